"""Engine: capacity, pinning, LRU eviction, rejection, settings, timing, counters, events."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from extproc.errors import ConfigError
from extproc.sim.engine import Engine, EngineConfig, QueueFull, RequestTooLarge
from extproc.sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, hash_request_tokens
from testkit.factories import ROUND_TIMING, make_sim_request, run_alone, seq


def settings(name: str, value: object) -> dict[str, Any]:
    return {name: value}


TIMED = EngineConfig(timing_profile=ROUND_TIMING)


@pytest.mark.parametrize(
    "name", [f.name for f in dataclasses.fields(EngineConfig) if f.type in ("int", "float")]
)
def test_invalid_settings_name_the_setting(name: str) -> None:
    with pytest.raises(ConfigError, match=f"EngineConfig.{name} must be"):
        EngineConfig(**settings(name, -1))


@pytest.mark.parametrize("name", ["block_size", "num_gpu_blocks", "max_num_seqs", "time_scale"])
def test_zero_is_invalid_for_sizes_and_scale(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**settings(name, 0))


def test_request_larger_than_the_whole_cache_is_rejected() -> None:
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=5))  # 4 usable, 1 null block
    with pytest.raises(RequestTooLarge, match="only 4 .num_gpu_blocks=5"):
        engine.add_request(make_sim_request(seq(1, 14), max_tokens=4), 0.0)  # 17 tokens of KV
    engine.add_request(make_sim_request(seq(1, 13), max_tokens=4), 0.0)  # 16 fit exactly
    assert engine.stats().num_waiting == 1


def test_request_longer_than_max_model_len_is_rejected() -> None:
    engine = Engine(EngineConfig(max_model_len=100))
    with pytest.raises(RequestTooLarge, match="maximum context length is 100"):
        engine.add_request(make_sim_request(seq(1, 90), max_tokens=11), 0.0)


def test_queue_is_bounded() -> None:
    engine = Engine(EngineConfig(max_num_waiting=2))
    for _ in range(2):
        engine.add_request(make_sim_request(seq(1, 8)), 0.0)
    with pytest.raises(QueueFull):
        engine.add_request(make_sim_request(seq(1, 8)), 0.0)


def test_running_blocks_are_pinned_and_a_prompt_that_does_not_fit_waits() -> None:
    engine = Engine(dataclasses.replace(TIMED, block_size=4, num_gpu_blocks=9))
    a = make_sim_request(seq(1, 16), max_tokens=5)  # 4 prompt blocks, a 5th to decode
    b = make_sim_request(seq(2, 17), max_tokens=1)  # 5 prompt blocks: never 5 free beside a
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    first = engine.step(0.0)
    assert [rid for rid, _ in first.admitted] == [a.request_id]
    assert engine.stats().num_waiting == 1
    results = engine.advance_to(10.0)
    fin = {f.request_id: f for r in [first, *results] for f in r.finished}
    assert fin[b.request_id].scheduled_s == fin[a.request_id].finished_s
    # a's prompt blocks survived b's allocation: a repeat of a hits all but the last token
    assert run_alone(engine, make_sim_request(seq(1, 16))).num_cached_tokens == 12


def test_free_cached_blocks_are_evicted_least_recently_used_first() -> None:
    # 6 usable blocks of 4; a 9-token prompt takes 3 blocks and caches 2, and its third
    # (partial, unhashed) block goes back to the front of the free queue, reused first.
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=7))
    x, y, z = seq(1, 9), seq(2, 9), seq(3, 9)
    run_alone(engine, make_sim_request(x))
    run_alone(engine, make_sim_request(y))
    assert run_alone(engine, make_sim_request(x)).num_cached_tokens == 8  # x used again: newest
    # z takes x's partial block, the never-used one, then y's tail: y is the least recent
    run_alone(engine, make_sim_request(z))
    assert engine.stats().num_evicted_blocks == 1
    assert run_alone(engine, make_sim_request(x)).num_cached_tokens == 8
    assert run_alone(engine, make_sim_request(y)).num_cached_tokens == 4


def test_kv_cache_usage_counts_blocks_in_use() -> None:
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=11))  # 10 usable
    engine.add_request(make_sim_request(seq(1, 8), max_tokens=3), 0.0)
    engine.step(0.0)
    assert engine.stats().kv_cache_usage == pytest.approx(0.2)  # 2 prompt blocks
    engine.advance_to(1.0)
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0  # cached blocks are free blocks
    assert stats.num_cached_blocks == 2


def test_ttft_grows_with_uncached_tokens_and_shrinks_on_a_hit() -> None:
    engine = Engine(TIMED)
    short = run_alone(engine, make_sim_request(seq(1, 100)))
    long = run_alone(engine, make_sim_request(seq(2, 1000)))
    again = run_alone(engine, make_sim_request(seq(2, 1000)))
    assert short.ttft_s == pytest.approx(0.010 + 0.100)
    assert long.ttft_s == pytest.approx(0.010 + 1.000)
    assert again.num_cached_tokens == 992
    assert again.ttft_s == pytest.approx(0.010 + 0.008)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_inter_token_latency_grows_with_the_batch(batch: int) -> None:
    engine = Engine(TIMED)
    for i in range(batch):
        engine.add_request(make_sim_request(seq(i, 10), max_tokens=4), 0.0)
    itl = [o.latency_s for r in engine.advance_to(10.0) for o in r.outputs if o.index > 0]
    assert len(itl) == 3 * batch
    assert itl == [pytest.approx(0.010 + batch * 0.001)] * len(itl)


def test_time_scale_multiplies_step_times() -> None:
    fast = Engine(dataclasses.replace(TIMED, time_scale=0.01))
    fin = run_alone(fast, make_sim_request(seq(1, 100)))
    assert fin.ttft_s == pytest.approx((0.010 + 0.100) * 0.01)


def test_max_num_seqs_queues_requests_and_counts_hits_only_on_admission() -> None:
    engine = Engine(dataclasses.replace(TIMED, max_num_seqs=1))
    a, b = make_sim_request(seq(1, 40), max_tokens=3), make_sim_request(seq(1, 40), max_tokens=3)
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    engine.step(0.0)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 0)
    finished = {f.request_id: f for r in engine.advance_to(10.0) for f in r.finished}
    fa, fb = finished[a.request_id], finished[b.request_id]
    assert fb.scheduled_s == fa.finished_s
    assert fb.queue_s > 0 and fb.ttft_s > fa.ttft_s
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_abort_frees_blocks_and_forgets_the_request() -> None:
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=9))  # 8 usable
    req = make_sim_request(seq(1, 16), max_tokens=8)
    engine.add_request(req, 0.0)
    engine.step(0.0)
    assert engine.abort(req.request_id)
    assert not engine.has_work()
    assert engine.stats().num_free_blocks == 8
    assert not engine.abort(req.request_id)
    engine.add_request(req, engine.clock)  # the id is free again


def test_idle_engine_starts_the_next_step_at_the_arrival() -> None:
    engine = Engine(TIMED)
    engine.add_request(make_sim_request(seq(1, 10)), 5.0)
    assert engine.advance_to(5.0) == []
    (result,) = engine.advance_to(5.5)
    assert result.start_s == 5.0
    assert result.finished[0].ttft_s == pytest.approx(0.020)


def test_same_prompt_same_answer_on_any_engine() -> None:
    prompt = seq(3, 33)
    a = run_alone(Engine(), make_sim_request(prompt, max_tokens=12))
    b = run_alone(Engine(EngineConfig(block_size=32)), make_sim_request(prompt, max_tokens=12))
    assert a.output_token_ids == b.output_token_ids
    assert a.output_text == b.output_text


def test_reset_prefix_cache_refuses_while_running_then_empties_the_cache() -> None:
    engine = Engine(EngineConfig(enable_kv_cache_events=True))
    prompt = seq(1, 40)
    engine.add_request(make_sim_request(prompt, max_tokens=3), 0.0)
    engine.step(0.0)
    assert not engine.reset_prefix_cache()
    engine.advance_to(10.0)
    engine.take_kv_events()
    assert engine.reset_prefix_cache()
    assert engine.take_kv_events() == [AllBlocksCleared()]
    assert run_alone(engine, make_sim_request(prompt)).num_cached_tokens == 0


def test_kv_events_follow_the_chain_through_prompt_decode_and_eviction() -> None:
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=5, enable_kv_cache_events=True))
    prompt = seq(1, 6)
    fin = run_alone(engine, make_sim_request(prompt, max_tokens=4, salt="s"))
    tokens = prompt + list(fin.output_token_ids)
    hashes = hash_request_tokens(tokens, 4, "s")
    events = engine.take_kv_events()
    # prompt block 0 at admission; block 1 once the 2nd generated token's KV is computed
    assert events == [
        BlockStored((hashes[0],), None, tuple(tokens[:4]), 4, (("s",),)),
        BlockStored((hashes[1],), hashes[0], tuple(tokens[4:8]), 4, (None,)),
    ]
    run_alone(engine, make_sim_request(seq(2, 13)))  # needs all 4 blocks: evicts both
    removed = [e for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes[:2])


def test_events_are_not_kept_unless_enabled() -> None:
    engine = Engine()
    run_alone(engine, make_sim_request(seq(1, 40)))
    assert engine.take_kv_events() == []


def test_running_and_waiting_as_vllms_gauges_report_them_at_the_end_of_the_last_step() -> None:
    """A request that arrived since the last step is not yet waiting in the gauges (vLLM
    makes its SchedulerStats after scheduling); one the step passed over is."""
    engine = Engine(dataclasses.replace(TIMED, max_num_seqs=1))
    a, b = make_sim_request(seq(1, 8), max_tokens=5), make_sim_request(seq(2, 8), max_tokens=5)
    engine.add_request(a, 0.0)
    stats = engine.stats()
    assert (stats.num_waiting, stats.step_running, stats.step_waiting) == (1, 0, 0)
    engine.step(0.0)
    engine.add_request(b, engine.clock)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.step_running, stats.step_waiting) == (1, 0)
    engine.step(engine.clock)  # max_num_seqs 1: b passed over
    stats = engine.stats()
    assert (stats.step_running, stats.step_waiting) == (1, 1)


def test_aborting_every_request_leaves_the_gauges_as_of_the_last_step() -> None:
    """vLLM makes its gauges' stats after each step: requests aborted since still show
    running, and their blocks in use, until the next step (vllm-project/vllm#22545)."""
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=11))  # 10 usable
    req = make_sim_request(seq(1, 8), max_tokens=3)
    engine.add_request(req, 0.0)
    engine.step(0.0)
    assert engine.abort(req.request_id)
    stats = engine.stats()
    assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0)  # freed at once
    assert stats.step_running == 1 and stats.step_kv_cache_usage == pytest.approx(0.2)
    other = make_sim_request(seq(2, 4), max_tokens=1)
    engine.add_request(other, engine.clock)
    engine.step(engine.clock)  # the next step tells the truth: one block, now done
    stats = engine.stats()
    assert (stats.step_running, stats.step_kv_cache_usage) == (0, 0.0)
