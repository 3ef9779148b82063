"""PreciseIndex against the simulated engine's block pool (vLLM's rules): every event the
pool publishes, in either wire layout, through the decoder into the index; the index then
predicts exactly the hit the pool finds, request after request, evictions included."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.datalayer.kv_events import apply_event, decode_batch
from extproc.pods import PodId
from extproc.prefix.precise.index import PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.sim.kv_cache import BlockPool, hash_request_tokens
from extproc.sim.kv_events import encode_event_batch

POD = PodId("default", "p0")
BS = 4


def serve(pool: BlockPool, tokens: list[int], salt: str | None) -> int:
    """One request through the pool as the engine runs it; returns the hit in tokens."""
    hashes = hash_request_tokens(tokens, BS, salt)
    hits = pool.find_longest_cache_hit(hashes, len(tokens), BS)
    pool.touch(hits)
    need = -(-len(tokens) // BS) - len(hits)
    blocks = [*hits, *pool.get_new_blocks(need)]
    pool.cache_full_blocks(blocks, hashes, len(hits), len(tokens) // BS, tokens, BS, salt)
    pool.free_blocks(reversed(blocks))
    return len(hits) * BS


def predicted(index: PreciseIndex, tokens: list[int], salt: str | None) -> int:
    gpu, _ = index.match(POD, chain_keys(tokens, BS, salt))
    return min(gpu, (len(tokens) - 1) // BS) * BS


def publish(pool: BlockPool, index: PreciseIndex, layout: str = "map") -> None:
    """The pool's events since the last call, on the wire and into the index."""
    for event in decode_batch(encode_event_batch(0.0, pool.take_events(), layout)):  # type: ignore[arg-type]
        assert apply_event(index, POD, event)


prompts = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=40),  # few values: shared prefixes
        st.sampled_from([None, "a", "b"]),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(prompts, st.sampled_from(["map", "array"]), st.integers(4, 24))
