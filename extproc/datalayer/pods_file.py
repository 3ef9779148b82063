"""Pods from a YAML file, and a watcher that republishes them when the file changes.

The file::

    pods:
      - name: sim-0                # required; unique within its namespace
        namespace: default         # optional, default "default"
        address: 127.0.0.1:8000    # required ip:port ([v6]:port); unique
        models: [sim-model]        # required, non-empty list of strings
        labels: {app: vllm}        # optional, string keys and values
        role: both                 # optional: prefill | decode | both (default)
        ready: true                # optional, default true

Every problem raises ``ConfigError`` with a message naming the file, the pod
(``pods[2] 'sim-2'``) and the problem; unknown keys are errors, so typos do not pass
silently. ``PodsFileWatcher`` polls the file and, when it changes, publishes the new
tuple; an invalid edit keeps the last good tuple and logs a WARNING instead.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc.errors import ConfigError
from extproc.pods import DEFAULT_NAMESPACE, Pod, PodId, PodRole

logger = logging.getLogger(__name__)

_POD_KEYS = frozenset({"name", "namespace", "address", "models", "labels", "role", "ready"})
_ROLES = ", ".join(r.value for r in PodRole)


def load_pods(path: str | os.PathLike[str]) -> tuple[Pod, ...]:
    """Read and validate a pods file.

    Args:
        path: the YAML file.

    Returns:
        The pods in file order.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML or breaks a rule.
    """
    return parse_pods(_read(Path(path)), str(path))


def parse_pods(text: str | bytes, source: str) -> tuple[Pod, ...]:
    """Parse the YAML text of a pods file; ``source`` names it in error messages.

    Bytes are decoded as YAML does (UTF-8, or UTF-16/32 with a byte-order mark).
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping with a 'pods' list at the top")
    if extra := sorted(map(str, set(data) - {"pods"})):
        raise ConfigError(f"{source}: unknown top-level keys {extra}; only 'pods' is allowed")
    entries = data.get("pods")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: 'pods' must be a non-empty list")
    pods = tuple(_parse_pod(entry, f"{source}: pods[{idx}]") for idx, entry in enumerate(entries))
    _check_unique(pods, source)
    return pods


