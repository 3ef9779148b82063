"""precise-prefix-cache with a view seeded from the view snapshot: provisional blocks
score like any others, but a pod whose match runs through them is not exact for the
cost model (``exact_matches`` leaves it out; ``matched_tokens`` keeps its estimate) until
its events confirm them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodId
from extproc.prefix.precise.index import SavedBlocks, SavedView
from extproc.request.parse import parse_request
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.factories import write_tokenizer
from tests.scheduling.plugins.support import BS, store

PODS = [Pod(PodId("default", f"p{i}"), f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(3)]
TOKENS = list(range(100, 100 + 4 * BS + 3))  # four whole blocks and a tail


def make(tmp_path: Path) -> PrecisePrefixCache:
    raw = {"models": {"m": str(write_tokenizer(tmp_path / "tok"))}, "blockSize": BS}
    return PrecisePrefixCache.from_args(raw, PluginContext(CollectorRegistry()))


def cycle() -> Cycle:
    return Cycle(parse_request("/v1/completions", orjson.dumps({"model": "m", "prompt": TOKENS})))


def seed_as_stored(plugin: PrecisePrefixCache, pod: Pod, tokens: list[int]) -> None:
    """``pod``'s view as the snapshot seeds it: what its events had stored, provisional."""
    store(plugin, pod, tokens)
    gpu = plugin.index.views.pop(pod.id).blocks["GPU"]
    saved = SavedBlocks(
        "GPU",
        np.fromiter(gpu, np.uint64),
        np.array([h % 2**64 for h in gpu.values()], np.uint64),
        np.zeros(len(gpu), np.uint32),
    )
    plugin.index.seed(pod.id, SavedView(BS, (saved,)))


def test_a_seeded_pod_scores_at_once_but_is_not_exact(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    seed_as_stored(plugin, PODS[0], TOKENS)
    store(plugin, PODS[1], TOKENS[: 2 * BS])  # confirmed events: two blocks
    c = cycle()
    assert plugin.score(c, PODS) == {PODS[0].id: 100, PODS[1].id: 50}
    exact = plugin.exact_matches(cycle(), PODS)
    assert exact is not None and exact.num_prompt_tokens == len(TOKENS)
    assert dict(exact.matched_tokens) == {PODS[1].id: 2 * BS, PODS[2].id: 0}
    assert plugin.matched_tokens(cycle(), PODS) == {
        PODS[0].id: 4 * BS,
        PODS[1].id: 2 * BS,
        PODS[2].id: 0,
    }


def test_confirmed_by_its_events_the_seeded_pod_is_exact_again(tmp_path: Path) -> None:
    plugin = make(tmp_path)
    seed_as_stored(plugin, PODS[0], TOKENS)
    plugin.index.confirm(PODS[0].id)
    exact = plugin.exact_matches(cycle(), PODS)
    assert exact is not None and exact.matched_tokens[PODS[0].id] == 4 * BS


def test_a_match_short_of_the_provisional_blocks_stays_exact(tmp_path: Path) -> None:
    """Only the blocks a pod's match runs through matter: a pod seeded with another
    prompt's blocks and holding this one's by its events is exact for it."""
    plugin = make(tmp_path)
    other = list(range(500, 500 + 2 * BS))
    seed_as_stored(plugin, PODS[0], other)
    store(plugin, PODS[0], TOKENS)
    exact = plugin.exact_matches(cycle(), PODS)
    assert exact is not None and exact.matched_tokens[PODS[0].id] == 4 * BS
