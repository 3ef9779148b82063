"""The proxy benchmark's pure parts: wrk's report, py-spy's stacks, the workload, the pods."""

from __future__ import annotations

import orjson
import pytest

from bench.loadgen import ID_MARK, chat_body, parse_wrk
from bench.picker_report import medians
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
