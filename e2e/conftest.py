"""End-to-end fixtures: simulated vLLM pods, extproc and a real Envoy, all on 127.0.0.1."""

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

import httpx
import pytest

from extproc.sim.launch import SimPods, Stack, run_stack, spawn_sim_pods

MODEL = "sim-llm"
RECORDED = ("extproc_completions_total", 'outcome="recorded"')
NUM_PODS = 4


@pytest.fixture(scope="package")
def sim() -> Iterator[SimPods]:
    with spawn_sim_pods(NUM_PODS, args=["--model", MODEL]) as pods:
        yield pods


PREFIX_CONFIG = Path(__file__).with_name("prefix-cache.yaml")


@pytest.fixture(scope="package")
def stack(sim: SimPods) -> Iterator[Stack]:
    with run_stack(sim.as_pods(), config=PREFIX_CONFIG) as running:
        yield running


@pytest.fixture(autouse=True)
def clear_faults(sim: SimPods) -> Iterator[None]:
    yield
    for pod in sim.pods:
        sim.clear_faults(pod.name)


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


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


def wait_for(predicate: object, timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` until true; a connection error (a process starting, restarting
    or draining under load) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


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
        assert wait_for(lambda: self.statuses(since).total() >= count, timeout_s), self.statuses()


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
