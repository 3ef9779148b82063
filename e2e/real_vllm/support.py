"""What the real-vLLM tests share besides their fixtures (those are in ``conftest.py``):
chat bodies with a fresh prefix, sending one and waiting until extproc records it, the
pods' own counters before and after, and their LoRA gauge's current labels."""

from __future__ import annotations

import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from e2e.real_vllm.pods import MODEL, VllmPod, metric_sum
from e2e.support import RECORDED, metric
from extproc.sim.launch import Stack
from testkit.waiting import wait_until

LORA_INFO = "vllm:lora_requests_info"
COUNTERS = ("vllm:request_success_total", "vllm:prefix_cache_hits_total")


def long_prefix() -> str:
    """A system prompt no other test sends: about 250 Qwen tokens, 7 blocks of 32."""
    return f"[{uuid.uuid4()}] " + "You are a meticulous assistant for the routing team. " * 24


def snapshot(pods: list[VllmPod]) -> list[dict[str, float]]:
    return [{name: metric_sum(p.metrics_text(), name) for name in COUNTERS} for p in pods]


def delta(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> list[float]:
    return [a[name] - b[name] for a, b in zip(after, before, strict=True)]


def chat(prefix: str, question: str, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True, **extra}


def send_recorded(stack: Stack, client: httpx.Client, body: dict[str, object]) -> httpx.Response:
    before = metric(stack, *RECORDED)
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    wait_until(lambda: metric(stack, *RECORDED) > before, what="the success was not recorded")
    return resp


def lora_info(page: str) -> dict[str, str] | None:
    """The labels of the newest ``vllm:lora_requests_info`` series on a pod's page.

    vLLM sets a series of that gauge to the current time at each stats update, labelled
    with the adapters it tracks, and keeps every label set it ever wrote: the newest is
    the one with the greatest value. ``None`` before any request for an adapter.
    """
    samples = [
        sample
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == LORA_INFO
    ]
    return dict(max(samples, key=lambda s: s.value).labels) if samples else None
