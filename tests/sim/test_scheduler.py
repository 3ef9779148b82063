"""The engine's scheduler, step by step, against vLLM V1's rules (its tests/v1/core cases).

Each table lists, per step, the ``(request, tokens computed)`` pairs in scheduling order.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.errors import ConfigError
from extproc.sim.engine import Engine, EngineConfig, StepResult
from extproc.sim.engine_flags import add_engine_flags, engine_config_from_args
from extproc.sim.kv_cache import BlockStored, hash_request_tokens
from extproc.sim.metrics import PodMetrics
from extproc.sim.timing import TimingProfile
from testkit.factories import ROUND_TIMING, make_sim_request, seq

Table = list[list[tuple[str, int]]]


def engine_with(requests: Sequence[tuple[str, int, int]], **config: Any) -> Engine:
    """An engine with ``(id, prompt tokens, max_tokens)`` requests queued at 0 in order."""
    engine = Engine(EngineConfig(**{"timing_profile": ROUND_TIMING, **config}))
    for i, (rid, num_tokens, max_tokens) in enumerate(requests):
        engine.add_request(
            make_sim_request(seq(100 + i, num_tokens), max_tokens, request_id=rid), 0.0
        )
    return engine


def run(engine: Engine, num_steps: int) -> list[StepResult]:
    return [engine.step(engine.clock) for _ in range(num_steps)]


def scheduled(results: Sequence[StepResult]) -> Table:
    return [list(r.scheduled) for r in results]


def sampled(results: Sequence[StepResult]) -> list[list[str]]:
    return [[o.request_id for o in r.outputs] for r in results]


def test_chunks_fill_the_budget_and_decodes_share_it() -> None:
    """vLLM's test_schedule_concurrent_partial_requests, without a long-prefill threshold."""
    engine = engine_with([("a", 800, 4), ("b", 800, 4), ("c", 800, 4)], max_num_batched_tokens=1024)
    results = run(engine, 4)
    assert scheduled(results) == [
        [("a", 800), ("b", 224)],  # c would get no token: not admitted
        [("a", 1), ("b", 576), ("c", 447)],
        [("a", 1), ("b", 1), ("c", 353)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]
    # only a request whose prompt is complete samples: a partial chunk samples nothing
    assert sampled(results) == [["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c"]]
    assert [[rid for rid, _ in r.admitted] for r in results] == [["a", "b"], ["c"], [], []]


def test_a_step_lasts_what_the_profile_says_for_its_work() -> None:
    engine = engine_with(
        [("a", 800, 4), ("b", 800, 4), ("c", 800, 4)],
        max_num_batched_tokens=1024,
        timing_profile=dataclasses.replace(
            ROUND_TIMING, s_per_decode_seq=0.005, s_per_prefill_seq=0.1
        ),
    )
    first, second = run(engine, 2)
    # a and b prefill 1024 tokens
    assert first.end_s - first.start_s == pytest.approx(0.010 + 2 * 0.1 + 0.001 * 1024)
    # a decodes (one sequence), b and c prefill 1023 tokens
    assert second.end_s - second.start_s == pytest.approx(0.010 + 0.005 + 2 * 0.1 + 0.001 * 1023)


def test_context_tokens_are_the_kv_the_scheduled_requests_had() -> None:
    per_context_token = TimingProfile("context", 0.0, 0.0, 0.0, 1.0, "test")
    engine = Engine(EngineConfig(timing_profile=per_context_token, max_num_batched_tokens=1024))
    for rid in ("a", "b", "c"):
        engine.add_request(make_sim_request(seq(ord(rid), 800), 4, request_id=rid), 0.0)
    first, second = run(engine, 2)
    assert first.end_s - first.start_s == 0.0
    assert second.end_s - second.start_s == 800 + 224  # c starts from nothing


def test_max_num_seqs_caps_the_running_requests() -> None:
    engine = engine_with([("a", 10, 2), ("b", 10, 1), ("c", 10, 1)], max_num_seqs=2)
    assert scheduled(run(engine, 2)) == [
        [("a", 10), ("b", 10)],  # c waits: two run
        [("a", 1), ("c", 10)],  # b finished at the end of step 1
    ]


@pytest.mark.parametrize(
    ("chunked", "table"),
    [
        (True, [[("a", 600), ("b", 400)], [("a", 1), ("b", 200), ("c", 10)]]),
        # b does not fit the budget left: the queue stops, c behind it waits too
        (False, [[("a", 600)], [("a", 1), ("b", 600), ("c", 10)]]),
    ],
)
def test_without_chunked_prefill_a_prompt_over_the_budget_left_stops_the_queue(
    chunked: bool, table: Table
) -> None:
    engine = engine_with(
        [("a", 600, 3), ("b", 600, 3), ("c", 10, 3)],
        max_num_batched_tokens=1000,
        max_model_len=1000,
        enable_chunked_prefill=chunked,
    )
    assert scheduled(run(engine, 2)) == table


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits() -> None:
    """Blocks of 4; 7 usable (and the null block). a holds 4 from step 2 on, so b's 16
    tokens (4 blocks) wait until a is done, although its first chunk of 11 would fit in 3."""
    engine = engine_with(
        [("a", 12, 4), ("b", 16, 1)], block_size=4, num_gpu_blocks=8, max_num_batched_tokens=12
    )
    assert scheduled(run(engine, 6)) == [
        [("a", 12)],
        [("a", 1)],
        [("a", 1)],
        [("a", 1)],
        [("b", 12)],
        [("b", 4)],
    ]


def test_chunked_prefill_off_needs_a_budget_of_max_model_len() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=1000)
    EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=32768)


