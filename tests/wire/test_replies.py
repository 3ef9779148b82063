"""The replies extproc builds for Envoy, read back as Envoy reads them."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.wire.ext_proc import route_response


@pytest.mark.parametrize("prefill", [None, "10.0.0.9:8000"])
def test_route_reply_continues_with_the_list_its_retries_and_prefill(prefill: str | None) -> None:
    destination = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"
    route = {"x-gateway-destination-endpoint": destination, "x-envoy-max-retries": "2"}
    if prefill is not None:
        route["x-prefiller-host-port"] = prefill
    metadata = struct_pb2.Struct()
    metadata.update({"envoy.lb": route})
    expected = ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse()), dynamic_metadata=metadata
    )
    reply = ep.ProcessingResponse.FromString(
        route_response(destination, prefill).SerializeToString()
    )
    assert reply == expected
    assert reply.request_body.HasField("response")  # a plain continue, not an empty oneof
