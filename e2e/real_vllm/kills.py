"""What the pod-killing tests share: the package's pods one may still kill.

Each such test kills one of the package's pods for good, so it starts from the pods
still alive (and extproc listing just those), whichever killing test ran before it.
"""

from __future__ import annotations

from e2e.real_vllm.pods import VllmPod
from e2e.support import metric
from extproc.sim.launch import Stack
from testkit.waiting import wait_until

READY = "extproc_pods_ready"


def live_pods(stack: Stack, pods: list[VllmPod]) -> list[VllmPod]:
    """The pods alive and healthy, once extproc's ready count agrees; at least two (one to
    kill, one to take over)."""
    alive = [p for p in pods if p.proc.alive()]
    assert len(alive) >= 2, "needs a pod to kill and one to take over"
    # A loaded machine can keep a live pod's /health past its 2 s timeout: wait for it.
    wait_until(lambda: all(p.healthy() for p in alive), timeout_s=60, what="live pods healthy")
    wait_until(lambda: metric(stack, READY) == len(alive), timeout_s=30)
    return alive
