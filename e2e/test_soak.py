"""The soak (``python -m e2e.soak``) with a CI-sized count: see e2e/soak.py for what passes."""

from __future__ import annotations

from e2e.soak import run_soak

CI_REQUESTS = 4000


def test_soak_through_envoy() -> None:
    report = run_soak(CI_REQUESTS)
    print(report.summary())
    assert report.ok, report.summary() + "\n" + "\n".join(report.unexpected)
    assert report.max_index_entries == report.index_bound  # the bound was reached: eviction ran
