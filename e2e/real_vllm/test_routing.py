"""Real vLLM pods behind Envoy and extproc: prefix affinity seen by the engines, streaming,
extproc's counters against the pods' own, and its scraper's reading of their pages.

Which pod served a request is read from the pods' ``vllm:request_success_total``
(requests are sent one at a time), and the cache reuse from their
``vllm:prefix_cache_hits_total`` and the responses' ``prompt_tokens_details``.
"""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from e2e.real_vllm.pods import MODEL, VllmPod, metric_sum
from e2e.real_vllm.support import chat, delta, long_prefix, send_recorded, snapshot
from e2e.support import RECORDED, metric
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.store import PodStore
from extproc.sim.launch import Stack
from testkit.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(900)]


def test_shared_prefix_lands_on_one_pod_whose_cache_hits_rise(
    vllm_stack: Stack, vllm_pods: list[VllmPod], client: httpx.Client
) -> None:
    prefix = long_prefix()
    before = snapshot(vllm_pods)
    send_recorded(vllm_stack, client, chat(prefix, "first question?"))
    first = delta(before, snapshot(vllm_pods), "vllm:request_success_total")
    owner = first.index(1.0)
    assert sorted(first) == [0.0, 0.0, 1.0]
    cached = []
    for i in range(4):
        resp = send_recorded(vllm_stack, client, chat(prefix, f"question {i}?"))
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = snapshot(vllm_pods)
    served = delta(before, after, "vllm:request_success_total")
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    assert served[owner] == 5 and sum(served) == 5
    assert hits[owner] >= 4 * 7 * 32  # every later request reused the 7 prefix blocks
    assert [h for i, h in enumerate(hits) if i != owner] == [0.0, 0.0]
    assert all(c >= 7 * 32 for c in cached), cached


def test_streamed_chat_through_envoy_keeps_affinity_and_is_recorded(
    vllm_stack: Stack, vllm_pods: list[VllmPod], client: httpx.Client
) -> None:
    prefix = long_prefix()
    send_recorded(vllm_stack, client, chat(prefix, "warm up"))
    before = snapshot(vllm_pods)
    recorded = metric(vllm_stack, *RECORDED)
    body = chat(prefix, "stream please", stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    wait_until(lambda: metric(vllm_stack, *RECORDED) == recorded + 1)
    hits = delta(before, snapshot(vllm_pods), "vllm:prefix_cache_hits_total")
    assert sorted(h > 0 for h in hits) == [False, False, True]


def test_extprocs_counters_match_what_the_pods_served(
    vllm_stack: Stack, vllm_pods: list[VllmPod], client: httpx.Client
) -> None:
    assert metric(vllm_stack, "extproc_pods_known") == len(vllm_pods)
    assert metric(vllm_stack, "extproc_pods_ready") == len(vllm_pods)
    routed = metric(vllm_stack, "extproc_route_decisions_total", f'model="{MODEL}"')
    recorded = metric(vllm_stack, *RECORDED)
    before = snapshot(vllm_pods)
    for i in range(6):
        send_recorded(vllm_stack, client, chat(long_prefix(), f"distinct {i}"))
    served = sum(delta(before, snapshot(vllm_pods), "vllm:request_success_total"))
    assert served == 6
    assert metric(vllm_stack, "extproc_route_decisions_total", f'model="{MODEL}"') == routed + 6
    assert metric(vllm_stack, *RECORDED) == recorded + 6


def test_extprocs_scraped_metrics_match_the_pods(vllm_pods: list[VllmPod]) -> None:
    """extproc's scraper (the classes ``extproc serve`` runs) reads what each pod's page says,
    with a request running on one pod so the values are not all zero."""
    store = PodStore(lambda _: None, stale_after_s=None)
    store.set_pods([p.as_pod() for p in vllm_pods])
    scraper = MetricsScraper(store, interval_s=0.1, registry=CollectorRegistry())
    busy = vllm_pods[0]
    body = {"model": MODEL, "prompt": long_prefix(), "max_tokens": 200, "ignore_eos": True}
    worker = threading.Thread(target=httpx.post, args=(busy.url + "/v1/completions",),
                              kwargs={"json": body, "timeout": 60})  # fmt: skip
    scraper.start()
    worker.start()
    try:

        def scraped_running(i: int) -> float | None:
            m = store.pods[i].metrics
            return None if m is None else m.running

        wait_until(lambda: scraped_running(0) == 1, 20, what="the running request was not seen")
        page = busy.metrics_text()
        assert metric_sum(page, "vllm:num_requests_running") == 1
        metrics = store.pods[0].metrics
        assert metrics is not None and metrics.kv_usage > 0
        assert metrics.kv_usage == pytest.approx(
            metric_sum(page, "vllm:kv_cache_usage_perc"), rel=0.5
        )
        assert metrics.waiting == metric_sum(page, "vllm:num_requests_waiting")
    finally:
        worker.join(60)
        scraper.stop()
    for pod, vp in zip(store.pods, vllm_pods, strict=True):
        page = vp.metrics_text()
        assert pod.ready and pod.metrics is not None
        assert pod.metrics.waiting == metric_sum(page, "vllm:num_requests_waiting")
