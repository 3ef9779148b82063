"""The view snapshot (``--view-snapshot``): written on drain, read at start; pods gone and
old entries dropped; a damaged, foreign or mismatched file refused, the views empty."""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.cli import build_parser
from extproc.cli.app import snapshot_views, start
from extproc.errors import ConfigError
from extproc.pods import PodId
from extproc.prefix import PrefixIndex, hash_prompt
from extproc.prefix.hashing import Keys, as_keys
from extproc.prefix.snapshot import FORMAT, View, ViewSnapshot
from testkit.example_pods import EXAMPLE_PODS_FILE

A, B = PodId("ns", "a"), PodId("ns", "b")
NOW = 1_000_000.0
SIZE, BLOCKS = 64, 128


def keys_of(text: str) -> Keys:
    return as_keys(hash_prompt("m", text, SIZE, BLOCKS))


def view(
    index: PrefixIndex, ages: dict[PodId, float] | None = None, size: int = SIZE, plugin: str = "p"
) -> View:
    ages = ages or {}
    return View(plugin, index, size, BLOCKS, ages.get, tag=0)


def live(index: PrefixIndex, pod: PodId) -> list[int]:
    """The pod's entries, oldest first."""
    lru = index.storage.lru_by_pod.get(pod)
    return [] if lru is None else index.storage.live_keys(lru).tolist()


def snapshot(
    path: Path, registry: CollectorRegistry | None = None, now: float = NOW, max_age_s: float = 60
) -> ViewSnapshot:
    return ViewSnapshot(path, max_age_s, registry or CollectorRegistry(), lambda: now)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def recorded() -> PrefixIndex:
    """Two pods' views: a shared prompt then one of its own each, and the shared one again
    on a (its first block most recent there)."""
    index = PrefixIndex(1000)
    shared = "system prompt " * 40
    for pod, own in ((A, "tenant a " * 30), (B, "tenant b " * 30)):
        index.record(keys_of(shared), pod)
        index.record(keys_of(shared + own), pod)
    index.record(keys_of(shared), A)
    return index


