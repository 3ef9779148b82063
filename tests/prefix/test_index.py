"""PrefixIndex: per-pod LRU, eviction, refresh, pod removal, lookup, checked against a model."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pods import PodId
from extproc.prefix import PrefixIndex, hash_prompt
from extproc.prefix.index import PodSet
from testkit.prefix_index import verify_index

A, B, C, D = (PodId("ns", n) for n in "abcd")


class ModelIndex:
    """Kthena's ModelPrefixStore.Add in the plainest Python: an OrderedDict per pod (the
    golang-lru list), one Add per block, tail first, each overflow one counted eviction
    of the oldest entry, labelled with that entry's model."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.pods: dict[PodId, OrderedDict[int, int]] = {}

    def record(self, hashes: list[int], pod: PodId, tag: int = 0) -> dict[int, int]:
        lru = self.pods.setdefault(pod, OrderedDict())
        evicted: dict[int, int] = {}
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                lru[h] = tag
                continue
            lru[h] = tag
            if len(lru) > self.cap:
                victim_tag = lru.popitem(last=False)[1]
                evicted[victim_tag] = evicted.get(victim_tag, 0) + 1
        return evicted

    def longest(self, hashes: list[int], pod: PodId) -> int:
        lru: dict[int, int] = self.pods.get(pod, {})
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in lru:
                return i + 1
        return 0


class Observer:
    """An ``IndexObserver`` keeping the entry count it was told and the last evictions."""

    def __init__(self) -> None:
        self.num_entries = 0
        self.last_evicted: dict[int, int] = {}

    def entries_changed(self, delta: int) -> None:
        self.num_entries += delta

    def evicted(self, by_tag: Mapping[int, int]) -> None:
        self.last_evicted = dict(by_tag)


def test_worked_example_first_24_of_32_blocks() -> None:
    idx = PrefixIndex(1000)
    hashes = hash_prompt("m", "a" * 2000)
    idx.record(hashes[:24], A)
    assert idx.match(hashes, [A, B], top_k=5) == {A: 24}


def test_longest_match_found_first_and_top_k_limits_pods() -> None:
    idx = PrefixIndex(1000)
    hashes = list(range(100, 110))
    idx.record(hashes[:3], A)
    idx.record(hashes[:9], B)
    idx.record(hashes[:5], C)
    idx.record(hashes[:1], D)
    assert idx.match(hashes, [A, B, C, D], top_k=5) == {B: 9, C: 5, A: 3, D: 1}
    assert idx.match(hashes, [A, B, C, D], top_k=2) == {B: 9, C: 5}
    assert idx.match(hashes, [A, D], top_k=5) == {A: 3, D: 1}  # candidates only
    assert idx.match([7, 8], [A, B], top_k=5) == {}


def test_lru_drops_least_recently_used_and_counts_evictions() -> None:
    idx = PrefixIndex(4)
    assert idx.record([1, 2, 3], A) == 0
    assert idx.record([4], A) == 0
    assert idx.record([1], A) == 0  # refresh: 1 becomes most recent
    # order oldest first is now 3, 2, 4, 1 (a record touches its tail first)
    assert idx.record([5], A) == 1
    assert idx.match([3], [A], 5) == {}
    assert idx.match([2], [A], 5) == {A: 1}
    assert idx.record([6, 7], A) == 2  # drops 2 and 4
    assert idx.match([2], [A], 5) == {} and idx.match([4], [A], 5) == {}
    assert idx.num_pod_entries(A) == 4 and idx.num_entries == 4
    verify_index(idx)


def test_a_block_evicted_and_re_added_within_one_record_counts_as_kthena_counts() -> None:
    idx = PrefixIndex(4)
    idx.record([1], A)
    idx.record([2, 3, 4], A)  # LRU order, oldest first: 1, 4, 3, 2
    # Kthena adds 5 (evicting 1), then 1 again (evicting 4): two evictions, while the
    # list ends as a one-step record leaves it: 3, 2, 5, 1.
    assert idx.record([1, 5], A) == 2
    assert idx.match([1], [A], 5) == {A: 1} and idx.match([4], [A], 5) == {}
    assert idx.match([3], [A], 5) == {A: 1} and idx.num_pod_entries(A) == 4
    verify_index(idx)


