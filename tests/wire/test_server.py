"""The gRPC layer against a real grpcio server on a free port: routing, errors, records."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.routing.router import Router
from extproc.wire import one_round
from extproc.wire.ext_proc import route_response
from extproc.wire.protocol import (
    EXT_PROC_SERVICE,
)
from extproc.wire.server import make_grpc_server, make_health_server
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler
from testkit.wire import PODS, Client, destination, error_of, log_entry


@pytest.fixture
def router() -> Router:
    return Router(make_scheduler(PREFIX_ONLY), PODS, registry=CollectorRegistry())


@pytest.fixture
def client(router: Router, server_kind: str) -> Iterator[Client]:
    server, port = make_grpc_server(router, "127.0.0.1:0", server_kind=server_kind)
    server.start()
    c = Client(port)
    yield c
    c.channel.close()
    server.stop(0).wait()


def test_routes_with_pick_and_fallbacks(client: Client) -> None:
    resp = client.send_body({"model": "m", "prompt": "hello"})
    assert resp.HasField("request_body")
    dest = destination(resp)
    assert len(dest) == 3 and len(set(dest)) == 3
    assert set(dest) <= {p.address for p in PODS}
    # one retry per fallback listed: Envoy's route adds it as x-envoy-max-retries
    fields = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert fields["x-envoy-max-retries"].string_value == "2"


def test_success_log_records_the_served_pod_and_next_request_follows(
    client: Client, router: Router
) -> None:
    prompt = {
        "model": "m",
        "messages": [{"role": "system", "content": "S" * 500}, {"role": "user", "content": "q1"}],
    }
    first = destination(client.send_body(prompt, path="/v1/chat/completions", request_id="a"))
    served = first[1]  # say the first pod failed and the retry went to the second
    client.log(log_entry("a", served))
    assert router.metrics.completions.labels("recorded").value == 1
    for i in range(10):
        nxt = destination(client.send_body(prompt, path="/v1/chat/completions", request_id=f"b{i}"))
        assert nxt[0] == served


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        pytest.param({"code": 503}, "error status", id="503"),
        pytest.param(
            {"ended": False, "upstream_protocol_error": True}, "died mid-stream", id="mid-stream"
        ),
        pytest.param(
            {"ended": False, "downstream_connection_termination": True},
            "client left",
            id="client-left",
        ),
        pytest.param(
            {"upstream_retry_limit_exceeded": True}, "retries exhausted", id="retry-limit"
        ),
    ],
)
def test_failed_responses_record_nothing(
    client: Client, router: Router, kwargs: dict[str, Any], reason: str
) -> None:
    dest = destination(client.send_body({"model": "m", "prompt": "x" * 300}, request_id="f"))
    client.log(log_entry("f", dest[0], **kwargs))
    plugin = router.scheduler.scorers[0].scorer
    assert plugin.index.num_entries == 0, reason  # type: ignore[attr-defined]
    assert router.metrics.completions.labels("failed").value == 1


def test_unknown_request_and_unknown_pod_are_counted_not_recorded(
    client: Client, router: Router
) -> None:
    client.log(log_entry("never-routed", PODS[0].address))
    dest = destination(client.send_body({"model": "m", "prompt": "y"}, request_id="u"))
    assert dest
    client.log(log_entry("u", "10.9.9.9:1"))
    assert router.metrics.completions.labels("unknown_request").value == 1
    assert router.metrics.completions.labels("unknown_pod").value == 1


@pytest.mark.parametrize(
    ("body", "path", "status", "code"),
    [
        pytest.param(b"{oops", "/v1/completions", 400, "invalid_json", id="bad-json"),
        pytest.param(  # a body naming no model is routed: tests/routing/test_default_model
            {"model": 7, "prompt": "p"}, "/v1/completions", 400, "invalid_type", id="model-number"
        ),
        pytest.param(
            {"model": "nope", "prompt": "p"},
            "/v1/completions",
            404,
            "model_not_found",
            id="unknown-model",
        ),
        pytest.param(
            {"model": "m", "input": 5}, "/v1/responses", 400, "invalid_type", id="bad-input"
        ),
        pytest.param(
            {"model": "m", "prompt": "p"},
            "/v1/embeddings",
            400,
            "unsupported_endpoint",
            id="bad-path",
        ),
    ],
)
def test_errors_are_immediate_json_responses(
    client: Client, body: object, path: str, status: int, code: str
) -> None:
    got_status, error = error_of(client.send_body(body, path=path))
    assert (got_status, error["code"]) == (status, code)
    assert error["message"]


def test_no_ready_pod_is_503(router: Router, client: Client) -> None:
    router.set_pods([make_pod("down", ready=False)])
    status, error = error_of(client.send_body({"model": "m", "prompt": "p"}))
    assert (status, error["code"]) == (503, "no_ready_pods")


def test_subset_hint_restricts_candidates(client: Client) -> None:
    allowed = [PODS[2].address]
    assert destination(client.send_body({"model": "m", "prompt": "p"}, subset=allowed)) == allowed
    status, _ = error_of(client.send_body({"model": "m", "prompt": "p"}, subset=["10.1.1.1:80"]))
    assert status == 503


def test_unexpected_errors_are_500_with_request_id_and_no_trace(
    router: Router, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken:
        def schedule(self, *_a: object) -> None:
            raise RuntimeError("secret internals")

    monkeypatch.setattr(router, "scheduler", Broken())
    status, error = error_of(client.send_body({"model": "m", "prompt": "p"}, request_id="rid-9"))
    assert status == 500 and "rid-9" in str(error["message"])
    assert "secret internals" not in str(error) and "Traceback" not in str(error)
    # and the server keeps serving
    monkeypatch.undo()
    assert destination(client.send_body({"model": "m", "prompt": "p"}))


def test_unexpected_message_kind_continues(client: Client) -> None:
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(), end_of_stream=True)
    )
    resp = client.process(iter([msg]), timeout=5)
    assert resp.HasField("request_headers")


def test_large_body_passes_the_grpc_limit(client: Client) -> None:
    prompt = "z" * (6 * 1024 * 1024)
    assert len(destination(client.send_body({"model": "m", "prompt": prompt}))) == 3


def test_health_service_reports_serving() -> None:
    server, servicer, port = make_health_server("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE)).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            servicer.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
    finally:
        server.stop(0).wait()


def test_route_replies_come_serialized_once_per_destination_list(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply bytes are remembered per destination list: built once per list, and
    exactly the reply built afresh, also when a later request brings the same list."""
    built: list[str] = []

    def counted(destination: str, prefill: str | None = None) -> ep.ProcessingResponse:
        built.append(destination)
        return route_response(destination, prefill)

    monkeypatch.setattr(one_round, "route_response", counted)
    body = {"model": "m", "prompt": "a prompt no pod has recorded " * 8}
    replies = [client.send_body(body, request_id=f"r{i}") for i in range(40)]
    lists = [",".join(destination(r)) for r in replies]
    assert len(set(lists)) < len(lists)  # some lists came again: remembered replies
    assert sorted(built) == sorted(set(lists))  # one build per distinct list
    assert all(r == route_response(dest) for r, dest in zip(replies, lists, strict=True))
