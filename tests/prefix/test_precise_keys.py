"""The key chain of stored blocks: ``chain_from`` makes the keys ``block_key`` makes one
block at a time, whatever extra keys the event gives each block."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.prefix.precise.keys import ROOT, block_key, chain_from, token_bytes

# What vLLM's events give a block: nothing, a LoRA name, the salt on a request's first.
EXTRAS = st.sampled_from([None, [], ["lora-a"], ["lora-b"], ["lora-a", "salt"], [7], [7.0]])


def one_by_one(
    parent: int, data: bytes, step: int, num: int, extras: list[Any] | None
) -> list[int]:
    keys = []
    for i in range(num):
        extra = extras[i] if extras and i < len(extras) else None
        parent = block_key(parent, data[i * step : (i + 1) * step], extra)
        keys.append(parent)
    return keys


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    block_size=st.sampled_from([1, 4, 16]),
    parent=st.sampled_from([ROOT, 0, 2**64 - 1, 12345]),
    extras=st.none() | st.lists(EXTRAS, max_size=20),
    alike=st.booleans(),
)
def test_chain_from_makes_the_keys_block_key_makes(
    tokens: list[int], block_size: int, parent: int, extras: list[Any] | None, alike: bool
) -> None:
    """``alike``: the blocks after the first share one extra (the kernel's one call);
    else they are drawn apart, ``[7]`` against ``[7.0]`` among them (equal in Python,
    packed apart by msgpack)."""
    num = len(tokens) // block_size
    if alike and extras:
        extras = extras[:1] + [extras[-1]] * (num - 1)
    data = token_bytes(tokens[: num * block_size])
    step = 4 * block_size
    assert chain_from(parent, data, step, num, extras) == one_by_one(
        parent, data, step, num, extras
    )


def test_extra_keys_equal_in_python_but_packed_apart_are_kept_apart() -> None:
    data = token_bytes(range(3))
    extras: list[Any] = [None, [7], [7.0]]  # 7 == 7.0, but msgpack packs an int and a float
    assert chain_from(ROOT, data, 4, 3, extras) == one_by_one(ROOT, data, 4, 3, extras)
    assert chain_from(ROOT, data, 4, 3, extras) != chain_from(ROOT, data, 4, 3, [None, [7], [7]])


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_token_bytes_are_little_endian_uint32_from_a_list_or_an_array(tokens: list[int]) -> None:
    expected = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert token_bytes(tokens) == expected
    assert token_bytes(np.array(tokens, dtype=np.uint32)) == expected
    assert token_bytes(tuple(tokens)) == expected


def test_a_token_id_out_of_range_is_refused() -> None:
    for bad in ([-1], [2**32]):
        with pytest.raises(OverflowError):
            token_bytes(bad)
