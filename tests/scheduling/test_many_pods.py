"""1,000 pods: the column (PodTable) scoring equals the plain per-pod formulas, and the
per-snapshot data the scheduler keeps follows every new snapshot."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.kernels import rank_best
from extproc.pods import Pod, PodId, PodMetrics, PodRole
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, named_config_text, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.scheduling.scheduler import SMALL_RANK, Scheduler
from testkit.factories import PREFIX_ONLY, make_cycle, make_pod, make_scheduler

SYSTEM = "You are a helpful assistant. " * 40


BUSY = (0, 0, 1, 3, 9, 10, 15)  # 2 in 7 pods have a full queue (maxWaitingRequests 10)
CALM = (0,) * 80 + (12,)  # 1 in 81: few enough left out for prefix-cache's "all but" masks


def random_pods(rng: random.Random, num_pods: int, waiting: Sequence[int] = BUSY) -> list[Pod]:
    pods = []
    for i in range(num_pods):
        latency = rng.random() < 0.7
        metrics = PodMetrics(
            waiting=rng.choice(waiting),
            running=rng.randrange(0, 30),
            kv_usage=rng.choice([0.0, 1.0, rng.random(), 0.29, 0.57]),
            ttft_s=rng.choice([0.1, 0.25, rng.random()]) if latency else None,
            itl_s=rng.choice([0.01, rng.random() / 10]) if rng.random() < 0.9 else None,
        )
        pods.append(
            Pod(
                id=PodId("ns", f"pod-{i}"),
                address=f"10.1.{i // 250}.{i % 250}:8000",
                models=frozenset({"m"} if rng.random() < 0.95 else {"other"}),
                ready=rng.random() < 0.97,
                metrics=metrics,
            )
        )
    return pods


# -- the plain formulas, one pod at a time (the plugins' module docstrings) ----------


def plain_least_request(pods: Sequence[Pod], in_flight: InFlight) -> dict[PodId, int]:
    bases = {}
    for p in pods:
        on_flight = in_flight.get(p.id)
        bases[p.id] = float(on_flight + 100 * max(on_flight - p.metrics.running, 0))
    top = max(bases.values())
    return {i: 100 if top == 0 else int((top - b) / top * 100) for i, b in bases.items()}


def plain_gpu_usage(pods: Sequence[Pod]) -> dict[PodId, int]:
    return {p.id: min(100, max(0, int((1.0 - p.metrics.kv_usage) * 100))) for p in pods}


def plain_least_latency(pods: Sequence[Pod], f: float) -> dict[PodId, int]:
    def has_both(p: Pod) -> bool:
        ttft, itl = p.metrics.ttft_s, p.metrics.itl_s
        return ttft is not None and itl is not None and ttft > 0 and itl > 0

    known = [p for p in pods if has_both(p)]

    def normalised(v: float, values: list[float]) -> float:
        lo, hi = min(values), max(values)
        return 100.0 if hi == lo else 100.0 * (hi - v) / (hi - lo)

    ttfts = [p.metrics.ttft_s or 0.0 for p in known]
    itls = [p.metrics.itl_s or 0.0 for p in known]
    return {
        p.id: int(
            f * normalised(p.metrics.ttft_s or 0.0, ttfts)
            + (1 - f) * normalised(p.metrics.itl_s or 0.0, itls)
        )
        if has_both(p)
        else 50
        for p in pods
    }


def plain_prefix_lengths(
    pods: Sequence[Pod], held: dict[PodId, set[int]], hashes: list[int]
) -> dict[PodId, int]:
    """Each candidate's longest match, walking back from the last block."""
    return {
        p.id: next((i + 1 for i in reversed(range(len(hashes))) if hashes[i] in held[p.id]), 0)
        for p in pods
        if p.id in held
    }


