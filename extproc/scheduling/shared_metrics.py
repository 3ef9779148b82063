"""Metrics and collectors made once per registry, so a scheduler can be built again on
the same registry (a configuration reload) without prometheus_client refusing the
second registration ("Duplicated timeseries").

A plugin asks ``shared_metric(registry, Counter, name, ...)`` where it would have made
``Counter(name, ..., registry=registry)``: the first call registers it, later calls (the
rebuilt plugin's) get the same object. A gauge read through ``set_function`` is pointed
at the newest plugin by that plugin's own ``set_function`` call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

T = TypeVar("T")

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.RLock()  # re-entrant: a ``make`` may ask for another shared object


def per_registry(registry: CollectorRegistry, key: str, make: Callable[[], T]) -> T:
    """``registry``'s one object under ``key``, made by ``make`` the first time."""
    with _LOCK:
        objects = _BY_REGISTRY.setdefault(registry, {})
        if key not in objects:
            objects[key] = make()
        found: T = objects[key]
        return found


def shared_metric(
    registry: CollectorRegistry,
    kind: Callable[..., T],
    name: str,
    documentation: str,
    labelnames: tuple[str, ...] | list[str] = (),
    **kwargs: Any,
) -> T:
    """``kind(name, documentation, labelnames, registry=registry, **kwargs)``, once per
    registry and name (``kind``: Counter, Gauge, Histogram...)."""

    def make() -> T:
        return kind(name, documentation, labelnames, registry=registry, **kwargs)

    return per_registry(registry, f"metric:{name}", make)
