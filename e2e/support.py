"""What the end-to-end tests share besides their fixtures (those are in ``conftest.py``):
the pods' model, extproc's metrics, request bodies for the three APIs, polling, background
load, and the retry-order Envoy."""

from __future__ import annotations

import collections
import itertools
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from extproc.sim.launch import SimPods, Stack
from extproc.wire.protocol import DESTINATION_KEY, DESTINATION_NAMESPACE, INTERNAL_HEADERS
from testkit.waiting import wait_until

MODEL = "sim-llm"
RECORDED = ("extproc_completions_total", 'outcome="recorded"')
NUM_PODS = 4
PREFIX_CONFIG = Path(__file__).with_name("prefix-cache.yaml")
ENTRIES = ("kthena_router_prefix_cache_entries", "")
FAILED = ("extproc_completions_total", 'outcome="failed"')


def unique_prefix() -> str:
    """A system prompt no other test sends: 1,200 bytes, so 19 blocks of 64."""
    return f"[{uuid.uuid4()}] " + "You are a meticulous assistant for the routing team. " * 22


class MissingSeries(AssertionError):
    """The series is not on the page: renamed, mislabelled, or not made yet."""


def metric(stack: Stack, name: str, labels: str = "", *, absent: float | None = None) -> float:
    """One sample of extproc's /metrics.

    A missing series fails (``MissingSeries``): a renamed metric must not read as 0 and
    pass an equality check. ``absent`` is the value for a labelled child that Prometheus
    only shows after its first increment (e.g. a per-pod error count)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{{re.escape(labels)}\}})? (\S+)$", re.MULTILINE)
    deadline = time.monotonic() + 5.0
    while True:  # a loaded machine can be slow to accept: retry briefly, then fail
        try:
            text = stack.metrics_text()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    match = pattern.search(text)
    if match:
        return float(match.group(2))
    if absent is None:
        raise MissingSeries(f"no series {name}{{{labels}}} on extproc's /metrics")
    return absent


class Load:
    """Requests sent back to back by ``workers`` threads until stopped (bounded: at most
    ``max_s`` seconds), each answer's status and serving pod counted in order."""

    def __init__(
        self, url: str, body: Callable[[int], dict[str, object]], workers: int, max_s: float
    ) -> None:
        self.url = url
        self.body = body
        self.outcomes: list[tuple[float, int, str | None]] = []  # (time, status, pod); 0: no answer
        self._stop = threading.Event()
        self._deadline = time.monotonic() + max_s
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                i = next(self._count)
                try:
                    resp = client.post("/v1/completions", json=self.body(i))
                    outcome = (time.monotonic(), resp.status_code, resp.headers.get("x-sim-pod"))
                except httpx.HTTPError:
                    outcome = (time.monotonic(), 0, None)
                with self._lock:
                    self.outcomes.append(outcome)

    def statuses(self, since: float = 0.0) -> collections.Counter[int]:
        with self._lock:
            return collections.Counter(s for t, s, _ in self.outcomes if t >= since)

    def wait_for_answers(self, count: int, since: float = 0.0, timeout_s: float = 20) -> None:
        wait_until(
            lambda: self.statuses(since).total() >= count, timeout_s, what=lambda: self.statuses()
        )


@contextmanager
def background_load(
    url: str,
    body: Callable[[int], dict[str, object]] | None = None,
    *,
    workers: int = 4,
    max_s: float = 60.0,
) -> Iterator[Load]:
    """``Load`` running for the ``with`` block; its threads are joined on leaving."""
    load = Load(
        url,
        body or (lambda i: {"model": MODEL, "prompt": f"load {i}", "max_tokens": 1}),
        workers,
        max_s,
    )
    for t in load._threads:
        t.start()
    try:
        yield load
    finally:
        load._stop.set()
        for t in load._threads:
            t.join(35)


def body_for(api: str, prefix: str, question: str, **extra: object) -> dict[str, object]:
    if api == "/v1/completions":
        return {"model": MODEL, "prompt": prefix + question, "max_tokens": 4, **extra}
    if api == "/v1/chat/completions":
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    return {
        "model": MODEL,
        "instructions": prefix,
        "input": question,
        "max_output_tokens": 4,
        **extra,
    }


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.headers["x-sim-pod"]


def send_and_wait_recorded(
    stack: Stack, client: httpx.Client, api: str, body: dict[str, object]
) -> str:
    before = metric(stack, *RECORDED)
    pod = served_by(client.post(api, json=body))
    wait_until(lambda: metric(stack, *RECORDED) > before, what="the success was not recorded")
    return pod


def client_routing_headers(target: str) -> dict[str, str]:
    """Every header extproc or the route sets, and the neighbours a client might try."""
    headers = dict.fromkeys(INTERNAL_HEADERS, target)
    headers["x-gateway-destination-endpoint-subset"] = target
    headers["x-envoy-original-dst-host"] = target
    return headers


API = "/v1/completions"
LIST_HEADER = "x-test-destination"
TRIES_HEADER = "x-test-tries"
MAX_REQUESTS = 80  # fresh prefixes tie (random lists, least loaded first): every case comes up


def answer_says_list_and_tries(config: dict[str, Any]) -> dict[str, Any]:
    """The generated bootstrap, with extproc's list and Envoy's try count on every answer."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for host in hcm["typed_config"]["route_config"]["virtual_hosts"]:
        host["response_headers_to_add"] = [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in (
                (LIST_HEADER, f"%DYNAMIC_METADATA({DESTINATION_NAMESPACE}:{DESTINATION_KEY})%"),
                (TRIES_HEADER, "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
            )
        ]
    return config


def names_by_address(sim: SimPods) -> dict[str, str]:
    return {f"127.0.0.1:{p.port}": p.name for p in sim.pods}
