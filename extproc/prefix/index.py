"""Which pods were recently sent which prompt blocks: one LRU per pod, by Kthena's rules.

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

The entries themselves (rings, hash maps, pod slots and pages, compaction) are
``prefix.storage``'s.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from extproc.kernels import held_lengths
from extproc.pods import PodId
from extproc.prefix.hashing import Keys, as_keys
from extproc.prefix.storage import SLOTS_PER_PAGE, PodLru, PrefixStorage


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
        self.storage = PrefixStorage()
        self._limits: dict[PodId, int] = {}  # pods held to fewer entries (``limit_pod``)
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        """Entries stored across all pods. Read under the lock: a record adds its new
        blocks before it evicts, so a reader between the two would see the bound exceeded."""
        with self._lock:
            return self.storage.num_entries

    def num_pod_entries(self, pod: PodId) -> int:
        lru = self.storage.lru_by_pod.get(pod)
        return lru.live if lru else 0

    def pods(self) -> list[PodId]:
        return list(self.storage.lru_by_pod)

    def live_entries(self) -> list[tuple[PodId, Keys]]:
        """Each pod's live block hashes, least recently used first (copies)."""
        storage = self.storage
        with self._lock:
            return [(pod, storage.live_keys(lru).copy()) for pod, lru in storage.lru_by_pod.items()]

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
        storage = self.storage
        with self._lock:
            if isinstance(candidates, PodSet):
                page_masks = self._pod_set_masks(candidates)
            else:
                page_masks = storage.candidate_masks(candidates)
            page_masks = storage.less(page_masks, exclude)
            if not page_masks or top_k <= 0 or not len(keys):
                return {}
            if len(page_masks) == 1:  # up to 63 pods: one probe, no page bookkeeping
                ((page, mask),) = page_masks.items()
                return self._match_page(keys, page, mask, top_k)
            pages_by_block = storage.pages_by_block(keys, page_masks)
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

        One kernel call (``kernels.held_lengths``) probes the owner masks of the pages
        that may hold each block and reads each candidate's deepest block off them: no
        step per pod or block in Python.
        """
        keys = as_keys(hashes)
        out = np.zeros(len(candidates.pods), dtype=np.int64)
        storage = self.storage
        with self._lock:
            page_masks = self._pod_set_masks(candidates)
            if exclude:
                page_masks = storage.less(page_masks, exclude)
            if not page_masks or not len(keys):
                return out
            held_lengths(
                storage.owners,
                storage.upper_pages,
                storage.page_key_array,
                keys,
                page_masks,
                self._pod_set_places(candidates),
                SLOTS_PER_PAGE,
                out,
            )
        return out

    def _pod_set_places(self, pod_set: PodSet) -> Keys:
        """Slot -> the first place of its pod in ``pod_set.pods`` (-1: none), kept in the
        set until the slot layout changes."""
        cached = pod_set._places
        version = self.storage.slots_version
        if cached is not None and cached[0] is self and cached[1] == version:
            return cached[2]
        places = self.storage.slot_places(pod_set.pods)
        pod_set._places = (self, version, places)
        return places

    def _pod_set_masks(self, pod_set: PodSet) -> dict[int, int]:
        cached = pod_set._cached  # (index, slot layout version, masks), swapped as one
        version = self.storage.slots_version
        if cached is not None and cached[0] is self and cached[1] == version:
            return cached[2]
        masks = self.storage.candidate_masks(pod_set.pods)
        pod_set._cached = (self, version, masks)
        return masks

    def _match_page(self, keys: Keys, page: int, mask: int, top_k: int) -> dict[PodId, int]:
        """``match`` when every candidate is on one page: its owner masks in one probe,
        then, last block first, the blocks where some candidate's longest match ends."""
        owners = self.storage.page_owners(keys, page, mask)
        held_from = np.bitwise_or.accumulate(owners[::-1])[::-1]  # held here or later
        ends = held_from.copy()
        ends[:-1] ^= held_from[1:]  # the candidates holding this block but no later one
        at = np.flatnonzero(ends)[::-1]
        found: dict[PodId, int] = {}
        for idx, bits in zip(at.tolist(), ends[at].tolist(), strict=True):
            if self._add_found(found, self.storage.slot_pods(page, bits), idx + 1, top_k):
                break
        return found

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
        page_array, masks = self.storage.owner_masks(keys, pages_by_block, page_masks, start, stop)
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
                for pod in self.storage.slot_pods(page, bits)
            ]
            if self._add_found(found, level, start + idx + 1, top_k):
                return True
        for page, bits in zip(pages, held_from[:, 0].tolist(), strict=True):
            seen[page] = seen.get(page, 0) | bits
        return False

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
        storage = self.storage
        with self._lock:
            lru = storage.lru_by_pod.get(pod) or storage.add_pod(pod)
            entry_keys = keys ^ lru.key
            seqs, num_held = storage.seqs_of(lru, entry_keys)
            num_new = len(keys) - num_held
            limit = self._limits.get(pod, self.max_entries_per_pod)
            evicted = max(0, lru.live + num_new - limit)
            by_tag: dict[int, int] = {}
            if not num_new:
                new_keys = keys[:0]
            elif not num_held:
                new_keys = keys
            else:
                new_keys = keys[seqs < 0]
            # A held block has at least live - (ring positions after it) entries older than
            # it; Kthena cannot reach it before evicting `evicted` others (docstring below).
            if (
                evicted
                and num_held
                and lru.live - (lru.base + lru.size - int(seqs[seqs >= 0].min()))
                < evicted + num_held
            ):
                readded = self._kthena_readds(lru, keys, seqs < 0, evicted, limit)
                if len(readded):  # counted under the tags they had
                    for old_tag in storage.tags_of(lru, readded):
                        by_tag[old_tag] = by_tag.get(old_tag, 0) + 1
            storage.touch(lru, keys, entry_keys, tag, new_keys)
            if evicted:
                for victim_tag, count in storage.evict_oldest(lru, evicted).items():
                    by_tag[victim_tag] = by_tag.get(victim_tag, 0) + count
            storage.compact(lru)
            return len(new_keys) - evicted, by_tag

    def _kthena_readds(
        self, lru: PodLru, keys: Keys, is_new: npt.NDArray[np.bool_], evicted: int, limit: int
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
        first = self.storage.oldest_live(lru, evicted + len(held))
        if set(first.tolist()).isdisjoint(held.tolist()):  # (np.isin sorts: slower here)
            return np.empty(0, dtype=np.int64)
        window = self.storage.oldest_live(lru, 2 * len(keys))
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
            if size > limit:
                alive.discard(order.popitem(last=False)[0])
                size -= 1
        return np.array(readded, dtype=np.int64)

    def limit_pod(self, pod: PodId, max_entries: int | None) -> None:
        """Hold ``pod`` to ``max_entries`` (at most ``max_entries_per_pod``) from its next
        record on; None lifts the limit. For a view sized like the pod's own cache."""
        with self._lock:
            if max_entries is None or max_entries >= self.max_entries_per_pod:
                self._limits.pop(pod, None)
            else:
                self._limits[pod] = max(1, max_entries)

    def remove_pod(self, pod: PodId) -> int:
        """Forget every entry of ``pod`` (not counted as evictions); returns how many."""
        with self._lock:
            removed = self.storage.remove_pod(pod)
            self._limits.pop(pod, None)
        if self.observer is not None and removed:
            self.observer.entries_changed(-removed)
        return removed

    def retain_pods(self, keep: Iterable[PodId]) -> list[PodId]:
        """Remove every pod not in ``keep`` (e.g. after discovery); returns those removed."""
        keep_set = set(keep)
        lru_by_pod = self.storage.lru_by_pod
        if lru_by_pod.keys() <= keep_set:  # the usual case, one C-level check
            return []
        gone = [pod for pod in list(lru_by_pod) if pod not in keep_set]
        for pod in gone:
            self.remove_pod(pod)
        return gone
