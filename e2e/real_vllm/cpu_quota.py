"""Hold a process tree to a fixed share of the CPU: a cgroup v1 ``cpu`` group with a CFS
quota.

On this machine the real vLLM pods, the client and the routers share two cores, so a pod's
compute is whatever the others leave it: an engine alone on a core has twice the compute
of two engines bound to the other, and a router that consolidates traffic onto one pod
gives it compute that spreading would share. Pods with a GPU each have compute of their
own. Capping every pod at the same share of a core (``cores``) makes them equal and fixed,
and leaves the rest of the machine to the client and the router. Unlike a GPU, a quota
also stalls a pod for the rest of a period once its threads have spent their share
(``bench/results/routing_quality_vllm_quota.md`` measures what that does).

    with cpu_group("extproc-vllm-8000", 0.5) as group:
        spawn(name, group.wrap(argv), log_dir)
        ...  # started at full speed
        group.cap()  # held to half a core from here on

``wrap`` makes the command join the group before it runs (``exec``), so every process it
starts is in the group too. Leaving the context waits for them to exit (stop the command
first), kills any left after ``REMOVE_TIMEOUT_S`` and removes the group. Needs the cgroup
v1 ``cpu`` hierarchy mounted writable (root); ``CpuQuotaUnavailable`` says what is
missing otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# A short period, so a capped pod is paused at most a few ms at a time (the kernel's
# default, 100 ms, would stall a request's prefill for tens of ms).
PERIOD_US = 10_000
REMOVE_TIMEOUT_S = 10.0


class CpuQuotaUnavailable(RuntimeError):
    """The machine cannot cap a process tree's CPU (no writable cgroup v1 ``cpu``)."""


@dataclass(frozen=True)
class CpuGroup:
    """One ``cpu`` cgroup and its quota, in cores."""

    path: Path
    cores: float

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the group: a shell writes its own pid into the group, then
        becomes the command (same pid, so stopping it by pid still works)."""
        join = 'echo $$ > "$0" && exec "$@"'
        return ["/bin/sh", "-c", join, str(self.path / "cgroup.procs"), *argv]

    def cap(self) -> None:
        """Hold the group to ``cores`` from now on (until then it runs uncapped)."""
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(round(self.cores * PERIOD_US)))

    def throttled(self) -> tuple[int, int]:
        """(periods, periods in which the group was throttled) so far."""
        lines = (self.path / "cpu.stat").read_text().splitlines()
        stat = {key: int(value) for key, value in (line.split() for line in lines if line)}
        return stat["nr_periods"], stat["nr_throttled"]


@contextmanager
def cpu_group(name: str, cores: float, root: Path = CPU_ROOT) -> Iterator[CpuGroup]:
    """A ``cpu`` cgroup named ``name``, to hold its processes to ``cores`` of a core once
    ``cap`` is called; removed on leaving, once its processes have exited (stop them
    first)."""
    machine = os.cpu_count() or 1
    if not 0 < cores <= machine:
        raise ValueError(f"cores must be in (0, {machine}], got {cores}")
    if not (root / "cpu.cfs_quota_us").exists():
        raise CpuQuotaUnavailable(f"no cgroup v1 cpu hierarchy at {root} (cpu.cfs_quota_us)")
    path = root / name
    try:
        path.mkdir()
    except OSError as exc:
        raise CpuQuotaUnavailable(f"cannot create the cgroup {path}: {exc}") from None
    try:
        yield CpuGroup(path, cores)
    finally:
        _remove(path)


def _remove(path: Path) -> None:
    """rmdir the group once its processes have gone; any still there after
    ``REMOVE_TIMEOUT_S`` (an engine its server left behind) get SIGKILL by PID."""
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    while pids := _pids(path):
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + REMOVE_TIMEOUT_S
        time.sleep(0.1)
    path.rmdir()


def _pids(path: Path) -> list[int]:
    return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
