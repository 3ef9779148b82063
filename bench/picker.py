"""Envoy + extproc against Envoy alone, same fast upstreams, same run, alternating.

The upstreams are "pods" that answer instantly: one Envoy process with a listener per pod,
each returning a small completion JSON (``direct_response``), so the measured cost is the
proxy's and the picker's, not a model's. Envoy alone is the generated bootstrap with the
ext_proc, buffer and access-log parts removed (round robin over the same pods). Load is
``wrk`` (Debian package) POSTing an 8 KB chat prompt, a few distinct prefixes.

Prints requests/s, latency p50/p99, CPU per request of extproc and of Envoy, and the
ratios against Envoy alone. Results also go out as JSON with the configuration.

    python -m bench.picker [--seconds 10] [--rounds 2] [--connections 16] [--pods 16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from extproc.envoyconf.build import EnvoyOptions, make_bootstrap
from extproc.envoyconf.render import to_dict
from extproc.launch import (
    Proc,
    free_port,
    start_envoy,
    start_envoy_config,
    start_extproc,
    write_pods_file,
)
from extproc.types import Pod, PodId

# What a idle vLLM pod's /metrics says, so the picker's scraper reads real series.
METRICS_PAGE = (
    'vllm:num_requests_running{engine="0",model_name="bench"} 0.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="bench"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="bench"} 0.1\n'
)
COMPLETION = orjson.dumps(
    {"id": "cmpl-1", "object": "text_completion", "model": "bench", "choices": [{"text": "ok"}]}
).decode()


def upstream_config(ports: list[int], admin_port: int) -> dict[str, Any]:
    """One Envoy, one listener per pod port, each answering 200 with a completion body."""

    def listener(port: int) -> dict[str, Any]:
        hcm = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"pod{port}",
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                "match": {"prefix": "/metrics"},
                "direct_response": {"status": 200, "body": {"inline_string": METRICS_PAGE}},
            }, {
                "match": {"prefix": "/"},
                "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
                "response_headers_to_add": [{"header": {"key": "x-sim-pod", "value": f"pod-{port}"}}],
            }]}]},
        }  # fmt: skip
        return {
            "name": f"pod{port}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 16 << 20,
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
        }  # fmt: skip

    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": [listener(p) for p in ports]},
    }


def envoy_alone_config(pods: list[Pod], options: EnvoyOptions) -> dict[str, Any]:
    """The generated bootstrap without extproc: router only, no access log."""
    config = to_dict(make_bootstrap(pods, options))
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [
                    h for h in hcm["http_filters"] if h["name"].endswith("router")
                ]
                hcm.pop("access_log", None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "extproc"
    ]
    return config


def chat_body(prompt_bytes: int) -> bytes:
    system = ("You are a careful assistant for the support team. " * 400)[: prompt_bytes - 200]
    return orjson.dumps(
        {"model": "bench", "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "How do I reset my password?"}],
         "max_tokens": 16}
    )  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, body_file: Path, seconds: int, connections: int) -> dict[str, float]:
    script = body_file.with_suffix(".lua")
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{body_file}", "rb"); wrk.body = f:read("*all"); f:close()\n'
    )
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script),
         url + "/v1/chat/completions"],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    lat = {k: _ms(v) for k, v in re.findall(r"^\s*(50|99)(?:\.0+)?%\s+(\S+)", out, re.MULTILINE)}
    if set(lat) != {"50", "99"}:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return {"rps": rps, "requests": total, "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "p50_ms": lat["50"], "p99_ms": lat["99"]}  # fmt: skip


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def measure(
    name: str, url: str, procs: dict[str, Proc], body: Path, args: argparse.Namespace
) -> dict[str, Any]:
    before = {k: cpu_seconds(p.pid) for k, p in procs.items()}
    result: dict[str, Any] = run_wrk(url, body, args.seconds, args.connections)
    for k, p in procs.items():
        result[f"{k}_cpu_us_per_request"] = round(
            (cpu_seconds(p.pid) - before[k]) / max(result["requests"], 1) * 1e6, 1
        )
    print(f"  {name:16s} {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install wrk")
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        log_dir = Path(tmp)
        body = log_dir / "body.json"
        body.write_bytes(chat_body(args.prompt_bytes))
        ports = [free_port() for _ in range(args.pods)]
        pods = [
            Pod(PodId("default", f"pod-{p}"), f"127.0.0.1:{p}", frozenset({"bench"})) for p in ports
        ]
        procs: list[Proc] = []
        try:
            up_admin = free_port()
            procs.append(
                start_envoy_config(upstream_config(ports, up_admin), up_admin, log_dir, "upstreams")
            )
            grpc_port = free_port()
            options = EnvoyOptions(
                extproc_address=f"127.0.0.1:{grpc_port}",
                listen_port=free_port(),
                admin_port=free_port(),
            )
            alone_opts = EnvoyOptions(
                extproc_address=f"127.0.0.1:{grpc_port}",
                listen_port=free_port(),
                admin_port=free_port(),
            )
            picker = start_extproc(
                write_pods_file(pods, log_dir / "pods.yaml"),
                log_dir,
                grpc_port=grpc_port,
                metrics_port=free_port(),
            )
            procs.append(picker)
            with_picker = start_envoy(pods, options, log_dir)
            procs.append(with_picker)
            alone = start_envoy_config(
                envoy_alone_config(pods, alone_opts), alone_opts.admin_port, log_dir, "envoy-alone"
            )
            procs.append(alone)
            runs: dict[str, list[dict[str, Any]]] = {"envoy_alone": [], "envoy_extproc": []}
            for r in range(args.rounds):
                print(f"round {r + 1}/{args.rounds}", flush=True)
                runs["envoy_alone"].append(
                    measure(
                        "envoy alone",
                        f"http://127.0.0.1:{alone_opts.listen_port}",
                        {"envoy": alone},
                        body,
                        args,
                    )
                )
                runs["envoy_extproc"].append(
                    measure(
                        "envoy + extproc",
                        f"http://127.0.0.1:{options.listen_port}",
                        {"envoy": with_picker, "extproc": picker},
                        body,
                        args,
                    )
                )
        finally:
            for p in reversed(procs):
                p.stop()
    summary = {
        k: {m: round(statistics.median(r[m] for r in v), 2) for m in v[0]} for k, v in runs.items()
    }
    a, e = summary["envoy_alone"], summary["envoy_extproc"]
    ratios = {"throughput": round(e["rps"] / a["rps"], 2), "p50_added_ms": round(e["p50_ms"] - a["p50_ms"], 2),
              "p99_added_ms": round(e["p99_ms"] - a["p99_ms"], 2)}  # fmt: skip
    print(
        f"\nmedian of {args.rounds} rounds: {json.dumps(summary)}\nratios vs envoy alone: {ratios}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"config": vars(args), "runs": runs, "summary": summary, "ratios": ratios}, indent=2
            )
        )


if __name__ == "__main__":
    main()
