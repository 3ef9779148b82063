"""Start simulated pods from a test: in a background thread, or as a subprocess.

    with run_sim_pods(GroupSettings(num_pods=2)) as pods:       # in-process, fast
        url = pods.pods[0].url
        pods.set_faults(0, error_rate=1.0)
        pods.stats("sim-1")["engine"]["prefix_cache_hits"]

    with spawn_sim_pods(3, args=["--time-scale", "0.01"]) as pods:   # a real process
        ...                                                   # pods.pid; SIGTERM on exit

Both yield a ``SimPods``: the pods' names and URLs plus sync helpers for the admin port
(faults, stats, cache reset), which keep working while a pod refuses connections.
Everything binds 127.0.0.1 on free ports and is stopped on leaving the ``with``.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

import extproc
from extproc.datalayer.kv_events import EVENTS_PORT_LABEL
from extproc.pods import Pod, PodId
from extproc.sim.launch import START_TIMEOUT_S, STOP_TIMEOUT_S
from extproc.sim.pods import GroupSettings, PodGroup

ADMIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class SimPodInfo:
    name: str
    url: str  # http://127.0.0.1:PORT
    port: int
    kv_events_endpoint: str | None = None  # where its KV events go (``--kv-events-endpoint``)


@dataclass(frozen=True, slots=True)
class SimPods:
    """Running pods and their admin port; ``pod`` arguments take a name or an index."""

    model: str
    admin_url: str
    pods: tuple[SimPodInfo, ...]
    pid: int | None = None  # the subprocess, for spawn_sim_pods

    @classmethod
    def from_description(cls, desc: dict[str, Any], pid: int | None = None) -> SimPods:
        pods = tuple(
            SimPodInfo(p["name"], p["url"], p["port"], p.get("kv_events_endpoint"))
            for p in desc["pods"]
        )
        return cls(desc["model"], desc["admin_url"], pods, pid)

    def as_pods(self, namespace: str = "default") -> list[Pod]:
        """The pods as extproc sees them (pods file, launch.run_stack): all ready; a pod
        publishing KV events on a port of its own is labelled with it
        (``EVENTS_PORT_LABEL``: extproc's connect topology reads it)."""
        return [
            Pod(
                PodId(namespace, p.name),
                f"127.0.0.1:{p.port}",
                frozenset({self.model}),
                labels=_events_label(p.kv_events_endpoint),
            )
            for p in self.pods
        ]

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.pods]

    def name_of(self, pod: str | int) -> str:
        return self.pods[pod].name if isinstance(pod, int) else pod

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        """One admin request; returns the decoded JSON answer.

        Raises:
            urllib.error.HTTPError: the admin port answered an error status.
        """
        data = orjson.dumps(body) if body is not None else None
        req = urllib.request.Request(self.admin_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=ADMIN_TIMEOUT_S) as resp:
            return orjson.loads(resp.read())

    def faults(self, pod: str | int) -> dict[str, Any]:
        return self.admin("GET", f"/pods/{self.name_of(pod)}/faults")  # type: ignore[no-any-return]

    def set_faults(self, pod: str | int, **changes: Any) -> dict[str, Any]:
        """Merge ``changes`` into the pod's faults (see faults.py) and return them all."""
        return self.admin("POST", f"/pods/{self.name_of(pod)}/faults", changes)  # type: ignore[no-any-return]

    def clear_faults(self, pod: str | int) -> dict[str, Any]:
        return self.admin("DELETE", f"/pods/{self.name_of(pod)}/faults")  # type: ignore[no-any-return]

    def stats(self, pod: str | int) -> dict[str, Any]:
        return self.admin("GET", f"/pods/{self.name_of(pod)}/stats")  # type: ignore[no-any-return]

    def reset_cache(self, pod: str | int) -> None:
        """Empty the pod's prefix cache, as if it came back empty (HTTPError 409 if busy)."""
        self.admin("POST", f"/pods/{self.name_of(pod)}/reset_cache")


def _events_label(endpoint: str | None) -> tuple[tuple[str, str], ...]:
    """The pod's publisher port as a label, when it bound 127.0.0.1 (else none)."""
    host, _, port = (endpoint or "").removeprefix("tcp://").rpartition(":")
    return ((EVENTS_PORT_LABEL, port),) if host == "127.0.0.1" and port.isdigit() else ()


@contextmanager
def run_sim_pods(settings: GroupSettings | None = None) -> Iterator[SimPods]:
    """Serve pods from an event loop in a background thread of this process."""
    settings = settings or GroupSettings()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sim-pods", daemon=True)
    thread.start()
    group: PodGroup | None = None
    try:

        async def start() -> PodGroup:
            g = PodGroup(settings)
            await g.start()
            return g

        group = asyncio.run_coroutine_threadsafe(start(), loop).result(START_TIMEOUT_S)
        yield SimPods.from_description(group.describe())
    finally:
        if group is not None:
            asyncio.run_coroutine_threadsafe(group.stop(), loop).result(STOP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_S)
        loop.close()


def _child_env() -> dict[str, str]:
    """This process's environment, with the ``extproc`` package we run from first on the path."""
    env = dict(os.environ)
    root = str(Path(extproc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@contextmanager
def spawn_sim_pods(
    num_pods: int = 2,
    *,
    args: Sequence[str] = (),
    port: int = 0,
    timeout_s: float = START_TIMEOUT_S,
    stderr: IO[bytes] | None = None,
) -> Iterator[SimPods]:
    """Run ``python -m extproc.sim.pods_cli --pods N --port PORT ARGS`` and wait until it serves.

    Args:
        num_pods: pods to start.
        args: more ``sim-pods`` flags (not ``--pods``/``--port``).
        port: the first pod's port; 0 (the default): free ports, the admin port too. A
            pod started again on its old port comes back with an empty cache.
        timeout_s: how long to wait for the ready line.
        stderr: where the process's stderr goes (default: this process's).

    Raises:
        RuntimeError: the process exited or stayed silent before serving.
    """
    cmd = [sys.executable, "-m", "extproc.sim.pods_cli", "--pods", str(num_pods)]
    cmd += ["--port", str(port), "--admin-port", "0"]  # a free admin port
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        stderr=stderr,
        env=_child_env(),
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(
                f"sim-pods did not start within {timeout_s} s (exit code {proc.poll()})"
            )
        yield SimPods.from_description(orjson.loads(line), proc.pid)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, then SIGKILL if it lingers; always reaped, pipes closed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    if proc.stdout is not None:
        proc.stdout.close()
