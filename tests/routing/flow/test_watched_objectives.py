"""InferenceObjectives watched from the (fake) Kubernetes API set the priorities flow
control gives new requests, and a priority change applies to the next request."""

from __future__ import annotations

import orjson
from prometheus_client import CollectorRegistry

from extproc.datalayer.objectives import InferenceObjectiveWatcher
from extproc.errors import Overloaded
from extproc.pods import PodMetrics
from extproc.routing.flow.config import OBJECTIVE_HEADER, FlowConfig
from extproc.routing.flow.held import Held
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler
from testkit.waiting import wait_until
from tests.datalayer.crd_watching import FAST, server_config
from tests.datalayer.fake_kube import FakeKube, inference_objective
from tests.datalayer.test_objectives import OBJECTIVES

BODY = orjson.dumps({"model": "m", "prompt": "hi"})


def test_a_watched_priority_change_applies_to_new_requests() -> None:
    config = FlowConfig(
        enabled=True,
        trusted_headers=frozenset({OBJECTIVE_HEADER}),
        objectives={"batch": 0},
        max_waiting=1,
    )
    router = Router(
        make_scheduler(PREFIX_ONLY),
        [make_pod("p0", metrics=PodMetrics(waiting=3))],  # saturated throughout
        registry=CollectorRegistry(),
        flow=config,
    )
    router.set_pods([make_pod("p0", metrics=PodMetrics(waiting=3))])  # the second scrape
    assert router.flow is not None
    objectives = router.flow.objectives

    def send(rid: str) -> object:
        try:
            return router.route_or_defer(
                "/v1/completions", BODY, request_id=rid, headers={OBJECTIVE_HEADER: "batch"}
            )
        except Overloaded as refused:
            return refused

    with FakeKube() as kube:
        kube.put(OBJECTIVES, inference_objective("batch", -1))
        watcher = InferenceObjectiveWatcher(
            server_config(kube.url),
            objectives.set_watched,
            namespace="ns",
            pool="pool",
            timing=FAST,
        )
        watcher.start()
        try:
            refused = send("r1")  # the cluster's -1 wins over the configured 0: shed
            assert isinstance(refused, Overloaded) and refused.code == "shed"
            kube.wait_for_watches(1)
            kube.put(OBJECTIVES, inference_objective("batch", 5))
            wait_until(lambda: objectives.get("batch") == 5, 5, what="change not applied")
            held = send("r2")
            assert isinstance(held, Held) and held.priority == 5
            held.cancel()
            kube.delete(OBJECTIVES, "batch")
            wait_until(lambda: objectives.get("batch") == 0, 5, what="delete not applied")
        finally:
            watcher.stop()
