"""MetricsScraper reading each pod's /v1/models (its LoRA adapters) from real HTTP
servers on 127.0.0.1: adapters loaded and unloaded at run time, the last good list kept
on errors, the error series."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.adapters import parse_adapters
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.store import PodStore
from extproc.pods import LoraSlots, Pod, PodId
from extproc.sim.launch import spawn_sim_pods
from testkit.metrics_pages import EngineState, make_vllm_page
from testkit.waiting import wait_until
from tests.datalayer.fake_pod import FakePod, models_list

BASE = "meta-llama/Llama-3.1-8B-Instruct"
SQL = models_list((BASE, None), ("sql", BASE), ("other-base-lora", "another-model"))


class Rig:
    def __init__(self, fakes: list[FakePod], models_interval_s: float = 0.05) -> None:
        self.fakes = fakes
        self.registry = CollectorRegistry()
        self.snapshot: tuple[Pod, ...] = ()
        self.store = PodStore(self._published, stale_after_s=0.5)
        self.pods = [
            Pod(PodId("default", f"p{i}"), fake.address, frozenset({BASE}))
            for i, fake in enumerate(fakes)
        ]
        self.store.set_pods(self.pods)
        self.scraper = MetricsScraper(
            self.store,
            interval_s=0.02,
            timeout_s=0.2,
            max_page_bytes=4096,
            registry=self.registry,
            models_interval_s=models_interval_s,
        )

    def _published(self, pods: tuple[Pod, ...]) -> None:
        self.snapshot = pods

    def adapters(self, idx: int) -> frozenset[str]:
        return self.snapshot[idx].adapters if self.snapshot else frozenset({"unpublished"})

    def errors(self, idx: int, reason: str) -> float:
        labels = {"pod": str(self.pods[idx].id), "reason": reason}
        value = self.registry.get_sample_value("extproc_models_scrape_errors_total", labels)
        return value or 0.0

    def models_reads(self, idx: int) -> int:
        return self.fakes[idx].paths.count("/v1/models")


@pytest.fixture
def fakes() -> Iterator[list[FakePod]]:
    pods = [FakePod(make_vllm_page([EngineState(waiting=1)])).start() for _ in range(2)]
    pods[0].models_page = SQL
    yield pods
    for pod in pods:
        pod.stop()


@pytest.fixture
def rig(fakes: list[FakePod]) -> Iterator[Rig]:
    rig = Rig(fakes)
    rig.scraper.start()
    yield rig
    rig.scraper.stop()


def test_adapters_of_the_pods_models_are_published(rig: Rig) -> None:
    wait_until(lambda: rig.adapters(0) == {"sql"})
    pod = rig.snapshot[0]
    assert pod.models == {BASE, "sql"} and pod.ready
    assert rig.adapters(1) == frozenset() and rig.snapshot[1].models == {BASE}


def test_adapters_loaded_and_unloaded_at_run_time(rig: Rig, fakes: list[FakePod]) -> None:
    wait_until(lambda: rig.adapters(0) == {"sql"})
    fakes[0].models_page = models_list((BASE, None), ("sql", BASE), ("chat", BASE))
    wait_until(lambda: rig.adapters(0) == {"sql", "chat"})
    fakes[0].models_page = models_list((BASE, None), ("chat", BASE))
    wait_until(lambda: rig.adapters(0) == {"chat"})
    assert rig.snapshot[0].models == {BASE, "chat"}


@pytest.mark.parametrize(
    ("page", "status", "reason"),
    [
        pytest.param(SQL, 500, "http_status", id="http-500"),
        pytest.param("<html>hello</html>", 200, "parse", id="not-json"),
        pytest.param('{"data": [{"parent": "x"}]}', 200, "parse", id="no-id"),
        pytest.param('{"object": "list"}', 200, "parse", id="no-data"),
        pytest.param(models_list(*[(f"a{i}", BASE) for i in range(60)]), 200, "too_large"),
    ],
)
def test_a_failed_read_keeps_the_last_good_list_and_is_counted(
    rig: Rig, fakes: list[FakePod], page: str, status: int, reason: str
) -> None:
    wait_until(lambda: rig.adapters(0) == {"sql"})
    fakes[0].models_page, fakes[0].models_status = page, status
    wait_until(lambda: rig.errors(0, reason) >= 2)
    assert rig.adapters(0) == {"sql"} and rig.snapshot[0].ready
    fakes[0].models_page, fakes[0].models_status = models_list((BASE, None)), 200
    wait_until(lambda: rig.adapters(0) == frozenset())


def test_an_unreachable_pod_is_read_again_as_soon_as_it_is_back(
    fakes: list[FakePod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted vLLM has lost the adapters loaded at run time: its next read does not
    wait out the interval (60 s here, the second read put at its end)."""
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    rig = Rig(fakes, models_interval_s=60.0)
    rig.scraper.start()
    try:
        wait_until(lambda: rig.adapters(0) == {"sql"})
        fakes[0].down()
        wait_until(lambda: not rig.snapshot[0].ready)
        fakes[0].models_page = models_list((BASE, None))
        fakes[0].up()
        wait_until(lambda: rig.adapters(0) == frozenset() and rig.snapshot[0].ready)
        reads = rig.models_reads(0)
        wait_until(lambda: fakes[1].num_requests >= 5)  # a few sweeps: no read due
        assert rig.models_reads(0) == reads
    finally:
        rig.scraper.stop()


