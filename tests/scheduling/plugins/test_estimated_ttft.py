"""estimated-ttft: the cost model's arithmetic, its affinity hysteresis, provisional credit
(arriving blocks) and the scheduler's load tie-break."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.pods import PodId, PodMetrics
from extproc.routing.pending import DEFAULT_PENDING_TTL_S
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, load_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.arrivals import Arrivals
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs, Written
from extproc.scheduling.scheduler import Scheduler
from testkit import estimated_ttft
from testkit.factories import PREFIX_ONLY, make_cycle, make_pod, make_scheduler

PROMPT = "w" * 4000  # 1,000 tokens at 4 bytes a token, 62.5 blocks of 64 bytes
# The arithmetic's tests pin what they compute with (not the shipped defaults): prefill 0.1
# ms/token, queued 30 ms, running 5 ms, writes 300 ms, no session term.
A = EstimatedTTFTArgs(prefillMsPerToken=0.1, runningMs=5.0, writtenMs=300.0, sessionMs=0.0)
DEFAULTS = EstimatedTTFTArgs()


def plugin(in_flight: InFlight | None = None) -> EstimatedTTFT:
    return EstimatedTTFT(A, PluginContext(CollectorRegistry(), in_flight=in_flight or InFlight()))


def test_the_defaults_are_priced_for_the_h100_8b_engine() -> None:
    """The shipped defaults (config.yaml writes them out too, but for the wait for an
    adapter slot: lora-affinity ranks the slots there)."""
    expected = {
        "prefillMsPerToken": 0.02,
        "queuedMs": 30.0,
        "runningMs": 15.0,
        "affinityMarginMs": 50.0,
        "affinityRatio": 1.5,
        "affinityMinMatch": 0.3,
        "writtenMs": 100.0,
        "sessionMs": 150.0,
        "sessionIdleS": 120.0,
        "sessionHoldShare": 0.5,
    }
    assert {name: getattr(DEFAULTS, name) for name in expected} == expected
    shipped = ttft_plugin(default_router()).args
    assert shipped == replace(DEFAULTS, loraSlotWaitMs=0.0)


@pytest.mark.parametrize(
    ("held_blocks", "metrics", "in_flight", "expected_ms"),
    [
        pytest.param([0, 0], [PodMetrics()] * 2, [(0, 0)] * 2, [130.0, 130.0], id="idle-cold"),
        pytest.param([62, 0], [PodMetrics()] * 2, [(0, 0)] * 2, [30.8, 130.0], id="warm-pod"),
        pytest.param([31, 0], [PodMetrics()] * 2, [(0, 0)] * 2, [80.4, 130.0], id="half-warm"),
        pytest.param(
            [0, 0],
            [PodMetrics(waiting=2), PodMetrics(running=4)],
            [(0, 0)] * 2,
            [100 + 2 * 100 + 30 * 3, 100 + 30 + 5 * 4],
            id="queue-sized-by-this-prompt-running-adds",
        ),
        pytest.param(
            [62, 0],
            [PodMetrics()] * 2,
            [(3, 30), (0, 0)],
            [0.1 * (30 + 8) + 30 * 4, 130.0],
            id="unseen-burst-of-warm-hits-is-cheap",
        ),
        pytest.param(
            [0, 0],
            [PodMetrics(running=3), PodMetrics()],
            [(3, 3000), (0, 0)],
            [100 + 30 + 15, 130.0],
            id="in-flight-already-running-is-not-queued",
        ),
    ],
)
def test_estimate_is_queue_wait_plus_uncached_prefill(
    held_blocks: list[int],
    metrics: list[PodMetrics],
    in_flight: list[tuple[int, int]],
    expected_ms: list[float],
) -> None:
    counts = InFlight()
    pods = [make_pod(f"p{i}", metrics=m) for i, m in enumerate(metrics)]
    p = plugin(counts)
    cycle = make_cycle(PROMPT)
    keys = cycle.block_keys(A.blockSizeToHash, A.maxBlocksToMatch)
    for pod, blocks in zip(pods, held_blocks, strict=True):
        if blocks:
            p.index.record(keys[:blocks], pod.id)
        n, tokens = in_flight[pods.index(pod)]
        for i in range(n):
            counts.start(pod.id, tokens // n + (i < tokens % n))
    estimates = p.estimate_ms(cycle, pods)
    assert [estimates[pod.id] for pod in pods] == pytest.approx(expected_ms)
    uncached = [1000 - 16 * b for b in held_blocks]
    assert [cycle.num_prefill_tokens(pod.id) for pod in pods] == uncached


@pytest.mark.parametrize(
    ("warm_waiting", "warm_wins"),
    [
        # warm: 30 + 130 ms per waiting request (its prompt's prefill and 30 ms); cold:
        # 130 ms. Warm yields past max(130 + 50, 1.5 * 130) = 195 ms: from 2 waiting.
        pytest.param(0, True, id="idle-warm-pod-keeps-it"),
        pytest.param(1, True, id="one-waiting-still-within-the-margin"),
        pytest.param(2, False, id="clearly-worse-yields-to-load"),
    ],
)
def test_affinity_holds_until_the_warm_pod_is_clearly_worse(
    warm_waiting: int, warm_wins: bool
) -> None:
    pods = [make_pod("warm", metrics=PodMetrics(waiting=warm_waiting)), make_pod("cold")]
    p = plugin()
    cycle = make_cycle(PROMPT)
    p.record(cycle, pods[0].id)
    est = p.estimate_ms(make_cycle(PROMPT), pods)
    assert est[pods[0].id] == pytest.approx(30 + 130 * warm_waiting)  # whole prompt held
    scores = p.score(make_cycle(PROMPT), pods)
    assert (scores[pods[0].id] > scores[pods[1].id]) is warm_wins


def test_hysteresis_favours_the_longest_match_beyond_its_estimate() -> None:
    """The affinity pod's cost: its estimate less the margin, or over the ratio, the less."""
    pods = [make_pod("warm"), make_pod("cold")]
    p = plugin()
    cycle = make_cycle(PROMPT)
    p.record(cycle, pods[0].id)
    costs = estimated_ttft.costs(p, make_cycle(PROMPT), pods)
    assert costs[pods[0].id] == pytest.approx(min(30 - 50, 30 / 1.5))
    assert p.score(make_cycle(PROMPT), pods) == {pods[0].id: 100, pods[1].id: 0}


