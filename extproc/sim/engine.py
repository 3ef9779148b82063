"""The simulated vLLM engine: vLLM V1's scheduler, block allocation, timing.

No I/O and no clock of its own: every call says what time it is, so a discrete-event
simulator drives it with a virtual clock and ``runner.EngineRunner`` with the loop's.

A request wants its KV computed up to its last token (the prompt, then each sampled
token); ``num_computed_tokens`` is how far it got. One step (``step(now)``, starting at
``max(now, clock)``) follows vLLM V1's ``Scheduler.schedule`` with the FCFS policy,
within a token budget of ``max_num_batched_tokens`` and ``max_num_seqs`` running:

1. Running requests first, in order: each gets the tokens it still misses (1 for a
   decode, the rest of its prompt for an unfinished prefill), capped by the budget left.
   Blocks are allocated for them now, and every block they fill is cached at once (vLLM
   caches at scheduling time, so a later request in the same step can hit it). When the
   pool runs out, the last running request is preempted, repeatedly: its blocks are
   freed (tail first, so its prefix stays cached longest), its computed tokens reset,
   and it goes to the front of the waiting queue. If the request being scheduled is the
   one preempted, the running pass stops.
2. Waiting requests (FCFS, preempted ones in front), only if nothing was preempted this
   step, while the budget lasts and fewer than ``max_num_seqs`` run. The prefix cache is
   looked up (at most all tokens but the last, in whole blocks); the request is admitted
   only if blocks remain for its whole sequence so far (vLLM's
   ``scheduler_reserve_full_isl``), and then gets as many of its missing tokens as the
   budget allows: a chunk. With ``enable_chunked_prefill`` off a request that does not
   fit the budget left stops the queue. The head of the queue blocks the rest.
3. The step lasts ``profile.step_s(StepWork(prefill tokens, decoding requests, context
   tokens, prefilling requests)) * time_scale`` (``timing.py``); a request recomputing
   after a preemption prefills, one computing only its last sampled token decodes. At
   the step's end a request whose computed tokens reach its last token samples one (a
   partial prefill chunk samples nothing). A request with ``max_tokens`` tokens
   finishes (``finish_reason`` "length") and its blocks are freed, tail first.

A preempted request is recomputed later, prompt and sampled tokens alike, from whatever
of it the prefix cache still holds. Counters as vLLM's: ``prefix_cache_queries`` (tokens
looked up) and ``prefix_cache_hits`` grow when a request is admitted for the first time
(vLLM keeps the lookups of preempted requests apart, out of these counters);
``num_cached_tokens`` (the usage's cached tokens) is the hit of that first admission;
``num_preemptions`` counts preemptions; ``num_prompt_tokens`` grows at a request's first
token. A request that could never fit (more blocks than the pool's usable ones for
``prompt + max_tokens - 1`` tokens, or longer than ``max_model_len``) is rejected by
``add_request``.

LoRA (``enable_lora``, ``lora.py``), as vLLM's scheduler and worker: a step holds
requests of at most ``max_loras`` distinct adapters; a waiting request whose adapter
would exceed that is skipped (it keeps its place at the front of the queue, and
requests behind it may be admitted). Before computing, the step brings its adapters
into the GPU slots (``AdapterSlots``: one evicted is the least recently used of those
the step does not need); each adapter loaded makes the step ``lora_load_ms`` longer,
for every request in it, as vLLM loads adapters before the forward pass. An adapter's
blocks are hashed with its name and path (``kv_cache.py``). ``lora_request_states``
names the adapters as vLLM 0.32's ``vllm:lora_requests_info`` does.

Not modelled: async scheduling (vLLM's default, which schedules the next step while one
runs, so what a step frees or samples reaches the scheduler a step later), spec
decoding, ``long_prefill_token_threshold``, the priority policy.

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
from extproc.sim.lora import AdapterSlots, LoraRequest
from extproc.sim.timing import DEFAULT_PROFILE, StepWork, TimingProfile, timing_profile
from extproc.sim.tokenizer import generate_words, word_token


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings. The scheduler's defaults are vLLM's for its OpenAI server on an
    H100-class GPU (``max_num_batched_tokens`` 8192, ``max_num_seqs`` 1024, chunked
    prefill on), matching the default timing profile; memory: 8192 blocks of 16 tokens.

    ``timing_profile`` names a profile of ``timing.PROFILES``; tests may pass a
    ``TimingProfile`` itself (the flag takes names only).
    """

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_gpu_blocks: int = field(default=8192, metadata={"help": "KV blocks in the cache"})
    max_num_seqs: int = field(default=1024, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=8192, metadata={"help": "token budget of one step (prefill chunks and decodes)"}
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata={"help": "split prompts longer than the step's budget left over steps"},
    )
    max_model_len: int = field(default=32768, metadata={"help": "most prompt + output tokens"})
    max_num_waiting: int = field(
        default=4096, metadata={"help": "most requests queued; more are refused"}
    )
    timing_profile: str | TimingProfile = field(
        default=DEFAULT_PROFILE, metadata={"help": "how long a step takes (timing.py)"}
    )
    time_scale: float = field(
        default=1.0, metadata={"help": "multiplies every step time (0.01 = 100x faster)"}
    )
    enable_kv_cache_events: bool = field(
        default=False, metadata={"help": "record BlockStored/BlockRemoved events"}
    )
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (lora.py)"})
    max_loras: int = field(
        default=1, metadata={"help": "GPU slots: most distinct LoRA adapters in one step"}
    )
    # 50 ms: a rank-16 adapter of an 8B model is ~80 MB of bf16 safetensors, read at
    # ~2 GB/s from a local disk's page cache, then copied into the GPU slot.
    lora_load_ms: float = field(
        default=50.0,
        metadata={"help": "sim only: a step bringing an adapter into a slot lasts this longer"},
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
        self.profile()  # an unknown name fails here
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's own check: without chunks a longer prompt could never be scheduled.
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) is "
                f"smaller than max_model_len ({self.max_model_len}) with chunked prefill "
                "off; increase max_num_batched_tokens or decrease max_model_len"
            )

    def profile(self) -> TimingProfile:
        """The timing profile, resolved from its name."""
        if isinstance(self.timing_profile, TimingProfile):
            return self.timing_profile
        return timing_profile(self.timing_profile)


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
    # The answer's tokens as text, one ``word_token`` each, instead of generated words (a
    # tool call); as many as max_tokens.
    output_words: tuple[str, ...] | None = None
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model


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
    num_cached_tokens: int  # prefix-cache hit at its first admission
    output_token_ids: tuple[int, ...]
    output_text: str
    arrival_s: float
    scheduled_s: float  # start of the step that first admitted it
    first_token_s: float
    finished_s: float
    finish_reason: str = "length"
    num_preemptions: int = 0

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
    admitted: tuple[tuple[str, int], ...]  # first admissions: (request_id, num_cached_tokens)
    outputs: tuple[TokenOutput, ...]
    finished: tuple[FinishedRequest, ...]
    scheduled: tuple[tuple[str, int], ...] = ()  # (request_id, tokens computed), in order
    preempted: tuple[str, ...] = ()  # in the order they were preempted
    lora_loads: tuple[str, ...] = ()  # adapters brought into a slot by this step


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0.0-1.0, vLLM's definition (cached free blocks count as free)
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int  # tokens looked up at first admissions
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_evicted_blocks: int
    num_finished_requests: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int
    num_preemptions: int = 0
    num_lora_loads: int = 0  # adapters brought into a GPU slot (sim:lora_loads_total)
    # Running and waiting at the end of the last step, what vLLM's gauges report: its
    # SchedulerStats are made after each step's scheduling, so a request that arrived
    # since is not counted waiting until a step has passed it over.
    step_running: int = 0
    step_waiting: int = 0
    step_kv_cache_usage: float = 0.0  # so is its KV-cache use (frozen by aborts until a step)


