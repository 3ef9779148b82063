"""Pods file: every validation rule, and the watcher's publish / keep-last-good behaviour."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.datalayer import pods_file
from extproc.datalayer.pods_file import (
    PodsFileWatcher,
    load_pods,
    parse_address,
    parse_pods,
)
from extproc.errors import ConfigError
from extproc.pods import Pod, PodId, PodRole
from testkit.example_pods import EXAMPLE_PODS_FILE


def make_entry(name: str = "p0", **fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "address": "10.0.0.1:8000", "models": ["m"]}
    entry.update(fields)
    return {k: v for k, v in entry.items() if v is not _DROP}


_DROP = object()


def dump(*entries: dict[str, Any]) -> str:
    return str(yaml.safe_dump({"pods": list(entries)}))


def write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def test_default_pods_file() -> None:
    pods = load_pods(EXAMPLE_PODS_FILE)
    assert [p.id for p in pods] == [PodId("default", f"sim-{i}") for i in range(4)]
    assert [p.address for p in pods] == [f"127.0.0.1:{8100 + i}" for i in range(4)]
    assert all(p.models == frozenset({"sim-model"}) and p.ready for p in pods)


def test_full_entry() -> None:
    text = """
pods:
  - name: a
    namespace: llm
    address: 10.1.2.3:8000
    models: [m1, m2]
    labels: {zone: b, app: vllm}
    role: prefill
    ready: false
  - name: b
    address: "[::1]:9000"
    models: [m1]
