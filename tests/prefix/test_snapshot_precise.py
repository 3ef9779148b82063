"""The view snapshot's precise views: each pod's token-exact blocks (every medium, our
keys, the engine's hashes, copies), block size and next KV-event sequence number, saved on
drain and seeded at start as provisional; version 1 files still load; damaged precise
arrays refuse the file; a pod gone or a file too old seeds nothing; with several files a
pod's view comes from the one that saw most of its events."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import PodId
from extproc.prefix import PrefixIndex
from extproc.prefix.precise.index import PreciseIndex
from extproc.prefix.precise.keys import chain_keys
from extproc.prefix.snapshot import PreciseView, ViewSnapshot
from tests.prefix.test_snapshot import NOW, A, B, keys_of, sample, view

BS = 4
PLUGIN = "precise-prefix-cache"


class Subscriber:
    """What the snapshot needs of the KV-events subscriber: its sequence numbers."""

    def __init__(self, next_seq: dict[PodId, int] | None = None) -> None:
        self.next_seq = dict(next_seq or {})
        self.resumed: dict[PodId, int] = {}

    def view(self, index: PreciseIndex) -> PreciseView:
        return PreciseView(PLUGIN, index, lambda: self.next_seq, self.resumed.__setitem__)


def warmed() -> PreciseIndex:
    """a: two chains on the GPU (one block cached twice), one block offloaded to the
    CPU; b: one chain."""
    index = PreciseIndex(1000)
    index.stored(A, [11, 12], None, [1] * 2 * BS, BS, None)
    index.stored(A, [21, 22], 11, [2] * 2 * BS, BS, None)
    index.stored(A, [12], 11, [1] * BS, BS, None)  # another copy of block 12
    index.stored(A, [31], None, [3] * BS, BS, None, "CPU")
    index.stored(B, [41, 42, 43], None, [4] * 3 * BS, BS, None)
    return index


def snapshot(path: Path, registry: CollectorRegistry | None = None, now: float = NOW,
             replica: str | None = None) -> ViewSnapshot:  # fmt: skip
    return ViewSnapshot(path, 600, registry or CollectorRegistry(), lambda: now, replica)


def test_the_precise_view_round_trips_provisional(tmp_path: Path) -> None:
    path, old = tmp_path / "view.npz", warmed()
    assert snapshot(path).write([], [Subscriber({A: 7, B: 3}).view(old)]) == 8
    index, sub, registry = PreciseIndex(1000, provisional_s=60), Subscriber(), CollectorRegistry()
    snapshot(path, registry).load([], {A, B}, [sub.view(index)])
    assert sub.resumed == {A: 7, B: 3}
    for pod in (A, B):
        new, was = index.views[pod], old.views[pod]
        assert (new.blocks, new.keys, new.copies) == (was.blocks, was.keys, was.copies)
        assert [list(b) for b in new.blocks.values()] == [list(b) for b in was.blocks.values()]
        assert new.block_size == BS and not new.stale()
        assert new.provisional == {m: set(b) for m, b in was.blocks.items()}
    chain = chain_keys([1] * BS + [2] * 2 * BS, BS)
    assert index.match(A, chain) == old.match(A, chain) == (3, 0)
    assert index.provisional_in(A, chain)
    assert index.seeded == index.num_provisional == 8
    # the restored hash -> key map: a removal finds its block, the copy counted
    first = chain_keys([1] * 2 * BS, BS)
    index.removed(A, [12])
    assert index.match(A, first) == (2, 0)
    index.removed(A, [12])
    assert index.match(A, first) == (1, 0) and index.dropped["removed"] == 1


def test_a_view_not_worth_keeping_is_not_saved(tmp_path: Path) -> None:
    """A stale view (being rebuilt), engine hashes that are not 64-bit integers, and a
    pod with no sequence number (no batch received) are left out."""
    old = warmed()
    old.stored(PodId("ns", "bytes"), [b"\x01" * 32], None, [5] * BS, BS, None)  # type: ignore[list-item]
    old.stored(PodId("ns", "quiet"), [51], None, [5] * BS, BS, None)
    old.mark_stale(B)
    seqs = {A: 1, B: 1, PodId("ns", "bytes"): 1}
    path = tmp_path / "view.npz"
    assert snapshot(path).write([], [Subscriber(seqs).view(old)]) == 5
    index, sub = PreciseIndex(1000), Subscriber()
    snapshot(path).load([], {A, B, PodId("ns", "bytes"), PodId("ns", "quiet")}, [sub.view(index)])
    assert set(index.views) == {A} and sub.resumed == {A: 1}


def test_pods_gone_and_files_too_old_seed_nothing(tmp_path: Path) -> None:
    path = tmp_path / "view.npz"
    snapshot(path, now=NOW).write([], [Subscriber({A: 7, B: 3}).view(warmed())])
    registry, index, sub = CollectorRegistry(), PreciseIndex(1000), Subscriber()
    snapshot(path, registry, now=NOW + 10).load([], {A}, [sub.view(index)])
    assert set(index.views) == {A} and sub.resumed == {A: 7}
    assert sample(registry, "extproc_view_snapshot_dropped_entries_total", reason="pod_gone") == 3
    registry, index, sub = CollectorRegistry(), PreciseIndex(1000), Subscriber()
    snapshot(path, registry, now=NOW + 601).load([], {A, B}, [sub.view(index)])
    assert index.views == {} and sub.resumed == {}
    assert sample(registry, "extproc_view_snapshot_dropped_entries_total", reason="too_old") == 8


def test_a_smaller_capacity_seeds_each_mediums_newest_blocks(tmp_path: Path) -> None:
    path = tmp_path / "view.npz"
    snapshot(path).write([], [Subscriber({A: 7}).view(warmed())])
    index = PreciseIndex(2)
    snapshot(path).load([], {A}, [Subscriber().view(index)])
    assert list(index.views[A].blocks["GPU"].values()) == [22, 12]  # 12 stored again last
    assert list(index.views[A].blocks["CPU"].values()) == [31]


def test_with_several_files_each_pod_comes_from_the_one_with_most_events(tmp_path: Path) -> None:
    """Replicas see the same events; the one that drained last saw the most. r1 wrote
    last but r2's subscriber had heard more of a."""
    newer_a = warmed()
    newer_a.stored(A, [61], None, [6] * BS, BS, None)
    snapshot(tmp_path, now=NOW - 20, replica="r2").write(
        [], [Subscriber({A: 9, B: 3}).view(newer_a)]
    )
    snapshot(tmp_path, now=NOW - 10, replica="r1").write(
        [], [Subscriber({A: 8, B: 3}).view(warmed())]
    )
    for name, at in (("r2", NOW - 20), ("r1", NOW - 10)):
        os.utime(tmp_path / f"{name}.npz", (at, at))
    index, sub = PreciseIndex(1000), Subscriber()
    snapshot(tmp_path, replica="r3").load([], {A, B}, [sub.view(index)])
    assert sub.resumed == {A: 9, B: 3}
    assert 61 in index.views[A].blocks["GPU"].values()