def test_a_pod_whose_models_change_is_read_again_at_once(
    fakes: list[FakePod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapters are those whose parent is one of the pod's models: new models, a
    new read (the interval is 60 s here, the second read put at its end)."""
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    rig = Rig(fakes, models_interval_s=60.0)
    rig.store.set_pods([replace(rig.pods[0], models=frozenset({"another-model"}))])
    rig.scraper.start()
    try:
        wait_until(lambda: rig.adapters(0) == {"other-base-lora"})
        rig.store.set_pods(rig.pods[:1])
        wait_until(lambda: rig.adapters(0) == {"sql"})
    finally:
        rig.scraper.stop()


def test_the_error_series_of_a_removed_pod_are_dropped(rig: Rig, fakes: list[FakePod]) -> None:
    fakes[0].models_status = 500
    wait_until(lambda: rig.errors(0, "http_status") >= 1)
    rig.store.set_pods(rig.pods[1:])
    wait_until(lambda: rig.errors(0, "http_status") == 0)


def test_models_interval_0_reads_no_models_page(fakes: list[FakePod]) -> None:
    rig = Rig(fakes, models_interval_s=0.0)
    rig.scraper.start()
    try:
        wait_until(lambda: fakes[0].num_requests >= 3 and bool(rig.snapshot))
    finally:
        rig.scraper.stop()
    assert rig.models_reads(0) == 0 and rig.adapters(0) == frozenset()


def test_a_negative_models_interval_is_refused() -> None:
    store = PodStore(lambda pods: None)
    with pytest.raises(ValueError, match="models_interval_s must be >= 0, got -1"):
        MetricsScraper(store, models_interval_s=-1.0, registry=CollectorRegistry())


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        pytest.param(SQL, {"sql"}, id="adapters-of-the-pods-models"),
        pytest.param(models_list((BASE, None)), set(), id="base-only"),
        pytest.param(models_list(("", BASE)), set(), id="empty-id-dropped"),
        pytest.param('{"data": [], "object": "list", "extra": [1]}', set(), id="empty"),
    ],
)
def test_parse_adapters(page: str, expected: set[str]) -> None:
    assert parse_adapters(page.encode(), frozenset({BASE})) == expected


@pytest.mark.parametrize(
    "page",
    ["", "[]", '{"data": {}}', '{"data": [{"id": 3}]}', '{"data": [{"id": "a", "parent": 1}]}'],
)
def test_parse_adapters_refuses_what_is_no_model_list(page: str) -> None:
    with pytest.raises(ValueError):
        parse_adapters(page.encode(), frozenset({BASE}))


def test_simulated_pods_adapters_loaded_and_unloaded_at_run_time() -> None:
    """The sim's vLLM endpoints: an adapter from --lora-modules, one loaded by
    /v1/load_lora_adapter and then unloaded, and the pod's LoRA slots once a request
    for an adapter ran."""
    args = ["--enable-lora", "--max-loras", "2", "--lora-modules", "sql=/adapters/sql"]
    with spawn_sim_pods(1, args=args) as sim:
        (base,) = [
            replace(p, models=frozenset({sim.model}), adapters=frozenset()) for p in sim.as_pods()
        ]
        published: list[tuple[Pod, ...]] = []
        store = PodStore(published.append, stale_after_s=2.0)
        store.set_pods([base])
        scraper = MetricsScraper(
            store, interval_s=0.05, registry=CollectorRegistry(), models_interval_s=0.05
        )
        scraper.start()
        try:
            wait_until(lambda: published[-1][0].adapters == {"sql"}, timeout_s=10.0)
            assert published[-1][0].metrics.lora is None  # no step yet: no series
            body = {"model": "sql", "prompt": "hello", "max_tokens": 2}
            httpx.post(
                f"{sim.pods[0].url}/v1/completions", json=body, timeout=10
            ).raise_for_status()
            sql = frozenset({"sql"})
            wait_until(lambda: published[-1][0].metrics.lora == LoraSlots(sql, sql, 2))
            sim.load_lora_adapter(0, "chat", "/adapters/chat")
            wait_until(lambda: published[-1][0].adapters == {"sql", "chat"})
            assert published[-1][0].models == {sim.model, "sql", "chat"}
            sim.unload_lora_adapter(0, "sql")
            wait_until(lambda: published[-1][0].adapters == {"chat"})
        finally:
            scraper.stop()
