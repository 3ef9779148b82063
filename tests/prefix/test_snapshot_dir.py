"""``--view-snapshot-dir``: each replica writes its own file, and a starting replica loads
the union of every replica's fresh file (the newest's entries the most recently used),
removes the old ones, and leaves another replica's write under way alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.cli import build_parser
from extproc.cli.app import snapshot_views, start
from extproc.errors import ConfigError
from extproc.prefix import PrefixIndex, hash_prompt
from extproc.prefix.snapshot import ViewSnapshot, replica_file_name
from testkit.example_pods import EXAMPLE_PODS_FILE
from tests.prefix.test_snapshot import NOW, A, B, keys_of, live, sample, view

MAX_AGE_S = 600.0


def replica(directory: Path, name: str, registry: CollectorRegistry | None = None,
            now: float = NOW) -> ViewSnapshot:  # fmt: skip
    return ViewSnapshot(directory, MAX_AGE_S, registry or CollectorRegistry(), lambda: now, name)


def served(*prompts: tuple[str, object]) -> PrefixIndex:
    """A replica's view: each prompt recorded on its pod, in order."""
    index = PrefixIndex(1000)
    for text, pod in prompts:
        index.record(keys_of(text), pod)  # type: ignore[arg-type]
    return index


SHARED = "system prompt " * 40


@pytest.fixture
def two_replicas(tmp_path: Path) -> tuple[PrefixIndex, PrefixIndex]:
    """Each replica routed its share: r1 a's tenant and the shared prompt on a, r2 b's
    tenant and the shared prompt on a too (later: written after r1)."""
    r1 = served((SHARED, A), (SHARED + "tenant a " * 30, A))
    r2 = served((SHARED + "tenant b " * 30, B), (SHARED + "tenant c " * 30, A))
    replica(tmp_path, "extproc-r1", now=NOW - 20).write([view(r1)])
    replica(tmp_path, "extproc-r2", now=NOW - 10).write([view(r2)])
    os.utime(tmp_path / "extproc-r1.npz", (NOW - 20, NOW - 20))
    os.utime(tmp_path / "extproc-r2.npz", (NOW - 10, NOW - 10))
    return r1, r2


def test_each_replica_writes_its_own_file(tmp_path: Path, two_replicas: object) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extproc-r1.npz", "extproc-r2.npz"]


