"""ScrapeProcess's own duties: a dead child started again, its families on the page from
the start, the child ending with its parent, and no child left after ``stop()``.
(What it scrapes and publishes: tests/datalayer/test_scrape.py, in both modes.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.scrape import ScrapeOptions
from extproc.datalayer.scrape_process import ScrapeProcess, run_child
from extproc.datalayer.store import PodStore
from extproc.pods import Pod, PodId
from testkit.metrics_pages import EngineState, make_vllm_page
from testkit.waiting import wait_until
from tests.datalayer.fake_pod import FakePod

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SPAWN_S = 30.0  # a child's start and first report, on a loaded machine


@pytest.fixture
def fake() -> Iterator[FakePod]:
    pod = FakePod(make_vllm_page([EngineState(waiting=1, running=1)])).start()
    yield pod
    pod.stop()


class Published:
    def __init__(self) -> None:
        self.snapshot: tuple[Pod, ...] = ()

    def __call__(self, pods: tuple[Pod, ...]) -> None:
        self.snapshot = pods

    def waiting(self) -> int | None:
        return self.snapshot[0].metrics.waiting if self.snapshot else None


def started(fake: FakePod, registry: CollectorRegistry, published: Published) -> ScrapeProcess:
    store = PodStore(published, stale_after_s=2.0)
    store.set_pods([Pod(PodId("default", "p0"), fake.address, frozenset({MODEL}))])
    scraper = ScrapeProcess(
        store, ScrapeOptions(interval_s=0.02, timeout_s=0.5), registry=registry, restart_delay_s=0.1
    )
    scraper.start()
    return scraper


def test_the_scrape_families_are_on_the_page_before_the_first_report() -> None:
    registry = CollectorRegistry()
    store = PodStore(lambda pods: None, stale_after_s=2.0)
    ScrapeProcess(store, ScrapeOptions(interval_s=0.5), registry=registry)  # not started
    names = {family.name for family in registry.collect()}
    assert {
        "extproc_scrape_errors",
        "extproc_scrape_duration_seconds",
        "extproc_scrape_interval_seconds",
        "extproc_scrape_full_page_pods",
        "extproc_models_scrape_errors",
        "extproc_scrape_process_restarts",
    } <= names
    assert registry.get_sample_value("extproc_scrape_interval_seconds") == 0.5
    assert registry.get_sample_value("extproc_scrape_process_restarts_total") == 0


def test_a_killed_child_is_started_again_and_counted(
    fake: FakePod, caplog: pytest.LogCaptureFixture
) -> None:
    registry, published = CollectorRegistry(), Published()
    scraper = started(fake, registry, published)
    try:
        wait_until(lambda: published.waiting() == 1, timeout_s=SPAWN_S)
        first = scraper.pid
        assert first is not None and first != os.getpid()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: registry.get_sample_value("extproc_scrape_process_restarts_total") == 1)
        wait_until(lambda: scraper.pid not in (None, first))
        fake.page = make_vllm_page([EngineState(waiting=7)])
        wait_until(lambda: published.waiting() == 7, timeout_s=SPAWN_S)  # the new child reports
        assert "the scraper process ended (exit code -9)" in caplog.text
    finally:
        scraper.stop()


def test_stop_leaves_no_child(fake: FakePod) -> None:
    registry, published = CollectorRegistry(), Published()
    scraper = started(fake, registry, published)
    wait_until(lambda: published.waiting() == 1, timeout_s=SPAWN_S)
    child = scraper._process
    scraper.stop()
    assert child is not None and not child.is_alive() and child.exitcode == 0
    assert registry.get_sample_value("extproc_scrape_process_restarts_total") == 0


def test_the_child_ends_when_its_parent_is_gone(fake: FakePod) -> None:
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    pods = (Pod(PodId("default", "p0"), fake.address, frozenset({MODEL})),)
    child = context.Process(
        target=run_child, args=(child_end, ScrapeOptions(interval_s=0.02), pods, 2.0, 30)
    )
    child.start()
    child_end.close()
    try:
        assert parent_end.poll(30.0)  # it scrapes and reports
        kind, _ = parent_end.recv()
        assert kind == "tick"
        parent_end.close()  # as when extproc is killed
        child.join(20.0)
        assert not child.is_alive() and child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_pods_go_stale_while_no_child_reports(fake: FakePod, stop_signal: signal.Signals) -> None:
    """Killed (restarted only after 3 s) or hung, the child sends nothing: the pod still
    goes stale on time, and is ready again once a child reports."""
    published = Published()
    store = PodStore(published, stale_after_s=0.3)
    store.set_pods([Pod(PodId("default", "p0"), fake.address, frozenset({MODEL}))])
    scraper = ScrapeProcess(
        store,
        ScrapeOptions(interval_s=0.02, timeout_s=0.5),
        registry=CollectorRegistry(),
        restart_delay_s=3.0,
    )
    scraper.start()
    try:
        wait_until(
            lambda: published.waiting() == 1 and published.snapshot[0].ready, timeout_s=SPAWN_S
        )
        child = scraper.pid
        assert child is not None
        os.kill(child, stop_signal)
        stopped = time.monotonic()
        wait_until(lambda: not published.snapshot[0].ready, timeout_s=2.9)
        assert time.monotonic() - stopped >= 0.25  # stale, not dropped at once
        if stop_signal == signal.SIGSTOP:
            os.kill(child, signal.SIGCONT)
        wait_until(lambda: published.snapshot[0].ready, timeout_s=SPAWN_S)
    finally:
        scraper.stop()


def test_a_hung_child_is_ended_and_started_again(
    fake: FakePod, caplog: pytest.LogCaptureFixture
) -> None:
    registry, published = CollectorRegistry(), Published()
    store = PodStore(published, stale_after_s=2.0)
    store.set_pods([Pod(PodId("default", "p0"), fake.address, frozenset({MODEL}))])
    scraper = ScrapeProcess(
        store,
        ScrapeOptions(interval_s=0.02, timeout_s=0.5),
        registry=registry,
        restart_delay_s=0.1,
        hung_after_s=1.0,
    )
    scraper.start()
    try:
        wait_until(lambda: published.waiting() == 1, timeout_s=SPAWN_S)
        hung = scraper.pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)
        wait_until(lambda: scraper.pid != hung, timeout_s=SPAWN_S)
        restarts = registry.get_sample_value("extproc_scrape_process_restarts_total")
        assert restarts is not None and restarts >= 1  # more if a loaded machine stalled one
        assert "the scraper process sent nothing for" in caplog.text
        fake.page = make_vllm_page([EngineState(waiting=4)])
        wait_until(lambda: published.waiting() == 4, timeout_s=SPAWN_S)  # a new child reports
    finally:
        scraper.stop()
