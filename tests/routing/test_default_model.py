"""A body naming no model (absent, null or ``""``) is routed as vLLM serves it: as the one
base model the ready candidate pods serve, its body sent on unchanged, hashed, admitted
and rewritten under that model; refused with 400 naming the models when they are several.
In both protocols (one-round and the Endpoint Picker Protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from extproc.errors import BadRequest, ExtProcError, ModelNotFound, NoReadyPods
from extproc.pods import Pod
from extproc.routing.flow.config import FlowConfig
from extproc.routing.rewrites import parse_model_rewrites
from extproc.routing.router import Router
from extproc.wire.one_round import RouteHandler
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler
from testkit.wire import Server, body, destination, error_of, headers, routed_body

PROMPT = "a prompt long enough to fill a few blocks of the prefix view " * 4
NAMED = orjson.dumps({"model": "m", "prompt": PROMPT})
NO_MODEL = {
    "absent": orjson.dumps({"prompt": PROMPT}),
    "null": orjson.dumps({"model": None, "prompt": PROMPT}),
    "empty": orjson.dumps({"model": "", "prompt": PROMPT}),
}
ONE_MODEL = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]  # all serve "m"
TWO_MODELS = [*ONE_MODEL, make_pod("q0", model="other", port=8100)]


def with_adapter(pod: Pod, adapter: str) -> Pod:
    return replace(pod, models=pod.models | {adapter}, adapters=frozenset({adapter}))


def make_router(pods: Sequence[Pod], **kwargs: Any) -> Router:
    return Router(make_scheduler(PREFIX_ONLY), pods, registry=CollectorRegistry(), **kwargs)


def refusal(router: Router, data: bytes, **kwargs: Any) -> ExtProcError:
    with pytest.raises(ExtProcError) as caught:
        router.route("/v1/completions", data, **kwargs)
    return caught.value


@pytest.mark.parametrize("name", list(NO_MODEL))
def test_a_body_without_a_model_is_routed_as_the_pools_one_model(name: str) -> None:
    router = make_router(ONE_MODEL)
    decision = router.route("/v1/completions", NO_MODEL[name], request_id="r")
    assert decision.body is None  # sent on as the client wrote it: the pod fills the model in
    assert router.pending.pop("r").cycle.request.model == "m"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(NO_MODEL))
def test_it_shares_the_prefix_cache_of_requests_naming_the_model(name: str) -> None:
    """vLLM serves it with no adapter: the base model's cache, as a named request's."""
    router = make_router(ONE_MODEL)
    first = router.route("/v1/completions", NAMED, request_id="named")
    served = first.pods[-1]  # not the first pick: the match, not a tie, must decide
    assert router.complete("named", served.address, succeeded=True)
    assert router.route("/v1/completions", NO_MODEL[name]).pods[0] == served


def test_adapters_are_not_the_default() -> None:
    pods = [with_adapter(p, "a") for p in ONE_MODEL]
    router = make_router(pods)
    router.route("/v1/completions", NO_MODEL["absent"], request_id="r")
    assert router.pending.pop("r").cycle.request.model == "m"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(NO_MODEL))
def test_several_models_are_refused_naming_them(name: str) -> None:
    router = make_router(TWO_MODELS)
    error = refusal(router, NO_MODEL[name])
    assert isinstance(error, BadRequest) and error.http_status == 400
    assert error.code == "missing_model"
    assert error.message.endswith("name one of: m, other")
    assert router.metrics.errors.labels("400", "missing_model")._value.get() == 1


def test_only_the_ready_candidates_count() -> None:
    unready = [*ONE_MODEL, make_pod("q0", model="other", port=8100, ready=False)]
    assert make_router(unready).route("/v1/completions", NO_MODEL["absent"]).pods
    subset = [p.address for p in ONE_MODEL[:2]]
    decision = make_router(TWO_MODELS).route("/v1/completions", NO_MODEL["absent"], subset=subset)
    assert {p.address for p in decision.pods} <= set(subset)


def test_no_ready_pod_is_503_and_no_base_model_404() -> None:
    unready = [make_pod("p0", ready=False)]
    assert isinstance(refusal(make_router(unready), NO_MODEL["absent"]), NoReadyPods)
    adapter_only = [replace(ONE_MODEL[0], models=frozenset({"a"}), adapters=frozenset({"a"}))]
    assert isinstance(refusal(make_router(adapter_only), NO_MODEL["absent"]), ModelNotFound)


@pytest.mark.parametrize("model", [7, False, [], {}])
def test_a_model_of_another_type_is_still_refused(model: object) -> None:
    data = orjson.dumps({"model": model, "prompt": PROMPT})
    error = refusal(make_router(ONE_MODEL), data)
    assert (error.http_status, error.code) == (400, "invalid_type")


@pytest.mark.parametrize("name", list(NO_MODEL))
def test_a_rewrite_rule_matches_the_resolved_model(name: str) -> None:
    """A rule for "m" rewrites a body that names no model, as one naming "m" (here to an
    adapter of the same pods): the body sent on names the target."""
    rules = parse_model_rewrites(
        [{"matches": [{"model": "m"}], "targets": [{"modelRewrite": "m-v2"}]}], "t.yaml"
    )
    router = make_router([with_adapter(p, "m-v2") for p in ONE_MODEL], rewrites=rules)
    decision = router.route("/v1/completions", NO_MODEL[name], request_id="r")
    assert decision.body is not None
    assert orjson.loads(decision.body) == {"model": "m-v2", "prompt": PROMPT}
    assert router.pending.pop("r").cycle.request.model == "m-v2"  # type: ignore[union-attr]


def test_a_rewritten_body_without_a_model_keeps_a_nested_model_key() -> None:
    rules = parse_model_rewrites(
        [{"matches": [{"model": "m"}], "targets": [{"modelRewrite": "m-v2"}]}], "t.yaml"
    )
    router = make_router([with_adapter(p, "m-v2") for p in ONE_MODEL], rewrites=rules)
    data = {"prompt": PROMPT, "metadata": {"model": "x"}}
    decision = router.route("/v1/completions", orjson.dumps(data))
    assert decision.body is not None
    assert orjson.loads(decision.body) == {**data, "model": "m-v2"}


def test_flow_control_admits_it_under_the_resolved_model(monkeypatch: pytest.MonkeyPatch) -> None:
    router = make_router(ONE_MODEL, flow=FlowConfig(enabled=True))
    assert router.flow is not None
    admitted: list[str] = []
    admit = router.flow.admit

    def spy(model: str, *args: Any) -> Any:
        admitted.append(model)
        return admit(model, *args)

    monkeypatch.setattr(router.flow, "admit", spy)
    router.route_or_defer("/v1/completions", NO_MODEL["absent"], request_id="r")
    assert admitted == ["m"]


@pytest.mark.parametrize("name", list(NO_MODEL))
def test_one_round_routes_it(name: str) -> None:
    handler = RouteHandler(make_router(ONE_MODEL))
    reply, _ = handler.process(routed_body("r", NO_MODEL[name]))
    assert isinstance(reply, bytes)
    response = ep_response(reply)
    assert destination(response)
    assert not response.request_body.response.HasField("body_mutation")
    refused, _ = RouteHandler(make_router(TWO_MODELS)).process(routed_body("s", NO_MODEL[name]))
    assert isinstance(refused, ep.ProcessingResponse)
    status, error = error_of(refused)
    assert status == 400 and "name one of: m, other" in str(error["message"])


def test_epp_routes_it(server_kind: str) -> None:
    with Server("epp", make_router(ONE_MODEL), server_kind) as s:
        for name, data in NO_MODEL.items():
            _, routed = s.exchange([headers(rid=name), body(data)])
            assert destination(routed), name
            assert not routed.request_body.response.HasField("body_mutation")
    with Server("epp", make_router(TWO_MODELS), server_kind) as s:
        _, refused = s.exchange([headers(rid="x"), body(NO_MODEL["absent"])])
        status, error = error_of(refused)
        assert status == 400 and "name one of: m, other" in str(error["message"])


def ep_response(reply: bytes) -> ep.ProcessingResponse:
    return ep.ProcessingResponse.FromString(reply)
