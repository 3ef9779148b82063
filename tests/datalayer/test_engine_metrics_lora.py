"""``vllm:lora_requests_info`` -> ``PodMetrics.lora``: the current series among the old
ones vLLM keeps, its adapter lists, and a malformed ``max_lora`` read as no metric."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from extproc.datalayer.engine_metrics import SAMPLE_NAMES, PageParser, PodReader, select_lines
from extproc.pods import LoraSlots, PodMetrics
from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.lora import LoraRequest
from extproc.sim.metrics import PodMetrics as SimPodMetrics
from testkit.factories import make_sim_request, seq
from testkit.metrics_pages import REAL_VLLM_PAGE

HEAD = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    "# TYPE vllm:lora_requests_info gauge\n"
)
# the page's load series carry model_name: the LoRA series (no model_name) must count too
LOAD = 'vllm:num_requests_waiting{engine="0",model_name="base"} 2.0\n'


def lora_line(running: str, waiting: str, when: float, max_lora: str = "4") -> str:
    labels = f'max_lora="{max_lora}",running_lora_adapters="{running}",'
    return f'vllm:lora_requests_info{{{labels}waiting_lora_adapters="{waiting}"}} {when}\n'


def read(page: str, reader: PodReader | None = None) -> PodMetrics:
    reader = reader or PodReader(frozenset({"base"}), pod="ns/p")
    metrics = reader.read(PageParser().samples(page.encode()), now_s=0.0)
    assert metrics is not None
    return metrics


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        pytest.param("", None, id="no-metric"),
        pytest.param(
            lora_line("sql", "chat", 1.7e9),
            LoraSlots(frozenset({"sql"}), frozenset({"chat"}), 4),
            id="one-series",
        ),
        pytest.param(
            lora_line("a,b", "", 1.7e9 + 5)
            + lora_line("c", "d", 1.7e9 + 9, max_lora="2")
            + lora_line("e", "", 1.7e9 + 1),
            LoraSlots(frozenset({"c"}), frozenset({"d"}), 2),
            id="several-series-latest-wins",
        ),
        pytest.param(
            lora_line(" a , b,,", ", c", 1.7e9),
            LoraSlots(frozenset({"a", "b"}), frozenset({"c"}), 4),
            id="names-stripped-empties-dropped",
        ),
        pytest.param(
            lora_line("", "", 1.7e9, max_lora="8"),
            LoraSlots(frozenset(), frozenset(), 8),
            id="empty-lists",
        ),
        pytest.param(
            lora_line("a", "", 1.7e9) + lora_line("", "", 1.7e9 + 30),
            LoraSlots(frozenset({"a"}), frozenset(), 4),
            id="idle-keeps-the-last-adapters-seen",
        ),
        pytest.param(
            lora_line("a", "", 1.7e9, max_lora="0"),
            LoraSlots(frozenset({"a"}), frozenset(), 0),
            id="zero-slots",
        ),
        pytest.param(
            lora_line("a", "", float("nan")) + lora_line("b", "", 1.0),
            LoraSlots(frozenset({"b"}), frozenset(), 4),
            id="nan-value-is-oldest",
        ),
    ],
)
def test_lora_slots(series: str, expected: LoraSlots | None) -> None:
    assert read(LOAD + (HEAD + series if series else "")).lora == expected


@pytest.mark.parametrize("max_lora", ["", "four", "-1", "2.5"])
def test_a_malformed_max_lora_reads_as_no_metric_logged_once(
    max_lora: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = PodReader(frozenset({"base"}), pod="ns/p")
    page = LOAD + HEAD + lora_line("a", "", 1.7e9, max_lora=max_lora)
    with caplog.at_level(logging.WARNING, "extproc.datalayer.engine_metrics"):
        first, second = read(page, reader), read(page, reader)
    assert first.lora is second.lora is None
    assert first.waiting == 2  # the other quantities are read all the same
    message = f"ns/p: vllm:lora_requests_info has max_lora={max_lora!r}, not a count"
    assert [r.getMessage() for r in caplog.records] == [f"{message}; read as no LoRA metric"]


def test_a_missing_max_lora_reads_as_no_metric() -> None:
    page = LOAD + 'vllm:lora_requests_info{running_lora_adapters="a"} 1.0\n'
    assert read(page).lora is None


def test_only_the_current_series_max_lora_matters() -> None:
    """An old series with a broken label does not hide the current one."""
    page = LOAD + lora_line("a", "", 1.0, max_lora="x") + lora_line("b", "", 2.0)
    assert read(page).lora == LoraSlots(frozenset({"b"}), frozenset(), 4)


def test_the_real_vllm_page_without_lora_reads_none() -> None:
    """vLLM started without --enable-lora writes no series: no LoRA metric."""
    reader = PodReader(frozenset({"qwen3-tiny"}))
    metrics = reader.read(PageParser().samples(REAL_VLLM_PAGE.read_bytes()), now_s=0.0)
    assert metrics is not None and metrics.lora is None


def test_only_the_current_series_is_kept_for_parsing() -> None:
    """A long-lived vLLM lists a series per combination of adapters it ran: only the
    current one reaches prometheus_client's (slow) parser."""
    old = "".join(lora_line(f"a{i}", "", float(i)) for i in range(50))
    lines = select_lines((LOAD + old + lora_line("now", "", 99.0) + old).encode())
    assert lines == [LOAD.strip().encode(), lora_line("now", "", 99.0).strip().encode()]


def test_a_series_without_a_value_is_malformed() -> None:
    with pytest.raises(ValueError, match="no value"):
        PageParser().samples((LOAD + 'vllm:lora_requests_info{max_lora="1"}\n').encode())


def test_a_simulated_lora_pods_filtered_page() -> None:
    """The sim's page as the scraper asks for it: the adapter while its request runs,
    and still once the engine idles (its newest series names none)."""
    engine = Engine(EngineConfig(block_size=4, enable_lora=True, max_loras=2))
    sim, parser = SimPodMetrics(engine, "base"), PageParser()
    reader = PodReader(frozenset({"base"}))
    request = replace(make_sim_request(seq(1, 8), 4), lora=LoraRequest("sql", 1, "/sql"))
    engine.add_request(request, engine.clock)
    seen = []
    while engine.has_work():
        sim.observe(engine.step(engine.clock))
        metrics = reader.read(parser.samples(sim.render(sorted(SAMPLE_NAMES))), 0.0)
        assert metrics is not None
        seen.append(metrics.lora)
    assert engine.lora_request_states() == ()
    assert set(seen) == {LoraSlots(frozenset({"sql"}), frozenset({"sql"}), 2)}
