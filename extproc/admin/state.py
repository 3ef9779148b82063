"""What the admin port shows: each pod's state (``/debug/pods``) and the scheduler
configuration in force (``/debug/config``), as JSON-ready dicts.

Both are read at request time from the router (so a reload's ``Router.set_scheduler``
shows at once), never on the request path, and change nothing.

``pods_state`` answers, keys kept stable (the status page reads them)::

    {
      "replica": str,               # this extproc's replica id
      "config_source": str,         # the configuration file (or embedded name) in force
      "uptime_s": float,            # since the admin port started
      "pending": int,               # routed requests waiting for their end
      "flow_control": {"enabled": bool, "held": int},
      "pods": [{
        "id": "namespace/name", "namespace": str, "name": str,
        "address": "ip:port", "models": [str], "role": "both|prefill|decode",
        "ready": bool,
        "load": {"waiting": int, "running": int, "kv_usage": float,
                 "scrape_age_s": float | null},     # null: never scraped (or no scraping)
        "in_flight": {"requests": int, "tokens": int},   # this router's, prefill tokens
        "views": {"<plugin>": {"blocks": int, "last_record_age_s": float | null,
                               "stale": bool}},       # each plugin's prefix view of it
        "kv_events": null | {"next_seq": int | null, "last_event_age_s": float | null,
                             "gaps": int, "replays": int, "marked_stale": int,
                             "restarts": int}         # precise-prefix-cache only
      }]
    }

``config_state`` answers the configuration in the YAML's own names, every plugin's
arguments with their defaults filled in (``scheduler.pluginConfig``), the
``flowControl`` section likewise, and ``modelRewrites``: the rules in force, the file's
and the watched InferenceModelRewrites' (each with ``from``: where it is written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from extproc.datalayer.kv_events import KvEventsSubscriber
from extproc.datalayer.store import PodStore
from extproc.pods import Pod, PodId
from extproc.routing.flow.config import FlowConfig
from extproc.routing.rewrites import RewriteRule
from extproc.routing.router import Router
from extproc.scheduling.config import plugins_of
from extproc.scheduling.interfaces import ViewInspector
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache


def scrape_ages(store: PodStore | None) -> dict[PodId, float | None]:
    """Seconds since each pod's last successful scrape (None: none yet, or no scraping)."""
    return {} if store is None else store.scrape_ages()


def pods_state(
    router: Router,
    *,
    config_source: str,
    uptime_s: float,
    store: PodStore | None = None,
    kv_events: KvEventsSubscriber | None = None,
) -> dict[str, Any]:
    """``/debug/pods`` (module doc)."""
    pods = router.pods
    plugins = plugins_of(router.scheduler).values()
    inspectors = [p for p in plugins if isinstance(p, ViewInspector)]
    ages = scrape_ages(store)
    in_flight = router.in_flight.snapshot()
    events = kv_events.pod_states([p.id for p in pods]) if kv_events is not None else {}
    flow = router.flow
    return {
        "replica": router.replica_id,
        "config_source": config_source,
        "uptime_s": round(uptime_s, 3),
        "pending": len(router.pending),
        "flow_control": {"enabled": flow is not None, "held": flow.held if flow else 0},
        "pods": [
            _pod_state(pod, inspectors, ages.get(pod.id), in_flight, events.get(pod.id))
            for pod in pods
        ],
    }


