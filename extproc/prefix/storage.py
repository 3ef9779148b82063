"""Where ``PrefixIndex`` keeps its entries: compact per-pod rings and C hash maps.

No Python object per entry. Entries live in C hash maps (cykhash) and NumPy ring
buffers, and a prompt's blocks are looked up, stored and dropped in one call each
(cykhash's batch probe; ``kernels.put_all`` for the writes, ``kernels.evict_oldest`` for
a full pod's evictions), so the per-request cost is a few dozen C calls, not one Python
loop per block.

Layout:

* ``entries``: entry key (block hash XOR the pod slot's key) -> the entry's sequence
  number in its pod's ring. An entry is live iff its ring position holds that number.
* ``owners``: (block hash XOR the page's key) -> bitmask of the page's pod slots holding
  the block. Pods get slots, 63 to a page, so a mask fits a non-negative int64.
* ``upper_pages``: block hash -> bitmask of the pages other than page 0 holding it, so a
  lookup costs one batch probe whatever the number of pods.

Hashes are stored as the int64 with the same 64 bits as the unsigned XXH64 digest.
Chained hashes of one prompt are distinct, which the batch updates rely on.

Not thread-safe: the index's lock guards every call. What the entries mean (which to
evict, what a lookup returns) is the index's (``prefix.index``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import xxhash
from cykhash import Int64toInt64Map, Int64toInt64Map_to

from extproc.kernels import evict_oldest, put_all
from extproc.kernels.pure import drop_live, lookup
from extproc.pods import PodId
from extproc.prefix.hashing import Keys

SLOTS_PER_PAGE = 63  # bit 63 would make a mask negative
MAX_PAGES = 63
MAX_PODS = SLOTS_PER_PAGE * MAX_PAGES


def _mix_key(kind: bytes, number: int) -> int:
    """A fixed pseudo-random int64, distinct per (kind, number)."""
    digest = xxhash.xxh64_intdigest(b"%s:%d" % (kind, number), 0x9E37_79B9)
    return int(np.uint64(digest).view(np.int64))


def lookup_counted(table: Int64toInt64Map, keys: Keys, default: int) -> tuple[Keys, int]:
    """``lookup``, and how many keys were found (the batch probe counts them)."""
    out = np.empty(len(keys), dtype=np.int64)
    found: int = Int64toInt64Map_to(table, keys, out, False, default)
    return out, found


@dataclass(slots=True)
class PodLru:
    """One pod's LRU order: a ring of block hashes, oldest at ``head``, lazily deleted.

    ``ring[i]`` (for ``head <= i < size``) has sequence number ``base + i``. Refreshing an
    entry appends it again; the older position goes stale, since ``entries`` now holds
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


