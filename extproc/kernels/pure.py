"""The kernels' pure reference: the functions ``_compiled.pyx`` must equal, written with
NumPy (no Python step per block or pod)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash
from cykhash import (
    Int64toInt64Map,
    Int64toInt64Map_from_buffers,
    Int64toInt64Map_to,
    update_int64toint64map,
)

Keys = npt.NDArray[np.int64]
Masks = npt.NDArray[np.int64]  # two dimensions: pages x blocks
Floats = npt.NDArray[np.float64]

_MASK_BITS = np.arange(63, dtype=np.int64)  # the bits of a non-negative int64 mask


def deepest_held(masks: Masks, first_slots: Keys, places: Keys, out: Keys) -> None:
    """Each slot's deepest block, from owner masks: ``masks[p, i]`` has bit ``b`` set when
    slot ``first_slots[p] + b`` holds block ``i``; for each such slot, ``out`` at its place
    (``places[slot]``, skipped where it is -1) becomes the number of blocks up to its
    deepest held one."""
    held_from = np.bitwise_or.accumulate(masks[:, ::-1], axis=1)[:, ::-1]  # here or later
    ends = held_from.copy()
    ends[:, :-1] &= ~held_from[:, 1:]  # the slots holding this block but no later one
    page_idx, block_idx = np.nonzero(ends)
    bit_set = (ends[page_idx, block_idx][:, np.newaxis] >> _MASK_BITS) & 1 != 0
    match_idx, bit = np.nonzero(bit_set)
    at = places[first_slots[page_idx[match_idx]] + bit]
    found = at >= 0
    out[at[found]] = block_idx[match_idx][found] + 1


def held_lengths(
    owners: Int64toInt64Map,
    upper_pages: Int64toInt64Map,
    page_keys: Keys,
    keys: Keys,
    page_masks: dict[int, int],
    places: Keys,
    slots_per_page: int,
    out: Keys,
) -> None:
    """``deepest_held`` over the prefix index's maps (``prefix.storage``): per page of
    ``page_masks`` (page -> the candidates' slot bits there), the blocks of ``keys`` that
    ``upper_pages`` says the page may hold (every block on page 0), probed in ``owners``
    (block key XOR the page's key; ``page_keys[0]`` is 0) and kept to the candidates;
    each candidate slot's deepest held block goes to ``out`` at its place."""
    upper = 0
    for page in page_masks:
        upper |= (1 << page) if page else 0
    pages_by_block = lookup(upper_pages, keys, 0) & upper if upper else np.zeros_like(keys)
    if 0 in page_masks:
        pages_by_block |= 1
    for page, mask in page_masks.items():
        rows = np.flatnonzero((pages_by_block >> page) & 1)
        if not len(rows):
            continue
        masks = np.zeros((1, len(keys)), dtype=np.int64)
        masks[0, rows] = lookup(owners, keys[rows] ^ page_keys[page], 0) & mask
        first_slot = np.array([page * slots_per_page], dtype=np.int64)
        deepest_held(masks, first_slot, places, out)


def lookup(table: Int64toInt64Map, keys: Keys, default: int) -> Keys:
    """``table[key]`` per key (``default`` where absent): one batch probe."""
    found = np.empty(len(keys), dtype=np.int64)
    Int64toInt64Map_to(table, keys, found, False, default)
    return found


def arriving_blocks(
    keys: Masks, lengths: Keys, slots: Keys, num_rows: int, prompt: Keys, num_slots: int
) -> dict[int, int]:
    """Per slot below ``num_slots``, the most leading blocks ``prompt`` shares with a row
    sent to it (row ``r`` of the first ``num_rows``: its first ``lengths[r]`` keys, sent
    to ``slots[r]``); only slots sharing one or more, in slot order."""
    n = num_rows
    width = min(keys.shape[1], len(prompt))
    equal = keys[:n, :width] == prompt[:width]
    first_difference = np.where(equal.all(axis=1), width, equal.argmin(axis=1))
    longest = np.zeros(num_slots, dtype=np.int64)
    np.maximum.at(longest, slots[:n], np.minimum(first_difference, lengths[:n]))
    found = np.flatnonzero(longest)
    return dict(zip(found.tolist(), longest[found].tolist(), strict=True))


def rank_few(
    scores: list[Keys],
    weights: list[int],
    positions: Keys,
    busy: Keys,
    routed: Keys,
    random: Callable[[], float],
) -> Keys:
    """``positions`` best first: by total ``sum(weight * score)`` (``scores[j]`` one per
    position, weighed ``weights[j]``), equal totals least loaded first (``max(busy,
    routed)`` at the position's row), then by one ``random()`` drawn per position, in
    order (a seeded ``random`` repeats the order)."""
    totals = np.zeros(len(positions), dtype=np.int64)
    for weight, scored in zip(weights, scores, strict=True):
        totals += weight * scored
    load = np.maximum(busy[positions], routed[positions])
    tiebreak = np.array([random() for _ in range(len(positions))])
    ranked: Keys = positions[np.lexsort((tiebreak, load, -totals))]
    return ranked


RANK_FIELD_BITS = 21  # ``rank_best``'s key: three fields of this many bits in an int64
RANK_FIELD = 1 << RANK_FIELD_BITS


def rank_best(
    scores: list[Keys],
    weights: list[int],
    positions: Keys,
    busy: Keys,
    routed: Keys,
    shuffled: Keys,
    limit: int,
) -> Keys | None:
    """The first ``limit`` of ``positions`` in ``rank_few``'s order (total, then load),
    equal keys in the order of ``shuffled`` (a permutation of ``range(len(positions))``),
    without sorting them all; None when a field does not fit its bits (then sort).

    One int64 key per position packs how far its total is behind the best, its load and
    its place in ``shuffled``: unique keys, so the ``limit`` smallest, in order, are
    exactly the first ``limit`` of that stable sort."""
    limit = min(limit, len(positions))
    if limit <= 0:
        return positions[:0].copy()
    totals = np.zeros(len(positions), dtype=np.int64)
    for weight, scored in zip(weights, scores, strict=True):
        totals += weight * scored
    load = np.maximum(busy[positions], routed[positions])
    behind = totals.max() - totals
    if (
        len(positions) >= RANK_FIELD
        or behind.max() >= RANK_FIELD
        or not 0 <= load.min() <= load.max() < RANK_FIELD
    ):
        return None
    place = np.empty(len(shuffled), dtype=np.int64)
    place[shuffled] = np.arange(len(shuffled))
    keys = (behind << (2 * RANK_FIELD_BITS)) | (load << RANK_FIELD_BITS) | place
    best = np.argpartition(keys, limit - 1)[:limit]
    ranked: Keys = positions[best[np.argsort(keys[best])]]
    return ranked


def put_all(table: Int64toInt64Map, keys: Keys, values: Keys) -> None:
    """``table[keys[i]] = values[i]`` for each ``i`` (keys distinct): a map of the pairs
    built, then merged, as cykhash offers no batch insert of its own."""
    update_int64toint64map(table, Int64toInt64Map_from_buffers(keys, values))


def discard_all(table: Int64toInt64Map, keys: Keys) -> None:
    """Each of ``keys`` out of ``table`` (absent ones ignored): ``drop_live``'s removals,
    rare enough (a pod leaving, and the reference's eviction) to need no compiled twin."""
    for key in keys.tolist():
        table.discard(key)


def drop_live(
    entries: Int64toInt64Map,
    owners: Int64toInt64Map,
    upper_pages: Int64toInt64Map,
    keys: Keys,
    lru_key: int,
    page_key: int,
    bit: int,
    page: int,
) -> None:
    """Remove one pod's live entries (their block keys) from the three maps, as
    ``evict_oldest`` describes (also used as it is when a pod leaves the index)."""
    discard_all(entries, keys ^ lru_key)
    owner_keys = keys ^ page_key
    masks = lookup(owners, owner_keys, 0) & ~bit
    emptied = masks == 0
    put_all(owners, owner_keys[~emptied], masks[~emptied])
    discard_all(owners, owner_keys[emptied])
    if page:
        gone = keys[emptied]
        pages = lookup(upper_pages, gone, 0) & ~(1 << page)
        put_all(upper_pages, gone[pages != 0], pages[pages != 0])
        discard_all(upper_pages, gone[pages == 0])


def evict_oldest(
    entries: Int64toInt64Map,
    owners: Int64toInt64Map,
    upper_pages: Int64toInt64Map,
    ring: Keys,
    tags: Keys,
    head: int,
    size: int,
    base: int,
    lru_key: int,
    page_key: int,
    bit: int,
    page: int,
    count: int,
) -> tuple[int, dict[int, int]]:
    """Drop the ``count`` oldest live entries of one pod's ring from the prefix index's
    maps (``prefix.storage``): ``ring[head:size]``, position ``i`` holding sequence number
    ``base + i``, is live where ``entries`` maps its block key XOR ``lru_key`` to that
    number. A dropped block leaves ``entries``; its page's owner mask (``owners``, at the
    key XOR ``page_key``) loses ``bit``, and goes at 0; then, on an upper page (``page`` >
    0), the block's mask of pages (``upper_pages``) loses the page, and goes at 0. Returns
    the new head (after the last entry dropped, or ``size``) and the drops per tag."""
    by_tag: dict[int, int] = {}
    while count and head < size:
        stop = min(size, head + max(2 * count, 256))
        window = ring[head:stop]
        seqs = lookup(entries, window ^ lru_key, -1)
        live_pos = np.flatnonzero(seqs == np.arange(base + head, base + stop))[:count]
        drop_live(entries, owners, upper_pages, window[live_pos], lru_key, page_key, bit, page)
        for tag in tags[head + live_pos].tolist():
            by_tag[tag] = by_tag.get(tag, 0) + 1
        count -= len(live_pos)
        head = head + int(live_pos[-1]) + 1 if not count else stop
    return head, by_tag


def chain_xxh3(
    data: bytes, step: int, num: int, root: int, first_extra: bytes, extra: bytes
) -> list[int]:
    """Chained XXH3-64 keys of ``num`` blocks of ``step`` bytes of ``data``: block ``i``'s
    key is the digest of its bytes followed by ``first_extra`` (block 0) or ``extra``
    (the others), seeded with the previous block's key (``root`` for block 0)."""
    keys: list[int] = []
    parent = root
    for i in range(num):
        tail = first_extra if i == 0 else extra
        parent = xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step] + tail, parent)
        keys.append(parent)
    return keys