def check_prefix(scores: Mapping[PodId, int], lengths: dict[PodId, int], n: int) -> None:
    """``scores`` is a top-5 Kthena could give: true scores, every pod longer than the
    shortest kept included, the rest of that length drawn arbitrarily."""
    matched = {p: m for p, m in lengths.items() if m}
    assert len(scores) == min(5, len(matched))
    assert all(scores[p] == matched[p] * 100 // n for p in scores)
    if scores:
        cut = min(matched[p] for p in scores)
        assert {p for p, m in matched.items() if m > cut} <= set(scores)


def default_scheduler(in_flight: InFlight) -> Scheduler:
    config = parse_config(named_config_text("kthena"), "kthena")
    return build_scheduler(config, CollectorRegistry(), in_flight)


def prefix_plugin(sched: Scheduler) -> PrefixCacheScorer:
    (plugin,) = (ws.scorer for ws in sched.scorers if isinstance(ws.scorer, PrefixCacheScorer))
    return plugin


@pytest.mark.parametrize(
    ("seed", "waiting"),
    [pytest.param(s, BUSY, id=f"busy-seed{s}") for s in range(3)]
    + [pytest.param(s, CALM, id=f"few-filtered-seed{s}") for s in range(2)],
)
def test_1000_pods_scores_and_order_equal_the_plain_computation(
    seed: int, waiting: Sequence[int]
) -> None:
    rng = random.Random(seed)
    pods = tuple(random_pods(rng, 1000, waiting))
    in_flight = InFlight()
    sched = default_scheduler(in_flight)
    sched.pods_changed(pods)
    for _ in range(300):
        in_flight.start(rng.choice(pods).id, 10)
    held: dict[PodId, set[int]] = {}
    prompts = [SYSTEM + f"question {q} " * 20 for q in range(6)]
    for _ in range(400):  # prompts, and their starts, recorded on many pods
        pod = rng.choice(pods).id
        cycle = make_cycle(rng.choice(prompts)[: rng.randrange(64, 2000)])
        sched.record(cycle, pod)
        held.setdefault(pod, set()).update(cycle.block_keys(64, 128).tolist())
    plugin = prefix_plugin(sched)
    for prompt in prompts[:3]:
        cycle = make_cycle(prompt)
        hashes = cycle.block_keys(64, 128).tolist()
        plugin.index.rng = random.Random(seed)  # the same draw among tied matches each call
        ranked = sched.schedule(cycle, pods)
        ready = [p for p in pods if "m" in p.models and p.ready]
        kept = [p for p in ready if p.metrics.waiting < 10]
        assert sorted(p.id for p in ranked) == sorted(p.id for p in kept)
        plugin.index.rng = random.Random(seed)
        prefix_scores = plugin.score(cycle, kept)
        check_prefix(prefix_scores, plain_prefix_lengths(kept, held, hashes), len(hashes))
        parts = [
            plain_least_request(kept, in_flight),
            plain_gpu_usage(kept),
            plain_least_latency(kept, 0.5),
            dict(prefix_scores),
        ]
        assert parts[3], "the test should exercise prefix matches"
        totals = [sum(part.get(p.id, 0) for part in parts) for p in ranked]
        assert totals == sorted(totals, reverse=True)
        table = sched.table(pods)
        rows = table.candidates("m").serving
        rows = rows[table.waiting[rows] < 10]
        for ws, part in zip(sched.scorers, parts, strict=True):
            plugin.index.rng = random.Random(seed)
            scores = ws.scorer.score_table(cycle, table, rows)  # type: ignore[attr-defined]
            assert dict(zip((table.ids[r] for r in rows), scores.tolist(), strict=True)) == {
                p.id: part.get(p.id, 0) for p in kept
            }, ws.scorer.type_name


def test_the_snapshot_table_is_kept_per_tuple_and_rebuilt_for_a_new_one() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    pods = tuple(make_pod(n) for n in "ab")
    sched.pods_changed(pods)
    assert sched.table(pods) is sched.table(pods)
    assert sched.table(list(pods)) is not sched.table(list(pods))  # a list may change
    moved = (*pods, make_pod("c"))
    assert sched.table(moved).ids == tuple(p.id for p in moved)


def test_new_snapshots_with_changed_metrics_added_and_removed_pods_are_scored_afresh() -> None:
    in_flight = InFlight()
    router = Router(
        default_scheduler(in_flight),
        [make_pod(f"p{i}", port=8000 + i) for i in range(300)],
        in_flight=in_flight,
        registry=CollectorRegistry(),
    )
    body = b'{"model": "m", "prompt": "hello there"}'
    busy = PodMetrics(waiting=3, running=5, kv_usage=0.9)
    # every pod but p7 busy: p7 must win
    router.set_pods([replace(p, metrics=busy) if p.id.name != "p7" else p for p in router.pods])
    assert router.route("/v1/completions", body).pods[0].id.name == "p7"
    # p7 busy too, a new idle pod added: the new one wins
    idle = make_pod("new", port=9999)
    router.set_pods([*(replace(p, metrics=busy) for p in router.pods), idle])
    assert router.route("/v1/completions", body).pods[0] == idle
    # the new pod's queue fills: the filter drops it
    full = replace(idle, metrics=PodMetrics(waiting=10))
    router.set_pods([*router.pods[:-1], full])
    assert full not in router.route("/v1/completions", body).pods
    # removed: never chosen, and the others rank as before
    router.set_pods(router.pods[:-1])
    assert {p.id.name for p in router.route("/v1/completions", body).pods} <= {
        f"p{i}" for i in range(300)
    }


def test_a_pod_recorded_after_the_snapshot_was_scored_gets_its_prefix_match() -> None:
    """prefix-cache keeps the snapshot's candidate masks; a pod's first record (a new
    slot in the index) must still count in the same snapshot."""
    sched = make_scheduler(PREFIX_ONLY)
    pods = tuple(make_pod(f"p{i}") for i in range(200))
    sched.pods_changed(pods)
    sched.record(make_cycle(SYSTEM + "one"), pods[3].id)
    assert sched.schedule(make_cycle(SYSTEM + "one"), pods)[0] == pods[3]
    sched.record(make_cycle(SYSTEM + "two"), pods[150].id)
    assert sched.schedule(make_cycle(SYSTEM + "two"), pods)[0] == pods[150]
    sched.pods_changed(pods[:150])  # pods[150] leaves the index; pods[3] stays
    sched.record(make_cycle(SYSTEM + "two"), pods[9].id)
    assert sched.schedule(make_cycle(SYSTEM + "two"), pods[:150])[0] == pods[9]


def test_prefill_and_decode_pods_are_ranked_in_their_own_passes_at_scale() -> None:
    pods = tuple(
        replace(make_pod(f"p{i}"), role=PodRole.PREFILL if i % 4 == 0 else PodRole.DECODE)
        for i in range(400)
    )
    sched = make_scheduler(PREFIX_ONLY)
    schedule = sched.schedule_request(make_cycle("x" * 300), pods)
    assert len(schedule.pods) == 300 and all(p.role is PodRole.DECODE for p in schedule.pods)
    assert schedule.prefill is not None and schedule.prefill.role is PodRole.PREFILL


def test_ties_at_scale_are_spread_over_every_equal_pod() -> None:
    sched = Scheduler(rng=random.Random(3))
    pods = tuple(make_pod(f"p{i}") for i in range(1000))
    firsts = {sched.schedule(make_cycle("p"), pods)[0].id for _ in range(3000)}
    assert len(firsts) > 900  # 3,000 draws over 1,000 equal pods miss ~50


def test_a_cycle_is_scored_the_same_whatever_the_pods_container() -> None:
    rng = random.Random(11)
    pods = random_pods(rng, 500)
    first = Scheduler(rng=random.Random(1), scorers=default_scheduler(InFlight()).scorers)
    second = Scheduler(rng=random.Random(1), scorers=first.scorers)
    cycle: Cycle = make_cycle("x" * 500)
    assert first.schedule(cycle, pods) == second.schedule(cycle, tuple(pods))


def test_up_to_64_candidates_ties_go_by_load_then_rng_as_the_plain_ranking() -> None:
    """Seeded runs (the offline simulator, its published results) keep their picks."""
    pods = [make_pod(f"p{i}", metrics=PodMetrics(running=i % 3)) for i in range(40)]
    sched = make_scheduler(
        "scheduler: {plugins: {Score: {enabled: [{name: least-request, weight: 2}]}}}"
    )
    sched.rng = random.Random(5)
    plain_rng = random.Random(5)
    for _ in range(20):
        got = sched.schedule(make_cycle("q"), pods)
        scores = plain_least_request(pods, InFlight())
        tiebreak = {p.id: plain_rng.random() for p in pods}
        # Equal totals: the least loaded first (nothing in flight: waiting + running), then
        # the rng's draw.
        load = {p.id: p.metrics.waiting + p.metrics.running for p in pods}
        assert got == sorted(pods, key=lambda p: (-2 * scores[p.id], load[p.id], tiebreak[p.id]))


def test_row_memory_is_shared_only_while_snapshots_list_the_same_pods() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    pods = tuple(make_pod(f"p{i}") for i in range(100))
    sched.pods_changed(pods)
    first = sched.table(pods)
    busier = tuple(replace(p, metrics=PodMetrics(running=1)) for p in pods)
    sched.pods_changed(busier)
    assert sched.table(busier).by_rows is first.by_rows  # metrics changed, pods did not
    sched.record(make_cycle(SYSTEM + "x"), pods[50].id)
    assert sched.schedule(make_cycle(SYSTEM + "x"), busier)[0].id == pods[50].id
    swapped = (*busier[:50], make_pod("new"), *busier[51:])  # row 50 is another pod now
    sched.pods_changed(swapped)
    assert sched.table(swapped).by_rows is not first.by_rows
    ranked = sched.schedule(make_cycle(SYSTEM + "x"), swapped)
    assert pods[50].id not in {p.id for p in ranked}
    sched.record(make_cycle(SYSTEM + "x"), swapped[50].id)
    assert sched.schedule(make_cycle(SYSTEM + "x"), swapped)[0].id.name == "new"


def test_a_pod_that_changes_models_is_a_candidate_for_its_new_model_only() -> None:
    sched = make_scheduler(PREFIX_ONLY)
    pods = tuple(make_pod(f"p{i}") for i in range(100))
    sched.pods_changed(pods)
    assert len(sched.schedule(make_cycle("x"), pods)) == 100
    moved = (*pods[:10], replace(pods[10], models=frozenset({"other"})), *pods[11:])
    sched.pods_changed(moved)  # same ids in the same order, one pod's models changed
    assert pods[10].id not in {p.id for p in sched.schedule(make_cycle("x"), moved)}
    assert sched.schedule(make_cycle("x", model="other"), moved) == [moved[10]]


@settings(max_examples=200, deadline=None)
@given(
    num=st.integers(SMALL_RANK + 1, 1500),
    distinct=st.integers(1, 6),
    limit=st.integers(1, 12),
    spread=st.sampled_from([37, 1 << 22]),
    seed=st.integers(0, 2**32),
)
def test_the_best_few_are_the_whole_rankings_first_few(
    num: int, distinct: int, limit: int, spread: int, seed: int
) -> None:
    """``kernels.rank_best`` over the permutation ``_order`` draws: the first ``limit`` of
    the full order, the same random tie-breaks (few distinct totals and loads: many ties,
    across the cut too); totals too far apart for the packed key give None (``_rank``
    then takes the whole ranking's way)."""
    draw = np.random.default_rng(seed)
    totals = draw.integers(0, distinct, num) * spread
    load = draw.integers(0, 3, num)
    whole = Scheduler(rng=random.Random(seed))._order(totals, load)
    shuffled = Scheduler(rng=random.Random(seed))._generator().permutation(num)
    positions = np.arange(num, dtype=np.int64)
    best = rank_best([totals], [1], positions, load, load, shuffled, limit)
    if spread > 1 << 21 and totals.max() != totals.min():
        assert best is None
    else:
        assert best is not None
        assert best.tolist() == whole[:limit].tolist()


def test_a_request_gets_the_same_pick_and_fallbacks_as_the_whole_ranking() -> None:
    rng = random.Random(5)
    pods = random_pods(rng, 1000)
    first = Scheduler(rng=random.Random(2), scorers=default_scheduler(InFlight()).scorers)
    second = Scheduler(rng=random.Random(2), scorers=first.scorers)
    for i in range(20):
        cycle = make_cycle(SYSTEM + str(i % 4))
        whole = first.schedule_request(cycle, pods).pods
        assert len(whole) > 900
        assert second.schedule_request(cycle, pods, 3).pods == whole[:3]
