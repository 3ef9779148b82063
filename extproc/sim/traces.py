"""Mooncake request traces (``../shared/traces/``) as simulator workloads.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``, one hash_id per 512-token block of the prompt; two requests share a
prompt prefix exactly as far as their hash_id lists share a prefix.

Text. Each hash_id becomes a fixed block of ``block_tokens`` 4-byte words (one token each,
see ``workloads.words_text``), word ``i`` of block ``h`` being
``WORDS[splitmix64(h * 2**20 + i) mod len(WORDS)]``: a function of the hash_id alone, so
equal hash_ids give equal text in every request, run and process. A request's prompt is
its blocks concatenated and cut to its input length.

Scaling. A divisor ``scale`` shrinks every length and keeps the sharing structure:
``block_tokens = max(1, round(512 / scale))``, input ``max(1, round(input_length / scale))``
tokens (at most the blocks' total), output ``max(1, round(output_length / scale))``.
Arrival times are ``timestamp / 1000 / speedup`` seconds (``speedup`` > 1 compresses time).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

from extproc.errors import ConfigError
from extproc.sim.workloads import (
    DEFAULT_MODEL,
    NUM_WORDS,
    WorkItem,
    Workload,
    completion_item,
    words_text,
)

TRACE_BLOCK_TOKENS = 512  # Mooncake's tokens per hash_id
TRACE_FILES = {
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
}
_WORD_POSITION_BITS = 20  # a block has fewer than 2**20 words at any scale

_U64 = np.uint64


def default_trace_dir() -> Path:
    """``<repo>/../shared/traces``, the repository being the one holding this package."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRecord]:
    """The first ``limit`` records (all when None) of a Mooncake JSONL trace, in file order.

    Raises:
        ConfigError: the file is missing, or a line is not a valid record (named by number).
    """
    records: list[TraceRecord] = []
    try:
        with path.open("rb") as f:
            for line_no, line in enumerate(f, 1):
                if limit is not None and len(records) >= limit:
                    break
                if line.strip():
                    records.append(_parse_record(line, path, line_no))
    except FileNotFoundError:
        raise ConfigError(f"{path}: trace file not found") from None
    return records


def _parse_record(line: bytes, path: Path, line_no: int) -> TraceRecord:
    try:
        raw = orjson.loads(line)
        record = TraceRecord(
            int(raw["timestamp"]),
            int(raw["input_length"]),
            int(raw["output_length"]),
            tuple(int(h) for h in raw["hash_ids"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}:{line_no}: not a Mooncake trace record: {exc!r}") from None
    if record.input_length <= 0 or record.output_length <= 0 or not record.hash_ids:
        raise ConfigError(f"{path}:{line_no}: lengths must be > 0 and hash_ids non-empty")
    return record


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's output function, element-wise (uint64 arithmetic wraps)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def block_words(hash_ids: tuple[int, ...], block_tokens: int) -> npt.NDArray[np.int64]:
    """Word indexes of the blocks ``hash_ids``, concatenated (module docstring)."""
    ids = np.asarray(hash_ids, dtype=np.uint64)[:, None] << _U64(_WORD_POSITION_BITS)
    positions = np.arange(block_tokens, dtype=np.uint64)[None, :]
    return (splitmix64((ids + positions).ravel()) % _U64(NUM_WORDS)).astype(np.int64)


def scaled_tokens(length: int, scale: float) -> int:
    return max(1, round(length / scale))


def trace_workload(
    path: Path,
    *,
    scale: float = 16.0,
    speedup: float = 1.0,
    limit: int | None = None,
    name: str = "trace",
    model: str = DEFAULT_MODEL,
) -> Workload:
    """A Mooncake trace as a workload of ``/v1/completions`` requests (module docstring).

    Raises:
        ConfigError: bad scale or speedup, or an unreadable trace.
    """
    if not scale >= 1.0:
        raise ConfigError(f"scale must be >= 1, got {scale}")
    if not speedup > 0.0:
        raise ConfigError(f"speedup must be > 0, got {speedup}")
    records = load_trace(path, limit)
    block_tokens = scaled_tokens(TRACE_BLOCK_TOKENS, scale)

    def items() -> Iterator[WorkItem]:
        for idx, rec in enumerate(records):
            num_tokens = min(
                scaled_tokens(rec.input_length, scale), len(rec.hash_ids) * block_tokens
            )
            text, tokens = words_text(block_words(rec.hash_ids, block_tokens)[:num_tokens])
            arrival_s = rec.timestamp_ms / 1000.0 / speedup
            max_tokens = scaled_tokens(rec.output_length, scale)
            yield completion_item(f"{name}-{idx}", arrival_s, text, tokens, max_tokens, model)

    params = {
        "trace": str(path),
        "num_requests": len(records),
        "scale": scale,
        "block_tokens": block_tokens,
        "speedup": speedup,
        "model": model,
    }
    return Workload(name, params, items)
