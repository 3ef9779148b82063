"""Scrape cost: CPU per scrape per pod, and % of one core for N pods at an interval.

Pages are realistic vLLM ``/metrics`` pages (``testkit.metrics_pages``: vLLM's
metric names and buckets, 2 engines, HTTP and process metrics; ~90 KB). Two parts:

* parse: CPU per page for the naive full parse with prometheus_client (the baseline),
  the selected lines through the full parser, and ``engine_metrics.PageParser``;
* end to end: ``MetricsScraper`` scraping N fake pods (served by a child process, so
  their CPU is not counted) for a while, with our parser and with the baseline parser;
  CPU is this process's (all threads), divided by the successful scrapes.

    python -m bench.scrape                     # 16 pods, 200 ms, 10 s per run
    python -m bench.scrape --quick             # 3 s per run
    python -m bench.scrape --serve 16          # (internal) the fake pods' process
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer.engine_metrics import (
    SAMPLE_NAMES,
    PageParser,
    PodReader,
    Sample,
    select_lines,
)
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.store import PodStore
from extproc.pods import Pod, PodId
from testkit.metrics_pages import EngineState, make_vllm_page

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NUM_VARIANTS = 16  # pages rotate, so values (and histogram deltas) change per scrape


class NaiveParser(PageParser):
    """The baseline: the whole page through prometheus_client's parser."""

    def samples(self, page: bytes) -> list[Sample]:
        return [
            Sample(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(page.decode())
            for s in family.samples
            if s.name in SAMPLE_NAMES
        ]


class SelectedFullParser(PageParser):
    """Selected lines, each parsed by prometheus_client (no series cache)."""

    def samples(self, page: bytes) -> list[Sample]:
        text = b"\n".join(select_lines(page)).decode()
        return [
            Sample(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]


def make_pages(n: int) -> list[bytes]:
    return [
        make_vllm_page(
            [
                EngineState(
                    waiting=i % 5,
                    running=8 + i,
                    kv_usage=0.4 + i / 100,
                    ttft_sum_s=0.2 * i,
                    ttft_count=i,
                    itl_sum_s=0.02 * 10 * i,
                    itl_count=10 * i,
                )
                for _ in range(2)
            ]
        ).encode()
        for i in range(1, n + 1)
    ]


def cpu_per_call_us(fn: Callable[[], object], min_s: float) -> float:
    fn()
    calls, started = 0, time.process_time()
    while (elapsed := time.process_time() - started) < min_s:
        fn()
        calls += 1
    return elapsed / calls * 1e6


def reading(parser: PageParser, pages: list[bytes]) -> Callable[[], object]:
    """One pod's successive scrapes: parse a page, read it (latency deltas included)."""
    reader, calls = PodReader(frozenset({MODEL})), itertools.count(1)

    def one() -> object:
        n = next(calls)
        return reader.read(parser.samples(pages[n % len(pages)]), n * 0.2)

    return one


def parse_costs(min_s: float) -> dict[str, float]:
    pages = make_pages(NUM_VARIANTS)
    out: dict[str, float] = {}
    for name, parser in (
        ("naive_full_parse", NaiveParser()),
        ("selected_lines_full_parser", SelectedFullParser()),
        ("extproc_page_parser", PageParser()),
    ):
        out[name] = round(cpu_per_call_us(reading(parser, pages), min_s), 1)
    return out


# -- fake pods (child process) ------------------------------------------------------------


def serve(num_pods: int) -> None:
    pages = make_pages(NUM_VARIANTS)

    async def main() -> None:
        counter = [0]

        async def metrics(request: web.Request) -> web.Response:
            counter[0] += 1
            return web.Response(body=pages[counter[0] % len(pages)], content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        ports = []
        for _ in range(num_pods):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(runner.addresses[-1][1])
        print(json.dumps(ports), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
        await runner.cleanup()

    asyncio.run(main())


def end_to_end(
    ports: list[int], parser: PageParser, interval_s: float, run_s: float
) -> dict[str, float]:
    registry = CollectorRegistry()
    store = PodStore(lambda pods: None)
    store.set_pods(
        [
            Pod(PodId("bench", f"p{i}"), f"127.0.0.1:{port}", frozenset({MODEL}))
            for i, port in enumerate(ports)
        ]
    )
    scraper = MetricsScraper(store, interval_s=interval_s, registry=registry, parser=parser)
    scraper.start()
    time.sleep(1.0)  # warm up: connections, series cache
    before = registry.get_sample_value("extproc_scrape_duration_seconds_count") or 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(run_s)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    scrapes = (registry.get_sample_value("extproc_scrape_duration_seconds_count") or 0.0) - before
    errors = sum(
        s.value
        for m in registry.collect()
        if m.name == "extproc_scrape_errors"
        for s in m.samples
        if s.name.endswith("_total")
    )
    scraper.stop()
    return {
        "scrapes": scrapes,
        "errors": errors,
        "cpu_us_per_scrape": round(cpu / max(scrapes, 1) * 1e6, 1),
        "core_percent": round(100 * cpu / wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--interval-s", type=float, default=0.2)
    parser.add_argument("--run-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="3 s runs")
    parser.add_argument("--serve", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    run_s = 3.0 if args.quick else args.run_s
    page = make_pages(1)[0]
    results: dict[str, object] = {
        "config": {
            "pods": args.pods,
            "interval_s": args.interval_s,
            "run_s": run_s,
            "page_bytes": len(page),
            "page_lines": page.count(b"\n"),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
            "load_average_1m": os.getloadavg()[0],  # other processes inflate CPU figures
            "git": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        },
        "parse_cpu_us_per_page": parse_costs(0.5 if args.quick else 2.0),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.scrape", "--serve", str(args.pods)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())
        results["end_to_end"] = {
            name: end_to_end(ports, p, args.interval_s, run_s)
            for name, p in (("extproc", PageParser()), ("naive_full_parse", NaiveParser()))
        }
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
