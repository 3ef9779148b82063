"""Prefix-cache micro-benchmark: render + hash + score + record, and bytes per entry.

Compares extproc's compact ``PrefixIndex`` with a baseline written the plain way (an
``OrderedDict`` LRU per pod and a dict from block hash to pod set), side by side in one
run, and prints the ratios. Results also go out as JSON with the configuration.

    python -m bench.prefix                  # 16 and 256 pods, 100 x 50,000 memory
    python -m bench.prefix --quick          # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.pods import PodId
from extproc.prefix import PrefixIndex, hash_prompt
from extproc.request.parse import parse_request
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from testkit.factories import make_pod

BLOCKS = 128


class BaselineIndex:
    """The obvious implementation: per-pod OrderedDict LRU + hash -> set of pods."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lru: dict[PodId, OrderedDict[int, None]] = {}
        self.holders: dict[int, set[PodId]] = {}

    def record(self, hashes: Sequence[int], pod: PodId) -> int:
        lru = self.lru.setdefault(pod, OrderedDict())
        evicted = 0
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self.holders.setdefault(h, set()).add(pod)
            if len(lru) > self.cap:
                old, _ = lru.popitem(last=False)
                owners = self.holders[old]
                owners.discard(pod)
                if not owners:
                    del self.holders[old]
                evicted += 1
        return evicted

    def match(
        self, hashes: Sequence[int], candidates: Sequence[PodId], top_k: int
    ) -> dict[PodId, int]:
        cands = set(candidates)
        found: dict[PodId, int] = {}
        for i in range(len(hashes) - 1, -1, -1):
            for pod in self.holders.get(hashes[i], ()):
                if pod in cands and pod not in found:
                    found[pod] = i + 1
                    if len(found) >= top_k:
                        return found
        return found


def chat_body_8kb(seed: int) -> bytes:
    rng = random.Random(seed)
    system = "You are a careful assistant for the support team. " * 60  # ~3 KB shared
    history = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": " ".join(
                rng.choice(["cache", "router", "pod", "token", "envoy", "prefix"])
                for _ in range(150)
            ),
        }
        for i in range(6)
    ]
    body = {"model": "m", "messages": [{"role": "system", "content": system}, *history]}
    return orjson.dumps(body)


