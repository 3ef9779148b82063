"""Kthena's other plugin names in a configuration: ``random`` and ``lora-affinity`` are
built-in plugins; ``kvcache-aware`` is read as precise-prefix-cache where that is
configured (its block size translated), else logged once at load and skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.scheduling.config import build_scheduler, load_config, parse_config
from extproc.scheduling.plugins.lora_affinity import LoraAffinity
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.plugins.random_score import Random
from testkit.factories import write_tokenizer

LOGGER = "extproc.scheduling.config"


def config_text(
    scores: list[tuple[str, int]], plugin_config: list[dict[str, Any]] | None = None
) -> str:
    doc = {
        "scheduler": {
            "plugins": {"Score": {"enabled": [{"name": n, "weight": w} for n, w in scores]}},
            "pluginConfig": plugin_config or [],
        }
    }
    text: str = yaml.safe_dump(doc)
    return text


def test_random_and_lora_affinity_are_built_where_kthena_enables_them() -> None:
    text = (
        "scheduler:\n  plugins:\n    Filter:\n      enabled: [lora-affinity]\n"
        "    Score:\n      enabled:\n        - {name: random, weight: 2}\n"
        "        - {name: lora-affinity, weight: 3}\n"
    )
    scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    (lora_filter,) = scheduler.filters
    random_score, lora_score = scheduler.scorers
    assert isinstance(lora_filter, LoraAffinity) and lora_score.scorer is lora_filter
    assert isinstance(random_score.scorer, Random) and random_score.weight == 2
    assert lora_score.weight == 3


def test_kthena_chart_default_leaves_lora_affinity_disabled() -> None:
    assert "lora-affinity" not in load_config("kthena").filters


@pytest.fixture
def models(tmp_path: Path) -> dict[str, str]:
    return {"m": str(write_tokenizer(tmp_path / "m"))}


def test_kvcache_aware_becomes_precise_prefix_cache_in_its_place(
    models: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    text = config_text(
        [("least-request", 1), ("kvcache-aware", 4), ("gpu-usage", 1)],
        [
            {"name": "precise-prefix-cache", "args": {"models": models, "cpuWeight": 0.25}},
            {
                "name": "kvcache-aware",
                "args": {"blockSizeToHash": 32, "maxBlocksToMatch": 64, "vllmTokenizerPort": 1},
            },
        ],
    )
    with caplog.at_level("INFO", logger=LOGGER):
        config = parse_config(text, "cm.yaml")
        scheduler = build_scheduler(config, CollectorRegistry())
    assert [(s.name, s.weight) for s in config.scores] == [
        ("least-request", 1),
        ("precise-prefix-cache", 4),
        ("gpu-usage", 1),
    ]
    precise = scheduler.scorers[1].scorer
    assert isinstance(precise, PrecisePrefixCache)
    assert (precise.args.blockSize, precise.args.cpuWeight) == (32, 0.25)
    assert precise.args.maxBlocksToMatch == 128  # kvcache-aware's means another thing
    assert "kvcache-aware" not in config.plugin_args
    messages = [r.getMessage() for r in caplog.records]
    assert "cm.yaml: kvcache-aware read as precise-prefix-cache" in messages
    assert (
        "cm.yaml: kvcache-aware args with no precise-prefix-cache meaning, ignored: "
        "['maxBlocksToMatch', 'vllmTokenizerPort']" in messages
    )
    assert not any("not enabled" in m for m in messages)


def test_precise_prefix_cache_keeps_its_own_block_size(models: dict[str, str]) -> None:
    text = config_text(
        [("kvcache-aware", 1)],
        [
            {"name": "kvcache-aware", "args": {"blocksizetohash": 32}},
            {"name": "precise-prefix-cache", "args": {"models": models, "BlockSize": 8}},
        ],
    )
    (precise,) = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry()).scorers
    assert isinstance(precise.scorer, PrecisePrefixCache) and precise.scorer.args.blockSize == 8


def test_both_enabled_are_one_plugin_with_precise_prefix_cache_weight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = config_text([("precise-prefix-cache", 2), ("kvcache-aware", 5)])
    with caplog.at_level("WARNING", logger=LOGGER):
        config = parse_config(text, "cm.yaml")
    assert [(s.name, s.weight) for s in config.scores] == [("precise-prefix-cache", 2)]
    assert [r.getMessage() for r in caplog.records] == [
        "cm.yaml: kvcache-aware is precise-prefix-cache here: configured once, with its weight"
    ]


def test_without_precise_prefix_cache_kvcache_aware_is_logged_once_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = config_text(
        [("kvcache-aware", 1), ("least-request", 1)],
        [{"name": "kvcache-aware", "args": {"blockSizeToHash": 32}}],
    )
    with caplog.at_level("INFO", logger=LOGGER):
        scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    assert [ws.scorer.type_name for ws in scheduler.scorers] == ["least-request"]
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname != "INFO"]
    skipped = (
        "cm.yaml: kvcache-aware skipped: extproc reads the pods' KV events through "
        "precise-prefix-cache, which is not configured (enable it, or give it a "
        "pluginConfig entry with its models)"
    )
    assert logged == [("ERROR", skipped)]
