"""The pods a routing benchmark runs on: simulated (many, one process) or real vLLM (3).

Both give the extproc ``Pod`` list, their URLs, the counters read from each pod's own
``/metrics`` (``vllm:prefix_cache_hits_total``, ``..._queries_total``,
``vllm:request_success_total``), a way to empty every prefix cache between contenders so
each starts cold, and what a precise-prefix-cache router needs: the ``extproc serve``
flags that receive the pods' KV events, the tokenizer directory and the block size.

Simulated pods run the pseudo-tokenizer and publish no KV events, unless started for
precise-prefix-cache (``precise``): then they tokenize with the real Qwen3 tokenizer of
the vLLM pods' model (``sim-pods --tokenizer``, from ``python -m e2e.real_vllm.prepare``)
and publish their KV events on a port each (extproc connects). vLLM pods publish to an
endpoint each (extproc binds them).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from e2e.real_vllm.pods import BLOCK_SIZE as VLLM_BLOCK_SIZE
from e2e.real_vllm.pods import MODEL as VLLM_MODEL
from e2e.real_vllm.pods import VllmPod, metric_sum, start_vllm_pods
from extproc.pods import Pod
from extproc.sim.launch import spawn_sim_pods
from testkit.e2e_cache import model_dir
from testkit.kv_events import wait_events_trusted

SIM_MODEL = "sim-llm"
SIM_BLOCK_SIZE = 16  # tokens, the simulated engine's default
COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "served": "vllm:request_success_total",
    "adapter_loads": "sim:lora_loads_total",  # the simulated pods' own (0 elsewhere)
}
RESET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PodSet:
    kind: str  # "sim" or "vllm"
    model: str
    pods: list[Pod]
    urls: list[str]
    reset_cache: Callable[[int], None]  # by pod index; raises while the pod is busy
    events_args: list[str]  # ``extproc serve`` flags to receive the pods' KV events
    flush_events: Callable[[int], None]  # make pod i publish a batch that clears its view
    tokenizer_dir: Path | None  # the pods' real tokenizer; None: they publish no events
    block_size: int

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

    def wait_events_trusted(self, metrics: Sequence[Callable[[], str]]) -> None:
        """Until every extproc (``/metrics`` pages) trusts its view of every pod."""
        wait_events_trusted(self.pods, self.flush_events, metrics)


@contextmanager
def sim_pod_set(
    num_pods: int, engine_args: Sequence[str], log_dir: Path, precise: bool = False
) -> Iterator[PodSet]:
    """Simulated pods; ``precise``: with the Qwen3 tokenizer and KV events (module doc)."""
    args = ["--model", SIM_MODEL, *engine_args]
    tokenizer: Path | None = None
    if precise:
        tokenizer = model_dir()
        if not (tokenizer / "tokenizer.json").exists():
            raise FileNotFoundError("run `python -m e2e.real_vllm.prepare` first (the tokenizer)")
        args += ["--tokenizer", str(tokenizer), "--kv-events-endpoint", "tcp://127.0.0.1:*"]
    with (
        open(log_dir / "sim-pods.log", "wb") as log,
        spawn_sim_pods(num_pods, args=args, stderr=log) as sim,
    ):
        yield PodSet(
            "sim", SIM_MODEL, sim.as_pods(), sim.urls, sim.reset_cache,
            ["--kv-events-topology", "connect"] if precise else [], sim.reset_cache, tokenizer,
            SIM_BLOCK_SIZE,
        )  # fmt: skip


def _flush_vllm(pod: VllmPod) -> None:
    """vLLM sends a reset's ``AllBlocksCleared`` with its next step's events: one new
    tiny request (a new prompt: a cached one would store nothing)."""
    pod.reset_prefix_cache()
    body = {"model": VLLM_MODEL, "prompt": f"flush {uuid.uuid4()}", "max_tokens": 1}
    req = urllib.request.Request(
        pod.url + "/v1/completions", orjson.dumps(body), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60):
        pass


@contextmanager
def vllm_pod_set(num_pods: int, log_dir: Path, cpu_quota: float | None = None) -> Iterator[PodSet]:
    """Real vLLM pods; with ``cpu_quota`` each held to that many cores, and how often the
    cap held each back is printed when they stop."""
    with start_vllm_pods(num_pods, log_dir, cpu_quota=cpu_quota) as pods:
        events = ["--kv-events-topology", "bind"]
        for p in pods:
            events += ["--kv-events-bind", p.kv_events_endpoint]
        yield PodSet(
            "vllm", VLLM_MODEL, [p.as_pod() for p in pods], [p.url for p in pods],
            lambda i: pods[i].reset_prefix_cache(), events, lambda i: _flush_vllm(pods[i]),
            model_dir(), VLLM_BLOCK_SIZE,
        )  # fmt: skip
        for p in pods:
            if p.cpu_group is not None:
                periods, throttled = p.cpu_group.throttled()
                print(f"[vllm] {p.name}: throttled in {throttled} of {periods} periods of "
                      f"its CPU quota ({p.cpu_group.cores} cores)", flush=True)  # fmt: skip