def test_approximate_and_precise_views_share_the_file(tmp_path: Path) -> None:
    path, approx = tmp_path / "view.npz", PrefixIndex(1000)
    approx.record(keys_of("hello " * 40), A)
    snapshot(path).write([view(approx)], [Subscriber({A: 7, B: 3}).view(warmed())])
    restored, index = PrefixIndex(1000), PreciseIndex(1000)
    assert snapshot(path).load([view(restored)], {A, B}, [Subscriber().view(index)]) == (
        approx.num_entries
    )
    assert index.seeded == 8


def _rewrite(
    path: Path, change: Callable[[dict[str, object], dict[str, np.ndarray]], None]
) -> None:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    header = json.loads(arrays.pop("header").tobytes())
    change(header, arrays)
    buffer = io.BytesIO()
    raw = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(buffer, header=raw, **arrays)
    path.write_bytes(buffer.getvalue())


def _version_1(header: dict[str, object], arrays: dict[str, np.ndarray]) -> None:
    """As version 1 wrote it: no precise views."""
    header["version"] = 1
    del header["precise"]
    for name in [n for n in arrays if n.startswith("p")]:
        del arrays[name]


def test_a_version_1_file_still_loads(tmp_path: Path) -> None:
    path, approx = tmp_path / "view.npz", PrefixIndex(1000)
    approx.record(keys_of("hello " * 40), A)
    snapshot(path).write([view(approx)], [Subscriber({A: 7}).view(warmed())])
    _rewrite(path, _version_1)
    registry, restored, index = CollectorRegistry(), PrefixIndex(1000), PreciseIndex(1000)
    assert snapshot(path, registry).load([view(restored)], {A}, [Subscriber().view(index)]) == (
        approx.num_entries
    )
    assert index.views == {}
    assert sample(registry, "extproc_view_snapshot_loads_total", result="loaded") == 1


def _set(name: str, make: Callable[[np.ndarray], np.ndarray]) -> Callable[..., None]:
    def change(header: dict[str, object], arrays: dict[str, np.ndarray]) -> None:
        arrays[name] = make(arrays[name])

    return change


def _pods(change: Callable[[list[list[Any]]], object]) -> Callable[..., None]:
    def apply(header: dict[str, object], arrays: dict[str, np.ndarray]) -> None:
        change(header["precise"][0]["pods"])  # type: ignore[index]

    return apply


DAMAGE = {
    "counts past the blocks": _set("p0_counts", lambda a: a + 1),
    "hashes short": _set("p0_hashes", lambda a: a[:-1]),
    "keys signed": _set("p0_keys", lambda a: a.astype(np.int64)),
    "a key repeated": _set("p0_keys", lambda a: np.full_like(a, 5)),
    "a hash repeated": _set("p0_hashes", lambda a: np.full_like(a, 5)),
    "a negative sequence": _pods(lambda pods: pods[0].__setitem__(3, -1)),
    "a medium missing": _pods(lambda pods: pods[0][4].pop()),
    "a pod's fields short": _pods(lambda pods: pods[0].pop()),
}


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_damaged_precise_arrays_refuse_the_file(
    tmp_path: Path, damage: Callable[..., None]
) -> None:
    path = tmp_path / "view.npz"
    snapshot(path).write([], [Subscriber({A: 7, B: 3}).view(warmed())])
    _rewrite(path, damage)
    registry, index, sub = CollectorRegistry(), PreciseIndex(1000), Subscriber()
    snapshot(path, registry).load([], {A, B}, [sub.view(index)])
    assert index.views == {} and sub.resumed == {}
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 1


def test_the_undamaged_precise_file_loads(tmp_path: Path) -> None:
    """The control of the damage cases."""
    path = tmp_path / "view.npz"
    snapshot(path).write([], [Subscriber({A: 7, B: 3}).view(warmed())])
    _rewrite(path, lambda header, arrays: None)
    index = PreciseIndex(1000)
    snapshot(path).load([], {A, B}, [Subscriber().view(index)])
    assert index.seeded == 8