def per_call_us(fn: Callable[[], object], repeat: int) -> dict[str, float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return {
        "p50": round(statistics.median(samples), 2),
        "p99": round(samples[int(len(samples) * 0.99) - 1], 2),
    }


def fill(
    index: PrefixIndex | BaselineIndex,
    pods: Sequence[PodId],
    entries_per_pod: int,
    rng: random.Random,
) -> None:
    for pod in pods:
        for _ in range(entries_per_pod // BLOCKS):
            index.record([rng.getrandbits(64) for _ in range(BLOCKS)], pod)


def index_latency(
    index: PrefixIndex | BaselineIndex,
    hashes: Sequence[int],
    ids: Sequence[PodId],
    new_prompts: Iterator[list[int]],
    repeat: int,
) -> dict[str, dict[str, float]]:
    """Score and record timings of one index (a function, so each lambda has a typed index)."""
    return {
        "score_us": per_call_us(lambda: index.match(hashes, ids, 5), repeat),
        "record_refresh_us": per_call_us(lambda: index.record(hashes, ids[0]), repeat),
        "record_new_evicting_us": per_call_us(
            lambda: index.record(next(new_prompts), ids[1]), repeat
        ),
    }


def latency(num_pods: int, entries_per_pod: int, repeat: int) -> dict[str, Any]:
    rng = random.Random(num_pods)
    pods = [make_pod(f"p{i}", port=9000 + i) for i in range(num_pods)]
    ids = [p.id for p in pods]
    body = chat_body_8kb(1)
    req = parse_request("/v1/chat/completions", body)
    hashes = hash_prompt(req.model, req.prompt)
    assert len(hashes) == BLOCKS, len(hashes)
    result: dict[str, Any] = {
        "pods": num_pods,
        "entries_per_pod": entries_per_pod,
        "prompt_bytes": len(req.prompt.encode()),
        "render_us": per_call_us(lambda: parse_request("/v1/chat/completions", body), repeat),
        "hash_us": per_call_us(lambda: hash_prompt(req.model, req.prompt), repeat),
    }
    plugin = PrefixCacheScorer.from_args(
        {"maxHashCacheSize": entries_per_pod}, PluginContext(CollectorRegistry())
    )
    baseline = BaselineIndex(entries_per_pod)
    indexes: tuple[tuple[str, PrefixIndex | BaselineIndex], ...] = (
        ("extproc", plugin.index),
        ("baseline", baseline),
    )
    for name, index in indexes:
        fill(index, ids, entries_per_pod, random.Random(num_pods))
        index.record(hashes, ids[0])  # one pod holds the prompt: a realistic hit
        new_prompts = [[rng.getrandbits(64) for _ in range(BLOCKS)] for _ in range(repeat)]
        it = iter(new_prompts)
        gc.collect()
        result[name] = index_latency(index, hashes, ids, it, repeat)
    cycle_scores = per_call_us(lambda: plugin.score(Cycle(req), pods), repeat)
    result["plugin_score_us"] = cycle_scores
    e, b = result["extproc"], result["baseline"]
    result["ratio_vs_baseline"] = {k: round(e[k]["p50"] / b[k]["p50"], 2) for k in e}
    return result


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(kind: str, num_pods: int, entries_per_pod: int) -> None:
    """Runs in a fresh process: fill one index, print RSS growth per entry."""
    ids = [PodId("default", f"p{i}") for i in range(num_pods)]
    index: PrefixIndex | BaselineIndex = (
        PrefixIndex(entries_per_pod) if kind == "extproc" else BaselineIndex(entries_per_pod)
    )
    gc.collect()
    before = rss_bytes()
    fill(index, ids, entries_per_pod, random.Random(0))
    gc.collect()
    entries = num_pods * (entries_per_pod // BLOCKS) * BLOCKS
    print(
        json.dumps(
            {
                "kind": kind,
                "entries": entries,
                "bytes_per_entry": round((rss_bytes() - before) / entries, 1),
            }
        )
    )


def memory(num_pods: int, entries_per_pod: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("extproc", "baseline"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.prefix",
                "--memory-child",
                kind,
                str(num_pods),
                str(entries_per_pod),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        out[kind] = json.loads(proc.stdout)
    out["ratio_vs_baseline"] = round(
        out["extproc"]["bytes_per_entry"] / out["baseline"]["bytes_per_entry"], 2
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, pods, entries = args.memory_child
        memory_child(kind, int(pods), int(entries))
        return
    entries, repeat = (2_048, 200) if args.quick else (50_000, 2_000)
    results: dict[str, Any] = {
        "config": {
            "blocks": BLOCKS,
            "block_size": 64,
            "top_k": 5,
            "python": sys.version.split()[0],
            "git": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        },
        "latency": [latency(n, entries, repeat) for n in (16, 256)],
        "memory": memory(10 if args.quick else 100, entries),
    }
    for lat in results["latency"]:
        print(
            f"\n{lat['pods']} pods, {lat['entries_per_pod']} entries each, {lat['prompt_bytes']}-byte chat prompt (p50 / p99 us)"
        )
        print(
            f"  render {lat['render_us']}  hash {lat['hash_us']}  plugin score {lat['plugin_score_us']}"
        )
        for op in ("score_us", "record_refresh_us", "record_new_evicting_us"):
            print(
                f"  {op:24s} extproc {lat['extproc'][op]}  baseline {lat['baseline'][op]}  ratio {lat['ratio_vs_baseline'][op]}"
            )
    mem = results["memory"]
    print(
        f"\nmemory: extproc {mem['extproc']}  baseline {mem['baseline']}  ratio {mem['ratio_vs_baseline']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