@pytest.mark.parametrize(
    ("held_blocks", "hysteresis"),
    [
        # 62.5 blocks in the prompt; affinity from 0.3 of it: 18.75 blocks, so 19 blocks.
        pytest.param(18, False, id="a-short-match-is-only-its-saved-prefill"),
        pytest.param(19, True, id="a-third-of-the-prompt-holds-the-request"),
    ],
)
def test_affinity_needs_a_match_of_a_share_of_the_prompt(
    held_blocks: int, hysteresis: bool
) -> None:
    """A shared system prompt alone must not pin every request to the pod that holds it."""
    pods = [make_pod("warm"), make_pod("cold")]
    p = plugin()
    cycle = make_cycle(PROMPT)
    p.index.record(
        cycle.block_keys(A.blockSizeToHash, A.maxBlocksToMatch)[:held_blocks], pods[0].id
    )
    est = p.estimate_ms(make_cycle(PROMPT), pods)
    costs = estimated_ttft.costs(p, make_cycle(PROMPT), pods)
    warm = est[pods[0].id]
    assert costs[pods[0].id] == pytest.approx(
        min(warm - A.affinityMarginMs, warm / A.affinityRatio) if hysteresis else warm
    )
    assert costs[pods[1].id] == pytest.approx(est[pods[1].id])


def test_no_match_anywhere_means_no_affinity_and_equal_pods_score_alike() -> None:
    pods = [make_pod("a"), make_pod("b")]
    assert plugin().score(make_cycle(PROMPT), pods) == {pods[0].id: 100, pods[1].id: 100}


