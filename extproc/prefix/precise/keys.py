"""extproc's own block keys: a chain over the blocks' token ids, the engine's hash ignored.

A block's key is ``XXH3-64(token ids as little-endian uint32 + packed extra keys,
seed=parent key)``, the first block's parent being ``ROOT``. The engine's own hashes
depend on its algorithm and, for xxHash, on a per-process seed (``PYTHONHASHSEED``), so
a router cannot recompute them; token ids it can. ``extra`` is vLLM's per-block extra
key tuple as its KV events publish it (untagged: the LoRA name on every block, then
``cache_salt`` on the first block only), so a salted or LoRA chain never meets another.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import xxhash

from extproc.kernels import chain_xxh3

# ``array("I")`` packs 4 bytes a token in the machine's order: little-endian uint32 where
# this holds (checked, not assumed).
_ARRAY_PACKS_LE_U32 = sys.byteorder == "little" and array("I").itemsize == 4
ROOT = 0x9E37_79B9_7F4A_7C15  # the parent of every chain's first block; any constant works

Tokens = Sequence[int] | npt.NDArray[np.uint32]


def token_bytes(tokens: Tokens) -> bytes:
    """``tokens`` as little-endian uint32 bytes (OverflowError for an id out of range). A
    list, as KV events decode, is packed by ``array``: faster than NumPy from a list."""
    if type(tokens) is list and _ARRAY_PACKS_LE_U32:
        return array("I", tokens).tobytes()
    return np.asarray(tokens, dtype="<u4").tobytes()


def block_key(parent: int, data: bytes, extra: Sequence[Any] | None) -> int:
    """The key of one block whose token ids are ``data`` (``token_bytes``) under ``parent``."""
    if extra:
        data += msgpack.packb(list(extra))
    return xxhash.xxh3_64_intdigest(data, seed=parent)


def request_extra(index: int, salt: str | None, lora: str | None) -> tuple[str, ...] | None:
    """The extra keys vLLM gives block ``index`` of a request (``generate_block_hash_extra_keys``
    then ``to_event_extra_keys``): the LoRA name, then the salt on block 0 only."""
    parts = ([lora] if lora else []) + ([salt] if salt and index == 0 else [])
    return tuple(parts) or None


def chain_keys(
    tokens: Tokens,
    block_size: int,
    salt: str | None = None,
    lora: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of every full block of a request's ``tokens`` (a short tail has none)."""
    num = len(tokens) // block_size
    if max_blocks is not None:
        num = min(num, max_blocks)
    data = token_bytes(tokens[: num * block_size])
    # block_key's extra bytes: block 0's (LoRA name and salt), then the others' (the name)
    first, rest = (_packed(request_extra(i, salt, lora)) for i in (0, 1))
    return chain_xxh3(data, 4 * block_size, num, ROOT, first, rest)


def chain_from(
    parent: int, data: bytes, step: int, num: int, extras: Sequence[Sequence[Any] | None] | None
) -> list[int]:
    """The keys of ``num`` blocks of ``data`` (``step`` bytes each) chained from ``parent``,
    block ``i`` with the extra keys ``extras[i]`` (none past the list's end), as
    ``block_key`` makes them one by one: one kernel call when the blocks after the first
    carry the same extra bytes (the usual event: none, or a LoRA name on every block)."""
    if not extras:
        return chain_xxh3(data, step, num, parent, b"", b"")
    packed = [_packed(extras[i]) if i < len(extras) else b"" for i in range(num)]
    if all(extra == packed[-1] for extra in packed[1:]):
        first = packed[0] if packed else b""
        return chain_xxh3(data, step, num, parent, first, packed[-1] if num > 1 else b"")
    keys: list[int] = []
    for i in range(num):  # extra keys that change along the chain: a block at a time
        parent = block_key(
            parent, data[i * step : (i + 1) * step], extras[i] if i < len(extras) else None
        )
        keys.append(parent)
    return keys


def _packed(extra: Sequence[Any] | None) -> bytes:
    """What ``block_key`` appends to a block's token bytes for ``extra``."""
    return msgpack.packb(list(extra)) if extra else b""
