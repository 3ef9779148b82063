"""estimated-ttft's table path (``score_table``: NumPy columns) against its per-pod path
(``score``: one pod at a time): the same costs, scores, uncached tokens and match ratio, to
the last bit, on generated tables of pods, in-flight counts, records, arriving prompts and
conversations (live returning sessions, the request continuing one; the pods' KV cache
sizes known or not, for the session weight and the hold), requests for a LoRA adapter (the pods'
adapter slots), alone or with exact counts (an ``ExactPrefix`` as precise-prefix-cache's,
some pods without an exact view)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.pods import LoraSlots, Pod, PodId, PodMetrics
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import Cycle, ExactMatches, PluginContext
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs
from extproc.scheduling.plugins.session_book import SessionPrompt
from extproc.scheduling.podtable import PodTable
from testkit import estimated_ttft
from testkit.factories import make_cycle

SYSTEM = "You are a terse assistant. Answer in one line. " * 12  # ~9 blocks
PROMPTS = [SYSTEM + f"question {q}: " + "detail " * (15 * q) for q in range(5)]
LONG = "x" * 40_000  # past maxBlocksToMatch (32,768 bytes hashed): the tail is uncached
MATCH_RATIO_SUM = "kthena_router_prefix_cache_match_ratio_sum"
TURN_BYTES = 150  # each turn of a conversation grows its prompt by two blocks or more


def chat(number: int) -> str:
    """Conversation ``number``'s text; its turn t (from 0) is its first 150 x (t + 1) bytes."""
    return f"chat {number}: " + "".join(f"turn {i} of chat {number}. " for i in range(200))


def turn_prompt(conversation: int, turn: int) -> str:
    return chat(conversation)[: TURN_BYTES * (turn + 1)]


def next_turn(conversation: int, turns: list[tuple[int, int]]) -> str:
    """The conversation's next prompt after ``turns`` ((pod, conversation) each)."""
    return turn_prompt(conversation, sum(c == conversation for _, c in turns))


@dataclass(frozen=True)
class Case:
    pods: list[Pod]
    in_flight: list[tuple[int, int]]  # (requests, prefill tokens) per pod
    records: list[tuple[int, str]]  # (pod, prompt) recorded after a success
    arriving: list[tuple[int, str]]  # (pod, prompt) picked, not ended (and written there)
    positions: list[int]  # the candidate rows (ascending)
    prompt: str
    args: EstimatedTTFTArgs
    # precise-prefix-cache's counts: the prompt's tokens, and the cached tokens of the pods
    # with an exact view (by index); None: not configured
    exact: tuple[int, dict[int, int]] | None = None
    # conversations' turns in order, each (pod, conversation) picked, served and ended: a
    # conversation's second turn makes it a live returning session on its pod
    turns: list[tuple[int, int]] = field(default_factory=list)


class FixedExact:
    """An ``ExactPrefix`` answering the same counts for every cycle, on the pods asked."""

    def __init__(self, pods: list[Pod], exact: tuple[int, dict[int, int]]) -> None:
        self.num_tokens = exact[0]
        self.matched = {pods[i].id: n for i, n in exact[1].items()}

    def exact_matches(self, cycle: Cycle, pods: Sequence[Pod]) -> ExactMatches | None:
        found = {p.id: self.matched[p.id] for p in pods if p.id in self.matched}
        return ExactMatches(self.num_tokens, found)


def prompt_starts() -> st.SearchStrategy[str]:
    """A known prompt cut anywhere (inside a block too), or the long one."""
    whole = st.sampled_from([*PROMPTS, LONG])
    return st.builds(lambda p, f: p[: max(1, int(len(p) * f))], whole, st.floats(0.0, 1.0))


