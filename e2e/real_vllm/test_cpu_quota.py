"""``cpu_quota``: a process tree held to a share of a core by a real cgroup, and the
group gone afterwards with nothing left running in it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.real_vllm import cpu_quota
from e2e.real_vllm.cpu_quota import CPU_ROOT, CpuQuotaUnavailable, cpu_group
from testkit.waiting import wait_until

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"

needs_cgroup = pytest.mark.skipif(
    not os.access(CPU_ROOT, os.W_OK),
    reason=f"needs the cgroup v1 cpu hierarchy writable at {CPU_ROOT} (root)",
)


@needs_cgroup
def test_a_spinning_child_gets_no_more_than_its_share() -> None:
    """Capped at a fifth of a core, a child of the wrapped command spins for 1 s of wall
    clock: throttled, it gets about a fifth of a core, where alone it would take one."""
    with cpu_group(f"extproc-test-{os.getpid()}", 0.2) as group:
        assert (group.path / "cpu.cfs_quota_us").read_text().strip() == "-1"  # starts uncapped
        group.cap()
        assert (group.path / "cpu.cfs_period_us").read_text().strip() == "10000"
        assert (group.path / "cpu.cfs_quota_us").read_text().strip() == "2000"
        spin = [sys.executable, "-c", SPIN.format(seconds=1.0)]
        # The shell runs the spinner as its child: the cap holds what it starts too.
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(group.wrap(["/bin/sh", "-c", 'exec "$@"', "sh", *spin]), check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        periods, throttled = group.throttled()
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert throttled > 10 and periods >= throttled
    assert cpu_s < 0.5  # 0.2 of a core for 1 s, with the interpreter's start-up


@needs_cgroup
def test_leaving_the_group_kills_what_outlived_its_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod's server stopped, its engine still running: the group waits, then kills it,
    and is removed."""
    monkeypatch.setattr(cpu_quota, "REMOVE_TIMEOUT_S", 0.3)
    name = f"extproc-test-{os.getpid()}"
    with cpu_group(name, 0.5) as group:
        lingering = subprocess.Popen(group.wrap(["sleep", "60"]))
        wait_until(lambda: str(lingering.pid) in (group.path / "cgroup.procs").read_text())
    assert lingering.wait(5) == -9
    assert not (CPU_ROOT / name).exists()


def test_without_a_cgroup_hierarchy_the_error_says_so(tmp_path: Path) -> None:
    with (
        pytest.raises(CpuQuotaUnavailable, match="no cgroup v1 cpu hierarchy"),
        cpu_group("pod", 0.5, root=tmp_path),
    ):
        pass


@pytest.mark.parametrize("cores", [0.0, -1.0, 1e6])
def test_a_share_outside_the_machine_is_refused(cores: float, tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match="cores must be in"),
        cpu_group("pod", cores, root=tmp_path),
    ):
        pass
