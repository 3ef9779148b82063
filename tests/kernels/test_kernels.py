"""The compiled kernels equal their pure reference on generated inputs, and a checkout
built as the Makefile builds it runs the compiled ones."""

from __future__ import annotations

import importlib
import random
import sys

import msgpack
import numpy as np
import pytest
import xxhash
from cykhash import Int64toInt64Map
from hypothesis import given
from hypothesis import strategies as st

from extproc import kernels
from extproc.kernels import pure
from extproc.kernels.pure import Kernels, Prices
from extproc.pods import PodId
from extproc.prefix.index import PrefixIndex
from extproc.prefix.precise.keys import ROOT, block_key, chain_keys, request_extra, token_bytes
from extproc.prefix.storage import SLOTS_PER_PAGE

MASKS = st.integers(min_value=0, max_value=(1 << SLOTS_PER_PAGE) - 1)


def compiled_kernels() -> Kernels:
    """The compiled module; its absence fails the test (setup.py builds it wherever a C
    compiler is, as on every machine CI runs on): never a silent second pure run."""
    try:
        module = importlib.import_module("extproc.kernels._compiled")
    except ImportError as exc:  # pragma: no cover - the failure message
        pytest.fail(f"the compiled kernels are not built ({exc}): run `make venv`")
    found: Kernels = module.KERNELS
    return found


def test_the_checkout_runs_the_compiled_kernels_unless_told_not_to() -> None:
    compiled_kernels()
    if kernels.IMPLEMENTATION.startswith("pure"):
        assert kernels.KERNELS_ENV in kernels.IMPLEMENTATION  # chosen, not fallen back to
    else:
        assert kernels.IMPLEMENTATION == "compiled (Cython)"


