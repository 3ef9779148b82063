"""How long one simulated engine step takes: named timing profiles.

A step's duration depends on what it computes, as vLLM's model runner sees it:
``StepWork`` counts the prefill tokens of the step (whole prompts or chunks), the
requests decoding one token, and the KV tokens those requests attend over. A
``TimingProfile`` turns that into seconds with coefficients fitted from measurements;
``PROFILES`` names them and ``--timing-profile`` picks one (the engine's
``time_scale`` then multiplies the result).
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step computes."""

    num_prefill_tokens: int  # prompt tokens computed this step (uncached, chunks included)
    num_decode_seqs: int  # requests that sample a token from their previous one
    num_context_tokens: int  # KV tokens the step's requests attend over, before the step


@dataclass(frozen=True, slots=True)
class TimingProfile:
    """A step's duration, linear in the work: ``base_s + Σ coefficient * count``."""

    name: str
    base_s: float
    s_per_prefill_token: float
    s_per_decode_seq: float
    s_per_context_token: float
    source: str  # where the coefficients come from

    def step_s(self, work: StepWork) -> float:
        return (
            self.base_s
            + self.s_per_prefill_token * work.num_prefill_tokens
            + self.s_per_decode_seq * work.num_decode_seqs
            + self.s_per_context_token * work.num_context_tokens
        )


GPU_H100_8B = TimingProfile(
    name="gpu-h100-8b",
    base_s=0.010,
    s_per_prefill_token=1e-4,
    s_per_decode_seq=1e-4,
    s_per_context_token=0.0,
    source="placeholder: to be fitted from published vLLM figures",
)

PROFILES: dict[str, TimingProfile] = {p.name: p for p in (GPU_H100_8B,)}
DEFAULT_PROFILE = GPU_H100_8B.name


def timing_profile(name: str) -> TimingProfile:
    """The profile called ``name``.

    Raises:
        ConfigError: no such profile (the message lists them).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown timing profile {name!r}; choose one of {', '.join(sorted(PROFILES))}"
        ) from None
