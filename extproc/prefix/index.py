"""Which pods were recently sent which prompt blocks: one LRU per pod, compact and batched.

Rules (Kthena's prefix-cache spec):

* Each pod has an LRU list of at most ``max_entries_per_pod`` block entries; one block
  recorded for three pods is three entries. A full list drops its least recently used
  entry (an eviction). Removing a pod drops all its entries (not evictions). Recording
  a block a pod already has refreshes it.
* A record is one step: the prompt's blocks the pod already has are refreshed, the new
  ones added, then the least recently used entries beyond the limit are dropped. The
  list ends exactly as Kthena's, which adds the blocks one at a time (tail first),
  evicting as it goes.
* Evictions are counted as Kthena counts them, per evicted entry's tag (the plugin's
  model): the entries no longer in the list afterwards, plus the prompt's own blocks
  Kthena's one-at-a-time adds evict before reaching them and then add again.
* A lookup walks the prompt's hashes from the last block backwards; because hashes are
  chained, the first hit for a pod is its longest match. At most ``top_k`` pods are
  returned, longest first; among pods with the same match length where only some fit,
  a random draw decides (Kthena's Go map order is arbitrary there).

A record touches a prompt's blocks tail first, so the first block ends most recently
used and the tail is evicted first: the order in which vLLM returns a finished request's
blocks to its free queue (``KVCacheManager.free``), so the estimate keeps a shared system
prompt as long as the engine does.

Memory and speed: no Python object per entry. Entries live in C hash maps (cykhash) and
NumPy ring buffers, and a prompt's blocks are looked up and stored in one batch call
each, so the per-request cost is a few dozen C calls, not one Python loop per block.

Layout:

* ``_entries``: entry key (block hash XOR the pod slot's key) -> the entry's sequence
  number in its pod's ring. An entry is live iff its ring position holds that number.
* ``_owners``: (block hash XOR the page's key) -> bitmask of the page's pod slots holding
  the block. Pods get slots, 63 to a page, so a mask fits a non-negative int64.
* ``_upper_pages``: block hash -> bitmask of the pages other than page 0 holding it, so a
  lookup costs one batch probe whatever the number of pods.

Hashes are stored as the int64 with the same 64 bits as the unsigned XXH64 digest.
Chained hashes of one prompt are distinct, which the batch updates rely on.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import xxhash
from cykhash import (
    Int64toInt64Map,
    Int64toInt64Map_from_buffers,
    Int64toInt64Map_to,
    update_int64toint64map,
)

from extproc.pods import PodId
from extproc.prefix.hashing import Keys, as_keys

SLOTS_PER_PAGE = 63  # bit 63 would make a mask negative
MAX_PAGES = 63
MAX_PODS = SLOTS_PER_PAGE * MAX_PAGES
_SLOT_BITS = np.arange(SLOTS_PER_PAGE, dtype=np.int64)


def _mix_key(kind: bytes, number: int) -> int:
    """A fixed pseudo-random int64, distinct per (kind, number)."""
    digest = xxhash.xxh64_intdigest(b"%s:%d" % (kind, number), 0x9E37_79B9)
    return int(np.uint64(digest).view(np.int64))


def _lookup(table: Int64toInt64Map, keys: Keys, default: int) -> Keys:
    out = np.empty(len(keys), dtype=np.int64)
    Int64toInt64Map_to(table, keys, out, False, default)
    return out


def _assign(table: Int64toInt64Map, keys: Keys, values: Keys) -> None:
    update_int64toint64map(table, Int64toInt64Map_from_buffers(keys, values))


def _popcount(values: Keys) -> npt.NDArray[np.integer[Any]]:
    """Set bits of each (non-negative) value."""
    if hasattr(np, "bitwise_count"):  # NumPy 2
        counts: npt.NDArray[np.integer[Any]] = np.bitwise_count(values)
        return counts
    as_bytes = np.ascontiguousarray(values).view(np.uint8)
    summed: npt.NDArray[np.integer[Any]] = (
        np.unpackbits(as_bytes).reshape(len(values), 64).sum(axis=1)
    )
    return summed


def _first_split(pages_by_block: Keys, top_k: int) -> int:
    """Where a match walks to first: the last block from which on at least ``top_k``
    pages hold some block (0 if none). A walk finds pods longest match first, so when
    that suffix yields ``top_k`` pods the blocks before it need no probe at all (a
    shared system prompt on every page, say); otherwise the rest is walked after.
    """
    held_from = np.bitwise_or.accumulate(pages_by_block[::-1])[::-1]
    enough = np.flatnonzero(_popcount(held_from) >= top_k)
    return int(enough[-1]) if len(enough) else 0


@dataclass(slots=True)
class _PodLru:
    """One pod's LRU order: a ring of block hashes, oldest at ``head``, lazily deleted.

    ``ring[i]`` (for ``head <= i < size``) has sequence number ``base + i``. Refreshing an
    entry appends it again; the older position goes stale, since ``_entries`` now holds
    the newer number.
    """

    slot: int
    key: int  # XOR-ed into block hashes to make this pod's entry keys
    page: int  # slot // SLOTS_PER_PAGE
    bit: int  # this slot's bit in its page's owner masks
    ring: Keys = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    tags: Keys = field(default_factory=lambda: np.empty(256, dtype=np.int64))  # per position
    head: int = 0
    size: int = 0
    base: int = 0
    live: int = 0

    def seqs(self, start: int, stop: int) -> Keys:
        return np.arange(self.base + start, self.base + stop, dtype=np.int64)


class PodSet:
    """Candidate pods for ``PrefixIndex.match`` that are matched many times (e.g. one pod
    snapshot's): the index computes their slot masks once and keeps them here until its
    slot layout changes (a pod added or removed), instead of once per call; likewise,
    for ``match_lengths``, where each slot's pod is in ``pods``.
    """

    __slots__ = ("_cached", "_places", "pods")

    def __init__(self, pods: Iterable[PodId]) -> None:
        self.pods = tuple(pods)
        self._cached: tuple[PrefixIndex, int, dict[int, int]] | None = None
        self._places: tuple[PrefixIndex, int, Keys] | None = None


class IndexObserver(Protocol):
    """Told of an index's changes (its metrics), after each update, outside its lock."""

    def entries_changed(self, delta: int) -> None:
        """The index holds ``delta`` more entries (fewer when negative)."""
        ...

    def evicted(self, by_tag: Mapping[int, int]) -> None:
        """A record evicted these many entries of each tag, as Kthena counts them."""
        ...


class PrefixIndex:
    """Per-pod LRU of recorded block hashes, and the lookup that scores against it.

    Thread-safe: every public method holds the index's own lock.
    """

    def __init__(
        self,
        max_entries_per_pod: int,
        rng: random.Random | None = None,
        observer: IndexObserver | None = None,
    ) -> None:
        if max_entries_per_pod <= 0:
            raise ValueError(f"max_entries_per_pod must be > 0, got {max_entries_per_pod}")
        self.max_entries_per_pod = max_entries_per_pod
        self.observer = observer
        # draws among equal matches beyond top-K; seeded, so a simulation replays exactly
        self.rng = rng if rng is not None else random.Random(0)
        self._entries = Int64toInt64Map()
        self._owners = Int64toInt64Map()
        self._upper_pages = Int64toInt64Map()
        self._lru_by_pod: dict[PodId, _PodLru] = {}
        self._pod_by_slot: dict[int, PodId] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._page_keys = [0] + [_mix_key(b"page", p) for p in range(1, MAX_PAGES)]
        self._page_key_array = np.array(self._page_keys, dtype=np.int64)
        self._slots_version = 0  # bumped whenever a pod gets or gives up a slot
        self._num_entries = 0
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        """Entries stored across all pods. Read under the lock: a record adds its new
        blocks before it evicts, so a reader between the two would see the bound exceeded."""
        with self._lock:
            return self._num_entries

    def num_pod_entries(self, pod: PodId) -> int:
        lru = self._lru_by_pod.get(pod)
        return lru.live if lru else 0

    def pods(self) -> list[PodId]:
        return list(self._lru_by_pod)

    def match(
        self,
        hashes: Sequence[int] | Keys,
        candidates: Iterable[PodId] | PodSet,
        top_k: int,
        exclude: Iterable[PodId] = (),
    ) -> dict[PodId, int]:
        """Longest recorded match, in blocks, for up to ``top_k`` candidate pods.

        Pods are found from the longest match down; when more pods share the last
        length that fits than there is room for, those that get in are drawn at random.
        Pods with no match are left out. A ``PodSet`` keeps the candidates' slot
        masks between calls (until a pod is added to or removed from the index); pods
        in ``exclude`` are taken out of the candidates for this call.
        """
        keys = as_keys(hashes)
        with self._lock:
            if isinstance(candidates, PodSet):
                page_masks = self._pod_set_masks(candidates)
            else:
                page_masks = self._candidate_masks(candidates)
            page_masks = self._less(page_masks, exclude)
            if not page_masks or top_k <= 0 or not len(keys):
                return {}
            if len(page_masks) == 1:  # up to 63 pods: one probe, no page bookkeeping
                ((page, mask),) = page_masks.items()
                return self._match_page(keys, page, mask, top_k)
            pages_by_block = self._pages_by_block(keys, page_masks)
            split = _first_split(pages_by_block, top_k)
            found: dict[PodId, int] = {}
            seen: dict[int, int] = {}  # page -> candidates found so far
            for start, stop in ((split, len(keys)), (0, split)):
                if start < stop and self._walk(
                    keys, pages_by_block, page_masks, start, stop, top_k, found, seen
                ):
                    break
            return found

    def match_lengths(
        self, hashes: Sequence[int] | Keys, candidates: PodSet, exclude: Iterable[PodId] = ()
    ) -> Keys:
        """Every candidate's longest recorded match, in blocks: one per pod of
        ``candidates.pods``, in its order (0: no match, or excluded; a pod listed twice
        gets its length at its first place). No top-K, so no draws.

        The matches come out as slot masks per page and block (where a candidate's
        longest match ends), turned into places in ``candidates.pods`` with array
        operations: no step per pod.
        """
        keys = as_keys(hashes)
        out = np.zeros(len(candidates.pods), dtype=np.int64)
        with self._lock:
            page_masks = self._less(self._pod_set_masks(candidates), exclude)
            if not page_masks or not len(keys):
                return out
            pages_by_block = self._pages_by_block(keys, page_masks)
            pages, masks = self._owner_masks(keys, pages_by_block, page_masks, 0, len(keys))
            if not len(pages):
                return out
            held_from = np.bitwise_or.accumulate(masks[:, ::-1], axis=1)[:, ::-1]
            ends = held_from.copy()
            ends[:, :-1] &= ~held_from[:, 1:]
            page_idx, block_idx = np.nonzero(ends)
            bit_set = (ends[page_idx, block_idx][:, np.newaxis] >> _SLOT_BITS) & 1 != 0
            match_idx, bit = np.nonzero(bit_set)
            slots = pages[page_idx[match_idx]] * SLOTS_PER_PAGE + bit
            out[self._pod_set_places(candidates)[slots]] = block_idx[match_idx] + 1
        return out

    def _less(self, page_masks: dict[int, int], exclude: Iterable[PodId]) -> dict[int, int]:
        """``page_masks`` without the slots of ``exclude`` (a copy if any: a PodSet's
        masks stay as cached)."""
        excluded = [lru for lru in map(self._lru_by_pod.get, exclude) if lru is not None]
        if excluded:
            page_masks = dict(page_masks)
            for lru in excluded:
                left = page_masks.get(lru.page, 0) & ~lru.bit
                if left:
                    page_masks[lru.page] = left
                else:
                    page_masks.pop(lru.page, None)
        return page_masks

    def _pod_set_places(self, pod_set: PodSet) -> Keys:
        """Slot -> the first place of its pod in ``pod_set.pods`` (-1: none), kept in the
        set until the slot layout changes."""
        cached = pod_set._places
        if cached is not None and cached[0] is self and cached[1] == self._slots_version:
            return cached[2]
        places = np.full(max(self._next_slot, 1), -1, dtype=np.int64)
        for place in range(len(pod_set.pods) - 1, -1, -1):
            lru = self._lru_by_pod.get(pod_set.pods[place])
            if lru is not None:
                places[lru.slot] = place
        pod_set._places = (self, self._slots_version, places)
        return places

    def _pod_set_masks(self, pod_set: PodSet) -> dict[int, int]:
        cached = pod_set._cached  # (index, slot layout version, masks), swapped as one
        if cached is not None and cached[0] is self and cached[1] == self._slots_version:
            return cached[2]
        masks = self._candidate_masks(pod_set.pods)
        pod_set._cached = (self, self._slots_version, masks)
        return masks

    def _candidate_masks(self, candidates: Iterable[PodId]) -> dict[int, int]:
        """Page -> bitmask of the candidates' slots (pods unknown to the index left out)."""
        lrus = [lru for lru in map(self._lru_by_pod.get, candidates) if lru is not None]
        if len(lrus) <= SLOTS_PER_PAGE:
            masks: dict[int, int] = {}
            for lru in lrus:
                masks[lru.page] = masks.get(lru.page, 0) | lru.bit
            return masks
        slots = np.fromiter((lru.slot for lru in lrus), dtype=np.int64, count=len(lrus))
        by_page = np.zeros(MAX_PAGES, dtype=np.int64)
        np.bitwise_or.at(by_page, slots // SLOTS_PER_PAGE, np.left_shift(1, slots % SLOTS_PER_PAGE))
        return {int(page): int(by_page[page]) for page in np.flatnonzero(by_page)}

    def _pages_by_block(self, keys: Keys, page_masks: dict[int, int]) -> Keys:
        """Per block, the candidate pages that may hold it: the upper pages
        ``_upper_pages`` says hold it, and page 0 (not tracked there) at every block.
        (``match`` calls it with two pages or more: a single page is ``_match_page``'s.)"""
        upper = 0
        for page in page_masks:
            upper |= (1 << page) if page else 0
        pages_by_block = _lookup(self._upper_pages, keys, 0) & upper
        if 0 in page_masks:
            pages_by_block |= 1
        return pages_by_block

    def _match_page(self, keys: Keys, page: int, mask: int, top_k: int) -> dict[PodId, int]:
        """``match`` when every candidate is on one page: its owner masks in one probe,
        then, last block first, the blocks where some candidate's longest match ends."""
        owners = _lookup(self._owners, keys ^ self._page_keys[page] if page else keys, 0)
        owners &= mask
        held_from = np.bitwise_or.accumulate(owners[::-1])[::-1]  # held here or later
        ends = held_from.copy()
        ends[:-1] ^= held_from[1:]  # the candidates holding this block but no later one
        at = np.flatnonzero(ends)[::-1]
        found: dict[PodId, int] = {}
        for idx, bits in zip(at.tolist(), ends[at].tolist(), strict=True):
            if self._add_found(found, self._slot_pods(page, bits), idx + 1, top_k):
                break
        return found

    def _slot_pods(self, page: int, bits: int) -> list[PodId]:
        """The pods of ``page`` whose slot bits are set, in slot order."""
        first_slot = page * SLOTS_PER_PAGE
        pods = []
        while bits:
            low = bits & -bits
            bits ^= low
            pods.append(self._pod_by_slot[first_slot + low.bit_length() - 1])
        return pods

    def _add_found(
        self, found: dict[PodId, int], pods: list[PodId], length: int, top_k: int
    ) -> bool:
        """Add ``pods``, matched ``length`` blocks, until ``found`` holds ``top_k``;
        returns whether it does. When only some fit, they are drawn at random (Kthena
        walks a Go map there, whose order is arbitrary), so pods holding the same prefix
        share the top-K slots instead of the first recorded taking them for ever."""
        room = top_k - len(found)
        if len(pods) > room:
            pods = self.rng.sample(pods, room)
        for pod in pods:
            found[pod] = length
        return len(found) == top_k

    def _walk(
        self,
        keys: Keys,
        pages_by_block: Keys,
        page_masks: dict[int, int],
        start: int,
        stop: int,
        top_k: int,
        found: dict[PodId, int],
        seen: dict[int, int],
    ) -> bool:
        """Walk blocks ``stop - 1`` down to ``start``, adding to ``found`` each candidate
        not ``seen`` at a later block; returns True once ``top_k`` are found.

        Owner masks are probed in one batch, only where a page may hold the block.
        """
        page_array, masks = self._owner_masks(keys, pages_by_block, page_masks, start, stop)
        if not len(page_array):
            return False
        pages = page_array.tolist()
        # new[p, i]: candidates of page p holding block i but no later block, i.e. the
        # pods a walk from the last block backwards finds at block i.
        held_from = np.bitwise_or.accumulate(masks[:, ::-1], axis=1)[:, ::-1]
        new = held_from.copy()
        new[:, :-1] &= ~held_from[:, 1:]
        if seen:
            new &= ~np.array([seen.get(page, 0) for page in pages], dtype=np.int64)[:, np.newaxis]
        for idx in np.flatnonzero(new.any(axis=0))[::-1].tolist():
            level = [
                pod
                for page, bits in zip(pages, new[:, idx].tolist(), strict=True)
                if bits
                for pod in self._slot_pods(page, bits)
            ]
            if self._add_found(found, level, start + idx + 1, top_k):
                return True
        for page, bits in zip(pages, held_from[:, 0].tolist(), strict=True):
            seen[page] = seen.get(page, 0) | bits
        return False

    def _owner_masks(
        self, keys: Keys, pages_by_block: Keys, page_masks: dict[int, int], start: int, stop: int
    ) -> tuple[Keys, Keys]:
        """The pages some block of ``start:stop`` may be held on, and per such page and
        block the candidates' slots holding it: one batch probe, only where
        ``pages_by_block`` says the page may hold the block."""
        present = int(np.bitwise_or.reduce(pages_by_block[start:stop]))
        pages = []
        while present:
            low = present & -present
            present ^= low
            pages.append(low.bit_length() - 1)
        page_array = np.array(pages, dtype=np.int64)
        held = (pages_by_block[np.newaxis, start:stop] >> page_array[:, np.newaxis]) & 1 != 0
        probes = (keys[np.newaxis, start:stop] ^ self._page_key_array[page_array][:, np.newaxis])[
            held
        ]
        masks = np.zeros((len(pages), stop - start), dtype=np.int64)
        masks[held] = _lookup(self._owners, probes, 0)
        masks &= np.array([page_masks[page] for page in pages], dtype=np.int64)[:, np.newaxis]
        return page_array, masks

    # -- updates -------------------------------------------------------------------

    def record(self, hashes: Sequence[int] | Keys, pod: PodId, tag: int = 0) -> int:
        """Record a prompt's blocks for ``pod``, the entries tagged ``tag`` (the plugin's
        model); returns the evictions, as Kthena counts them (the observer gets them by
        the evicted entries' tags).

        Blocks are touched tail first, so the first block ends most recently used.
        """
        added, by_tag = self._record(hashes, pod, tag)
        if self.observer is not None:
            self.observer.entries_changed(added)
            if by_tag:
                self.observer.evicted(by_tag)
        return sum(by_tag.values())

    def _record(
        self, hashes: Sequence[int] | Keys, pod: PodId, tag: int
    ) -> tuple[int, dict[int, int]]:
        """``record``: the entries it adds less those it drops, and its evictions by
        the evicted entries' tags."""
        keys = np.ascontiguousarray(as_keys(hashes)[::-1])
        if not len(keys):
            return 0, {}
        with self._lock:
            lru = self._lru_by_pod.get(pod) or self._add_pod(pod)
            entry_keys = keys ^ lru.key
            seqs = _lookup(self._entries, entry_keys, -1)
            is_new = seqs < 0
            evicted = max(0, lru.live + int(is_new.sum()) - self.max_entries_per_pod)
            by_tag: dict[int, int] = {}
            # A held block has at least live - (ring positions after it) entries older than
            # it; Kthena cannot reach it before evicting `evicted` others (docstring below).
            held_seqs = seqs[~is_new]
            if (
                evicted
                and len(held_seqs)
                and lru.live - (lru.base + lru.size - int(held_seqs.min()))
                < evicted + len(held_seqs)
            ):
                readded = self._kthena_readds(lru, keys, is_new, evicted)
                if len(readded):  # counted under the tags they had
                    seqs = _lookup(self._entries, readded ^ lru.key, -1)
                    for old_tag in lru.tags[seqs - lru.base].tolist():
                        by_tag[old_tag] = by_tag.get(old_tag, 0) + 1
            start = self._append(lru, keys, tag)
            _assign(self._entries, entry_keys, lru.seqs(start, start + len(keys)))
            new_keys = keys[is_new]
            if len(new_keys):
                self._set_owner(lru, new_keys)
                lru.live += len(new_keys)
                self._num_entries += len(new_keys)
            if evicted:
                for victim_tag, count in self._evict_oldest(lru, evicted).items():
                    by_tag[victim_tag] = by_tag.get(victim_tag, 0) + count
            self._compact(lru)
            return len(new_keys) - evicted, by_tag

    def _kthena_readds(
        self, lru: _PodLru, keys: Keys, is_new: npt.NDArray[np.bool_], evicted: int
    ) -> Keys:
        """The prompt's blocks ``lru`` holds that Kthena's tail-first adds evict before
        reaching them (each then added again, evicting one more entry).

        Kthena's victims are the oldest untouched entries. Until a held block is evicted,
        at most ``evicted`` (the one-step count) are, so the first such block is among
        the oldest ``evicted + held``: when none is, nothing is re-added. Otherwise the
        adds are simulated over the oldest ``2 n`` entries (``n`` blocks; victims are
        among them when ``n`` fits the list, and a list shorter than ``n`` is whole).
        """
        held = keys[~is_new]
        first = self._oldest_live(lru, evicted + len(held))
        if set(first.tolist()).isdisjoint(held.tolist()):  # (np.isin sorts: slower here)
            return np.empty(0, dtype=np.int64)
        window = self._oldest_live(lru, 2 * len(keys))
        order = OrderedDict.fromkeys(window.tolist())  # oldest first
        alive = set(held.tolist())
        held_set = frozenset(alive)
        size, readded = lru.live, []
        for key in keys.tolist():  # tail first
            if key in alive:
                order[key] = None
                order.move_to_end(key)
                continue
            if key in held_set:  # held before, evicted earlier in this record
                readded.append(key)
            order[key] = None
            alive.add(key)
            size += 1
            if size > self.max_entries_per_pod:
                alive.discard(order.popitem(last=False)[0])
                size -= 1
        return np.array(readded, dtype=np.int64)

    def remove_pod(self, pod: PodId) -> int:
        """Forget every entry of ``pod`` (not counted as evictions); returns how many."""
        with self._lock:
            lru = self._lru_by_pod.pop(pod, None)
            if lru is None:
                return 0
            victims = self._live_keys(lru)
            self._drop(lru, victims)
            del self._pod_by_slot[lru.slot]
            self._free_slots.append(lru.slot)
            self._slots_version += 1
        if self.observer is not None and len(victims):
            self.observer.entries_changed(-len(victims))
        return len(victims)

    def retain_pods(self, keep: Iterable[PodId]) -> list[PodId]:
        """Remove every pod not in ``keep`` (e.g. after discovery); returns those removed."""
        keep_set = set(keep)
        if self._lru_by_pod.keys() <= keep_set:  # the usual case, one C-level check
            return []
        gone = [pod for pod in list(self._lru_by_pod) if pod not in keep_set]
        for pod in gone:
            self.remove_pod(pod)
        return gone

    # -- internals (called with the lock held) ---------------------------------------

    def _add_pod(self, pod: PodId) -> _PodLru:
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._next_slot < MAX_PODS:
            slot = self._next_slot
            self._next_slot += 1
        else:
            raise ValueError(f"the prefix index holds at most {MAX_PODS} pods")
        page, bit = divmod(slot, SLOTS_PER_PAGE)
        lru = _PodLru(slot=slot, key=_mix_key(b"slot", slot), page=page, bit=1 << bit)
        self._lru_by_pod[pod] = lru
        self._pod_by_slot[slot] = pod
        self._slots_version += 1
        return lru

    def _append(self, lru: _PodLru, keys: Keys, tag: int) -> int:
        """Append to the ring, shifting or growing it; returns the first new position."""
        if lru.size + len(keys) > len(lru.ring):
            occupied = lru.size - lru.head
            if lru.head and occupied + len(keys) <= len(lru.ring) // 2:
                lru.ring[:occupied] = lru.ring[lru.head : lru.size]
                lru.tags[:occupied] = lru.tags[lru.head : lru.size]
            else:
                capacity = max(2 * (occupied + len(keys)), 256)
                grown = np.empty(capacity, dtype=np.int64)
                grown[:occupied] = lru.ring[lru.head : lru.size]
                lru.ring = grown
                grown_tags = np.empty(capacity, dtype=np.int64)
                grown_tags[:occupied] = lru.tags[lru.head : lru.size]
                lru.tags = grown_tags
            lru.base += lru.head
            lru.size = occupied
            lru.head = 0
        start = lru.size
        lru.ring[start : start + len(keys)] = keys
        lru.tags[start : start + len(keys)] = tag
        lru.size += len(keys)
        return start

    def _live_mask(self, lru: _PodLru, start: int, stop: int) -> npt.NDArray[np.bool_]:
        window = lru.ring[start:stop]
        live: npt.NDArray[np.bool_] = _lookup(self._entries, window ^ lru.key, -1) == lru.seqs(
            start, stop
        )
        return live

    def _live_keys(self, lru: _PodLru) -> Keys:
        return lru.ring[lru.head : lru.size][self._live_mask(lru, lru.head, lru.size)]

    def _oldest_live(self, lru: _PodLru, count: int) -> Keys:
        """Up to ``count`` live entries' block hashes, oldest first."""
        found: list[Keys] = []
        start, wanted = lru.head, count
        while wanted and start < lru.size:
            stop = min(lru.size, start + max(2 * wanted, 256))
            live = lru.ring[start:stop][self._live_mask(lru, start, stop)][:wanted]
            found.append(live)
            wanted -= len(live)
            start = stop
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def _evict_oldest(self, lru: _PodLru, count: int) -> dict[int, int]:
        """Drop the ``count`` oldest live entries; returns how many had each tag."""
        by_tag: Counter[int] = Counter()
        while count:
            stop = min(lru.size, lru.head + max(2 * count, 256))
            live_pos = np.flatnonzero(self._live_mask(lru, lru.head, stop))[:count]
            self._drop(lru, lru.ring[lru.head + live_pos])
            by_tag.update(lru.tags[lru.head + live_pos].tolist())
            count -= len(live_pos)
            lru.head = lru.head + int(live_pos[-1]) + 1 if not count else stop
        return by_tag

    def _set_owner(self, lru: _PodLru, keys: Keys) -> None:
        owner_keys = keys ^ self._page_keys[lru.page]
        _assign(self._owners, owner_keys, _lookup(self._owners, owner_keys, 0) | lru.bit)
        if lru.page:
            pages = _lookup(self._upper_pages, keys, 0) | (1 << lru.page)
            _assign(self._upper_pages, keys, pages)

    def _drop(self, lru: _PodLru, keys: Keys) -> None:
        """Remove live entries (their block hashes) from every map."""
        if not len(keys):
            return
        for entry_key in (keys ^ lru.key).tolist():
            self._entries.discard(entry_key)
        lru.live -= len(keys)
        self._num_entries -= len(keys)
        owner_keys = keys ^ self._page_keys[lru.page]
        masks = _lookup(self._owners, owner_keys, 0) & ~lru.bit
        emptied = masks == 0
        _assign(self._owners, owner_keys[~emptied], masks[~emptied])
        for owner_key in owner_keys[emptied].tolist():
            self._owners.discard(owner_key)
        if lru.page:
            gone = keys[emptied]
            pages = _lookup(self._upper_pages, gone, 0) & ~(1 << lru.page)
            _assign(self._upper_pages, gone[pages != 0], pages[pages != 0])
            for key in gone[pages == 0].tolist():
                self._upper_pages.discard(key)

    def _compact(self, lru: _PodLru) -> None:
        """Drop the stale positions refreshes left once they outnumber the live ones.

        Amortised O(1) a block: it runs after at least ``live + 1024`` appends.
        """
        if lru.size - lru.head <= 2 * lru.live + 1024:
            return
        live = self._live_mask(lru, lru.head, lru.size)
        kept = lru.ring[lru.head : lru.size][live]
        kept_tags = lru.tags[lru.head : lru.size][live]
        lru.base += lru.size
        ring = np.empty(max(2 * len(kept), 256), dtype=np.int64)
        ring[: len(kept)] = kept
        tags = np.empty(len(ring), dtype=np.int64)
        tags[: len(kept)] = kept_tags
        lru.ring, lru.tags, lru.head, lru.size = ring, tags, 0, len(kept)
        _assign(self._entries, kept ^ lru.key, lru.seqs(0, len(kept)))

    # -- checking ----------------------------------------------------------------

    def verify(self) -> None:
        """Raise ``AssertionError`` unless every map agrees with the LRU rings.

        For tests and debugging: O(entries).
        """
        with self._lock:
            total = 0
            owners_expected: dict[int, int] = {}
            uppers_expected: dict[int, int] = {}
            for pod, lru in self._lru_by_pod.items():
                assert self._pod_by_slot[lru.slot] == pod
                live = self._live_keys(lru).tolist()
                assert len(live) == len(set(live)) == lru.live, (pod, len(live), lru.live)
                assert lru.live <= self.max_entries_per_pod
                total += lru.live
                for key in live:
                    owner_key = key ^ self._page_keys[lru.page]
                    owners_expected[owner_key] = owners_expected.get(owner_key, 0) | lru.bit
                    if lru.page:
                        uppers_expected[key] = uppers_expected.get(key, 0) | (1 << lru.page)
            assert total == self._num_entries == len(self._entries), (total, len(self._entries))
            assert dict(self._owners.items()) == owners_expected
            assert dict(self._upper_pages.items()) == uppers_expected
