"""metrics.md: every metric family ``extproc serve`` exposes, by when: found by starting
what serve builds (``cli.app.start``) into a fresh registry, once per mode (no scraping
and one plugin without metrics, then scraping on, each plugin, flow control, Redis
sharing, the view snapshot), plus
prometheus_client's default collectors (the process and the Python runtime)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import yaml
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
)
from prometheus_client.metrics import MetricWrapperBase

from extproc.cli import app, build_parser
from extproc.scheduling.registry import BUILTIN
from tools.docs_reference.cli import environment
from tools.docs_reference.markdown import GENERATED, code, table, text


class Family(NamedTuple):
    name: str  # as exposed: a counter's with ``_total``
    type: str
    labels: tuple[str, ...]
    help: str


# One pod nothing listens on: the scraper's errors only move counters.
_PODS = "pods:\n  - name: p0\n    address: 127.0.0.1:9\n    models: [m]\n"


class Condition(NamedTuple):
    """When a family is exported; sorted in this order on the page."""

    rank: int
    plugin: str = ""  # rank PLUGIN: the plugin whose configuration adds it

    def heading(self) -> str:
        return _HEADINGS.get(self.rank, f"the `{self.plugin}` plugin")


ALWAYS, SCRAPING, PLUGIN, FLOW, REDIS, SNAPSHOT, RUNTIME = range(7)
_HEADINGS = {
    ALWAYS: "Always",
    SCRAPING: "With scraping (`--stale-after-s` > 0, the default)",
    FLOW: "With flow control (a `flowControl` section in the configuration)",
    REDIS: "With `--redis-url` (replicas sharing their view)",
    SNAPSHOT: "With `--view-snapshot` or `--view-snapshot-dir` (the view kept across restarts)",
    RUNTIME: "The process and the Python runtime (prometheus_client's default collectors)",
}


def metrics_page() -> str:
    conditions: dict[str, list[Condition]] = {}
    families: dict[str, Family] = {}

    def add(condition: Condition, found: Mapping[str, Family]) -> None:
        for name, family in found.items():
            families.setdefault(name, family)
            conditions.setdefault(name, []).append(condition)

    no_scraping = ["--stale-after-s", "0"]
    base = _serve_families(no_scraping, "gpu-usage")
    add(Condition(ALWAYS), base)
    add(Condition(SCRAPING), _without(_serve_families([], "gpu-usage"), base))
    for plugin in sorted(BUILTIN):
        add(Condition(PLUGIN, plugin), _without(_serve_families(no_scraping, plugin), base))
    flow = _serve_families(no_scraping, "gpu-usage", flow_control={})
    add(Condition(FLOW), _without(flow, base))
    redis = [*no_scraping, "--redis-url", "redis://127.0.0.1:1"]
    add(Condition(REDIS), _without(_serve_families(redis, "gpu-usage"), base))
    with tempfile.TemporaryDirectory() as views:
        snapshot = [*no_scraping, "--view-snapshot-dir", views]
        add(Condition(SNAPSHOT), _without(_serve_families(snapshot, "gpu-usage"), base))
    runtime = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        runtime.register(collector)
    add(Condition(RUNTIME), _families(runtime))

    by_condition: dict[tuple[Condition, ...], list[Family]] = {}
    for name in sorted(families):
        by_condition.setdefault(tuple(sorted(conditions[name])), []).append(families[name])
    parts = [
        GENERATED.format(source="the metrics `extproc serve` registers"),
        "# Metrics\n\n",
        (
            "Every metric family `extproc serve` exposes on `--metrics-port` (`/metrics`, "
            "Prometheus text format), by when it is exported. Counters are shown as exposed, "
            "with `_total` (each also has a `_created` series); a histogram `NAME` exposes "
            "`NAME_bucket`, `NAME_sum` and `NAME_count`.\n"
        ),
    ]
    for condition, members in sorted(by_condition.items()):
        parts.append(f"\n## {_heading(condition)}\n\n")
        parts.append(
            table(
                ["Metric", "Type", "Labels", "Help"],
                [
                    [code(f.name), f.type, ", ".join(code(x) for x in f.labels), text(f.help)]
                    for f in members
                ],
            )
        )
    return "".join(parts)


def _heading(conditions: tuple[Condition, ...]) -> str:
    plugins = [c.plugin for c in conditions if c.rank == PLUGIN]
    if len(plugins) == len(conditions):
        names = " or ".join(f"`{p}`" for p in plugins)
        return f"With the {names} plugin{'s' if len(plugins) > 1 else ''} configured"
    return " or ".join(c.heading() for c in conditions)


def _without(found: Mapping[str, Family], base: Mapping[str, Family]) -> dict[str, Family]:
    return {name: family for name, family in found.items() if name not in base}


def _serve_families(
    flags: list[str], plugin: str, flow_control: dict[str, object] | None = None
) -> dict[str, Family]:
    """The families ``extproc serve`` registers with ``flags`` and only ``plugin``
    configured (a precise-prefix-cache without models: its tokenizers are per model),
    and ``flow_control`` as the ``flowControl`` section if given."""
    config: dict[str, object] = {
        "scheduler": {
            "plugins": {"Score": {"enabled": [{"name": plugin, "weight": 1}]}},
            "pluginConfig": [{"name": plugin, "args": None}],
        }
    }
    if flow_control is not None:
        config["flowControl"] = flow_control
    with tempfile.TemporaryDirectory() as tmp, environment({}), _quiet():
        (Path(tmp) / "pods.yaml").write_text(_PODS)
        (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config))
        argv = ["serve", "--address", "127.0.0.1", "--grpc-port", "0", "--health-port", "0"]
        argv += [
            "--metrics-port",
            "0",
            "--pods",
            f"{tmp}/pods.yaml",
            "--config",
            f"{tmp}/config.yaml",
        ]
        registry = CollectorRegistry()
        running = app.start(build_parser().parse_args(argv + flags), registry)
        try:
            return _families(registry)
        finally:
            running.stop(drain_s=0)


@contextmanager
def _quiet() -> Iterator[None]:
    """No log lines while a picker runs only to show its metrics (Redis unreachable...)."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _families(registry: CollectorRegistry) -> dict[str, Family]:
    """Each family ``registry`` exposes, with its label names (a labelled metric with no
    child yet has no sample to show them: they are read from the metric objects)."""
    found: dict[str, Family] = {}
    # prometheus_client's private table of collectors: guarded, the registry's public
    # collect() serves without it (label names then only from samples).
    collectors = getattr(registry, "_collector_to_names", None)
    for collector in list(collectors) if collectors is not None else [registry]:
        wrapper_labels = (
            getattr(collector, "_labelnames", None)
            if isinstance(collector, MetricWrapperBase)
            else None
        )
        by_family = getattr(collector, "family_labelnames", {})  # a collector relaying families
        for metric in collector.collect():
            labels = wrapper_labels or by_family.get(metric.name)
            if labels is None:
                labels = getattr(metric, "_labelnames", None) or tuple(
                    sorted({k for s in metric.samples for k in s.labels} - {"le", "quantile"})
                )
            name = f"{metric.name}_total" if metric.type == "counter" else metric.name
            found[name] = Family(name, metric.type, tuple(labels), metric.documentation)
    return found
