"""What a running process holds (memory, threads, file descriptors), for the tests that
look for leaks under load."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Usage:
    """What a process holds."""

    rss_bytes: int
    threads: int
    fds: int


def usage_of(pid: int) -> Usage:
    """The process ``pid`` now, from ``/proc`` (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Usage(
        rss_bytes=int(fields["VmRSS"].split()[0]) * 1024,
        threads=int(fields["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
    )
