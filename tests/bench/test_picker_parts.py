"""The proxy benchmark's pure parts: wrk's report, py-spy's stacks, the workload, the pods."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bench.loadgen import ID_MARK, chat_body, parse_wrk
from bench.picker_report import ENVOY, EXTPROC, markdown, medians, ratios, scaling_table
from bench.pyspy import top_entries
from bench.upstreams import PROBES, free_ports, upstream_config

WRK_REPORT = """\
Running 2s test @ http://127.0.0.1:40000
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    16.21ms    6.02ms  60.11ms   80.00%
    Req/Sec   496.50     40.11   580.00     75.00%
  Latency Distribution
     50%   15.51ms
     75%   18.00ms
     90%   22.00ms
     99%  980.00us
  1997 requests in 2.01s, 1.01MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:    991.85
Transfer/sec:    514.00KB
"""


def test_parse_wrk_reads_rate_latency_and_failures() -> None:
    assert parse_wrk(WRK_REPORT) == {
        "rps": 991.85, "requests": 1997, "non_2xx": 4, "socket_errors": 3,
        "p50_ms": 15.51, "p99_ms": 0.98,
    }  # fmt: skip


def test_parse_wrk_rejects_a_report_without_latency() -> None:
    with pytest.raises(RuntimeError, match="unexpected wrk output"):
        parse_wrk("Requests/sec: 1.0\n1 requests in 1s\n")


def test_top_entries_counts_self_at_the_leaf_and_total_once_per_sample() -> None:
    collapsed = "main (a.py);f (a.py);f (a.py);g (b.py) 3\nmain (a.py);f (a.py) 1\n"
    num_samples, entries = top_entries(collapsed)
    assert num_samples == 4
    by_frame = {e.frame: (e.self_pct, e.total_pct) for e in entries}
    assert by_frame == {"g (b.py)": (75.0, 75.0), "f (a.py)": (25.0, 100.0)}


@pytest.mark.parametrize(
    "prompt_bytes", [pytest.param(n, id=f"{n}B") for n in (1024, 8192, 225280)]
)
def test_chat_body_opens_the_prompt_with_the_tenant_mark(prompt_bytes: int) -> None:
    body = chat_body(prompt_bytes)
    system = orjson.loads(body)["messages"][0]["content"]
    assert system.startswith(f"Tenant {ID_MARK}. ")
    assert abs(len(body) - prompt_bytes) < 300


def test_medians_sum_the_failures() -> None:
    runs = [{"rps": 1.0, "non_2xx": 1, "socket_errors": 0},
            {"rps": 3.0, "non_2xx": 2, "socket_errors": 1}]  # fmt: skip
    assert medians(runs) == {"rps": 2.0, "non_2xx": 3, "socket_errors": 1}


def test_upstreams_have_one_listener_per_distinct_port_with_every_probe() -> None:
    ports = free_ports(200)
    assert len(set(ports)) == 200
    listeners = upstream_config(ports, admin_port=1)["static_resources"]["listeners"]
    assert [lst["address"]["socket_address"]["port_value"] for lst in listeners] == ports
    hcm = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["match"]["prefix"] for r in routes] == [path for path, _ in PROBES] + ["/"]


def test_markdown_renders_every_router_of_a_cell_and_the_added_latency() -> None:
    def run(rps: float, p50: float, **cpu: float) -> dict[str, float]:
        return {"rps": rps, "requests": rps, "non_2xx": 0, "socket_errors": 0,
                "p50_ms": p50, "p99_ms": 2 * p50, **cpu}  # fmt: skip

    runs = {
        ENVOY: {"loaded": [run(1000, 1.0, envoy_cpu_us_per_request=200)],
                "low": [run(900, 0.5, envoy_cpu_us_per_request=250)]},
        EXTPROC: {"loaded": [run(250, 4.0, extproc_cpu_us_per_request=900)],
                  "low": [run(400, 0.9, extproc_cpu_us_per_request=950)]},
    }  # fmt: skip
    summary = {name: {k: medians(v) for k, v in by.items()} for name, by in runs.items()}
    cell: dict[str, Any] = {"prompt_kb": 8, "pods": 16, "num_prefixes": 32, "pods_with_entries": 16,
            "warm_requests": {EXTPROC: 40}, "idle_cpu_pct": {"envoy+extproc/extproc": 2.0},
            "runs": runs, "summary": summary, "ratios": ratios(summary)}  # fmt: skip
    result = {
        "machine": {"cpu_model": "cpu", "cores": 2, "load_average": [0.1, 0, 0],
                    "git_sha": "0" * 40, "envoy_version": "x/1.40.0/Clean",
                    "sglang_router": "sglang-router==0.3.2"},
        "config": {"threads": 2, "connections": 16, "seconds": 5, "low_seconds": 3,
                   "rounds": 1, "prefixes_per_pod": 2},
        "elapsed_s": 10.0, "cells": [cell],
    }  # fmt: skip
    text = markdown(result)
    assert "| 8 KB | 16 | envoy+extproc | 250 | 250-250 | 0.25 |" in text
    assert "| 8 KB | 16 | 0.500 | 0.900 | +0.400 | yes |" in text
    assert ratios(summary)[f"{EXTPROC} throughput vs envoy"] == 0.25


def test_scaling_table_sets_the_most_pods_against_the_fewest_gross_and_net_of_idle() -> None:
    def cell(pods: int, p99: float, cpu: float, net: float) -> dict[str, Any]:
        loaded = {"p99_ms": p99, "extproc_cpu_us_per_request": cpu,
                  "extproc_net_us_per_request": net}  # fmt: skip
        return {"prompt_kb": 8, "pods": pods, "summary": {EXTPROC: {"loaded": loaded}}}

    table = scaling_table([cell(16, 10.0, 400, 380), cell(1000, 35.0, 640, 560)])
    # p99 3.5x (over 3x); CPU 1.6x in all, 1.47x net of the idle scraper's (at most 1.5x)
    assert "| 8 KB | 1000 / 16 | 3.50 | no | 640 / 400 | 1.60 | 560 / 380 | 1.47 | yes |" in table
    assert scaling_table([cell(16, 10.0, 400, 380)]).count("\n") == 1  # one pod count: no row
