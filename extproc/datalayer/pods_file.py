"""Pods from a YAML file, and a watcher that republishes them when the file changes.

The file::

    pods:
      - name: sim-0                # required; unique within its namespace
        namespace: default         # optional, default "default"
        address: 127.0.0.1:8000    # required ip:port ([v6]:port); unique
        models: [sim-model]        # required, non-empty list of strings
        adapters: [sql-lora]       # optional: LoRA adapters it serves or can load
        labels: {app: vllm}        # optional, string keys and values
        role: both                 # optional: prefill | decode | both (default)
        ready: true                # optional, default true
      - name: vllm-dp              # data-parallel ranks: one endpoint per port
        address: 10.0.0.5          # the IP alone (or ip:port with port == ports[0])
        ports: [8000, 8001]        # rank N serves on ports[N]
        models: [llama]

``adapters`` are added to ``models`` and set in ``Pod.adapters``; an adapter may also be
listed in ``models``, but a pod keeps at least one base model, and a name is never an
adapter on one pod and a base model on another.

``ports`` makes each port an endpoint of its own (its own address, metrics page, load
and prefix views): with one port the pod keeps its name; with several, rank N is named
``<name>-rank-N`` as the Gateway API Inference Extension names an InferencePool's
target ports, and labelled ``RANK_LABEL: N`` (its KV events come from the events port
plus N, as vLLM's data-parallel ranks publish them).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from extproc.errors import ConfigError
from extproc.pods import DEFAULT_NAMESPACE, RANK_LABEL, Pod, PodId, PodRole

logger = logging.getLogger(__name__)


_POD_KEYS = frozenset(
    {"name", "namespace", "address", "ports", "models", "adapters", "labels", "role", "ready"}
)
_ROLES = ", ".join(r.value for r in PodRole)


class _Entry(NamedTuple):
    """One entry of the file: its name and its endpoints (one a port)."""

    name: str
    pods: tuple[Pod, ...]


def load_pods(path: str | os.PathLike[str]) -> tuple[Pod, ...]:
    """Read and validate a pods file.

    Args:
        path: the YAML file.

    Returns:
        The pods in file order (a pod with several ports: its ranks in port order).

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
    parsed = [_parse_entry(entry, f"{source}: pods[{idx}]") for idx, entry in enumerate(entries)]
    _check_unique(parsed, source)
    _check_adapters(parsed, source)
    return tuple(pod for entry in parsed for pod in entry.pods)


def parse_host(host: str) -> str:
    """Validate an IP address (IPv6 as ``[ip]``) and return it in canonical form.

    Raises:
        ValueError: with the reason; callers add the file and pod.
    """
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"host {host!r} is not an IP address") from None
    if (ip.version == 6) != bracketed:
        raise ValueError(f"host {host!r}: write IPv6 hosts as [ip] or [ip]:port, IPv4 without []")
    return f"[{ip}]" if ip.version == 6 else str(ip)