def test_arriving_blocks_count_as_held_until_settled() -> None:
    pods = [make_pod("a"), make_pod("b")]
    p = plugin()
    first = make_cycle(PROMPT)
    p.arriving(first, pods[0].id)
    assert p.matched_blocks(make_cycle(PROMPT + " more"), pods) == {pods[0].id: 62}
    assert p.arrivals.num_requests == 1
    p.arriving(make_cycle(PROMPT[:640]), pods[0].id)  # a second request, shorter
    p.settled(first, pods[0].id)
    assert p.matched_blocks(make_cycle(PROMPT), pods) == {pods[0].id: 10}
    p.settled(make_cycle(PROMPT[:640]), pods[0].id)
    assert p.matched_blocks(make_cycle(PROMPT), pods) == {}
    assert len(p.arrivals) == 0 and p.arrivals.num_requests == 0
    assert p.index.num_entries == 0  # arriving is never a record


# Prompts whose chains share 0 to 8 leading blocks with each other: starts of one text
# (each a prefix of the next), another text, and starts of the first that part from it
# after 4 and 7 blocks (as long as some of the others: the same first block and length).
CHAINS = [
    make_cycle(text[:n]).block_keys(A.blockSizeToHash, A.maxBlocksToMatch).tolist()
    for text in (PROMPT, "v" * 640, PROMPT[:256] + "z" * 400, PROMPT[:448] + "z" * 200)
    for n in (64, 200, 320, 512)
]


def common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PICK, END, GONE = "pick", "end", "pod-gone"


@settings(deadline=None)  # a per-example time limit fails on a loaded machine, not on a bug
@given(
    st.lists(
        st.tuples(
            st.sampled_from([PICK, PICK, END, GONE]),
            st.integers(0, 3),
            st.integers(0, len(CHAINS) - 1),
        )
    ),
    st.integers(0, len(CHAINS) - 1),
)
@example([(PICK, 0, 3), (PICK, 0, 3), (END, 0, 3), (END, 0, 3)], 3)  # one prompt twice
@example([(PICK, 0, 2), (PICK, 0, 10), (END, 0, 10)], 2)  # as long, parting at the last block
@example([(PICK, i % 4, i % 8) for i in range(40)] + [(END, i % 4, i % 8) for i in range(37)], 1)
def test_arrivals_find_each_pods_longest_arriving_prefix(
    ops: list[tuple[str, int, int]], query: int
) -> None:
    """After any sequence of picks, ends and pods leaving, a lookup gives every pod with a
    request in flight its longest common prefix with any of them, as a plain list does."""
    arrivals = Arrivals()
    live: list[tuple[PodId, int]] = []
    for op, pod_idx, chain in ops:
        pod = PodId("ns", f"p{pod_idx}")
        if op == PICK:
            arrivals.add(np.array(CHAINS[chain], dtype=np.int64), pod)
            live.append((pod, chain))
        elif op == END and (pod, chain) in live:
            arrivals.remove(np.array(CHAINS[chain], dtype=np.int64), pod)
            live.remove((pod, chain))
        elif op == GONE:
            arrivals.forget_pods({p for p, _ in live} - {pod})
            live = [(p, c) for p, c in live if p != pod]
    expected: dict[PodId, int] = {}
    for pod, chain in live:
        n = common_blocks(CHAINS[query], CHAINS[chain])
        if n > expected.get(pod, 0):
            expected[pod] = n
    assert arrivals.match(np.array(CHAINS[query], dtype=np.int64)) == expected
    assert arrivals.num_requests == len(arrivals) == len(live)


def test_pods_that_come_and_go_do_not_grow_the_arrivals_tables() -> None:
    arrivals = Arrivals()
    keys = np.array(CHAINS[3], dtype=np.int64)
    for i in range(100):
        arrivals.add(keys, PodId("ns", f"p{i}"))
        arrivals.remove(keys, PodId("ns", f"p{i}"))
    arrivals.add(keys, PodId("ns", "a"))
    arrivals.add(keys, PodId("ns", "b"))
    arrivals.forget_pods(set())
    assert len(arrivals._rows_of) == 2  # slots of pods without prompts are reused


def default_router(pending_ttl_s: float = DEFAULT_PENDING_TTL_S, num_pods: int = 4) -> Router:
    in_flight = InFlight()
    scheduler = build_scheduler(load_config(), CollectorRegistry(), in_flight)
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(num_pods)]
    return Router(
        scheduler,
        pods,
        pending_ttl_s=pending_ttl_s,
        in_flight=in_flight,
        registry=CollectorRegistry(),
    )


def body(question: str, prefix: str = PROMPT) -> bytes:
    return b'{"model": "m", "prompt": "%s %s"}' % (prefix.encode(), question.encode())


