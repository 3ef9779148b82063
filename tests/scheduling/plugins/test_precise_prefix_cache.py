"""precise-prefix-cache: scores and exact matched tokens from the pods' views, the
approximate fallbacks (unknown model, untokenizable request, stale pod), configuration."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.pods import Pod, PodId
from extproc.request.parse import parse_request
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.podtable import PodTable
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import write_tokenizer
from tests.scheduling.plugins.support import BS, store

pytestmark = needs_model_tokenizer
PODS = [Pod(PodId("default", f"p{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(3)]
SYSTEM = "You are a careful assistant. " * 20


def make(registry: CollectorRegistry | None = None, **args: object) -> PrecisePrefixCache:
    raw = {"models": {"m": str(MODEL_DIR)}, "blockSize": BS, **args}
    return PrecisePrefixCache.from_args(raw, PluginContext(registry or CollectorRegistry()))


def cycle(question: str = "hi", model: str = "m", **extra: object) -> Cycle:
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question}], **extra}  # fmt: skip
    return Cycle(parse_request("/v1/chat/completions", orjson.dumps(body)))


def test_the_pod_holding_the_prompt_scores_and_matches_exactly() -> None:
    plugin = make()
    c = cycle()
    tokens = plugin.prompt_tokens(c)
    assert tokens is not None and len(tokens) > 3 * BS
    store(plugin, PODS[1], tokens[: 3 * BS])  # the shared system prompt's first 3 blocks
    scores = plugin.score(c, PODS)
    assert set(scores) == {PODS[1].id}
    assert scores[PODS[1].id] == 3 * 100 // (len(tokens) // BS)
    assert plugin.matched_tokens(c, PODS) == {PODS[0].id: 0, PODS[1].id: 3 * BS, PODS[2].id: 0}


def test_a_responses_request_matches_the_same_conversation_sent_as_chat() -> None:
    """Both render to the same prompt, so a pod holding one holds the other."""
    plugin = make()
    body = {"model": "m", "instructions": SYSTEM, "input": [{"role": "user", "content": "hi"}]}
    c = Cycle(parse_request("/v1/responses", orjson.dumps(body)))
    tokens = plugin.prompt_tokens(cycle())
    responses_tokens = plugin.prompt_tokens(c)
    assert tokens is not None and responses_tokens is not None
    assert responses_tokens.tolist() == tokens.tolist()
    store(plugin, PODS[2], tokens)
    assert plugin.matched_tokens(c, PODS)[PODS[2].id] == (len(tokens) - 1) // BS * BS


def test_a_whole_cached_prompt_leaves_its_last_token_to_compute() -> None:
    plugin = make()
    tokens = list(range(100, 100 + 2 * BS))  # exactly two blocks, both cached
    body = orjson.dumps({"model": "m", "prompt": tokens})
    c = Cycle(parse_request("/v1/completions", body))
    store(plugin, PODS[0], tokens)
    # vLLM's max_cache_hit_length = num_tokens - 1: the last block is computed again
    assert plugin.matched_tokens(c, [PODS[0]])[PODS[0].id] == BS
    assert plugin.score(c, [PODS[0]]) == {PODS[0].id: 100}


def test_the_salt_isolates_chains() -> None:
    plugin = make()
    tokens = plugin.prompt_tokens(cycle())
    assert tokens is not None
    store(plugin, PODS[0], tokens, salt="t1")
    assert plugin.score(cycle(), PODS) == {}
    assert PODS[0].id in plugin.score(cycle(cache_salt="t1"), PODS)
    assert plugin.score(cycle(cache_salt="t2"), PODS) == {}


def test_an_adapters_blocks_match_only_its_own_requests() -> None:
    """vLLM keys a LoRA adapter's blocks by its name: a pod holding the prompt for
    adapter ``lora-a`` holds nothing for the base model, and the base model's blocks
    nothing for the adapter."""
    plugin = make(models={"m": str(MODEL_DIR), "lora-a": str(MODEL_DIR)})
    pods = [replace(p, models=p.models | {"lora-a"}, adapters=frozenset({"lora-a"})) for p in PODS]
    plugin.pods_changed(pods)
    tokens = plugin.prompt_tokens(cycle(model="lora-a"))
    assert tokens is not None
    store(plugin, pods[0], tokens, lora="lora-a")
    store(plugin, pods[1], tokens)  # the base model's
    assert set(plugin.score(cycle(model="lora-a"), pods)) == {pods[0].id}
    assert set(plugin.score(cycle(), pods)) == {pods[1].id}


@pytest.mark.parametrize(
    ("c", "reason"),
    [
        pytest.param(cycle(model="other"), "unknown_model", id="unknown-model"),
        pytest.param(
            Cycle(
                parse_request(
                    "/v1/responses",
                    orjson.dumps({"model": "m", "input": "hi", "previous_response_id": "r1"}),
                )
            ),
            "not_exact",
            id="responses-with-stored-history",
        ),
    ],
)
def test_requests_without_exact_tokens_use_the_approximate_view(c: Cycle, reason: str) -> None:
    registry = CollectorRegistry()
    plugin = make(registry)
    assert plugin.score(c, PODS) == {}
    plugin.record(c, PODS[2].id)
    assert set(plugin.score(c, PODS)) == {PODS[2].id}
    labels = {"reason": reason}
    assert registry.get_sample_value("extproc_precise_prefix_fallbacks_total", labels) == 1


def test_a_stale_pod_is_scored_from_the_approximate_view() -> None:
    registry = CollectorRegistry()
    plugin = make(registry)
    c = cycle()
    tokens = plugin.prompt_tokens(c)
    assert tokens is not None
    store(plugin, PODS[0], tokens)
    plugin.index.mark_stale(PODS[0].id)  # lost events: its view is forgotten and distrusted
    plugin.record(c, PODS[0].id)
    assert set(plugin.score(c, PODS)) == {PODS[0].id}  # from the recorded prompt
    value = registry.get_sample_value(
        "extproc_precise_prefix_fallbacks_total", {"reason": "stale_pod"}
    )
    assert value == 1


def test_the_table_path_scores_as_score_does() -> None:
    """Exact views, a stale pod scored from the approximate view, a pod holding nothing,
    and a subset of the rows: ``score_table`` is ``score`` row by row."""
    pods = [*PODS, Pod(PodId("default", "p3"), "10.0.0.3:8000", frozenset({"m"}))]
    plugin = make()
    tokens = plugin.prompt_tokens(cycle())
    assert tokens is not None
    store(plugin, pods[1], tokens[: 3 * BS])
    store(plugin, pods[2], tokens[:BS])
    store(plugin, pods[3], tokens)
    plugin.index.mark_stale(pods[3].id)
    plugin.record(cycle(), pods[3].id)
    table = PodTable(pods)
    for rows in ([0, 1, 2, 3], [1, 3], [0]):
        positions = np.array(rows, dtype=np.int64)
        by_pods = plugin.score(cycle(), [pods[i] for i in rows])
        assert len(by_pods) == len(set(rows) - {0})
        by_table = plugin.score_table(cycle(), table, positions)
        assert by_table.tolist() == [by_pods.get(pods[i].id, 0) for i in rows]


def test_the_configuration_builds_it_and_refuses_bad_models() -> None:
    text = (
        Path("extproc/data/precise.yaml").read_text().replace("/models/qwen3-tiny", str(MODEL_DIR))
    )
    scheduler = build_scheduler(parse_config(text, "precise.yaml"), CollectorRegistry())
    assert any(isinstance(p, PrecisePrefixCache) for p in scheduler.listeners)
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        build_scheduler(
            parse_config(text.replace(str(MODEL_DIR), "/nonexistent"), "x"), CollectorRegistry()
        )
    with pytest.raises(ConfigError, match="'models' must map"):
        make(models=["m"])


def test_a_model_whose_chat_template_does_not_compile_is_refused(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content "
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="precise-prefix-cache: .*chat template does not compile"):
        PrecisePrefixCache.from_args(
            {"models": {"m": str(tmp_path)}}, PluginContext(CollectorRegistry())
        )


def test_a_new_prompt_is_left_to_prepare_and_a_known_one_is_tokenized_at_once() -> None:
    plugin = make()
    tok = plugin.tokenizers["m"]
    question = "a question nobody asked before " * 30
    cold = cycle(question)
    work = plugin.prepare(cold)
    assert work is not None and not cold.tokenized  # the encoding is left to run
    work.run()
    whole = tok.tokenizer.encode(tok.render_chat(cold.request.data or {}), add_special_tokens=False)
    assert cold.tokenized and cold.token_ids is not None
    assert cold.token_ids.tolist() == whole.ids
    warm = cycle(question)
    assert plugin.prepare(warm) is None  # every segment in the memo: done on the spot
    assert warm.token_ids is not None and warm.token_ids.tolist() == whole.ids
    assert plugin.prepare(warm) is None and plugin.prompt_tokens(warm) is warm.token_ids


def test_a_skipped_preparation_scores_from_the_approximate_view() -> None:
    registry = CollectorRegistry()
    plugin = make(registry)
    c = cycle("another question nobody asked " * 30)
    work = plugin.prepare(c)
    assert work is not None
    misses = plugin.tokenizers["m"].misses
    work.skip()
    plugin.record(c, PODS[1].id)
    assert set(plugin.score(c, PODS)) == {PODS[1].id}  # the recorded prompt, approximately
    assert plugin.prompt_tokens(c) is None
    assert plugin.tokenizers["m"].misses == misses  # nothing was tokenized after all
    labels = {"reason": "busy"}
    assert registry.get_sample_value("extproc_precise_prefix_fallbacks_total", labels) == 1
