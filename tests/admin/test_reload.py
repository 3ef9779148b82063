"""Live reload of the scheduler configuration: applied between requests with the views,
pending records and in-flight counts kept; invalid or restart-only files refused with the
old configuration in force; counted in the metrics."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.admin.reload import ConfigReloader
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, config_text, parse_config, plugins_of
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.scheduling.registry import BUILTIN
from testkit.factories import make_pod, write_tokenizer
from testkit.waiting import wait_until

PATH = "/v1/completions"
PODS = [make_pod(f"p{i}", port=8000 + i) for i in range(4)]
WARM = "You are the support assistant of a very large shop. " * 20


def prefix_config(weight: int = 1, block_size: int = 64, extra: str = "") -> str:
    return f"""
scheduler:
  plugins:
    Score:
      enabled:
        - name: prefix-cache
          weight: {weight}
{extra}
  pluginConfig:
    - name: prefix-cache
      args: {{blockSizeToHash: {block_size}}}
"""


LEAST_REQUEST = """        - name: least-request
          weight: 100"""

TTFT = """
scheduler:
  plugins:
    Score:
      enabled:
        - name: estimated-ttft
          weight: {weight}
"""


class Setup:
    """A router started from a configuration file, with its reloader (no thread)."""

    def __init__(self, tmp_path: Path, text: str, poll_s: float = 0.0) -> None:
        self.file = tmp_path / "config.yaml"
        self.file.write_text(text)
        self.registry = CollectorRegistry()
        text, source = config_text(self.file)
        config = parse_config(text, source)
        in_flight = InFlight()
        scheduler = build_scheduler(config, self.registry, in_flight)
        self.router = Router(scheduler, PODS, registry=self.registry, in_flight=in_flight)
        self.reloader = ConfigReloader(
            self.router, self.file, text, config, self.registry, poll_s=poll_s
        )

    def write(self, text: str) -> None:
        self.file.write_text(text)

    def count(self, result: str) -> float:
        value = self.registry.get_sample_value("extproc_config_reloads_total", {"result": result})
        return value or 0.0

    def gauge(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)

    def route(self, request_id: str, prompt: str = WARM) -> str:
        body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 8})
        return self.router.route(PATH, body, request_id=request_id).pods[0].address

    def serve(self, request_id: str, prompt: str = WARM) -> str:
        """Route and end successfully (recorded for the pick)."""
        pick = self.route(request_id, prompt)
        assert self.router.complete(request_id, pick, succeeded=True)
        return pick


def plugin(router: Router, name: str) -> object:
    return plugins_of(router.scheduler)[name]


def test_the_first_load_counts_as_applied_with_its_hash(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    assert s.count("applied") == 1 and s.gauge("extproc_config_last_reload_success") == 1
    assert (s.gauge("extproc_config_last_reload_timestamp_seconds") or 0) > 0
    info = next(m for m in s.registry.collect() if m.name == "extproc_config_info")
    (sample,) = info.samples
    assert sample.labels == {"hash": s.reloader.digest, "source": str(s.file)}


def test_a_new_weight_applies_to_the_next_request(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    warm = s.serve("warm")
    busy = s.route("busy")  # in flight on the warm pod: the prefix wins still
    assert busy == warm and s.route("next") == warm
    s.write(prefix_config(extra=LEAST_REQUEST))
    assert s.reloader.reload_now() == "applied"
    assert [(w.scorer.type_name, w.weight) for w in s.router.scheduler.scorers] == [
        ("prefix-cache", 1),
        ("least-request", 100),
    ]
    # The warm pod has two requests in flight: least-request's weight sends it elsewhere.
    assert s.route("after") != warm
    assert s.count("applied") == 2 and s.gauge("extproc_config_last_reload_success") == 1


def test_a_prefix_recorded_before_the_reload_still_scores_after_it(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    warm = s.serve("warm")
    before = plugin(s.router, "prefix-cache")
    s.write(prefix_config(weight=3))
    assert s.reloader.reload_now() == "applied"
    after = plugin(s.router, "prefix-cache")
    assert after is not before and isinstance(after, PrefixCacheScorer)
    assert after.index.num_entries > 0
    assert all(s.route(f"r{i}") == warm for i in range(5))


def test_a_changed_geometry_starts_the_view_empty_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup(tmp_path, prefix_config())
    s.serve("warm")
    s.write(prefix_config(block_size=32))
    with caplog.at_level(logging.WARNING):
        assert s.reloader.reload_now() == "applied"
    after = plugin(s.router, "prefix-cache")
    assert isinstance(after, PrefixCacheScorer) and after.index.num_entries == 0
    assert "prefix-cache starts its prefix view empty (blockSizeToHash 64 -> 32)" in caplog.text
    assert s.registry.get_sample_value("kthena_router_prefix_cache_entries") == 0


def test_in_flight_counts_and_pending_records_are_kept(tmp_path: Path) -> None:
    s = Setup(tmp_path, TTFT.format(weight=1))
    pick = s.route("open")
    pod = next(p for p in PODS if p.address == pick)
    assert s.router.in_flight.get(pod.id) == 1
    s.write(TTFT.format(weight=2))
    assert s.reloader.reload_now() == "applied"
    ttft = plugin(s.router, "estimated-ttft")
    assert isinstance(ttft, EstimatedTTFT)
    assert ttft.in_flight is s.router.in_flight
    assert s.router.in_flight.get(pod.id) == 1
    assert ttft.arrivals.num_requests == 1 and len(s.router.pending) == 1
    assert s.router.complete("open", pick, succeeded=True)  # recorded by the new scheduler
    assert ttft.arrivals.num_requests == 0 and ttft.index.num_entries > 0
    assert s.router.in_flight.get(pod.id) == 0


def test_an_invalid_file_is_refused_and_the_old_configuration_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup(tmp_path, prefix_config())
    scheduler = s.router.scheduler
    s.write("scheduler: [unclosed\n  x: {")
    assert s.reloader.reload_now() == "invalid"
    assert s.router.scheduler is scheduler
    assert s.count("invalid") == 1 and s.gauge("extproc_config_last_reload_success") == 0
    (line,) = [r for r in caplog.records if r.name == "extproc.reload"]
    assert str(s.file) in line.getMessage() and "\n" not in line.getMessage()
    # Polling the same content again says nothing more; a valid file then applies.
    assert s.reloader.reload(counted_unchanged=False) == "invalid"
    assert s.count("invalid") == 1
    s.write(prefix_config(extra="        - name: no-such-plugin\n          weight: 1") + "x: [")
    assert s.reloader.reload_now() == "invalid"
    s.write(prefix_config(weight=2))
    assert s.reloader.reload_now() == "applied"
    assert s.gauge("extproc_config_last_reload_success") == 1


def test_bad_plugin_arguments_are_refused(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    scheduler = s.router.scheduler
    s.write(prefix_config(weight=0))
    assert s.reloader.reload_now() == "invalid"
    assert s.router.scheduler is scheduler


def test_unchanged_content_is_not_applied_again(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    scheduler = s.router.scheduler
    s.write(prefix_config())  # a new mtime, the same content
    assert s.reloader.reload_now() == "unchanged"
    assert s.reloader.reload(counted_unchanged=False) == "unchanged"
    assert s.router.scheduler is scheduler and s.count("unchanged") == 1


def test_a_flow_control_change_needs_a_restart(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    scheduler = s.router.scheduler
    s.write(prefix_config(weight=2) + "flowControl: {}\n")
    assert s.reloader.reload_now() == "refused"
    assert s.router.scheduler is scheduler and s.count("refused") == 1


def test_adding_precise_prefix_cache_needs_a_restart(tmp_path: Path) -> None:
    s = Setup(tmp_path, prefix_config())
    s.write(prefix_config(extra="        - name: precise-prefix-cache\n          weight: 1"))
    assert s.reloader.reload_now() == "refused"


def test_the_poll_applies_a_configmap_symlink_swap(tmp_path: Path) -> None:
    """A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> a timestamped
    directory, swapped for a new one on update (the file's own path never changes)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "v1").mkdir()
    (volume / "v1" / "config.yaml").write_text(prefix_config())
    (volume / "..data").symlink_to("v1")
    (volume / "config.yaml").symlink_to("..data/config.yaml")
    s = Setup(volume, prefix_config(), poll_s=0.05)
    s.file.unlink()
    s.file.symlink_to("..data/config.yaml")
    s.reloader.start()
    try:
        (volume / "v2").mkdir()
        (volume / "v2" / "config.yaml").write_text(prefix_config(weight=7))
        (volume / "..data_tmp").symlink_to("v2")
        os.replace(volume / "..data_tmp", volume / "..data")
        wait_until(lambda: s.router.scheduler.scorers[0].weight == 7)
        assert s.count("applied") == 2
    finally:
        s.reloader.stop()


def test_the_embedded_default_has_nothing_to_reload(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    text, source = config_text(None)
    config = parse_config(text, source)
    router = Router(build_scheduler(config, registry), PODS, registry=registry)
    reloader = ConfigReloader(router, None, text, config, registry)
    assert not reloader.watching and reloader.reload_now() == "unchanged"


def precise_config(weight: int = 1, capacity: int = 1000) -> str:
    return f"""
scheduler:
  plugins:
    Score:
      enabled:
        - name: precise-prefix-cache
          weight: {weight}
  pluginConfig:
    - name: precise-prefix-cache
      args: {{capacityBlocks: {capacity}}}
"""


def test_the_kv_event_view_is_kept_so_the_subscriber_feeds_the_live_one(tmp_path: Path) -> None:
    s = Setup(tmp_path, precise_config())
    before = plugin(s.router, "precise-prefix-cache")
    assert isinstance(before, PrecisePrefixCache)
    fed = before.index  # what app.start hands the KV-events subscriber
    s.write(precise_config(weight=2, capacity=500))
    assert s.reloader.reload_now() == "applied"
    after = plugin(s.router, "precise-prefix-cache")
    assert isinstance(after, PrecisePrefixCache) and after is not before
    assert after.index is fed and fed.capacity == 500
    s.write(prefix_config())  # removing it would leave the subscriber feeding nothing
    assert s.reloader.reload_now() == "refused"
    assert plugin(s.router, "precise-prefix-cache") is after


def test_every_plugin_builds_again_on_the_same_registry(tmp_path: Path) -> None:
    """No "Duplicated timeseries": every metric a plugin or the scheduler registers is
    shared per registry, and the rebuilt plugins' gauges read the new plugins."""
    models = {"m": str(write_tokenizer(tmp_path / "m"))}
    enabled = "\n".join(f"        - name: {name}\n          weight: 1" for name in sorted(BUILTIN))
    text = f"""
scheduler:
  plugins:
    Filter:
      enabled: [least-request]
    Score:
      enabled:
{enabled}
  pluginConfig:
    - name: precise-prefix-cache
      args: {{models: {orjson.dumps(models).decode()}}}
"""
    s = Setup(tmp_path, text)
    s.serve("warm")
    s.write(text.replace("weight: 1", "weight: 2"))
    assert s.reloader.reload_now() == "applied"
    entries = s.registry.get_sample_value("extproc_estimated_ttft_entries")
    ttft = plugin(s.router, "estimated-ttft")
    assert isinstance(ttft, EstimatedTTFT) and entries == ttft.index.num_entries > 0