def chain_xxh64(data: bytes, block_size: int, max_blocks: int, start: int) -> Keys:
    """Kthena's chain (``prefix.hashing``'s module doc) over ``data``'s first ``max_blocks``
    blocks of ``block_size`` bytes (the last may be shorter): block ``i``'s key is the
    XXH64 (seed 0) of the previous key's unsigned decimal text (``start`` for block 0)
    followed by the block's bytes; as int64 with the same bits."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    prev = start
    out: list[int] = []
    for offset in range(0, min(len(data), block_size * max_blocks), block_size):
        prev = xxhash.xxh64_intdigest(b"%d" % prev + data[offset : offset + block_size])
        out.append(prev)
    return np.array(out, dtype=np.uint64).view(np.int64)


BYTES_PER_TOKEN = 4  # the usual estimate for English text and code with BPE tokenizers


def session_weight(mean: float, held_bytes: int, capacity: Floats) -> float:
    """``min(1, mean * share)`` (estimated-ttft's module doc): ``mean`` live returning
    sessions per candidate, ``share`` the part of the candidates' KV caches (``capacity``:
    tokens per candidate, 0 where unknown) their latest prompts (``held_bytes``) fill; 1
    when a candidate's cache size is unknown."""
    if len(capacity) == 0 or capacity.min() <= 0:
        return 1.0
    return min(1.0, mean * held_bytes / BYTES_PER_TOKEN / float(capacity.sum()))


