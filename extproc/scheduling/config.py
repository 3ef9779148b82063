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
    pdGroup:                                # optional: prefill/decode groups by labels
      groupKey: modelserving.volcano.sh/group-name      # (``scheduling.pdgroup``)
      prefillLabels: {modelserving.volcano.sh/role: prefill}
      decodeLabels: {modelserving.volcano.sh/role: decode}
    flowControl: {...}                      # optional: priorities, fairness, a queue
                                            # (``routing.flow.config``)
    modelRewrites: [...]                    # optional: model A to B, or weighted splits
                                            # (``routing.rewrites``)

Semantics follow Kthena's spec, ``conf.go`` and ``factory.go``: a score weight that is missing,
0 or negative stops start-up with ``score plugin "NAME" must set a weight greater than
0, got N`` (the spec; Kthena's code reads a missing one as 0 and a negative one as 0,
logged, and the spec wins); a plugin listed twice in ``Score.enabled`` is configured
once, with its last entry's weight (Kthena keeps them in a map), a filter listed twice
runs once (Kthena runs it again, on the pods it kept: the same pods), and a
``pluginConfig`` entry listed twice gives its last args;
``Score.disabled`` has no effect; a name no built-in plugin answers to (for that
extension point) is logged as ``Failed to get plugin NAME.`` and skipped, except Kthena's
``kvcache-aware`` score (its Redis block index, fed from the pods' KV events), read as
``precise-prefix-cache`` (the pods' KV events, read here) when that is configured, and
otherwise logged and skipped (``_map_kvcache_aware``; a kvcache-aware argument that is
not an integer is left at its default alone, as in Kthena); plugin args
use ``extproc.scheduling.args`` rules, except that an invalid least-latency
``TTFTTPOTWeightFactor`` stops start-up, as in Kthena. Unreadable YAML or a missing file
stops start-up with a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from extproc.errors import ConfigError
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.interfaces import (
    ExactPrefix,
    Filter,
    Plugin,
    PluginContext,
    PodsListener,
    PrefixMatcher,
    Preparer,
    Provisional,
    Recorder,
    Reloadable,
    Scorer,
)
from extproc.scheduling.pdgroup import PDGroup
from extproc.scheduling.plugins.least_latency import LeastLatency, check_least_latency_args
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.scheduling.registry import BUILTIN
from extproc.scheduling.scheduler import PluginTimer, Scheduler, WeightedScorer
from extproc.scheduling.sessions import SessionStore
from extproc.scheduling.shared_metrics import per_registry

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
    pd_group: PDGroup | None = None  # the optional top-level ``pdGroup`` section
    # The optional top-level ``flowControl`` section, as written: the routing layer
    # parses it (``routing.flow.config``), the scheduler does not use it.
    flow_control: Any = None
    # The optional top-level ``modelRewrites`` section, as written (``routing.rewrites``).
    model_rewrites: Any = None


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
    return parse_config(*config_text(path))


def config_text(path: str | Path | None = None) -> tuple[str, str]:
    """The text of the configuration ``load_config`` reads for ``path``, and its source
    (the name its errors give).

    Raises:
        ConfigError: the file is missing or unreadable.
    """
    if path is None:
        return default_config_text(), DEFAULT_CONFIG_NAME
    if str(path) in NAMED_CONFIGS and not Path(path).exists():
        return named_config_text(str(path)), f"<embedded {path} configuration>"
    try:
        return Path(path).read_text("utf-8"), str(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc}") from None


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
    weights: dict[str, int] = {}  # Kthena's map: the last entry of a name wins
    for i, item in enumerate(_list(score_section.get("enabled"), source, "Score.enabled")):
        entry = _score_entry(item, source, i)
        weights.pop(entry.name, None)
        weights[entry.name] = entry.weight
    plugin_args: dict[str, Any] = {}
    for i, entry in enumerate(_list(scheduler.get("pluginConfig"), source, "pluginConfig")):
        where = f"{source}: scheduler.pluginConfig[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{where}: each entry needs a 'name' string and optional 'args'")
        if entry["name"] == LeastLatency.type_name and "args" in entry:
            problem = check_least_latency_args(entry["args"])
            if problem:
                raise ConfigError(
                    f"{source}: failed to Load Scheduler: failed to Unmarshal PluginsConfig: "
                    f"invalid {entry['name']} plugin configuration: {problem}"
                )
        plugin_args[entry["name"]] = entry.get("args")
    _map_kvcache_aware(weights, plugin_args, source)
    filters = tuple(dict.fromkeys(_known(filters, Filter)))
    scores = tuple(ScoreEntry(name, weights[name]) for name in _known(weights, Scorer))
    pd_group = None
    if doc.get("pdGroup") is not None:
        pd_group = PDGroup.parse(doc["pdGroup"], f"{source}: pdGroup")
    return SchedulerConfig(
        source,
        filters,
        scores,
        plugin_args,
        pd_group,
        doc.get("flowControl"),
        doc.get("modelRewrites"),
    )


def _known(names: Iterable[str], point: type) -> list[str]:
    """The names a built-in plugin answers to at ``point`` (Filter, Scorer); Kthena's
    registry lookup: any other is logged and skipped."""
    known = []
    for name in names:
        plugin = BUILTIN.get(name)
        if plugin is None or not _implements(plugin, point):
            log.error("Failed to get plugin %s.", name)
        else:
            known.append(name)
    return known


KVCACHE_AWARE = "kvcache-aware"
# kvcache-aware's args that mean the same for precise-prefix-cache: the tokens per block.
KVCACHE_AWARE_ARGS = {"blocksizetohash": "blockSize"}


def _map_kvcache_aware(weights: dict[str, int], plugin_args: dict[str, Any], source: str) -> None:
    """Kthena's ``kvcache-aware`` score becomes ``precise-prefix-cache`` (same place, same
    weight) when that is configured (enabled or given a ``pluginConfig`` entry), its
    ``blockSizeToHash`` read as ``blockSize`` unless that is set; otherwise it is logged
    once and skipped. Both enabled: one plugin, with precise-prefix-cache's weight."""
    if KVCACHE_AWARE not in weights:
        return
    precise = PrecisePrefixCache.type_name
    names = (KVCACHE_AWARE, precise)
    args = plugin_args.pop(KVCACHE_AWARE, None)
    if precise not in weights and precise not in plugin_args:
        del weights[KVCACHE_AWARE]
        log.error(
            "%s: %s skipped: extproc reads the pods' KV events through %s, which is not "
            "configured (enable it, or give it a pluginConfig entry with its models)",
            source,
            *names,
        )
        return
    if precise in weights:
        del weights[KVCACHE_AWARE]
        log.warning("%s: %s is %s here: configured once, with its weight", source, *names)
    else:
        renamed = {precise if k == KVCACHE_AWARE else k: w for k, w in weights.items()}
        weights.clear()
        weights.update(renamed)
        log.info("%s: %s read as %s", source, *names)
    plugin_args[precise] = _translated_args(args, plugin_args.get(precise), source)


def _translated_args(kvcache: Any, precise: Any, source: str) -> Any:
    """precise-prefix-cache's args with kvcache-aware's that mean the same added where
    precise-prefix-cache's own leave them unset; kvcache-aware's others are dropped
    (logged): extproc tokenizes in process, and matches whole prompts."""
    if not isinstance(kvcache, dict) or not kvcache:
        return precise
    own = dict(precise) if isinstance(precise, dict) else {}
    own_keys = {k.lower() for k in own if isinstance(k, str)}
    dropped = []
    for key, value in kvcache.items():
        target = KVCACHE_AWARE_ARGS.get(key.lower()) if isinstance(key, str) else None
        if target is None:
            dropped.append(key)
        elif target.lower() not in own_keys and _readable_int(key, value, source):
            own[target] = value
    if dropped:
        precise = PrecisePrefixCache.type_name
        log.warning(
            "%s: %s args with no %s meaning, ignored: %s", source, KVCACHE_AWARE, precise, dropped
        )
    return own


def _readable_int(key: str, value: Any, source: str) -> bool:
    """Whether kvcache-aware's ``key`` decodes as Kthena's int field. One that does not
    (a string, a fraction) leaves only that argument at its default, as Go's decoder
    skips the field and Kthena's plugin keeps the others; carried over, it would make
    precise-prefix-cache's whole block unparseable."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return True
    log.warning(
        "%s: %s %s %r is not an integer, using the default", source, KVCACHE_AWARE, key, value
    )
    return False


def _implements(plugin: type, point: type) -> bool:
    method = "filter" if point is Filter else "score"
    return callable(getattr(plugin, method, None))


def build_scheduler(
    config: SchedulerConfig,
    registry: CollectorRegistry = REGISTRY,
    in_flight: InFlight | None = None,
    sessions: SessionStore | None = None,
    previous: Scheduler | None = None,
) -> Scheduler:
    """Instantiate each named plugin once and wire it into every role it was given.

    ``in_flight`` is the router's counters, shared with the plugins that read them;
    ``sessions`` turns session sticky on. A plugin that offers exact prefix counts
    (``ExactPrefix``), then one that offers the prefix view (``PrefixMatcher``), is built
    first and handed to the others in their context. ``previous``, a reload's scheduler
    in force: each new plugin takes over the state of the previous plugin of its type
    (``Reloadable.adopt``), once all are built. Metrics are registered once per registry
    (``shared_metrics``), so building again on the same registry reuses them.
    """
    ctx = PluginContext(
        registry=registry,
        in_flight=in_flight if in_flight is not None else InFlight(),
    )
    names = list(dict.fromkeys((*config.filters, *(s.name for s in config.scores))))
    names.sort(
        key=lambda name: (
            not issubclass(BUILTIN[name], ExactPrefix),
            not issubclass(BUILTIN[name], PrefixMatcher),
        )
    )
    instances: dict[str, Plugin] = {}
    for name in names:
        plugin = BUILTIN[name].from_args(config.plugin_args.get(name), ctx)
        instances[name] = plugin
        if ctx.exact is None and isinstance(plugin, ExactPrefix):
            ctx = replace(ctx, exact=plugin)
        if ctx.prefix is None and isinstance(plugin, PrefixMatcher):
            ctx = replace(ctx, prefix=plugin)
    filters = [p for p in map(instances.__getitem__, config.filters) if isinstance(p, Filter)]
    scorers = [
        WeightedScorer(plugin, entry.weight)
        for entry in config.scores
        if isinstance(plugin := instances[entry.name], Scorer)
    ]
    if previous is not None:
        _adopt(instances, previous)
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
        preparers=tuple(p for p in instances.values() if isinstance(p, Preparer)),
        in_flight=ctx.in_flight,
        sessions=sessions,
        timer=per_registry(registry, "plugin-timer", lambda: PluginTimer(registry)),
        pd_group=config.pd_group,
    )


def plugins_of(scheduler: Scheduler) -> dict[str, object]:
    """The scheduler's plugin instances by type name (each in whatever roles it has)."""
    found: dict[str, object] = {}
    roles: Iterable[Iterable[object]] = (
        scheduler.filters,
        (w.scorer for w in scheduler.scorers),
        scheduler.recorders,
        scheduler.listeners,
        scheduler.provisional,
        scheduler.preparers,
    )
    for role in roles:
        for plugin in role:
            found.setdefault(getattr(plugin, "type_name", repr(plugin)), plugin)
    return found


def _adopt(instances: dict[str, Plugin], previous: Scheduler) -> None:
    """Each new plugin takes over its predecessor's state (``Reloadable``)."""
    before = plugins_of(previous)
    for name, plugin in instances.items():
        old = before.get(name)
        if old is not None and isinstance(plugin, Reloadable):
            kept = plugin.adopt(old)
            log.info("reload: %s %s its state", name, "kept" if kept else "kept part of")


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
