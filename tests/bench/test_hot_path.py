"""bench.hot_path drives the whole per-request path: every request routed, its reply
Envoy's, its end recorded for the pod that served it."""

from __future__ import annotations

from pathlib import Path

from bench.floor import precise_config
from bench.hot_path import HotPath
from bench.upstreams import MODEL
from extproc.prefix.precise.keys import chain_keys
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer


def test_each_request_is_routed_ended_and_recorded() -> None:
    path = HotPath(num_pods=4, prompt_bytes=2048, num_prefixes=3)
    for _ in range(12):
        path.one_request()
    assert len(path.router.pending) == 0  # every end matched its route
    sample = path.registry.get_sample_value
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 12
    assert sample("extproc_route_decisions_total", {"model": MODEL}) == 12


def test_with_requests_in_flight_each_ends_that_many_requests_later() -> None:
    path = HotPath(num_pods=4, prompt_bytes=2048, num_prefixes=3, in_flight=5)
    for _ in range(12):
        path.one_request()
    assert len(path.router.pending) == 5
    sample = path.registry.get_sample_value
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 7
    for _ in range(5):
        path.end_oldest()
    assert len(path.router.pending) == 0
    assert sample("extproc_completions_total", {"outcome": "recorded"}) == 12


@needs_model_tokenizer
def test_with_events_the_served_pods_views_hold_the_prompts_and_match_them(
    tmp_path: Path,
) -> None:
    """Precise with the pods' KV events: each end stores the prompt's full blocks in the
    served pod's view, so the next request for the same prompt finds them there exactly."""
    config = precise_config(MODEL_DIR, tmp_path).read_text()
    path = HotPath(num_pods=4, prompt_bytes=2048, num_prefixes=2, config_text=config)
    path.with_events()
    assert path._events is not None
    plugin = path._events.plugin
    for _ in range(4):
        path.one_request()
    size = plugin.args.blockSize
    tokens = path._events.tokens[0]
    held = {pod: plugin.index.match(pod, chain_keys(tokens, size))[0] for pod in plugin.index.views}
    assert max(held.values()) == len(tokens) // size  # the whole prompt, in full blocks
    sample = path.registry.get_sample_value
    assert not sample("extproc_precise_prefix_fallbacks_total", {"reason": "stale_pod"})
    # A pod holding the prompt publishes nothing more for it, as vLLM's block pool
    # publishes only the blocks it did not find cached (and a block-aligned prompt's
    # last block, computed again for the last token: one more copy).
    pod = max(held, key=lambda p: held[p])
    view = plugin.index.views[pod]
    copies = sum(view.copies.get("GPU", {}).values())
    address = next(p.address for p in path.router.pods if p.id == pod)
    path._events.stored(0, address)
    again = sum(view.copies.get("GPU", {}).values()) - copies
    assert again == (len(tokens) % size == 0)
    assert all(v.orphans == 0 for v in plugin.index.views.values())
