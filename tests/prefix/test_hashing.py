"""Block hashing: Kthena's chain bit for bit, coverage, multi-byte text and salts."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kernels import chain_xxh64
from extproc.memo import FifoMemo
from extproc.prefix import hash_prompt, hashing
from extproc.prefix.hashing import PromptBlockHash, chain_start, prompt_keys


def reference_chain(model: str, data: bytes, block_size: int) -> list[int]:
    """The spec's chain, written independently with xxhash's streaming object."""
    prev = xxhash.xxh64(model.encode(), seed=0).intdigest()
    out = []
    for i in range(0, len(data), block_size):
        h = xxhash.xxh64(seed=0)
        h.update(str(prev).encode("ascii"))
        h.update(data[i : i + block_size])
        prev = h.intdigest()
        out.append(prev)
    return out


def test_matches_the_spec_chain_bit_for_bit() -> None:
    prompt = "You are a helpful assistant. " * 40
    assert hash_prompt("qwen", prompt) == reference_chain("qwen", prompt.encode(), 64)


def test_worked_example_2000_bytes_is_32_blocks_last_one_short() -> None:
    prompt = "a" * 2000
    hashes = hash_prompt("m", prompt)
    assert len(hashes) == 32  # 31 full blocks and one of 16 bytes
    assert hashes == reference_chain("m", prompt.encode(), 64)


def test_only_the_first_8192_bytes_are_hashed() -> None:
    base = "x" * 8192
    assert len(hash_prompt("m", base)) == 128
    assert hash_prompt("m", base + "tail that differs") == hash_prompt("m", base + "other")
    assert hash_prompt("m", base, max_blocks=200) != hash_prompt("m", base + "y", max_blocks=200)


def test_multibyte_text_is_cut_in_bytes_not_characters() -> None:
    prompt = "路由器" * 30  # 3 bytes per character: 270 bytes
    hashes = hash_prompt("m", prompt)
    assert len(hashes) == 5  # ceil(270 / 64): characters split across blocks
    assert hashes == reference_chain("m", prompt.encode("utf-8"), 64)


def test_models_never_share_hashes() -> None:
    assert not set(hash_prompt("a", "same text")) & set(hash_prompt("b", "same text"))


def test_empty_prompt_has_no_blocks() -> None:
    assert hash_prompt("m", "") == []


def test_salts_isolate_and_no_salt_is_plain_kthena() -> None:
    prompt = "shared system prompt " * 20
    plain = hash_prompt("m", prompt)
    a = hash_prompt("m", prompt, salt="tenant-a")
    b = hash_prompt("m", prompt, salt="tenant-b")
    assert hash_prompt("m", prompt, salt=None) == reference_chain("m", prompt.encode(), 64)
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert hash_prompt("m", prompt, salt="tenant-a") == a  # same salt shares


def test_no_unsalted_prompt_reproduces_a_salted_chain() -> None:
    """The salted start uses another XXH64 seed: a block spelling the salt does not help."""
    start = xxhash.xxh64_intdigest(b"m")
    crafted = (b"%d\x00cache_salt=t" % start)[len(b"%d" % start) :].decode()
    salted = hash_prompt("m", "hello", salt="t")
    assert not set(salted) & set(hash_prompt("m", crafted + "hello", block_size=len(crafted)))


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.text(max_size=600), st.text(max_size=300), st.sampled_from([1, 7, 64]))
def test_hashes_of_a_prefix_are_a_prefix_of_the_longer_prompts_hashes(
    head: str, tail: str, block_size: int
) -> None:
    short = hash_prompt("m", head, block_size=block_size, max_blocks=1000)
    long = hash_prompt("m", head + tail, block_size=block_size, max_blocks=1000)
    full_blocks = len(head.encode()) // block_size
    assert long[:full_blocks] == short[:full_blocks]


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.binary(min_size=1, max_size=400), st.binary(min_size=1, max_size=400))
def test_different_first_block_changes_every_hash(a: bytes, b: bytes) -> None:
    if a[:64] == b[:64]:
        return
    ha = hash_prompt("m", a.decode("latin-1"))
    hb = hash_prompt("m", b.decode("latin-1"))
    assert not set(ha) & set(hb)


# -- the memo of recent chains ---------------------------------------------------------


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(
    st.text(max_size=300),
    st.sampled_from(["m", "other-model"]),
    st.sampled_from([None, "tenant-a", "tenant-b"]),
    st.sampled_from([(64, 128), (16, 4), (64, 2)]),
)
def test_remembered_chains_equal_freshly_computed_ones(
    prompt: str, model: str, salt: str | None, geometry: tuple[int, int]
) -> None:
    block_size, max_blocks = geometry
    fresh = (
        chain_xxh64(
            prompt.encode("utf-8", "surrogatepass")[: block_size * max_blocks],
            block_size,
            max_blocks,
            chain_start(model, salt),
        )
        .view(np.uint64)
        .tolist()
    )
    for _ in range(2):  # computed, then remembered
        assert hash_prompt(model, prompt, block_size, max_blocks, salt) == fresh


def test_the_memo_keeps_models_salts_and_geometries_apart() -> None:
    prompt = "shared system prompt " * 20
    chains = {
        tuple(hash_prompt(model, prompt, bs, mb, salt))
        for model in ("m", "n")
        for salt in (None, "s")
        for bs, mb in ((64, 128), (32, 128))
    }
    assert len(chains) == 8


def test_the_memo_is_bounded_and_forgets_the_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memo: FifoMemo[tuple[str, str | None, int, int, int], tuple[PromptBlockHash, ...]] = FifoMemo(3)
    monkeypatch.setattr(hashing, "_CHAINS", memo)
    for i in range(5):
        hash_prompt("m", f"prompt {i}")
    assert len(memo) == 3
    for i in range(5):
        key = ("m", None, 64, 128, xxhash.xxh3_128_intdigest(b"prompt %d" % i))
        assert (key in memo) == (i >= 2)
    returned = hash_prompt("m", "prompt 4")
    returned.append(PromptBlockHash(0))  # a caller's list is its own
    assert hash_prompt("m", "prompt 4") == reference_chain("m", b"prompt 4", 64)


def test_prompt_keys_are_the_hashes_bits_and_a_callers_own_copy() -> None:
    prompt = "a shared system prompt " * 40
    keys = prompt_keys("m", prompt)
    assert keys.dtype == np.int64
    assert keys.view(np.uint64).tolist() == hash_prompt("m", prompt)
    expected = hash_prompt("m", prompt)
    keys[:] = 0  # a caller scribbling on its array leaves the memoized chain alone
    assert prompt_keys("m", prompt).view(np.uint64).tolist() == expected
    assert hash_prompt("m", prompt) == expected and 0 not in expected
