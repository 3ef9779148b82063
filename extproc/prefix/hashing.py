"""Prompt -> chained block hashes, byte-compatible with Kthena's router.

The prompt's UTF-8 bytes are cut into ``block_size``-byte blocks (the last may be
shorter; a multi-byte character may be split), at most ``max_blocks`` of them, and
chained with XXH64, seed 0::

    h0 = XXH64(model)
    h[i] = XXH64(decimal(h[i-1]) + block[i])     # the unsigned decimal text, then the bytes

``cache_salt`` isolates tenants the way vLLM does (``vllm-prefix-caching.txt``): it is
folded into the start of the chain, so every hash of a salted prompt differs from every
hash of an unsalted one or one with another salt. The salted start is hashed with a
different XXH64 seed than the chain, so no unsalted prompt can be crafted to reproduce a
salted chain. A request without a salt hashes exactly as Kthena's router does.

The chain is the ``chain_xxh64`` kernel (``extproc.kernels``: xxHash's C over the
blocks, or its pure reference, a Python call per block). A one-pass digest of the same
bytes is cheaper still, and prompts repeat their start often (a shared system prompt and
tools, a retried request), so the chains of the last ``MEMO_SIZE`` distinct prompt starts
are kept, keyed by an XXH3-128 digest of the hashed bytes, as the read-only int64 array
(same bits) that ``PrefixIndex`` takes; ``prompt_keys`` hands out a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

from extproc.kernels import chain_xxh64
from extproc.memo import FifoMemo

PromptBlockHash = NewType("PromptBlockHash", int)  # XXH64 of a block of prompt bytes, chained
Keys = npt.NDArray[np.int64]  # block hashes as int64 with the same bits (``PrefixIndex``)

# Seed for the salted chain start only; any value but 0 (the chain's seed) would do.
SALT_SEED = 0x5A17_CAC4E_5A17 & 0xFFFF_FFFF_FFFF_FFFF

_xxh64 = xxhash.xxh64_intdigest
_digest = xxhash.xxh3_128_intdigest

MEMO_SIZE = 4096  # distinct prompt starts whose chains are kept (about 5 KB each at most)


def chain_start(model: str, salt: str | None = None) -> int:
    """The chain's parent for block 1: XXH64(model), salted when a salt is given."""
    start = _xxh64(model.encode())
    if salt is None:
        return start
    return _xxh64(b"%d\x00cache_salt=%s" % (start, salt.encode()), SALT_SEED)


def hash_prompt(
    model: str,
    prompt: str,
    block_size: int = 64,
    max_blocks: int = 128,
    salt: str | None = None,
) -> list[PromptBlockHash]:
    """The prompt's block hashes as Kthena's router computes them (salt: see module doc).

    Args:
        model: the model name; the chain starts at its hash, so models never share.
        prompt: the rendered prompt (``extproc.request.parse``).
        block_size: bytes per block (``blockSizeToHash``).
        max_blocks: blocks hashed at most (``maxBlocksToMatch``); later text is ignored.
        salt: the request's ``cache_salt``, if any.

    Returns:
        One hash per block, in prompt order; empty for an empty prompt.
    """
    hashes: list[PromptBlockHash] = (
        prompt_keys(model, prompt, block_size, max_blocks, salt).view(np.uint64).tolist()
    )
    return hashes


def prompt_keys(
    model: str,
    prompt: str,
    block_size: int = 64,
    max_blocks: int = 128,
    salt: str | None = None,
) -> Keys:
    """``hash_prompt`` as an int64 array with the same bits (chains memoized)."""
    if block_size <= 0 or max_blocks <= 0:
        raise ValueError(f"block_size and max_blocks must be > 0, got {block_size}, {max_blocks}")
    limit = block_size * max_blocks
    data = prompt[:limit].encode()[:limit]  # a character is at least a byte: no more needed
    key = (model, salt, block_size, max_blocks, _digest(data))
    chain = _CHAINS.get(
        key, lambda: _read_only(chain_xxh64(data, block_size, max_blocks, chain_start(model, salt)))
    )
    return chain.copy()  # the memo's own array stays as computed, whatever the caller does


def as_keys(hashes: Sequence[int] | Keys) -> Keys:
    """Unsigned 64-bit hashes as the int64 array the index works on (same bits)."""
    if isinstance(hashes, np.ndarray):
        return hashes
    return np.fromiter(hashes, dtype=np.uint64, count=len(hashes)).view(np.int64)


def _read_only(keys: Keys) -> Keys:
    keys.flags.writeable = False  # shared by every request with this prompt start
    return keys


# (model, salt, block size, max blocks, digest of the hashed bytes) -> the chain
_CHAINS: FifoMemo[tuple[str, str | None, int, int, int], Keys] = FifoMemo(MEMO_SIZE)