def ttft_plugin(router: Router) -> EstimatedTTFT:
    ws = router.scheduler.scorers[0]  # the default's first score (then lora-affinity)
    assert isinstance(ws.scorer, EstimatedTTFT)
    return ws.scorer


def test_a_burst_with_a_new_prefix_follows_its_first_pick_before_any_response() -> None:
    """The shipped defaults: the third request of an 8,000-token document costs the warm
    pod, two deep, (0.02 x 8,003 + 30 x 3) / 1.5 = 167 ms against 190 ms on a cold pod
    (without the credit the second already finds no match there: 380 ms). A 1,000-token
    prompt is not worth the queue (60 ms against 50): that burst rightly spreads."""
    router = default_router()
    document = "d" * 32_000
    picks = {router.route("/v1/completions", body(f"q{i}", document), request_id=f"r{i}")
             .pods[0].id for i in range(3)}  # fmt: skip
    assert len(picks) == 1  # without provisional credit the least loaded would differ


@pytest.mark.parametrize(
    "end",
    [
        pytest.param("failure", id="failure"),
        pytest.param("retry-elsewhere", id="retry-elsewhere"),
        pytest.param("abandon", id="abandoned"),
        pytest.param("timeout", id="pending-timeout"),
        pytest.param("success", id="success"),
    ],
)
def test_provisional_credit_goes_at_the_end_and_only_success_records(end: str) -> None:
    router = default_router(0.0 if end == "timeout" else DEFAULT_PENDING_TTL_S)
    plugin_ = ttft_plugin(router)
    decision = router.route("/v1/completions", body("q0"), request_id="r0")
    pick, other = decision.pods[0], decision.pods[1]
    # the control: the pick holds the credit before the end, whichever end comes
    credited = plugin_.matched_blocks(make_cycle(PROMPT + " q1", model="m"), router.pods)
    assert plugin_.arrivals.num_requests == 1 and set(credited) == {pick.id}
    if end == "failure":
        router.complete("r0", pick.address, succeeded=False)
    elif end == "retry-elsewhere":
        router.complete("r0", other.address, succeeded=True, attempts=2)
    elif end == "abandon":
        router.abandon("r0")
    elif end == "timeout":
        router.route("/v1/completions", b'{"model": "m", "prompt": "x"}', request_id="r1")
        router.complete("r1", pick.address, succeeded=False)
    else:
        router.complete("r0", pick.address, succeeded=True)
    assert plugin_.arrivals.num_requests == 0 and len(plugin_.arrivals) == 0
    recorded = {pod: plugin_.index.num_pod_entries(pod.id) > 0 for pod in router.pods}
    expected = {"retry-elsewhere": other, "success": pick}.get(end)
    assert recorded == {pod: pod == expected for pod in router.pods}


def tie_scheduler(in_flight: InFlight, seed: int) -> Scheduler:
    scheduler = make_scheduler(PREFIX_ONLY)  # no match anywhere: every total is 0
    scheduler.in_flight = in_flight
    scheduler.rng = random.Random(seed)
    return scheduler


@pytest.mark.parametrize("seed", range(5))
def test_equal_totals_go_to_the_least_loaded_pod_first(seed: int) -> None:
    in_flight = InFlight()
    pods = [
        make_pod("busy", metrics=PodMetrics(running=3)),
        make_pod("routed-to", metrics=PodMetrics()),
        make_pod("idle"),
        make_pod("scraped-waiting", metrics=PodMetrics(waiting=1)),
    ]
    for _ in range(2):
        in_flight.start(pods[1].id)
    order = [p.id.name for p in tie_scheduler(in_flight, seed).schedule(make_cycle("x"), pods)]
    assert order == ["idle", "scraped-waiting", "routed-to", "busy"]


def test_ties_among_many_pods_are_broken_by_load_too() -> None:
    in_flight = InFlight()
    pods = [make_pod(f"p{i}", metrics=PodMetrics(running=1 + (i != 77))) for i in range(100)]
    for i in range(100):
        if i != 77:
            in_flight.start(pods[i].id)
    ranked = tie_scheduler(in_flight, 0).schedule(make_cycle("x"), pods)
    assert ranked[0].id.name == "p77"