ADAPTERS = ["m", "a1", "a2", "a3"]
# A pod's adapter slots: None (no LoRA metric), or adapters running and waiting, max_lora.
LORA_SLOTS = st.none() | st.builds(
    LoraSlots,
    st.frozensets(st.sampled_from(ADAPTERS)),
    st.frozensets(st.sampled_from(ADAPTERS)),
    st.integers(0, 4),
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_pods = draw(st.integers(1, 80))  # past 63: the index's pods span two pages
    adapter = draw(st.booleans())  # the request's model "m" is a LoRA adapter
    # KV caches in tokens: the session weight's share (None: unknown, the weight is 1)
    capacity = st.sampled_from([None, 600, 20_000]) if draw(st.booleans()) else st.just(None)
    pods = [
        Pod(
            PodId("ns", f"p{i}"),
            f"10.0.0.{i}:8000",
            frozenset({"m"}),
            adapters=frozenset({"m"}) if adapter else frozenset(),
            metrics=PodMetrics(
                waiting=draw(st.just(0) | st.integers(0, 12)),  # none waiting: the hold
                running=draw(st.integers(0, 40)),
                lora=draw(LORA_SLOTS),
                kv_capacity_tokens=draw(capacity),
            ),
        )
        for i in range(num_pods)
    ]
    in_flight = draw(
        st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, 20_000)),
            min_size=num_pods,
            max_size=num_pods,
        )
    )
    pod = st.integers(0, num_pods - 1)
    records = draw(st.lists(st.tuples(pod, prompt_starts()), max_size=12))
    arriving = draw(st.lists(st.tuples(pod, prompt_starts()), max_size=6))
    positions = sorted(draw(st.sets(st.integers(0, num_pods - 1), min_size=1)))
    turns = draw(st.lists(st.tuples(pod, st.integers(0, 3)), max_size=16))
    continued = st.integers(0, 3).map(lambda c: next_turn(c, turns))
    prompt = draw(st.one_of(prompt_starts(), st.just(""), continued))
    ms = st.floats(0.001, 500.0)
    args = EstimatedTTFTArgs(
        prefillMsPerToken=draw(st.sampled_from([0.1, 0.025]) | st.floats(0.0001, 5.0)),
        queuedMs=draw(st.sampled_from([30.0, 0.0]) | ms),
        runningMs=draw(st.sampled_from([5.0, 0.0]) | ms),
        affinityMarginMs=draw(st.sampled_from([50.0, 0.0]) | ms),
        affinityRatio=draw(st.sampled_from([1.5, 1.0]) | st.floats(1.0, 10.0)),
        affinityMinMatch=draw(st.sampled_from([0.3, 0.0]) | st.floats(0.0, 1.0)),
        writtenMs=draw(st.sampled_from([300.0, 0.0]) | ms),
        writtenWindow=draw(st.sampled_from([1000, 1]) | st.integers(2, 10**6)),
        sessionMs=draw(st.sampled_from([150.0, 0.0]) | ms),
        sessionHoldShare=draw(st.sampled_from([0.5, 0.0]) | st.floats(0.0, 2.0)),
        loraLoadMs=draw(st.sampled_from([100.0, 0.0]) | ms),
        loraSlotWaitMs=draw(st.sampled_from([1000.0, 0.0]) | ms),
    )
    exact = draw(
        st.none()
        | st.integers(1, 12_000).flatmap(
            lambda n: st.tuples(
                st.just(n), st.dictionaries(pod, st.integers(0, n - 1) | st.just(n - 1))
            )
        )
    )
    return Case(pods, in_flight, records, arriving, positions, prompt, args, exact, turns)


