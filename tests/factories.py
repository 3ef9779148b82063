"""Small builders shared by the tests (like vLLM's ``make_request``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.request.parse import Api, InferenceRequest
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.types import Cycle
from extproc.types import Pod, PodId, PodMetrics


def make_pod(
    name: str,
    *,
    model: str = "m",
    ready: bool = True,
    port: int = 8000,
    namespace: str = "default",
    metrics: PodMetrics | None = None,
) -> Pod:
    return Pod(
        id=PodId(namespace, name),
        address=f"127.0.0.1:{port}",
        models=frozenset({model}),
        ready=ready,
        metrics=metrics or PodMetrics(),
    )


def make_cycle(prompt: str, *, model: str = "m", salt: str | None = None) -> Cycle:
    return Cycle(InferenceRequest(Api.COMPLETIONS, model, prompt, cache_salt=salt))


def make_scheduler(yaml_text: str, registry: CollectorRegistry | None = None) -> Scheduler:
    return build_scheduler(parse_config(yaml_text, "test.yaml"), registry or CollectorRegistry())


PREFIX_ONLY = """
scheduler:
  plugins:
    Score:
      enabled:
        - name: prefix-cache
          weight: 1
"""
