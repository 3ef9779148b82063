"""The approximate prefix views kept across a restart (``serve --view-snapshot``).

Without Redis a restarted extproc starts with an empty view and every tenant's next
request lands wherever the load says. So on drain the views are written to a file, and
on start read back:

* the file is NumPy's ``.npz`` (read with ``allow_pickle=False``: no code runs on load),
  written to a temporary file beside it and moved over it (``os.replace``), so a reader
  sees the old file or the new one, never half of one;
* ``header``: UTF-8 JSON as a uint8 array: ``format`` (``FORMAT``), ``version``,
  ``written_at`` (Unix time), and per view its plugin, geometry (block size, blocks
  hashed per prompt) and pods (namespace, name, when the view last recorded for it);
* per view ``i``: ``v{i}_keys``, every pod's live block hashes (int64, the index's own
  entries), oldest first, pod after pod, and ``v{i}_counts``, how many are each pod's;
* on load, pods that no longer exist and pods last recorded longer ago than the
  maximum age are dropped, and entries beyond a pod's current capacity (the oldest);
  the rest are recorded in their LRU order. A file that cannot be read, is of another
  format or version, or whose geometry differs from the configured plugin's, is
  refused as a whole with one log line: the views start empty.

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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.pods import PodId
from extproc.prefix.hashing import Keys
from extproc.prefix.index import PrefixIndex

log = logging.getLogger("extproc.snapshot")

FORMAT = "extproc-view-snapshot"
VERSION = 1
DEFAULT_MAX_AGE_S = 3600.0
_ZIP_MAGIC = b"PK\x03\x04"  # a .npz is a zip file
# What reading an untrusted file may raise: each refuses it (SnapshotRefused is a ValueError).
_DAMAGED = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile)


def add_snapshot_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """``serve`` flags for the view snapshot."""
    g = p.add_argument_group(
        "View snapshot", "the approximate prefix views kept across a restart, without Redis"
    )
    g.add_argument(
        "--view-snapshot",
        type=Path,
        default=env("view-snapshot", None),
        help="write the approximate prefix views to this file on drain and read them back "
        "at start (e.g. on a volume) (default: none, a restart starts empty)",
    )
    g.add_argument(
        "--view-snapshot-max-age-s",
        type=float,
        default=env("view-snapshot-max-age-s", str(DEFAULT_MAX_AGE_S)),
        help="at start, drop the snapshot's pods last recorded longer ago than this "
        "(default: %(default)s s)",
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
class _PodEntries:
    pod: PodId
    recorded_at: float  # Unix time
    keys: Keys  # oldest first


class SnapshotMetrics:
    """The snapshot's series (registered only with ``--view-snapshot``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "extproc_view_snapshot_loads",
            "View snapshot reads at start, by result: loaded, missing (no file yet) or "
            "refused (unreadable, foreign, another version or geometry).",
            ["result"],
            registry=registry,
        )
        self.loaded_entries = Gauge(
            "extproc_view_snapshot_loaded_entries",
            "Entries the view snapshot restored at start, per plugin.",
            ["plugin"],
            registry=registry,
        )
        self.dropped_entries = Counter(
            "extproc_view_snapshot_dropped_entries",
            "Snapshot entries not restored at start: pod_gone, too_old, over_capacity or "
            "no_plugin (the view's plugin is not configured).",
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
    """Reads the views from ``path`` at start and writes them there on drain."""

    def __init__(
        self, path: Path, max_age_s: float, registry: CollectorRegistry, now: Callable[[], float]
    ) -> None:
        self.path = path
        self.max_age_s = max_age_s
        self.metrics = SnapshotMetrics(registry)
        self.now = now
        # when each restored pod was last recorded, for a pod not recorded since
        self._restored_at: dict[tuple[str, PodId], float] = {}

    def load(self, views: Sequence[View], pods: Collection[PodId]) -> int:
        """Restore ``views`` from the file, keeping only ``pods``; returns the entries
        restored. Never raises: a bad file is refused, the views stay as they are."""
        if not self.path.exists():
            log.info("view snapshot %s: no file yet, the views start empty", self.path)
            self.metrics.loads.labels("missing").inc()
            return 0
        try:
            saved = _read(self.path, {v.plugin: v for v in views})
        except _DAMAGED as exc:
            log.warning("view snapshot %s refused, the views start empty: %s", self.path, exc)
            self.metrics.loads.labels("refused").inc()
            return 0
        total = sum(self._restore(view, saved.pop(view.plugin, []), pods) for view in views)
        for entries in saved.values():  # views of plugins no longer configured
            self.metrics.dropped_entries.labels("no_plugin").inc(sum(len(e.keys) for e in entries))
        self.metrics.loads.labels("loaded").inc()
        log.info("view snapshot %s: %d entries restored", self.path, total)
        return total

    def _restore(self, view: View, saved: list[_PodEntries], pods: Collection[PodId]) -> int:
        oldest = self.now() - self.max_age_s
        restored = 0
        for entries in saved:
            keys = entries.keys
            if entries.pod not in pods:
                self.metrics.dropped_entries.labels("pod_gone").inc(len(keys))
                continue
            if entries.recorded_at < oldest:
                self.metrics.dropped_entries.labels("too_old").inc(len(keys))
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

    def write(self, views: Sequence[View]) -> int:
        """Write ``views`` to the file, atomically; returns the entries written. Never
        raises: a failed write is logged, the previous file stays."""
        try:
            written = self._write(views)
        except OSError as exc:
            log.warning("view snapshot %s not written: %s", self.path, exc)
            self.metrics.writes.labels("failed").inc()
            return 0
        self.metrics.writes.labels("written").inc()
        log.info("view snapshot %s: %d entries written", self.path, written)
        return written

    def _write(self, views: Sequence[View]) -> int:
        now = self.now()
        header: dict[str, Any] = {"format": FORMAT, "version": VERSION, "written_at": now}
        arrays: dict[str, Keys] = {}
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
        buffer = io.BytesIO()
        header_bytes = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        np.savez(buffer, header=header_bytes, **arrays)  # type: ignore[arg-type]
        _replace_atomically(self.path, buffer.getvalue())
        return sum(len(a) for name, a in arrays.items() if name.endswith("_keys"))

    def _recorded_at(self, view: View, pod: PodId, now: float) -> float:
        age = view.last_record_age(pod)
        if age is not None:
            return now - age
        return self._restored_at.get((view.plugin, pod), now)


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


def _read(path: Path, views: dict[str, View]) -> dict[str, list[_PodEntries]]:
    """The file's entries per plugin, checked whole before any is used.

    Raises:
        SnapshotRefused: (and whatever NumPy or zipfile raise on a damaged file).
    """
    with path.open("rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            raise SnapshotRefused("not an extproc view snapshot (not a .npz file)")
        f.seek(0)
        return _read_npz(np.load(f, allow_pickle=False), views)


def _read_npz(npz: Any, views: dict[str, View]) -> dict[str, list[_PodEntries]]:
    """``_read`` of the opened zip: its header checked, then each view's arrays."""
    with npz:
        header = json.loads(_array(npz, "header", np.uint8).tobytes())
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise SnapshotRefused("not an extproc view snapshot")
        if header.get("version") != VERSION:
            raise SnapshotRefused(
                f"version {header.get('version')!r}, this extproc reads {VERSION}"
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
        return found


def _array(npz: Any, name: str, dtype: type[np.generic] = np.int64) -> Keys:
    array = npz[name]
    if array.dtype != dtype or array.ndim != 1:
        raise SnapshotRefused(f"{name} is {array.dtype} of {array.ndim} dimensions")
    out: Keys = array
    return out


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
