"""``ScrapeProcess``: the ``MetricsScraper`` in a child process, off the router's GIL.

A sweep's GETs and page parsing hold the GIL of the process they run in: in the routing
process every request arriving meanwhile waits for them, which at 1,000 pods made the
p99 about ten times the unscraped one (docs/performance.md). Here the scraper runs
unchanged in a child process (multiprocessing's ``spawn``: no fork of a process running
gRPC's threads) and the routing process only applies each tick's outcomes to its
``PodStore``, on a relay thread that waits on the pipe without the GIL.

Over one ``multiprocessing`` pipe, pickled:

* parent -> child: the store's base pods whenever discovery changes them (checked every
  ``POLL_S``), and ``stop``;
* child -> parent: each tick's ``update_metrics`` batch, with the store's
  ``stale_after_s`` (stretched with the sweeps, as in process) and the child registry's
  metric families, which the parent's registry exposes as they are (``extproc_scrape_*``
  read the same in either mode); and the child's log records, handled by the parent's
  loggers (its format, its level).

A child that dies is started again after ``restart_delay_s``, doubled while children
die before their first report (at most ``MAX_RESTART_DELAY_S``), and counted in
``extproc_scrape_process_restarts_total`` (the new child's counters start again from
zero, as a restarted process's do). While no report arrives for two ticks (a child dead,
starting or hung), the relay hands the store an empty batch every two ticks, as an empty
tick does, so pods go stale on time (a healthy child's tick a little late is not doubled
by one). A child that has sent nothing for ``hung_after_s`` since its last report
(``STARTUP_S`` at the most before its first) is killed and started again. ``spawn``
imports the parent's main module in the child: a script that starts one needs the
``if __name__ == "__main__":`` guard. The child exits when the parent's end of the pipe
closes, so a killed extproc leaves no scraper behind.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import multiprocessing
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from extproc.datalayer.scrape import MetricsScraper, ScrapeMetrics, ScrapeOptions
from extproc.datalayer.store import AdaptersUpdate, MetricsUpdate, PodStore
from extproc.pods import Pod

log = logging.getLogger("extproc.datalayer.scrape")

POLL_S: Final = 0.05  # how soon a change of discovery's pods reaches the child
STOP_WAIT_S: Final = 5.0
MAX_RESTART_DELAY_S: Final = 30.0
STARTUP_S: Final = 60.0  # a child's first report may take this long (a loaded machine)


@dataclass(frozen=True, slots=True)
class _Tick:
    metrics: list[MetricsUpdate]
    adapters: list[AdaptersUpdate]
    stale_after_s: float | None
    families: list[Metric]


class ScrapeProcess:
    """Scrapes the store's pods in a child process; ``start()``/``stop()``."""

    def __init__(
        self,
        store: PodStore,
        options: ScrapeOptions,
        *,
        registry: CollectorRegistry = REGISTRY,
        restart_delay_s: float = 1.0,
        hung_after_s: float = 30.0,
    ) -> None:
        self.store = store
        self.options = options
        self.restart_delay_s = restart_delay_s
        self.hung_after_s = hung_after_s
        self._stale_after_s = store.stale_after_s  # as configured, before any stretching
        self._forwarded = _ForwardedFamilies(options.interval_s)
        registry.register(self._forwarded)
        self.restarts = Counter(
            "extproc_scrape_process_restarts",
            "Times the scraper's child process ended unasked and was started again.",
            registry=registry,
        )
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._sent: tuple[Pod, ...] | None = None
        self._stopping = threading.Event()
        self._relay: threading.Thread | None = None
        self._reported = False  # the child in place has sent a tick
        self._published_s = time.monotonic()  # the store's last batch, a tick's or empty
        self._heard_s = time.monotonic()  # the child in place's last message (or its start)
        self._delay_s = restart_delay_s

    @property
    def pid(self) -> int | None:
        """The child's process id, None before ``start()``."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the child and the relay thread."""
        if self._relay is not None:
            raise RuntimeError("ScrapeProcess already started")
        self._spawn()
        self._relay = threading.Thread(target=self._run_relay, name="scrape-relay", daemon=True)
        self._relay.start()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Ask the child to stop, wait for it (then end it) and for the relay thread."""
        self._stopping.set()
        self._send(("stop", None))
        if self._relay is not None:
            self._relay.join(timeout_s)
        self._end_child(timeout_s)

    def _spawn(self) -> None:
        parent_end, child_end = self._context.Pipe()
        pods = self.store.base_pods
        level = logging.getLogger("extproc").getEffectiveLevel()
        process = self._context.Process(
            target=run_child,
            args=(child_end, self.options, pods, self._stale_after_s, level),
            name="extproc-scraper",
            daemon=True,
        )
        process.start()
        child_end.close()  # the child's copy alone: its death is EOF here
        self._process, self._conn, self._sent = process, parent_end, pods
        self._heard_s = time.monotonic()

    def _end_child(self, timeout_s: float) -> None:
        process, conn = self._process, self._conn
        if process is not None:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)
        if conn is not None:
            conn.close()

    def _send(self, message: tuple[str, Any]) -> None:
        with self._send_lock:
            if self._conn is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: the relay restarts it
                pass

    def _run_relay(self) -> None:
        while not self._stopping.is_set():
            conn = self._conn
            assert conn is not None
            pods = self.store.base_pods
            if pods is not self._sent:
                self._sent = pods
                self._send(("pods", pods))
            try:
                if not conn.poll(POLL_S):
                    self._publish_if_silent()
                    self._end_if_hung()
                    continue
                kind, payload = conn.recv()
            except (EOFError, OSError):
                if not self._stopping.is_set():
                    self._restart()
                continue
            self._heard_s = time.monotonic()
            try:
                self._apply(kind, payload)
            except Exception:  # a bug downstream (on_change) must not end the scraping
                log.exception("publishing scraped metrics failed")

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "tick":
            tick: _Tick = payload
            self._reported = True
            self._published_s = time.monotonic()
            self._forwarded.families = tick.families
            if self.store.stale_after_s is not None and tick.stale_after_s is not None:
                self.store.stale_after_s = tick.stale_after_s
            self.store.update_metrics(tick.metrics, tick.adapters)
        elif kind == "log":
            record = logging.makeLogRecord(payload)
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)

    def _restart(self) -> None:
        process = self._process
        if process is not None:
            process.join(STOP_WAIT_S)
        self._delay_s = (
            self.restart_delay_s if self._reported else min(2 * self._delay_s, MAX_RESTART_DELAY_S)
        )
        log.error(
            "the scraper process ended (exit code %s); starting another in %.1f s",
            None if process is None else process.exitcode,
            self._delay_s,
        )
        self.restarts.inc()
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()
        deadline = time.monotonic() + self._delay_s
        while time.monotonic() < deadline:
            if self._stopping.wait(POLL_S):
                return
            self._publish_if_silent()
        with self._send_lock:
            if self._stopping.is_set():  # stop() came between the wait and here
                return
            self._spawn()
            self._reported = False

    def _end_if_hung(self) -> None:
        """Kill a child silent for ``hung_after_s`` (before its first report, for
        ``STARTUP_S`` if longer): its end of the pipe closes, and the relay starts another."""
        process = self._process
        silent_s = time.monotonic() - self._heard_s
        limit = self.hung_after_s if self._reported else max(self.hung_after_s, STARTUP_S)
        if process is None or silent_s < limit or not process.is_alive():
            return
        log.error("the scraper process sent nothing for %.0f s; ending it", silent_s)
        process.kill()

    def _publish_if_silent(self) -> None:
        """No report for two ticks: an empty batch, so that the store re-checks staleness."""
        now = time.monotonic()
        if now - self._published_s < 2 * self.options.interval_s:
            return
        self._published_s = now
        try:
            self.store.update_metrics(())
        except Exception:  # a bug downstream (on_change) must not end the relay
            log.exception("publishing scraped metrics failed")


class _ForwardedFamilies(Collector):
    """The child registry's families as last reported; before the first report, the
    scraper's families as a new one starts them (so the page lists them from the start)."""

    family_labelnames = ScrapeMetrics.LABELS  # by family: read by the docs' metrics reference

    def __init__(self, interval_s: float) -> None:
        fresh = CollectorRegistry()
        ScrapeMetrics(fresh).interval.set(interval_s)
        self.families: list[Metric] = list(fresh.collect())

    def collect(self) -> Iterable[Metric]:
        return self.families


