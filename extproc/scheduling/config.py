"""The Kthena-style scheduler configuration (YAML) -> a configured ``Scheduler``.

Format::

    scheduler:
      plugins:
        Filter:
          enabled: [least-request]          # names (or {name: ...} mappings)
        Score:
          enabled:
            - name: prefix-cache
              weight: 1                     # an integer > 0, required
          disabled: [...]                   # accepted and ignored, as in Kthena
      pluginConfig:
        - name: prefix-cache
          args: {blockSizeToHash: 64, maxBlocksToMatch: 128, ...}

Semantics follow Kthena: a score weight that is missing, 0 or negative stops start-up
with ``score plugin "NAME" must set a weight greater than 0, got N``; ``Score.disabled``
has no effect; plugin args use ``extproc.scheduling.args`` rules. An unknown plugin,
unreadable YAML or a missing file stops start-up with a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from extproc.errors import ConfigError
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.registry import BUILTIN
from extproc.scheduling.scheduler import PluginTimer, Scheduler, WeightedScorer
from extproc.scheduling.sessions import SessionStore
from extproc.scheduling.types import (
    Filter,
    Plugin,
    PluginContext,
    PodsListener,
    PrefixMatcher,
    Provisional,
    Recorder,
    Scorer,
)

log = logging.getLogger("extproc.scheduling.config")

DEFAULT_CONFIG_NAME = "<embedded default config.yaml>"


@dataclass(frozen=True, slots=True)
class ScoreEntry:
    name: str
    weight: int


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The parsed, validated configuration (no plugin built yet)."""

    source: str  # the file it came from, for messages
    filters: tuple[str, ...]
    scores: tuple[ScoreEntry, ...]
    plugin_args: dict[str, Any]


NAMED_CONFIGS = ("default", "kthena", "cost-aware")  # extproc/data/<name>.yaml; default: config


def default_config_text() -> str:
    return named_config_text("default")


def named_config_text(name: str) -> str:
    """An embedded configuration by name (``NAMED_CONFIGS``)."""
    file = "config" if name == "default" else name
    return resources.files("extproc").joinpath(f"data/{file}.yaml").read_text("utf-8")


def load_config(path: str | Path | None = None) -> SchedulerConfig:
    """Read and validate a configuration file; ``None`` means the embedded default.

    A name of ``NAMED_CONFIGS`` (``kthena``: Kthena's default) that is not also a file
    here selects that embedded configuration.
    """
    if path is None:
        return parse_config(default_config_text(), DEFAULT_CONFIG_NAME)
    if str(path) in NAMED_CONFIGS and not Path(path).exists():
        return parse_config(named_config_text(str(path)), f"<embedded {path} configuration>")
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc}") from None
    return parse_config(text, str(path))


def parse_config(text: str, source: str) -> SchedulerConfig:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("scheduler"), dict):
        raise ConfigError(f"{source}: expected a mapping with a 'scheduler' section")
    scheduler = doc["scheduler"]
    plugins = _mapping(scheduler.get("plugins"), f"{source}: scheduler.plugins")
    filter_section = _mapping(plugins.get("Filter"), f"{source}: scheduler.plugins.Filter")
    score_section = _mapping(plugins.get("Score"), f"{source}: scheduler.plugins.Score")
    filters = tuple(
        _plugin_name(item, f"{source}: scheduler.plugins.Filter.enabled[{i}]")
        for i, item in enumerate(_list(filter_section.get("enabled"), source, "Filter.enabled"))
    )
    scores = tuple(
        _score_entry(item, source, i)
        for i, item in enumerate(_list(score_section.get("enabled"), source, "Score.enabled"))
    )
    for name in (*filters, *(s.name for s in scores)):
        if name not in BUILTIN:
            raise ConfigError(
                f"{source}: unknown plugin {name!r}; known plugins: {', '.join(sorted(BUILTIN))}"
            )
    plugin_args: dict[str, Any] = {}
    for i, entry in enumerate(_list(scheduler.get("pluginConfig"), source, "pluginConfig")):
        where = f"{source}: scheduler.pluginConfig[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{where}: each entry needs a 'name' string and optional 'args'")
        plugin_args[entry["name"]] = entry.get("args")
    return SchedulerConfig(source, filters, scores, plugin_args)


