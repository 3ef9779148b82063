"""Sample a running Python process with py-spy and rank its functions by self and total time.

py-spy's defaults apply: idle threads (waiting in a lock, ``epoll``, ``select``) are left
out, so the percentages are shares of the samples where some thread was running Python.
``record --format raw`` writes collapsed stacks (``frame;frame;...;leaf COUNT``, root
first); a function's *self* share counts the samples where it is the leaf, its *total*
share those where it is anywhere on the stack (once per sample, however deep it recurs).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RATE_HZ = 100
STOP_GRACE_S = 30  # after --duration: py-spy writes its file


@dataclass(frozen=True, slots=True)
class Entry:
    frame: str  # "function (module.py)"
    self_pct: float
    total_pct: float


def py_spy() -> str:
    """The ``py-spy`` next to this Python (``pip install py-spy``), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise FileNotFoundError("no py-spy: pip install py-spy")
    return found


def start_recording(
    pid: int, seconds: float, out: Path, output_format: str = "raw"
) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (raw collapsed stacks, or
    ``flamegraph``: an SVG)."""
    argv = [
        py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", str(RATE_HZ), "--format", output_format, "--nolineno",
        "--nonblocking", "--output", str(out),
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish_recording(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """Wait for py-spy to write its file; raise with its stderr if it failed."""
    try:
        _, err = proc.communicate(timeout=seconds + STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode:
        raise RuntimeError(f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')}")


def top_entries(collapsed: str, num_entries: int = 15) -> tuple[int, list[Entry]]:
    """(samples, the ``num_entries`` functions of most self time, with their total share)."""
    self_count: Counter[str] = Counter()
    total_count: Counter[str] = Counter()
    num_samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        num_samples += count
        self_count[frames[-1]] += count
        for frame in set(frames):
            total_count[frame] += count
    if not num_samples:
        return 0, []
    return num_samples, [
        Entry(frame, 100 * n / num_samples, 100 * total_count[frame] / num_samples)
        for frame, n in self_count.most_common(num_entries)
    ]


def format_entries(title: str, num_samples: int, entries: list[Entry]) -> str:
    """A Markdown section: the entries as a table under ``title``."""
    lines = [f"### {title}", "", f"{num_samples} samples at {RATE_HZ} Hz, idle threads excluded", "",
             "| self % | total % | function |", "|---:|---:|---|"]  # fmt: skip
    lines += [f"| {e.self_pct:.1f} | {e.total_pct:.1f} | `{e.frame}` |" for e in entries]
    return "\n".join(lines) + "\n"
