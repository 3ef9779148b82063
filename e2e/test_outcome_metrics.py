"""Per-request outcome metrics fed by real Envoy's access-log entries: each pod's
histograms count the requests it served, streamed or not, and the prefix view's
predicted cached tokens count a prefix sent again to its pod."""

from __future__ import annotations

import collections

import httpx

from e2e.support import MODEL, metric, served_by, unique_prefix
from extproc.sim.launch import SimPods, Stack
from testkit.waiting import wait_until

API = "/v1/completions"
HISTOGRAMS = (
    "extproc_request_first_byte_seconds",
    "extproc_request_duration_seconds",
    "extproc_request_bytes",
    "extproc_response_bytes",
    "extproc_request_attempts",
)
COUNTERS = ("extproc_routed_prompt_tokens_total", "extproc_predicted_cached_tokens_total")
NUM_PREFIXES = 3  # each sent twice, plain then streamed


def series(stack: Stack, sim: SimPods) -> dict[tuple[str, str], float]:
    """(series name, pod name) -> value, for every pod; 0 where not made yet."""
    values = {}
    for pod in sim.pods:
        labels = f'model="{MODEL}",pod="default/{pod.name}"'
        for name in (*(f"{h}_{s}" for h in HISTOGRAMS for s in ("count", "sum")), *COUNTERS):
            values[name, pod.name] = metric(stack, name, labels, absent=0)
    return values


def test_each_pods_histograms_count_the_requests_it_served(
    stack: Stack, client: httpx.Client, sim: SimPods
) -> None:
    before = series(stack, sim)

    def grown() -> dict[tuple[str, str], float]:
        now = series(stack, sim)
        return {key: now[key] - before[key] for key in now}

    def wait_timed(num: int) -> None:
        """Until ``num`` requests' ends were timed (the last one is in the view)."""
        duration = f"{HISTOGRAMS[1]}_count"
        wait_until(
            lambda: sum(v for (n, _), v in grown().items() if n == duration) == num,
            what=f"{num} requests' ends timed",
        )

    served: collections.Counter[str] = collections.Counter()
    prompt = ""
    for i in range(NUM_PREFIXES):
        prompt = unique_prefix() + "question?"
        plain = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        served[served_by(client.post(API, json=plain))] += 1
        wait_timed(2 * i + 1)
        streamed = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
        reply = client.post(API, json=streamed)
        assert reply.text.rstrip().endswith("data: [DONE]")
        served[served_by(reply)] += 1
        wait_timed(2 * i + 2)
    delta = grown()
    for pod in sim.pods:
        num = served[pod.name]
        for histogram in HISTOGRAMS:
            assert delta[f"{histogram}_count", pod.name] == num, (histogram, pod.name)
        assert delta[f"{HISTOGRAMS[0]}_sum", pod.name] <= delta[f"{HISTOGRAMS[1]}_sum", pod.name]
        assert delta["extproc_request_attempts_sum", pod.name] == num  # no retry
        if num:
            assert delta["extproc_request_bytes_sum", pod.name] > 0
            assert delta["extproc_response_bytes_sum", pod.name] > 0
            assert delta["extproc_routed_prompt_tokens_total", pod.name] > 0
    # Each prompt's second request went to the pod that recorded its first, which holds it
    # all in the view: its whole estimate (bytes / 4) predicted cached there.
    predicted = sum(delta["extproc_predicted_cached_tokens_total", p.name] for p in sim.pods)
    assert predicted == NUM_PREFIXES * -(-len(prompt) // 4)
