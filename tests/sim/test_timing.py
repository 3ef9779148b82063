"""The timing profiles: what they promise, and that they still match their recorded fits."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from extproc.errors import ConfigError
from extproc.sim.timing import DEFAULT_PROFILE, PROFILES, StepWork, TimingProfile, timing_profile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# Coefficients are written to three significant digits: the profile may stray this much
# (relative) from the fit's prediction, on top of the fit's own residual.
ROUNDING = 0.01
COEFFICIENTS = (
    "s_per_prefill_token",
    "s_per_prefill_seq",
    "s_per_decode_seq",
    "s_per_context_token",
)
WORK_TERMS = [f.name for f in fields(StepWork)]


def recorded(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / f"engine-timing-{name}.json").read_text()))


def work(point: dict[str, Any]) -> StepWork:
    return StepWork(**point["work"])


@pytest.mark.parametrize("profile", PROFILES.values(), ids=list(PROFILES))
def test_profile_is_positive_and_sourced(profile: TimingProfile) -> None:
    assert profile.base_s > 0
    assert all(getattr(profile, c) >= 0 for c in COEFFICIENTS)
    assert profile.s_per_prefill_token > 0 and profile.s_per_decode_seq > 0
    assert profile.source.strip()


@pytest.mark.parametrize("profile", PROFILES.values(), ids=list(PROFILES))
@pytest.mark.parametrize("term", WORK_TERMS)
def test_more_work_never_takes_less_time(profile: TimingProfile, term: str) -> None:
    base = StepWork(
        num_prefill_tokens=64, num_decode_seqs=4, num_context_tokens=512, num_prefill_seqs=1
    )
    times = [profile.step_s(replace(base, **{term: n})) for n in (0, 1, 10, 1000)]
    assert times == sorted(times)


def test_names_resolve_and_default_exists() -> None:
    assert DEFAULT_PROFILE in PROFILES
    for name, profile in PROFILES.items():
        assert timing_profile(name) is profile and profile.name == name


def test_unknown_profile_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        timing_profile("tpu-v9")
    assert all(name in str(err.value) for name in PROFILES)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_profile_is_its_recorded_fit(name: str) -> None:
    result = recorded(name)
    profile = timing_profile(result["profile"])
    fit = result["fit"]
    for key in ("base_s", *COEFFICIENTS):
        assert getattr(profile, key) == pytest.approx(fit[key], rel=ROUNDING, abs=1e-12), key


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_profile_reproduces_the_measurements_within_the_stated_residual(name: str) -> None:
    result = recorded(name)
    profile = timing_profile(result["profile"])
    tolerance = result["fit"]["max_rel_residual"] + ROUNDING
    fitted = [p for p in result["points"] if p.get("fitted", True)]
    assert len(fitted) >= 20
    for point in fitted:
        predicted = profile.step_s(work(point))
        assert abs(predicted - point["step_s"]) <= tolerance * point["step_s"], point["work"]