class PrefixStorage:
    """The entries of every pod: their rings, the three maps, pod slots and pages."""

    def __init__(self) -> None:
        self.entries = Int64toInt64Map()
        self.owners = Int64toInt64Map()
        self.upper_pages = Int64toInt64Map()
        self.lru_by_pod: dict[PodId, PodLru] = {}
        self.pod_by_slot: dict[int, PodId] = {}
        self._free_slots: list[int] = []
        self.next_slot = 0
        self.page_keys = [0] + [_mix_key(b"page", p) for p in range(1, MAX_PAGES)]
        self.page_key_array = np.array(self.page_keys, dtype=np.int64)
        self.slots_version = 0  # bumped whenever a pod gets or gives up a slot
        self.page_slots = [0] * MAX_PAGES  # per page, the bits of the slots in use
        self.num_entries = 0

    # -- pods and their slots ----------------------------------------------------------

    def add_pod(self, pod: PodId) -> PodLru:
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self.next_slot < MAX_PODS:
            slot = self.next_slot
            self.next_slot += 1
        else:
            raise ValueError(f"the prefix index holds at most {MAX_PODS} pods")
        page, bit = divmod(slot, SLOTS_PER_PAGE)
        lru = PodLru(slot=slot, key=_mix_key(b"slot", slot), page=page, bit=1 << bit)
        self.page_slots[page] |= lru.bit
        self.lru_by_pod[pod] = lru
        self.pod_by_slot[slot] = pod
        self.slots_version += 1
        return lru

    def remove_pod(self, pod: PodId) -> int:
        """Drop every entry of ``pod`` and free its slot; returns how many entries."""
        lru = self.lru_by_pod.pop(pod, None)
        if lru is None:
            return 0
        victims = self.live_keys(lru)
        self._drop(lru, victims)
        del self.pod_by_slot[lru.slot]
        self.page_slots[lru.page] &= ~lru.bit
        self._free_slots.append(lru.slot)
        self.slots_version += 1
        return len(victims)

    def slot_pods(self, page: int, bits: int) -> list[PodId]:
        """The pods of ``page`` whose slot bits are set, in slot order."""
        first_slot = page * SLOTS_PER_PAGE
        pods = []
        while bits:
            low = bits & -bits
            bits ^= low
            pods.append(self.pod_by_slot[first_slot + low.bit_length() - 1])
        return pods

    # -- one pod's entries -------------------------------------------------------------

    def seqs_of(self, lru: PodLru, entry_keys: Keys) -> tuple[Keys, int]:
        """Each block's sequence number in ``lru`` (-1: not held), by its entry key
        (``entry_keys``: the block hashes XOR ``lru.key``), and how many are held."""
        return lookup_counted(self.entries, entry_keys, -1)

    def tags_of(self, lru: PodLru, held: Keys) -> list[int]:
        """The tags of blocks ``lru`` holds."""
        tags: list[int] = lru.tags[lookup(self.entries, held ^ lru.key, -1) - lru.base].tolist()
        return tags

    def touch(self, lru: PodLru, keys: Keys, entry_keys: Keys, tag: int, new_keys: Keys) -> None:
        """Append ``keys`` (their entry keys ``entry_keys``; ``new_keys`` of them not held
        yet) as ``lru``'s most recent entries, in order, tagged ``tag``."""
        start = self._append(lru, keys, tag)
        put_all(self.entries, entry_keys, lru.seqs(start, start + len(keys)))
        if len(new_keys):
            self._set_owner(lru, new_keys)
            lru.live += len(new_keys)
            self.num_entries += len(new_keys)

    def live_keys(self, lru: PodLru) -> Keys:
        return lru.ring[lru.head : lru.size][self._live_mask(lru, lru.head, lru.size)]

    def oldest_live(self, lru: PodLru, count: int) -> Keys:
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

    def evict_oldest(self, lru: PodLru, count: int) -> dict[int, int]:
        """Drop the ``count`` oldest live entries; returns how many had each tag."""
        lru.head, by_tag = evict_oldest(
            self.entries,
            self.owners,
            self.upper_pages,
            lru.ring,
            lru.tags,
            lru.head,
            lru.size,
            lru.base,
            lru.key,
            self.page_keys[lru.page],
            lru.bit,
            lru.page,
            count,
        )
        dropped = sum(by_tag.values())
        lru.live -= dropped
        self.num_entries -= dropped
        return by_tag

    def compact(self, lru: PodLru) -> None:
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
        put_all(self.entries, kept ^ lru.key, lru.seqs(0, len(kept)))

    def _append(self, lru: PodLru, keys: Keys, tag: int) -> int:
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

    def _live_mask(self, lru: PodLru, start: int, stop: int) -> npt.NDArray[np.bool_]:
        window = lru.ring[start:stop]
        live: npt.NDArray[np.bool_] = lookup(self.entries, window ^ lru.key, -1) == lru.seqs(
            start, stop
        )
        return live

    def _set_owner(self, lru: PodLru, keys: Keys) -> None:
        owner_keys = keys ^ self.page_keys[lru.page] if lru.page else keys
        put_all(self.owners, owner_keys, lookup(self.owners, owner_keys, 0) | lru.bit)
        if lru.page:
            pages = lookup(self.upper_pages, keys, 0) | (1 << lru.page)
            put_all(self.upper_pages, keys, pages)

    def _drop(self, lru: PodLru, keys: Keys) -> None:
        """Remove live entries (their block hashes) from every map."""
        if not len(keys):
            return
        drop_live(
            self.entries,
            self.owners,
            self.upper_pages,
            keys,
            lru.key,
            self.page_keys[lru.page],
            lru.bit,
            lru.page,
        )
        lru.live -= len(keys)
        self.num_entries -= len(keys)

    # -- probes for a lookup -----------------------------------------------------------

    def candidate_masks(self, candidates: Iterable[PodId]) -> dict[int, int]:
        """Page -> bitmask of the candidates' slots (pods unknown to the index left out)."""
        lrus = [lru for lru in map(self.lru_by_pod.get, candidates) if lru is not None]
        if len(lrus) <= SLOTS_PER_PAGE:
            masks: dict[int, int] = {}
            for lru in lrus:
                masks[lru.page] = masks.get(lru.page, 0) | lru.bit
            return masks
        slots = np.fromiter((lru.slot for lru in lrus), dtype=np.int64, count=len(lrus))
        by_page = np.zeros(MAX_PAGES, dtype=np.int64)
        np.bitwise_or.at(by_page, slots // SLOTS_PER_PAGE, np.left_shift(1, slots % SLOTS_PER_PAGE))
        return {int(page): int(by_page[page]) for page in np.flatnonzero(by_page)}

    def slot_places(self, pods: tuple[PodId, ...]) -> Keys:
        """Slot -> the first place of its pod in ``pods`` (-1: none)."""
        places = np.full(max(self.next_slot, 1), -1, dtype=np.int64)
        for place in range(len(pods) - 1, -1, -1):
            lru = self.lru_by_pod.get(pods[place])
            if lru is not None:
                places[lru.slot] = place
        return places

    def less(self, page_masks: dict[int, int], exclude: Iterable[PodId]) -> dict[int, int]:
        """``page_masks`` without the slots of ``exclude`` (a copy if any: a cached set of
        masks stays as it is)."""
        excluded = [lru for lru in map(self.lru_by_pod.get, exclude) if lru is not None]
        if excluded:
            page_masks = dict(page_masks)
            for lru in excluded:
                left = page_masks.get(lru.page, 0) & ~lru.bit
                if left:
                    page_masks[lru.page] = left
                else:
                    page_masks.pop(lru.page, None)
        return page_masks

    def page_owners(self, keys: Keys, page: int, mask: int) -> Keys:
        """Per block, the slots of ``mask`` on ``page`` holding it: one batch probe."""
        owners = lookup(self.owners, keys ^ self.page_keys[page] if page else keys, 0)
        if mask != self.page_slots[page]:  # else every slot holding a block is in mask
            owners &= mask
        return owners

    def pages_by_block(self, keys: Keys, page_masks: dict[int, int]) -> Keys:
        """Per block, the candidate pages that may hold it: the upper pages
        ``upper_pages`` says hold it, and page 0 (not tracked there) at every block."""
        upper = 0
        for page in page_masks:
            upper |= (1 << page) if page else 0
        pages_by_block = lookup(self.upper_pages, keys, 0) & upper
        if 0 in page_masks:
            pages_by_block |= 1
        return pages_by_block

    def owner_masks(
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
        page_bits = np.left_shift(1, page_array)
        held = (pages_by_block[np.newaxis, start:stop] & page_bits[:, np.newaxis]) != 0
        probes = (keys[np.newaxis, start:stop] ^ self.page_key_array[page_array][:, np.newaxis])[
            held
        ]
        masks = np.zeros((len(pages), stop - start), dtype=np.int64)
        masks[held] = lookup(self.owners, probes, 0)
        candidates = [page_masks[page] for page in pages]
        if candidates != [self.page_slots[page] for page in pages]:  # else all are in masks
            masks &= np.array(candidates, dtype=np.int64)[:, np.newaxis]
        return page_array, masks
