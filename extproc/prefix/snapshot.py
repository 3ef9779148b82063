"""The prefix views kept across a restart (``serve --view-snapshot`` or
``--view-snapshot-dir``).

Without Redis a restarted extproc starts with an empty view and every tenant's next
request lands wherever the load says. So on drain the views are written to a file, and
on start read back:

* the file is NumPy's ``.npz`` (read with ``allow_pickle=False``: no code runs on load),
  written to a temporary file beside it (a dotfile ending ``.tmp``) and moved over it
  (``os.replace``), so a reader sees the old file or the new one, never half of one;
* ``header``: UTF-8 JSON as a uint8 array: ``format`` (``FORMAT``), ``version``,
  ``written_at`` (Unix time), per approximate view its plugin, geometry (block size,
  blocks hashed per prompt) and pods (namespace, name, when the view last recorded for
  it), and per precise view (``precise``) its plugin and pods (namespace, name, block
  size, the KV-event sequence number expected next, media);
* per approximate view ``i``: ``v{i}_keys``, every pod's live block hashes (int64, the
  index's own entries), oldest first, pod after pod, and ``v{i}_counts``, how many are
  each pod's;
* per precise view ``i``: ``p{i}_keys`` (our block keys), ``p{i}_hashes`` (the engine's)
  (uint64), ``p{i}_copies`` (uint32, copies beyond the first), each pod's media one after
  the other, oldest stored first, and ``p{i}_counts``, the blocks of each (pod, medium);
* on load, pods that no longer exist and pods last recorded longer ago than the
  maximum age are dropped, and entries beyond a pod's current capacity (the oldest);
  the rest are recorded in their LRU order. A precise view seeds its pods' views as
  provisional and tells the KV-events subscriber the sequence number to expect
  (``prefix.precise.index``, ``datalayer.kv_events``). A file that cannot be read, is of
  another format or version, or whose geometry differs from the configured plugin's, is
  refused as a whole with one log line. Version 1 files (no precise views) still load.

With a directory (several replicas), each replica writes ``DIR/<replica>.npz`` and at
start reads every file there written within the maximum age, oldest first, into the
union of their views: without Redis each replica saw only its share of the traffic, so
the union is the best guess of each pod's cache; a key in several files takes its place
in the newest. Files (and abandoned temporary files) older than the maximum age are
removed; a fresh temporary file, another replica's write under way, is left alone. Of the
precise views, which every replica builds from the same events, each pod's is taken from
the file that saw the most of its events (the highest sequence number).

With ``--redis-url`` too, the file is read first and the stream's window replayed after
it: both fill the view, and the stream's records, the newer, are the most recently used.

Restored entries are tagged ``tag`` (their evictions' model label), as the file does not
keep which model recorded them.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.pods import PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex
from extproc.prefix.precise.index import PreciseIndex, SavedBlocks, SavedView

log = logging.getLogger("extproc.snapshot")

FORMAT = "extproc-view-snapshot"
VERSION = 2  # 2 added the precise views
READS = (1, 2)
DEFAULT_MAX_AGE_S = 3600.0
SUFFIX = ".npz"
_ZIP_MAGIC = b"PK\x03\x04"  # a .npz is a zip file
# What reading an untrusted file may raise: each refuses it (SnapshotRefused is a ValueError).
_DAMAGED = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile)


def add_snapshot_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve`` flags for the view snapshot."""
    g = p.add_argument_group(
        "View snapshot", "the prefix views kept across a restart, without Redis"
    )
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--view-snapshot",
        type=Path,
        default=env("view-snapshot", None),
        help="write the prefix views to this file on drain and read them back at start "
        "(e.g. on a volume) (default: none, a restart starts empty)",
    )
    where.add_argument(
        "--view-snapshot-dir",
        type=Path,
        default=env("view-snapshot-dir", None),
        help="several replicas: write the views to DIR/<replica>.npz on drain (the replica "
        "named by POD_NAME, else the host name) and at start read the union of every "
        "replica's file in DIR (default: none)",
    )
    g.add_argument(
        "--view-snapshot-max-age-s",
        type=float,
        default=env("view-snapshot-max-age-s", str(DEFAULT_MAX_AGE_S)),
        help="at start, drop the snapshot's pods last recorded longer ago than this, and "
        "in --view-snapshot-dir remove files older than this (default: %(default)s s)",
    )


class SnapshotRefused(ValueError):
    """The file is not a snapshot this extproc can load (says why)."""