def test_deepest_held_finds_each_slots_last_block() -> None:
    owners = np.array([[0b111, 0b010, 0b001, 0]], dtype=np.int64)
    places = np.array([2, 0, 1], dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    pure.deepest_held(owners, np.zeros(1, dtype=np.int64), places, out)
    # slot 0 (place 2) last holds block 2, slot 1 (place 0) block 1, slot 2 block 0
    assert out.tolist() == [2, 1, 3]


@given(
    num_pods=st.sampled_from([2, SLOTS_PER_PAGE + 2, 2 * SLOTS_PER_PAGE + 3]),  # 1 to 3 pages
    prompts=st.lists(
        st.tuples(st.integers(0, 4), st.integers(1, 30), st.integers(1, 3)), min_size=1, max_size=20
    ),
    asked=st.tuples(st.integers(0, 4), st.integers(0, 40)),
    seed=st.integers(0, 2**32 - 1),
)
def test_held_lengths_is_the_same_compiled_pure_and_by_the_storages_masks(
    num_pods: int, prompts: list[tuple[int, int, int]], asked: tuple[int, int], seed: int
) -> None:
    """From a prefix index filled with overlapping prompts on pods of every page, each
    candidate's deepest held block of a prompt is the same from both kernels and from the
    storage's own owner masks read by ``deepest_held``. The candidates are a random subset
    of the pods, placed among all of them as ``match_lengths`` places every pod and
    excludes some (their slots have places, so only the page masks leave them out), and
    some slots have no place."""
    rng = np.random.default_rng(seed)
    index = PrefixIndex(max_entries_per_pod=10_000)
    pods = [PodId("default", f"pod-{i}") for i in range(num_pods)]
    roots = rng.integers(-(2**62), 2**62, size=5)
    for at, pod in enumerate(pods):  # slots in order: the last pods' on upper pages
        index.record(np.array([at], dtype=np.int64), pod)
    for root, length, copies in prompts:
        keys = np.arange(length, dtype=np.int64) * 7919 + roots[root]
        for at in rng.choice(num_pods, size=copies):
            index.record(keys[: rng.integers(1, length + 1)], pods[at])
    storage = index.storage
    chosen = [pod for pod in pods if rng.random() < 0.6]
    page_masks = storage.candidate_masks(chosen)
    places = storage.slot_places(tuple(pods))
    places[rng.random(len(places)) < 0.1] = -1  # a candidate whose place is not wanted
    root, length = asked
    keys = np.arange(length, dtype=np.int64) * 7919 + roots[root]
    outs = []
    for implementation in (pure.KERNELS, compiled_kernels()):
        out = np.zeros(num_pods, dtype=np.int64)
        implementation.held_lengths(
            storage.owners, storage.upper_pages, storage.page_key_array, keys, page_masks,
            places, SLOTS_PER_PAGE, out,
        )  # fmt: skip
        outs.append(out)
    expected = np.zeros(num_pods, dtype=np.int64)
    if page_masks and length:
        by_block = storage.pages_by_block(keys, page_masks)
        pages, masks = storage.owner_masks(keys, by_block, page_masks, 0, length)
        pure.deepest_held(masks, pages * SLOTS_PER_PAGE, places, expected)
    np.testing.assert_array_equal(outs[0], expected)
    np.testing.assert_array_equal(outs[1], expected)


@given(
    num_rows=st.integers(0, 12),
    width=st.integers(1, 10),
    prompt_length=st.integers(1, 14),
    num_slots=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_arriving_blocks_are_the_same_compiled_and_pure(
    num_rows: int, width: int, prompt_length: int, num_slots: int, seed: int
) -> None:
    """Rows of keys from a small alphabet, so that they share prefixes of every length
    with the prompt, and rows beyond ``num_rows`` that must not count."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2, (num_rows + 2, width), dtype=np.int64)
    lengths = rng.integers(1, width + 1, num_rows + 2)
    slots = rng.integers(0, num_slots, num_rows + 2)
    prompt = rng.integers(0, 2, prompt_length, dtype=np.int64)
    found = [
        implementation.arriving_blocks(keys, lengths, slots, num_rows, prompt, num_slots)
        for implementation in (pure.KERNELS, compiled_kernels())
    ]
    assert found[0] == found[1]
    assert list(found[1]) == sorted(found[1])  # in slot order
    for slot, blocks in found[1].items():  # a row of that slot shares exactly so many
        shared = [
            next((i for i in range(n) if keys[r, i] != prompt[i]), n)
            for r in range(num_rows)
            if slots[r] == slot
            for n in [min(int(lengths[r]), prompt_length)]
        ]
        assert blocks == max(shared) > 0


@given(
    num_rows=st.integers(1, 40),
    num_scorers=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_rank_few_is_the_same_compiled_and_pure(num_rows: int, num_scorers: int, seed: int) -> None:
    """Scores, loads and weights from small ranges, so that totals and loads tie often and
    the draws decide; each implementation draws from a generator seeded alike."""
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(num_rows) < 0.8).astype(np.int64)
    scores = [rng.integers(0, 3, len(positions)) for _ in range(num_scorers)]
    weights = rng.integers(0, 3, num_scorers).tolist()
    busy, routed = rng.integers(0, 3, num_rows), rng.integers(0, 3, num_rows)
    ranked = [
        implementation.rank_few(
            scores, weights, positions, busy, routed, random.Random(seed).random
        )
        for implementation in (pure.KERNELS, compiled_kernels())
    ]
    np.testing.assert_array_equal(ranked[0], ranked[1])
    assert sorted(ranked[1].tolist()) == positions.tolist()


def test_rank_few_puts_the_highest_total_first_then_the_least_loaded() -> None:
    positions = np.array([0, 1, 2, 3], dtype=np.int64)
    scores = [np.array([10, 50, 50, 50]), np.array([0, 0, 1, 0])]
    busy = np.array([0, 5, 0, 2], dtype=np.int64)
    routed = np.array([0, 0, 7, 3], dtype=np.int64)  # row 2: 7 in flight beats its scrape
    for implementation in (pure.KERNELS, compiled_kernels()):
        ranked = implementation.rank_few(scores, [2, 1], positions, busy, routed, random.random)
        # totals 20, 100, 101, 100: row 2 first; rows 1 and 3 tie, row 3's load 3 < 5
        assert ranked.tolist() == [2, 3, 1, 0]


@given(
    num_rows=st.integers(0, 300),
    num_scorers=st.integers(0, 3),
    limit=st.integers(0, 12),
    spread=st.sampled_from([1, 37, 1 << 21, 1 << 40]),
    load_top=st.sampled_from([3, 1 << 21]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rank_best_is_the_same_compiled_and_pure(
    num_rows: int, num_scorers: int, limit: int, spread: int, load_top: int, seed: int
) -> None:
    """Few distinct totals and loads, so that ties cross the cut and the permutation
    decides; totals or loads too large for the packed key give None on both paths."""
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(num_rows) < 0.8).astype(np.int64)
    scores = [rng.integers(0, 4, len(positions)) * spread for _ in range(num_scorers)]
    weights = rng.integers(0, 3, num_scorers).tolist()
    busy, routed = rng.integers(0, load_top, num_rows), rng.integers(0, 3, num_rows)
    shuffled = rng.permutation(len(positions))
    ranked = [
        implementation.rank_best(scores, weights, positions, busy, routed, shuffled, limit)
        for implementation in (pure.KERNELS, compiled_kernels())
    ]
    if ranked[0] is None:
        assert ranked[1] is None
        return
    assert ranked[1] is not None
    np.testing.assert_array_equal(ranked[0], ranked[1])
    # the first ``limit`` of the whole stable order of ``shuffled`` by (total, load)
    totals = sum(
        (w * s for w, s in zip(weights, scores, strict=True)), np.zeros(len(positions), np.int64)
    )
    load = np.maximum(busy[positions], routed[positions])
    whole = positions[shuffled[np.lexsort((load[shuffled], -totals[shuffled]))]]
    assert ranked[1].tolist() == whole[:limit].tolist()


def test_rank_best_refuses_what_is_no_permutation() -> None:
    positions = np.arange(3, dtype=np.int64)
    zeros = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="permutation"):
        compiled_kernels().rank_best([], [], positions, zeros, zeros, np.array([0, 1, 7]), 2)
    with pytest.raises(ValueError, match="permutation"):
        compiled_kernels().rank_best([], [], positions, zeros, zeros, np.array([0, 1]), 2)


@given(
    num_rows=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    prices=st.tuples(
        *(st.floats(0.0, 200.0) for _ in range(4)),
        st.floats(0.0, 1.0),
        st.floats(0.0, 100.0),
        st.floats(1.0, 3.0),
        st.sampled_from([0.0, 150.0]),
    ),
    units_per_token=st.sampled_from([1, 4]),
)
def test_ttft_costs_are_the_same_compiled_and_pure(
    num_rows: int,
    seed: int,
    prices: tuple[float, float, float, float, float, float, float, float],
    units_per_token: int,
) -> None:
    """Bit for bit: the compiled loop does the same float operations in the same order."""
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(num_rows) < 0.8).astype(np.int64)
    units = int(rng.integers(0, 50_000))
    held = np.minimum(rng.integers(0, 60_000, len(positions)), units)
    held[rng.random(len(positions)) < 0.3] = held.max(initial=0)  # several share the longest
    requests = rng.integers(0, 6, num_rows)
    columns = (
        requests,
        requests * rng.integers(0, 9_000, num_rows),  # tokens in flight
        rng.integers(0, 12, num_rows),  # waiting
        rng.integers(0, 24, num_rows),  # running
        rng.random(num_rows) * rng.integers(0, 2),  # written (sometimes none)
        rng.integers(0, 5, num_rows).astype(np.float64),  # returning sessions
        rng.integers(0, 40_000, num_rows).astype(np.float64),  # their prompts' bytes
        # KV cache tokens: sometimes one unknown (0), sometimes small enough to weigh
        rng.integers(0 if rng.random() < 0.2 else 1, 60_000, num_rows).astype(np.float64),
    )
    outs = []
    for implementation in (pure.KERNELS, compiled_kernels()):
        uncached = np.empty(len(positions), dtype=np.int64)
        costs = np.empty(len(positions), dtype=np.float64)
        scores = np.empty(len(positions), dtype=np.int64)
        implementation.ttft_costs(
            held,
            (units, units_per_token, -(-units // units_per_token)),
            positions,
            *columns,
            Prices(*prices),
            uncached,
            costs,
            scores,
        )
        outs.append((uncached, costs, scores))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][2], outs[1][2])
    assert outs[0][1].tobytes() == outs[1][1].tobytes(), (outs[0][1], outs[1][1])


@given(
    operations=st.lists(
        st.tuples(
            st.booleans(),  # put, else discard
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40, unique=True),
        ),
        max_size=12,
    )
)
def test_the_map_writes_are_the_same_compiled_and_pure(
    operations: list[tuple[bool, list[int]]],
) -> None:
    """Puts over keys already there or not, between removals (``pure.discard_all``, which
    has no compiled twin), from a strided view too."""
    tables = []
    for implementation in (pure.KERNELS, compiled_kernels()):
        table = Int64toInt64Map()
        for n, (put, keys) in enumerate(operations):
            array = np.array(keys, dtype=np.int64)
            if put:
                implementation.put_all(table, array, array ^ n)
            else:
                pure.discard_all(table, array[::2])  # a strided view too
        tables.append(dict(table.items()))
    assert tables[0] == tables[1]


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16]),
    salt=st.sampled_from([None, "", "s1"]),
    lora=st.sampled_from([None, "adapter"]),
)
def test_token_chains_are_the_same_compiled_and_pure_and_block_by_block(
    tokens: list[int], block_size: int, salt: str | None, lora: str | None
) -> None:
    """``chain_keys`` (through the kernel in use) equals each kernel and the chain made
    block by block with ``block_key``."""
    data = token_bytes(tokens)
    num, step = len(tokens) // block_size, 4 * block_size
    by_block, parent = [], ROOT
    for i in range(num):
        parent = block_key(parent, data[i * step : (i + 1) * step], request_extra(i, salt, lora))
        by_block.append(parent)
    assert chain_keys(tokens, block_size, salt, lora) == by_block
    first, rest = (
        msgpack.packb([x for x in (lora, salt if i == 0 else None) if x]) for i in (0, 1)
    )
    first, rest = (b if b != msgpack.packb([]) else b"" for b in (first, rest))
    for implementation in (pure.KERNELS, compiled_kernels()):
        assert implementation.chain_xxh3(data, step, num, ROOT, first, rest) == by_block


@given(
    data=st.binary(max_size=700),
    step=st.integers(0, 40),
    num=st.integers(-1, 30),
    root=st.integers(0, 2**64 - 1),
    first=st.binary(max_size=12),
    rest=st.binary(max_size=12),
)
def test_token_chains_of_any_shape_are_the_same_compiled_and_pure(
    data: bytes, step: int, num: int, root: int, first: bytes, rest: bytes
) -> None:
    """Blocks past the data's end (short or empty), no extra bytes, any seed."""
    expected = pure.chain_xxh3(data, step, num, root, first, rest)
    assert compiled_kernels().chain_xxh3(data, step, num, root, first, rest) == expected


@given(
    data=st.binary(max_size=900),
    block_size=st.integers(1, 80),
    max_blocks=st.one_of(st.integers(-1, 20), st.just(2**62)),  # 2**62: no limit, no overflow
    start=st.one_of(st.sampled_from([0, 9, 10, 2**64 - 1]), st.integers(0, 2**64 - 1)),
)
def test_kthena_chains_are_the_same_compiled_and_pure_and_as_kthena_hashes(
    data: bytes, block_size: int, max_blocks: int, start: int
) -> None:
    """``chain_xxh64`` equals the rule written out (a short last block, a limit, starts of
    every decimal length), compiled and pure."""
    by_block, prev = [], start
    for offset in range(0, min(len(data), block_size * max_blocks), block_size):
        prev = xxhash.xxh64_intdigest(str(prev).encode() + data[offset : offset + block_size])
        by_block.append(prev)
    for implementation in (pure.KERNELS, compiled_kernels()):
        keys = implementation.chain_xxh64(data, block_size, max_blocks, start)
        assert keys.dtype == np.int64
        assert keys.view(np.uint64).tolist() == by_block


@pytest.mark.parametrize("block_size", [0, -64])
def test_a_chain_of_blocks_of_no_bytes_is_refused_by_both(block_size: int) -> None:
    for implementation in (pure.KERNELS, compiled_kernels()):
        with pytest.raises(ValueError, match="block_size must be > 0"):
            implementation.chain_xxh64(b"abc", block_size, 4, 0)


def _map_copy(table: Int64toInt64Map) -> Int64toInt64Map:
    copy = Int64toInt64Map()
    for key, value in table.items():
        copy[key] = value
    return copy


@given(
    num_pods=st.sampled_from([1, 3, SLOTS_PER_PAGE + 2]),  # the last: a pod on an upper page
    prompts=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=25
    ),
    seed=st.integers(0, 2**32 - 1),
    share=st.floats(0.0, 1.5),
)
def test_eviction_is_the_same_compiled_and_pure_on_index_states(
    num_pods: int, prompts: list[tuple[int, int, int]], seed: int, share: float
) -> None:
    """From a prefix index filled with overlapping prompts (shared blocks, refreshes that
    leave stale ring positions, pods on the first and on an upper page), evicting a share of
    a pod's live entries leaves the same maps, head and counts per tag either way."""
    rng = np.random.default_rng(seed)
    index = PrefixIndex(max_entries_per_pod=10_000)
    pods = [PodId("default", f"pod-{i}") for i in range(num_pods)]
    roots = rng.integers(-(2**62), 2**62, size=6)
    for at, pod in enumerate(pods):  # slots in order: the last pods' on an upper page
        index.record(np.array([at], dtype=np.int64), pod)
    targets = sorted({0, 1, num_pods - 2, num_pods - 1} & set(range(num_pods)))
    for root, length, tag in prompts:
        keys = np.arange(length, dtype=np.int64) * 7919 + roots[root]
        for at in rng.choice(targets, size=rng.integers(1, 3)):
            index.record(keys, pods[at], tag)
    storage = index.storage
    lru = storage.lru_by_pod[pods[rng.choice(targets)]]
    count = min(lru.live, int(share * lru.live))
    results = []
    for implementation in (pure.KERNELS, compiled_kernels()):
        maps = [_map_copy(m) for m in (storage.entries, storage.owners, storage.upper_pages)]
        head, by_tag = implementation.evict_oldest(
            *maps, lru.ring, lru.tags, lru.head, lru.size, lru.base, lru.key,
            storage.page_keys[lru.page], lru.bit, lru.page, count,
        )  # fmt: skip
        results.append((head, by_tag, [sorted(m.items()) for m in maps]))
    assert results[0] == results[1]
    assert sum(results[0][1].values()) == count


def test_without_the_compiled_module_the_pure_kernels_run_and_say_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    monkeypatch.delattr(kernels, "_compiled", raising=False)
    monkeypatch.setitem(sys.modules, "extproc.kernels._compiled", None)  # not built
    implementation, chosen = kernels._select()
    assert chosen is pure.KERNELS
    assert implementation.startswith("pure Python") and "C compiler" in implementation