# -- the child ----------------------------------------------------------------------


class _RelayedStore:
    """What ``MetricsScraper`` needs of a ``PodStore``, in the child: discovery's pods as
    the parent sends them; each tick's outcomes sent to the parent."""

    def __init__(
        self,
        pipe: _Pipe,
        registry: CollectorRegistry,
        pods: tuple[Pod, ...],
        stale_after_s: float | None,
    ) -> None:
        self.base_pods = pods
        self.stale_after_s = stale_after_s
        self._pipe = pipe
        self._registry = registry

    def update_metrics(
        self, updates: Iterable[MetricsUpdate], adapters: Iterable[AdaptersUpdate] = ()
    ) -> None:
        families = list(self._registry.collect())
        tick = _Tick(list(updates), list(adapters), self.stale_after_s, families)
        self._pipe.send(("tick", tick))


class _Pipe:
    """The child's end: sends from the scraper's loop and from logging, one at a time;
    a log record goes as its attributes (``put_nowait`` is ``QueueHandler``'s call)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[str, Any]) -> None:
        with self._lock:
            self.conn.send(message)

    def put_nowait(self, record: logging.LogRecord) -> None:
        try:
            self.send(("log", dict(record.__dict__)))
        except (OSError, ValueError):  # the parent is gone; the child is ending
            pass


def run_child(
    conn: Connection,
    options: ScrapeOptions,
    pods: Sequence[Pod],
    stale_after_s: float | None,
    log_level: int,
) -> None:
    """The child's main: scrape until the parent says stop or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's
    pipe = _Pipe(conn)
    root = logging.getLogger()
    root.handlers = [logging.handlers.QueueHandler(pipe)]  # type: ignore[arg-type]
    root.setLevel(log_level)
    registry = CollectorRegistry()
    store = _RelayedStore(pipe, registry, tuple(pods), stale_after_s)
    scraper = MetricsScraper.with_options(store, options, registry=registry)
    threading.Thread(
        target=_follow_parent, args=(conn, store, scraper), name="scrape-parent", daemon=True
    ).start()
    try:
        asyncio.run(scraper.run())
    except (OSError, ValueError):  # the parent's end closed under a send
        pass


def _follow_parent(conn: Connection, store: _RelayedStore, scraper: MetricsScraper) -> None:
    """Discovery's pods into the relayed store, until ``stop`` or the parent is gone."""
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "stop":
            break
        store.base_pods = payload
    scraper.stop()