class Prices(NamedTuple):
    """estimated-ttft's prices (``scheduling.plugins.estimated_ttft``'s arguments)."""

    prefill_ms_per_token: float
    queued_ms: float
    running_ms: float
    written_ms: float
    affinity_min_match: float
    affinity_margin_ms: float
    affinity_ratio: float
    session_ms: float


def ttft_costs(
    held: Keys,
    prompt: tuple[int, int, int],
    positions: Keys,
    requests: Keys,
    tokens: Keys,
    waiting: Keys,
    running: Keys,
    written: Floats,
    sessions: Floats,
    session_bytes: Floats,
    capacity: Floats,
    prices: Prices,
    uncached_out: Keys,
    costs_out: Floats,
    scores_out: Keys,
) -> None:
    """estimated-ttft's cost and score of each candidate (its module doc says what each
    term is; the cheapest scores 100, the dearest 0).

    ``held``: per candidate, the prompt units it holds; ``prompt``: the prompt's units,
    units per token and tokens; ``positions``: the candidates' rows of the pod table, whose
    columns are ``requests``/``tokens`` (in flight), ``waiting``/``running`` (scraped),
    ``written`` (relative tokens written), ``sessions`` (returning sessions placed, the
    request's own left out), ``session_bytes`` (their latest prompts' bytes) and
    ``capacity`` (KV cache tokens, 0 where unknown); the last three are read only with a
    session price, which ``session_weight`` scales. ``sessions``, ``session_bytes`` and
    ``capacity`` hold whole numbers (below 2**53), so their sums are exact in any order.
    Out: each candidate's uncached tokens, cost and score."""
    p = prices
    units, units_per_token, num_tokens = prompt
    uncached = -((held - units) // units_per_token)
    num_in_flight, in_flight_tokens = requests[positions], tokens[positions]
    waiting, running = waiting[positions], running[positions]
    queued = waiting + np.maximum(0, num_in_flight - waiting - running)
    mean_tokens = np.where(
        num_in_flight > 0,
        in_flight_tokens / np.maximum(num_in_flight, 1),
        float(num_tokens),
    )
    costs: Floats = (
        p.prefill_ms_per_token * (queued * mean_tokens + uncached)
        + p.queued_ms * (1 + queued)
        + p.running_ms * running
    )
    written = written[positions]
    most = written.max(initial=0.0)
    if most > 0:
        costs += p.written_ms / (most * max(1, num_tokens)) * written * uncached
    longest = int(held.max(initial=0))
    if longest > 0 and longest / max(1, units) >= p.affinity_min_match:
        affinity = held == longest
        est = costs[affinity]
        costs[affinity] = np.minimum(est - p.affinity_margin_ms, est / p.affinity_ratio)
    if p.session_ms > 0:
        counts = sessions[positions]
        mean = max(1.0, counts.sum() / max(1, len(counts)))
        weight = session_weight(mean, int(session_bytes[positions].sum()), capacity[positions])
        price = p.session_ms * weight if weight < 1.0 else p.session_ms
        costs += price * counts / mean
    uncached_out[:] = uncached
    costs_out[:] = costs
    if not len(costs):
        return
    lo, hi = costs.min(), costs.max()
    if hi == lo:
        scores_out[:] = 100
    else:
        scores_out[:] = (100 * (hi - costs) / (hi - lo)).astype(np.int64)


class Kernels(NamedTuple):
    """One implementation's functions (the compiled ones are typed as their references:
    ``tests/kernels`` calls both the same way)."""

    held_lengths: Callable[..., None]  # ``held_lengths``'s parameters
    arriving_blocks: Callable[[Masks, Keys, Keys, int, Keys, int], dict[int, int]]
    rank_few: Callable[[list[Keys], list[int], Keys, Keys, Keys, Callable[[], float]], Keys]
    rank_best: Callable[[list[Keys], list[int], Keys, Keys, Keys, Keys, int], Keys | None]
    ttft_costs: Callable[..., None]  # ``ttft_costs``'s parameters
    put_all: Callable[[Int64toInt64Map, Keys, Keys], None]
    chain_xxh3: Callable[[bytes, int, int, int, bytes, bytes], list[int]]
    chain_xxh64: Callable[[bytes, int, int, int], Keys]
    evict_oldest: Callable[..., tuple[int, dict[int, int]]]  # ``evict_oldest``'s parameters


KERNELS = Kernels(
    held_lengths,
    arriving_blocks,
    rank_few,
    rank_best,
    ttft_costs,
    put_all,
    chain_xxh3,
    chain_xxh64,
    evict_oldest,
)
