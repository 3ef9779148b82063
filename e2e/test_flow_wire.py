"""Holding a request through real Envoy: the wire side of flow control.

extproc's gRPC server runs in this process over a real ``Router`` whose ``route_or_defer``
holds every request (a ``Held`` this test decides), in front of simulated pods and a real
Envoy with a short ``message_timeout`` (1 s). What is checked is Envoy's side: the
override extproc sends first keeps Envoy waiting past its message timeout until the hold
ends (one-round, EPP buffered and full duplex); without ``max_message_timeout`` Envoy
ignores the override (the generated configuration must set it); a client that leaves
while held makes extproc cancel the hold. The whole system (queue, priorities) is tested
in ``e2e/test_flow_control.py``.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from e2e.support import MODEL
from extproc.envoyconf.options import EnvoyOptions
from extproc.routing.decision import RouteDecision
from extproc.routing.flow.held import Held
from extproc.routing.router import Router
from extproc.sim.launch import Proc, SimPods, free_port, start_envoy
from extproc.wire.epp import epp_process
from extproc.wire.server import make_grpc_server
from testkit.factories import PREFIX_ONLY, make_scheduler
from testkit.waiting import wait_until

MESSAGE_TIMEOUT_S = 1.0
HOLD_S = 3.0  # held this long, three times Envoy's message timeout
TTL_S = 4.0  # the hold's time to live: the override asks for TTL + 2 s


@dataclass
class Holding:
    """``route_or_defer`` replaced: every request is held; routed for real after
    ``release_after_s`` (None: never, until cancelled)."""

    router: Router
    release_after_s: float | None = HOLD_S
    held: list[Held] = field(default_factory=list)

    def route_or_defer(self, path: str, data: bytes, **kwargs: Any) -> Held:
        held = Held(time.monotonic() + TTL_S, priority=0)
        self.held.append(held)
        if self.release_after_s is not None:

            def release() -> None:
                if held.cancelled():  # the client left
                    return
                decision: RouteDecision = self.router.route(path, data, **kwargs)
                held.set_result(decision)

            timer = threading.Timer(self.release_after_s, release)
            timer.daemon = True
            timer.start()
        return held


@dataclass
class Served:
    url: str
    holding: Holding


def gateway_style(body_mode: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ext_proc filter as Gateway API implementations set it (e2e/test_gateway_epp.py):
    request headers sent, the body ``body_mode``, the response sent back."""

    def edit(config: dict[str, Any]) -> dict[str, Any]:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        typed = hcm["typed_config"]
        typed["http_filters"] = [
            f for f in typed["http_filters"] if f["name"] != "envoy.filters.http.buffer"
        ]
        ext = typed["http_filters"][0]["typed_config"]
        ext.pop("request_attributes", None)
        duplex = body_mode == "FULL_DUPLEX_STREAMED"
        ext["processing_mode"] = {
            "request_header_mode": "SEND",
            "request_body_mode": body_mode,
            "request_trailer_mode": "SEND" if duplex else "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED",
            "response_trailer_mode": "SKIP",
        }
        return config

    return edit


def without_max_message_timeout(
    edit: Callable[[dict[str, Any]], dict[str, Any]] | None,
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit_more(config: dict[str, Any]) -> dict[str, Any]:
        config = edit(config) if edit else config
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"]["http_filters"][0]["typed_config"].pop("max_message_timeout")
        return config

    return edit_more


PROTOCOLS: dict[str, Callable[[dict[str, Any]], dict[str, Any]] | None] = {
    "one-round": None,
    "epp-buffered": gateway_style("BUFFERED"),
    "epp-full-duplex": gateway_style("FULL_DUPLEX_STREAMED"),
}


@contextmanager
def serve(sim: SimPods, protocol: str, *, max_message_timeout: bool = True) -> Iterator[Served]:
    """extproc's gRPC server (holding every request) and Envoy in front of ``sim``."""
    pods = sim.as_pods()
    router = Router(make_scheduler(PREFIX_ONLY), pods, registry=CollectorRegistry())
    holding = Holding(router)
    router.route_or_defer = holding.route_or_defer  # type: ignore[method-assign,assignment]
    server, port = make_grpc_server(
        router,
        "127.0.0.1:0",
        process=epp_process(router) if protocol.startswith("epp") else None,
    )
    server.start()
    envoy: Proc | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="extproc-flow-wire-") as tmp:
            options = EnvoyOptions(
                extproc_address=f"127.0.0.1:{port}",
                listen_port=free_port(),
                admin_port=free_port(),
                message_timeout_s=MESSAGE_TIMEOUT_S,
            )
            edit = PROTOCOLS[protocol]
            if not max_message_timeout:
                edit = without_max_message_timeout(edit)
            envoy = start_envoy(pods, options, Path(tmp), edit)
            yield Served(f"http://127.0.0.1:{options.listen_port}", holding)
    finally:
        if envoy is not None:
            envoy.stop()
        server.stop(0).wait(5)
        router.close(5)


def post(url: str, timeout_s: float = 30) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        resp = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "held", "max_tokens": 1}
        )
    return resp, time.monotonic() - started


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_request_held_past_the_message_timeout_is_routed_and_served(
    sim: SimPods, protocol: str
) -> None:
    with serve(sim, protocol) as served:
        resp, took = post(served.url)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-sim-pod"]
    assert took >= HOLD_S  # held all along: Envoy's 1 s timer did not fire
    assert served.holding.held[0].done() and not served.holding.held[0].cancelled()


@pytest.mark.parametrize(
    ("protocol", "status"),
    [
        pytest.param("one-round", 504, id="one-round"),
        pytest.param("epp-buffered", 504, id="epp-buffered"),
        # Envoy 1.40 runs no message timer on a full-duplex body: the hold needs no override
        pytest.param("epp-full-duplex", 200, id="epp-full-duplex"),
    ],
)
def test_without_max_message_timeout_envoy_ignores_the_override(
    sim: SimPods, protocol: str, status: int
) -> None:
    """Why the generated configuration sets max_message_timeout: Envoy's fact, measured."""
    with serve(sim, protocol, max_message_timeout=False) as served:
        resp, took = post(served.url)
    assert resp.status_code == status, resp.text
    if status == 504:
        assert took < HOLD_S  # at the 1 s message timeout, not at the hold's end
    else:
        assert took >= HOLD_S  # held all along, no timer fired


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_client_that_leaves_while_held_cancels_the_hold(sim: SimPods, protocol: str) -> None:
    with serve(sim, protocol) as served:
        served.holding.release_after_s = None  # held until cancelled
        with pytest.raises(httpx.ReadTimeout):
            post(served.url, timeout_s=1.5)  # leaves after 1.5 s, past the message timeout
        wait_until(lambda: served.holding.held and served.holding.held[0].cancelled())
