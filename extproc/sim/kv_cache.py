"""Block hashes and the block pool: vLLM's prefix cache, as ``vllm-prefix-caching.txt`` tells it.

Hashes. Only full blocks of ``block_size`` tokens are hashed, each chained on its
parent's hash; the chain starts from ``NONE_HASH``, fixed so every process agrees::

    h[i] = low64(SHA-256(h[i-1] as 8 bytes big-endian
                         + block i's tokens as little-endian uint32
                         + b"lora=" + name + b"\0" + path  if the request has an adapter
                         + b"cache_salt=" + salt  if i == 0 and a salt is given))

The salt enters the first block only; every later hash inherits it through the chain.
A LoRA adapter's name and path enter every block, as vLLM's extra keys put
``("lora", name, path)`` on each: an adapter's blocks never serve the base model or
another adapter (or the same name loaded from another path).
A hash is the digest's last 8 bytes as an unsigned int, which is also the integer form
vLLM puts in its KV-cache events.

Pool. ``num_gpu_blocks`` blocks, each with a reference count; as in vLLM, block 0 is the
null block, never handed out, so ``num_gpu_blocks - 1`` hold KV (usage is their share in
use). Blocks of running requests are pinned (count > 0). Free blocks wait in a queue and
are taken from its front; a free block may still hold a cached hash, and taking it for
new data evicts that hash. Like vLLM's ``BlockPool``, a request's blocks are freed tail
first: those with a cached hash join the back of the queue (least recently freed are
evicted first, a prompt's last blocks before its first ones), those without one (a
partial last block) its front, to be reused first. Only the pool edits the hash map and
the free queue.

As in vLLM, cached blocks are not de-duplicated: when two requests compute the same
block (two identical prompts side by side, or a prompt of whole blocks sent again, whose
last block is always recomputed), both blocks are cached under its hash, each with its
own ``BlockStored`` and, when evicted, its own ``BlockRemoved``; a hit takes the first
one cached, and the hash stays findable while one is left.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from extproc.sim.lora import LoraRequest

# vLLM's hash of one block of token ids: the low 64 bits of a SHA-256 digest
TokenBlockHash = NewType("TokenBlockHash", int)

NONE_HASH = TokenBlockHash(
    int.from_bytes(hashlib.sha256(b"extproc-sim-none-hash").digest()[-8:], "big")
)


def hash_block_tokens(
    parent_block_hash: TokenBlockHash,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora: LoraRequest | None = None,
) -> TokenBlockHash:
    """One link of the chain (module docstring); ``cache_salt`` only for block 0."""
    h = hashlib.sha256(parent_block_hash.to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if lora is not None:
        h.update(b"lora=" + lora.name.encode() + b"\0" + lora.path.encode())
    if cache_salt is not None:
        h.update(b"cache_salt=" + cache_salt.encode())
    return TokenBlockHash(int.from_bytes(h.digest()[-8:], "big"))


def extend_block_hashes(
    block_hashes: list[TokenBlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora: LoraRequest | None = None,
) -> None:
    """Append the hashes of ``token_ids``' full blocks not yet in ``block_hashes``."""
    for idx in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[idx - 1] if idx else NONE_HASH
        chunk = token_ids[idx * block_size : (idx + 1) * block_size]
        salt = cache_salt if idx == 0 else None
        block_hashes.append(hash_block_tokens(parent, chunk, salt, lora))


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora: LoraRequest | None = None,
) -> list[TokenBlockHash]:
    """The hashes of every full block of ``token_ids``."""
    out: list[TokenBlockHash] = []
    extend_block_hashes(out, token_ids, block_size, cache_salt, lora)
    return out


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, consecutive in one request's chain."""

    block_hashes: tuple[TokenBlockHash, ...]
    parent_block_hash: TokenBlockHash | None  # None when the first stored block is block 0
    token_ids: tuple[int, ...]
    block_size: int
    # per block, as vLLM's events carry them: the adapter's name, then the salt on block 0
    extra_keys: tuple[tuple[str, ...] | None, ...]
    lora_id: int | None = None  # the adapter's lora_int_id
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """One cached block evicted."""

    block_hashes: tuple[TokenBlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: TokenBlockHash | None = None


def _event_extra_keys(
    index: int, cache_salt: str | None, lora: LoraRequest | None
) -> tuple[str, ...] | None:
    """Block ``index``'s extra keys as vLLM's events publish them (untagged): the
    adapter's name on every block, then the salt on block 0."""
    keys = ([lora.name] if lora else []) + (
        [cache_salt] if index == 0 and cache_salt is not None else []
    )
    return tuple(keys) or None


class BlockPool:
    """The blocks, the free queue (LRU) and the hash -> block map; see the module docstring."""

    def __init__(self, num_gpu_blocks: int, enable_kv_cache_events: bool = False) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # Front = the next taken. Keyed by block_id; block 0 is the null block, never free.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        # hash -> the blocks cached under it, by block_id, first cached first
        self._cached: dict[TokenBlockHash, dict[int, KVCacheBlock]] = {}
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Distinct hashes cached: a hash cached in two blocks counts once, as in the
        length of vLLM's hash map (and in a view built from the pool's events)."""
        return len(self._cached)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV: all but the null block."""
        return self.num_gpu_blocks - 1

    def usage(self) -> float:
        """vLLM's KV-cache usage: the share of usable blocks not free (0.0-1.0)."""
        if not self.num_usable_blocks:
            return 0.0
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_cached_block(self, block_hash: TokenBlockHash) -> KVCacheBlock | None:
        """The first block cached under ``block_hash``, if any."""
        blocks = self._cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def find_longest_cache_hit(
        self, block_hashes: Sequence[TokenBlockHash], num_tokens: int, block_size: int
    ) -> list[KVCacheBlock]:
        """Cached blocks from the start, stopping at the first miss.

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always
        computed, to get logits. Nothing is touched.
        """
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: (num_tokens - 1) // block_size]:
            block = self.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Pin hit blocks for a request: out of the free queue, reference count up."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free queue, evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot take {num_blocks} blocks, {len(self._free)} free")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        blocks = self._cached[block_hash]
        del blocks[block.block_id]
        if not blocks:
            del self._cached[block_hash]
        self.num_evicted_blocks += 1
        if self._events is not None:
            self._events.append(BlockRemoved((block_hash,)))
        block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Unpin blocks; those no longer used join the free queue in the given order: at
        its back with a cached hash, at its front without one (module docstring)."""
        unhashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(unhashed):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[TokenBlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
        lora: LoraRequest | None = None,
    ) -> None:
        """Register a request's blocks ``num_cached_blocks..num_full_blocks-1`` as cached,
        with one ``BlockStored`` for them, as vLLM does per request and step.

        Their KV is (being) computed, so later requests may hit them.
        """
        if num_full_blocks <= num_cached_blocks:
            return
        for idx in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[idx], block_hashes[idx]
            assert block.block_hash is None
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
        if self._events is None:
            return
        first = num_cached_blocks
        self._events.append(
            BlockStored(
                block_hashes=tuple(block_hashes[first:num_full_blocks]),
                parent_block_hash=block_hashes[first - 1] if first else None,
                token_ids=tuple(token_ids[first * block_size : num_full_blocks * block_size]),
                block_size=block_size,
                extra_keys=tuple(
                    _event_extra_keys(i, cache_salt, lora) for i in range(first, num_full_blocks)
                ),
                lora_id=lora.int_id if lora else None,
                lora_name=lora.name if lora else None,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, as vLLM does: only when no block is in use (else False)."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (empty when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events
