"""Each request's priority and fairness key, from its headers and body.

The priority comes from the objective the request names (the Gateway API Inference
Extension's ``x-gateway-inference-objective`` header) through ``Objectives``: the
configuration's map, overlaid by the ``InferenceObjective`` objects watched in
Kubernetes. The fairness key is a header's value (the Inference Extension's
``x-gateway-inference-fairness-id``, or e.g. a tenant header) or a body field (``user``).
A header counts only when the operator lists it in ``trustedHeaders``: a client could
otherwise name itself critical. No objective, an unknown one or a malformed one gives
``defaultPriority`` (counted by reason), never an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from extproc.routing.flow.config import OBJECTIVE_HEADER, FlowConfig

# A Kubernetes object name (RFC 1123 subdomain): what an InferenceObjective is called.
_OBJECTIVE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
MAX_FAIRNESS_KEY = 128  # characters kept of a fairness key (a label of nothing, a dict key)


class FlowClass(NamedTuple):
    priority: int
    fairness_key: str


class Objectives:
    """Objective name -> priority: the configured map, overlaid by the watched one.

    Read lock-free on the request path (a dict rebound whole on change).
    """

    def __init__(self, configured: Mapping[str, int]) -> None:
        self._configured = dict(configured)
        self._merged: dict[str, int] = dict(configured)

    def set_watched(self, watched: Mapping[str, int]) -> None:
        """The ``InferenceObjective``s now in Kubernetes (they win over the configured)."""
        self._merged = {**self._configured, **watched}

    def get(self, name: str) -> int | None:
        return self._merged.get(name)


class Classifier:
    """Headers and body -> ``FlowClass``; ``count_default(reason)`` is told when a
    request names an objective that gives it the default priority (unknown, malformed)."""

    def __init__(
        self,
        config: FlowConfig,
        objectives: Objectives,
        count_default: Callable[[str], None],
    ) -> None:
        self._objectives = objectives
        self._default = config.default_priority
        self._count_default = count_default
        trusted = config.trusted_headers
        self._objective_header = OBJECTIVE_HEADER if OBJECTIVE_HEADER in trusted else None
        header = config.fairness_header
        self._fairness_header = header if header and header in trusted else None
        self._fairness_field = config.fairness_body_field

    def classify(
        self, headers: Mapping[str, str] | None, data: Mapping[str, Any] | None
    ) -> FlowClass:
        return FlowClass(self._priority(headers), self._fairness_key(headers, data))

    def _priority(self, headers: Mapping[str, str] | None) -> int:
        if self._objective_header is None or not headers:
            return self._default
        name = headers.get(self._objective_header)
        if not name:
            return self._default
        if not _OBJECTIVE_NAME.fullmatch(name):
            self._count_default("malformed")
            return self._default
        priority = self._objectives.get(name)
        if priority is None:
            self._count_default("unknown")
            return self._default
        return priority

    def _fairness_key(
        self, headers: Mapping[str, str] | None, data: Mapping[str, Any] | None
    ) -> str:
        if self._fairness_header is not None and headers:
            key = headers.get(self._fairness_header)
            if key:
                return key[:MAX_FAIRNESS_KEY]
        if self._fairness_field is not None and data is not None:
            value = data.get(self._fairness_field)
            if isinstance(value, str | int) and not isinstance(value, bool):
                return str(value)[:MAX_FAIRNESS_KEY]
        return ""
