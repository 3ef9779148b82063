"""Several extproc replicas behind one or more Envoys, optionally sharing through a real
Redis: the launch helpers of the replica tests and ``bench.replicas``.

Every Envoy lists every replica in its ``extproc`` cluster (``extproc envoy-config
--extproc-address a,b``), so ext_proc streams and access-log streams each go to a
replica of Envoy's choosing. ``redis-server`` (the Debian package) runs on a free port of
127.0.0.1 without persistence; it can be killed and started again on the same port.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.envoyconf.options import EnvoyOptions
from extproc.pods import Pod
from extproc.sim.launch import (
    Proc,
    free_port,
    metrics_page,
    spawn,
    start_envoy,
    start_extproc,
    wait_or_stop,
    write_pods_file,
)


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: apt-get install redis-server (make system-deps)")
    return found


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


@dataclass
class RedisServer:
    """A ``redis-server`` on 127.0.0.1:``port``, no persistence."""

    port: int
    log_dir: Path
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [
            redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = spawn("redis", argv, self.log_dir)
        wait_or_stop(lambda: _redis_ping(self.port), self.proc, "redis-server")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.stop(sig)


@contextmanager
def run_redis(log_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), log_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Replica:
    """One extproc replica: its ports and process (restartable on the same ports)."""

    index: int
    grpc_port: int
    metrics_port: int
    args: list[str]
    pods_file: Path
    log_dir: Path
    config: Path | None
    admin_port: int | None = None
    proc: Proc | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        self.starts += 1
        self.proc = start_extproc(
            self.pods_file,
            self.log_dir,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            config=self.config,
            extra_args=self.args + self._admin_args(),
            name=f"extproc-{self.index}-{self.starts}",
        )

    def _admin_args(self) -> list[str]:
        return [] if self.admin_port is None else ["--admin-port", str(self.admin_port)]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.stop(sig)

    def explain(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The replica's ``/debug/pick`` for this request: what its view holds for it on
        every pod, read without recording, crediting or counting anything."""
        if self.admin_port is None:
            raise ValueError("started without an admin port: run_replicas(admin=True)")
        envelope = json.dumps({"path": path, "body": body}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}/debug/pick", data=envelope, method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer: dict[str, Any] = json.load(resp)
        return answer

    def metrics_text(self) -> str:
        return metrics_page(self.metrics_port)

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of ``name``'s samples whose labels contain ``labels`` (0 when absent)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith(name) and labels in line and not line.startswith("#"):
                sample, _, value = line.rpartition(" ")
                if sample.split("{")[0] == name:
                    total += float(value)
        return total


@dataclass
class Replicas:
    """Replicas, the Envoys in front of them, and the Redis they share (if any)."""

    replicas: list[Replica]
    envoys: list[Proc]
    listen_ports: list[int]
    redis: RedisServer | None
    log_dir: Path
    failure_mode_allow: bool

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.listen_ports]

    def total(self, name: str, labels: str = "") -> float:
        """``name`` summed over the live replicas."""
        return sum(
            r.metric(name, labels) for r in self.replicas if r.proc is not None and r.proc.alive()
        )


@contextmanager
def run_replicas(
    pods: Sequence[Pod],
    *,
    num_replicas: int = 2,
    num_envoys: int = 1,
    redis: bool = True,
    record_metadata: bool = True,
    config: Path | None = None,
    failure_mode_allow: bool = False,
    extproc_args: Sequence[str] = (),
    admin: bool = False,
) -> Iterator[Replicas]:
    """``num_replicas`` extprocs (each told the Redis URL when ``redis``; each with its own
    admin port when ``admin``, for ``Replica.explain``) behind ``num_envoys`` Envoys that
    all list every replica; everything stopped after."""
    with tempfile.TemporaryDirectory(prefix="extproc-replicas-") as tmp, ExitStack() as stack:
        log_dir = Path(tmp)
        pods_file = write_pods_file(pods, log_dir / "pods.yaml")
        server = stack.enter_context(run_redis(log_dir)) if redis else None
        args = [
            "--record-metadata", "on" if record_metadata else "off",
            *(["--redis-url", server.url] if server else []),
            *extproc_args,
        ]  # fmt: skip
        replicas = [
            Replica(
                i,
                free_port(),
                free_port(),
                list(args),
                pods_file,
                log_dir,
                config,
                admin_port=free_port() if admin else None,
            )
            for i in range(num_replicas)
        ]
        for replica in replicas:
            replica.start()
            stack.callback(replica.stop)
        envoys, ports = [], []
        for i in range(num_envoys):
            options = EnvoyOptions(
                extproc_address=",".join(r.address for r in replicas),
                listen_port=free_port(),
                admin_port=free_port(),
                failure_mode_allow=failure_mode_allow,
            )
            envoy = start_envoy(pods, options, log_dir, name=f"envoy-{i}")
            stack.callback(envoy.stop)
            envoys.append(envoy)
            ports.append(options.listen_port)
        yield Replicas(replicas, envoys, ports, server, log_dir, failure_mode_allow)