@dataclass(frozen=True, slots=True)
class View:
    """One plugin's approximate view, as the snapshot saves and restores it."""

    plugin: str  # the plugin's type name, which view of the file is its
    index: PrefixIndex
    block_size: int
    max_blocks: int
    last_record_age: Callable[[PodId], float | None]  # seconds since the pod's last record
    tag: int = 0  # restored entries' tag


@dataclass(frozen=True, slots=True)
class PreciseView:
    """precise-prefix-cache's token-exact view and where each pod's events stand."""

    plugin: str
    index: PreciseIndex
    next_sequences: Callable[[], Mapping[PodId, int]]  # at the write: expected next
    resume: Callable[[PodId, int], None]  # at start: the events to expect next


@dataclass(frozen=True, slots=True)
class _PodEntries:
    pod: PodId
    recorded_at: float  # Unix time
    keys: Keys  # oldest first


@dataclass(frozen=True, slots=True)
class _PodBlocks:
    pod: PodId
    next_seq: int
    view: SavedView


@dataclass(frozen=True, slots=True)
class _Saved:
    """One file's content."""

    written_at: float
    views: dict[str, list[_PodEntries]]  # approximate, per plugin
    precise: dict[str, list[_PodBlocks]] = field(default_factory=dict)


class SnapshotMetrics:
    """The snapshot's series (registered only with ``--view-snapshot`` or
    ``--view-snapshot-dir``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "extproc_view_snapshot_loads",
            "View snapshot files read at start, by result: loaded, missing (no file yet) "
            "or refused (unreadable, foreign, another version or geometry).",
            ["result"],
            registry=registry,
        )
        self.loaded_files = Gauge(
            "extproc_view_snapshot_loaded_files",
            "Snapshot files whose views were restored at start (several replicas' in "
            "--view-snapshot-dir).",
            registry=registry,
        )
        self.removed_files = Counter(
            "extproc_view_snapshot_removed_files",
            "Files of --view-snapshot-dir removed at start, older than the maximum age.",
            registry=registry,
        )
        self.loaded_entries = Gauge(
            "extproc_view_snapshot_loaded_entries",
            "Entries the view snapshot restored at start, per plugin (the approximate "
            "view's; the precise view's blocks are extproc_kv_events_seeded_blocks).",
            ["plugin"],
            registry=registry,
        )
        self.dropped_entries = Counter(
            "extproc_view_snapshot_dropped_entries",
            "Snapshot entries (a precise view's blocks too) not restored at start: "
            "pod_gone, too_old, over_capacity or no_plugin (the view's plugin is not "
            "configured).",
            ["reason"],
            registry=registry,
        )
        self.writes = Counter(
            "extproc_view_snapshot_writes",
            "View snapshot writes on drain, by result: written or failed.",
            ["result"],
            registry=registry,
        )


class ViewSnapshot:
    """Reads the views at start and writes them on drain: to and from the file ``path``,
    or with ``replica`` to ``path/<replica>.npz`` and from every file in ``path``."""

    def __init__(
        self,
        path: Path,
        max_age_s: float,
        registry: CollectorRegistry,
        now: Callable[[], float],
        replica: str | None = None,
    ) -> None:
        self.directory = path if replica is not None else None
        self.path = path / f"{replica_file_name(replica)}{SUFFIX}" if replica else path
        self.max_age_s = max_age_s
        self.metrics = SnapshotMetrics(registry)
        self.now = now
        # when each restored pod was last recorded, for a pod not recorded since
        self._restored_at: dict[tuple[str, PodId], float] = {}

    def load(
        self,
        views: Sequence[View],
        pods: Collection[PodId],
        precise: Sequence[PreciseView] = (),
    ) -> int:
        """Restore ``views`` and seed ``precise`` from the file(s), keeping only ``pods``;
        returns the approximate entries restored. Never raises: a bad file is refused,
        the views stay as they are."""
        try:
            files = self._files()
        except OSError as exc:  # the directory went away, or cannot be read
            log.warning("view snapshot %s refused, the views start empty: %s", self.path, exc)
            self.metrics.loads.labels("refused").inc()
            return 0
        if not files:
            where = self.directory or self.path
            log.info("view snapshot %s: no file yet, the views start empty", where)
            self.metrics.loads.labels("missing").inc()
            return 0
        by_plugin = {v.plugin: v for v in views}
        saved = []
        for path in files:
            try:
                saved.append(_read(path, by_plugin))
            except _DAMAGED as exc:
                log.warning("view snapshot %s refused, its views are not restored: %s", path, exc)
                self.metrics.loads.labels("refused").inc()
                continue
            self.metrics.loads.labels("loaded").inc()
        self.metrics.loaded_files.set(len(saved))
        saved.sort(key=lambda s: s.written_at)  # oldest first: the newest end most recent
        union = self._union(saved)
        total = sum(self._restore(view, union.pop(view.plugin, []), pods) for view in views)
        for entries in union.values():  # views of plugins no longer configured
            self.metrics.dropped_entries.labels("no_plugin").inc(sum(len(e.keys) for e in entries))
        seeded = sum(self._seed(view, saved, pods) for view in precise)
        log.info(
            "view snapshot %s: %d entries restored, %d precise blocks seeded, from %d file(s)",
            self.directory or self.path,
            total,
            seeded,
            len(saved),
        )
        return total

    def _files(self) -> list[Path]:
        """The files to read; in a directory, those older than the maximum age removed."""
        if self.directory is None:
            return [self.path] if self.path.exists() else []
        oldest = self.now() - self.max_age_s
        fresh = []
        for path in sorted(self.directory.iterdir()):
            snapshot = path.suffix == SUFFIX and not path.name.startswith(".")
            abandoned = path.name.startswith(".") and path.name.endswith(".tmp")
            if not (snapshot or abandoned) or not path.is_file():
                continue
            try:
                old = path.stat().st_mtime < oldest
                if old:
                    path.unlink()
                    self.metrics.removed_files.inc()
                    log.info("view snapshot %s removed: older than %.0f s", path, self.max_age_s)
            except FileNotFoundError:  # another replica removed or renamed it meanwhile
                continue
            if snapshot and not old:
                fresh.append(path)
        return fresh

    def _union(self, saved: Sequence[_Saved]) -> dict[str, list[_PodEntries]]:
        """Each plugin's pods' entries across the files (oldest first), those recorded
        before the maximum age dropped; a key repeated keeps its place in the newest."""
        oldest = self.now() - self.max_age_s
        parts: dict[str, dict[PodId, list[_PodEntries]]] = {}
        for one in saved:
            for plugin, entries in one.views.items():
                pods = parts.setdefault(plugin, {})
                for entry in entries:
                    if entry.recorded_at < oldest:
                        self.metrics.dropped_entries.labels("too_old").inc(len(entry.keys))
                    else:
                        pods.setdefault(entry.pod, []).append(entry)
        return {
            plugin: [_merged(pod, entries) for pod, entries in pods.items()]
            for plugin, pods in parts.items()
        }

    def _restore(self, view: View, saved: list[_PodEntries], pods: Collection[PodId]) -> int:
        restored = 0
        for entries in saved:
            keys = entries.keys
            if entries.pod not in pods:
                self.metrics.dropped_entries.labels("pod_gone").inc(len(keys))
                continue
            room = view.index.max_entries_per_pod - view.index.num_pod_entries(entries.pod)
            if len(keys) > room:
                self.metrics.dropped_entries.labels("over_capacity").inc(len(keys) - room)
                keys = keys[len(keys) - room :]
            # record touches tail first: reversed, the oldest ends least recently used
            view.index.record(keys[::-1], entries.pod, view.tag)
            self._restored_at[(view.plugin, entries.pod)] = entries.recorded_at
            restored += len(keys)
        self.metrics.loaded_entries.labels(view.plugin).set(restored)
        return restored

    def _seed(self, view: PreciseView, saved: Sequence[_Saved], pods: Collection[PodId]) -> int:
        """Seed ``view``'s pods, each from the file that saw most of its events."""
        oldest = self.now() - self.max_age_s
        best: dict[PodId, _PodBlocks] = {}
        for one in saved:  # oldest first: on a tie the newest wins
            for blocks in one.precise.get(view.plugin, []):
                if one.written_at < oldest:
                    self.metrics.dropped_entries.labels("too_old").inc(blocks.view.num_blocks())
                elif blocks.pod not in pods:
                    self.metrics.dropped_entries.labels("pod_gone").inc(blocks.view.num_blocks())
                elif blocks.pod not in best or blocks.next_seq >= best[blocks.pod].next_seq:
                    best[blocks.pod] = blocks
        seeded = 0
        for pod, blocks in best.items():
            seeded += view.index.seed(pod, blocks.view)
            view.resume(pod, blocks.next_seq)
        return seeded

    def write(self, views: Sequence[View], precise: Sequence[PreciseView] = ()) -> int:
        """Write ``views`` and ``precise`` to the file, atomically; returns the entries
        and blocks written. Never raises: a failed write is logged, the previous file
        stays."""
        try:
            written = self._write(views, precise)
        except OSError as exc:
            log.warning("view snapshot %s not written: %s", self.path, exc)
            self.metrics.writes.labels("failed").inc()
            return 0
        self.metrics.writes.labels("written").inc()
        log.info("view snapshot %s: %d entries written", self.path, written)
        return written

    def _write(self, views: Sequence[View], precise: Sequence[PreciseView]) -> int:
        now = self.now()
        header: dict[str, Any] = {"format": FORMAT, "version": VERSION, "written_at": now}
        arrays: dict[str, Any] = {}
        header["views"] = []
        for i, view in enumerate(views):
            pods = view.index.live_entries()
            header["views"].append(
                {
                    "plugin": view.plugin,
                    "block_size": view.block_size,
                    "max_blocks": view.max_blocks,
                    "pods": [
                        [pod.namespace, pod.name, self._recorded_at(view, pod, now)]
                        for pod, _ in pods
                    ],
                }
            )
            arrays[f"v{i}_counts"] = np.array([len(k) for _, k in pods], dtype=np.int64)
            arrays[f"v{i}_keys"] = (
                np.concatenate([k for _, k in pods]) if pods else np.empty(0, dtype=np.int64)
            )
        written = sum(len(a) for name, a in arrays.items() if name.endswith("_keys"))
        header["precise"] = []
        for i, exact in enumerate(precise):
            entry, view_arrays = _precise_arrays(exact)
            header["precise"].append(entry)
            arrays.update({f"p{i}_{name}": a for name, a in view_arrays.items()})
            written += len(view_arrays["keys"])
        buffer = io.BytesIO()
        header_bytes = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        np.savez(buffer, header=header_bytes, **arrays)
        _replace_atomically(self.path, buffer.getvalue())
        return written

    def _recorded_at(self, view: View, pod: PodId, now: float) -> float:
        age = view.last_record_age(pod)
        if age is not None:
            return now - age
        return self._restored_at.get((view.plugin, pod), now)