def test_evictions_are_labelled_with_the_evicted_entrys_tag() -> None:
    observer = Observer()
    idx = PrefixIndex(3, observer=observer)
    idx.record([1, 2], A, tag=7)
    assert idx.record([3, 4], A, tag=9) == 1
    assert observer.last_evicted == {7: 1}  # drops 2, recorded with tag 7
    assert idx.record([5, 6, 8], A, tag=9) == 3
    assert observer.last_evicted == {7: 1, 9: 2}
    assert observer.num_entries == idx.num_entries == 3


def test_record_order_keeps_the_first_block_longest() -> None:
    idx = PrefixIndex(3)
    idx.record([10, 11, 12], A)
    idx.record([20], A)  # evicts the tail block 12, not the first block 10
    assert idx.match([10, 11, 12], [A], 5) == {A: 2}


def test_one_block_for_three_pods_is_three_entries() -> None:
    idx = PrefixIndex(10)
    for pod in (A, B, C):
        idx.record([42], pod)
    assert idx.num_entries == 3


def test_removing_a_pod_drops_its_entries_without_evictions() -> None:
    idx = PrefixIndex(10)
    idx.record([1, 2, 3], A)
    idx.record([1, 2], B)
    assert idx.remove_pod(A) == 3
    assert idx.num_entries == 2
    assert idx.match([1, 2, 3], [A, B], 5) == {B: 2}
    assert idx.remove_pod(A) == 0
    assert idx.retain_pods([C]) == [B] and idx.num_entries == 0
    verify_index(idx)


def test_pods_beyond_one_page_are_found() -> None:
    idx = PrefixIndex(100)
    pods = [PodId("ns", f"p{i}") for i in range(200)]
    for i, pod in enumerate(pods):
        idx.record(list(range(1, i % 7 + 2)), pod)
    found = idx.match(list(range(1, 10)), pods, top_k=200)
    assert found == {pod: i % 7 + 1 for i, pod in enumerate(pods)}
    idx.remove_pod(pods[150])
    assert pods[150] not in idx.match(list(range(1, 10)), pods, top_k=200)
    verify_index(idx)


def test_large_and_boundary_hash_values() -> None:
    idx = PrefixIndex(10)
    hashes = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    idx.record(hashes, A)
    assert idx.match(hashes, [A], 5) == {A: 5}
    verify_index(idx)


def test_invalid_capacity() -> None:
    with pytest.raises(ValueError, match="max_entries_per_pod must be > 0"):
        PrefixIndex(0)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("record"),
            st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
            st.integers(0, 4),
        ),
        st.tuples(st.just("remove"), st.just([]), st.integers(0, 4)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 10), st.lists(st.integers(0, 40), min_size=1, max_size=12))
def test_index_agrees_with_the_plain_model(
    operations: list[tuple[str, list[int], int]], cap: int, query: list[int]
) -> None:
    pods = [PodId("ns", f"p{i}") for i in range(5)]
    observer = Observer()
    idx, model = PrefixIndex(cap, observer=observer), ModelIndex(cap)
    for op, hashes, p in operations:
        if op == "record":
            tag = len(hashes) % 3
            observer.last_evicted = {}
            evicted = model.record(hashes, pods[p], tag)
            assert idx.record(hashes, pods[p], tag) == sum(evicted.values())
            assert observer.last_evicted == evicted
        else:
            idx.remove_pod(pods[p])
            model.pods.pop(pods[p], None)
        verify_index(idx)
    num_entries = sum(len(v) for v in model.pods.values())
    assert idx.num_entries == observer.num_entries == num_entries <= len(pods) * cap
    found = idx.match(query, pods, top_k=len(pods))
    assert found == {p: n for p in pods if (n := model.longest(query, p))}


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20), st.integers(0, 20), st.integers(1, 5))
def test_a_longer_match_never_scores_lower(short: int, extra: int, top_k: int) -> None:
    idx = PrefixIndex(1000)
    hashes = list(range(1000, 1040))
    idx.record(hashes[:short], A)
    idx.record(hashes[: short + extra], B)
    found = idx.match(hashes, [A, B], top_k=top_k)
    if extra:
        assert found[B] == short + extra > found.get(A, 0)
    else:  # equal matches: which pods get the top-K places is arbitrary
        assert set(found.values()) == {short} and len(found) == min(top_k, 2)


