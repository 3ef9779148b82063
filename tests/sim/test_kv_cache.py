"""The prefix cache reproduces vllm-prefix-caching.txt: the chain, the salt, the eight requests."""

from __future__ import annotations

import pytest

from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.kv_cache import (
    NONE_HASH,
    BlockPool,
    BlockRemoved,
    BlockStored,
    hash_block_tokens,
    hash_request_tokens,
)
from testkit.factories import make_sim_request, run_alone, seq


def test_hashes_cover_full_blocks_only_and_chain_on_the_parent() -> None:
    tokens = seq(1, 50)
    hashes = hash_request_tokens(tokens, 16)
    assert len(hashes) == 3  # 50 tokens: three full blocks, the tail of 2 is not hashed
    assert hashes[0] == hash_block_tokens(NONE_HASH, tokens[:16])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:32])
    assert hash_request_tokens(tokens[:48], 16) == hashes  # same prefix, same hashes
    assert hash_request_tokens([9, *tokens], 16)[0] != hashes[0]


def test_salt_enters_the_first_block_and_changes_the_whole_chain() -> None:
    tokens = seq(1, 48)
    plain = hash_request_tokens(tokens, 16)
    salted = hash_request_tokens(tokens, 16, "tenant-b")
    assert salted[0] == hash_block_tokens(NONE_HASH, tokens[:16], "tenant-b")
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32])  # no salt after block 0
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert hash_request_tokens(tokens, 16, "tenant-b") == salted


def test_the_eight_worked_requests() -> None:
    """The document's Go program, through the engine: cached tokens per request."""
    engine = Engine(EngineConfig(block_size=16))
    system, user_a, user_b, follow_up = seq(1, 50), seq(2, 20), seq(3, 20), seq(5, 12)
    first = run_alone(engine, make_sim_request(system + user_a, max_tokens=30))
    answer_a = list(first.output_token_ids)  # the engine's own answer plays answerA
    assert len(answer_a) == 30
    cases = [
        ("2. same system prompt, different question", system + user_b, None, 48),
        ("3. next turn of conversation 1", system + user_a + answer_a + follow_up, None, 96),
        ("4. timestamp before the system prompt", seq(9, 1) + system + user_a, None, 0),
        ("5. request 1 again, cache_salt=tenant-b", system + user_a, "tenant-b", 0),
        ("6. the same, from tenant-b again", system + user_a, "tenant-b", 64),
        ("7. a 64-token prompt, first time", seq(7, 64), None, 0),
        ("8. exactly the same 64-token prompt again", seq(7, 64), None, 48),
    ]
    got = [(first.num_prompt_tokens, first.num_cached_tokens)]
    for _, prompt, salt, _ in cases:
        fin = run_alone(engine, make_sim_request(prompt, salt=salt))
        got.append((fin.num_prompt_tokens, fin.num_cached_tokens))
    assert got == [(70, 0)] + [(len(p), hit) for _, p, _, hit in cases]
    stats = engine.stats()
    assert stats.prefix_cache_queries == sum(n for n, _ in got)
    assert stats.prefix_cache_hits == 48 + 96 + 64 + 48


@pytest.mark.parametrize(
    ("num_tokens", "expected_hit"),
    [
        pytest.param(160, 144, id="160-identical-recomputes-last-block"),
        pytest.param(161, 160, id="161-one-more-token-hits-all-ten-blocks"),
        pytest.param(17, 16, id="17"),
        pytest.param(16, 0, id="16-one-block-never-hits"),
        pytest.param(1, 0, id="1"),
    ],
)
def test_hit_never_includes_the_last_token(num_tokens: int, expected_hit: int) -> None:
    engine = Engine(EngineConfig(block_size=16))
    prompt = seq(4, num_tokens)
    run_alone(engine, make_sim_request(prompt))
    assert run_alone(engine, make_sim_request(prompt)).num_cached_tokens == expected_hit


def test_lookup_stops_at_the_first_miss() -> None:
    engine = Engine(EngineConfig(block_size=4))
    prompt = seq(1, 17)
    run_alone(engine, make_sim_request(prompt))
    changed = prompt[:4] + [99_999] + prompt[5:]  # block 1 differs, blocks 2-3 as before
    assert run_alone(engine, make_sim_request(changed)).num_cached_tokens == 4


def test_pool_caches_identical_blocks_twice_as_vllm_does() -> None:
    """No de-duplication: both blocks are cached (and announced); a hit takes the first
    one; evicting either says so, and the hash stays findable while one is left."""
    pool = BlockPool(3, enable_kv_cache_events=True)  # the null block and two
    blocks = pool.get_new_blocks(2)
    h = hash_block_tokens(NONE_HASH, [1, 2])
    pool.cache_full_blocks(blocks[:1], [h], 0, 1, [1, 2], 2, None)
    pool.cache_full_blocks(blocks[1:], [h], 0, 1, [1, 2], 2, None)
    assert pool.get_cached_block(h) is blocks[0]
    assert blocks[1].block_hash == h and pool.num_cached_blocks == 1
    assert [type(e) for e in pool.take_events()] == [BlockStored, BlockStored]
    pool.free_blocks(blocks)
    (evicted,) = pool.get_new_blocks(1)  # the least recently freed: blocks[0]
    assert evicted is blocks[0]
    assert pool.get_cached_block(h) is blocks[1]
    assert pool.take_events() == [BlockRemoved((h,))]
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is None and pool.num_cached_blocks == 0
    assert pool.take_events() == [BlockRemoved((h,))]
    assert pool.num_evicted_blocks == 2


def test_block_0_is_the_null_block_and_unhashed_blocks_are_reused_first() -> None:
    """vLLM's BlockPool: block 0 is never handed out (usage counts the others); freed
    blocks without a hash go to the front of the free queue, tail first, hashed ones to
    its back, so a cached prefix outlives a request's partial last block."""
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5 and pool.usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and pool.usage() == 0.6
    pool.cache_full_blocks(blocks, [hash_block_tokens(NONE_HASH, [1])], 0, 1, [1], 1, None)
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 2, 4, 5, 1]
