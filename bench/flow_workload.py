"""bench.flow_control's load: open-loop arrivals of three classes and several tenants.

Each request names its class in the Gateway API Inference Extension's objective header
(``x-gateway-inference-objective: critical | standard | sheddable``) and its tenant in
the fairness header (``x-gateway-inference-fairness-id``). Within the standard band one
tenant (``NOISY_TENANT``) sends ``noisy_factor`` times each other tenant's rate. Arrivals
are Poisson at one total rate, each request's class and tenant drawn by weight; every
prompt is distinct (no shared prefix), so the prefix cache plays no part and every
request costs the pods the same. Deterministic for a seed, bounded in count and time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from bench.workloads import BYTES_PER_TOKEN, words

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
CLASSES = ("critical", "standard", "sheddable")
PRIORITIES = {"critical": 100, "standard": 0, "sheddable": -1}  # the flow config's objectives
NOISY_TENANT = "tenant-0"
# The other classes' one fairness key each (fairness is measured within the standard band).
CLASS_TENANT = {"critical": "critical-app", "sheddable": "batch"}
PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Mix:
    """What the arrivals are made of."""

    shares: tuple[float, float, float] = (0.1, 0.7, 0.2)  # critical, standard, sheddable
    tenants: int = 5  # in the standard band, ``NOISY_TENANT`` among them
    noisy_factor: float = 5.0  # the noisy tenant's rate over each other tenant's
    prompt_tokens: int = 256
    output_tokens: int = 32
    model: str = "sim-llm"

    def tenant_weights(self) -> dict[str, float]:
        """Each standard tenant's share of the standard band's arrivals (weights)."""
        return {f"tenant-{i}": self.noisy_factor if i == 0 else 1.0 for i in range(self.tenants)}


@dataclass(frozen=True, slots=True)
class FlowRequest:
    at_s: float  # arrival, seconds from the start
    cls: str  # one of CLASSES
    tenant: str  # the fairness key sent
    body: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return {OBJECTIVE_HEADER: self.cls, FAIRNESS_HEADER: self.tenant}


def body(mix: Mix, seed: int) -> dict[str, Any]:
    """A completion request of ``mix.prompt_tokens`` distinct tokens (pseudo-tokenizer: 4
    bytes a token), asking for ``mix.output_tokens`` (the simulated engine makes them all)."""
    prompt = words(seed, mix.prompt_tokens * BYTES_PER_TOKEN)
    return {"model": mix.model, "prompt": prompt, "max_tokens": mix.output_tokens}


def arrivals(
    mix: Mix, rate: float, duration_s: float, *, max_requests: int, seed: int = 1
) -> list[FlowRequest]:
    """Poisson arrivals at ``rate`` a second for ``duration_s`` (at most ``max_requests``),
    each of a class drawn by ``mix.shares`` and, in the standard band, a tenant drawn by
    ``mix.tenant_weights()``. Prompts are seeded by ``seed`` and the request's number, so
    two schedules with different seeds share no prompt."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    rng = random.Random(seed)
    weights = mix.tenant_weights()
    tenants, tenant_w = list(weights), list(weights.values())
    out: list[FlowRequest] = []
    t = rng.expovariate(rate)
    while t < duration_s and len(out) < max_requests:
        cls = rng.choices(CLASSES, mix.shares)[0]
        tenant = rng.choices(tenants, tenant_w)[0] if cls == "standard" else CLASS_TENANT[cls]
        out.append(FlowRequest(t, cls, tenant, body(mix, seed * 1_000_003 + len(out))))
        t += rng.expovariate(rate)
    return out