def test_ring_compaction_under_many_refreshes() -> None:
    idx = PrefixIndex(5)
    for _ in range(3000):
        idx.record([1, 2, 3], A)
    assert len(idx.storage.lru_by_pod[A].ring) < 2000  # stale positions were dropped
    assert idx.match([1, 2, 3], [A], 5) == {A: 3}
    verify_index(idx)


def test_a_pod_set_follows_pods_added_to_and_removed_from_the_index() -> None:
    idx = PrefixIndex(100)
    candidates = PodSet([A, B])
    idx.record([1, 2, 3], A)
    assert idx.match([1, 2, 3], candidates, 5) == {A: 3}
    idx.record([1, 2], B)  # B gets its slot after the masks were first computed
    assert idx.match([1, 2, 3], candidates, 5) == {A: 3, B: 2}
    idx.remove_pod(B)
    idx.record([1, 2, 3], C)  # C reuses B's slot, but is no candidate
    assert idx.match([1, 2, 3], candidates, 5) == {A: 3}
    other = PrefixIndex(100)  # the same set used with another index: its own slots
    other.record([1], B)
    assert other.match([1, 2, 3], candidates, 5) == {B: 1}
    assert idx.match([1, 2, 3], candidates, 5) == {A: 3}


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 300))
def test_many_pages_match_the_plain_model(seed: int, top_k: int) -> None:
    """Pods over many pages of slots, matched as a list and as a PodSet, agree with
    the plain model: longest first, equal lengths at the cut drawn arbitrarily."""
    rng = random.Random(seed)
    idx, model = PrefixIndex(1000), ModelIndex(1000)
    pods = [PodId("ns", f"p{i}") for i in range(rng.randrange(60, 400))]
    hashes = [rng.getrandbits(64) for _ in range(40)]
    recorded: list[PodId] = []
    for pod in rng.sample(pods, rng.randrange(1, len(pods))):
        prompt = hashes[: rng.randrange(1, 41)] + [rng.getrandbits(64)]
        idx.record(prompt, pod)
        model.record(prompt, pod)
        recorded.append(pod)
    candidates = rng.sample(pods, rng.randrange(1, len(pods) + 1))
    wanted = set(candidates)
    lengths = {p: model.longest(hashes, p) for p in recorded if p in wanted}
    assert_top_k(idx.match(hashes, candidates, top_k), lengths, top_k)
    assert_top_k(idx.match(hashes, PodSet(candidates), top_k), lengths, top_k)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 400), st.integers(0, 3))
