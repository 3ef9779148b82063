"""The simulated engine against a real vLLM-CPU pod, request by request
(``engine_parity`` says what is compared and why): the same cached tokens, preemption in
both or neither. Each sequence's median TTFT and end-to-end time are printed with any
that fall outside the tolerance, not asserted: a wall-clock figure of a real pod on a
shared 2-core machine is a benchmark's (``make sim-parity``), and under the suite's load
(two CPU hogs beside it) the real pod ran 8 times slower than its quiet-machine profile.

One real pod and one sim pod serve the unloaded sequences; a second pair, with a cache
small enough to force preemption, is started only once the first is stopped (each pair
is a class's fixture).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from e2e.real_vllm import engine_parity as ep
from e2e.real_vllm.pods import BLOCK_SIZE, MAX_MODEL_LEN
from e2e.real_vllm.prepare import prepare

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(1200)]

Pair = tuple[ep.Side, ep.Side, ep.EngineSettings]


@pytest.fixture(scope="class")
def pair() -> Iterator[Pair]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-parity-") as tmp,
        ep.parity_pods(Path(tmp)) as running,
    ):
        yield running


@pytest.fixture(scope="class")
def pressure_pair() -> Iterator[Pair]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-parity-") as tmp,
        ep.parity_pods(Path(tmp), num_gpu_blocks=ep.PRESSURE_GPU_BLOCKS) as running,
    ):
        yield running


def _check(comparison: ep.Comparison) -> None:
    print("\n" + ep.table([comparison]), *comparison.timing_misses(), sep="\n")
    assert comparison.mismatches == []


SEQUENCES: dict[str, Callable[[Tokenizer], ep.RequestSequence]] = {
    "cold": lambda _: ep.cold(),
    "shared-prefix": lambda _: ep.shared_prefix(),
    "multi-turn-chat": lambda _: ep.chat_turns(),
    "multi-turn-tokens": ep.token_turns,
    "long-among-short": lambda _: ep.long_among_short(),
}


class TestUnderNoPressure:
    def test_settings_are_the_real_pods(self, pair: Pair) -> None:
        _, _, settings = pair
        assert settings.block_size == BLOCK_SIZE
        assert settings.num_gpu_blocks * settings.block_size >= MAX_MODEL_LEN
        assert settings.enable_chunked_prefill

    @pytest.mark.parametrize("name", list(SEQUENCES))
    def test_sequence_matches(self, pair: Pair, name: str) -> None:
        real, sim, _ = pair
        seq = SEQUENCES[name](ep.encoder())
        _check(ep.compare(seq, ep.run_sequence(real, seq), ep.run_sequence(sim, seq)))


class TestUnderMemoryPressure:
    def test_preemption_in_both(self, pressure_pair: Pair) -> None:
        real, sim, settings = pressure_pair
        assert settings.num_gpu_blocks == ep.PRESSURE_GPU_BLOCKS
        seq = ep.memory_pressure()
        real_run = ep.run_sequence(real, seq)
        assert real_run.num_preemptions > 0, "the real pod was not pressed enough to preempt"
        comparison = ep.compare(seq, real_run, ep.run_sequence(sim, seq))
        assert comparison.sim_preemptions > 0
        _check(comparison)
