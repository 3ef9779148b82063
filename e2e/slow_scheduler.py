"""``python -m e2e.slow_scheduler serve ...``: the real ``extproc serve`` whose scheduler
takes longer than Envoy's message timeout for marked requests, and whose metrics scraper
is slow to stop. Test-only.

A prompt containing ``[slow-scheduler:SECONDS]`` makes ``Scheduler.schedule_request``
sleep that long before scheduling; every other request is untouched. Stopping the
scraper takes ``SLOW_STOP_S`` more, as its child process's exit can on a loaded machine:
a drain must count and record the streams in flight all the same. Nothing in extproc
knows about it: this wrapper patches the two methods and runs the ordinary command line,
so the gRPC server, the router and the access log are the ones that ship.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from extproc.cli import main
from extproc.datalayer.scrape_process import ScrapeProcess
from extproc.scheduling.scheduler import Scheduler

MARKER = re.compile(r"\[slow-scheduler:(\d+(?:\.\d+)?)\]")
SLOW_STOP_S = 5.0
_schedule_request = Scheduler.schedule_request
_stop_scraper = ScrapeProcess.stop


def marker(seconds: float) -> str:
    """The text to put in a prompt for a scheduler that takes ``seconds``."""
    return f"[slow-scheduler:{seconds}]"


def slow_schedule_request(self: Scheduler, cycle: Any, *args: Any, **kwargs: Any) -> Any:
    found = MARKER.search(cycle.request.prompt)
    if found:
        time.sleep(min(float(found.group(1)), 30.0))
    return _schedule_request(self, cycle, *args, **kwargs)


def slow_stop_scraper(self: ScrapeProcess, *args: Any, **kwargs: Any) -> None:
    time.sleep(SLOW_STOP_S)
    _stop_scraper(self, *args, **kwargs)


if __name__ == "__main__":
    Scheduler.schedule_request = slow_schedule_request  # type: ignore[method-assign]
    ScrapeProcess.stop = slow_stop_scraper  # type: ignore[method-assign]
    sys.exit(main())