"""
    a, b = parse_pods(text, "f.yaml")
    assert a == Pod(
        id=PodId("llm", "a"),
        address="10.1.2.3:8000",
        models=frozenset({"m1", "m2"}),
        labels=(("app", "vllm"), ("zone", "b")),
        role=PodRole.PREFILL,
        ready=False,
    )
    assert b.id == PodId("default", "b")
    assert (b.address, b.role, b.ready, b.labels) == ("[::1]:9000", PodRole.BOTH, True, ())


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        pytest.param("127.0.0.1:8000", "127.0.0.1:8000", id="ipv4"),
        pytest.param("[::1]:1", "[::1]:1", id="ipv6"),
        pytest.param("[2001:DB8::0001]:65535", "[2001:db8::1]:65535", id="ipv6-canonical"),
        pytest.param("10.0.0.1:080", "10.0.0.1:80", id="port-leading-zero"),
    ],
)
def test_parse_address(address: str, expected: str) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        pytest.param("127.0.0.1", "has no port: write ip:port, or list", id="no-port"),
        pytest.param(":8000", "not 'ip:port'", id="no-host"),
        pytest.param("localhost:8000", "not an IP address", id="hostname"),
        pytest.param("256.0.0.1:8000", "not an IP address", id="bad-octet"),
        pytest.param("010.0.0.1:8000", "not an IP address", id="octet-leading-zero"),
        pytest.param("::1:8000", "[ip]:port", id="ipv6-unbracketed"),
        pytest.param("[10.0.0.1]:8000", "[ip]:port", id="ipv4-bracketed"),
        pytest.param("10.0.0.1:0", "port must be", id="port-zero"),
        pytest.param("10.0.0.1:65536", "port must be", id="port-too-big"),
        pytest.param("10.0.0.1:-1", "port must be", id="port-negative"),
        pytest.param("10.0.0.1:80a", "port must be", id="port-not-digits"),
        pytest.param("10.0.0.1:", "port must be", id="port-empty"),
        pytest.param("10.0.0.1:٣", "port must be", id="port-non-ascii-digit"),
        pytest.param(8000, "must be a string", id="not-string"),
    ],
)
def test_bad_address(address: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=r"f\.yaml: pods\[0\] 'p0': .*" + re.escape(problem)):
        parse_pods(dump(make_entry(address=address)), "f.yaml")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("pods: [", "not valid YAML", id="yaml-syntax"),
        pytest.param("", "expected a mapping", id="empty-file"),
        pytest.param("- name: a", "expected a mapping", id="top-level-list"),
        pytest.param("pods:", "'pods' must be a non-empty list", id="pods-null"),
        pytest.param("pods: []", "'pods' must be a non-empty list", id="pods-empty"),
        pytest.param("pods: {a: 1}", "'pods' must be a non-empty list", id="pods-mapping"),
        pytest.param("pods: [x]\nextra: 1", "unknown top-level keys ['extra']", id="top-extra"),
        pytest.param("pods: [x]", "pods[0]: expected a mapping, got str", id="entry-not-mapping"),
    ],
)
def test_bad_file_shape(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml: .*" + re.escape(problem)):
        parse_pods(text, "f.yaml")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({"name": _DROP}, "'name' is required", id="name-missing"),
        pytest.param({"name": ""}, "'name' is required", id="name-empty"),
        pytest.param({"name": 7}, "'name' is required", id="name-int"),
        pytest.param({"namespace": ""}, "'namespace' must be a non-empty", id="namespace-empty"),
        pytest.param({"namespace": 1}, "'namespace' must be a non-empty", id="namespace-int"),
        pytest.param({"address": _DROP}, "'address' (ip:port) is required", id="address-missing"),
        pytest.param({"models": _DROP}, "'models' is required", id="models-missing"),
        pytest.param({"models": []}, "'models' is required", id="models-empty"),
        pytest.param({"models": "m"}, "'models' is required", id="models-string"),
        pytest.param({"models": ["m", 3]}, "entries must be non-empty strings", id="models-int"),
        pytest.param({"models": [""]}, "entries must be non-empty strings", id="models-blank"),
        pytest.param({"labels": ["a"]}, "'labels' must be a mapping", id="labels-list"),
        pytest.param({"labels": {"v": 1}}, "keys and values must be strings", id="label-int"),
        pytest.param({"labels": {1: "v"}}, "keys and values must be strings", id="label-key-int"),
        pytest.param({"role": "worker"}, "'role' must be one of prefill, decode, both", id="role"),
        pytest.param({"ready": "yes please"}, "'ready' must be true or false", id="ready-string"),
        pytest.param({"adress": "x"}, "unknown keys ['adress']", id="typo-key"),
    ],
)
def test_bad_pod(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml: pods\[0\].*" + re.escape(problem)):
        parse_pods(dump(make_entry(**fields)), "f.yaml")


def test_error_names_the_pod_index_and_name() -> None:
    text = dump(make_entry("ok"), make_entry("bad", address="10.0.0.2:8000", role="x"))
    with pytest.raises(ConfigError, match=r"^f\.yaml: pods\[1\] 'bad': 'role'"):
        parse_pods(text, "f.yaml")


def test_duplicate_name() -> None:
    text = dump(make_entry("a"), make_entry("a", address="10.0.0.2:8000"))
    with pytest.raises(ConfigError, match=r"pods\[1\] 'a': duplicate name 'default/a'.*pods\[0\]"):
        parse_pods(text, "f.yaml")


def test_same_name_in_other_namespace_is_fine() -> None:
    text = dump(make_entry("a"), make_entry("a", namespace="x", address="10.0.0.2:8000"))
    assert [str(p.id) for p in parse_pods(text, "f.yaml")] == ["default/a", "x/a"]


def test_duplicate_address_after_canonical_form() -> None:
    text = dump(make_entry("a", address="[::1]:80"), make_entry("b", address="[0::1]:080"))
    with pytest.raises(ConfigError, match=r"pods\[1\] 'b': duplicate address '\[::1\]:80'.*'a'"):
        parse_pods(text, "f.yaml")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none.yaml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: pods file not found"):
        load_pods(path)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}: cannot read pods file"):
        load_pods(tmp_path)  # a directory


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"pods:\n  - name: \xff\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pods(path)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    write(path, dump(make_entry(models=[])))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: pods\\[0\\] 'p0'"):
        load_pods(path)


# --- watcher ---------------------------------------------------------------------------


class Published:
    def __init__(self) -> None:
        self.calls: list[tuple[Pod, ...]] = []
        self.event = threading.Event()

    def __call__(self, pods: tuple[Pod, ...]) -> None:
        self.calls.append(pods)
        self.event.set()


@pytest.fixture
def pods_path(tmp_path: Path) -> Path:
    path = tmp_path / "pods.yaml"
    write(path, dump(make_entry("a")))
    return path


def names(pods: tuple[Pod, ...]) -> list[str]:
    return [p.id.name for p in pods]


def test_watcher_initial_load_does_not_publish(pods_path: Path) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    assert names(watcher.pods) == ["a"]
    assert not watcher.poll()
    assert published.calls == []


def test_watcher_initial_load_fails_on_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pods file not found"):
        PodsFileWatcher(tmp_path / "none.yaml", Published())


def test_watcher_rejects_non_positive_interval(pods_path: Path) -> None:
    with pytest.raises(ConfigError, match="interval must be positive"):
        PodsFileWatcher(pods_path, Published(), interval_s=0)


def test_watcher_publishes_change(pods_path: Path) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    write(pods_path, dump(make_entry("a"), make_entry("b", address="10.0.0.2:8000")))
    assert watcher.poll()
    assert [names(c) for c in published.calls] == [["a", "b"]]
    assert names(watcher.pods) == ["a", "b"]


def test_watcher_same_size_same_mtime_rewrite_is_seen(pods_path: Path) -> None:
    """A rewrite that keeps size and mtime is caught by the content hash."""
    published = Published()
    watcher = PodsFileWatcher(pods_path, published, interval_s=3600)
    st = pods_path.stat()
    write(pods_path, dump(make_entry("b")))  # same length as "a"
    os.utime(pods_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pods_path.stat().st_size == st.st_size
    assert watcher.poll()
    assert names(watcher.pods) == ["b"]


def test_watcher_old_unchanged_file_is_not_read(
    pods_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    real_read = pods_file._read

    def counting_read(path: Path) -> bytes:
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(pods_file, "_read", counting_read)
    watcher = PodsFileWatcher(pods_path, Published(), interval_s=0.01)
    os.utime(pods_path, (1_000_000, 1_000_000))  # modified long ago
    assert not watcher.poll()  # the stat changed: read once, same content
    assert not watcher.poll()  # the stat did not change and is old: not read
    assert len(reads) == 2  # the constructor's read and the first poll's


def test_watcher_equal_pods_are_not_republished(pods_path: Path) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    write(pods_path, "# a comment\n" + dump(make_entry("a")))
    assert not watcher.poll()
    assert published.calls == []


def test_watcher_keeps_last_good_and_warns_once(
    pods_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    caplog.set_level(logging.WARNING, logger="extproc.datalayer.pods_file")
    write(pods_path, dump(make_entry("a", address="nowhere:80")))
    assert not watcher.poll()
    assert not watcher.poll()
    assert names(watcher.pods) == ["a"] and published.calls == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(pods_path) in record.getMessage()
    assert "not an IP address" in record.getMessage()
    assert "keeping the last good 1 pods" in record.getMessage()

    write(pods_path, dump(make_entry("c")))  # fixed: published again
    assert watcher.poll()
    assert names(watcher.pods) == ["c"]


def test_watcher_survives_deletion_and_restore(
    pods_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    caplog.set_level(logging.WARNING, logger="extproc.datalayer.pods_file")
    text = pods_path.read_text()
    pods_path.unlink()
    assert not watcher.poll()
    assert not watcher.poll()
    assert [r.getMessage() for r in caplog.records] == [
        f"{pods_path}: pods file not found; keeping the last good 1 pods"
    ]
    write(pods_path, text)
    assert not watcher.poll()  # same pods as before: nothing to publish
    write(pods_path, dump(make_entry("b")))
    assert watcher.poll()
    assert names(published.calls[-1]) == ["b"]


def test_watcher_replaced_by_rename(pods_path: Path) -> None:
    """ConfigMap-style atomic replace: a new inode under the same name."""
    published = Published()
    watcher = PodsFileWatcher(pods_path, published)
    tmp = pods_path.with_suffix(".tmp")
    write(tmp, dump(make_entry("z")))
    os.replace(tmp, pods_path)
    assert watcher.poll()
    assert names(watcher.pods) == ["z"]


def test_watcher_thread_publishes_and_stops(pods_path: Path) -> None:
    published = Published()
    watcher = PodsFileWatcher(pods_path, published, interval_s=0.02)
    watcher.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            watcher.start()
        write(pods_path, dump(make_entry("b"), make_entry("c", address="10.0.0.3:1")))
        assert published.event.wait(5)
        assert names(published.calls[0]) == ["b", "c"]
    finally:
        watcher.stop()
    assert watcher._thread is not None and not watcher._thread.is_alive()


def test_watcher_thread_survives_callback_error(
    pods_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = threading.Event()
    calls: list[tuple[Pod, ...]] = []

    def on_change(pods: tuple[Pod, ...]) -> None:
        calls.append(pods)
        if len(calls) == 1:
            raise ValueError("boom")
        done.set()

    watcher = PodsFileWatcher(pods_path, on_change, interval_s=0.02)
    caplog.set_level(logging.ERROR, logger="extproc.datalayer.pods_file")
    watcher.start()
    try:
        write(pods_path, dump(make_entry("b")))
        for _ in range(250):  # bounded: 5 s
            if calls:
                break
            threading.Event().wait(0.02)
        write(pods_path, dump(make_entry("c")))
        assert done.wait(5)
    finally:
        watcher.stop()
    assert [names(c) for c in calls] == [["b"], ["c"]]
    assert "pods file watcher error" in caplog.text
