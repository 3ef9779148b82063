"""How long one simulated engine step takes: named timing profiles.

A step's duration depends on what it computes, as vLLM's model runner sees it:
``StepWork`` counts the prefill tokens of the step (whole prompts or chunks), the
requests those tokens belong to, the requests decoding one token, and the KV tokens the
step's requests attend over. A ``TimingProfile`` turns that into seconds with
coefficients fitted from measurements; ``PROFILES`` names them and ``--timing-profile``
picks one (the engine's ``time_scale`` then multiplies the result).

The fits, their points and residuals are in ``bench/results/engine-timing-*.md``
(``python -m bench.engine_timing`` measures a real vLLM-CPU pod;
``python -m bench.engine_timing_gpu`` fits published H100 figures).
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
    num_prefill_seqs: int = 0  # requests with prefill tokens this step (a chunk each)


@dataclass(frozen=True, slots=True)
class TimingProfile:
    """A step's duration, linear in the work: ``base_s + Σ coefficient * count``."""

    name: str
    base_s: float
    s_per_prefill_token: float
    s_per_decode_seq: float
    s_per_context_token: float
    source: str  # where the coefficients come from
    s_per_prefill_seq: float = 0.0

    def step_s(self, work: StepWork) -> float:
        return (
            self.base_s
            + self.s_per_prefill_token * work.num_prefill_tokens
            + self.s_per_prefill_seq * work.num_prefill_seqs
            + self.s_per_decode_seq * work.num_decode_seqs
            + self.s_per_context_token * work.num_context_tokens
        )


# Meta-Llama-3-8B-class model, BF16, one H100 SXM: decode terms from Lambda's published
# vLLM run, the prefill term from Vidur's H100 profile of Llama-2-7B's linear layers.
GPU_H100_8B = TimingProfile(
    name="gpu-h100-8b",
    base_s=6.98e-3,
    s_per_prefill_token=20.1e-6,
    s_per_decode_seq=54.9e-6,
    s_per_context_token=58.3e-9,
    source=(
        "https://github.com/LambdaLabsML/vllm-benchmark/blob/a4f9f4371a1ccac781293837fce2bce0cc6d25cc/"
        "results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json; "
        "https://github.com/microsoft/vidur/blob/7d47513363ec447a741ac5e47241580b47724fbf/"
        "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
    ),
)

# The tiny random Qwen3 on a real vLLM-CPU pod of e2e/real_vllm, one core of a shared
# 2-core machine: the pod the parity tests compare a simulated one with.
CPU_QWEN3_TINY = TimingProfile(
    name="cpu-qwen3-tiny",
    base_s=3.38e-3,
    s_per_prefill_token=3.63e-6,
    s_per_prefill_seq=2.36e-3,
    s_per_decode_seq=188e-6,
    s_per_context_token=61.4e-9,
    source=(
        "bench/results/engine-timing-cpu.md: steps of a vLLM-CPU 0.32 pod (e2e/real_vllm, "
        "tiny Qwen3) timed by its own prefill-time and inter-token-latency histograms"
    ),
)

PROFILES: dict[str, TimingProfile] = {p.name: p for p in (GPU_H100_8B, CPU_QWEN3_TINY)}
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
