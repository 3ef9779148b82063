"""The shipped Mooncake traces, which some tests replay: missing, those tests fail.

They live in ``../shared/traces`` beside the repository (CI clones it there too), found
from the package's own path; a skip would hide a CI set up without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.sim.traces import default_trace_dir


@pytest.fixture
def trace_dir() -> Path:
    found = default_trace_dir()
    if not found.is_dir():
        pytest.fail(f"no Mooncake traces at {found}: ../shared/traces must sit beside the repo")
    return found
