"""Mooncake traces: shared hash_ids give shared text, scaling keeps the structure, bad input fails."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.errors import ConfigError
from extproc.sim.tokenizer import tokenize
from extproc.sim.traces import (
    TRACE_FILES,
    block_words,
    load_trace,
    trace_workload,
)
from extproc.sim.workloads import WorkItem

RECORDS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [0, 3]},
    {"timestamp": 1200, "input_length": 512, "output_length": 40, "hash_ids": [3]},
]


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in RECORDS) + b"\n")
    return path


def items(
    path: Path, scale: float = 16.0, speedup: float = 1.0, limit: int | None = None
) -> list[WorkItem]:
    return list(trace_workload(path, scale=scale, speedup=speedup, limit=limit).items())


def test_shared_hash_ids_share_text_exactly_that_far(trace_file: Path) -> None:
    r0, r1, r2, r3 = items(trace_file, scale=16)  # 32 tokens a block
    assert r1.request.prompt.startswith(r0.request.prompt)  # r0 is blocks 0-1, cut short
    assert r2.sim.prompt_token_ids[:32] == r0.sim.prompt_token_ids[:32]  # block 0
    assert r2.sim.prompt_token_ids[32:38] != r0.sim.prompt_token_ids[32:38]  # 3 vs 1
    assert r3.sim.prompt_token_ids[:6] == r2.sim.prompt_token_ids[32:38]  # block 3, anywhere
    for item in (r0, r1, r2, r3):
        assert list(item.sim.prompt_token_ids) == tokenize(item.request.prompt)


@pytest.mark.parametrize(
    ("scale", "inputs", "outputs"),
    [
        pytest.param(1, [1000, 1500, 600, 512], [100, 10, 1, 40], id="unscaled"),
        pytest.param(16, [62, 94, 38, 32], [6, 1, 1, 2], id="16"),
        pytest.param(64, [16, 23, 9, 8], [2, 1, 1, 1], id="64-at-least-one"),
    ],
)
def test_scaling_divides_lengths(
    trace_file: Path, scale: int, inputs: list[int], outputs: list[int]
) -> None:
    got = items(trace_file, scale=scale)
    assert [len(i.sim.prompt_token_ids) for i in got] == inputs
    assert [i.sim.max_tokens for i in got] == outputs


def test_block_text_is_a_prefix_of_the_same_block_at_a_smaller_scale() -> None:
    assert (block_words((7,), 8) == block_words((7,), 32)[:8]).all()


def test_timestamps_speedup_and_limit(trace_file: Path) -> None:
    assert [i.arrival_s for i in items(trace_file)] == [0.0, 0.5, 1.0, 1.2]
    assert [i.arrival_s for i in items(trace_file, speedup=4, limit=2)] == [0.0, 0.125]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        pytest.param(b"{not json", "trace.jsonl:2: not a Mooncake trace record", id="json"),
        pytest.param(b'{"timestamp": 1}', "trace.jsonl:2: not a Mooncake", id="missing-field"),
        pytest.param(
            b'{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "trace.jsonl:2: lengths must be > 0",
            id="zero-length",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: bytes, match: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(orjson.dumps(RECORDS[0]) + b"\n" + line + b"\n")
    with pytest.raises(ConfigError, match=match):
        load_trace(path)


def test_missing_file_and_bad_scale(tmp_path: Path, trace_file: Path) -> None:
    with pytest.raises(ConfigError, match="trace file not found"):
        trace_workload(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="scale must be >= 1"):
        trace_workload(trace_file, scale=0.5)
    with pytest.raises(ConfigError, match="speedup must be > 0"):
        trace_workload(trace_file, speedup=0)


@pytest.mark.parametrize("name", list(TRACE_FILES))
def test_shipped_traces_start_with_their_shared_block(trace_dir: Path, name: str) -> None:
    got = items(trace_dir / TRACE_FILES[name], scale=16, limit=50)
    assert len(got) == 50
    records = load_trace(trace_dir / TRACE_FILES[name], limit=50)
    first_ids = {r.hash_ids[0] for r in records}
    first_blocks = {i.sim.prompt_token_ids[:32] for i in got}
    assert len(first_blocks) == len(first_ids)