def _pod_state(
    pod: Pod,
    inspectors: list[Any],
    scrape_age_s: float | None,
    in_flight: Mapping[PodId, Any],
    events: Any,
) -> dict[str, Any]:
    m = pod.metrics
    count = in_flight.get(pod.id)
    views = {}
    for plugin in inspectors:
        view = plugin.pod_view(pod.id)
        age = view.last_record_age_s
        views[plugin.type_name] = {
            "blocks": view.blocks,
            "last_record_age_s": None if age is None else round(age, 3),
            "stale": view.stale,
        }
    return {
        "id": str(pod.id),
        "namespace": pod.id.namespace,
        "name": pod.id.name,
        "address": pod.address,
        "models": sorted(pod.models),
        "adapters": sorted(pod.adapters),
        "rank": pod.rank,
        "role": pod.role.value,
        "ready": pod.ready,
        "load": {
            "waiting": m.waiting,
            "running": m.running,
            "kv_usage": m.kv_usage,
            "scrape_age_s": scrape_age_s,
        },
        "in_flight": {
            "requests": count.num_requests if count else 0,
            "tokens": count.num_tokens if count else 0,
        },
        "views": views,
        "kv_events": None if events is None else _events(events),
    }


def _events(state: Any) -> dict[str, Any]:
    out: dict[str, Any] = state._asdict()
    age = out["last_event_age_s"]
    out["last_event_age_s"] = None if age is None else round(age, 3)
    return out


def config_state(router: Router, config_source: str) -> dict[str, Any]:
    """``/debug/config``: the router's scheduler and flow control now (module doc)."""
    scheduler = router.scheduler
    plugins = plugins_of(scheduler).items()
    plugin_config = [{"name": name, "args": plugin_args(p)} for name, p in plugins]
    section: dict[str, Any] = {
        "plugins": {
            "Filter": {"enabled": [f.type_name for f in scheduler.filters]},
            "Score": {
                "enabled": [
                    {"name": ws.scorer.type_name, "weight": ws.weight} for ws in scheduler.scorers
                ]
            },
        },
        "pluginConfig": plugin_config,
    }
    out: dict[str, Any] = {"source": config_source, "scheduler": section}
    pd = scheduler.pd_group
    if pd is not None:
        out["pdGroup"] = {
            "groupKey": pd.group_key,
            "prefillLabels": dict(pd.prefill_labels),
            "decodeLabels": dict(pd.decode_labels),
        }
    flow = router.flow.config if router.flow is not None else FlowConfig(enabled=False)
    out["flowControl"] = flow_section(flow)
    out["modelRewrites"] = [rewrite_rule(rule) for rule in router.rewrites.rules]
    out["sessions"] = {"sticky": scheduler.sessions is not None}
    return out


def plugin_args(plugin: Any) -> dict[str, Any]:
    """A plugin's arguments in force, under their configuration keys (defaults filled
    in: the args dataclass holds them all)."""
    args = getattr(plugin, "args", None)
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        out = dataclasses.asdict(args)
    if isinstance(plugin, PrecisePrefixCache):
        out["models"] = sorted(plugin.tokenizers)
    return out


def rewrite_rule(rule: RewriteRule) -> dict[str, Any]:
    """A rewrite rule in the YAML's keys (``routing.rewrites``), and where it is written."""
    return {
        "matches": [{"model": {"type": "Exact", "value": m}} for m in rule.models],
        "targets": [{"modelRewrite": t.model, "weight": t.weight} for t in rule.targets],
        "from": rule.where,
    }


def flow_section(flow: FlowConfig) -> dict[str, Any]:
    """``flowControl`` in the YAML's keys (``routing.flow.config``), every default shown."""
    return {
        "enabled": flow.enabled,
        "trustedHeaders": sorted(flow.trusted_headers),
        "objectives": dict(flow.objectives),
        "defaultPriority": flow.default_priority,
        "fairness": {"header": flow.fairness_header, "bodyField": flow.fairness_body_field},
        "saturation": {
            "maxWaiting": flow.max_waiting,
            "maxKvUsage": flow.max_kv_usage,
            "reservedSlots": flow.reserved_slots,
            "reservedFor": flow.reserved_for,
            "batchSlots": flow.batch_slots,
        },
        "queue": {
            "maxRequests": flow.max_requests,
            "maxBytes": flow.max_bytes,
            "ttlS": flow.ttl_s,
            "bandTtlS": {str(k): v for k, v in flow.band_ttl_s.items()},
            "retryAfterS": flow.retry_after_s,
        },
    }