def test_match_lengths_gives_every_candidate_its_longest_match(
    seed: int, num_pods: int, num_excluded: int
) -> None:
    """``match_lengths``: one length per place of the candidate set, every candidate's
    longest match as the plain model has it, excluded pods 0 (for that call only), a pod
    listed twice at its first place; pods removed from and added to the index after the
    set was first used are followed."""
    rng = random.Random(seed)
    idx, model = PrefixIndex(1000), ModelIndex(1000)
    pods = [PodId("ns", f"p{i}") for i in range(num_pods)]
    hashes = [rng.getrandbits(64) for _ in range(40)]

    def record(pod: PodId) -> None:
        prompt = hashes[: rng.randrange(0, 41)] + [rng.getrandbits(64)]
        idx.record(prompt, pod)
        model.record(prompt, pod)

    for pod in rng.sample(pods, rng.randrange(1, num_pods + 1)):
        record(pod)
    places = rng.sample(pods, rng.randrange(1, num_pods + 1))
    places += rng.sample(places, min(2, len(places)))  # listed twice
    candidates = PodSet(places)
    for _ in range(2):
        excluded = set(rng.sample(places, min(num_excluded, len(places))))
        expected = [
            model.longest(hashes, pod) if pod not in excluded and places.index(pod) == i else 0
            for i, pod in enumerate(places)
        ]
        assert idx.match_lengths(hashes, candidates, excluded).tolist() == expected
        assert idx.match_lengths(hashes, candidates).tolist() == [
            model.longest(hashes, pod) if places.index(pod) == i else 0
            for i, pod in enumerate(places)
        ]
        gone = rng.choice(pods)  # the slot layout changes between the two rounds
        idx.remove_pod(gone)
        model.pods.pop(gone, None)
        record(rng.choice(pods))


def test_a_walk_past_blocks_held_only_by_other_pods_still_finds_the_candidates() -> None:
    """Pages 1-3 hold the prompt's tail for pods that are no candidates: the first
    (suffix) probe finds nothing, and the rest of the prompt is walked."""
    idx = PrefixIndex(100)
    pods = [PodId("ns", f"p{i}") for i in range(4 * 63)]
    hashes = list(range(1, 41))
    for page in (1, 2, 3):
        idx.record(hashes, pods[page * 63])  # the whole prompt, on pages 1-3
    idx.record(hashes[:10], pods[5])
    idx.record(hashes[:20], pods[7])
    idx.record(hashes[:15], pods[64])  # page 1, a candidate
    candidates = [pods[5], pods[7], pods[64], pods[100]]
    assert list(idx.match(hashes, candidates, 2).items()) == [(pods[7], 20), (pods[64], 15)]
    assert idx.match(hashes, PodSet(candidates), 5) == {pods[7]: 20, pods[64]: 15, pods[5]: 10}


def test_excluded_pods_are_left_out_for_one_call_only() -> None:
    idx = PrefixIndex(100)
    for pod, n in ((A, 3), (B, 2), (C, 1)):
        idx.record([1, 2, 3][:n], pod)
    everyone = PodSet([A, B, C, D])
    assert idx.match([1, 2, 3], everyone, 5, exclude=[A, D]) == {B: 2, C: 1}
    assert idx.match([1, 2, 3], everyone, 5) == {A: 3, B: 2, C: 1}  # cached masks intact
    assert idx.match([1, 2, 3], [A, B], 5, exclude=[A, B]) == {}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 70), st.sampled_from([0, 1, 2]))
def test_candidates_on_one_page_match_the_plain_model(seed: int, top_k: int, page: int) -> None:
    """Every candidate's slot on one page (the single-probe path), on page 0 or above,
    with pods of other pages holding the same prompt: the same lengths and order
    (longest first) as the plain model, equal lengths at the cut drawn arbitrarily."""
    rng = random.Random(seed)
    idx, model = PrefixIndex(1000), ModelIndex(1000)
    pods = [PodId("ns", f"p{i}") for i in range(3 * 63)]
    hashes = [rng.getrandbits(64) for _ in range(40)]
    for pod in pods:  # slots in list order: pods[63 * k : 63 * (k + 1)] are page k
        prompt = hashes[: rng.randrange(0, 41)] + [rng.getrandbits(64)]
        idx.record(prompt, pod)
        model.record(prompt, pod)
    page_pods = pods[63 * page : 63 * (page + 1)]
    candidates = rng.sample(page_pods, rng.randrange(1, 64))
    lengths = {p: model.longest(hashes, p) for p in candidates}
    assert_top_k(idx.match(hashes, candidates, top_k), lengths, top_k)
    assert_top_k(idx.match(hashes, PodSet(candidates), top_k), lengths, top_k)


