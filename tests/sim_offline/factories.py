"""Builders for the offline-simulator tests: words, items, small workloads, settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from extproc.scheduling.config import SchedulerConfig, load_config
from extproc.sim.engine import EngineConfig
from extproc.sim.offline import SimSettings
from extproc.sim.workloads import NUM_WORDS, WorkItem, Workload, completion_item, words_text

MODEL = "m"


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


def settings(num_pods: int = 2, **engine: Any) -> SimSettings:
    return SimSettings(num_pods, EngineConfig(**engine))