def test_round_trip_restores_each_pods_entries_in_lru_order(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    path = tmp_path / "view.npz"
    assert snapshot(path).write([view(recorded, {A: 1.0, B: 2.0})]) == recorded.num_entries
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    assert snapshot(path, registry).load([view(restored)], {A, B}) == recorded.num_entries
    for pod in (A, B):
        assert live(restored, pod) == live(recorded, pod)
    prompt = keys_of("system prompt " * 40 + "tenant b " * 30)
    assert restored.match(prompt, [A, B], 2) == recorded.match(prompt, [A, B], 2)
    assert sample(registry, "extproc_view_snapshot_loads_total", result="loaded") == 1
    assert sample(registry, "extproc_view_snapshot_loaded_entries", plugin="p") == (
        recorded.num_entries
    )


def test_restored_lru_order_decides_the_next_eviction(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    """Not only the set of entries: their order, so a full pod evicts what it would have."""
    path = tmp_path / "view.npz"
    snapshot(path).write([view(recorded)])
    restored = PrefixIndex(recorded.num_pod_entries(A))
    snapshot(path).load([view(restored)], {A})
    extra = keys_of("new prompt " * 12)
    for index in (recorded, restored):
        index.limit_pod(A, recorded.num_pod_entries(A))
        index.record(extra, A)
    assert live(restored, A) == live(recorded, A)


def test_pods_that_no_longer_exist_are_dropped(tmp_path: Path, recorded: PrefixIndex) -> None:
    path = tmp_path / "view.npz"
    snapshot(path).write([view(recorded)])
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    assert snapshot(path, registry).load([view(restored)], {A}) == recorded.num_pod_entries(A)
    assert restored.pods() == [A]
    assert sample(registry, "extproc_view_snapshot_dropped_entries_total", reason="pod_gone") == (
        recorded.num_pod_entries(B)
    )


def test_pods_last_recorded_before_the_max_age_are_dropped(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    """a recorded 10 s before the write, b 100 s: read 30 s later with a 60 s maximum,
    a is 40 s old and kept, b 130 s and dropped."""
    path = tmp_path / "view.npz"
    snapshot(path, now=NOW).write([view(recorded, {A: 10.0, B: 100.0})])
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    snapshot(path, registry, now=NOW + 30, max_age_s=60).load([view(restored)], {A, B})
    assert restored.pods() == [A]
    assert sample(registry, "extproc_view_snapshot_dropped_entries_total", reason="too_old") == (
        recorded.num_pod_entries(B)
    )


def test_a_restored_pod_not_recorded_since_keeps_its_time(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    """Restarts in a row do not make old entries new: a restored pod's time is carried."""
    path = tmp_path / "view.npz"
    snapshot(path, now=NOW).write([view(recorded, {A: 50.0, B: 50.0})])
    restored = PrefixIndex(1000)
    again = snapshot(path, now=NOW + 5)
    again.load([view(restored)], {A, B})
    again.write([view(restored)])  # no record since: no age
    last = PrefixIndex(1000)
    snapshot(path, now=NOW + 20, max_age_s=60).load([view(last)], {A, B})
    assert last.num_entries == 0  # 70 s since their last record


def test_a_smaller_capacity_keeps_each_pods_newest_entries(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    path = tmp_path / "view.npz"
    snapshot(path).write([view(recorded)])
    registry = CollectorRegistry()
    restored = PrefixIndex(5)
    snapshot(path, registry).load([view(restored)], {A})
    assert live(restored, A) == live(recorded, A)[-5:]
    assert sample(
        registry, "extproc_view_snapshot_dropped_entries_total", reason="over_capacity"
    ) == (recorded.num_pod_entries(A) - 5)


def test_a_view_of_a_plugin_not_configured_is_dropped(
    tmp_path: Path, recorded: PrefixIndex
) -> None:
    path = tmp_path / "view.npz"
    snapshot(path).write([view(recorded, plugin="gone")])
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    assert snapshot(path, registry).load([view(restored)], {A, B}) == 0
    assert sample(registry, "extproc_view_snapshot_dropped_entries_total", reason="no_plugin") == (
        recorded.num_entries
    )


def test_no_file_yet_starts_empty_without_a_refusal(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    assert snapshot(tmp_path / "none.npz", registry).load([view(PrefixIndex(10))], {A}) == 0
    assert sample(registry, "extproc_view_snapshot_loads_total", result="missing") == 1
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 0


def _npz(header: object, **arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    raw = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(buffer, header=raw, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def _valid(recorded: PrefixIndex, tmp_path: Path) -> bytes:
    path = tmp_path / "valid.npz"
    snapshot(path).write([view(recorded)])
    return path.read_bytes()


def _pickled() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, header=np.array([{"format": FORMAT}], dtype=object))
    return buffer.getvalue()


def _npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.arange(10, dtype=np.int64))
    return buffer.getvalue()


def _header_with(**changes: object) -> Callable[[bytes], bytes]:
    def change(valid: bytes) -> bytes:
        with np.load(io.BytesIO(valid), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = json.loads(arrays.pop("header").tobytes())
        header.update(changes)
        return _npz(header, **arrays)

    return change


def _view_with(**changes: object) -> Callable[[bytes], bytes]:
    def change(valid: bytes) -> bytes:
        with np.load(io.BytesIO(valid), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = json.loads(arrays.pop("header").tobytes())
        header["views"][0].update(changes)
        return _npz(header, **arrays)

    return change


def _counts_off(valid: bytes) -> bytes:
    with np.load(io.BytesIO(valid), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    header = json.loads(arrays.pop("header").tobytes())
    arrays["v0_counts"][-1] += 5  # the last pod's would run past the keys
    return _npz(header, **arrays)


def _repeated_keys(valid: bytes) -> bytes:
    with np.load(io.BytesIO(valid), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    header = json.loads(arrays.pop("header").tobytes())
    arrays["v0_keys"] = np.full_like(arrays["v0_keys"], 7)
    return _npz(header, **arrays)


def _flip_a_key_byte(valid: bytes) -> bytes:
    """One byte of the stored keys changed: the zip member's CRC no longer matches."""
    start = valid.index(keys_of("system prompt " * 40)[:1].tobytes())
    damaged = bytearray(valid)
    damaged[start] ^= 0xFF
    return bytes(damaged)


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda valid: valid[: len(valid) // 2],
    "empty": lambda valid: b"",
    "a byte flipped": _flip_a_key_byte,
    "not npz": lambda valid: b"pods:\n  - name: a\n",
    "pickled objects": lambda valid: _pickled(),
    "one npy array": lambda valid: _npy(),
    "foreign format": _header_with(format="someone-elses"),
    "another version": _header_with(version=99),
    "another block size": _view_with(block_size=SIZE * 2),
    "another max blocks": _view_with(max_blocks=BLOCKS + 1),
    "counts that do not add up": _counts_off,
    "repeated keys": _repeated_keys,
    "header not an object": lambda valid: _npz([1, 2, 3]),
    "views missing": _header_with(views=None),
}


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_damaged_foreign_or_mismatched_file_is_refused_and_the_views_start_empty(
    tmp_path: Path,
    recorded: PrefixIndex,
    damage: Callable[[bytes], bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "view.npz"
    path.write_bytes(damage(_valid(recorded, tmp_path)))
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    with caplog.at_level(logging.WARNING, logger="extproc.snapshot"):
        assert snapshot(path, registry).load([view(restored)], {A, B}) == 0
    assert restored.num_entries == 0
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 1
    assert sample(registry, "extproc_view_snapshot_loads_total", result="loaded") == 0
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, caplog.records


def test_the_unchanged_file_is_loaded(tmp_path: Path, recorded: PrefixIndex) -> None:
    """The control of the damage cases: the same steps without damage load."""
    path = tmp_path / "view.npz"
    path.write_bytes(_valid(recorded, tmp_path))
    restored = PrefixIndex(1000)
    assert snapshot(path).load([view(restored)], {A, B}) == recorded.num_entries


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(
    tmp_path: Path, recorded: PrefixIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "view.npz"
    path.write_bytes(b"previous")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("extproc.prefix.snapshot.os.fsync", full_disk)
    registry = CollectorRegistry()
    assert snapshot(path, registry).write([view(recorded)]) == 0
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.npz"]
    assert sample(registry, "extproc_view_snapshot_writes_total", result="failed") == 1


def _serve(path: Path, *flags: str) -> argparse.Namespace:
    ports = ["--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"]
    return build_parser().parse_args(
        ["serve", "--pods", str(EXAMPLE_PODS_FILE), *ports, "--view-snapshot", str(path), *flags]
    )


def test_serve_writes_the_views_on_stop_and_reads_them_at_start(tmp_path: Path) -> None:
    path = tmp_path / "view.npz"
    running = start(_serve(path), CollectorRegistry())
    try:
        (first,) = snapshot_views(running.router.scheduler)
        pod = running.router.pods[0].id
        prompt = hash_prompt("sim-model", "hello " * 100, first.block_size, first.max_blocks)
        first.index.record(prompt, pod)
    finally:
        running.stop(0.0)
    registry = CollectorRegistry()
    running = start(_serve(path), registry)
    try:
        (second,) = snapshot_views(running.router.scheduler)
        assert second.index is not first.index
        assert live(second.index, pod) == live(first.index, pod)
        assert sample(registry, "kthena_router_prefix_cache_entries") == len(prompt)
    finally:
        running.stop(0.0)


def test_serve_refuses_a_max_age_that_is_not_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--view-snapshot-max-age-s must be greater than 0"):
        start(_serve(tmp_path / "v.npz", "--view-snapshot-max-age-s", "0"), CollectorRegistry())


def test_serve_refuses_a_snapshot_in_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--view-snapshot: no directory .*missing"):
        start(_serve(tmp_path / "missing" / "v.npz"), CollectorRegistry())
