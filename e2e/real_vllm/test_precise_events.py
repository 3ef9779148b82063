"""precise-prefix-cache against a real vLLM pod whose cache is small, with its KV events
passing through a relay that can drop them:

* evictions: a workload four times the cache evicts, and the cached tokens extproc
  predicts still equal the pod's report request after request (``BlockRemoved``
  applied), including prefixes whose tail the pod evicted;
* lost events, no replay: the gap is detected, the pod's view is marked stale and scored
  from the approximate view (counted), and once the stale time is over the view built
  from the events after the gap predicts exactly again;
* lost events with vLLM's replay endpoint: the missed batches are fetched, the view never
  goes stale, and the prediction for the request whose events were dropped is exact.

One pod (``--num-gpu-blocks-override``, a replay endpoint), started for this module; its
publisher connects to the relay (a SUB socket bound on the pod's endpoint, forwarding to
a PUB socket), and extproc's subscriber connects to the relay's PUB (the connect
topology).
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import zmq
from prometheus_client import CollectorRegistry

from e2e.real_vllm.exact import EVENTS_TIMEOUT_S, check, post, start_exact, with_max_tokens
from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import prepare
from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.request.parse import parse_request
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.sim.launch import free_port
from testkit.e2e_cache import model_dir
from testkit.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(600)]

NUM_BLOCKS = 20  # 19 usable (vLLM keeps a null block): 608 tokens, above max_model_len
STALE_S = 3.0
QUIET_S = 1.0  # no event for this long after a request: its batches have all been sent
CHAT = "/v1/chat/completions"


class Relay:
    """Forwards a publisher's messages (SUB bound on its endpoint) to a PUB socket, or
    drops them while ``dropping`` is set."""

    def __init__(self, publisher_endpoint: str) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.dropping = False
        self.dropped = 0
        self.last_message_at = time.monotonic()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(publisher_endpoint)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            self.last_message_at = time.monotonic()
            if self.dropping:
                self.dropped += 1
            else:
                self._pub.send_multipart(frames)

    def wait_quiet(self) -> None:
        """Until no message came for ``QUIET_S``."""
        wait_until(lambda: time.monotonic() - self.last_message_at > QUIET_S, 20)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def small_pod() -> Iterator[VllmPod]:
    prepare()
    with (
        tempfile.TemporaryDirectory(prefix="extproc-vllm-small-") as tmp,
        start_vllm_pods(
            1, Path(tmp), extra_args=["--num-gpu-blocks-override", str(NUM_BLOCKS)], replay=True
        ) as pods,
    ):
        yield pods[0]


@pytest.fixture(scope="module")
def relay(small_pod: VllmPod) -> Iterator[Relay]:
    r = Relay(small_pod.kv_events_endpoint)
    yield r
    r.close()


class Precise:
    """The plugin, fed by a subscriber connected to the relay (with the pod's replay
    endpoint or without); its metrics in ``registry``."""

    def __init__(self, pod: VllmPod, relay: Relay, replay: bool) -> None:
        self.pod_id = pod.as_pod().id
        self.registry = CollectorRegistry()
        self.plugin = PrecisePrefixCache.from_args(
            {"models": {MODEL: str(model_dir())}, "blockSize": BLOCK_SIZE, "staleSeconds": STALE_S},
            PluginContext(self.registry),
        )
        port = int(relay.endpoint.rsplit(":", 1)[1])
        settings = EventsSettings("connect", port, replay_port=pod.replay_port if replay else None)
        self.subscriber = KvEventsSubscriber(self.plugin.index, settings, self.registry)
        self.subscriber.set_pods([pod.as_pod()])
        self.plugin.pods_changed([pod.as_pod()])

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def pod_metric(self, name: str, **labels: str) -> float:
        return self.metric(name, pod=str(self.pod_id), **labels)

    def stale(self) -> bool:
        return self.plugin.index.view(self.pod_id).stale()


@contextmanager
def precise_view(pod: VllmPod, relay: Relay, replay: bool) -> Iterator[Precise]:
    """A ``Precise`` whose view of ``pod`` is exact (reset) on entry, stopped on leaving."""
    p = Precise(pod, relay, replay)
    p.subscriber.start()
    try:
        with httpx.Client(timeout=120) as client:
            start_exact(p.plugin, pod, client)
        yield p
    finally:
        p.subscriber.stop()


def chat(system: str, question: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": system},
            {"role": "user", "content": question}]}  # fmt: skip


def full_hit(num_tokens: int) -> int:
    """What vLLM finds cached of a prompt it holds whole: its full blocks but the last token."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_predictions_stay_exact_through_evictions(small_pod: VllmPod, relay: Relay) -> None:
    """Four documents of about six blocks behind a shared system prompt, twice round: the
    cache holds two or three, so every request evicts the oldest tails and each second
    visit finds its document partly or wholly gone."""
    system = f"[{uuid.uuid4()}] " + "You answer questions about documents. " * 10
    docs = [f"Document {i} {uuid.uuid4()}: " + f"fact {i} is true. " * 30 for i in range(4)]
    evicted = 0
    with precise_view(small_pod, relay, replay=True) as p, httpx.Client(timeout=120) as client:
        for doc in docs:
            check(p.plugin, client, small_pod, CHAT, chat(system, doc))
        for doc in docs:
            predicted, num_tokens = check(p.plugin, client, small_pod, CHAT, chat(system, doc))
            evicted += predicted < full_hit(num_tokens)
            assert p.plugin.index.view(p.pod_id).num_blocks("GPU") < NUM_BLOCKS
    assert evicted == len(docs)


