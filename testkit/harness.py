"""Simulated pods in this process, served from an event loop in a background thread:
faster to start than ``extproc.sim.launch.spawn_sim_pods``'s subprocess.

    with run_sim_pods(GroupSettings(num_pods=2)) as pods:
        url = pods.pods[0].url
        pods.set_faults(0, error_rate=1.0)
        pods.stats("sim-1")["engine"]["prefix_cache_hits"]
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from extproc.sim.launch import START_TIMEOUT_S, STOP_TIMEOUT_S, SimPods
from extproc.sim.pods import GroupSettings, PodGroup


@contextmanager
def run_sim_pods(settings: GroupSettings | None = None) -> Iterator[SimPods]:
    """Serve pods from an event loop in a background thread of this process."""
    settings = settings or GroupSettings()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sim-pods", daemon=True)
    thread.start()
    group: PodGroup | None = None
    try:

        async def start() -> PodGroup:
            g = PodGroup(settings)
            await g.start()
            return g

        group = asyncio.run_coroutine_threadsafe(start(), loop).result(START_TIMEOUT_S)
        yield SimPods.from_description(group.describe())
    finally:
        if group is not None:
            asyncio.run_coroutine_threadsafe(group.stop(), loop).result(STOP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_S)
        loop.close()
