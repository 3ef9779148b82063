"""Fit the simulated engine's GPU timing profile (``gpu-h100-8b``) from published figures.

Two public measurements of an 8B-class model on one H100, neither taken here:

- Lambda's vLLM benchmark of Meta-Llama-3-8B-Instruct (BF16) on 1x H100 80GB SXM
  (``LAMBDA_URL``): ten ShareGPT prompts sent at once, the client's inter-token
  latencies of every request. That vLLM ran multi-step scheduling: each streamed chunk
  holds ``STEPS_PER_CHUNK`` tokens (a request of N output tokens has (N-1)/10 chunks), so
  a chunk's latency over ten is one decode step of the requests still running. These
  decode steps fit the base, the per-decode-sequence and the per-context-token terms.
- Vidur's H100 profile of Llama-2-7B (``VIDUR_URL``): the median time of each linear
  operation of one decoder layer (QKV and output projections, MLP, norms, RoPE) as a
  function of the batch's token count. The layer's total times 32 layers, plus the
  embedding, fitted in the token count from 256 tokens up, gives the per-prefill-token
  term. Attention over the prompt itself is not in that profile.

The per-prefill-sequence term has no published source and stays 0. Lambda's time to first
token (all ten prompts prefilled in one step) is shown beside the fit as a check: it is
client-side and includes the API server.

    python -m bench.engine_timing_gpu --lambda-json LAMBDA.json --vidur-csv mlp.csv \
        --json bench/results/engine-timing-gpu.json --md bench/results/engine-timing-gpu.md

(``LAMBDA.json`` and ``mlp.csv`` are the files at the two URLs.)
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_timing import coefficient_rows, fit, point, point_rows, publish

LAMBDA_URL = (
    "https://github.com/LambdaLabsML/vllm-benchmark/blob/a4f9f4371a1ccac781293837fce2bce0cc6d25cc/"
    "results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json"
)
VIDUR_URL = (
    "https://github.com/microsoft/vidur/blob/7d47513363ec447a741ac5e47241580b47724fbf/"
    "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
)
STEPS_PER_CHUNK = 10
NUM_LAYERS = 32
MIN_PREFILL_TOKENS = 256  # below this the linear layers are bound by reading weights


def decode_points(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One decode step per chunk index: the median over the requests for which the chunk
    is whole (not their last), with every request still running counted."""
    itls, inputs = run["itls"], run["input_lens"]
    points = []
    for c in range(max(len(x) for x in itls)):
        running = [r for r, x in enumerate(itls) if len(x) > c]
        whole = [itls[r][c] / STEPS_PER_CHUNK for r in running if len(itls[r]) > c + 1]
        if not whole:
            continue
        # KV tokens before the chunk's middle step, summed over the running requests.
        context = sum(inputs[r] + STEPS_PER_CHUNK * c + (STEPS_PER_CHUNK - 1) / 2 for r in running)
        runs = [{"step_s": s} for s in whole]
        points.append(
            point("decode", (0, 0, len(running), round(context)), runs, "step_s", chunk=c)
        )
    return points


def linear_layers_s(vidur_csv: Path) -> list[tuple[int, float]]:
    """(tokens, seconds) of the model's linear layers and embedding, tensor parallel 1."""
    by_tokens: dict[int, list[float]] = {}
    with vidur_csv.open() as f:
        for row in csv.DictReader(f):
            if row["num_tensor_parallel_workers"] != "1":
                continue
            ops = [k for k in row if k.startswith("time_stats.") and k.endswith(".median")]
            layer_ms = sum(float(row[k]) for k in ops if k != "time_stats.emb.median")
            total_ms = NUM_LAYERS * layer_ms + float(row["time_stats.emb.median"])
            by_tokens.setdefault(int(row["num_tokens"]), []).append(total_ms / 1e3)
    return sorted((n, statistics.median(v)) for n, v in by_tokens.items())