def serve_with_events_dropped(relay: Relay, client: httpx.Client, pod: VllmPod, body: Any) -> None:
    """Serve ``body`` with every event batch it causes dropped by the relay."""
    relay.wait_quiet()
    before = relay.dropped
    relay.dropping = True
    try:
        post(client, pod, CHAT, with_max_tokens(CHAT, body))
        relay.wait_quiet()
    finally:
        relay.dropping = False
    assert relay.dropped > before


def prompts(n: int) -> list[dict[str, Any]]:
    """``n`` chat requests sharing nothing, of about three blocks each."""
    return [chat(f"[{uuid.uuid4()}] " + "Some context to keep. " * 16, "Why?") for _ in range(n)]


def test_lost_events_mark_the_view_stale_until_new_events_rebuild_it(
    small_pod: VllmPod, relay: Relay
) -> None:
    a, b, c, d = prompts(4)
    with precise_view(small_pod, relay, replay=False) as p, httpx.Client(timeout=120) as client:
        check(p.plugin, client, small_pod, CHAT, a)
        gaps = p.pod_metric("extproc_kv_events_gaps_total")
        serve_with_events_dropped(relay, client, small_pod, b)
        check(p.plugin, client, small_pod, CHAT, c)  # its events come after the gap
        assert p.pod_metric("extproc_kv_events_gaps_total") == gaps + 1
        assert p.stale() and p.metric("extproc_kv_events_stale_pods") == 1
        # Stale: scored from the approximate view, which learned ``a`` when it was served.
        cycle_a = Cycle(parse_request(CHAT, orjson.dumps(a)))
        p.plugin.record(cycle_a, p.pod_id)
        assert p.plugin.score(cycle_a, [small_pod.as_pod()]) == {p.pod_id: 100}
        assert p.metric("extproc_precise_prefix_fallbacks_total", reason="stale_pod") == 1
        # The stale time over, the view the events after the gap built is trusted again.
        wait_until(lambda: not p.stale(), STALE_S + EVENTS_TIMEOUT_S)
        assert p.metric("extproc_kv_events_stale_pods") == 0
        predicted, num_tokens = check(p.plugin, client, small_pod, CHAT, c)
        assert predicted == full_hit(num_tokens) > 0
        check(p.plugin, client, small_pod, CHAT, d)
        predicted, num_tokens = check(p.plugin, client, small_pod, CHAT, d)
        assert predicted == full_hit(num_tokens)


def test_with_replay_the_missed_batches_are_fetched_and_nothing_is_lost(
    small_pod: VllmPod, relay: Relay
) -> None:
    a, b, c = prompts(3)
    with precise_view(small_pod, relay, replay=True) as p, httpx.Client(timeout=120) as client:
        check(p.plugin, client, small_pod, CHAT, a)
        gaps = p.pod_metric("extproc_kv_events_gaps_total")
        replays = p.pod_metric("extproc_kv_events_replays_total", outcome="ok")  # joining
        serve_with_events_dropped(relay, client, small_pod, b)
        check(p.plugin, client, small_pod, CHAT, c)  # its first batch shows the gap
        assert p.pod_metric("extproc_kv_events_gaps_total") == gaps + 1
        assert p.pod_metric("extproc_kv_events_replays_total", outcome="ok") == replays + 1
        assert not p.stale() and p.metric("extproc_kv_events_stale_pods") == 0
        # ``b``'s blocks reached the view only through the replay.
        predicted, num_tokens = check(p.plugin, client, small_pod, CHAT, b)
        assert predicted == full_hit(num_tokens) > 0
