"""The simulated vLLM engine: admission, continuous batching, block allocation, timing.

No I/O and no clock of its own: every call says what time it is, so a discrete-event
simulator drives it with a virtual clock and ``runner.EngineRunner`` with the loop's.

One step, as in vLLM's scheduler (``step(now)``, starting at ``max(now, clock)``):

1. Every running request that has its first token decodes one more: the KV of its last
   sampled token is computed (a new block is taken when the last one is full).
2. Waiting requests are admitted first come, first served, while fewer than
   ``max_num_seqs`` run, the prefill token budget (``max_num_batched_tokens``) lasts
   (the step's first prefill always fits: no chunked prefill) and blocks suffice. The
   head of the queue blocks the rest. On admission the prefix cache is looked up, the
   hit blocks are pinned, the rest of the prompt gets new blocks and its full blocks
   are cached at once (vLLM caches at scheduling time), and the counters
   ``prefix_cache_queries`` (prompt tokens) and ``prefix_cache_hits`` (hit tokens) grow.
   A request waiting in the queue is not counted until admitted.
3. The step lasts ``(step_base_s + decode_s_per_seq * running
   + prefill_s_per_token * uncached prompt tokens admitted) * time_scale``; at its end
   every running request samples one token. A request with ``max_tokens`` tokens
   finishes (``finish_reason`` "length") and its blocks are freed, tail first.

Blocks. A request keeps the KV of its prompt and of every generated token but the last
(``prompt + max_tokens - 1`` tokens), so admission reserves that many blocks up front:
no running request ever runs out and nothing is preempted. A request that could never
fit (more blocks than ``num_gpu_blocks``, or longer than ``max_model_len``) is rejected
by ``add_request``.

A discrete-event loop over several engines::

    engine.add_request(req, now=t)         # at each arrival, in time order
    while engine.has_work() and engine.clock < t_next_arrival:
        result = engine.step(engine.clock) # outputs happen at result.end_s
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

from extproc.errors import ConfigError
from extproc.sim.kv_cache import (
    BlockPool,
    KVCacheBlock,
    KVCacheEvent,
    TokenBlockHash,
    extend_block_hashes,
)
from extproc.sim.tokenizer import generate_words, word_token


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings. The timing defaults are assumptions, roughly an 8B model on one
    modern GPU: prefill about 10,000 tokens/s, decode steps of about 10 ms plus 0.1 ms per
    running sequence. Memory: 8192 blocks of 16 tokens, 131,072 tokens of KV."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_gpu_blocks: int = field(default=8192, metadata={"help": "KV blocks in the cache"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=8192, metadata={"help": "prefill token budget of one step"}
    )
    max_model_len: int = field(default=32768, metadata={"help": "most prompt + output tokens"})
    max_num_waiting: int = field(
        default=4096, metadata={"help": "most requests queued; more are refused"}
    )
    prefill_s_per_token: float = field(
        default=1e-4, metadata={"help": "step time per uncached prompt token, s"}
    )
    step_base_s: float = field(default=0.010, metadata={"help": "fixed time of one step, s"})
    decode_s_per_seq: float = field(
        default=1e-4, metadata={"help": "step time per running request, s"}
    )
    time_scale: float = field(
        default=1.0, metadata={"help": "multiplies every step time (0.01 = 100x faster)"}
    )
    enable_kv_cache_events: bool = field(
        default=False, metadata={"help": "record BlockStored/BlockRemoved events"}
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"EngineConfig.{f.name} must be > 0, got {value}")
            if isinstance(value, float) and not value >= 0:  # also catches NaN
                raise ConfigError(f"EngineConfig.{f.name} must be >= 0, got {value}")
        if self.time_scale <= 0:
            raise ConfigError(f"EngineConfig.time_scale must be > 0, got {self.time_scale}")


class RequestRejected(Exception):
    """``add_request`` refused a request; the message says why."""


class RequestTooLarge(RequestRejected):
    """The request can never run: longer than max_model_len, or more blocks than exist."""


class QueueFull(RequestRejected):
    """``max_num_waiting`` requests are already queued."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 16
    cache_salt: str | None = None
    seed: int = 0  # varies the generated words; the prompt alone fixes them otherwise


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One sampled token, at the end of a step."""

    request_id: str
    index: int  # 0 for the first token
    token_id: int
    text: str
    latency_s: float  # time to first token for index 0, else time since the previous token
    finished: bool


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit at admission
    output_token_ids: tuple[int, ...]
    output_text: str
    arrival_s: float
    scheduled_s: float  # start of the step that admitted it
    first_token_s: float
    finished_s: float
    finish_reason: str = "length"

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.scheduled_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class StepResult:
    start_s: float
    end_s: float
    admitted: tuple[tuple[str, int], ...]  # (request_id, num_cached_tokens)
    outputs: tuple[TokenOutput, ...]
    finished: tuple[FinishedRequest, ...]


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0.0-1.0, vLLM's definition (cached free blocks count as free)
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int  # prompt tokens of admitted requests
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_evicted_blocks: int
    num_finished_requests: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int


@dataclass(slots=True, eq=False)
class _Request:
    req: SimRequest
    arrival_s: float
    words: list[str]
    token_ids: list[int]  # prompt, then every sampled token
    block_hashes: list[TokenBlockHash]
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # blocks already offered to the cache
    num_cached_tokens: int = 0
    num_reserved_blocks: int = 0  # still to take, of the blocks admission reserved
    scheduled_s: float = 0.0
    first_token_s: float = 0.0
    last_token_s: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.req.prompt_token_ids)


class Engine:
    """One simulated vLLM engine; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.pool = BlockPool(self.config.num_gpu_blocks, self.config.enable_kv_cache_events)
        self.clock = 0.0  # end of the last step; the next step starts no earlier
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._num_reserved_blocks = 0
        self._queries = self._hits = 0
        self._num_finished = self._num_prompt_tokens = self._num_generation_tokens = 0
        self._num_steps = 0

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue ``req``, arrived at ``now``.

        Raises:
            RequestTooLarge: it could never run on this engine.
            QueueFull: ``max_num_waiting`` requests wait already.
            ValueError: empty prompt, ``max_tokens`` < 1, or a request id in use.
        """
        cfg = self.config
        num_prompt = len(req.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt has no tokens")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if req.request_id in self._ids:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if num_prompt + req.max_tokens > cfg.max_model_len:
            raise RequestTooLarge(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {num_prompt + req.max_tokens} tokens ({num_prompt} in the "
                f"messages, {req.max_tokens} in the completion). Please reduce the length of "
                "the messages or completion."
            )
        num_blocks = _cdiv(num_prompt + req.max_tokens - 1, cfg.block_size)
        if num_blocks > cfg.num_gpu_blocks:
            raise RequestTooLarge(
                f"the request needs {num_blocks} KV blocks of {cfg.block_size} tokens "
                f"({num_prompt} prompt + {req.max_tokens} output tokens) but the cache has "
                f"only num_gpu_blocks={cfg.num_gpu_blocks}"
            )
        if len(self._waiting) >= cfg.max_num_waiting:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_num_waiting)")
        if not self.has_work():
            self.clock = max(self.clock, now)  # an idle engine's next step starts at arrival
        prompt = list(req.prompt_token_ids)
        hashes: list[TokenBlockHash] = []
        extend_block_hashes(hashes, prompt, cfg.block_size, req.cache_salt)
        words = generate_words(req.prompt_token_ids, req.max_tokens, req.seed)
        self._waiting.append(_Request(req, now, words, prompt, hashes))
        self._ids.add(req.request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request, freeing its blocks; False if unknown."""
        for r in self._waiting:
            if r.req.request_id == request_id:
                self._waiting.remove(r)
                self._ids.discard(request_id)
                return True
        for r in self._running:
            if r.req.request_id == request_id:
                self._running.remove(r)
                self._release(r)
                return True
        return False

    def step(self, now: float) -> StepResult:
        """Run one step starting at ``max(now, clock)``; see the module docstring.

        Raises:
            RuntimeError: there is nothing to do (check ``has_work()``).
        """
        if not self.has_work():
            raise RuntimeError("step() on an idle engine")
        cfg = self.config
        start = max(now, self.clock)
        for r in self._running:
            self._compute_tokens(r, len(r.token_ids))
        admitted, num_prefill_tokens = self._admit(start)
        duration = (
            cfg.step_base_s
            + cfg.decode_s_per_seq * len(self._running)
            + cfg.prefill_s_per_token * num_prefill_tokens
        ) * cfg.time_scale
        end = start + duration
        self.clock = end
        self._num_steps += 1
        outputs: list[TokenOutput] = []
        finished: list[FinishedRequest] = []
        for r in list(self._running):
            index = r.num_output_tokens
            word = r.words[index]
            token_id = word_token(word)
            r.token_ids.append(token_id)
            latency = end - (r.arrival_s if index == 0 else r.last_token_s)
            if index == 0:
                r.first_token_s = end
            r.last_token_s = end
            done = index + 1 == r.req.max_tokens
            outputs.append(TokenOutput(r.req.request_id, index, token_id, word, latency, done))
            if done:
                self._running.remove(r)
                self._release(r)
                finished.append(self._finished(r, end))
        self._num_generation_tokens += len(outputs)
        return StepResult(start, end, tuple(admitted), tuple(outputs), tuple(finished))

    def advance_to(self, t: float) -> list[StepResult]:
        """Run back-to-back steps while there is work and the next would start before ``t``."""
        results: list[StepResult] = []
        while self.has_work() and self.clock < t:
            results.append(self.step(self.clock))
        return results

    def _admit(self, start: float) -> tuple[list[tuple[str, int]], int]:
        cfg, pool = self.config, self.pool
        admitted: list[tuple[str, int]] = []
        budget = cfg.max_num_batched_tokens
        num_prefill_tokens = 0
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            r = self._waiting[0]
            num_prompt = len(r.req.prompt_token_ids)
            hits = pool.find_longest_cache_hit(r.block_hashes, num_prompt, cfg.block_size)
            num_new_tokens = num_prompt - len(hits) * cfg.block_size
            if admitted and num_new_tokens > budget:
                break
            num_new_blocks = _cdiv(num_prompt + r.req.max_tokens - 1, cfg.block_size) - len(hits)
            num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
            available = pool.num_free_blocks - num_hits_free - self._num_reserved_blocks
            if num_new_blocks > available:
                break
            self._waiting.popleft()
            pool.touch(hits)
            r.blocks = list(hits)
            r.num_hashed_blocks = len(hits)
            r.num_computed_tokens = r.num_cached_tokens = len(hits) * cfg.block_size
            r.num_reserved_blocks = num_new_blocks
            r.scheduled_s = start
            self._num_reserved_blocks += num_new_blocks
            self._compute_tokens(r, num_prompt)
            self._running.append(r)
            self._queries += num_prompt
            self._hits += r.num_cached_tokens
            self._num_prompt_tokens += num_prompt
            budget -= num_new_tokens
            num_prefill_tokens += num_new_tokens
            admitted.append((r.req.request_id, r.num_cached_tokens))
        return admitted, num_prefill_tokens

    def _compute_tokens(self, r: _Request, num_tokens: int) -> None:
        """Give ``r`` blocks for ``num_tokens`` tokens of KV and cache its full blocks."""
        bs = self.config.block_size
        num_new = _cdiv(num_tokens, bs) - len(r.blocks)
        if num_new > 0:
            r.blocks += self.pool.get_new_blocks(num_new)
            r.num_reserved_blocks -= num_new
            self._num_reserved_blocks -= num_new
        r.num_computed_tokens = num_tokens
        num_full = num_tokens // bs
        if num_full > r.num_hashed_blocks:
            extend_block_hashes(r.block_hashes, r.token_ids[: num_full * bs], bs, r.req.cache_salt)
            self.pool.cache_full_blocks(
                r.blocks,
                r.block_hashes,
                r.num_hashed_blocks,
                num_full,
                r.token_ids,
                bs,
                r.req.cache_salt,
            )
            r.num_hashed_blocks = num_full

    def _release(self, r: _Request) -> None:
        self.pool.free_blocks(reversed(r.blocks))
        r.blocks = []
        self._num_reserved_blocks -= r.num_reserved_blocks
        r.num_reserved_blocks = 0
        self._ids.discard(r.req.request_id)

    def _finished(self, r: _Request, end: float) -> FinishedRequest:
        self._num_finished += 1
        num_prompt = len(r.req.prompt_token_ids)
        return FinishedRequest(
            request_id=r.req.request_id,
            num_prompt_tokens=num_prompt,
            num_cached_tokens=r.num_cached_tokens,
            output_token_ids=tuple(r.token_ids[num_prompt:]),
            output_text="".join(r.words),
            arrival_s=r.arrival_s,
            scheduled_s=r.scheduled_s,
            first_token_s=r.first_token_s,
            finished_s=end,
        )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (``AllBlocksCleared``); False while requests run, like vLLM."""
        if self._running:
            return False
        return self.pool.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV-cache events since the last call (needs ``enable_kv_cache_events``)."""
        return self.pool.take_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.pool.usage(),
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_evicted_blocks=self.pool.num_evicted_blocks,
            num_finished_requests=self._num_finished,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
        )
