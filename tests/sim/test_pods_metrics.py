"""A pod's /metrics: vLLM's names, types, labels and buckets, moving with the traffic."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from extproc.datalayer.engine_metrics import SAMPLE_NAMES, PageParser, PodReader
from extproc.datalayer.scrape import FILTERED_PAGE
from extproc.sim.engine import EngineConfig
from extproc.sim.launch import SimPods
from extproc.sim.metrics import ITL_BUCKETS, TTFT_BUCKETS
from extproc.sim.pods import GroupSettings
from testkit.factories import constant_step
from testkit.harness import run_sim_pods
from testkit.waiting import wait_until

LABELS = {"model_name": "sim-llm", "engine": "0"}
EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


def scrape(pods: SimPods, pod: int = 0) -> dict[str, tuple[str, list[Sample]]]:
    resp = httpx.get(pods.pods[pod].url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    families = text_string_to_metric_families(resp.text)
    # prometheus-client adds a *_created gauge per histogram, as in vLLM's own output
    return {f.name: (f.type, f.samples) for f in families if not f.name.endswith("_created")}


def value(metrics: dict[str, tuple[str, list[Sample]]], sample_name: str) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    (sample,) = [s for s in metrics[family][1] if s.name == sample_name]
    return sample.value


def test_metrics_slash_honours_name_filters_as_vllm_does() -> None:
    """vLLM serves prometheus_client's app at /metrics/ (``name[]`` filters the samples)
    and a route of its own at /metrics (the parameter is ignored)."""
    with run_sim_pods(GroupSettings(num_pods=1, engine=EngineConfig(num_gpu_blocks=1000))) as pods:
        url = pods.pods[0].url
        filtered = httpx.get(url + FILTERED_PAGE).text
        ignored = httpx.get(url + FILTERED_PAGE.replace("/metrics/", "/metrics", 1)).text
        full = httpx.get(url + "/metrics").text
    names = {s.name for f in text_string_to_metric_families(filtered) for s in f.samples}
    assert names and names <= SAMPLE_NAMES
    assert {"vllm:num_requests_waiting", "vllm:cache_config_info"} <= names
    assert "_bucket" not in filtered and len(filtered) * 5 < len(full)
    assert "_bucket" in ignored


def test_names_types_labels_and_buckets_are_vllms() -> None:
    with run_sim_pods(GroupSettings(num_pods=1, engine=EngineConfig(num_gpu_blocks=1000))) as pods:
        metrics = scrape(pods)
        page = httpx.get(pods.pods[0].url + "/metrics").content
    assert {name: t for name, (t, _) in metrics.items()} == EXPECTED_TYPES
    for name, (_, samples) in metrics.items():
        if name != "vllm:cache_config_info":
            assert all(LABELS.items() <= s.labels.items() for s in samples), name
    (info,) = metrics["vllm:cache_config_info"][1]
    assert info.value == 1.0
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "1000"
    assert info.labels["engine"] == "0"
    read = PodReader(frozenset({"sim-llm"})).read(PageParser().samples(page), now_s=0.0)
    assert read is not None and read.kv_capacity_tokens == 1000 * 16  # as the scraper reads it
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
    ):
        les = [s.labels["le"] for s in metrics[name][1] if s.name.endswith("_bucket")]
        assert les == [str(b) for b in buckets] + ["+Inf"]
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    assert ITL_BUCKETS[:3] == (0.01, 0.025, 0.05) and ITL_BUCKETS[-1] == 80.0


def test_counters_and_histograms_move_with_requests(pods: SimPods) -> None:
    before = scrape(pods, 1)
    body = {"prompt": "metrics " * 40, "max_tokens": 4}
    for _ in range(2):
        assert httpx.post(pods.pods[1].url + "/v1/completions", json=body).status_code == 200
    after = scrape(pods, 1)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("vllm:prefix_cache_queries_total") == 2 * 80
    assert delta("vllm:prefix_cache_hits_total") == 64
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:request_success_total") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert value(after, "vllm:num_requests_running") == 0


def test_gauges_show_a_running_request() -> None:
    slow = EngineConfig(
        timing_profile=constant_step(0.05), num_gpu_blocks=101
    )  # 20 tokens take 1 s
    with run_sim_pods(GroupSettings(num_pods=1, engine=slow)) as pods:
        body = {"prompt": "x" * 400, "max_tokens": 10}
        thread = threading.Thread(
            target=httpx.post, args=(pods.pods[0].url + "/v1/completions",), kwargs={"json": body}
        )
        thread.start()
        wait_until(lambda: value(scrape(pods), "vllm:num_requests_running") != 0)
        metrics = scrape(pods)
        usage = value(metrics, "vllm:kv_cache_usage_perc")
        assert usage == pytest.approx(0.07)  # 100 prompt tokens in 7 of 100 usable blocks
        assert value(metrics, "vllm:num_requests_waiting") == 0
        thread.join(5)
