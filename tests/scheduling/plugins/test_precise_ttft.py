"""estimated-ttft with precise-prefix-cache (``extproc/data/precise.yaml``): the cost
model's prefix comes from the pods' KV events wherever precise-prefix-cache knows it,
from estimated-ttft's own view exactly where precise-prefix-cache falls back (a request
it cannot tokenize, a pod whose view is stale), and a pick counts as cached on its pod
from the pick until the request ends (provisional credit), events or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import Pod
from extproc.request.parse import parse_request
from extproc.request.tokens import TokenIds
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import BYTES_PER_TOKEN, Cycle
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import make_pod
from tests.scheduling.plugins.support import BS, store

pytestmark = needs_model_tokenizer
PODS = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]
SYSTEM = "You answer questions about the routing of requests to model servers. " * 80
CHAT = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which pod holds my prompt?"}]}  # fmt: skip
# Continues a stored response, which only the engine has: not tokenized exactly.
UNTOKENIZABLE = {"model": "m", "input": SYSTEM + "Which pod holds my prompt?",
                 "previous_response_id": "resp_1"}  # fmt: skip
TOKEN_IDS = {"model": "m", "prompt": list(range(1000, 1000 + 4 * BS))}  # 4 whole blocks


def precise_router() -> Router:
    """A router on the shipped precise.yaml, its model map naming the test tokenizer."""
    text = Path("extproc/data/precise.yaml").read_text()
    text = text.replace("qwen3-tiny: /models/qwen3-tiny", f"m: {MODEL_DIR}")
    in_flight = InFlight()
    scheduler = build_scheduler(parse_config(text, "precise.yaml"), CollectorRegistry(), in_flight)
    return Router(scheduler, PODS, in_flight=in_flight, registry=CollectorRegistry())


def plugins(router: Router) -> tuple[EstimatedTTFT, PrecisePrefixCache]:
    ttft, precise, _lora_affinity = (ws.scorer for ws in router.scheduler.scorers)
    assert isinstance(ttft, EstimatedTTFT) and isinstance(precise, PrecisePrefixCache)
    return ttft, precise


def make_cycle(body: dict[str, Any]) -> Cycle:
    path = {"input": "/v1/responses", "prompt": "/v1/completions"}.get(
        next(k for k in ("input", "prompt", "messages") if k in body), "/v1/chat/completions"
    )
    return Cycle(parse_request(path, orjson.dumps(body)))


def uncached(router: Router, body: dict[str, Any]) -> list[int]:
    """What the cost model takes each pod to prefill for ``body``, as it schedules it."""
    cycle = make_cycle(body)
    router.scheduler.schedule_request(cycle, PODS)
    return [cycle.num_prefill_tokens(p.id) for p in PODS]


def tokens_of(router: Router, body: dict[str, Any]) -> TokenIds:
    tokens = plugins(router)[1].prompt_tokens(make_cycle(body))
    assert tokens is not None
    return tokens


# Expected per pod: ("exact", blocks) = the prompt's tokens less those whole blocks, the
# last token never cached; "own" = estimated-ttft's own view, which recorded the whole
# prompt there (so nothing to prefill); "cold" = the whole prompt. Prompt tokens are exact
# for a request precise-prefix-cache tokenizes, else estimated from bytes.
@pytest.mark.parametrize(
    ("body", "events", "recorded", "stale", "expected"),
    [
        pytest.param(CHAT, {}, None, set(), ["cold"] * 3, id="nothing-anywhere"),
        pytest.param(CHAT, {1: 3}, None, set(), ["cold", ("exact", 3), "cold"], id="events"),
        pytest.param(
            CHAT, {1: 3}, 0, set(), ["cold", ("exact", 3), "cold"],
            id="events-overrule-the-own-view",
        ),
        pytest.param(
            CHAT, {1: 999}, None, set(), ["cold", ("exact", 999), "cold"],
            id="whole-prompt-held",
        ),
        pytest.param(
            TOKEN_IDS, {1: 4}, None, set(), ["cold", ("exact", 3), "cold"],
            id="whole-blocks-held-leave-the-last-token",
        ),
        pytest.param(
            CHAT, {1: 3}, 0, {0}, ["own", ("exact", 3), "cold"], id="stale-pod-uses-own-view",
        ),
        pytest.param(
            CHAT, {2: 3}, None, {2}, ["cold"] * 3, id="stale-pod-events-are-not-trusted",
        ),
        pytest.param(
            UNTOKENIZABLE, {1: 3}, 0, set(), ["own", "cold", "cold"],
            id="untokenizable-request-uses-own-view",
        ),
    ],
)  # fmt: skip
def test_the_cost_model_reads_exact_counts_and_falls_back_where_precise_does(
    body: dict[str, Any],
    events: dict[int, int],
    recorded: int | None,
    stale: set[int],
    expected: list[str | tuple[str, int]],
) -> None:
    router = precise_router()
    ttft, precise = plugins(router)
    exact = body is not UNTOKENIZABLE
    tokens = tokens_of(router, body if exact else CHAT)
    for pod, blocks in events.items():
        store(precise, PODS[pod], tokens[: blocks * BS])
    if recorded is not None:
        ttft.record(make_cycle(body), PODS[recorded].id)
    for pod in stale:
        precise.index.mark_stale(PODS[pod].id)
    num_tokens = len(tokens) if exact else -(-make_cycle(body).num_prompt_bytes // BYTES_PER_TOKEN)
    want = []
    for kind in expected:
        if isinstance(kind, tuple):
            want.append(num_tokens - min(kind[1], len(tokens) // BS) * BS)
        else:
            want.append({"cold": num_tokens, "own": 0}[kind])
    assert uncached(router, body) == want


def route(router: Router, request_id: str, body: dict[str, Any] = CHAT) -> Pod:
    return router.route("/v1/chat/completions", orjson.dumps(body), request_id=request_id).pods[0]


@pytest.mark.parametrize("events", [pytest.param(False, id="no-events"),
                                    pytest.param(True, id="events-came")])  # fmt: skip
@pytest.mark.parametrize("end", ["success", "failure", "abandon"])
def test_a_pick_counts_as_cached_until_it_ends_then_only_events_tell(
    end: str, events: bool
) -> None:
    router = precise_router()
    ttft, precise = plugins(router)
    tokens = tokens_of(router, CHAT)
    num_cached = (len(tokens) - 1) // BS * BS
    pick = route(router, "r0")
    row = PODS.index(pick)
    assert uncached(router, CHAT)[row] == len(tokens) - num_cached  # credited at the pick
    assert precise.arrivals.num_requests == 1
    if events:  # the prefill's events reach the view before the request ends
        store(precise, pick, tokens)
    if end == "abandon":
        router.abandon("r0")
    else:
        router.complete("r0", pick.address, succeeded=end == "success")
    assert precise.arrivals.num_requests == 0 and len(precise.arrivals) == 0
    ttft.index.retain_pods(())  # only the events may tell now, not estimated-ttft's record
    want = len(tokens) - (num_cached if events else 0)
    assert uncached(router, CHAT)[row] == want


def test_a_burst_follows_its_first_pick_before_any_event() -> None:
    router = precise_router()  # estimated-ttft's own credit is overruled by the events'
    # a document long enough that prefilling it elsewhere costs more than queueing behind
    # the burst's first requests (at 0.02 ms a token, a short prompt rightly spreads)
    document = {"model": "m", "messages": [{"role": "user", "content": SYSTEM * 6}]}
    picks = {route(router, f"r{i}", document).id for i in range(3)}
    assert len(picks) == 1  # the least loaded would differ without precise's credit


def test_one_ranking_matches_the_candidates_once_and_the_next_matches_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """precise-prefix-cache's score and estimated-ttft's exact counts read one match of
    the candidates per ranking; a later ranking of the same cycle sees the events since."""
    router = precise_router()
    _, precise = plugins(router)
    tokens = tokens_of(router, CHAT)
    matched: list[int] = []
    match = precise._match

    def counted(*args: Any) -> Any:
        matched.append(1)
        return match(*args)

    monkeypatch.setattr(precise, "_match", counted)
    cycle = make_cycle(CHAT)
    router.scheduler.schedule_request(cycle, PODS)
    assert len(matched) == 1
    assert cycle.num_prefill_tokens(PODS[1].id) == len(tokens)
    store(precise, PODS[1], tokens[: 3 * BS])
    router.scheduler.schedule_request(cycle, PODS)  # as a queued request is ranked again
    assert len(matched) == 2
    assert cycle.num_prefill_tokens(PODS[1].id) == len(tokens) - 3 * BS
