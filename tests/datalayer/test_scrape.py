"""MetricsScraper against real HTTP servers on 127.0.0.1: metrics, failures, staleness.

The behaviour tests run the scraper both ways serve does (``--scraper``): in a thread of
this process, and in a child process whose outcomes, metrics and logs come back here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.engine_metrics import SAMPLE_NAMES
from extproc.datalayer.scrape import MetricsScraper, ScrapeOptions, _Schedule
from extproc.datalayer.scrape_process import ScrapeProcess
from extproc.datalayer.store import PodStore
from extproc.pods import Pod, PodId
from testkit.factories import make_pod
from testkit.metrics_pages import REAL_VLLM_PAGE, EngineState, make_vllm_page
from testkit.waiting import wait_until
from tests.datalayer.fake_pod import FakePod

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STALE_S = 0.3
SPACED_SWEEPS = 3  # counted once the budget has stretched the interval


@pytest.fixture
def fake_pods() -> Iterator[list[FakePod]]:
    pods = [FakePod(make_vllm_page([EngineState(waiting=i, running=1)])).start() for i in (1, 2)]
    yield pods
    for pod in pods:
        pod.stop()


class Rig:
    def __init__(
        self,
        fakes: list[FakePod],
        cpu_budget: float = 0.1,
        interval_s: float = 0.02,
        mode: str = "thread",
    ) -> None:
        self.registry = CollectorRegistry()
        self.store = PodStore(self._published, stale_after_s=STALE_S)
        self.pods = [
            Pod(PodId("default", f"p{i}"), fake.address, frozenset({MODEL}))
            for i, fake in enumerate(fakes)
        ]
        self.snapshot: tuple[Pod, ...] = ()
        # each published snapshot's readiness of pod 0 and its connect errors by then
        self.history: list[tuple[bool, float]] = []
        self.store.set_pods(self.pods)
        options = ScrapeOptions(interval_s=interval_s, timeout_s=0.2, cpu_budget=cpu_budget)
        self.scraper: MetricsScraper | ScrapeProcess
        if mode == "process":
            self.scraper = ScrapeProcess(self.store, options, registry=self.registry)
        else:
            self.scraper = MetricsScraper.with_options(self.store, options, registry=self.registry)

    def _published(self, pods: tuple[Pod, ...]) -> None:
        self.snapshot = pods
        self.history.append((pods[0].ready, self.errors(0, "connect")))

    def pod(self, idx: int) -> Pod:
        return self.snapshot[idx]

    def sweep_interval_s(self) -> float:
        return self.registry.get_sample_value("extproc_scrape_interval_seconds") or 0.0

    def errors(self, idx: int, reason: str) -> float:
        labels = {"pod": str(self.pods[idx].id), "reason": reason}
        return self.registry.get_sample_value("extproc_scrape_errors_total", labels) or 0.0


MODES = ["thread", "process"]


@pytest.fixture(params=MODES)
def scraper_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rig(fake_pods: list[FakePod], scraper_mode: str) -> Iterator[Rig]:
    rig = Rig(fake_pods, mode=scraper_mode)
    rig.scraper.start()
    yield rig
    rig.scraper.stop()


def test_scrapes_every_pod_into_the_store(rig: Rig) -> None:
    wait_until(lambda: [p.metrics.waiting for p in rig.snapshot] == [1, 2])
    assert all(p.ready and p.metrics.running == 1 for p in rig.snapshot)
    count = rig.registry.get_sample_value("extproc_scrape_duration_seconds_count")
    assert count is not None and count >= 2


def full_page_pods(rig: Rig) -> float | None:
    return rig.registry.get_sample_value("extproc_scrape_full_page_pods")


def test_asks_for_just_the_series_it_reads(rig: Rig, fake_pods: list[FakePod]) -> None:
    fake_pods[0].page = REAL_VLLM_PAGE.read_text()
    wait_until(lambda: rig.pod(0).metrics.kv_capacity_tokens == 65536 * 32)
    paths = {urlsplit(p).path for p in fake_pods[0].paths}
    assert paths == {"/metrics/"}  # never the full page
    names = parse_qs(urlsplit(fake_pods[0].paths[-1]).query)["name[]"]
    assert sorted(names) == sorted(SAMPLE_NAMES)
    assert rig.pod(0).ready and rig.pod(0).metrics.waiting == 0
    assert full_page_pods(rig) == 0


def test_a_pod_without_the_filtered_page_is_scraped_by_its_full_page(
    fake_pods: list[FakePod], scraper_mode: str
) -> None:
    fake_pods[0].filters = False
    rig = Rig(fake_pods, mode=scraper_mode)
    rig.scraper.start()
    try:
        wait_until(lambda: bool(rig.snapshot) and rig.pod(0).metrics.waiting == 1)
        asked = fake_pods[0].num_requests
        wait_until(lambda: fake_pods[0].num_requests >= asked + 3)
        # one refused filtered page, then the full page only, and no error counted
        assert [urlsplit(p).path for p in fake_pods[0].paths].count("/metrics/") == 1
        assert fake_pods[0].paths[-1] == "/metrics"
        assert rig.errors(0, "http_status") == 0 and rig.pod(0).ready
        assert {urlsplit(p).path for p in fake_pods[1].paths} == {"/metrics/"}
        assert full_page_pods(rig) == 1
        rig.store.set_pods(rig.pods[1:])
        wait_until(lambda: full_page_pods(rig) == 0)
    finally:
        rig.scraper.stop()


def test_a_page_without_our_series_is_an_error_and_the_filter_stays(
    rig: Rig, fake_pods: list[FakePod]
) -> None:
    wait_until(lambda: rig.pod(0).ready)
    fake_pods[0].page = "# nothing of ours\nsome_other_metric 1\n"
    wait_until(lambda: rig.errors(0, "no_metrics") >= 2)
    assert full_page_pods(rig) == 0  # the full page failed too: no reason to give up the filter
    assert urlsplit(fake_pods[0].paths[-1]).path in {"/metrics/", "/metrics"}
    # Switched where a scrape starts: one that read the empty filtered page and then found
    # our series on the full page would rightly keep to the full page.
    fake_pods[0].page_at_next_scrape(make_vllm_page([EngineState(waiting=5)]))
    wait_until(lambda: rig.pod(0).metrics.waiting == 5)
    wait_until(
        lambda: [urlsplit(p).path for p in fake_pods[0].paths[-2:]] == ["/metrics/"] * 2,
        what="the filtered page is not asked again",
    )
    assert full_page_pods(rig) == 0


def test_kv_capacity_from_a_real_vllm_page(rig: Rig, fake_pods: list[FakePod]) -> None:
    wait_until(lambda: rig.pod(0).metrics.waiting == 1)
    assert rig.pod(0).metrics.kv_capacity_tokens is None  # the made-up page has no info
    fake_pods[0].page = REAL_VLLM_PAGE.read_text()
    wait_until(lambda: rig.pod(0).metrics.kv_capacity_tokens == 65536 * 32)
    assert rig.pod(0).ready and rig.pod(0).metrics.waiting == 0


def test_latency_from_histogram_deltas(rig: Rig, fake_pods: list[FakePod]) -> None:
    wait_until(lambda: rig.pod(0).metrics.waiting == 1)
    fake_pods[0].page = make_vllm_page(
        [EngineState(waiting=1, ttft_sum_s=0.6, ttft_count=3, itl_sum_s=0.5, itl_count=10)]
    )
    wait_until(lambda: rig.pod(0).metrics.ttft_s is not None)
    assert rig.pod(0).metrics.ttft_s == pytest.approx(0.2)
    assert rig.pod(0).metrics.itl_s == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        pytest.param("error", "http_status", id="http-500"),
        pytest.param("garbage", "no_metrics", id="garbage"),
        pytest.param("malformed", "parse", id="malformed"),
        pytest.param("slow", "timeout", id="slow"),
    ],
)
def test_failing_pod_keeps_metrics_until_stale_then_returns(
    rig: Rig, fake_pods: list[FakePod], mode: str, reason: str
) -> None:
    wait_until(lambda: rig.pod(0).metrics.waiting == 1 and rig.pod(0).ready)
    switched_at = time.monotonic()
    fake_pods[0].mode = mode  # type: ignore[assignment]
    wait_until(lambda: rig.errors(0, reason) >= 1)
    wait_until(lambda: not rig.pod(0).ready)
    # stale: out once the last success (at most one interval before the switch) is old
    assert time.monotonic() - switched_at >= STALE_S - 0.05
    assert rig.pod(0).metrics.waiting == 1  # the last metrics are kept
    assert rig.pod(1).ready
    fake_pods[0].mode = "ok"
    wait_until(lambda: rig.pod(0).ready)


def test_unreachable_pod_leaves_at_once_and_returns(rig: Rig, fake_pods: list[FakePod]) -> None:
    wait_until(lambda: rig.pod(0).ready and rig.pod(0).metrics.waiting == 1)
    fake_pods[0].down()
    wait_until(lambda: not rig.pod(0).ready)
    # out on the first refused connection, not after --stale-after-s of failed scrapes
    # (15 at this interval)
    first_out = next(errors for ready, errors in rig.history if not ready)
    assert first_out <= 1
    assert rig.errors(0, "connect") >= 1 and rig.pod(1).ready
    fake_pods[0].up()
    wait_until(lambda: rig.pod(0).ready)


def test_removed_pod_is_no_longer_scraped_and_its_errors_are_dropped(
    rig: Rig, fake_pods: list[FakePod]
) -> None:
    fake_pods[0].mode = "error"
    wait_until(lambda: rig.errors(0, "http_status") >= 1)
    rig.store.set_pods(rig.pods[1:])
    sweeps = fake_pods[1].num_requests
    wait_until(lambda: fake_pods[1].num_requests >= sweeps + 2)  # a scrape under way has ended
    before, sweeps = fake_pods[0].num_requests, fake_pods[1].num_requests
    wait_until(lambda: fake_pods[1].num_requests >= sweeps + 3)  # three sweeps more
    assert fake_pods[0].num_requests == before
    assert rig.errors(0, "http_status") == 0


def test_discovery_unready_pods_are_not_scraped(
    fake_pods: list[FakePod], scraper_mode: str
) -> None:
    rig = Rig(fake_pods, mode=scraper_mode)
    rig.store.set_pods(
        [
            make_pod("idle", port=fake_pods[0].port, ready=False),
            make_pod("ready", port=fake_pods[1].port),
        ]
    )
    rig.scraper.start()
    try:
        wait_until(lambda: fake_pods[1].num_requests >= 3)  # three sweeps
    finally:
        rig.scraper.stop()
    assert fake_pods[0].num_requests == 0


def test_stop_ends_the_thread_promptly(fake_pods: list[FakePod]) -> None:
    rig = Rig(fake_pods, interval_s=60.0)  # a stop that waited out the interval: 60 s
    rig.scraper.start()
    wait_until(lambda: bool(rig.snapshot) and rig.pod(0).metrics.waiting == 1)
    started = time.monotonic()
    rig.scraper.stop()
    assert time.monotonic() - started < 20.0  # generous for a loaded machine
    assert isinstance(rig.scraper, MetricsScraper)
    assert rig.scraper._thread is not None and not rig.scraper._thread.is_alive()


def test_sweeps_are_spaced_out_to_stay_within_the_cpu_budget(
    fake_pods: list[FakePod], caplog: pytest.LogCaptureFixture, scraper_mode: str
) -> None:
    rig = Rig(fake_pods, cpu_budget=0.001, mode=scraper_mode)
    rig.scraper.start()
    try:
        wait_until(lambda: rig.sweep_interval_s() > 0.2)
        served, started = fake_pods[0].num_requests, time.monotonic()
        wait_until(lambda: fake_pods[0].num_requests >= served + SPACED_SWEEPS, timeout_s=30)
        took = time.monotonic() - started
    finally:
        rig.scraper.stop()
    # a sweep is ~1 ms of CPU: at 0.1% of a core, about one a second instead of 50; the
    # sweeps counted span at least SPACED_SWEEPS - 1 whole intervals (a lower bound a
    # loaded machine only lengthens; every 20 ms they would take 0.04 s)
    assert took >= (SPACED_SWEEPS - 1) * 0.2
    final = rig.sweep_interval_s()  # re-measured each sweep
    assert final > 0.2
    wait_until(lambda: rig.store.stale_after_s == max(STALE_S, 3 * rig.sweep_interval_s()))
    assert "scraping every" in caplog.text and "--scrape-cpu-budget" in caplog.text


def test_the_budget_follows_the_measured_cost_and_never_goes_below_the_interval() -> None:
    store = PodStore(lambda pods: None, stale_after_s=2.0)
    scraper = MetricsScraper(store, interval_s=0.2, cpu_budget=0.1, registry=CollectorRegistry())
    scraper._fit_budget(0.016 * 0.5e-3 / 0.0005, num_pods=16, scraped=16)  # 16 x 0.5 ms
    assert scraper.sweep_interval_s == 0.2 and store.stale_after_s == 2.0
    scraper._fit_budget(500 * 1e-3, num_pods=1000, scraped=500)  # 1,000 x 1 ms
    assert scraper.sweep_interval_s == pytest.approx(10.0)
    assert store.stale_after_s == pytest.approx(30.0)
    scraper._fit_budget(0.0, num_pods=1000, scraped=1000)  # pods got cheap again
    assert scraper.sweep_interval_s == 0.2 and store.stale_after_s == 2.0


def test_pods_due_every_spaced_sweep_spread_over_its_ticks() -> None:
    """1,000 pods read at once when new, then each on a tick of its own within the sweep
    interval (2.5 s, ticks of 0.2 s): no tick takes much more than its share."""
    schedule = _Schedule(slack_s=0.1)
    ids = [PodId("default", f"p{i}") for i in range(1000)]
    assert all(schedule.is_due(i, 0.0) for i in ids)
    for pod_id in ids:
        schedule.started(pod_id, 0.0, 2.5)
    per_tick = []
    for tick in range(1, 14):
        due = [i for i in ids if schedule.is_due(i, tick * 0.2)]
        for pod_id in due:
            schedule.started(pod_id, tick * 0.2, 2.5)
        per_tick.append(len(due))
    share = 1000 * 0.2 / 2.5  # 80 a tick; the first tick also takes its slack's 40
    steady = per_tick[1:12]
    assert max(steady) < 1.6 * share and min(steady) > 0.4 * share
    assert max(per_tick) < 2.2 * share  # never every pod on one tick
    assert sum(per_tick[:12]) >= 1000 * 2.3 / 2.5  # each pod once within its interval


def test_a_pod_due_every_tick_is_read_every_tick_however_late_the_ticks() -> None:
    schedule = _Schedule(slack_s=0.1)  # the scraper's: half a tick
    pod_id = PodId("default", "p0")
    late = [0.0, 0.03, 0.0, 0.09, 0.01, 0.0, 0.05]  # each tick's lateness
    reads = 0
    for tick, lateness in enumerate(late):
        now = tick * 0.2 + lateness
        if schedule.is_due(pod_id, now):
            schedule.started(pod_id, now, 0.2)
            reads += 1
    assert reads == len(late)
