"""A model rewrite on the wire: the body reply carries the rewritten body and its
content-length, in the one-round protocol and in the Endpoint Picker Protocol's BUFFERED
and FULL_DUPLEX_STREAMED modes; a request no rule matches gets the reply of before."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from extproc.routing.rewrites import parse_model_rewrites
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.wire.one_round import RouteHandler
from testkit.factories import PREFIX_ONLY, make_pod
from testkit.wire import Server, body, destination, headers, routed_body

ASKED = b'{"model": "m", "prompt": "a prompt long enough to hash, a prompt long enough"}'
REWRITTEN = ASKED.replace(b'"m"', b'"m-v2"')
OTHER = b'{"model": "m-v2", "prompt": "no rule for this model"}'


def new_router() -> Router:
    registry = CollectorRegistry()
    scheduler = build_scheduler(parse_config(PREFIX_ONLY, "t.yaml"), registry)
    rules = parse_model_rewrites(
        [{"matches": [{"model": "m"}], "targets": [{"modelRewrite": "m-v2"}]}], "t.yaml"
    )
    pods = [make_pod("v2", model="m-v2", port=8200)]
    return Router(scheduler, pods, registry=registry, rewrites=rules)


def set_headers(common: ep.CommonResponse) -> dict[str, bytes]:
    return {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}


def test_one_round_reply_carries_the_body_and_its_length() -> None:
    handler = RouteHandler(new_router())
    reply, _ = handler.process(routed_body("r1", ASKED))
    assert isinstance(reply, bytes)
    common = ep.ProcessingResponse.FromString(reply).request_body.response
    assert common.body_mutation.body == REWRITTEN
    assert set_headers(common)["content-length"] == str(len(REWRITTEN)).encode()
    plain, _ = handler.process(routed_body("r2", OTHER))
    assert isinstance(plain, bytes)
    response = ep.ProcessingResponse.FromString(plain)
    assert not response.request_body.response.HasField("body_mutation")
    assert not response.request_body.response.HasField("header_mutation")
    assert destination(response) == ["127.0.0.1:8200"]


def test_epp_buffered_reply_carries_the_body_and_its_length(server_kind: str) -> None:
    with Server("epp", new_router(), server_kind) as s:
        _, routed = s.exchange([headers(rid="b"), body(ASKED)])
        common = routed.request_body.response
        assert common.body_mutation.body == REWRITTEN
        assert set_headers(common)["content-length"] == str(len(REWRITTEN)).encode()
        _, plain = s.exchange([headers(rid="p"), body(OTHER)])
        assert not plain.request_body.response.HasField("body_mutation")
        assert "content-length" not in set_headers(plain.request_body.response)


def test_epp_full_duplex_streams_the_rewritten_body(server_kind: str) -> None:
    with Server("epp", new_router(), server_kind) as s:
        routed_headers, streamed = s.exchange([headers(rid="d", duplex=True), body(ASKED)])
        length = set_headers(routed_headers.request_headers.response)["content-length"]
        assert length == str(len(REWRITTEN)).encode()
        sent = streamed.request_body.response.body_mutation.streamed_response
        assert sent.body == REWRITTEN and sent.end_of_stream
        assert orjson.loads(sent.body)["model"] == "m-v2"
        plain_headers, plain = s.exchange([headers(rid="q", duplex=True), body(OTHER)])
        assert "content-length" not in set_headers(plain_headers.request_headers.response)
        assert plain.request_body.response.body_mutation.streamed_response.body == OTHER
