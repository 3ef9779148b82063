"""Per-pod views of the KV cache, built from vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events and keyed by ``keys.block_key`` (never the engine's hash).

Each pod keeps, per medium (``GPU``, and ``CPU`` or another offload tier), an ordered
map key -> engine hash and its inverse engine hash -> key; the inverse maps a
``BlockRemoved`` and a ``BlockStored``'s parent to our keys. A store whose parent we do
not know (stored before we subscribed, or lost) cannot be keyed and is counted as an
orphan; its blocks could not be matched anyway, since a match walks from block 0.

vLLM does not de-duplicate its cache: two requests computing the same block side by
side both cache it, each copy with its own ``BlockStored`` and, when evicted, its own
``BlockRemoved``, and a lookup hits while any copy is left. So a hash stored again while
known counts one more copy (in ``copies``, which holds only hashes with more than one,
so the request path reads nothing more), and a removal drops the block only with its
last copy.

Seeding (``serve --view-snapshot``): a restarted extproc fills each pod's view from the
snapshot (``saved`` / ``seed``), its blocks marked *provisional*: scored at once, but not
exact (``provisional_in``) until the pod's events confirm them. A replay of the missed
batches, or a first batch that follows the saved sequence number, confirms them all
(``confirm``); else each is confirmed by a ``BlockStored`` of its key and dropped by a
``BlockRemoved`` of its hash (the hash -> key map is restored too), and those still
unconfirmed ``provisional_s`` after the seeding are dropped (``expire``), as are all of
them on ``AllBlocksCleared``, a restarted publisher or a later gap.

Memory is bounded by the pod's real capacity (``capacity`` blocks per medium, from the
configuration): an engine never holds more, so an overflow means removals were lost,
and the oldest-stored blocks go first.

Threads: one writer (the events subscriber); the request path only reads, with single
``dict`` lookups, which the GIL makes atomic, so it takes no lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc.pods import PodId
from extproc.prefix.precise.keys import ROOT, chain_from, token_bytes

GPU = "GPU"


@dataclass(slots=True)
class PodView:
    """One pod's cached blocks, as its events told."""

    capacity: int
    block_size: int | None = None  # learned from the pod's first BlockStored
    blocks: dict[str, dict[int, int]] = field(default_factory=dict)  # medium -> key -> hash
    keys: dict[str, dict[int, int]] = field(default_factory=dict)  # medium -> hash -> key
    # medium -> hash -> copies beyond the first, for hashes cached more than once
    copies: dict[str, dict[int, int]] = field(default_factory=dict)
    stale_until: float = 0.0  # monotonic time; the view is not trusted before it
    orphans: int = 0  # stored blocks whose parent was unknown
    evicted: int = 0  # blocks dropped over capacity (lost removals)
    # medium -> keys seeded from the snapshot and not yet confirmed by the pod's events
    provisional: dict[str, set[int]] = field(default_factory=dict)
    provisional_until: float = 0.0  # monotonic time; unconfirmed seeded blocks go then

    def stale(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.stale_until

    def clear(self) -> None:
        self.blocks = {}
        self.keys = {}
        self.copies = {}
        self.provisional = {}

    def num_provisional(self) -> int:
        return sum(len(keys) for keys in self.provisional.values())

    def num_blocks(self, medium: str) -> int:
        return len(self.blocks.get(medium, ()))


@dataclass(frozen=True, slots=True)
class SavedBlocks:
    """One medium of a pod's view as the view snapshot keeps it, oldest stored first."""

    medium: str
    keys: npt.NDArray[np.uint64]  # our keys (``keys.block_key``)
    hashes: npt.NDArray[np.uint64]  # the engine's hash of each
    copies: npt.NDArray[np.uint32]  # each one's copies beyond the first


@dataclass(frozen=True, slots=True)
class SavedView:
    """A pod's view as the view snapshot keeps it."""

    block_size: int | None
    media: tuple[SavedBlocks, ...]

    def num_blocks(self) -> int:
        return sum(len(m.keys) for m in self.media)


# Why seeded blocks leave the view unconfirmed (``PreciseIndex.dropped``'s keys).
DROP_REASONS = ("expired", "removed", "cleared", "restarted", "stale", "evicted")
_U64 = 1 << 64


def medium_of(value: Any) -> str:
    """vLLM leaves ``medium`` out (None) for the GPU pool."""
    return value if isinstance(value, str) and value else GPU


class PreciseIndex:
    """Every known pod's ``PodView``; the subscriber writes, the scorer reads."""

    def __init__(
        self, capacity_blocks: int, stale_s: float = 30.0, provisional_s: float = 600.0
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be 1 or more, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.stale_s = stale_s
        self.provisional_s = provisional_s
        self.views: dict[PodId, PodView] = {}
        # seeded blocks: how many, confirmed by events, dropped unconfirmed (by reason)
        self.seeded = 0
        self.confirmed = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._seeded_pods: set[PodId] = set()  # pods with provisional blocks

    def view(self, pod: PodId) -> PodView:
        view = self.views.get(pod)
        if view is None:
            view = self.views[pod] = PodView(self.capacity)
        return view

    def retain_pods(self, keep: Iterable[PodId]) -> None:
        keep = set(keep)
        for pod in [p for p in self.views if p not in keep]:
            del self.views[pod]
        self._seeded_pods &= keep

    # The view snapshot (before the subscriber starts, after it stopped) ---------------

    def saved(self, pod: PodId) -> SavedView | None:
        """``pod``'s view for the snapshot; None when there is nothing to keep: no view,
        a stale one (being rebuilt), or engine hashes that are not 64-bit integers
        (vLLM's events carry integers unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
        view = self.views.get(pod)
        if view is None or view.stale():
            return None
        media = []
        for medium, blocks in view.blocks.items():
            hashes = list(blocks.values())
            if not all(isinstance(h, int) and 0 <= h < _U64 for h in hashes):
                return None
            copies = view.copies.get(medium, {})
            media.append(
                SavedBlocks(
                    medium,
                    np.fromiter(blocks, dtype=np.uint64, count=len(blocks)),
                    np.array(hashes, dtype=np.uint64),
                    np.array([copies.get(h, 0) for h in hashes], dtype=np.uint32),
                )
            )
        return SavedView(view.block_size, tuple(media))

    def seed(self, pod: PodId, saved: SavedView, now: float | None = None) -> int:
        """Fill ``pod``'s view from the snapshot, every block provisional until
        ``provisional_s`` from ``now`` (monotonic); returns the blocks seeded (at most
        ``capacity`` a medium, the newest)."""
        view = self.views[pod] = PodView(self.capacity, saved.block_size)
        for medium in saved.media:
            start = max(0, len(medium.keys) - self.capacity)
            keys = [int(k) for k in medium.keys[start:]]
            hashes = [int(h) for h in medium.hashes[start:]]
            view.blocks[medium.medium] = dict(zip(keys, hashes, strict=True))
            view.keys[medium.medium] = dict(zip(hashes, keys, strict=True))
            view.copies[medium.medium] = {
                h: int(c) for h, c in zip(hashes, medium.copies[start:], strict=True) if c
            }
            view.provisional[medium.medium] = set(keys)
        num = view.num_provisional()
        if num:
            view.provisional_until = (time.monotonic() if now is None else now) + self.provisional_s
            self._seeded_pods.add(pod)
        self.seeded += num
        return num

    # Writes (the subscriber's thread) ------------------------------------------------

    def stored(
        self,
        pod: PodId,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Sequence[Any] | None] | None,
        medium: Any = None,
    ) -> int:
        """Apply one ``BlockStored``; returns the blocks added, a known block's further
        copy included (0 for an orphan or a partial block, which vLLM only stores with
        partial-block hits on)."""
        view = self.view(pod)
        med = medium_of(medium)
        if block_size < 1 or len(token_ids) != len(hashes) * block_size:
            return 0
        by_hash = view.keys.setdefault(med, {})
        parent_key = ROOT if parent is None else self._key_of(view, parent, med)
        if parent_key is None:
            view.orphans += len(hashes)
            return 0
        view.block_size = block_size
        blocks = view.blocks.setdefault(med, {})
        copies = view.copies.setdefault(med, {})
        provisional = view.provisional.get(med)
        keys = chain_from(
            parent_key, token_bytes(token_ids), 4 * block_size, len(hashes), extra_keys
        )
        if not provisional and blocks.keys().isdisjoint(keys):  # all new: the usual event
            blocks.update(zip(keys, hashes, strict=True))  # newest last, as one at a time
            by_hash.update(zip(hashes, keys, strict=True))
        else:
            for key, engine_hash in zip(keys, hashes, strict=True):
                known = blocks.pop(key, None)
                if provisional and key in provisional:
                    # confirmed, not one more copy: the seeded block may have been evicted
                    # while extproc was down and computed again
                    provisional.discard(key)
                    self.confirmed += 1
                elif known == engine_hash:  # another copy, newest again
                    copies[engine_hash] = copies.get(engine_hash, 0) + 1
                blocks[key] = engine_hash
                by_hash[engine_hash] = key
        while len(blocks) > view.capacity:
            oldest = next(iter(blocks))
            engine_hash = blocks.pop(oldest)
            by_hash.pop(engine_hash, None)
            copies.pop(engine_hash, None)
            view.evicted += 1
            if provisional and oldest in provisional:
                provisional.discard(oldest)
                self.dropped["evicted"] += 1
        return len(hashes)

    def removed(self, pod: PodId, hashes: Sequence[int], medium: Any = None) -> int:
        """Apply one ``BlockRemoved``; returns the blocks dropped (a block with
        copies left stays)."""
        view = self.view(pod)
        med = medium_of(medium)
        by_hash, blocks = view.keys.get(med, {}), view.blocks.get(med, {})
        copies = view.copies.get(med, {})
        provisional = view.provisional.get(med)
        dropped = 0
        for engine_hash in hashes:
            others = copies.pop(engine_hash, 0)
            if others:
                if others > 1:
                    copies[engine_hash] = others - 1
                continue
            key = by_hash.pop(engine_hash, None)
            if key is not None and blocks.pop(key, None) is not None:
                dropped += 1
                if provisional and key in provisional:
                    provisional.discard(key)
                    self.dropped["removed"] += 1
        return dropped

    def cleared(self, pod: PodId, reason: str = "cleared") -> None:
        """``AllBlocksCleared`` (``reason`` "cleared"), or a restarted engine
        ("restarted"): the pod holds nothing, which is exactly known, so a stale view is
        trusted again."""
        view = self.view(pod)
        self._drop_provisional(pod, view, reason)
        view.clear()
        view.stale_until = 0.0

    def mark_stale(self, pod: PodId) -> None:
        """Events were lost: forget the pod's view and distrust it for ``stale_s``
        while it is rebuilt from the next events."""
        view = self.view(pod)
        self._drop_provisional(pod, view, "stale")
        view.clear()
        view.stale_until = time.monotonic() + self.stale_s

    def confirm(self, pod: PodId) -> int:
        """No event of ``pod`` was missed since its seeding (a replay brought back every
        batch, or the first one followed the saved sequence number): its seeded blocks
        are exact again; returns how many were confirmed."""
        view = self.views.get(pod)
        num = 0 if view is None else view.num_provisional()
        if view is not None:
            view.provisional = {}
        self._seeded_pods.discard(pod)
        self.confirmed += num
        return num

    def expire(self, now: float | None = None) -> int:
        """Drop the seeded blocks still unconfirmed ``provisional_s`` after their seeding;
        returns how many went."""
        now = time.monotonic() if now is None else now
        num = 0
        for pod in [p for p in self._seeded_pods if self.views[p].provisional_until <= now]:
            view = self.views[pod]
            for medium, keys in view.provisional.items():
                blocks, by_hash = view.blocks.get(medium, {}), view.keys.get(medium, {})
                copies = view.copies.get(medium, {})
                for key in keys:
                    engine_hash = blocks.pop(key, None)
                    if engine_hash is not None:
                        by_hash.pop(engine_hash, None)
                        copies.pop(engine_hash, None)
                num += len(keys)
            view.provisional = {}
            self._seeded_pods.discard(pod)
        self.dropped["expired"] += num
        return num

    def _drop_provisional(self, pod: PodId, view: PodView, reason: str) -> None:
        self.dropped[reason] += view.num_provisional()
        view.provisional = {}
        self._seeded_pods.discard(pod)

    @property
    def num_provisional(self) -> int:
        """Seeded blocks not yet confirmed, every pod."""
        views = [self.views.get(p) for p in list(self._seeded_pods)]  # any thread
        return sum(v.num_provisional() for v in views if v is not None)

    @staticmethod
    def _key_of(view: PodView, engine_hash: int, medium: str) -> int | None:
        key = view.keys.get(medium, {}).get(engine_hash)
        if key is None:  # a CPU block's parent may sit on the GPU, and the other way
            for other, by_hash in view.keys.items():
                if other != medium and (key := by_hash.get(engine_hash)) is not None:
                    break
        return key

    # Reads (the request path) --------------------------------------------------------

    def match(self, pod: PodId, keys: Sequence[int]) -> tuple[int, int]:
        """The pod's longest run of cached blocks from the start of ``keys``:
        (blocks on the GPU, blocks found only in an offload tier)."""
        view = self.views.get(pod)
        if view is None:
            return 0, 0
        gpu = view.blocks.get(GPU, {})
        # The leading run on the GPU, probed in C (``takewhile`` stops at the first miss):
        # a pod holding a shared system prompt matches its every block.
        on_gpu = len(list(takewhile(gpu.__contains__, keys)))
        if on_gpu == len(keys):
            return on_gpu, 0
        # tuple() copies in one C call: the writer may add a medium meanwhile
        offload = [b for m, b in tuple(view.blocks.items()) if m != GPU]
        if not offload:
            return on_gpu, 0
        elsewhere = 0
        for key in keys[on_gpu:]:
            if key in gpu:
                on_gpu += 1
            elif any(key in b for b in offload):
                elsewhere += 1
            else:
                break
        return on_gpu, elsewhere

    def provisional_in(self, pod: PodId, keys: Sequence[int], num: int | None = None) -> bool:
        """Whether any of ``keys`` (the first ``num``, if given) is a seeded block of
        ``pod`` not yet confirmed; a view without any (the usual case) reads no key."""
        view = self.views.get(pod)
        if view is None or not view.provisional:
            return False
        pending = tuple(view.provisional.values())  # the writer may confirm meanwhile
        return any(key in p for key in islice(keys, num) for p in pending)