def parse_address(address: str) -> str:
    """Validate ``ip:port`` (IPv6 as ``[ip]:port``) and return it in canonical form.

    Raises:
        ValueError: with the reason; callers add the file and pod.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {address!r} is not 'ip:port'")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"address {address!r}: host {host!r} is not an IP address") from None
    if (ip.version == 6) != bracketed:
        raise ValueError(f"address {address!r}: write IPv6 hosts as [ip]:port, IPv4 without []")
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"address {address!r}: port must be an integer from 1 to 65535")
    return f"[{ip}]:{int(port_text)}" if ip.version == 6 else f"{ip}:{int(port_text)}"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: pods file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read pods file: {exc}") from exc


def _parse_pod(entry: object, where: str) -> Pod:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {_type_name(entry)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: 'name' is required and must be a non-empty string")
    where = f"{where} {name!r}"
    if extra := sorted(map(str, set(entry) - _POD_KEYS)):
        raise ConfigError(f"{where}: unknown keys {extra}; allowed: {sorted(_POD_KEYS)}")
    namespace = entry.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace.strip():
        raise ConfigError(f"{where}: 'namespace' must be a non-empty string")
    if "address" not in entry:
        raise ConfigError(f"{where}: 'address' (ip:port) is required")
    if not isinstance(address := entry["address"], str):
        raise ConfigError(f"{where}: address must be a string 'ip:port', got {_type_name(address)}")
    try:
        address = parse_address(address)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Pod(
        id=PodId(namespace, name),
        address=address,
        models=_parse_models(entry.get("models"), where),
        labels=_parse_labels(entry.get("labels", {}), where),
        role=_parse_role(entry.get("role", PodRole.BOTH.value), where),
        ready=_parse_ready(entry.get("ready", True), where),
    )


def _parse_models(models: object, where: str) -> frozenset[str]:
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{where}: 'models' is required: a non-empty list of model names")
    if bad := [m for m in models if not isinstance(m, str) or not m.strip()]:
        raise ConfigError(f"{where}: 'models' entries must be non-empty strings, got {bad!r}")
    return frozenset(models)


def _parse_labels(labels: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(labels, Mapping):
        raise ConfigError(f"{where}: 'labels' must be a mapping, got {_type_name(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(
                f"{where}: label {key!r}: {value!r}: keys and values must be strings "
                "(quote numbers and booleans)"
            )
    return tuple(sorted(labels.items()))


def _parse_role(role: object, where: str) -> PodRole:
    try:
        return PodRole(role)
    except ValueError:
        raise ConfigError(f"{where}: 'role' must be one of {_ROLES}, got {role!r}") from None


def _parse_ready(ready: object, where: str) -> bool:
    if not isinstance(ready, bool):
        raise ConfigError(f"{where}: 'ready' must be true or false, got {ready!r}")
    return ready


def _check_unique(pods: tuple[Pod, ...], source: str) -> None:
    first_by_id: dict[PodId, int] = {}
    first_by_address: dict[str, int] = {}
    for idx, pod in enumerate(pods):
        if (prev := first_by_id.setdefault(pod.id, idx)) != idx:
            raise ConfigError(
                f"{source}: pods[{idx}] {pod.id.name!r}: duplicate name {str(pod.id)!r}, "
                f"already used by pods[{prev}]"
            )
        if (prev := first_by_address.setdefault(pod.address, idx)) != idx:
            raise ConfigError(
                f"{source}: pods[{idx}] {pod.id.name!r}: duplicate address {pod.address!r}, "
                f"already used by pods[{prev}] {pods[prev].id.name!r}"
            )


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


class PodsFileWatcher:
    """Polls a pods file and calls ``on_change(pods)`` when its valid content changes.

    The constructor loads the file once (raising ``ConfigError``, so start-up fails on a
    bad file) and keeps the result in ``pods``; ``on_change`` is called only for later
    changes, with a tuple that differs from the previous one. An invalid or missing file
    keeps the last good tuple and logs one WARNING per distinct problem.

    A poll stats the file (mtime, size, inode) and reads it only when that changed or
    the file was modified within the last two intervals, since a same-size rewrite inside
    the file system's mtime resolution leaves the stat unchanged (git's "racy clean"
    case); the content hash then decides whether anything really changed.

    Use ``start()``/``stop()`` for a background daemon thread, or call ``poll()``
    directly (tests, or a caller with its own loop).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[tuple[Pod, ...]], Any],
        *,
        interval_s: float = 1.0,
    ) -> None:
        if interval_s <= 0:
            raise ConfigError(f"pods file poll interval must be positive, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem: str | None = None
        self._last_stat: tuple[int, int, int] | None = self._stat()
        data = _read(self.path)
        self.pods: tuple[Pod, ...] = parse_pods(data, str(self.path))
        self._last_digest: bytes | None = hashlib.blake2b(data).digest()

    def poll(self) -> bool:
        """Check the file once; returns True when new pods were published."""
        stat = self._stat()
        if stat is None:
            self._last_digest = None  # a restored file is read again, whatever its content
            self._warn(f"{self.path}: pods file not found")
            return False
        recent = time.time_ns() - stat[1] < 2 * self.interval_s * 1e9
        if stat == self._last_stat and not recent:
            return False
        self._last_stat = stat
        try:
            data = _read(self.path)
        except ConfigError as exc:
            self._warn(str(exc))
            return False
        digest = hashlib.blake2b(data).digest()
        if digest == self._last_digest:
            return False
        self._last_digest = digest
        try:
            pods = parse_pods(data, str(self.path))
        except ConfigError as exc:
            self._warn(str(exc))
            return False
        self._last_problem = None
        if pods == self.pods:
            return False
        self.pods = pods
        logger.info("%s: %d pods loaded", self.path, len(pods))
        self._on_change(pods)
        return True

    def start(self) -> None:
        """Poll every ``interval_s`` seconds in a daemon thread until ``stop()``."""
        if self._thread is not None:
            raise RuntimeError("PodsFileWatcher already started")
        self._thread = threading.Thread(
            target=self._run, name=f"pods-file-watcher:{self.path.name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait for it (at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # a bug in on_change must not end the watch
                logger.exception("%s: pods file watcher error", self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _warn(self, problem: str) -> None:
        if problem != self._last_problem:
            self._last_problem = problem
            logger.warning("%s; keeping the last good %d pods", problem, len(self.pods))
