"""Injected faults, set by the admin port: errors, refused connections, cut streams, delay."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from extproc.sim.engine import EngineConfig
from extproc.sim.launch import SimPods
from extproc.sim.pods import GroupSettings
from testkit.factories import FAST_ENGINE, constant_step
from testkit.harness import run_sim_pods
from testkit.waiting import wait_until

BODY = {"prompt": "fault " * 20, "max_tokens": 4}


@pytest.fixture
def pods() -> Iterator[SimPods]:
    with run_sim_pods(GroupSettings(num_pods=2, engine=FAST_ENGINE)) as group:
        yield group


def post(pods: SimPods, pod: int = 0) -> httpx.Response:
    return httpx.post(pods.pods[pod].url + "/v1/completions", json=BODY, timeout=10)


@pytest.mark.parametrize("status", [500, 503])
def test_error_rate_one_fails_every_request_with_a_vllm_error(pods: SimPods, status: int) -> None:
    assert pods.set_faults(0, error_rate=1.0, error_status=status)["error_rate"] == 1.0
    for _ in range(3):
        resp = post(pods)
        assert resp.status_code == status
        assert resp.headers["x-sim-pod"] == "sim-0"
        assert resp.json()["error"]["code"] == status
    assert post(pods, 1).status_code == 200  # faults are per pod
    stats = pods.stats(0)
    assert stats["num_injected_errors"] == 3
    assert stats["engine"]["prefix_cache_queries"] == 0  # failed requests reach no engine


def test_error_rate_half_fails_every_second_request_from_the_first(pods: SimPods) -> None:
    pods.set_faults(0, error_rate=0.5)
    assert [post(pods).status_code for _ in range(6)] == [500, 200] * 3


def test_clearing_faults_restores_service(pods: SimPods) -> None:
    pods.set_faults(0, error_rate=1.0, delay_s=0.01)
    assert pods.clear_faults(0) == pods.faults(1)
    assert post(pods).status_code == 200


def test_refused_connections_and_reopening_on_the_same_port(pods: SimPods) -> None:
    with httpx.Client() as keep_alive:
        assert keep_alive.post(pods.pods[0].url + "/v1/completions", json=BODY).status_code == 200
        pods.set_faults(0, refuse_connections=True)
        with pytest.raises(httpx.TransportError):
            keep_alive.post(pods.pods[0].url + "/v1/completions", json=BODY)  # pooled conn dropped
    with pytest.raises(httpx.ConnectError):
        post(pods)
    assert pods.stats(0)["listening"] is False
    pods.set_faults(0, refuse_connections=False)
    assert post(pods).status_code == 200
    assert pods.stats(0)["listening"] is True


def test_stream_dies_after_k_chunks_without_its_end(pods: SimPods) -> None:
    pods.set_faults(1, die_mid_stream_after_chunks=3)
    received: list[str] = []
    body = {**BODY, "stream": True, "max_tokens": 10}
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", pods.pods[1].url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        received.extend(line for line in resp.iter_lines() if line)
    assert len(received) == 3
    assert all(line.startswith("data: {") for line in received)
    stats = pods.stats(1)
    assert stats["num_cut_streams"] == 1
    assert stats["num_served"] == 0
    assert stats["engine"]["num_running"] == 0  # the engine request was aborted
    plain = post(pods, 1)  # plain answers are not cut
    assert plain.status_code == 200


def test_delay_holds_each_request(pods: SimPods) -> None:
    pods.set_faults(0, delay_s=0.2)
    start = time.monotonic()
    assert post(pods).status_code == 200
    assert time.monotonic() - start >= 0.2


@pytest.mark.parametrize(
    "faults",
    [{"error_rat": 1}, {"error_rate": 2}, {"error_status": 200}, {"delay_s": "1"},
     {"refuse_connections": 1}, {"die_mid_stream_after_chunks": -1},
     {"metrics": "down"}, {"metrics": 1}],
)  # fmt: skip
def test_bad_faults_are_refused_and_change_nothing(
    pods: SimPods, faults: dict[str, object]
) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        pods.set_faults(0, **faults)
    assert err.value.code == 400
    err.value.close()
    assert pods.faults(0) == pods.faults(1)


@pytest.mark.parametrize(("mode", "status"), [("error", 500), ("garbage", 200)])
def test_metrics_endpoint_down_or_garbage_while_the_pod_serves(
    pods: SimPods, mode: str, status: int
) -> None:
    pods.set_faults(0, metrics=mode)
    page = httpx.get(pods.pods[0].url + "/metrics", timeout=5)
    assert page.status_code == status and b"vllm:num_requests_running" not in page.content
    assert post(pods).status_code == 200
    pods.clear_faults(0)
    assert b"vllm:num_requests_running" in httpx.get(pods.pods[0].url + "/metrics").content


def test_admin_routes_on_the_pod_port_too(pods: SimPods) -> None:
    url = pods.pods[0].url + "/admin/faults"
    assert httpx.post(url, json={"delay_s": 0.01}).json()["delay_s"] == 0.01
    assert httpx.get(url).json()["delay_s"] == 0.01
    assert httpx.delete(url).json()["delay_s"] == 0.0
    assert httpx.get(pods.admin_url + "/pods/nope/stats").status_code == 404


def test_stats_and_cache_reset_make_a_pod_that_comes_back_empty(pods: SimPods) -> None:
    headers = {"x-request-id": "req-42"}
    url = pods.pods[0].url + "/v1/completions"
    for _ in range(2):
        assert httpx.post(url, json=BODY, headers=headers).status_code == 200
    stats = pods.stats(0)
    assert stats["num_served"] == 2
    assert stats["cached_tokens_total"] == 16
    assert [r["cached_tokens"] for r in stats["recent"]] == [0, 16]
    assert stats["recent"][0]["x_request_id"] == "req-42"
    pods.reset_cache(0)
    assert pods.stats(0)["engine"]["num_cached_blocks"] == 0
    assert post(pods).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_refusing_through_the_pods_own_port_still_answers(pods: SimPods) -> None:
    resp = httpx.post(pods.pods[0].url + "/admin/faults", json={"refuse_connections": True})
    assert resp.status_code == 200
    assert resp.json()["refuse_connections"] is True
    with pytest.raises(httpx.ConnectError):
        post(pods)
    pods.clear_faults(0)
    assert post(pods).status_code == 200


def test_a_full_queue_answers_503() -> None:
    # The running request lasts 4 s, so it is still running (and the second still
    # waiting) when the third arrives, even on a loaded machine.
    slow = EngineConfig(timing_profile=constant_step(0.5), max_num_seqs=1, max_num_waiting=1)
    with run_sim_pods(GroupSettings(num_pods=1, engine=slow)) as one:
        url = one.pods[0].url + "/v1/completions"
        body = {"prompt": "queue", "max_tokens": 8}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, url, json=body, timeout=30)
            wait_until(lambda: one.stats(0)["engine"]["num_running"] == 1)
            waiting = pool.submit(httpx.post, url, json=body, timeout=30)
            wait_until(lambda: one.stats(0)["engine"]["num_waiting"] == 1)
            refused = httpx.post(url, json=body)
            assert refused.status_code == 503
            assert "max_num_waiting" in refused.json()["error"]["message"]
            assert running.result().status_code == waiting.result().status_code == 200
