"""What routing decides for one request: its pods, best first."""

from __future__ import annotations

from typing import NamedTuple

from extproc.pods import Pod
from extproc.routing.records import Record


class RouteDecision(NamedTuple):
    """One request's route (a tuple: built per request, more cheaply than a frozen
    dataclass)."""

    pods: tuple[Pod, ...]  # best first: the pick, then the fallbacks
    prefill: Pod | None = None  # with prefill/decode disaggregation
    record: Record | None = None  # with ``carry_records``: what recording it needs
    body: bytes | None = None  # a model rewrite's body, sent instead of the client's

    @property
    def destination(self) -> str:
        """The Endpoint Picker Protocol's value: ``ip:port,ip:port,...``."""
        return ",".join([p.address for p in self.pods])
