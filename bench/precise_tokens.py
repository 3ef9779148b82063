"""The cost of exact tokens for precise-prefix-cache: one chat request rendered and
tokenized (``request.tokens.SegmentTokenizer``) at 1, 8 and 220 KB of prompt, cold (every
segment new: a fresh memo) and warm (the same conversation plus one new short turn, as
multi-turn traffic sends), against tokenizing the whole rendered prompt; and the memo's
hit ratio over a multi-turn workload.

    python -m bench.precise_tokens --model-dir ~/.cache/extproc-e2e/model/qwen3-tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from extproc.request.parse import Api
from extproc.request.tokens import SegmentTokenizer

SIZES_KB = (1, 8, 220)
WORDS = ["the", "router", "sends", "each", "request", "to", "the", "pod", "that", "holds", "it"]


def conversation(kb: int, turns: int = 8) -> list[dict[str, str]]:
    """``turns`` user/assistant pairs after a system prompt, about ``kb`` KB in all."""
    per = max(1, kb * 1024 // (2 * turns + 1))
    text = " ".join(WORDS * (per // 60 + 1))[:per]
    out = [{"role": "system", "content": text}]
    for t in range(turns):
        out += [{"role": "user", "content": f"{t} {text}"}, {"role": "assistant", "content": text}]
    return out


def timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_size(model_dir: Path, kb: int, repeat: int) -> dict[str, Any]:
    messages = conversation(kb)
    tok = SegmentTokenizer(model_dir)
    text = tok.render_chat({"messages": messages})
    whole = timed(lambda: tok.tokenizer.encode(text, add_special_tokens=False), repeat)

    def cold() -> None:
        tok._memo.clear()
        tok._memo_size = 0
        tok.request_tokens(Api.CHAT_COMPLETIONS, {"messages": messages})

    cold_s = timed(cold, repeat)
    tok.request_tokens(Api.CHAT_COMPLETIONS, {"messages": messages})
    counter = iter(range(10**9))

    def warm() -> None:
        turn = [*messages, {"role": "user", "content": f"and then? {next(counter)}"}]
        tok.request_tokens(Api.CHAT_COMPLETIONS, {"messages": turn})

    warm_s = timed(warm, repeat)
    num_tokens = len(tok.tokenizer.encode(text, add_special_tokens=False).ids)
    return {"kb": kb, "tokens": num_tokens, "whole_ms": whole * 1e3,
            "segments_cold_ms": cold_s * 1e3, "segments_warm_ms": warm_s * 1e3}  # fmt: skip


def measure(model_dir: Path, repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": [measure_size(model_dir, kb, repeat) for kb in SIZES_KB]}
    tok = SegmentTokenizer(model_dir)
    for conv in range(20):  # 20 conversations of 10 turns each, every turn a new request
        messages = [{"role": "system", "content": "You are helpful. " * 40}]
        for turn in range(10):
            messages.append({"role": "user", "content": f"conv {conv} turn {turn} " * 10})
            tok.request_tokens(Api.CHAT_COMPLETIONS, {"messages": messages})
            messages.append({"role": "assistant", "content": f"answer {conv}.{turn} " * 10})
    results["multiturn_memo_hit_ratio"] = tok.hits / (tok.hits + tok.misses)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench/results/precise_tokens.json"))
    args = p.parse_args()
    results = measure(args.model_dir, args.repeat)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
