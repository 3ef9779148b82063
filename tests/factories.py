"""Small builders shared by the tests (like vLLM's ``make_request``)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from extproc.pods import Pod, PodId, PodMetrics
from extproc.request.parse import Api, InferenceRequest
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.scheduler import Scheduler


def make_pod(
    name: str,
    *,
    model: str = "m",
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


def make_cycle(prompt: str, *, model: str = "m", salt: str | None = None) -> Cycle:
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