def replica_file_name(replica: str) -> str:
    """``replica`` as a file name: path separators and other odd characters become
    ``_``, and it never starts with a dot (a dotfile is a write under way)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica)
    return "_" + safe[1:] if safe.startswith(".") else safe or "_"


def _merged(pod: PodId, parts: list[_PodEntries]) -> _PodEntries:
    """One pod's entries from several files (oldest first) as one LRU list: a key in
    several keeps its last place, so the newest file's are the most recently used."""
    if len(parts) == 1:
        return parts[0]
    keys = np.concatenate([p.keys for p in parts])
    _, last_from_end = np.unique(keys[::-1], return_index=True)
    keep = np.sort(len(keys) - 1 - last_from_end)
    return _PodEntries(pod, max(p.recorded_at for p in parts), keys[keep])


def _precise_arrays(view: PreciseView) -> tuple[dict[str, Any], dict[str, Any]]:
    """A precise view's header entry and arrays; pods without a view worth keeping or
    without events yet are left out."""
    sequences = view.next_sequences()
    pods: list[list[Any]] = []
    counts: list[int] = []
    parts: list[SavedBlocks] = []
    for pod in list(view.index.views):
        seq = sequences.get(pod)
        saved = view.index.saved(pod)
        if seq is None or saved is None:
            continue
        media = [m.medium for m in saved.media]
        pods.append([pod.namespace, pod.name, saved.block_size, seq, media])
        counts.extend(len(m.keys) for m in saved.media)
        parts.extend(saved.media)

    def joined(name: str, dtype: type[np.generic]) -> Any:
        return np.concatenate([getattr(m, name) for m in parts]) if parts else np.empty(0, dtype)

    arrays = {
        "counts": np.array(counts, dtype=np.int64),
        "keys": joined("keys", np.uint64),
        "hashes": joined("hashes", np.uint64),
        "copies": joined("copies", np.uint32),
    }
    return {"plugin": view.plugin, "pods": pods}, arrays