def test_written_decays_by_one_over_the_window_each_pick() -> None:
    written = Written(window=4)  # x 0.75 a pick
    a, b = make_pod("a").id, make_pod("b").id
    written.add(a, 1000)
    written.add(b, 100)
    written.add(b, 100)
    assert written.get(a) == pytest.approx(1000 * 0.75**2)
    assert written.get(b) == pytest.approx(100 * 0.75 + 100)
    written.forget_pods({b})
    assert written.get(a) == 0.0


def test_written_rows_follow_every_pick_and_a_new_table() -> None:
    """The table path's per-row values: the pods' shares as ``get`` gives them, kept up to
    date pick by pick for one table, and rebuilt for a table with other pods."""
    written = Written(window=4)
    a, b, c = (make_pod(n).id for n in "abc")
    rows = {a: 0, b: 1}
    written.add(a, 1000)
    first = written.relative_rows(rows, 2)
    written.add(b, 100)  # after the rows were built: kept up to date
    written.add(c, 50)  # no row in this table
    values = written.relative_rows(rows, 2)
    assert values[1] / values[0] == pytest.approx(written.get(b) / written.get(a))
    assert first[1] == 0.0  # a copy, not the live array
    other = {c: 0, a: 1}  # a new table: rebuilt from every pod's value
    values = written.relative_rows(other, 2)
    assert values[0] / values[1] == pytest.approx(written.get(c) / written.get(a))
    written.forget_pods({a})
    assert list(written.relative_rows(other, 2)) == [0.0, pytest.approx(values[1])]


def test_written_survives_its_common_factor_growing_past_the_rebase() -> None:
    """A window of 2 doubles the common factor every pick: 1,200 picks would overflow it."""
    written = Written(window=2)
    a, b = make_pod("a").id, make_pod("b").id
    rows = {a: 0, b: 1}
    written.relative_rows(rows, 2)
    for _ in range(600):
        written.add(a, 100)
        written.add(b, 300)
    assert written.get(a) == pytest.approx(100 * 0.5 / (1 - 0.25))  # one pick older than b's
    assert written.get(b) == pytest.approx(300 / (1 - 0.25))
    values = written.relative_rows(rows, 2)
    assert np.isfinite(values).all()
    assert values[1] / values[0] == pytest.approx(written.get(b) / written.get(a))


@pytest.mark.parametrize(
    ("held_blocks", "expected_write_ms"),
    [
        # The busiest writer (a: 4,000 tokens) pays writtenMs for a whole prompt, b (1,000
        # written) a quarter of it; c never written to, nothing. Held blocks pay nothing.
        pytest.param([0, 0, 0], [A.writtenMs, A.writtenMs / 4, 0.0], id="a-new-prompt"),
        pytest.param([62, 0, 0], [A.writtenMs * 8 / 1000, A.writtenMs / 4, 0.0], id="a-held"),
    ],
)
def test_write_cost_is_the_uncached_share_times_the_pods_turnover(
    held_blocks: list[int], expected_write_ms: list[float]
) -> None:
    pods = [make_pod("a"), make_pod("b"), make_pod("c")]
    p = plugin()
    p.written = Written(window=10**12)  # no decay, to read the arithmetic
    p.written.add(pods[0].id, 4000)
    p.written.add(pods[1].id, 1000)
    cycle = make_cycle(PROMPT)
    keys = cycle.block_keys(A.blockSizeToHash, A.maxBlocksToMatch)
    for pod, blocks in zip(pods, held_blocks, strict=True):
        if blocks:
            p.index.record(keys[:blocks], pod.id)
    p.estimate_ms(cycle, pods)
    write = p.write_ms(cycle, [pod.id for pod in pods])
    assert [write[pod.id] for pod in pods] == pytest.approx(expected_write_ms)


def test_new_prompts_spread_over_pods_by_what_was_written_there() -> None:
    """Idle pods, nothing in flight: a new prompt avoids the pod the last one was written to
    (without the write cost every pod is equal and the pick is the scheduler's draw)."""
    for seed in range(8):
        router = default_router(num_pods=2)
        router.scheduler.rng = random.Random(seed)
        first = router.route("/v1/completions", body("q0"), request_id="r0").pods[0]
        router.complete("r0", first.address, succeeded=True)
        prompt = b'{"model": "m", "prompt": "%s"}' % (b"z" * 4000)
        second = router.route("/v1/completions", prompt, request_id="r1").pods[0]
        assert second.id != first.id