def test_a_starting_replica_loads_the_union_of_every_replicas_file(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    r1, r2 = two_replicas
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    loaded = replica(tmp_path, "extproc-r3", registry).load([view(restored)], {A, B})
    union_a = set(live(r1, A)) | set(live(r2, A))
    assert set(live(restored, A)) == union_a and loaded == len(union_a) + r2.num_pod_entries(B)
    assert live(restored, B) == live(r2, B)
    for text in ("tenant a ", "tenant b ", "tenant c "):
        prompt = keys_of(SHARED + text * 30)
        best = max(restored.match(prompt, [A, B], 2).items(), key=lambda kv: kv[1])
        assert best == (B if text == "tenant b " else A, len(prompt))
    assert sample(registry, "extproc_view_snapshot_loaded_files") == 2
    assert sample(registry, "extproc_view_snapshot_loads_total", result="loaded") == 2


def test_the_newest_files_entries_are_the_most_recently_used(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    """r2 wrote last: its entries of a (the shared prompt's blocks too, which r1 also
    has) come after r1's own, so a full pod evicts r1's first."""
    r1, r2 = two_replicas
    restored = PrefixIndex(1000)
    replica(tmp_path, "extproc-r3").load([view(restored)], {A, B})
    order = live(restored, A)
    only_r1 = [k for k in live(r1, A) if k not in set(live(r2, A))]
    assert order == only_r1 + live(r2, A)


def test_a_small_capacity_keeps_the_newest_files_entries(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    _, r2 = two_replicas
    room = r2.num_pod_entries(A)
    restored = PrefixIndex(room)
    replica(tmp_path, "extproc-r3").load([view(restored)], {A})
    assert live(restored, A) == live(r2, A)


def test_files_older_than_the_max_age_are_removed_and_not_loaded(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    _, r2 = two_replicas
    old = NOW - MAX_AGE_S - 1
    os.utime(tmp_path / "extproc-r1.npz", (old, old))
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    replica(tmp_path, "extproc-r3", registry).load([view(restored)], {A, B})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extproc-r2.npz"]
    assert live(restored, A) == live(r2, A)
    assert sample(registry, "extproc_view_snapshot_removed_files_total") == 1
    assert sample(registry, "extproc_view_snapshot_loaded_files") == 1


def test_a_write_under_way_is_ignored_and_an_abandoned_one_removed(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    """Another replica's temporary file (a dotfile ending .tmp, as the atomic write names
    it): fresh, it is neither read nor removed; older than the max age, it was left by a
    crash and goes."""
    r1, r2 = two_replicas
    writing = tmp_path / ".extproc-r4.npz.a1b2.tmp"
    writing.write_bytes((tmp_path / "extproc-r1.npz").read_bytes()[:50])  # half written
    os.utime(writing, (NOW, NOW))
    abandoned = tmp_path / ".extproc-r5.npz.c3d4.tmp"
    abandoned.write_bytes(b"PK")
    os.utime(abandoned, (NOW - MAX_AGE_S - 1,) * 2)
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    replica(tmp_path, "extproc-r3", registry).load([view(restored)], {A, B})
    assert writing.exists() and not abandoned.exists()
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 0
    assert sample(registry, "extproc_view_snapshot_loaded_files") == 2
    assert set(live(restored, A)) == set(live(r1, A)) | set(live(r2, A))


def test_a_damaged_file_is_refused_and_the_others_load(
    tmp_path: Path, two_replicas: tuple[PrefixIndex, PrefixIndex]
) -> None:
    _, r2 = two_replicas
    damaged = tmp_path / "extproc-r1.npz"
    damaged.write_bytes(damaged.read_bytes()[:100])
    os.utime(damaged, (NOW, NOW))
    registry = CollectorRegistry()
    restored = PrefixIndex(1000)
    replica(tmp_path, "extproc-r3", registry).load([view(restored)], {A, B})
    assert live(restored, A) == live(r2, A)
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 1
    assert sample(registry, "extproc_view_snapshot_loads_total", result="loaded") == 1


def test_an_empty_directory_is_missing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    assert replica(tmp_path, "r", registry).load([view(PrefixIndex(10))], {A}) == 0
    assert sample(registry, "extproc_view_snapshot_loads_total", result="missing") == 1


@pytest.mark.parametrize(
    ("name", "file"),
    [
        pytest.param("extproc-7d9f-x2", "extproc-7d9f-x2", id="pod-name"),
        pytest.param("../etc/passwd", "_._etc_passwd", id="no-path"),
        pytest.param(".hidden", "_hidden", id="not-a-dotfile"),
        pytest.param("", "_", id="empty"),
    ],
)
def test_replica_file_names_stay_in_the_directory(name: str, file: str) -> None:
    assert replica_file_name(name) == file


def _serve(*flags: str) -> list[str]:
    ports = ["--grpc-port", "0", "--health-port", "0", "--metrics-port", "0"]
    return ["serve", "--pods", str(EXAMPLE_PODS_FILE), *ports, *flags]


def test_serve_writes_its_file_named_by_pod_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "extproc-abc")
    args = build_parser().parse_args(_serve("--view-snapshot-dir", str(tmp_path)))
    running = start(args, CollectorRegistry())
    running.stop(0.0)
    (written,) = tmp_path.iterdir()
    assert written.name == "extproc-abc.npz"
    with np.load(written, allow_pickle=False) as npz:
        assert "header" in npz.files


def test_serve_replicas_each_write_their_file_and_a_new_one_starts_from_the_union(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling update: replicas r1 and r2 each served a prompt on another pod and
    drained; r3, a new pod, starts with both."""
    args = build_parser().parse_args(_serve("--view-snapshot-dir", str(tmp_path)))
    recorded = {}
    for i, name in enumerate(("extproc-r1", "extproc-r2")):
        monkeypatch.setenv("POD_NAME", name)
        running = start(args, CollectorRegistry())
        try:
            (first,) = snapshot_views(running.router.scheduler)
            pod = running.router.pods[i].id
            keys = hash_prompt("sim-model", f"tenant {i} " * 80, first.block_size, first.max_blocks)
            first.index.record(keys, pod)
            recorded[pod] = live(first.index, pod)
        finally:
            running.stop(0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extproc-r1.npz", "extproc-r2.npz"]
    monkeypatch.setenv("POD_NAME", "extproc-r3")
    registry = CollectorRegistry()
    running = start(args, registry)
    try:
        (view_r3,) = snapshot_views(running.router.scheduler)
        assert {pod: live(view_r3.index, pod) for pod in recorded} == recorded
        assert sample(registry, "extproc_view_snapshot_loaded_files") == 2
    finally:
        running.stop(0.0)


def test_serve_refuses_a_snapshot_dir_that_is_not_a_directory(tmp_path: Path) -> None:
    args = build_parser().parse_args(_serve("--view-snapshot-dir", str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="--view-snapshot-dir: .*missing is not a directory"):
        start(args, CollectorRegistry())


def test_the_file_and_directory_flags_exclude_each_other(tmp_path: Path) -> None:
    flags = _serve("--view-snapshot", str(tmp_path / "v.npz"), "--view-snapshot-dir", str(tmp_path))
    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)


def test_a_directory_that_went_away_is_refused_and_the_views_start_empty(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    gone = replica(tmp_path / "gone", "r", registry)
    assert gone.load([view(PrefixIndex(10))], {A}) == 0
    assert sample(registry, "extproc_view_snapshot_loads_total", result="refused") == 1