def _replace_atomically(path: Path, data: bytes) -> None:
    """``data`` as ``path``'s content: a temporary file beside it, synced, moved over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read(path: Path, views: dict[str, View]) -> _Saved:
    """The file's entries per plugin, checked whole before any is used.

    Raises:
        SnapshotRefused: (and whatever NumPy or zipfile raise on a damaged file).
    """
    with path.open("rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            raise SnapshotRefused("not an extproc view snapshot (not a .npz file)")
        f.seek(0)
        return _read_npz(np.load(f, allow_pickle=False), views)


def _read_npz(npz: Any, views: dict[str, View]) -> _Saved:
    """``_read`` of the opened zip: its header checked, then each view's arrays."""
    with npz:
        header = json.loads(_array(npz, "header", np.uint8).tobytes())
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise SnapshotRefused("not an extproc view snapshot")
        if header.get("version") not in READS:
            raise SnapshotRefused(
                f"version {header.get('version')!r}, this extproc reads "
                f"{' and '.join(map(str, READS))}"
            )
        found: dict[str, list[_PodEntries]] = {}
        for i, saved in enumerate(header["views"]):
            plugin = str(saved["plugin"])
            view = views.get(plugin)
            geometry = (int(saved["block_size"]), int(saved["max_blocks"]))
            if view is not None and geometry != (view.block_size, view.max_blocks):
                raise SnapshotRefused(
                    f"{plugin}'s blocks are {geometry[0]} bytes x {geometry[1]} in the file, "
                    f"{view.block_size} x {view.max_blocks} configured"
                )
            found[plugin] = _pod_entries(
                saved["pods"], _array(npz, f"v{i}_counts", np.int64), _array(npz, f"v{i}_keys")
            )
        precise = {
            str(saved["plugin"]): _pod_blocks(saved["pods"], npz, f"p{i}_")
            for i, saved in enumerate(header.get("precise", []))
        }
        return _Saved(float(header["written_at"]), found, precise)


