"""A real Prometheus scrapes extproc and the simulated pods; every dashboard query has data.

Prometheus is Debian's package (``apt-get install prometheus``, as .ci/run does); a
missing binary fails the test. It scrapes every second, on 127.0.0.1, while a short
workload goes through Envoy: shared prefixes (hits), distinct ones (misses, and evictions
with a 32-entry cache per pod), requests extproc refuses (the error series), and a pod
that is down (scrape errors, retries). extproc runs the Helm chart's configuration: the
shipped default.

The precise row (its panels have data only with precise-prefix-cache on) has its own
run: extproc with the chart's values-precise.yaml (its ConfigMap and KV-events flags,
replay on) and a tokenizer of the tests' own making, each simulated pod with a scripted
KV-event publisher on its own port that loses, replays, restarts and garbles batches.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.support import MODEL, NUM_PODS, metric, unique_prefix
from extproc.datalayer.kv_events import EVENTS_PORT_LABEL
from extproc.pods import Pod, PodId
from extproc.request.parse import Api
from extproc.request.tokens import SegmentTokenizer
from extproc.scheduling.config import named_config_text
from extproc.sim import launch
from extproc.sim.kv_cache import BlockStored, hash_request_tokens
from extproc.sim.launch import Proc, SimPods, Stack, free_port, run_stack, spawn
from testkit.chart import PRECISE, find, render
from testkit.dashboard import FLOW_ROW, PRECISE_ROW, queries, require_binary
from testkit.factories import write_tokenizer
from testkit.kv_publisher import TOPIC, Publisher
from testkit.waiting import wait_until

SCRAPE_INTERVAL = "1s"
RATE_INTERVAL = "30s"  # the dashboard's $__rate_interval: the whole run fits in it
DATA_TIMEOUT_S = 20.0  # a series needs two scrapes after it first appears
NUM_PREFIXES = 8
NUM_ROUNDS = 4
ROUND_PAUSE_S = 1.5  # more than a scrape interval
NUM_TARGETS = 1 + NUM_PODS  # extproc and the pods

# The chart's ConfigMap with its default scheduler configuration (the shipped default,
# estimated-ttft, whose prefix view emits the series the prefix-cache panels read), with
# room for 32 blocks per pod: a prompt is about 20 blocks (1,200-byte prefix), so a pod's
# second prefix evicts (8 prefixes on 4 pods: some pod gets two).
MAX_HASH_CACHE_SIZE = 32


def chart_config() -> dict[str, Any]:
    configmap = find(render({}), "ConfigMap", "rel-extproc")
    config: dict[str, Any] = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["scheduler"] == yaml.safe_load(named_config_text("default"))["scheduler"]
    [view] = [p for p in config["scheduler"]["pluginConfig"] if p["name"] == "estimated-ttft"]
    view["args"]["maxHashCacheSize"] = MAX_HASH_CACHE_SIZE
    return config


@pytest.fixture
def picker(sim: SimPods, tmp_path: Path) -> Iterator[Stack]:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(chart_config()))
    # Nothing listens at the dead pod's address: extproc's scrapes of it fail (the scrape
    # error series) and a request sent there is retried on the next listed pod.
    dead = Pod(PodId("default", "dead"), f"127.0.0.1:{free_port()}", frozenset({MODEL}))
    with run_stack([*sim.as_pods(), dead], config=config) as stack:
        yield stack


@pytest.fixture
def prometheus(picker: Stack, sim: SimPods, tmp_path: Path) -> Iterator[str]:
    with scraping(picker, sim, tmp_path) as url:
        yield url


@contextmanager
def scraping(picker: Stack, sim: SimPods, tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping extproc and the pods every second; yields its URL."""
    binary = require_binary("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "extproc",
                "static_configs": [{"targets": [f"127.0.0.1:{picker.metrics_port}"]}],
            },
            {
                "job_name": "vllm",
                "static_configs": [{"targets": [f"127.0.0.1:{p.port}" for p in sim.pods]}],
            },
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    proc: Proc = spawn("prometheus", argv, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_until(
            lambda: _get(f"{url}/-/ready").startswith("Prometheus"), proc, "prometheus"
        )
        yield url
    finally:
        proc.stop()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def query(url: str, promql: str) -> list[dict[str, object]]:
    """An instant query's result vector (the API's ``data.result``)."""
    answer = json.loads(_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]  # type: ignore[no-any-return]


def has_data(result: list[dict[str, object]]) -> bool:
    """At least one sample that is a number (a ratio over no traffic is NaN)."""
    values = [sample["value"][1] for sample in result]  # type: ignore[index]
    return any(v not in ("NaN", "+Inf", "-Inf") for v in values)


def run_workload(stack: Stack) -> None:
    """Rounds of one request per prefix (the first round misses, later ones hit), and two
    refused requests, with pauses: rate() only sees increases between two scrapes."""
    prefixes = [unique_prefix() for _ in range(NUM_PREFIXES)]
    with httpx.Client(base_url=stack.url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        for round_idx in range(NUM_ROUNDS):
            bodies = [
                {"model": MODEL, "prompt": f"{prefix}question {round_idx}", "max_tokens": 4}
                for prefix in prefixes
            ]
            replies = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
            assert {r.status_code for r in replies} == {200}
            unknown_model = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            not_json = client.post("/v1/completions", content=b"{not json")
            assert (unknown_model.status_code, not_json.status_code) == (404, 400)
            time.sleep(ROUND_PAUSE_S)


def wait_for_first_scrapes(url: str) -> None:
    """Until every target was scraped once, so the workload's increases are all seen."""
    wait_until(
        lambda: len(query(url, "up == 1")) == NUM_TARGETS,
        DATA_TIMEOUT_S,
        interval_s=0.2,
        what=f"Prometheus scraping all {NUM_TARGETS} targets",
    )


def wait_for_data(url: str, pending: dict[str, str]) -> None:
    """Until every query of ``pending`` (title -> PromQL) returns a number."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        pending = {k: q for k, q in pending.items() if not has_data(query(url, q))}
        time.sleep(0.5)
    assert not pending, f"no data after {DATA_TIMEOUT_S} s for: {json.dumps(pending, indent=2)}"


def test_every_dashboard_query_returns_data(picker: Stack, prometheus: str) -> None:
    # One request first, so the model's series exist before Prometheus's first scrape
    # and rate() sees every request of the workload.
    with httpx.Client(base_url=picker.url, timeout=30) as client:
        warm = {"model": MODEL, "prompt": unique_prefix(), "max_tokens": 1}
        assert client.post("/v1/completions", json=warm).status_code == 200
    wait_for_first_scrapes(prometheus)
    run_workload(picker)
    wait_for_data(prometheus, queries(RATE_INTERVAL, except_rows=[PRECISE_ROW, FLOW_ROW]))
    # The panel's figure is extproc's own: the share of routed requests that matched.
    # The first round and the warm-up miss (fresh prefixes); a later round misses only
    # where the 32-entry cache evicted the prefix's first blocks.
    page = picker.metrics_text()
    matched = f'kthena_router_prefix_cache_match_ratio_bucket{{le="0.0",model="{MODEL}"}}'
    count = f'kthena_router_prefix_cache_match_ratio_count{{model="{MODEL}"}}'
    samples = dict(line.rsplit(" ", 1) for line in page.splitlines() if line.startswith("kthena"))
    routed, missed = float(samples[count]), float(samples[matched])
    assert routed == 1 + NUM_PREFIXES * NUM_ROUNDS
    assert missed >= 1 + NUM_PREFIXES
    expected = (routed - missed) / routed
    hit_rate = query(prometheus, queries(RATE_INTERVAL)["Prefix cache hit rate/A"])
    got = float(hit_rate[0]["value"][1])  # type: ignore[index]
    assert got == pytest.approx(expected, abs=0.05), (got, routed, missed)
    assert 0.0 < got <= (NUM_ROUNDS - 1) / NUM_ROUNDS + 0.05  # hits only from round 2 on


# The precise row ---------------------------------------------------------------------

BS = 4  # the publishers' block size: the plugin keys a pod's blocks by the size its events tell
SYSTEM = "hello world " * 8


def chat(question: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip


def stored(tokens: list[int]) -> BlockStored:
    hashes = tuple(hash_request_tokens(tokens, BS))
    return BlockStored(hashes, None, tuple(tokens[: len(hashes) * BS]), BS, (None,) * len(hashes))


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    """One per pod; the first runs the replay ROUTER every pod's replay port reaches (all
    pods are on 127.0.0.1), holding only its own batches."""
    pubs = [Publisher(replay=i == 0) for i in range(NUM_PODS)]
    try:
        yield pubs
    finally:
        for pub in pubs:
            pub.close()


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return write_tokenizer(tmp_path / "tokenizer")


@pytest.fixture
def precise_picker(
    sim: SimPods, publishers: list[Publisher], tokenizer_dir: Path, tmp_path: Path
) -> Iterator[Stack]:
    """extproc as the chart runs it with values-precise.yaml (replay port on), the models
    map pointing at ``tokenizer_dir``, each pod labelled with its publisher's port."""
    kv_events = {**PRECISE["kvEvents"], "replayPort": publishers[0].replay_port}
    docs = render({**PRECISE, "kvEvents": kv_events})
    config = yaml.safe_load(find(docs, "ConfigMap", "rel-extproc")["data"]["config.yaml"])
    [precise] = [
        p for p in config["scheduler"]["pluginConfig"] if p["name"] == "precise-prefix-cache"
    ]
    precise["args"]["models"] = {MODEL: str(tokenizer_dir)}
    config_path = tmp_path / "precise.yaml"
    config_path.write_text(yaml.safe_dump(config))
    [container] = find(docs, "Deployment", "rel-extproc")["spec"]["template"]["spec"]["containers"]
    kv_args = [a for a in container["args"] if a.startswith("--kv-events")]
    pods = [
        replace(pod, labels=((EVENTS_PORT_LABEL, str(pub.port)),))
        for pod, pub in zip(sim.as_pods(), publishers, strict=True)
    ]
    with run_stack(pods, config=config_path, extproc_args=kv_args) as stack:
        yield stack


def batches(stack: Stack, pod: str) -> float:
    return metric(
        stack, "extproc_kv_events_batches_received_total", f'pod="default/{pod}"', absent=0
    )


def join(stack: Stack, sim: SimPods, publishers: list[Publisher]) -> None:
    """ZMQ's slow joiner: each publisher sends batch 0 until extproc has one."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    for pod, pub in zip(sim.pods, publishers, strict=True):
        while not batches(stack, pod.name):
            assert time.monotonic() < deadline, f"extproc never subscribed to {pod.name}"
            pub.seq = 0
            pub.sent.clear()
            pub.publish(stored([5] * BS))
            time.sleep(0.1)


def lose_replay_restart_garble(
    stack: Stack, sim: SimPods, publishers: list[Publisher], tokens: list[int]
) -> None:
    """pod 0 loses a batch its ROUTER replays; pod 1 loses one past what that ROUTER holds
    (a failed replay: stale); pod 2 restarts and stores the workload's prompt; pod 3
    sends a message of two frames."""

    def replays(outcome: str) -> float:
        labels = f'outcome="{outcome}",pod="default/{sim.pods[0 if outcome == "ok" else 1].name}"'
        return metric(stack, "extproc_kv_events_replays_total", labels, absent=0)

    p0, p1, p2, p3 = publishers
    p0.publish(stored([1] * 2 * BS))
    p0.publish(stored([2] * 2 * BS), lose=True)
    p0.publish(stored([3] * 2 * BS))
    wait_until(lambda: replays("ok") == 1, timeout_s=DATA_TIMEOUT_S, interval_s=0.1)
    for _ in range(5):  # past p0's last batch, so p0's ROUTER has nothing to replay
        p1.publish(stored([1] * BS))
    p1.publish(stored([2] * BS), lose=True)
    p1.publish(stored([3] * BS))
    wait_until(lambda: replays("failed") == 1, timeout_s=DATA_TIMEOUT_S, interval_s=0.1)
    p2.publish(stored([1] * BS))
    p2.seq = 0  # a restarted engine
    p2.publish(stored(tokens))
    p3.pub.send_multipart([TOPIC, b"\0" * 8])
    wait_until(
        lambda: metric(stack, "extproc_kv_events_errors_total", 'reason="frames"', absent=0) == 1,
        timeout_s=DATA_TIMEOUT_S,
        interval_s=0.1,
    )


def test_every_precise_dashboard_query_returns_data(
    precise_picker: Stack,
    sim: SimPods,
    publishers: list[Publisher],
    tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    with scraping(precise_picker, sim, tmp_path) as url:
        join(precise_picker, sim, publishers)
        with httpx.Client(base_url=precise_picker.url, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=chat("warm")).status_code == 200
            wait_for_first_scrapes(url)
            first = chat("hello")
            tokens = SegmentTokenizer(tokenizer_dir).request_tokens(Api.CHAT_COMPLETIONS, first)
            lose_replay_restart_garble(precise_picker, sim, publishers, tokens)
            for round_idx in range(NUM_ROUNDS):
                for body in (first, chat(f"question {round_idx}")):
                    assert client.post("/v1/chat/completions", json=body).status_code == 200
                # the responses API is not tokenized exactly: the approximate view scores it
                responses = {"model": MODEL, "input": "hello", "max_output_tokens": 4}
                assert client.post("/v1/responses", json=responses).status_code == 200
                time.sleep(ROUND_PAUSE_S)
        wait_for_data(url, queries(RATE_INTERVAL, rows=[PRECISE_ROW]))
        # pod 2 holds the prompt's blocks, as its events said: its requests matched
        ratio = "extproc_precise_prefix_cache_match_ratio"
        label = f'model="{MODEL}"'
        missed = metric(precise_picker, f"{ratio}_bucket", f'le="0.0",{label}')
        assert metric(precise_picker, f"{ratio}_count", label) > missed
