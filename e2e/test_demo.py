"""``extproc demo`` runs end to end and shows extproc beating round robin on cache hits."""

from __future__ import annotations

import re

import pytest

from extproc.cli import main


def test_demo_prints_routing_and_a_better_hit_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "80"]) == 0
    out = capsys.readouterr().out
    assert "through Envoy + extproc" in out and "round robin" in out
    ratios = dict(re.findall(r"^  (extproc|round robin)\s+([\d.]+)%$", out, re.MULTILINE))
    assert float(ratios["extproc"]) > float(ratios["round robin"]) + 10