def test_the_spec_prefix_cache_series_describe_its_view() -> None:
    """Match ratio (a prefix held or arriving), evictions by the evicted entry's model,
    entries: kthena_router_prefix_cache_*, as the prefix-cache plugin emits them."""
    registry = CollectorRegistry()
    p = EstimatedTTFT(EstimatedTTFTArgs(maxHashCacheSize=70), PluginContext(registry))
    pods = [make_pod("a"), make_pod("b")]
    p.score(make_cycle(PROMPT), pods)  # a miss
    p.record(make_cycle(PROMPT), pods[0].id)  # 63 blocks
    p.score(make_cycle(PROMPT), pods)  # held whole: 1.0
    p.arriving(make_cycle("v" * 640), pods[1].id)
    p.score(make_cycle("v" * 1280), pods)  # 10 of 20 blocks arriving: 0.5
    p.record(make_cycle("u" * 640, model="m2"), pods[0].id)  # 73 blocks: 3 evicted
    ratio = "kthena_router_prefix_cache_match_ratio"
    value = registry.get_sample_value
    assert value(f"{ratio}_count", {"model": "m"}) == 3
    assert value(f"{ratio}_sum", {"model": "m"}) == 1.5
    assert value(f"{ratio}_bucket", {"model": "m", "le": "0.0"}) == 1
    assert value("kthena_router_prefix_cache_evictions_total", {"model": "m"}) == 3
    assert value("kthena_router_prefix_cache_entries") == 70


def test_with_prefix_cache_configured_too_the_series_cover_both_views() -> None:
    registry = CollectorRegistry()
    scheduler = make_scheduler(
        """
scheduler:
  plugins:
    Score:
      enabled:
        - {name: estimated-ttft, weight: 1}
        - {name: prefix-cache, weight: 1}
""",
        registry,
    )
    pods = [make_pod("a"), make_pod("b")]
    scheduler.record(make_cycle(PROMPT), pods[0].id)  # 63 blocks in each view
    assert registry.get_sample_value("kthena_router_prefix_cache_entries") == 63 + 63
    scheduler.schedule(make_cycle(PROMPT), pods)  # each scores: two observations
    count = "kthena_router_prefix_cache_match_ratio_count"
    assert registry.get_sample_value(count, {"model": "m"}) == 2


@pytest.mark.parametrize("name", ["writtenMs", "affinityMarginMs"])
def test_a_zero_write_cost_or_margin_turns_the_term_off(name: str) -> None:
    """Unlike Kthena's arguments (0 means the default), these two take 0."""
    args = EstimatedTTFT.from_args({name: 0}, PluginContext(CollectorRegistry())).args
    assert getattr(args, name) == 0.0
    zero_queued = EstimatedTTFT.from_args({"queuedMs": 0}, PluginContext(CollectorRegistry()))
    assert zero_queued.args == DEFAULTS


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_a_negative_or_infinite_write_cost_uses_the_default_and_logs(
    value: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="extproc.scheduling.config"):
        args = EstimatedTTFT.from_args({"writtenMs": value}, PluginContext(CollectorRegistry()))
    assert args.args.writtenMs == DEFAULTS.writtenMs == 100.0
    assert f"Invalid writtenMs {value}, using default value 100.0" in caplog.text


def test_no_write_cost_leaves_only_the_estimate() -> None:
    """writtenMs 0: the busiest writer pays nothing more than a pod never written to."""
    pods = [make_pod("a"), make_pod("b")]
    ctx = PluginContext(CollectorRegistry(), in_flight=InFlight())
    p = EstimatedTTFT.from_args({"writtenMs": 0}, ctx)
    p.written.add(pods[0].id, 4000)
    cycle = make_cycle(PROMPT)
    assert estimated_ttft.costs(p, cycle, pods) == p.estimate_ms(cycle, pods)
    assert p.write_ms(cycle, [pod.id for pod in pods]) == {pods[0].id: 0.0, pods[1].id: 0.0}
