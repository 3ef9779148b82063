"""bench.floor's table and bench.trivial_picker's fixed answers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry, start_http_server

from bench.floor import BARE, PRECISE, TRIVIAL, markdown, paired_ratios, precise_config, segments
from bench.picker_report import ENVOY, EXTPROC
from bench.trivial_picker import fixed_route, ignore_log
from bench.upstreams import MODEL
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.wire.access_log import AccessLogHandler
from extproc.wire.grpc_loop import Answer
from extproc.wire.one_round import RouteHandler, one_round_process
from extproc.wire.protocol import DESTINATION_KEY, DESTINATION_NAMESPACE
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler


def run(rps: float, p50: float, envoy_us: float, extproc_us: float | None = None) -> dict[str, Any]:
    loaded: dict[str, float] = {"rps": rps, "envoy_cpu_us_per_request": envoy_us}
    if extproc_us is not None:
        loaded["extproc_cpu_us_per_request"] = extproc_us
    return {"loaded": loaded, "low": {"p50_ms": p50}}


def test_the_table_gives_each_router_as_a_ratio_to_envoy_alone_at_its_prompt_size() -> None:
    rows = [
        {"prompt_kb": 8, "router": ENVOY, **run(4000, 0.5, 250)},
        {"prompt_kb": 8, "router": TRIVIAL, **run(2000, 1.2, 500, 180)},
        {"prompt_kb": 8, "router": EXTPROC, **run(1000, 2.0, 600, 600)},
    ]
    args = argparse.Namespace(pods=16, seconds=4, low_seconds=3, rounds=3)
    info = {"cpu_model": "cpu", "cores": 2, "git_sha": "abc"}
    lines = markdown(rows, args, info).splitlines()
    assert (
        "| 8 KB | envoy+trivial-picker | 2000 | 0.50 | 1.20 | +0.70 | 500 | 180 | 1.00 |" in lines
    )
    assert "| 8 KB | envoy+extproc | 1000 | 0.25 | 2.00 | +1.50 | 600 | 600 | 3.33 |" in lines
    assert "| 8 KB | envoy | 4000 | 1.00 | 0.50 | +0.00 | 250 |  |  |" in lines
    assert not any("Cold memo" in line for line in lines)


def test_the_cold_memo_rows_make_a_table_of_their_own_with_their_own_baselines() -> None:
    rows = [
        {"prompt_kb": 8, "router": ENVOY, **run(4000, 0.5, 250)},
        {"prompt_kb": 8, "router": TRIVIAL, **run(2000, 1.2, 500, 180)},
        {"prompt_kb": 8, "router": EXTPROC, **run(1000, 2.0, 600, 600)},
        {"prompt_kb": 8, "router": ENVOY, "memo": "cold", **run(5000, 0.4, 200)},
        {"prompt_kb": 8, "router": TRIVIAL, "memo": "cold", **run(2500, 1.0, 400, 200)},
        {"prompt_kb": 8, "router": EXTPROC, "memo": "cold", **run(500, 3.0, 700, 900)},
    ]
    args = argparse.Namespace(pods=16, seconds=4, low_seconds=3, rounds=3)
    info = {"cpu_model": "cpu", "cores": 2, "git_sha": "abc"}
    text = markdown(rows, args, info)
    warm, cold = text.split("## Cold memo")
    assert "| 8 KB | envoy+extproc | 1000 | 0.25 | 2.00 | +1.50 | 600 | 600 | 3.33 |" in warm
    assert "| 8 KB | envoy+extproc | 500 | 0.10 | 3.00 | +2.60 | 700 | 900 | 4.50 |" in cold
    assert "| 8 KB | envoy | 5000 | 1.00 | 0.40 | +0.00 | 200 |  |  |" in cold


def test_the_bare_variant_gives_the_defaults_cpu_as_a_ratio_to_it() -> None:
    rows = [
        {"prompt_kb": 8, "router": ENVOY, **run(4000, 0.5, 250)},
        {"prompt_kb": 8, "router": EXTPROC, **run(1000, 2.0, 600, 525)},
        {"prompt_kb": 8, "router": BARE, **run(1040, 1.9, 600, 500)},
    ]
    rows[2]["default_cpu_ratios"] = [1.2, 1.03, 0.98]
    args = argparse.Namespace(pods=16, seconds=4, low_seconds=3, rounds=3)
    info = {"cpu_model": "cpu", "cores": 2, "git_sha": "abc"}
    lines = markdown(rows, args, info).splitlines()
    assert "| 8 KB | 500 | 525 | 1.030 | 0.98, 1.03, 1.20 | 1040 | 1000 |" in lines


def test_the_rounds_ratios_pair_each_default_run_with_the_bare_one_after_it() -> None:
    default = [{"extproc_cpu_us_per_request": v} for v in (600.0, 700.0)]
    bare = [{"extproc_cpu_us_per_request": v} for v in (500.0, 700.0)]
    assert paired_ratios(default, bare) == [1.2, 1.0]


def test_the_trivial_picker_answers_the_first_pods_and_records_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pods = [make_pod(n) for n in "abcd"]
    router = Router(make_scheduler(PREFIX_ONLY), pods, registry=CollectorRegistry())
    message = ep.ProcessingRequest()
    message.request_body.body = b"not even json"
    monkeypatch.setattr(RouteHandler, "process_soon", fixed_route)
    stream = one_round_process(RouteHandler(router)).open()  # as the server calls it
    answer = stream.on_message(message)
    assert isinstance(answer, Answer) and answer.end
    (reply,) = answer.replies
    assert isinstance(reply, bytes)
    metadata = ep.ProcessingResponse.FromString(reply).dynamic_metadata
    destination = metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_KEY]
    assert destination.string_value == ",".join(p.address for p in pods[:3])
    # typed as any callable in complete's place, so the None it returns can be asserted
    complete: Callable[[AccessLogHandler, als_pb2.StreamAccessLogsMessage], object] = ignore_log
    assert complete(AccessLogHandler(router), als_pb2.StreamAccessLogsMessage()) is None
    assert len(router.pending) == 0


def test_the_precise_section_compares_each_memo_with_the_approximate_default() -> None:
    def row(router: str, memo: str, us: float, rps: float, **extra: object) -> dict[str, Any]:
        cell = run(rps, 1.0, 100, us)
        return {"prompt_kb": 8, "router": router, "memo": memo, **cell, **extra}

    rows = [
        {"prompt_kb": 8, "router": ENVOY, **run(4000, 0.5, 250)},
        row(EXTPROC, "warm", 600, 1000),
        row(PRECISE, "warm", 900, 800, memo_hit_ratio=1.0),
        row(EXTPROC, "cold", 650, 950),
        row(PRECISE, "cold", 6500, 90, memo_hit_ratio=0.5),
    ]
    args = argparse.Namespace(pods=16, seconds=4, low_seconds=3, rounds=3)
    info = {"cpu_model": "cpu", "cores": 2, "git_sha": "abc"}
    lines = markdown(rows, args, info).splitlines()
    assert "| 8 KB | warm | 600 | 900 | 1.50 | 1000 | 800 | 1.00, 1.00 | 100% |" in lines
    assert "| 8 KB | cold | 650 | 6500 | 10.00 | 950 | 90 | 1.00, 1.00 | 50% |" in lines
    assert sum(line.startswith("| 8 KB | envoy+extproc |") for line in lines) == 1  # warm only


@needs_model_tokenizer
def test_the_precise_variant_serves_the_pods_model_and_its_memo_is_read(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    text = precise_config(MODEL_DIR, tmp_path).read_text()
    scheduler = build_scheduler(parse_config(text, "precise.yaml"), registry)
    plugin = next(p for p in scheduler.preparers if isinstance(p, PrecisePrefixCache))
    assert set(plugin.tokenizers) == {MODEL}
    plugin.tokenizers[MODEL].tokens("a<|im_end|>b<|im_end|>a")
    server, _ = start_http_server(0, "127.0.0.1", registry)
    try:
        assert segments(server.server_port) == (1, 2)
    finally:
        server.shutdown()
        server.server_close()