def test_equal_matches_beyond_top_k_share_the_slots() -> None:
    """Eight pods hold the whole prompt, top-K is 5: Kthena's Go map order lets any five
    in; the first recorded must not take the slots for ever (p5-p7 never scoring)."""
    idx = PrefixIndex(1000)
    pods = [PodId("ns", f"p{i}") for i in range(8)]
    for pod in pods:
        idx.record([1, 2, 3], pod)
    idx.record([1], PodId("ns", "short"))
    times = dict.fromkeys(pods, 0)
    for _ in range(400):
        found = idx.match([1, 2, 3], [*pods, PodId("ns", "short")], 5)
        assert len(found) == 5 and set(found.values()) == {3}
        for pod in found:
            times[pod] += 1
    assert all(150 < n < 350 for n in times.values()), times  # 5/8 of 400 = 250 each


def test_longer_matches_always_take_their_slots_first() -> None:
    idx = PrefixIndex(1000)
    long_ones = [PodId("ns", f"long{i}") for i in range(3)]
    equal = [PodId("ns", f"eq{i}") for i in range(6)]
    for pod in long_ones:
        idx.record([1, 2, 3], pod)
    for pod in equal:
        idx.record([1, 2], pod)
    for seed in range(20):
        idx.rng = random.Random(seed)
        found = idx.match([1, 2, 3], [*equal, *long_ones], 5)
        assert list(found.values()) == [3, 3, 3, 2, 2]
        assert set(long_ones) < set(found)


def assert_top_k(found: dict[PodId, int], lengths: dict[PodId, int], top_k: int) -> None:
    """``found`` is a top-K Kthena could return: its pods' true lengths, longest first,
    every pod longer than the shortest kept, the rest of that length drawn arbitrarily."""
    matched = {p: n for p, n in lengths.items() if n}
    assert len(found) == min(top_k, len(matched))
    assert all(matched.get(p) == n for p, n in found.items())
    values = list(found.values())
    assert values == sorted(values, reverse=True)
    if values:
        assert {p for p, n in matched.items() if n > values[-1]} <= set(found)


@pytest.mark.parametrize(
    ("limit", "expected_a"),
    [(3, 3), (None, 8), (100, 8)],
    ids=["limited-pod-keeps-its-newest", "lifted", "above-the-index-bound-is-the-bound"],
)
def test_a_pod_limit_holds_only_that_pod_to_fewer_entries(
    limit: int | None, expected_a: int
) -> None:
    index = PrefixIndex(max_entries_per_pod=8)
    index.limit_pod(A, limit)
    for i in range(4):
        index.record([10 * i + 1, 10 * i + 2, 10 * i + 3], A)
        index.record([10 * i + 1, 10 * i + 2, 10 * i + 3], B)
    assert index.num_pod_entries(A) == expected_a
    assert index.num_pod_entries(B) == 8
    # the limit evicts as the bound does: least recently used first, the newest prompt stays
    assert index.match([31, 32, 33], [A], 1) == {A: 3}
    verify_index(index)


def test_a_removed_pod_loses_its_limit() -> None:
    index = PrefixIndex(max_entries_per_pod=8)
    index.limit_pod(A, 2)
    index.remove_pod(A)
    index.record([1, 2, 3, 4], A)
    assert index.num_pod_entries(A) == 4


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32))
def test_each_pages_slots_in_use_follow_pods_added_and_removed(seed: int) -> None:
    """``page_slots`` (a lookup leaves the owner masks unmasked when every slot in use
    on the page is a candidate) is, per page, the bits of the pods' slots there."""
    rng = random.Random(seed)
    idx = PrefixIndex(100)
    pods = [PodId("ns", f"p{i}") for i in range(rng.randrange(1, 200))]
    for _ in range(300):
        pod = rng.choice(pods)
        if rng.random() < 0.3:
            idx.remove_pod(pod)
        else:
            idx.record([rng.getrandbits(64)], pod)
    expected = [0] * len(idx.storage.page_slots)
    for lru in idx.storage.lru_by_pod.values():
        expected[lru.page] |= lru.bit
    assert idx.storage.page_slots == expected
