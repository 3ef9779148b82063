"""The picks for a recorded request stream are those recorded (``picks_stream``): a
change meant to make routing cheaper must not change a decision."""

from __future__ import annotations

import json

import pytest

from tests.scheduling.picks_stream import CONFIGS, POD_COUNTS, RECORDED, run_stream

RECORDED_PICKS: dict[str, list[str]] = json.loads(RECORDED.read_text())


@pytest.mark.parametrize("num_pods", POD_COUNTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_the_picks_are_the_recorded_ones(config: str, num_pods: int) -> None:
    picks = run_stream(config, num_pods)
    recorded = RECORDED_PICKS[f"{config}/{num_pods}"]
    first_change = next(
        (n for n, (a, b) in enumerate(zip(picks, recorded, strict=True)) if a != b), None
    )
    assert first_change is None, (
        f"request {first_change}: picked {picks[first_change]}, recorded {recorded[first_change]}"
    )
