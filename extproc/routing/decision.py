"""What routing decides for one request: its pods, best first."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.pods import Pod
from extproc.routing.records import Record


@dataclass(frozen=True, slots=True)
class RouteDecision:
    pods: tuple[Pod, ...]  # best first: the pick, then the fallbacks
    prefill: Pod | None = None  # with prefill/decode disaggregation
    record: Record | None = None  # with ``carry_records``: what recording it needs

    @property
    def destination(self) -> str:
        """The Endpoint Picker Protocol's value: ``ip:port,ip:port,...``."""
        return ",".join([p.address for p in self.pods])