def test_the_newest_running_request_is_preempted_and_requeued_at_the_front() -> None:
    """Blocks of 4; 7 usable (and the null block). a, b, c take 2 each; a's decode takes
    the last free one, b's needs one more: c, the newest, is preempted. It goes back
    before d (queued later), and on its return hits what is left of its own cached
    prefix."""
    engine = engine_with([("a", 8, 3), ("b", 8, 3), ("c", 8, 3)], block_size=4, num_gpu_blocks=8)
    results = run(engine, 1)
    engine.add_request(make_sim_request(seq(9, 8), 3, request_id="d"), engine.clock)
    results += run(engine, 4)
    assert scheduled(results) == [
        [("a", 8), ("b", 8), ("c", 8)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1)],  # c (3 blocks) cannot return beside a and b: d waits behind
        [("c", 5), ("d", 8)],  # c's first block still cached: 4 of its 9 tokens hit
        [("c", 1), ("d", 1)],
    ]
    assert [r.preempted for r in results] == [(), ("c",), (), (), ()]
    assert engine.stats().num_preemptions == 1
    finished = {f.request_id: f for r in engine.advance_to(10.0) for f in r.finished}
    finished.update({f.request_id: f for r in results for f in r.finished})
    # the usage's cached tokens are the first admission's; c's later hit does not count
    assert finished["c"].num_cached_tokens == 0
    assert finished["c"].num_preemptions == 1
    assert len(finished["c"].output_token_ids) == 3
    stats = engine.stats()
    # vLLM keeps preempted requests' lookups out of the prefix-cache counters
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32, 0)
    assert stats.num_free_blocks == 7


def test_a_request_preempted_by_its_own_allocation_stops_the_running_pass() -> None:
    """Blocks of 4; 5 usable (and the null block). a and b take 2 each; a's decode takes
    the last free one; b needs one and is itself the newest: b is preempted, recomputed
    once a is done."""
    engine = engine_with([("a", 8, 3), ("b", 8, 3)], block_size=4, num_gpu_blocks=6)
    results = run(engine, 5)
    assert scheduled(results) == [
        [("a", 8), ("b", 8)],
        [("a", 1)],
        [("a", 1)],  # b needs 3 blocks; 2 are free until a finishes
        [("b", 1)],  # b's whole prompt hits: only its sampled token is computed
        [("b", 1)],
    ]
    assert [r.preempted for r in results] == [(), ("b",), (), (), ()]
    assert sampled(results) == [["a", "b"], ["a"], ["a"], ["b"], ["b"]]
    assert not engine.has_work()


def test_blocks_filled_by_a_chunk_are_cached_when_it_is_scheduled() -> None:
    """The second of two identical prompts hits blocks the first's chunk fills in the
    same step, and its hit is its num_cached_tokens."""
    engine = Engine(EngineConfig(timing_profile=ROUND_TIMING, max_num_batched_tokens=24))
    prompt = seq(1, 40)
    for rid in ("a", "b"):
        engine.add_request(make_sim_request(prompt, 2, request_id=rid), 0.0)
    results = run(engine, 2)
    assert scheduled(results) == [[("a", 24)], [("a", 16), ("b", 8)]]
    assert results[1].admitted == (("b", 32),)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_kv_events_come_with_the_chunk_that_fills_the_blocks() -> None:
    engine = Engine(
        EngineConfig(block_size=4, max_num_batched_tokens=8, enable_kv_cache_events=True)
    )
    prompt = seq(1, 20)
    engine.add_request(make_sim_request(prompt, 1, request_id="a"), 0.0)
    hashes = hash_request_tokens(prompt, 4)
    per_step = []
    for _ in range(3):
        engine.step(engine.clock)
        per_step.append(engine.take_kv_events())
    assert per_step == [
        [BlockStored(tuple(hashes[0:2]), None, tuple(prompt[0:8]), 4, (None, None))],
        [BlockStored(tuple(hashes[2:4]), hashes[1], tuple(prompt[8:16]), 4, (None, None))],
        [BlockStored((hashes[4],), hashes[3], tuple(prompt[16:20]), 4, (None,))],
    ]


def test_preemptions_are_counted_as_vllm_names_them() -> None:
    engine = engine_with([("a", 8, 3), ("b", 8, 3)], block_size=4, num_gpu_blocks=6)
    metrics = PodMetrics(engine, "m")
    run(engine, 2)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = [s for s in families["vllm:num_preemptions"].samples if s.name.endswith("_total")]
    assert sample.name == "vllm:num_preemptions_total"
    assert sample.labels == {"model_name": "m", "engine": "0"}
    assert sample.value == 1


def test_flags_spell_chunked_prefill_and_the_profile_as_vllm_and_timing_do() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "32768"])
    config = engine_config_from_args(args)
    assert not config.enable_chunked_prefill
    assert config.timing_profile == EngineConfig().timing_profile
    with pytest.raises(SystemExit):
        parser.parse_args(["--timing-profile", "no-such-profile"])
    with pytest.raises(ConfigError, match="unknown timing profile"):
        EngineConfig(timing_profile="no-such-profile")


def test_defaults_are_vllms_for_its_openai_server_on_an_h100() -> None:
    config = EngineConfig()
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (8192, 1024)
    assert config.enable_chunked_prefill
    assert dataclasses.replace(config, time_scale=0.5).profile() == config.profile()
