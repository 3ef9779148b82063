"""The real-time runner: tokens arrive in order and in time, and nobody waits on a dead engine."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from extproc.sim.engine import Engine, EngineConfig, StepResult
from extproc.sim.runner import EngineRunner, EngineStopped
from testkit.factories import constant_step, make_sim_request, seq


def test_tokens_arrive_in_order_at_the_engines_pace() -> None:
    """Each step lasts its 20 ms and hands out its token only at its end; one token a
    step (counts and engine times, not wall-clock bounds a loaded machine would break)."""
    steps: list[StepResult] = []

    async def main() -> None:
        runner = EngineRunner(
            Engine(EngineConfig(timing_profile=constant_step(0.02))), on_step=steps.append
        )
        runner.start()
        try:
            stream = runner.submit(make_sim_request(seq(1, 8), max_tokens=5))
            arrivals = [(out.index, runner.now()) async for out in stream.tokens()]
        finally:
            await runner.stop()
        assert [index for index, _ in arrivals] == [0, 1, 2, 3, 4]
        assert [[out.index for out in step.outputs] for step in steps] == [[i] for i in range(5)]
        for step, (_, arrived) in zip(steps, arrivals, strict=True):
            assert step.end_s - step.start_s == pytest.approx(0.02)
            assert arrived >= step.end_s  # not before its step ended
        for earlier, later in itertools.pairwise(steps):
            assert later.start_s >= earlier.end_s  # one step at a time
        assert stream.finished is not None
        assert stream.num_cached_tokens == 0

    asyncio.run(main())


def test_a_failing_engine_fails_its_streams_and_refuses_new_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine()

    def broken(now: float) -> StepResult:
        raise RuntimeError("bug")

    monkeypatch.setattr(engine, "step", broken)

    async def main() -> None:
        runner = EngineRunner(engine)
        runner.start()
        try:
            stream = runner.submit(make_sim_request(seq(1, 8)))
            with pytest.raises(EngineStopped):
                await asyncio.wait_for(stream.result(), 5)
            with pytest.raises(EngineStopped):
                runner.submit(make_sim_request(seq(2, 8)))
        finally:
            await runner.stop()

    asyncio.run(main())


def test_stop_ends_waiting_streams() -> None:
    async def main() -> None:
        runner = EngineRunner(Engine(EngineConfig(timing_profile=constant_step(10.0))))
        runner.start()
        stream = runner.submit(make_sim_request(seq(1, 8)))
        await asyncio.sleep(0.01)
        await runner.stop()
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(stream.result(), 5)

    asyncio.run(main())
