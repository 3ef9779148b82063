"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

GRPC_SERVER_KINDS = ["loop", "public"]


@pytest.fixture(params=GRPC_SERVER_KINDS)
def server_kind(request: pytest.FixtureRequest) -> str:
    """Each gRPC server test runs on the loop server and on grpcio's public server."""
    return str(request.param)
