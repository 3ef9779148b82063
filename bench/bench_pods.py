"""The pods a routing benchmark runs on: simulated (many, one process) or real vLLM (3).

Both give the extproc ``Pod`` list, their URLs, the counters read from each pod's own
``/metrics`` (``vllm:prefix_cache_hits_total``, ``..._queries_total``,
``vllm:request_success_total``), and a way to empty every prefix cache between
contenders so each starts cold.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from e2e.real_vllm.pods import MODEL as VLLM_MODEL
from e2e.real_vllm.pods import metric_sum, start_vllm_pods
from extproc.sim.harness import spawn_sim_pods
from extproc.types import Pod, PodId

SIM_MODEL = "sim-llm"
COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "served": "vllm:request_success_total",
}
RESET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PodSet:
    kind: str  # "sim" or "vllm"
    model: str
    urls: list[str]
    reset_cache: Callable[[int], None]  # by pod index; raises while the pod is busy

    @property
    def pods(self) -> list[Pod]:
        return [
            Pod(PodId("default", f"{self.kind}-{i}"), url.removeprefix("http://"),
                frozenset({self.model}))
            for i, url in enumerate(self.urls)
        ]  # fmt: skip

    def counters(self) -> list[dict[str, float]]:
        out = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            out.append({k: metric_sum(text, name) for k, name in COUNTERS.items()})
        return out

    def reset_all(self) -> None:
        """Empty every pod's prefix cache, retrying while a pod still finishes requests."""
        for i in range(len(self.urls)):
            deadline = time.monotonic() + RESET_TIMEOUT_S
            while True:
                try:
                    self.reset_cache(i)
                    break
                except urllib.error.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)


@contextmanager
def sim_pod_set(num_pods: int, engine_args: Sequence[str], log_dir: Path) -> Iterator[PodSet]:
    with (
        open(log_dir / "sim-pods.log", "wb") as log,
        spawn_sim_pods(num_pods, args=["--model", SIM_MODEL, *engine_args], stderr=log) as sim,
    ):
        yield PodSet("sim", SIM_MODEL, sim.urls, lambda i: sim.reset_cache(i))


@contextmanager
def vllm_pod_set(num_pods: int, log_dir: Path) -> Iterator[PodSet]:
    with start_vllm_pods(num_pods, log_dir) as pods:
        yield PodSet(
            "vllm", VLLM_MODEL, [p.url for p in pods], lambda i: pods[i].reset_prefix_cache()
        )
