"""Which pods were recently sent which prompt blocks: one LRU per pod, compact.

Rules (Kthena's prefix-cache spec):

* Each pod has an LRU list of at most ``max_entries_per_pod`` block entries; one block
  recorded for three pods is three entries. A full list drops its least recently used
  entry (an eviction). Removing a pod drops all its entries (not evictions). Recording
  a block a pod already has refreshes it.
* A lookup walks the prompt's hashes from the last block backwards; because hashes are
  chained, the first hit for a pod is its longest match.

A record touches a prompt's blocks tail first, so the first block is the most recently
used and the tail is evicted first: this is the order in which vLLM returns a finished
request's blocks to its free queue (``KVCacheManager.free``), so the estimate keeps a
shared system prompt as long as the engine does.

Memory: an entry costs one cell of a C hash map (``_entries``), 8 bytes of a ring buffer,
and, for a block held by no other pod of its page, one cell of ``_owners``; no Python
object per entry. Measured: see ``bench/prefix_bench.py``.

cykhash maps are probed with `key in m` then `m[key]`: its `get()` is a Python-level
method about twenty times slower (hence the SIM401 exemptions).

Layout:

* ``_entries``: entry key (block hash XOR the pod slot's key) -> the entry's sequence
  number in its pod's ring. An entry is live iff its ring position holds the same number.
* ``_owners``: (block hash, page) -> bitmask of the page's pod slots holding the block.
  Pods are numbered in slots, 63 to a page, so masks fit a signed 64-bit value.
* ``_upper_pages``: block hash -> bitmask of pages other than page 0 holding it, so a
  lookup costs one probe per block whatever the number of pods.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash
from cykhash import Int64toInt64Map

from extproc.prefix.hashing import BlockHash
from extproc.types import PodId

SLOTS_PER_PAGE = 63  # bit 63 would make the mask negative in the signed map
MAX_PAGES = 63
MAX_PODS = SLOTS_PER_PAGE * MAX_PAGES

_TWO63 = 1 << 63
_TWO64 = 1 << 64


def _signed(value: int) -> int:
    return value - _TWO64 if value >= _TWO63 else value


def _mix_key(kind: bytes, number: int) -> int:
    """A fixed pseudo-random signed 64-bit key, distinct per (kind, number)."""
    return _signed(xxhash.xxh64_intdigest(b"%s:%d" % (kind, number), 0x9E37_79B9))


@dataclass(slots=True)
class _PodLru:
    """One pod's LRU order: a ring of hashes, oldest at ``head``, with lazy deletion.

    ``ring[i]`` has sequence number ``base + i``. Refreshing an entry appends it again;
    the older position goes stale because ``_entries`` now holds the newer number.
    """

    slot: int
    key: int  # XOR-ed into block hashes to make this pod's entry keys
    ring: array = field(default_factory=lambda: array("q"))  # type: ignore[type-arg]
    head: int = 0
    base: int = 0
    live: int = 0


class PrefixIndex:
    """Per-pod LRU of recorded block hashes, and the lookup that scores against it.

    Thread-safe: every public method takes the index's own lock.
    """

    def __init__(self, max_entries_per_pod: int) -> None:
        if max_entries_per_pod <= 0:
            raise ValueError(f"max_entries_per_pod must be > 0, got {max_entries_per_pod}")
        self.max_entries_per_pod = max_entries_per_pod
        self._entries = Int64toInt64Map()
        self._owners = Int64toInt64Map()
        self._upper_pages = Int64toInt64Map()
        self._lru_by_pod: dict[PodId, _PodLru] = {}
        self._pod_by_slot: dict[int, PodId] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._page_keys = [0] + [_mix_key(b"page", p) for p in range(1, MAX_PAGES)]
        self._num_entries = 0
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        """Entries stored across all pods."""
        return self._num_entries

    def num_pod_entries(self, pod: PodId) -> int:
        lru = self._lru_by_pod.get(pod)
        return lru.live if lru else 0

    def pods(self) -> list[PodId]:
        return list(self._lru_by_pod)

    def match(
        self, hashes: Sequence[BlockHash], candidates: Iterable[PodId], top_k: int
    ) -> dict[PodId, int]:
        """Longest recorded match, in blocks, for up to ``top_k`` candidate pods.

        Walks from the last block backwards and stops once ``top_k`` pods were found,
        so pods with longer matches come first. Pods with no match are left out.
        """
        with self._lock:
            page_masks: dict[int, int] = {}
            for pod in candidates:
                lru = self._lru_by_pod.get(pod)
                if lru is not None:
                    page, bit = divmod(lru.slot, SLOTS_PER_PAGE)
                    page_masks[page] = page_masks.get(page, 0) | (1 << bit)
            if not page_masks or top_k <= 0:
                return {}
            found: dict[PodId, int] = {}
            owners = self._owners
            uppers = self._upper_pages
            page_keys = self._page_keys
            mask0 = page_masks.pop(0, 0)
            upper = 0
            for page in page_masks:
                upper |= 1 << page
            for idx in range(len(hashes) - 1, -1, -1):
                hk = _signed(hashes[idx])
                hits: list[tuple[int, int]] = []
                if mask0 and hk in owners:
                    hits.append((0, owners[hk] & mask0))
                if upper and hk in uppers:
                    pages = uppers[hk] & upper
                    while pages:
                        low = pages & -pages
                        page = low.bit_length() - 1
                        pages ^= low
                        hits.append((page, owners[hk ^ page_keys[page]] & page_masks[page]))
                for page, mask in hits:
                    while mask:
                        low = mask & -mask
                        mask ^= low
                        pod = self._pod_by_slot[page * SLOTS_PER_PAGE + low.bit_length() - 1]
                        found[pod] = idx + 1
                        if len(found) >= top_k:
                            return found
                        # Its longest match is known: stop looking for it.
                        if page == 0:
                            mask0 &= ~low
                        else:
                            page_masks[page] &= ~low
                if not mask0 and not any(page_masks.values()):
                    break
            return found

    # -- updates -------------------------------------------------------------------

    def record(self, hashes: Sequence[BlockHash], pod: PodId) -> int:
        """Record the prompt's blocks for ``pod``; returns the number of evictions.

        Blocks are touched tail first, so the first block ends most recently used.
        """
        with self._lock:
            lru = self._lru_by_pod.get(pod) or self._add_pod(pod)
            entries = self._entries
            owners = self._owners
            page, bit = divmod(lru.slot, SLOTS_PER_PAGE)
            owner_bit = 1 << bit
            page_key = self._page_keys[page]
            ring = lru.ring
            evicted = 0
            for idx in range(len(hashes) - 1, -1, -1):
                hk = _signed(hashes[idx])
                entry_key = hk ^ lru.key
                is_new = entry_key not in entries
                entries[entry_key] = lru.base + len(ring)
                ring.append(hk)
                if not is_new:
                    continue
                lru.live += 1
                self._num_entries += 1
                owner_key = hk ^ page_key
                owners[owner_key] = (owners[owner_key] if owner_key in owners else 0) | owner_bit  # noqa: SIM401
                if page:
                    uppers = self._upper_pages
                    uppers[hk] = (uppers[hk] if hk in uppers else 0) | (1 << page)  # noqa: SIM401
                if lru.live > self.max_entries_per_pod:
                    self._evict_oldest(lru)
                    evicted += 1
            self._compact(lru)
            return evicted

    def remove_pod(self, pod: PodId) -> int:
        """Forget every entry of ``pod`` (not counted as evictions); returns how many."""
        with self._lock:
            lru = self._lru_by_pod.pop(pod, None)
            if lru is None:
                return 0
            removed = 0
            for pos in range(lru.head, len(lru.ring)):
                hk = lru.ring[pos]
                if self._is_live(lru, hk, pos):
                    self._drop_entry(lru, hk)
                    removed += 1
            del self._pod_by_slot[lru.slot]
            self._free_slots.append(lru.slot)
            return removed

    def retain_pods(self, keep: Iterable[PodId]) -> list[PodId]:
        """Remove every pod not in ``keep`` (e.g. after discovery); returns those removed."""
        keep_set = set(keep)
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
        lru = _PodLru(slot=slot, key=_mix_key(b"slot", slot))
        self._lru_by_pod[pod] = lru
        self._pod_by_slot[slot] = pod
        return lru

    def _is_live(self, lru: _PodLru, hk: int, pos: int) -> bool:
        entry_key = hk ^ lru.key
        return entry_key in self._entries and self._entries[entry_key] == lru.base + pos

    def _evict_oldest(self, lru: _PodLru) -> None:
        ring = lru.ring
        while True:
            pos = lru.head
            lru.head += 1
            hk = ring[pos]
            if self._is_live(lru, hk, pos):
                self._drop_entry(lru, hk)
                return

    def _drop_entry(self, lru: _PodLru, hk: int) -> None:
        """Remove one live entry from ``_entries`` and the owner masks."""
        self._entries.discard(hk ^ lru.key)
        lru.live -= 1
        self._num_entries -= 1
        page, bit = divmod(lru.slot, SLOTS_PER_PAGE)
        owner_key = hk ^ self._page_keys[page]
        mask = self._owners[owner_key] & ~(1 << bit)
        if mask:
            self._owners[owner_key] = mask
            return
        self._owners.discard(owner_key)
        if page:
            pages = self._upper_pages[hk] & ~(1 << page)
            if pages:
                self._upper_pages[hk] = pages
            else:
                self._upper_pages.discard(hk)

    def _compact(self, lru: _PodLru) -> None:
        """Keep the ring within about twice the live entries (amortised O(1) a record).

        Drops the consumed head and the stale positions that refreshes left behind,
        renumbering the live entries in order.
        """
        ring = lru.ring
        if len(ring) - lru.head <= 2 * lru.live + 1024:
            if lru.head > len(ring) // 2:
                lru.base += lru.head
                del ring[: lru.head]
                lru.head = 0
            return
        kept = array(
            "q",
            (hk for pos, hk in enumerate(ring) if pos >= lru.head and self._is_live(lru, hk, pos)),
        )
        lru.base += len(ring)
        for pos, hk in enumerate(kept):
            self._entries[hk ^ lru.key] = lru.base + pos
        lru.ring = kept
        lru.head = 0

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
                live = [
                    hk
                    for pos, hk in enumerate(lru.ring)
                    if pos >= lru.head and self._is_live(lru, hk, pos)
                ]
                assert len(live) == len(set(live)) == lru.live, (pod, len(live), lru.live)
                assert lru.live <= self.max_entries_per_pod
                total += lru.live
                page, bit = divmod(lru.slot, SLOTS_PER_PAGE)
                for hk in live:
                    key = hk ^ self._page_keys[page]
                    owners_expected[key] = owners_expected.get(key, 0) | (1 << bit)
                    if page:
                        uppers_expected[hk] = uppers_expected.get(hk, 0) | (1 << page)
            assert total == self._num_entries == len(self._entries), (total, len(self._entries))
            assert dict(self._owners.items()) == owners_expected
            assert dict(self._upper_pages.items()) == uppers_expected
