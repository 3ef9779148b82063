"""The soak (``python -m e2e.soak``) at a size the suite can afford (about half a minute
on 2 cores): see e2e/soak.py for what passes. The full one is a command of its own
(docs/reliability.md)."""

from __future__ import annotations

import pytest

from e2e.soak import run_soak

SUITE_REQUESTS = 4000


@pytest.mark.timeout(240)
def test_soak_through_envoy() -> None:
    report = run_soak(SUITE_REQUESTS)
    print(report.summary())
    assert report.ok, report.summary() + "\n" + "\n".join(report.unexpected)
    assert report.num_unexpected == 0 and report.pending_at_end == 0
    assert report.recorded == SUITE_REQUESTS  # every request succeeded and was recorded once
    assert report.ends_checked == SUITE_REQUESTS  # each ended once, on the pod that served it
    assert len(report.samples) > SUITE_REQUESTS // 250  # usage sampled through the run
    assert report.max_index_entries == report.index_bound  # the bound was reached: eviction ran
