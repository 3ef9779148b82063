"""The chart tests' fixture: one set of values per mode the chart renders."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.chart import MODES


@pytest.fixture(params=list(MODES), ids=list(MODES))
def mode_values(request: pytest.FixtureRequest) -> dict[str, Any]:
    return MODES[request.param]
