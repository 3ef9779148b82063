"""``--protocol epp`` behind an Envoy configured the way Gateway API implementations do:
request headers first, the body BUFFERED or FULL_DUPLEX_STREAMED, the response sent back
through ext_proc, no access log. Routing, affinity, errors and recording must all hold,
and a retried request is recorded for the pod the gateway reports as served."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from e2e.support import (
    API,
    LIST_HEADER,
    MAX_REQUESTS,
    MODEL,
    PREFIX_CONFIG,
    RECORDED,
    TRIES_HEADER,
    answer_says_list_and_tries,
    body_for,
    client_routing_headers,
    metric,
    names_by_address,
    unique_prefix,
)
from extproc.sim.launch import SimPods, Stack, run_stack
from extproc.wire.epp import SERVED_KEY
from extproc.wire.protocol import DESTINATION_NAMESPACE, INTERNAL_HEADERS
from testkit.waiting import wait_until


def gateway_style(body_mode: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(config: dict[str, Any]) -> dict[str, Any]:
        for listener in config["static_resources"]["listeners"]:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            hcm.pop("access_log", None)
            filters = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.buffer"]
            for f in filters:
                if f["name"] == "envoy.filters.http.ext_proc":
                    ext = f["typed_config"]
                    ext.pop("request_attributes", None)
                    ext["processing_mode"] = {
                        "request_header_mode": "SEND",
                        "request_body_mode": body_mode,
                        "request_trailer_mode": "SEND"
                        if body_mode == "FULL_DUPLEX_STREAMED"
                        else "SKIP",
                        "response_header_mode": "SEND",
                        "response_body_mode": "STREAMED",
                        "response_trailer_mode": "SKIP",
                    }
            hcm["http_filters"] = filters
            # a gateway has no strip list of ours: extproc itself must remove what clients
            # send and set the destination header the pod then sees
            for host in hcm["route_config"]["virtual_hosts"]:
                host.pop("request_headers_to_remove", None)
        return config

    return edit


@pytest.fixture(scope="module", params=["BUFFERED", "FULL_DUPLEX_STREAMED"])
def epp_stack(request: pytest.FixtureRequest, sim: SimPods) -> Iterator[Stack]:
    with run_stack(
        sim.as_pods(),
        config=PREFIX_CONFIG,
        extproc_args=["--protocol", "epp"],
        envoy_transform=gateway_style(request.param),
    ) as stack:
        yield stack


def test_epp_routes_with_affinity_and_records_on_success(epp_stack: Stack) -> None:
    prefix = unique_prefix()
    body = {"model": MODEL, "prompt": prefix + "first", "max_tokens": 3}
    with httpx.Client(base_url=epp_stack.url, timeout=30) as client:
        before = metric(epp_stack, *RECORDED)
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        owner = first.headers["x-sim-pod"]
        wait_until(lambda: metric(epp_stack, *RECORDED) > before)
        for i in range(4):
            again = client.post("/v1/completions", json={**body, "prompt": prefix + f"q{i}"})
            assert again.headers["x-sim-pod"] == owner
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_epp_errors_are_json(epp_stack: Stack) -> None:
    with httpx.Client(base_url=epp_stack.url, timeout=30) as client:
        bad = client.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        empty = client.post("/v1/completions", content=b"")
        assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_json"


def test_epp_client_routing_headers_never_steer_and_never_reach_a_pod(
    epp_stack: Stack, sim: SimPods
) -> None:
    prefix = unique_prefix()
    body = {"model": MODEL, "prompt": prefix + "q", "max_tokens": 1}
    with httpx.Client(base_url=epp_stack.url, timeout=30) as client:
        before = metric(epp_stack, *RECORDED)
        owner = client.post("/v1/completions", json=body).headers["x-sim-pod"]
        wait_until(lambda: metric(epp_stack, *RECORDED) > before)
        address = {p.name: f"127.0.0.1:{p.port}" for p in sim.pods}
        for other in (name for name in address if name != owner):
            resp = client.post(
                "/v1/completions", json=body, headers=client_routing_headers(address[other])
            )
            assert resp.status_code == 200 and resp.headers["x-sim-pod"] == owner
            seen = sim.stats(owner)["recent"][-1]["routing_headers"]
            # the pod sees extproc's pick (this protocol sends it as a header), nothing else
            assert seen["x-gateway-destination-endpoint"].split(",")[0] == address[owner]
            assert not set(seen) & (set(INTERNAL_HEADERS) - {"x-gateway-destination-endpoint"})


def reports_served(config: dict[str, Any]) -> dict[str, Any]:
    """What a gateway that reports the served endpoint does: the override_host load
    balancer writes the host it picked, try after try, to ``envoy.lb`` metadata
    (``selected_host_key``), which ext_proc forwards to extproc with the response."""
    for cluster in config["static_resources"]["clusters"]:
        for policy in cluster.get("load_balancing_policy", {}).get("policies", []):
            typed = policy["typed_extension_config"]["typed_config"]
            if "override_host_sources" in typed:
                typed["selected_host_key"] = {
                    "key": DESTINATION_NAMESPACE,
                    "path": [{"key": SERVED_KEY}],
                }
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for f in hcm["typed_config"]["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            forwarding = f["typed_config"]["metadata_options"]["forwarding_namespaces"]
            forwarding["untyped"] = [*forwarding["untyped"], DESTINATION_NAMESPACE]
    return config


@pytest.fixture(scope="module", params=[True, False], ids=["served-reported", "not-reported"])
def served_stack(request: pytest.FixtureRequest, sim: SimPods) -> Iterator[Stack]:
    def edit(config: dict[str, Any]) -> dict[str, Any]:
        config = answer_says_list_and_tries(gateway_style("BUFFERED")(config))
        return reports_served(config) if request.param else config

    with run_stack(
        sim.as_pods(),
        config=PREFIX_CONFIG,
        extproc_args=["--protocol", "epp"],
        envoy_transform=edit,
    ) as stack:
        stack.reports_served = request.param  # type: ignore[attr-defined]
        yield stack


def test_epp_a_retried_request_is_recorded_for_the_pod_the_gateway_says_served(
    served_stack: Stack, sim: SimPods
) -> None:
    """The pick answers 503, the next listed pod serves. Reported: the prefix is recorded
    for the pod that served, so the next request goes there. Not reported: extproc can only
    record it for its pick, the pod that failed, and the next request goes back to it."""
    failing = sim.pods[0].name
    sim.set_faults(failing, error_rate=1.0, error_status=503)
    by_address = names_by_address(sim)
    with httpx.Client(base_url=served_stack.url, timeout=30) as client:
        for _ in range(MAX_REQUESTS):
            prefix = unique_prefix()
            before = metric(served_stack, *RECORDED)
            resp = client.post("/v1/completions", json=body_for(API, prefix, "q"))
            assert resp.status_code == 200, resp.text
            wait_until(lambda: metric(served_stack, *RECORDED) == before + 1)  # noqa: B023
            listed = [by_address[a] for a in resp.headers[LIST_HEADER].split(",")]
            if listed[0] == failing:
                break
        else:
            pytest.fail(f"{failing} was never the pick in {MAX_REQUESTS} fresh prefixes")
        assert resp.headers["x-sim-pod"] == listed[1] and resp.headers[TRIES_HEADER] == "2"
        sim.clear_faults(failing)
        again = client.post("/v1/completions", json=body_for(API, prefix, "again"))
    reported = bool(served_stack.reports_served)  # type: ignore[attr-defined]
    assert again.headers["x-sim-pod"] == (listed[1] if reported else failing)
