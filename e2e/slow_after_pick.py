"""``python -m e2e.slow_after_pick serve ...``: ``e2e.slow_scheduler``, whose marked
requests also wait after their pick is credited. Test-only.

A prompt containing ``[slow-after-pick:SECONDS]`` makes ``Scheduler.arriving`` sleep that
long once the plugins have credited the pick, before the route is answered: the credit
can be seen on /metrics while Envoy still waits (or after it stopped waiting), which a
test needs as its control before it checks the credit goes.
"""

from __future__ import annotations

import re
import sys
import time

from e2e.slow_scheduler import slow_schedule_request
from extproc.cli import main
from extproc.pods import PodId
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.scheduler import Scheduler

AFTER_PICK = re.compile(r"\[slow-after-pick:(\d+(?:\.\d+)?)\]")
_arriving = Scheduler.arriving


def after_pick(seconds: float) -> str:
    """The text to put in a prompt for a route answered ``seconds`` after its credit."""
    return f"[slow-after-pick:{seconds}]"


def slow_arriving(self: Scheduler, cycle: Cycle, pod: PodId) -> None:
    _arriving(self, cycle, pod)
    found = AFTER_PICK.search(cycle.request.prompt)
    if found:
        time.sleep(min(float(found.group(1)), 30.0))


if __name__ == "__main__":
    Scheduler.schedule_request = slow_schedule_request  # type: ignore[method-assign]
    Scheduler.arriving = slow_arriving  # type: ignore[method-assign]
    sys.exit(main())
