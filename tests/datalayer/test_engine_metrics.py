"""Reading /metrics pages: vLLM and SGLang names, label sets, models, latency windows,
the KV capacity from ``vllm:cache_config_info``.

``testkit/pages/vllm-0.32.0-cpu.txt`` is a real page: vLLM 0.32.0 (CPU), started as
``e2e/real_vllm/pods.py`` starts a pod (1 GiB of KV cache, blocks of 32 tokens), after
two completions.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer.engine_metrics import (
    SAMPLE_NAMES,
    CounterSince,
    HistogramTotals,
    LatencyWindow,
    PageParser,
    PodReader,
    Sample,
    select_lines,
)
from extproc.pods import PodMetrics
from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.metrics import PodMetrics as SimPodMetrics
from testkit.factories import make_sim_request, seq
from testkit.metrics_pages import (
    REAL_VLLM_PAGE,
    EngineState,
    make_sglang_page,
    make_vllm_page,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def counted(metrics: PodMetrics) -> PodMetrics:
    """A vLLM page's metrics on its first scrape: no prefix-cache tokens counted yet."""
    return replace(metrics, prefix_cache_hits=0.0, prefix_cache_queries=0.0)


def read(page: str, models: frozenset[str] = frozenset({MODEL})) -> PodMetrics | None:
    return PodReader(models).read(PageParser().samples(page.encode()), now_s=0.0)


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        pytest.param(
            make_vllm_page([EngineState(waiting=3, running=4, kv_usage=0.5)]),
            counted(PodMetrics(waiting=3, running=4, kv_usage=0.5)),
            id="vllm-one-engine",
        ),
        pytest.param(
            make_vllm_page(
                [EngineState(waiting=3, running=4, kv_usage=0.5), EngineState(1, 2, 0.25)]
            ),
            counted(PodMetrics(waiting=4, running=6, kv_usage=0.375)),
            id="vllm-engines-summed-usage-averaged",
        ),
        pytest.param(
            make_vllm_page([EngineState(2, 1, 0.75)], legacy_names=True),
            counted(PodMetrics(waiting=2, running=1, kv_usage=0.75)),
            id="vllm-legacy-gpu-cache-name",
        ),
        pytest.param(
            make_sglang_page(waiting=5, running=7, token_usage=0.9, model=MODEL),
            PodMetrics(waiting=5, running=7, kv_usage=0.9),
            id="sglang",
        ),
    ],
)
def test_first_scrape_reads_gauges_without_latency(page: str, expected: PodMetrics) -> None:
    assert read(page) == expected


def test_only_the_pods_model_counts_when_labels_name_it() -> None:
    ours = make_vllm_page([EngineState(waiting=3)], model="a")
    other = make_vllm_page([EngineState(waiting=100)], model="b")
    assert read(ours + other, frozenset({"a"})) == counted(PodMetrics(waiting=3))
    assert read(ours + other, frozenset({"a", "b"})) == counted(PodMetrics(waiting=103))


def test_all_label_sets_count_when_none_names_the_pods_model() -> None:
    page = make_vllm_page([EngineState(waiting=3)], model="served-name")
    assert read(page, frozenset({"configured-name"})) == counted(PodMetrics(waiting=3))


def test_series_text_is_parsed_by_prometheus_client_escapes_included() -> None:
    model = 'we"ird}\\name'
    page = make_vllm_page([EngineState(waiting=6)], model=model)
    assert read(page, frozenset({model})) == counted(PodMetrics(waiting=6))


def test_selected_samples_equal_the_full_parse() -> None:
    """The fast path returns exactly what the full prometheus_client parse has."""
    page = make_vllm_page([EngineState(3, 4, 0.5, 1.5, 10, 2.0, 100), EngineState(1, 2, 0.1)])
    # per engine: 3 gauges, 2 x (sum, count), 2 prefix-cache counters
    assert len(assert_fast_parse_is_full_parse(page)) == 18


def test_real_vllm_page_fast_parse_is_the_full_parse() -> None:
    names = {s.name for s in assert_fast_parse_is_full_parse(REAL_VLLM_PAGE.read_text())}
    assert "vllm:cache_config_info" in names


def assert_fast_parse_is_full_parse(page: str) -> list[Sample]:
    parser = PageParser()
    fast = parser.samples(page.encode())
    again = parser.samples(page.encode())  # from the series cache
    wanted = {s.name for s in fast}
    full = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in wanted
    ]
    assert [(s.name, dict(s.labels), s.value) for s in fast] == full
    assert again == fast
    return fast


def test_real_vllm_page_reads_load_and_kv_capacity() -> None:
    page = REAL_VLLM_PAGE.read_text()
    (info,) = [
        s
        for family in text_string_to_metric_families(page)
        if family.name == "vllm:cache_config_info"
        for s in family.samples
    ]
    expected = counted(PodMetrics(kv_capacity_tokens=65536 * 32))
    assert read(page, frozenset({"qwen3-tiny"})) == expected
    # vLLM 0.32 also writes the product itself, as kv_cache_size_tokens
    assert int(info.labels["kv_cache_size_tokens"]) == expected.kv_capacity_tokens


