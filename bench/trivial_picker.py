"""``python -m bench.trivial_picker serve ...``: ``extproc serve`` that does no routing work.

Every ``Process`` body gets the same route (the first three pods, serialized once), and
access-log messages are read but not acted on. The gRPC loop, the protobuf parsing of
each message, Envoy's config and the process are the ones that ship, so this measures
the floor under any picker built on them (``bench.floor``). Benchmark-only: nothing in
extproc knows about it; this wrapper patches three methods and runs the ordinary command
line.
"""

from __future__ import annotations

import sys

from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.cli import main
from extproc.wire.access_log import AccessLogHandler
from extproc.wire.ext_proc import route_response
from extproc.wire.grpc_loop import Metadata
from extproc.wire.one_round import RouteHandler

NUM_DESTINATIONS = 3


def fixed_route(
    self: RouteHandler,
    message: ep.ProcessingRequest,
    trace: Metadata = (),
    body: bytes | None = None,
) -> tuple[ep.ProcessingResponse | bytes, str | None]:
    """``process_soon``'s place (its signature, so that mypy sees a change to it): the
    same route for every request."""
    destination = ",".join(p.address for p in self.router.pods[:NUM_DESTINATIONS])
    reply = self._replies.get(
        (destination, None), lambda: route_response(destination).SerializeToString()
    )
    return reply, None


def ignore_log(self: AccessLogHandler, message: als_pb2.StreamAccessLogsMessage) -> None:
    return None


if __name__ == "__main__":
    RouteHandler.process = fixed_route  # type: ignore[method-assign]
    RouteHandler.process_soon = fixed_route  # type: ignore[method-assign]
    AccessLogHandler.complete = ignore_log  # type: ignore[method-assign]
    sys.exit(main())