def parse_address(address: str) -> str:
    """Validate ``ip:port`` (IPv6 as ``[ip]:port``) and return it in canonical form.

    Raises:
        ValueError: with the reason; callers add the file and pod.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {address!r} is not 'ip:port'")
    try:
        host = parse_host(host)
    except ValueError as exc:
        raise ValueError(f"address {address!r}: {exc}") from None
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"address {address!r}: port must be an integer from 1 to 65535")
    return f"{host}:{int(port_text)}"


def rank_pods(pod: Pod, host: str, ports: Sequence[int]) -> tuple[Pod, ...]:
    """``pod`` as one endpoint a port, at ``host:port``: with one port it keeps its name
    (as before ranks existed); with several, rank N is ``<name>-rank-N`` (the Inference
    Extension's name for a pool's Nth target port) labelled ``RANK_LABEL: N``."""
    if len(ports) == 1:
        return (replace(pod, address=f"{host}:{ports[0]}"),)
    return tuple(
        replace(
            pod,
            id=PodId(pod.id.namespace, f"{pod.id.name}-rank-{rank}"),
            address=f"{host}:{port}",
            labels=tuple(sorted({**dict(pod.labels), RANK_LABEL: str(rank)}.items())),
        )
        for rank, port in enumerate(ports)
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: pods file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read pods file: {exc}") from exc


def _parse_entry(entry: object, where: str) -> _Entry:
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
    host, ports = _parse_endpoint(entry, where)
    models = _parse_models(entry.get("models"), where)
    adapters = _parse_adapters(entry.get("adapters", []), models, where)
    pod = Pod(
        id=PodId(namespace, name),
        address="",  # rank_pods sets it
        models=models | adapters,
        adapters=adapters,
        labels=_parse_labels(entry.get("labels", {}), where),
        role=_parse_role(entry.get("role", PodRole.BOTH.value), where),
        ready=_parse_ready(entry.get("ready", True), where),
    )
    return _Entry(name, rank_pods(pod, host, ports))


def _parse_endpoint(entry: Mapping[Any, Any], where: str) -> tuple[str, tuple[int, ...]]:
    """The host and the ports of ``address`` (ip:port, or the IP alone) and ``ports``."""
    if "address" not in entry:
        raise ConfigError(f"{where}: 'address' (ip:port) is required")
    if not isinstance(address := entry["address"], str):
        raise ConfigError(f"{where}: address must be a string 'ip:port', got {_type_name(address)}")
    ports = _parse_ports(entry["ports"], where) if "ports" in entry else None
    if (host := _host_or_none(address)) is not None:
        if ports is None:
            raise ConfigError(
                f"{where}: address {address!r} has no port: write ip:port, "
                "or list the pod's ports in 'ports'"
            )
        return host, ports
    try:
        host, _, port_text = parse_address(address).rpartition(":")
    except ValueError as exc:
        if ports is None:
            raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(
            f"{where}: address {address!r} is neither an IP address (IPv6 as [ip]) nor ip:port"
        ) from None
    port = int(port_text)
    if ports is not None and port != ports[0]:
        raise ConfigError(
            f"{where}: address {address!r} has port {port} but ports[0] (rank 0) is "
            f"{ports[0]}: give the address without a port, or make them agree"
        )
    return host, ports or (port,)


def _host_or_none(address: str) -> str | None:
    try:
        return parse_host(address)
    except ValueError:
        return None


def _parse_ports(ports: object, where: str) -> tuple[int, ...]:
    if not isinstance(ports, list) or not ports:
        raise ConfigError(f"{where}: 'ports' must be a non-empty list of port numbers")
    for port in ports:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ConfigError(f"{where}: ports: {port!r} is not a port number from 1 to 65535")
    if repeated := sorted({p for p in ports if ports.count(p) > 1}):
        raise ConfigError(f"{where}: ports: {repeated} listed more than once")
    return tuple(ports)


def _parse_models(models: object, where: str) -> frozenset[str]:
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{where}: 'models' is required: a non-empty list of model names")
    if bad := [m for m in models if not isinstance(m, str) or not m.strip()]:
        raise ConfigError(f"{where}: 'models' entries must be non-empty strings, got {bad!r}")
    return frozenset(models)


def _parse_adapters(adapters: object, models: frozenset[str], where: str) -> frozenset[str]:
    if not isinstance(adapters, list):
        raise ConfigError(f"{where}: 'adapters' must be a list of LoRA adapter names")
    if bad := [a for a in adapters if not isinstance(a, str) or not a.strip()]:
        raise ConfigError(f"{where}: 'adapters' entries must be non-empty strings, got {bad!r}")
    if not models - set(adapters):
        raise ConfigError(
            f"{where}: every model is a LoRA adapter: 'models' must also name the base "
            "model the adapters run on"
        )
    return frozenset(adapters)


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


def _check_unique(entries: Sequence[_Entry], source: str) -> None:
    first_by_id: dict[PodId, int] = {}
    first_by_address: dict[str, int] = {}
    for idx, entry in enumerate(entries):
        for pod in entry.pods:
            if (prev := first_by_id.setdefault(pod.id, idx)) != idx:
                raise ConfigError(
                    f"{source}: pods[{idx}] {entry.name!r}: duplicate name {str(pod.id)!r}, "
                    f"already used by pods[{prev}]"
                )
            if (prev := first_by_address.setdefault(pod.address, idx)) != idx:
                raise ConfigError(
                    f"{source}: pods[{idx}] {entry.name!r}: duplicate address {pod.address!r}, "
                    f"already used by pods[{prev}] {entries[prev].name!r}"
                )


def _check_adapters(entries: Sequence[_Entry], source: str) -> None:
    """A name is a base model everywhere or an adapter everywhere: a request for it must
    not reach a pod that would read it as the other."""
    base_at: dict[str, int] = {}
    adapter_at: dict[str, int] = {}
    for idx, entry in enumerate(entries):
        pod = entry.pods[0]
        for model in sorted(pod.models - pod.adapters):
            base_at.setdefault(model, idx)
        for adapter in sorted(pod.adapters):
            adapter_at.setdefault(adapter, idx)
    for name in sorted(base_at.keys() & adapter_at.keys()):
        at, base = adapter_at[name], base_at[name]
        raise ConfigError(
            f"{source}: pods[{at}] {entries[at].name!r} lists {name!r} as a LoRA "
            f"adapter, but it is a base model of pods[{base}] {entries[base].name!r}"
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