@dataclass(slots=True, eq=False)
class _Request:
    req: SimRequest
    arrival_s: float
    words: list[str]
    token_ids: list[int]  # prompt, then every sampled token
    block_hashes: list[TokenBlockHash]  # of every full block of token_ids
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # blocks already offered to the cache
    num_cached_tokens: int | None = None  # set at the first admission
    num_preemptions: int = 0
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
        self.profile = self.config.profile()
        self.pool = BlockPool(self.config.num_gpu_blocks, self.config.enable_kv_cache_events)
        self.clock = 0.0  # end of the last step; the next step starts no earlier
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._queries = self._hits = self._num_preemptions = 0
        self._num_finished = self._num_prompt_tokens = self._num_generation_tokens = 0
        self._num_steps = 0
        # (running, waiting, KV-cache use) at the end of the last step
        self._step_counts: tuple[int, int, float] = (0, 0, 0.0)
        self.lora_slots = AdapterSlots(self.config.max_loras)
        self._num_lora_loads = 0
        # vLLM 0.32's LoRARequestStates: adapter -> its requests that have sampled a token
        # and not finished, adapters in the order they got their first such request
        self._lora_states: dict[str, set[str]] = {}

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
        if req.lora is not None and not cfg.enable_lora:
            raise ValueError(f"LoRA adapter {req.lora.name!r} requested but LoRA is not enabled")
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
        if num_blocks > self.pool.num_usable_blocks:
            raise RequestTooLarge(
                f"the request needs {num_blocks} KV blocks of {cfg.block_size} tokens "
                f"({num_prompt} prompt + {req.max_tokens} output tokens) but the cache has "
                f"only {self.pool.num_usable_blocks} (num_gpu_blocks={cfg.num_gpu_blocks}, "
                "one of them vLLM's null block)"
            )
        if len(self._waiting) >= cfg.max_num_waiting:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_num_waiting)")
        if not self.has_work():
            self.clock = max(self.clock, now)  # an idle engine's next step starts at arrival
        prompt = list(req.prompt_token_ids)
        hashes: list[TokenBlockHash] = []
        extend_block_hashes(hashes, prompt, cfg.block_size, req.cache_salt, req.lora)
        words = (
            list(req.output_words)
            if req.output_words is not None
            else generate_words(req.prompt_token_ids, req.max_tokens, req.seed)
        )
        self._waiting.append(_Request(req, now, words, prompt, hashes))
        self._ids.add(req.request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request, freeing its blocks; False if unknown."""
        for r in self._waiting:
            if r.req.request_id == request_id:
                self._waiting.remove(r)
                self._ids.discard(request_id)
                self._lora_finished(r)  # a preempted request had sampled tokens
                return True
        for r in self._running:
            if r.req.request_id == request_id:
                self._running.remove(r)
                self._release(r)
                self._lora_finished(r)
                return True
        return False

    def step(self, now: float) -> StepResult:
        """Run one step starting at ``max(now, clock)``; see the module docstring.

        Raises:
            RuntimeError: there is nothing to do (check ``has_work()``).
        """
        if not self.has_work():
            raise RuntimeError("step() on an idle engine")
        start = max(now, self.clock)
        scheduled: dict[_Request, int] = {}
        preempted: list[_Request] = []
        budget = self._schedule_running(scheduled, preempted)
        admitted: list[tuple[str, int]] = []
        if not preempted:
            self._schedule_waiting(scheduled, budget, start, admitted)
        loads = self._load_loras(scheduled)
        work = self._compute(scheduled)
        load_s = len(loads) * self.config.lora_load_ms / 1000
        end = start + (self.profile.step_s(work) + load_s) * self.config.time_scale
        self.clock = end
        self._num_steps += 1
        outputs, finished = self._sample(scheduled, end)
        self._step_counts = (len(self._running), len(self._waiting), self.pool.usage())
        return StepResult(
            start,
            end,
            tuple(admitted),
            tuple(outputs),
            tuple(finished),
            tuple((r.req.request_id, n) for r, n in scheduled.items()),
            tuple(r.req.request_id for r in preempted),
            tuple(a.name for a in loads),
        )

    def advance_to(self, t: float) -> list[StepResult]:
        """Run back-to-back steps while there is work and the next would start before ``t``."""
        results: list[StepResult] = []
        while self.has_work() and self.clock < t:
            results.append(self.step(self.clock))
        return results

    def _schedule_running(self, scheduled: dict[_Request, int], preempted: list[_Request]) -> int:
        """Step 1 of the module docstring; returns the budget left."""
        budget = self.config.max_num_batched_tokens
        idx = 0
        while idx < len(self._running) and budget > 0:
            r = self._running[idx]
            num_new = min(len(r.token_ids) - r.num_computed_tokens, budget)
            while not self._allocate(r, num_new):
                victim = self._running.pop()  # the lowest priority under FCFS: the newest
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    return budget
            scheduled[r] = num_new
            budget -= num_new
            idx += 1
        return budget

    def _schedule_waiting(
        self,
        scheduled: dict[_Request, int],
        budget: int,
        start: float,
        admitted: list[tuple[str, int]],
    ) -> None:
        """Step 2 of the module docstring, with LoRA's limit on distinct adapters."""
        cfg, pool = self.config, self.pool
        loras = {r.req.lora.int_id for r in scheduled if r.req.lora is not None}
        skipped: list[_Request] = []
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            r = self._waiting[0]
            lora = r.req.lora
            if lora is not None and lora.int_id not in loras and len(loras) == cfg.max_loras:
                skipped.append(self._waiting.popleft())
                continue
            num_tokens = len(r.token_ids)
            hits = pool.find_longest_cache_hit(r.block_hashes, num_tokens, cfg.block_size)
            num_hit_tokens = len(hits) * cfg.block_size
            num_new = num_tokens - num_hit_tokens
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            num_evictable = sum(1 for b in hits if b.ref_cnt == 0)
            num_blocks = _cdiv(num_tokens, cfg.block_size) - len(hits) + num_evictable
            if num_blocks > pool.num_free_blocks:
                break
            self._waiting.popleft()
            pool.touch(hits)
            r.blocks = list(hits)
            r.num_hashed_blocks = len(hits)
            r.num_computed_tokens = num_hit_tokens
            allocated = self._allocate(r, num_new)
            assert allocated  # the whole sequence fits, so its first chunk does
            if r.num_cached_tokens is None:
                r.num_cached_tokens = num_hit_tokens
                r.scheduled_s = start
                self._queries += num_tokens
                self._hits += num_hit_tokens
                admitted.append((r.req.request_id, num_hit_tokens))
            self._running.append(r)
            scheduled[r] = num_new
            budget -= num_new
            if lora is not None:
                loras.add(lora.int_id)
        self._waiting.extendleft(reversed(skipped))

    def _load_loras(self, scheduled: dict[_Request, int]) -> list[LoraRequest]:
        """Bring the step's adapters into the GPU slots; those loaded now."""
        batch = {r.req.lora.int_id: r.req.lora for r in scheduled if r.req.lora is not None}
        if not batch:
            return []
        loads = self.lora_slots.bring_in(list(batch.values()))
        self._num_lora_loads += len(loads)
        return loads

    def _allocate(self, r: _Request, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of ``r``, and the blocks they fill cached;
        False (nothing taken) when the pool is short."""
        bs = self.config.block_size
        num_tokens = r.num_computed_tokens + num_new
        num_blocks = _cdiv(num_tokens, bs) - len(r.blocks)
        if num_blocks > self.pool.num_free_blocks:
            return False
        if num_blocks > 0:
            r.blocks += self.pool.get_new_blocks(num_blocks)
        num_full = num_tokens // bs
        if num_full > r.num_hashed_blocks:
            self.pool.cache_full_blocks(
                r.blocks,
                r.block_hashes,
                r.num_hashed_blocks,
                num_full,
                r.token_ids,
                bs,
                r.req.cache_salt,
                r.req.lora,
            )
            r.num_hashed_blocks = num_full
        return True

    def _preempt(self, r: _Request) -> None:
        self._free_blocks(r)
        r.num_computed_tokens = r.num_hashed_blocks = 0
        r.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(r)

    def _compute(self, scheduled: dict[_Request, int]) -> StepWork:
        """Advance every scheduled request's computed tokens; what the step computed."""
        num_prefill = num_prefill_seqs = num_decode = num_context = 0
        for r, num_new in scheduled.items():
            num_context += r.num_computed_tokens
            is_decode = (
                num_new == 1
                and r.num_output_tokens > 0
                and r.num_computed_tokens == len(r.token_ids) - 1
            )
            if is_decode:
                num_decode += 1
            else:
                num_prefill += num_new
                num_prefill_seqs += 1
            r.num_computed_tokens += num_new
        return StepWork(num_prefill, num_decode, num_context, num_prefill_seqs)

    def _sample(
        self, scheduled: dict[_Request, int], end: float
    ) -> tuple[list[TokenOutput], list[FinishedRequest]]:
        """A token for every scheduled request that caught up with its last token."""
        bs = self.config.block_size
        outputs: list[TokenOutput] = []
        finished: list[FinishedRequest] = []
        for r in scheduled:
            if r.num_computed_tokens < len(r.token_ids):
                continue  # a partial prefill chunk
            index = r.num_output_tokens
            word = r.words[index]
            token_id = word_token(word)
            r.token_ids.append(token_id)
            extend_block_hashes(r.block_hashes, r.token_ids, bs, r.req.cache_salt, r.req.lora)
            latency = end - (r.arrival_s if index == 0 else r.last_token_s)
            if index == 0:
                r.first_token_s = end
                self._num_prompt_tokens += len(r.req.prompt_token_ids)
                if r.req.lora is not None:
                    self._lora_states.setdefault(r.req.lora.name, set()).add(r.req.request_id)
            r.last_token_s = end
            done = index + 1 == r.req.max_tokens
            outputs.append(TokenOutput(r.req.request_id, index, token_id, word, latency, done))
            if done:
                self._running.remove(r)
                self._release(r)
                self._lora_finished(r)
                finished.append(self._finished(r, end))
        self._num_generation_tokens += len(outputs)
        return outputs, finished

    def _release(self, r: _Request) -> None:
        self._free_blocks(r)
        self._ids.discard(r.req.request_id)

    def _lora_finished(self, r: _Request) -> None:
        lora = r.req.lora
        if lora is None or lora.name not in self._lora_states:
            return
        requests = self._lora_states[lora.name]
        requests.discard(r.req.request_id)
        if not requests:
            del self._lora_states[lora.name]

    def lora_request_states(self) -> tuple[str, ...]:
        """The adapters vLLM 0.32 names in both labels of ``vllm:lora_requests_info``.

        Its front end learns of a request's scheduling from the request's outputs, and a
        request has none before its first token: so an adapter is listed from its first
        request's first token until its last request finishes, waiting requests that
        never ran go unseen, and every listed adapter is in both ``running`` and
        ``waiting`` (``LoRARequestStates.update_scheduler_stats`` keys both by every
        adapter it tracks). In the order the adapters were first listed.
        """
        return tuple(self._lora_states)

    def _free_blocks(self, r: _Request) -> None:
        """Unpin ``r``'s blocks tail first, so its prefix stays cached longest."""
        self.pool.free_blocks(reversed(r.blocks))
        r.blocks = []

    def _finished(self, r: _Request, end: float) -> FinishedRequest:
        self._num_finished += 1
        num_prompt = len(r.req.prompt_token_ids)
        assert r.num_cached_tokens is not None
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
            num_preemptions=r.num_preemptions,
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
            num_preemptions=self._num_preemptions,
            num_lora_loads=self._num_lora_loads,
            step_running=self._step_counts[0],
            step_waiting=self._step_counts[1],
            step_kv_cache_usage=self._step_counts[2],
        )