def cache_info(engine: str, blocks: str | None, block_size: str | None) -> str:
    labels = {"block_size": block_size, "engine": engine, "num_gpu_blocks": blocks}
    text = ",".join(f'{k}="{v}"' for k, v in labels.items() if v is not None)
    return f"vllm:cache_config_info{{{text}}} 1.0\n"


@pytest.mark.parametrize(
    ("info_lines", "expected"),
    [
        pytest.param([cache_info("0", "1000", "16")], 16_000, id="one-engine"),
        pytest.param(
            [cache_info("0", "1000", "16"), cache_info("1", "500", "32")],
            32_000,
            id="data-parallel-engines-summed",
        ),
        pytest.param([cache_info("0", "None", "16")], None, id="blocks-not-known-yet"),
        pytest.param(
            [cache_info("0", "None", "16"), cache_info("1", "500", "16")],
            8_000,
            id="only-engines-that-know-count",
        ),
        pytest.param([cache_info("0", "0", "16")], None, id="zero-blocks"),
        pytest.param([cache_info("0", "-4", "16")], None, id="negative-blocks"),
        pytest.param([cache_info("0", "1000", None)], None, id="no-block-size-label"),
        pytest.param([cache_info("0", None, "16")], None, id="no-blocks-label"),
        pytest.param([cache_info("0", "1000", "16.0")], None, id="not-an-integer"),
        pytest.param([], None, id="no-cache-config-info"),
    ],
)
def test_kv_capacity_is_blocks_times_block_size_over_engines(
    info_lines: list[str], expected: int | None
) -> None:
    """The waiting series names the pod's model, so the model filter is on: the info
    series, which names none, still counts."""
    page = 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n' + "".join(info_lines)
    assert read(page, frozenset({"m"})) == PodMetrics(waiting=2, kv_capacity_tokens=expected)


def test_select_lines_drops_buckets_comments_and_other_series() -> None:
    lines = select_lines(make_vllm_page([EngineState()]).encode())
    assert lines and all(not line.startswith(b"#") and b"_bucket" not in line for line in lines)
    assert not any(line.startswith(b"vllm:request_queue_time_seconds") for line in lines)


@pytest.mark.parametrize(
    "page",
    [
        pytest.param("<html>502 Bad Gateway</html>", id="html"),
        pytest.param("", id="empty"),
        pytest.param("# HELP x y\nx 1\n", id="other-series-only"),
    ],
)
def test_page_without_known_series_reads_none(page: str) -> None:
    assert read(page) is None


@pytest.mark.parametrize(
    "line",
    [
        pytest.param('vllm:num_requests_waiting{engine="0"}', id="no-value"),
        pytest.param('vllm:num_requests_waiting{engine="0"} many', id="bad-value"),
        pytest.param('vllm:num_requests_waiting{engine="0} 1', id="bad-labels"),
    ],
)
def test_malformed_wanted_line_raises_value_error(line: str) -> None:
    with pytest.raises(ValueError):
        PageParser().samples(line.encode() + b"\n")


def test_series_cache_is_bounded() -> None:
    parser = PageParser(max_cached_series=2)
    for i in range(5):
        parser.samples(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n'.encode())
        assert len(parser._series) <= 2


def test_recent_latency_is_the_delta_mean_between_scrapes() -> None:
    reader, parser = PodReader(frozenset({MODEL}), hold_s=5.0), PageParser()

    def scrape(now_s: float, *engines: EngineState) -> PodMetrics | None:
        return reader.read(parser.samples(make_vllm_page(engines).encode()), now_s)

    first = scrape(0.0, EngineState(ttft_sum_s=10.0, ttft_count=10, itl_sum_s=5.0, itl_count=50))
    assert first is not None and first.ttft_s is None and first.itl_s is None  # history ignored
    second = scrape(
        1.0,
        EngineState(ttft_sum_s=10.5, ttft_count=11, itl_sum_s=5.0, itl_count=50),
        EngineState(ttft_sum_s=0.3, ttft_count=1, itl_sum_s=0.2, itl_count=10),
    )
    assert second is not None
    assert second.ttft_s == pytest.approx(0.8 / 2)  # (0.5 + 0.3) over 2 new observations
    assert second.itl_s == pytest.approx(0.02)
    same = EngineState(ttft_sum_s=10.5, ttft_count=11, itl_sum_s=5.0, itl_count=50)
    held = scrape(4.0, same, EngineState(ttft_sum_s=0.3, ttft_count=1, itl_sum_s=0.2, itl_count=10))
    assert held is not None and held.ttft_s == pytest.approx(0.4)  # no news: held for 5 s
    gone = scrape(6.5, same, EngineState(ttft_sum_s=0.3, ttft_count=1, itl_sum_s=0.2, itl_count=10))
    assert gone is not None and gone.ttft_s is None and gone.itl_s is None


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([(1.0, 10), (3.0, 20)], 0.2, id="delta"),
        pytest.param([(1.0, 10), (1.0, 10)], None, id="no-new-observations"),
        pytest.param([(9.0, 90), (0.5, 2)], None, id="restart-is-a-new-baseline"),
        pytest.param([(9.0, 90), (0.5, 2), (1.5, 4)], 0.5, id="after-restart"),
        pytest.param([(1.0, 10), None, (3.0, 20)], None, id="series-vanished"),
    ],
)
def test_latency_window(totals: list[tuple[float, int] | None], expected: float | None) -> None:
    window = LatencyWindow(hold_s=0.0)
    result = None
    for now_s, t in enumerate(totals):
        result = window.update(None if t is None else HistogramTotals(*t), float(now_s))
    assert result == (None if expected is None else pytest.approx(expected))


