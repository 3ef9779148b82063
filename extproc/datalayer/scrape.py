"""``MetricsScraper``: every ready pod's ``/metrics``, on an interval, into the ``PodStore``.

Design: one daemon thread runs an asyncio loop with one aiohttp session (keep-alive
connections, C HTTP parser: a fraction of httpx's CPU per GET); parsing is
``engine_metrics``' job. Parsing holds the GIL, so a request arriving meanwhile waits
for it: ``extproc serve`` runs the scraper in a child process (``scrape_process``) unless
``--scraper thread``. The costs per scrape and per sweep: docs/performance.md
(``bench/scrape.py``).

Each tick (every ``interval_s``) starts a scrape of every discovery-ready pod that is due
and has none in progress, waits for them until the next tick at most, and hands the
outcomes that arrived to ``PodStore.update_metrics`` in one batch (one publish per tick;
an empty batch still lets the store re-check staleness). A pod is due at once when new,
then every sweep interval, its first a random part of one: when the sweeps are spaced out
(below) each tick scrapes its share of the pods instead of every pod landing on one tick,
which at 1,000 pods took the bursts of CPU, and the p99 they cost the requests, away
(docs/performance.md). A slow pod's scrape, bounded by ``timeout_s``, carries over into
later ticks without delaying the other pods.

Scraping stays within ``cpu_budget`` of one core (default a tenth): the thread's CPU
time per sweep is measured, and when scraping every pod each ``interval_s`` would cost
more, the sweeps are spaced out to fit (the interval becomes a full sweep's CPU time /
``cpu_budget`` when that is longer than ``interval_s``). Pods then stay fresh for
``STALE_SWEEPS`` sweeps, not just ``stale_after_s``. The interval in force is the
gauge ``extproc_scrape_interval_seconds``; a warning says when it first stretches.

The page asked for is ``/metrics/?name[]=...``, one ``name[]`` per series we read
(``engine_metrics.SAMPLE_NAMES``): prometheus_client's exposition then renders just those
(``restricted_registry``). vLLM mounts prometheus_client's app under ``/metrics/``, while
its plain ``/metrics`` route ignores the parameter, so a filtered page costs the pod's API
server far less CPU than the full one, on the event loop that serves its requests
(docs/performance.md). A pod whose filtered page is refused (not 200) or carries none of
our series is asked for the full ``/metrics`` at once, and from then on while it stays
(``extproc_scrape_full_page_pods``): any engine serving a plain page still works.

Failures never leave the loop: each is counted in
``extproc_scrape_errors_total{pod, reason}`` with ``reason`` one of ``connect`` (the
pod is unreachable: not ready at once), ``timeout``, ``http_status``, ``read``,
``too_large``, ``parse`` (a wanted line is malformed), ``no_metrics`` (none of the
series we read) or ``internal`` (a bug, logged with its traceback); those other than
``connect`` keep the pod's last metrics until they go stale. Every scrape's duration
goes to ``extproc_scrape_duration_seconds``.

LoRA adapters: with ``models_interval_s`` > 0 the same loop reads each ready pod's
``/v1/models`` too (``adapters``), every ``models_interval_s`` (stretched by the same
factor as the sweeps when the CPU budget stretches them), with the same time and size
limits and the same spreading; the adapters found go to the store in the tick's batch.
A failed read keeps the last good list and is counted in
``extproc_models_scrape_errors_total{pod, reason}`` (the reasons above; ``parse``: not an
OpenAI model list). A pod that refused a connection,
to either page, is read again from the next tick on: a restarted vLLM has lost the
adapters loaded at run time, and its new list is read with its first metrics. So is a
pod whose models the source changed (an adapter's parent must be one of them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Final, NamedTuple, Protocol, TypeVar
from urllib.parse import urlencode

import aiohttp
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from extproc.datalayer.adapters import MODELS_PAGE, parse_adapters
from extproc.datalayer.engine_metrics import SAMPLE_NAMES, PageParser, PodReader
from extproc.datalayer.store import AdaptersUpdate, MetricsUpdate
from extproc.pods import Pod, PodId, PodMetrics

log = logging.getLogger("extproc.datalayer.scrape")
T = TypeVar("T")

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_PAGE_BYTES: Final = 8 << 20  # far above a real page; this only bounds a broken one
STALE_SWEEPS: Final = 3  # with a stretched interval, pods stay fresh this many sweeps
FULL_PAGE: Final = "/metrics"
FILTERED_PAGE: Final = "/metrics/?" + urlencode([("name[]", n) for n in sorted(SAMPLE_NAMES)])


class ScrapedStore(Protocol):
    """What the scraper needs of a ``PodStore`` (``scrape_process`` relays these)."""

    base_pods: tuple[Pod, ...]
    stale_after_s: float | None

    def update_metrics(
        self, updates: Iterable[MetricsUpdate], adapters: Iterable[AdaptersUpdate] = ()
    ) -> None: ...


class _ScrapeError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ScrapeMetrics:
    # the labelled families' label names (ScrapeProcess's parent shows them before any child)
    LABELS: Final = {
        "extproc_scrape_errors": ("pod", "reason"),
        "extproc_models_scrape_errors": ("pod", "reason"),
    }

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "extproc_scrape_errors",
            "Failed scrapes of pods' /metrics, by pod and reason.",
            self.LABELS["extproc_scrape_errors"],
            registry=registry,
        )
        self.duration = Histogram(
            "extproc_scrape_duration_seconds",
            "Time to fetch and parse one pod's /metrics, failures included.",
            registry=registry,
            buckets=DURATION_BUCKETS,
        )
        self.interval = Gauge(
            "extproc_scrape_interval_seconds",
            "Time between sweeps over every pod: --scrape-interval-s, or longer to keep "
            "scraping within --scrape-cpu-budget.",
            registry=registry,
        )
        self.full_page_pods = Gauge(
            "extproc_scrape_full_page_pods",
            "Pods scraped by their full /metrics page: their /metrics/?name[]= page was "
            "refused or carried none of the series extproc reads.",
            registry=registry,
        )
        self.models_errors = Counter(
            "extproc_models_scrape_errors",
            "Failed reads of pods' /v1/models (their LoRA adapters), by pod and reason.",
            self.LABELS["extproc_models_scrape_errors"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class ScrapeOptions:
    """The scraper's settings (``MetricsScraper.with_options``; ``ScrapeProcess``'s child
    builds its scraper from them)."""

    interval_s: float = 0.2
    timeout_s: float = 1.0
    cpu_budget: float = 0.1
    latency_hold_s: float = 10.0
    max_page_bytes: int = MAX_PAGE_BYTES
    models_interval_s: float = 0.0


class MetricsScraper:
    """Scrapes the store's pods in a background thread; ``start()``/``stop()``."""

    @classmethod
    def with_options(
        cls, store: ScrapedStore, options: ScrapeOptions, *, registry: CollectorRegistry
    ) -> MetricsScraper:
        return cls(store, registry=registry, **asdict(options))

    def __init__(
        self,
        store: ScrapedStore,
        *,
        interval_s: float = 0.2,
        timeout_s: float = 1.0,
        cpu_budget: float = 0.1,
        latency_hold_s: float = 10.0,
        max_page_bytes: int = MAX_PAGE_BYTES,
        registry: CollectorRegistry = REGISTRY,
        parser: PageParser | None = None,
        models_interval_s: float = 0.0,
    ) -> None:
        """``parser`` replaces the page parser (the benchmark passes its baseline);
        ``models_interval_s`` 0 reads no ``/v1/models`` (module doc)."""
        if interval_s <= 0 or timeout_s <= 0 or cpu_budget <= 0:
            raise ValueError(
                "interval_s, timeout_s and cpu_budget must be > 0, got "
                f"{interval_s}, {timeout_s}, {cpu_budget}"
            )
        if models_interval_s < 0:
            raise ValueError(f"models_interval_s must be >= 0, got {models_interval_s}")
        self.store = store
        self.interval_s = interval_s
        self.cpu_budget = cpu_budget
        self.sweep_interval_s = interval_s  # in force: interval_s, or longer (the budget)
        self._stale_after_s = store.stale_after_s
        self.timeout_s = timeout_s
        self.latency_hold_s = latency_hold_s
        self.max_page_bytes = max_page_bytes
        self.models_interval_s = models_interval_s
        self.metrics = ScrapeMetrics(registry)
        self.metrics.interval.set(interval_s)
        self._parser = parser or PageParser()
        self._readers: dict[PodId, PodReader] = {}
        self._full_page: set[PodId] = set()  # pods whose filtered page failed (module doc)
        self.metrics.full_page_pods.set_function(lambda: len(self._full_page))
        self._error_labels: set[tuple[str, str]] = set()
        self._models_error_labels: set[tuple[str, str]] = set()
        # a tick's lateness (half a tick) must not skip a pod that is due every tick
        self._scrapes = _Schedule(slack_s=interval_s / 2)
        self._models = _Schedule(slack_s=interval_s / 2)
        self._known: tuple[Pod, ...] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Run ``run()`` in a daemon thread until ``stop()``."""
        if self._thread is not None:
            raise RuntimeError("MetricsScraper already started")
        started = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.run(started.set)), name="metrics-scraper", daemon=True
        )
        self._thread.start()
        started.wait(5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (scrapes in progress are cancelled) and wait for the thread."""
        self._stopping.set()
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            try:
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:  # the loop already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)

    async def run(self, on_started: Callable[[], object] = lambda: None) -> None:
        """The scrape loop, until ``stop()``."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        on_started()
        in_flight = _InFlight()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            try:
                await self._loop_ticks(session, in_flight)
            finally:
                tasks = in_flight.tasks()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop_ticks(self, session: aiohttp.ClientSession, in_flight: _InFlight) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        cpu_at_tick = time.thread_time()  # this thread does nothing but scrape
        while not self._stopping.is_set():
            self._follow_pods(in_flight)
            started = self._start_reads(session, in_flight, loop.time())
            next_tick += self.interval_s
            if next_tick <= loop.time():  # fell behind (a stalled process): skip missed ticks
                next_tick = loop.time() + self.interval_s
            tasks = in_flight.tasks()
            if tasks:
                await asyncio.wait(tasks, timeout=next_tick - loop.time())
            metrics, adapters = in_flight.pop_done()
            try:
                self.store.update_metrics(metrics, adapters)
            except Exception:  # a bug downstream (on_change) must not end the scraping
                log.exception("publishing scraped metrics failed")
            cpu = time.thread_time()
            if started:
                self._fit_budget(cpu - cpu_at_tick, len(self.store.base_pods), started)
            cpu_at_tick = cpu
            await self._sleep_until(next_tick)

    def _start_reads(self, session: aiohttp.ClientSession, in_flight: _InFlight, now: float) -> int:
        """Start the scrapes and ``/v1/models`` reads due; returns how many scrapes."""
        started = 0
        models_interval = self.models_interval_s * self.sweep_interval_s / self.interval_s
        for pod in self.store.base_pods:
            if not pod.ready:
                continue
            if pod.id not in in_flight.metrics and self._scrapes.is_due(pod.id, now):
                in_flight.metrics[pod.id] = asyncio.create_task(self._scrape(session, pod))
                self._scrapes.started(pod.id, now, self.sweep_interval_s)
                started += 1
            if (
                self.models_interval_s
                and pod.id not in in_flight.models
                and self._models.is_due(pod.id, now)
            ):
                in_flight.models[pod.id] = asyncio.create_task(self._read_models(session, pod))
                self._models.started(pod.id, now, models_interval)
        return started

    def _fit_budget(self, sweep_cpu_s: float, num_pods: int, scraped: int) -> None:
        """Space sweeps so that scraping every pod costs at most ``cpu_budget`` of a core."""
        full_sweep_s = sweep_cpu_s * num_pods / scraped
        wanted = max(self.interval_s, full_sweep_s / self.cpu_budget)
        if abs(wanted - self.sweep_interval_s) < 0.1 * self.sweep_interval_s:
            return  # steady: no churn from measurement noise
        if wanted > self.interval_s and self.sweep_interval_s == self.interval_s:
            log.warning(
                "scraping %d pods every %.2f s would take %.0f%% of a core; scraping every "
                "%.2f s instead (--scrape-cpu-budget %.2f)",
                num_pods,
                self.interval_s,
                100 * full_sweep_s / self.interval_s,
                wanted,
                self.cpu_budget,
            )
        self.sweep_interval_s = wanted
        self.metrics.interval.set(wanted)
        if self._stale_after_s is not None:
            self.store.stale_after_s = max(self._stale_after_s, STALE_SWEEPS * wanted)

    async def _sleep_until(self, deadline: float) -> None:
        assert self._wakeup is not None
        delay = deadline - asyncio.get_running_loop().time()
        if delay > 0 and not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._wakeup.wait(), delay)
            except TimeoutError:
                pass

    def _follow_pods(self, in_flight: _InFlight) -> None:
        """Drop the state (reads, latency windows, error series) of pods that left; read
        at once the adapters of pods whose models changed (their parents)."""
        pods, known = self.store.base_pods, self._known
        if pods is known:
            return
        self._known = pods
        models_before = {p.id: p.models for p in known or ()}
        for pod in pods:
            if models_before.get(pod.id, pod.models) != pod.models:
                self._models.at_next_tick(pod.id)
        ids = {p.id for p in pods}
        for tasks in (in_flight.metrics, in_flight.models):
            for pod_id in [i for i in tasks if i not in ids]:
                tasks.pop(pod_id).cancel()
        for pod_id in [i for i in self._readers if i not in ids]:
            del self._readers[pod_id]
        self._scrapes.keep(ids)
        self._models.keep(ids)
        self._full_page &= ids
        names = {str(i) for i in ids}
        for counter, seen in (
            (self.metrics.errors, self._error_labels),
            (self.metrics.models_errors, self._models_error_labels),
        ):
            for labels in [lb for lb in seen if lb[0] not in names]:
                seen.discard(labels)
                counter.remove(*labels)

    # -- one scrape ------------------------------------------------------------------

    async def _scrape(self, session: aiohttp.ClientSession, pod: Pod) -> MetricsUpdate:
        """Fetch and read one pod's page; never raises."""
        started = time.perf_counter()
        try:
            outcome = await _attempt(self._read(session, pod), pod, FULL_PAGE)
        finally:
            self.metrics.duration.observe(time.perf_counter() - started)
        if isinstance(outcome, _Failed):
            self._count_error(self.metrics.errors, self._error_labels, pod, outcome.reason)
            if outcome.reason == "connect":  # it may be restarting: its adapters change
                self._models.at_next_tick(pod.id)
            return MetricsUpdate(pod.id, None, reachable=outcome.reason != "connect")
        return MetricsUpdate(pod.id, outcome)

    async def _read_models(self, session: aiohttp.ClientSession, pod: Pod) -> AdaptersUpdate | None:
        """The adapters on the pod's ``/v1/models``; ``None`` when the read failed."""
        outcome = await _attempt(self._adapters_page(session, pod), pod, MODELS_PAGE)
        if not isinstance(outcome, _Failed):
            return AdaptersUpdate(pod.id, outcome)
        if outcome.reason == "connect":
            self._models.at_next_tick(pod.id)
        self._count_error(
            self.metrics.models_errors, self._models_error_labels, pod, outcome.reason
        )
        return None

    async def _adapters_page(self, session: aiohttp.ClientSession, pod: Pod) -> frozenset[str]:
        return parse_adapters(await self._fetch(session, pod, MODELS_PAGE), pod.models)

    async def _read(self, session: aiohttp.ClientSession, pod: Pod) -> PodMetrics:
        """The pod's metrics from its filtered page, or from its full page (module doc)."""
        if pod.id in self._full_page:
            return await self._read_full_page(session, pod)
        try:
            metrics = await self._read_page(session, pod, FILTERED_PAGE)
        except _ScrapeError as exc:
            if exc.reason != "http_status":
                raise
            metrics = None
        if metrics is not None:
            return metrics
        metrics = await self._read_full_page(session, pod)
        self._full_page.add(pod.id)
        log.info(
            "%s (%s) refused /metrics/?name[]= or had none of our series there: scraping "
            "its full /metrics page from now on",
            pod.id,
            pod.address,
        )
        return metrics

    async def _read_full_page(self, session: aiohttp.ClientSession, pod: Pod) -> PodMetrics:
        metrics = await self._read_page(session, pod, FULL_PAGE)
        if metrics is None:
            raise _ScrapeError("no_metrics")
        return metrics

    async def _read_page(
        self, session: aiohttp.ClientSession, pod: Pod, page: str
    ) -> PodMetrics | None:
        body = await self._fetch(session, pod, page)
        return self._reader(pod).read(self._parser.samples(body), time.monotonic())

    async def _fetch(self, session: aiohttp.ClientSession, pod: Pod, page: str) -> bytes:
        url = f"http://{pod.address}{page}"
        async with session.get(url, headers={"Accept-Encoding": "identity"}) as resp:
            if resp.status != 200:
                raise _ScrapeError("http_status")
            if resp.content_length is not None and resp.content_length > self.max_page_bytes:
                raise _ScrapeError("too_large")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > self.max_page_bytes:
                    raise _ScrapeError("too_large")
                chunks.append(chunk)
            return b"".join(chunks)

    def _reader(self, pod: Pod) -> PodReader:
        reader = self._readers.get(pod.id)
        if reader is None or reader.models != pod.models:
            reader = self._readers[pod.id] = PodReader(
                pod.models, self.latency_hold_s, pod=str(pod.id)
            )
        return reader

    @staticmethod
    def _count_error(counter: Counter, seen: set[tuple[str, str]], pod: Pod, reason: str) -> None:
        labels = (str(pod.id), reason)
        seen.add(labels)
        counter.labels(*labels).inc()
        log.debug("a read of %s (%s) failed: %s", pod.id, pod.address, reason)