def _array(npz: Any, name: str, dtype: type[np.generic] = np.int64) -> Any:
    array = npz[name]
    if array.dtype != dtype or array.ndim != 1:
        raise SnapshotRefused(f"{name} is {array.dtype} of {array.ndim} dimensions")
    return array


def _pod_entries(pods: list[Any], counts: Keys, keys: Keys) -> list[_PodEntries]:
    if len(pods) != len(counts) or (counts < 0).any() or int(counts.sum()) != len(keys):
        raise SnapshotRefused("the pods, their counts and the keys do not agree")
    found, start = [], 0
    for (namespace, name, recorded_at), count in zip(pods, counts.tolist(), strict=True):
        pod_keys = keys[start : start + count]
        start += count
        if len(np.unique(pod_keys)) != len(pod_keys):  # an index holds a block once a pod
            raise SnapshotRefused(f"{namespace}/{name}'s keys repeat")
        found.append(_PodEntries(PodId(str(namespace), str(name)), float(recorded_at), pod_keys))
    return found


def _pod_blocks(pods: list[Any], npz: Any, prefix: str) -> list[_PodBlocks]:
    """A precise view's pods, each medium's blocks checked: a key and a hash once each."""
    counts = _array(npz, f"{prefix}counts", np.int64)
    keys, hashes = (
        _array(npz, f"{prefix}keys", np.uint64),
        _array(npz, f"{prefix}hashes", np.uint64),
    )
    copies = _array(npz, f"{prefix}copies", np.uint32)
    media = [m for _, _, _, _, pod_media in pods for m in pod_media]
    total = int(counts.sum()) if len(counts) else 0
    if (
        len(media) != len(counts)
        or (counts < 0).any()
        or not total == len(keys) == len(hashes) == len(copies)
    ):
        raise SnapshotRefused("the precise view's pods, counts and blocks do not agree")
    found, start, medium_idx = [], 0, 0
    for namespace, name, block_size, next_seq, pod_media in pods:
        parts = []
        for medium in pod_media:
            end = start + int(counts[medium_idx])
            medium_idx += 1
            part = SavedBlocks(str(medium), keys[start:end], hashes[start:end], copies[start:end])
            start = end
            if len(np.unique(part.keys)) != len(part.keys) or len(np.unique(part.hashes)) != len(
                part.hashes
            ):
                raise SnapshotRefused(f"{namespace}/{name}'s precise blocks repeat")
            parts.append(part)
        if int(next_seq) < 0:
            raise SnapshotRefused(f"{namespace}/{name}'s sequence number is {next_seq}")
        size = None if block_size is None else int(block_size)
        view = SavedView(size, tuple(parts))
        found.append(_PodBlocks(PodId(str(namespace), str(name)), int(next_seq), view))
    return found
