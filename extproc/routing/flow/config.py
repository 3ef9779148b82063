"""The ``flowControl`` section of the scheduler configuration -> ``FlowConfig``.

Format (every key optional; the section absent, or ``enabled: false``, is today's
behaviour: no request is held or refused by flow control)::

    flowControl:
      enabled: true
      trustedHeaders: [x-gateway-inference-objective, x-gateway-inference-fairness-id]
      objectives: {critical: 100, standard: 0, sheddable: -1}   # name -> priority
      defaultPriority: 0            # no objective, an unknown or a malformed one
      fairness: {header: x-gateway-inference-fairness-id, bodyField: user}
      saturation: {maxWaiting: 1, maxKvUsage: 0.9, reservedSlots: 0, reservedFor: 1,
                   batchSlots: null}   # the engines' --max-num-seqs, if known
      queue: {maxRequests: 1000, maxBytes: 104857600, ttlS: 15, bandTtlS: {100: 30},
              retryAfterS: 1}

Unlike plugin args (Kthena's lax rules, ``scheduling.args``), this is extproc's own
section: a key of the wrong type or out of range stops start-up, naming it, and an
unknown key does too (a misspelt limit must not silently fall back to a default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.errors import ConfigError

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """Flow control's settings; the defaults are the shipped ones (docs: flow control)."""

    enabled: bool = False
    trusted_headers: frozenset[str] = frozenset()
    objectives: Mapping[str, int] = field(default_factory=dict)
    default_priority: int = 0
    fairness_header: str | None = FAIRNESS_HEADER
    fairness_body_field: str | None = None
    max_waiting: float = 1
    max_kv_usage: float = 0.9
    reserved_slots: int = 0  # room kept for priorities >= reserved_for
    reserved_for: int = 1
    batch_slots: int | None = None  # each pod's batch size, if given (else learned)
    max_requests: int = 1000
    max_bytes: int = 100 << 20
    ttl_s: float = 15.0
    band_ttl_s: Mapping[int, float] = field(default_factory=dict)
    retry_after_s: int = 1
    # Not in the section: whether the pods' metrics are scraped (``serve
    # --stale-after-s 0`` turns scraping off; saturation then counts extproc's in-flight
    # requests alone).
    scraped: bool = True

    def ttl_for(self, priority: int) -> float:
        """The time to live of a request of ``priority`` in the queue."""
        return self.band_ttl_s.get(priority, self.ttl_s)

    @property
    def longest_ttl_s(self) -> float:
        return max([self.ttl_s, *self.band_ttl_s.values()])


_TOP_KEYS = {
    "enabled",
    "trustedHeaders",
    "objectives",
    "defaultPriority",
    "fairness",
    "saturation",
    "queue",
}


def parse_flow_control(section: Any, source: str) -> FlowConfig:
    """The parsed section (``None``: flow control off).

    Raises:
        ConfigError: a key unknown, of the wrong type or out of range, named.
    """
    if section is None:
        return FlowConfig()
    where = f"{source}: flowControl"
    top = _mapping(section, where, _TOP_KEYS)
    fairness = _mapping(top.get("fairness", {}), f"{where}.fairness", {"header", "bodyField"})
    saturation = _mapping(
        top.get("saturation", {}),
        f"{where}.saturation",
        {"maxWaiting", "maxKvUsage", "reservedSlots", "reservedFor", "batchSlots"},
    )
    queue = _mapping(
        top.get("queue", {}),
        f"{where}.queue",
        {"maxRequests", "maxBytes", "ttlS", "bandTtlS", "retryAfterS"},
    )
    defaults = FlowConfig()
    objectives = {
        str(name): _int(value, f"{where}.objectives.{name}")
        for name, value in _mapping(top.get("objectives", {}), f"{where}.objectives").items()
    }
    band_ttl = {
        _int(priority, f"{where}.queue.bandTtlS key {priority!r}"): _positive(
            ttl, f"{where}.queue.bandTtlS.{priority}"
        )
        for priority, ttl in _mapping(queue.get("bandTtlS", {}), f"{where}.queue.bandTtlS").items()
    }
    max_kv = _positive(
        saturation.get("maxKvUsage", defaults.max_kv_usage), f"{where}.saturation.maxKvUsage"
    )
    if max_kv > 1:
        raise ConfigError(f"{where}.saturation.maxKvUsage must be in (0, 1], got {max_kv}")
    return FlowConfig(
        enabled=_bool(top.get("enabled", True), f"{where}.enabled"),
        trusted_headers=frozenset(
            _header(h, f"{where}.trustedHeaders")
            for h in _list(top.get("trustedHeaders", []), f"{where}.trustedHeaders")
        ),
        objectives=objectives,
        default_priority=_int(top.get("defaultPriority", 0), f"{where}.defaultPriority"),
        fairness_header=_optional_header(
            fairness.get("header", defaults.fairness_header), f"{where}.fairness.header"
        ),
        fairness_body_field=_optional_str(fairness.get("bodyField"), f"{where}.fairness.bodyField"),
        max_waiting=_positive(
            saturation.get("maxWaiting", defaults.max_waiting),
            f"{where}.saturation.maxWaiting",
            zero=True,
        ),
        max_kv_usage=max_kv,
        reserved_slots=int(
            _positive(
                saturation.get("reservedSlots", 0), f"{where}.saturation.reservedSlots", zero=True
            )
        ),
        reserved_for=_int(
            saturation.get("reservedFor", defaults.reserved_for), f"{where}.saturation.reservedFor"
        ),
        batch_slots=_batch_slots(saturation.get("batchSlots"), f"{where}.saturation.batchSlots"),
        max_requests=int(
            _positive(queue.get("maxRequests", defaults.max_requests), f"{where}.queue.maxRequests")
        ),
        max_bytes=int(
            _positive(queue.get("maxBytes", defaults.max_bytes), f"{where}.queue.maxBytes")
        ),
        ttl_s=_positive(queue.get("ttlS", defaults.ttl_s), f"{where}.queue.ttlS"),
        band_ttl_s=band_ttl,
        retry_after_s=int(
            _positive(
                queue.get("retryAfterS", defaults.retry_after_s), f"{where}.queue.retryAfterS"
            )
        ),
    )


def _mapping(value: Any, where: str, keys: set[str] | None = None) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    if keys is not None:
        unknown = sorted(str(k) for k in value if k not in keys)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})"
            )
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)  # a YAML key written as a string: "100"
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    return value


def _batch_slots(value: Any, where: str) -> int | None:
    """The engines' batch size, if given: a whole number of requests, 1 or more."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{where} must be an integer of 1 or more (vLLM's --max-num-seqs), got {value!r}"
        )
    return value


def _positive(value: Any, where: str, *, zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        floor = "0 or more" if zero else "greater than 0"
        raise ConfigError(f"{where} must be a number {floor}, got {value!r}")
    return float(value)


def _header(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or value != value.lower() or " " in value:
        raise ConfigError(f"{where}: {value!r} is not a lowercase header name")
    return value


def _optional_header(value: Any, where: str) -> str | None:
    return None if value is None else _header(value, where)


def _optional_str(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a field name, got {value!r}")
    return value
