"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest
from hypothesis import settings

# No per-example deadline: on a loaded 2-core machine a slow example is the machine, not
# the code (the assertions are what the property tests check).
settings.register_profile("extproc", deadline=None)
settings.load_profile("extproc")

GRPC_SERVER_KINDS = ["loop", "public"]


@pytest.fixture(params=GRPC_SERVER_KINDS)
def server_kind(request: pytest.FixtureRequest) -> str:
    """Each gRPC server test runs on the loop server and on grpcio's public server."""
    return str(request.param)