def build_scheduler(
    config: SchedulerConfig,
    registry: CollectorRegistry = REGISTRY,
    in_flight: InFlight | None = None,
    sessions: SessionStore | None = None,
) -> Scheduler:
    """Instantiate each named plugin once and wire it into every role it was given.

    ``in_flight`` is the router's counters, shared with the plugins that read them;
    ``sessions`` turns session sticky on. A plugin that offers the prefix view
    (``PrefixMatcher``) is built first and handed to the others in their context.
    """
    ctx = PluginContext(
        registry=registry, in_flight=in_flight if in_flight is not None else InFlight()
    )
    names = list(dict.fromkeys((*config.filters, *(s.name for s in config.scores))))
    names.sort(key=lambda name: not issubclass(BUILTIN[name], PrefixMatcher))
    instances: dict[str, Plugin] = {}
    for name in names:
        plugin = BUILTIN[name].from_args(config.plugin_args.get(name), ctx)
        instances[name] = plugin
        if ctx.prefix is None and isinstance(plugin, PrefixMatcher):
            ctx = replace(ctx, prefix=plugin)
    filters: list[Filter] = []
    for name in config.filters:
        plugin = instances[name]
        if not isinstance(plugin, Filter):
            raise ConfigError(f"{config.source}: plugin {name!r} is not a Filter plugin")
        filters.append(plugin)
    scorers: list[WeightedScorer] = []
    for entry in config.scores:
        plugin = instances[entry.name]
        if not isinstance(plugin, Scorer):
            raise ConfigError(f"{config.source}: plugin {entry.name!r} is not a Score plugin")
        scorers.append(WeightedScorer(plugin, entry.weight))
    unused = sorted(set(config.plugin_args) - set(instances))
    if unused:
        log.warning("%s: pluginConfig for plugins that are not enabled: %s", config.source, unused)
    log.info(
        "scheduler from %s: filters %s, scores %s",
        config.source,
        list(config.filters),
        [f"{s.name}*{s.weight}" for s in config.scores],
    )
    return Scheduler(
        filters=tuple(filters),
        scorers=tuple(scorers),
        recorders=tuple(p for p in instances.values() if isinstance(p, Recorder)),
        listeners=tuple(p for p in instances.values() if isinstance(p, PodsListener)),
        provisional=tuple(p for p in instances.values() if isinstance(p, Provisional)),
        in_flight=ctx.in_flight,
        sessions=sessions,
        timer=PluginTimer(registry),
    )


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping")
    return value


def _list(value: Any, source: str, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{source}: scheduler.{what} must be a list")
    return value


def _plugin_name(item: Any, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        return str(item["name"])
    raise ConfigError(f"{where}: expected a plugin name")


def _score_entry(item: Any, source: str, idx: int) -> ScoreEntry:
    where = f"{source}: scheduler.plugins.Score.enabled[{idx}]"
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ConfigError(f"{where}: expected a mapping with 'name' and 'weight'")
    name = item["name"]
    weight = item.get("weight", 0)
    if weight is None:
        weight = 0
    if isinstance(weight, bool) or not isinstance(weight, int):
        raise ConfigError(
            f"{source}: failed to Load Scheduler: failed to Unmarshal Plugins: "
            f'score plugin "{name}" weight must be an integer, got {weight!r}'
        )
    if weight <= 0:
        raise ConfigError(
            f"{source}: failed to Load Scheduler: failed to Unmarshal Plugins: "
            f'score plugin "{name}" must set a weight greater than 0, got {weight}'
        )
    return ScoreEntry(name, weight)
