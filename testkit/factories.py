"""Small builders the tests, e2e and benchmarks share (like vLLM's ``make_request``):
pods, cycles and schedulers; a tokenizer directory; the simulated engine's requests; the
offline simulator's words, items, workloads and settings."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from extproc.pods import Pod, PodId, PodMetrics
from extproc.request.parse import Api, InferenceRequest
from extproc.scheduling.config import SchedulerConfig, build_scheduler, load_config, parse_config
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.scheduler import Scheduler
from extproc.sim.engine import Engine, EngineConfig, FinishedRequest, SimRequest
from extproc.sim.offline import SimSettings
from extproc.sim.timing import TimingProfile
from extproc.sim.workloads import NUM_WORDS, WorkItem, Workload, completion_item, words_text

MODEL = "m"  # the model of make_pod's pods and of the offline simulator's workloads


def make_pod(
    name: str,
    *,
    model: str = MODEL,
    ready: bool = True,
    port: int = 8000,
    namespace: str = "default",
    metrics: PodMetrics | None = None,
) -> Pod:
    return Pod(
        id=PodId(namespace, name),
        address=f"127.0.0.1:{port}",
        models=frozenset({model}),
        ready=ready,
        metrics=metrics or PodMetrics(),
    )


def make_cycle(prompt: str, *, model: str = MODEL, salt: str | None = None) -> Cycle:
    return Cycle(InferenceRequest(Api.COMPLETIONS, model, prompt, cache_salt=salt))


# A ChatML template, as Qwen's, without its tool and reasoning branches.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(directory: Path) -> Path:
    """A small model's tokenizer directory as precise-prefix-cache reads it: tokenizer.json
    (a word-level vocabulary, the ChatML markers as added tokens) and tokenizer_config.json
    (the chat template)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "system", "user", "assistant"])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def precise_only_config(model: str, tokenizer: Path, block_size: int = 16) -> str:
    """A scheduler configuration scoring with precise-prefix-cache alone, ``model``'s
    prompts tokenized with ``tokenizer`` (a directory, e.g. ``write_tokenizer``'s)."""
    return f"""
scheduler:
  plugins:
    Score:
      enabled:
        - name: precise-prefix-cache
          weight: 1
  pluginConfig:
    - name: precise-prefix-cache
      args:
        models:
          {model}: {tokenizer}
        blockSize: {block_size}
"""


def make_scheduler(yaml_text: str, registry: CollectorRegistry | None = None) -> Scheduler:
    return build_scheduler(parse_config(yaml_text, "test.yaml"), registry or CollectorRegistry())


PREFIX_ONLY = """
scheduler:
  plugins:
    Score:
      enabled:
        - name: prefix-cache
          weight: 1
"""


# The simulated engine (tests/sim)

FAST_ENGINE = EngineConfig(time_scale=0.01)  # the engine's time runs 100 times faster
# Round numbers: a step costs 10 ms + 1 ms per decoding request + 1 ms per prefill token.
ROUND_TIMING = TimingProfile(
    name="test-round",
    base_s=0.010,
    s_per_prefill_token=0.001,
    s_per_decode_seq=0.001,
    s_per_context_token=0.0,
    source="round numbers for tests",
)


def constant_step(step_s: float) -> TimingProfile:
    """A profile whose every step lasts ``step_s``, whatever it computes."""
    return TimingProfile(f"constant-{step_s}", step_s, 0.0, 0.0, 0.0, "tests")


_ids = itertools.count()


def seq(seed: int, n: int) -> list[int]:
    """n deterministic token ids from a seed, as in vllm-prefix-caching.txt's Go code."""
    return [(seed * 7919 + i * 104729) % 50000 for i in range(n)]


def make_sim_request(
    prompt: Sequence[int], max_tokens: int = 1, salt: str | None = None, request_id: str = ""
) -> SimRequest:
    return SimRequest(request_id or f"r{next(_ids)}", tuple(prompt), max_tokens, salt)


def run_alone(engine: Engine, req: SimRequest) -> FinishedRequest:
    """Add ``req`` at the engine's clock and step until it finishes."""
    engine.add_request(req, engine.clock)
    while True:
        result = engine.step(engine.clock)
        for fin in result.finished:
            if fin.request_id == req.request_id:
                return fin


# The offline simulator (tests/sim_offline)


def random_words(seed: int, num_tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, NUM_WORDS, num_tokens)


def make_item(
    request_id: str, arrival_s: float, word_idx: np.ndarray, max_tokens: int = 4
) -> WorkItem:
    """A completions request whose prompt is the words ``word_idx``."""
    text, tokens = words_text(word_idx)
    return completion_item(request_id, arrival_s, text, tokens, max_tokens, MODEL)


def make_workload(items: Sequence[WorkItem]) -> Workload:
    return Workload("test", {"model": MODEL}, lambda: iter(items))


def default_scheduler_config() -> SchedulerConfig:
    """Kthena's default (the named ``kthena`` configuration): these tests read its
    prefix-cache plugin's index."""
    return load_config("kthena")


def sim_settings(num_pods: int = 2, **engine: Any) -> SimSettings:
    return SimSettings(num_pods, EngineConfig(**engine))