class _Schedule:
    """When each pod's next read is due (loop time): at once for a pod not read yet, then
    every interval, the first of them a random part of it, so that the reads of many
    pods spread over the ticks instead of all landing on one. Due up to ``slack_s`` early."""

    def __init__(self, slack_s: float) -> None:
        self.slack_s = slack_s
        self._due: dict[PodId, float] = {}
        self._read: set[PodId] = set()  # pods read at least once

    def is_due(self, pod_id: PodId, now: float) -> bool:
        return self._due.get(pod_id, now) <= now + self.slack_s

    def started(self, pod_id: PodId, now: float, interval_s: float) -> None:
        if pod_id in self._read:
            self._due[pod_id] = now + interval_s
        else:
            self._read.add(pod_id)
            self._due[pod_id] = now + random.uniform(0.0, interval_s)

    def at_next_tick(self, pod_id: PodId) -> None:
        self._due.pop(pod_id, None)

    def keep(self, ids: set[PodId]) -> None:
        """Forget the pods not in ``ids``."""
        self._due = {i: t for i, t in self._due.items() if i in ids}
        self._read &= ids


class _InFlight:
    """The reads in progress, each pod's scrape and ``/v1/models`` read."""

    def __init__(self) -> None:
        self.metrics: dict[PodId, asyncio.Task[MetricsUpdate]] = {}
        self.models: dict[PodId, asyncio.Task[AdaptersUpdate | None]] = {}

    def tasks(self) -> list[asyncio.Task[Any]]:
        return [*self.metrics.values(), *self.models.values()]

    def pop_done(self) -> tuple[list[MetricsUpdate], list[AdaptersUpdate]]:
        """The outcomes that arrived (failed ``/v1/models`` reads send nothing)."""
        metrics = [self.metrics.pop(i).result() for i in _done(self.metrics)]
        models = [self.models.pop(i).result() for i in _done(self.models)]
        return metrics, [update for update in models if update is not None]


def _done(tasks: dict[PodId, asyncio.Task[Any]]) -> list[PodId]:
    return [pod_id for pod_id, task in tasks.items() if task.done()]


class _Failed(NamedTuple):
    reason: str  # the reason label (module doc)


async def _attempt(read: Awaitable[T], pod: Pod, page: str) -> T | _Failed:
    """``read``'s value, or why it failed; logs the traceback of a bug."""
    try:
        return await read
    except _ScrapeError as exc:
        return _Failed(exc.reason)
    except TimeoutError:
        return _Failed("timeout")
    except aiohttp.ClientConnectorError:
        return _Failed("connect")
    except aiohttp.ClientError:
        return _Failed("read")
    except ValueError:
        return _Failed("parse")
    except Exception:
        log.exception("reading %s of %s (%s) failed", page, pod.id, pod.address)
        return _Failed("internal")