def with_cache_counters(page: str, hits: float, queries: float) -> str:
    """The real page with its engine's prefix-cache counters set to these values."""
    series = '{engine="0",model_name="qwen3-tiny"}'
    for name, value in (("hits", hits), ("queries", queries)):
        line = f"vllm:prefix_cache_{name}_total{series} "
        (old,) = [x for x in page.splitlines() if x.startswith(line)]
        page = page.replace(old, f"{line}{value}")
    return page


def test_real_vllm_page_prefix_cache_counters_count_from_the_first_scrape() -> None:
    """The real page has hits 0 and queries 12: history before the first scrape is not
    counted, what the engine adds after is."""
    page, reader, parser = (
        REAL_VLLM_PAGE.read_text(),
        PodReader(frozenset({"qwen3-tiny"})),
        PageParser(),
    )
    first = reader.read(parser.samples(page.encode()), now_s=0.0)
    later = with_cache_counters(page, hits=40.0, queries=112.0)
    second = reader.read(parser.samples(later.encode()), now_s=1.0)
    assert first is not None and (first.prefix_cache_hits, first.prefix_cache_queries) == (0, 0)
    assert second is not None
    assert (second.prefix_cache_hits, second.prefix_cache_queries) == (40.0, 100.0)


def vllm_counters(engines: list[tuple[float, float]], prefix: str = "vllm:") -> str:
    lines = ['vllm:num_requests_waiting{engine="0",model_name="m"} 0.0']
    for engine, (hits, queries) in enumerate(engines):
        labels = f'{{engine="{engine}",model_name="m"}}'
        lines.append(f"{prefix}prefix_cache_hits_total{labels} {hits}")
        lines.append(f"{prefix}prefix_cache_queries_total{labels} {queries}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "prefix", [pytest.param("vllm:", id="vllm"), pytest.param("vllm:gpu_", id="older-vllm")]
)
def test_prefix_cache_counters_are_summed_over_engines(prefix: str) -> None:
    reader, parser = PodReader(frozenset({"m"})), PageParser()
    reader.read(parser.samples(vllm_counters([(1, 10), (2, 20)], prefix).encode()), 0.0)
    page = vllm_counters([(5, 30), (4, 25)], prefix)
    metrics = reader.read(parser.samples(page.encode()), 1.0)
    assert metrics is not None
    assert (metrics.prefix_cache_hits, metrics.prefix_cache_queries) == (6.0, 25.0)


def test_pages_without_prefix_cache_counters_read_none() -> None:
    metrics = read(make_sglang_page(waiting=1, model=MODEL))
    assert metrics is not None and metrics.prefix_cache_hits is None
    assert metrics.prefix_cache_queries is None


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([5.0, 8.0, 12.0], 7.0, id="increase-since-first"),
        pytest.param([50.0, 60.0, 4.0, 9.0], 19.0, id="restart-counts-from-zero"),
        pytest.param([5.0, None], None, id="absent"),
        pytest.param([5.0, None, 7.0], 2.0, id="absent-then-back"),
        pytest.param([5.0, float("nan"), 7.0], 2.0, id="nan-skipped"),
    ],
)
def test_counter_since(values: list[float | None], expected: float | None) -> None:
    counter, result = CounterSince(), None
    for value in values:
        result = counter.update(value)
    assert result == expected


def test_simulated_pods_filtered_page_carries_the_prefix_cache_counters() -> None:
    """The sim's ``/metrics/?name[]=`` page (what the scraper asks for) has the counters
    vLLM has, with the engine's values."""
    engine = Engine(EngineConfig(block_size=4))
    sim = SimPodMetrics(engine, "m")
    reader, parser = PodReader(frozenset({"m"})), PageParser()
    reader.read(parser.samples(sim.render(sorted(SAMPLE_NAMES))), 0.0)
    for i, prompt in enumerate((seq(1, 32), seq(1, 32))):
        engine.add_request(make_sim_request(prompt, 1, request_id=str(i)), engine.clock)
        while engine.stats().num_finished_requests <= i:
            engine.step(engine.clock)
    stats = engine.stats()
    metrics = reader.read(parser.samples(sim.render(sorted(SAMPLE_NAMES))), 1.0)
    assert stats.prefix_cache_hits > 0
    assert metrics is not None
    assert metrics.prefix_cache_hits == stats.prefix_cache_hits
    assert metrics.prefix_cache_queries == stats.prefix_cache_queries == 64