def build(case: Case) -> tuple[EstimatedTTFT, CollectorRegistry]:
    registry = CollectorRegistry()
    counts = InFlight()
    for pod, (n, tokens) in zip(case.pods, case.in_flight, strict=True):
        for i in range(n):
            counts.start(pod.id, tokens // n + (i < tokens % n))
    exact = FixedExact(case.pods, case.exact) if case.exact is not None else None
    plugin = EstimatedTTFT(case.args, PluginContext(registry, in_flight=counts, exact=exact))
    for idx, prompt in case.records:
        plugin.record(make_cycle(prompt), case.pods[idx].id)
    for idx, prompt in case.arriving:
        plugin.arriving(make_cycle(prompt), case.pods[idx].id)
    for i, (idx, conversation) in enumerate(case.turns):  # as the router: picked, served, ended
        cycle, pick = make_cycle(next_turn(conversation, case.turns[:i])), case.pods[idx].id
        plugin.arriving(cycle, pick)
        plugin.record(cycle, pick)
        plugin.settled(cycle, pick)
    return plugin, registry


def observed(registry: CollectorRegistry) -> float:
    return registry.get_sample_value(MATCH_RATIO_SUM, {"model": "m"}) or 0.0


def both_paths(
    plugin: EstimatedTTFT, registry: CollectorRegistry, case: Case
) -> tuple[dict[PodId, tuple[int, float, int, float]], ...]:
    """Per candidate: (score, cost, prefill tokens, match ratio observed) on each path."""
    table = PodTable(case.pods)
    positions = np.array(case.positions, dtype=np.int64)
    candidates = table.take(positions)
    results = []
    for path in ("pods", "table"):
        cycle = make_cycle(case.prompt)
        before = observed(registry)
        if path == "pods":
            costs = estimated_ttft.costs(plugin, make_cycle(case.prompt), candidates)
            scores = plugin.score(cycle, candidates)
        else:
            cost_rows = estimated_ttft.costs_table(
                plugin, make_cycle(case.prompt), table, positions
            )
            costs = dict(zip((p.id for p in candidates), cost_rows.tolist(), strict=True))
            score_rows = plugin.score_table(cycle, table, positions)
            scores = dict(zip((p.id for p in candidates), score_rows.tolist(), strict=True))
        ratio = observed(registry) - before
        results.append(
            {
                p.id: (scores[p.id], costs[p.id], prefill_tokens(cycle, p.id), ratio)
                for p in candidates
            }
        )
    return tuple(results)


def prefill_tokens(cycle: Cycle, pod: PodId) -> int:
    return cycle.num_prefill_tokens(pod)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_table_path_equals_per_pod_path(case: Case) -> None:
    plugin, registry = build(case)
    by_pods, by_table = both_paths(plugin, registry, case)
    assert by_table == by_pods


@st.composite
def held_cases(draw: st.DrawFn) -> tuple[Case, int]:
    """A case whose request continues conversation 0 on a candidate that the hold keeps
    (no pod waiting, caches large enough), and that candidate's index."""
    case = draw(cases())
    pods = [
        replace(p, metrics=replace(p.metrics, waiting=0, kv_capacity_tokens=20_000))
        for p in case.pods
    ]
    home = draw(st.sampled_from(case.positions))
    turns = [*case.turns, (home, 0)]
    args = replace(case.args, sessionMs=150.0, sessionHoldShare=0.5)
    held = replace(case, pods=pods, turns=turns, prompt=next_turn(0, turns), args=args)
    return held, home


@settings(max_examples=100, deadline=None)
@given(held_cases())
def test_table_path_equals_per_pod_path_with_a_held_conversation(held: tuple[Case, int]) -> None:
    """The hold on both paths: the conversation's pod alone scores highest, and the paths
    agree on every other pod's cost too."""
    case, home = held
    plugin, registry = build(case)
    by_pods, by_table = both_paths(plugin, registry, case)
    assert by_table == by_pods
    best = max(score for score, *_ in by_table.values())
    top = [pod for pod, (score, *_) in by_table.items() if score == best]
    assert top == [case.pods[home].id] or len(case.positions) == 1


@pytest.mark.parametrize(
    ("waiting", "seed", "args", "conversations"),
    [
        # 2 in 7 filtered out: the candidates' own slot masks (many rows left out)
        pytest.param((0, 0, 1, 3, 9, 10, 15), 0, EstimatedTTFTArgs(), 0, id="many-filtered"),
        # 1 in 81: "every pod but these few". No session term (the case below has it):
        # the arriving prompts extend each other into returning sessions on 7 of the 999
        # candidates, and sessionMs over so small a mean (150 ms / 0.007) costs each of
        # those 21 s, which squashes every other score into 98 or 99.
        pytest.param((0,) * 80 + (12,), 1, EstimatedTTFTArgs(sessionMs=0.0), 0, id="few-filtered"),
        # 400 conversations of two turns over the pods, the request the third turn of one
        pytest.param((0, 0, 1, 3, 12), 2, EstimatedTTFTArgs(), 400, id="returning-sessions"),
    ],
)
def test_1000_pods_table_path_equals_per_pod_path(
    waiting: tuple[int, ...], seed: int, args: EstimatedTTFTArgs, conversations: int
) -> None:
    rng = random.Random(seed)
    pods = [
        Pod(
            PodId("ns", f"pod-{i}"),
            f"10.1.{i // 250}.{i % 250}:8000",
            frozenset({"m"}),
            metrics=PodMetrics(waiting=rng.choice(waiting), running=rng.randrange(30)),
        )
        for i in range(1000)
    ]
    prompt_of = [rng.choice(PROMPTS)[: rng.randrange(64, 2000)] for _ in range(600)]
    positions = [i for i, p in enumerate(pods) if p.metrics.waiting < 10]
    # conversation 0's second turn on a candidate: the request leaves its own session out
    turns = [(rng.randrange(1000), c) for _ in range(2) for c in range(conversations)]
    if conversations:
        turns[conversations] = (rng.choice(positions), 0)
    case = Case(
        pods=pods,
        in_flight=[(rng.choice([0, 0, 1, 3]), rng.randrange(5000)) for _ in pods],
        records=[(rng.randrange(1000), p) for p in prompt_of[:500]],
        arriving=[(rng.randrange(1000), p) for p in prompt_of[500:]],
        positions=positions,
        prompt=next_turn(0, turns) if conversations else PROMPTS[3],
        args=args,
        turns=turns,
    )
    plugin, registry = build(case)
    by_pods, by_table = both_paths(plugin, registry, case)
    assert by_table == by_pods
    scores = [score for score, *_ in by_table.values()]
    assert len(set(scores)) > 10, "the case should spread the scores"
    if conversations:
        returning = plugin.sessions.returning_counts(p.id for p in pods)
        assert sum(returning.values()) >= conversations
        assert sum(n > 1 for n in returning.values()) > 10  # several share a pod
        keys = make_cycle(case.prompt).block_keys(args.blockSizeToHash, args.maxBlocksToMatch)
        prompt = SessionPrompt(keys, args.blockSizeToHash, case.prompt.encode())
        session = plugin.sessions.find(prompt)
        own = pods[turns[conversations][0]].id
        assert plugin.sessions.session_pod(session) == (own, True)
