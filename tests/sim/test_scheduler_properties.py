"""Across random workloads on small caches (chunks, preemptions, aborts) no block leaks.

Random prompts share a few prefixes; caches of a few blocks force preemption. After every
step each block's reference count is the number of running requests holding it, free
blocks are exactly the unreferenced ones, a running request holds the blocks of its
computed tokens, the step keeps to its budget and ``max_num_seqs``; at the end every
request finished or was aborted and every block is free (but vLLM's null block).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st

from extproc.sim.engine import Engine, EngineConfig, RequestRejected, StepResult
from testkit.factories import ROUND_TIMING, make_sim_request, seq

BLOCK_SIZE = 4
PREFIXES = [seq(i, 12) for i in range(3)]

# Every op is (kind, (a, b, c, d)): "add" a request of prefix a (none if a == 3), b own
# tokens, max_tokens c, own tokens from seed d; "step" a times; "abort" the a-th id added.
ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "abort"]),
        st.tuples(
            st.integers(0, len(PREFIXES)),
            st.integers(1, 20),
            st.integers(1, 24),
            st.integers(0, 1000),
        ),
    ),
    min_size=10,
    max_size=80,
)


def check_blocks(engine: Engine, result: StepResult | None) -> None:
    pool, cfg = engine.pool, engine.config
    held = Counter(b.block_id for r in engine._running for b in r.blocks)
    assert all(not r.blocks and r.num_computed_tokens == 0 for r in engine._waiting)
    for block in pool.blocks:
        assert block.ref_cnt == held[block.block_id]
    assert 0 not in held  # the null block
    assert set(pool._free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    for r in engine._running:
        assert len(r.blocks) == -(-r.num_computed_tokens // cfg.block_size)
        assert len({b.block_id for b in r.blocks}) == len(r.blocks)
    cached = [(h, i, b) for h, blocks in pool._cached.items() for i, b in blocks.items()]
    assert all(b.block_hash == h and b.block_id == i for h, i, b in cached)
    assert all(pool._cached.values())  # a hash whose last block went is gone
    assert len(cached) == sum(b.block_hash is not None for b in pool.blocks)
    assert len(engine._running) <= cfg.max_num_seqs
    if result is not None:
        assert sum(n for _, n in result.scheduled) <= cfg.max_num_batched_tokens


@settings(max_examples=300, deadline=None)
@given(
    ops,
    st.integers(6, 12),  # num_gpu_blocks
    st.integers(8, 48),  # max_num_batched_tokens
    st.integers(1, 6),  # max_num_seqs
    st.booleans(),  # enable_chunked_prefill
)
def test_no_block_is_leaked_or_double_freed(
    operations: list[tuple[str, tuple[int, int, int, int]]],
    num_gpu_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    chunked: bool,
) -> None:
    engine = Engine(
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            max_model_len=max_num_batched_tokens if not chunked else 1024,
            timing_profile=ROUND_TIMING,
        )
    )
    added: list[str] = []
    aborted: set[str] = set()
    finished: set[str] = set()

    def note(result: StepResult) -> None:
        check_blocks(engine, result)
        for fin in result.finished:
            assert fin.request_id not in finished
            finished.add(fin.request_id)

    for op, (a, b, c, d) in operations:
        if op == "add":
            prompt = (PREFIXES[a] if a < len(PREFIXES) else []) + seq(d, b)
            req = make_sim_request(prompt, c, request_id=f"r{len(added)}")
            try:
                engine.add_request(req, engine.clock)
            except RequestRejected:
                continue
            added.append(req.request_id)
        elif op == "step":
            for _ in range(a + 1):
                if engine.has_work():
                    note(engine.step(engine.clock))
        elif added:
            rid = added[d % len(added)]
            if engine.abort(rid):
                aborted.add(rid)
                check_blocks(engine, None)
    for _ in range(2_000):
        if not engine.has_work():
            break
        note(engine.step(engine.clock))
    assert not engine.has_work()
    assert finished | aborted == set(added) and not finished & aborted
    assert engine.pool.num_free_blocks == num_gpu_blocks - 1  # all but the null block
    event("preempted" if engine.stats().num_preemptions else "no preemption")
