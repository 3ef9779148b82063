"""Through real Envoy, with the shipped default (estimated-ttft): a pick's prompt counts as
arriving at its pod at once, so a second request with the same new prefix follows it
before the first response ends; the credit goes when the request ends, however it ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from e2e.conftest import MODEL, RECORDED, metric, unique_prefix, wait_for
from extproc.sim.harness import SimPods
from extproc.sim.launch import Stack, run_stack

ARRIVING = ("extproc_estimated_ttft_arriving_requests", "")
FAILED = ("extproc_completions_total", 'outcome="failed"')


@pytest.fixture(scope="module")
def default_stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(sim.as_pods()) as running:  # no config: the embedded default
        yield running


def post(url: str, prompt: str, out: dict[str, httpx.Response], key: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    out[key] = httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_a_second_request_follows_the_first_before_it_ends(
    default_stack: Stack, sim: SimPods
) -> None:
    for pod in sim.pods:
        sim.set_faults(pod.name, delay_s=2.0)  # the first stays in flight for 2 s
    prefix = unique_prefix()
    recorded = metric(default_stack, *RECORDED)
    answers: dict[str, httpx.Response] = {}
    first = threading.Thread(target=post, args=(default_stack.url, prefix + "q1", answers, "1"))
    first.start()
    assert wait_for(lambda: metric(default_stack, *ARRIVING) >= 1, 10), "no credit at pick"
    post(default_stack.url, prefix + "q2", answers, "2")
    first.join(30)
    assert answers["1"].status_code == answers["2"].status_code == 200
    assert answers["1"].headers["x-sim-pod"] == answers["2"].headers["x-sim-pod"]
    assert wait_for(lambda: metric(default_stack, *ARRIVING) == 0, 10), "credit left behind"
    assert wait_for(lambda: metric(default_stack, *RECORDED) >= recorded + 2, 10)


def test_a_failed_request_leaves_no_credit_and_no_record(
    default_stack: Stack, sim: SimPods
) -> None:
    for pod in sim.pods:
        sim.set_faults(pod.name, error_rate=1.0, error_status=500)
    entries = metric(default_stack, "extproc_estimated_ttft_entries")
    failed = metric(default_stack, *FAILED)
    answers: dict[str, httpx.Response] = {}
    post(default_stack.url, unique_prefix() + "q", answers, "only")
    assert answers["only"].status_code >= 500
    assert wait_for(lambda: metric(default_stack, *FAILED) > failed, 10)
    assert metric(default_stack, *ARRIVING) == 0
    assert metric(default_stack, "extproc_estimated_ttft_entries") == entries