def test_index_predicts_the_pools_hits(
    requests: list[tuple[list[int], str | None]], layout: str, num_blocks: int
) -> None:
    pool = BlockPool(num_blocks, enable_kv_cache_events=True)
    index = PreciseIndex(capacity_blocks=num_blocks)
    for tokens, salt in requests:
        if -(-len(tokens) // BS) > num_blocks - 1 or (layout == "array" and salt):  # null block
            continue  # older vLLM's array layout does not publish extra keys (cache_salt)
        assert predicted(index, tokens, salt) == serve(pool, tokens, salt)
        publish(pool, index, layout)
    view = index.views.get(POD)
    if view is not None:  # every cached block, a hash cached twice (vLLM's) counted twice
        assert view.num_blocks("GPU") == pool.num_cached_blocks
        assert view.num_blocks("GPU") + sum(view.copies.get("GPU", {}).values()) == sum(
            b.block_hash is not None for b in pool.blocks
        )


def test_a_prompt_cached_twice_is_hit_after_one_copy_is_evicted() -> None:
    """A prompt of whole blocks sent twice is cached twice (its last block is always
    computed again); evicting the older copy leaves the other one to hit."""
    pool = BlockPool(5, enable_kv_cache_events=True)  # the null block and four
    index = PreciseIndex(capacity_blocks=4)
    for tokens, hit in [
        ([0] * 4, 0),
        ([0] * 4, 0),  # the same block again, in another block
        ([1] * 4 + [2] * 4 + [3] * 3, 0),  # takes the first copy's block
        ([0] * 4 + [5], 4),
    ]:
        assert predicted(index, tokens, None) == serve(pool, tokens, None) == hit
        publish(pool, index)


def test_all_blocks_cleared_empties_the_view() -> None:
    pool = BlockPool(8, enable_kv_cache_events=True)
    index = PreciseIndex(8)
    serve(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    assert pool.reset_prefix_cache()
    publish(pool, index)
    assert index.view(POD).num_blocks("GPU") == 0


def test_capacity_bounds_a_view_that_lost_its_removals() -> None:
    index = PreciseIndex(capacity_blocks=3)
    for i in range(10):  # ten unrelated blocks, no BlockRemoved: only the last 3 stay
        index.stored(POD, [i], None, [i] * BS, BS, None)
    view = index.view(POD)
    assert view.num_blocks("GPU") == 3 and view.evicted == 7
    assert len(view.keys["GPU"]) == 3


@pytest.mark.parametrize(
    ("medium", "expected"),
    [pytest.param("GPU", (2, 0), id="gpu"), pytest.param("CPU", (0, 2), id="cpu-offload")],
)
def test_media_are_counted_apart(medium: str, expected: tuple[int, int]) -> None:
    index = PreciseIndex(8)
    tokens = list(range(2 * BS))
    index.stored(POD, [10, 11], None, tokens, BS, None, medium)
    assert index.match(POD, chain_keys(tokens, BS)) == expected
    index.removed(POD, [11], medium)
    assert sum(index.match(POD, chain_keys(tokens, BS))) == 1


def test_salt_and_lora_keys_follow_the_events_extra_keys() -> None:
    index = PreciseIndex(8)
    tokens = list(range(2 * BS))
    index.stored(POD, [1, 2], None, tokens, BS, [["lora-a", "salt"], ["lora-a"]])
    assert index.match(POD, chain_keys(tokens, BS, salt="salt", lora="lora-a"))[0] == 2
    assert index.match(POD, chain_keys(tokens, BS, salt="salt"))[0] == 0
    assert index.match(POD, chain_keys(tokens, BS, lora="lora-a"))[0] == 0


def test_a_store_under_an_unknown_parent_is_an_orphan() -> None:
    index = PreciseIndex(8)
    assert index.stored(POD, [5], 999, list(range(BS)), BS, None) == 0
    assert index.view(POD).orphans == 1


@pytest.mark.parametrize("medium", ["GPU", "CPU"])
@pytest.mark.parametrize("num_copies", [2, 3])
def test_a_block_cached_again_stays_until_every_copy_is_removed(
    medium: str, num_copies: int
) -> None:
    """vLLM caches a block computed by two requests side by side twice, with a
    ``BlockStored`` per copy and a ``BlockRemoved`` per evicted copy; it hits while one
    copy is left."""
    index = PreciseIndex(8)
    tokens = [0] * BS
    keys = chain_keys(tokens, BS)
    for _ in range(num_copies):
        index.stored(POD, [7], None, tokens, BS, None, medium)
    assert index.view(POD).num_blocks(medium) == 1
    for _ in range(num_copies - 1):
        assert index.removed(POD, [7], medium) == 0
        assert sum(index.match(POD, keys)) == 1
    assert index.removed(POD, [7], medium) == 1
    assert sum(index.match(POD, keys)) == 0
    assert index.removed(POD, [7], medium) == 0


@pytest.mark.parametrize(
    "forget",
    [
        pytest.param(lambda index: index.cleared(POD), id="all-blocks-cleared"),
        pytest.param(lambda index: index.mark_stale(POD), id="stale"),
        pytest.param(  # capacity 2: two unrelated blocks push the first one out
            lambda index: [index.stored(POD, [i], None, [i] * BS, BS, None) for i in (1, 2)],
            id="over-capacity",
        ),
    ],
)
def test_a_forgotten_block_forgets_its_copies(forget: Callable[[PreciseIndex], object]) -> None:
    index = PreciseIndex(capacity_blocks=2)
    tokens = [0] * BS
    for _ in range(3):
        index.stored(POD, [7], None, tokens, BS, None)
    forget(index)
    index.stored(POD, [7], None, tokens, BS, None)  # cached once from now on
    index.removed(POD, [7])
    assert index.match(POD, chain_keys(tokens, BS)) == (0, 0)


def longest_run(index: PreciseIndex, keys: list[int]) -> tuple[int, int]:
    """``match``'s rule: each block's tier (the GPU's first), up to the first held nowhere."""
    blocks = index.view(POD).blocks
    tiers = [
        "GPU"
        if key in blocks.get("GPU", {})
        else next((m for m in blocks if key in blocks[m]), None)
        for key in keys
    ]
    run = tiers[: tiers.index(None)] if None in tiers else tiers
    return run.count("GPU"), len(run) - run.count("GPU")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["GPU", "CPU", "DISK", None]), min_size=1, max_size=12),
    st.integers(0, 12),
)
def test_a_match_is_the_leading_run_held_in_any_tier(where: list[str | None], cut: int) -> None:
    """Each block of a 12-block prompt held on the GPU, offloaded, or not held (None),
    then matched whole and cut short: the GPU run found at once, the rest block by block."""
    index = PreciseIndex(64)
    keys = chain_keys(list(range(len(where) * BS)), BS)
    blocks = index.view(POD).blocks
    for i, medium in enumerate(where):
        if medium is not None:  # key -> engine hash, as ``stored`` keeps them
            blocks.setdefault(medium, {})[keys[i]] = 1000 + i
    assert index.match(POD, keys[:cut]) == longest_run(index, keys[:cut])
    assert index.match(POD, keys) == longest_run(index, keys)


def test_only_the_first_num_keys_are_looked_for_among_seeded_blocks() -> None:
    """``provisional_in(pod, keys, num)``: the exact counts ask about the blocks matched
    (the first ``num``), not the prompt's later ones."""
    index = PreciseIndex(64)
    keys = chain_keys(list(range(4 * BS)), BS)
    index.stored(POD, [10, 11], None, list(range(2 * BS)), BS, None)  # confirmed
    index.view(POD).provisional["GPU"] = {keys[2]}  # the third block seeded, unconfirmed
    assert not index.provisional_in(POD, keys, 2)
    assert index.provisional_in(POD, keys, 3)
    assert index.provisional_in(POD, keys)
