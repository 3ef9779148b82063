"""Injected failures of one pod, set from flags or ``/admin/faults``.

Only the inference endpoints (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``) are affected, and ``/metrics`` by ``metrics``; ``/health`` and
``/admin`` always answer, except that ``refuse_connections`` closes the pod's whole port.

- ``delay_s``: wait this long before handling the request (at most 60 s).
- ``error_rate`` / ``error_status``: answer that share of requests with that status (a
  vLLM-style error body) instead of generating. Deterministic: request n (from 0, counted
  since the faults were last set) fails when ``ceil((n+1)*rate) > ceil(n*rate)``, so
  rate 1 fails every request and 0.5 every second one, starting with the first.
- ``refuse_connections``: stop listening and drop open connections, so clients get
  "connection refused"; clearing it listens again on the same port.
- ``die_mid_stream_after_chunks``: a streamed answer is cut (connection aborted, no
  terminating chunk, no ``[DONE]``) after this many SSE events; 0 cuts right after the
  headers. Plain (non-streamed) answers are not affected.
- ``metrics``: what ``/metrics`` answers: ``ok``; ``error`` (HTTP 500, the endpoint is
  down while the pod serves); ``garbage`` (HTTP 200, bytes that are not Prometheus text).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

MAX_DELAY_S = 60.0
METRICS_MODES = ("ok", "error", "garbage")


@dataclass(frozen=True, slots=True)
class Faults:
    error_rate: float = 0.0
    error_status: int = 500
    refuse_connections: bool = False
    die_mid_stream_after_chunks: int | None = None
    delay_s: float = 0.0
    metrics: str = "ok"

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be within 0..1, got {self.error_rate}")
        if not 400 <= self.error_status <= 599:
            raise ValueError(f"error_status must be an HTTP error status, got {self.error_status}")
        if self.die_mid_stream_after_chunks is not None and self.die_mid_stream_after_chunks < 0:
            raise ValueError(
                f"die_mid_stream_after_chunks must be >= 0, got {self.die_mid_stream_after_chunks}"
            )
        if not 0.0 <= self.delay_s <= MAX_DELAY_S:
            raise ValueError(f"delay_s must be within 0..{MAX_DELAY_S}, got {self.delay_s}")
        if self.metrics not in METRICS_MODES:
            raise ValueError(
                f"metrics must be one of {', '.join(METRICS_MODES)}, got {self.metrics!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, changes: Any) -> Faults:
        """These faults with ``changes`` (a JSON object) applied.

        Raises:
            TypeError: ``changes`` is not an object.
            ValueError: an unknown key, or a value of the wrong type or out of range.
        """
        if not isinstance(changes, dict):
            raise TypeError("faults must be a JSON object")
        types = {f.name: f.type for f in fields(self)}
        for key, value in changes.items():
            if key not in types:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(types)}")
            ok = {
                "error_rate": isinstance(value, int | float) and not isinstance(value, bool),
                "error_status": isinstance(value, int) and not isinstance(value, bool),
                "refuse_connections": isinstance(value, bool),
                "die_mid_stream_after_chunks": value is None
                or (isinstance(value, int) and not isinstance(value, bool)),
                "delay_s": isinstance(value, int | float) and not isinstance(value, bool),
                "metrics": isinstance(value, str),
            }[key]
            if not ok:
                raise ValueError(f"fault {key!r} has a value of the wrong type: {value!r}")
        return replace(self, **changes)


class ErrorSchedule:
    """Which requests fail under ``error_rate`` (see the module docstring)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._n = 0

    def next_fails(self) -> bool:
        n, self._n = self._n, self._n + 1
        return math.ceil((n + 1) * self.rate) > math.ceil(n * self.rate)