def prefill_slope(samples: Sequence[tuple[int, float]]) -> dict[str, Any]:
    used = [(n, s) for n, s in samples if n >= MIN_PREFILL_TOKENS]
    n = np.array([u[0] for u in used], dtype=float)
    s = np.array([u[1] for u in used])
    slope, intercept = np.polyfit(n, s, 1)
    relative = (s - (intercept + slope * n)) / s
    return {
        "s_per_prefill_token": float(slope),
        "intercept_s": float(intercept),
        "num_samples": len(used),
        "tokens_range": [int(n.min()), int(n.max())],
        "max_rel_residual": float(np.max(np.abs(relative))),
        "rms_rel_residual": float(np.sqrt(np.mean(relative**2))),
        "samples": [{"num_tokens": int(a), "linear_layers_s": float(b)} for a, b in used],
    }


def markdown(result: dict[str, Any]) -> str:
    f, p, check = result["fit"], result["prefill"], result["ttft_check"]
    return "\n".join(
        [
            "# Engine step timing: an 8B model on one H100 (`gpu-h100-8b`)",
            "",
            "Fitted from published figures, none measured here:",
            "",
            (
                f"- decode steps: [Lambda vLLM benchmark, Meta-Llama-3-8B-Instruct, 1x H100 SXM]({LAMBDA_URL}) "
                f"(vLLM, BF16, {result['lambda']['num_prompts']} prompts at once; a streamed chunk is "
                f"{STEPS_PER_CHUNK} scheduler steps)"
            ),
            (
                f"- prefill tokens: [Vidur's H100 profile of Llama-2-7B linear layers]({VIDUR_URL}) "
                f"({NUM_LAYERS} layers, {p['tokens_range'][0]}-{p['tokens_range'][1]} tokens, "
                f"{p['num_samples']} samples)"
            ),
            "",
            f"Command: `{result['command']}`",
            "",
            "## Fit",
            "",
            *coefficient_rows(f),
            "",
            (
                f"The prefill slope's own fit: {p['s_per_prefill_token'] * 1e6:.2f} µs a token, "
                f"intercept {p['intercept_s'] * 1e3:.2f} ms, largest relative residual "
                f"{p['max_rel_residual']:.0%}, RMS {p['rms_rel_residual']:.1%}."
            ),
            "",
            (
                f"Check: Lambda's median time to first token, {check['num_prompt_tokens']} prompt "
                f"tokens of {check['num_prompts']} requests in one step, is "
                f"{check['measured_s'] * 1e3:.1f} ms at the client; the profile gives "
                f"{check['predicted_s'] * 1e3:.1f} ms for that step."
            ),
            "",
            "## Decode points (one a chunk; median over the requests)",
            "",
            *point_rows(result["points"], f),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lambda-json", type=Path, required=True)
    parser.add_argument("--vidur-csv", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args(argv)
    run = json.loads(args.lambda_json.read_text())
    points = decode_points(run)
    decode_fit = fit(points)
    prefill = prefill_slope(linear_layers_s(args.vidur_csv))
    decode_fit["s_per_prefill_token"] = prefill["s_per_prefill_token"]
    decode_fit["not_fitted"] = ["num_prefill_seqs"]
    prompt_tokens, num_prompts = sum(run["input_lens"]), len(run["input_lens"])
    result = {
        "profile": "gpu-h100-8b",
        "sources": [LAMBDA_URL, VIDUR_URL],
        "command": "python -m bench.engine_timing_gpu --lambda-json LAMBDA.json --vidur-csv mlp.csv",
        "lambda": {
            k: run[k] for k in ("model_id", "date", "num_prompts", "input_lens", "output_lens")
        },
        "points": points,
        "prefill": prefill,
        "fit": decode_fit,
        "ttft_check": {
            "num_prompt_tokens": prompt_tokens,
            "num_prompts": num_prompts,
            "measured_s": run["median_ttft_ms"] / 1e3,
            "predicted_s": decode_fit["base_s"] + prefill["s_per_prefill_token"] * prompt_tokens,
        },
    }
    publish(result, markdown(result), args.json, args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
