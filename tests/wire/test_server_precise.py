"""precise-prefix-cache through the real gRPC server (both servers, both protocols): a
prompt whose segments the memo lacks is tokenized on the router's preparing threads, and
the other streams are answered meanwhile; a full pool routes from the approximate view,
and the drain routes what waits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from extproc.pods import Pod, PodId
from extproc.routing.preparing import PreparePool
from extproc.routing.router import Router
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import make_scheduler
from testkit.waiting import wait_until
from testkit.wire import (
    Server,
    body,
    destination,
    error_of,
    headers,
    routed_body,
    wait_settled,
)

pytestmark = needs_model_tokenizer
CONFIG = f"""
scheduler:
  plugins:
    Score:
      enabled:
        - name: precise-prefix-cache
          weight: 1
  pluginConfig:
    - name: precise-prefix-cache
      args:
        models:
          m: {MODEL_DIR}
"""
# "m" has a tokenizer (precise), "other" none (routed from the approximate view at once).
PODS = [
    Pod(PodId("default", f"p{i}"), f"127.0.0.1:{8200 + i}", frozenset({"m", "other"}))
    for i in range(3)
]


class BlockingTokenizer:
    """The model's tokenizer, but each batch encode waits for ``release`` (and says it
    started): a cold prompt that takes as long as the test wants."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.started = threading.Event()
        self.release = threading.Event()

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        assert self.release.wait(30)
        return self._tokenizer.encode_batch_fast(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def precise_router(registry: CollectorRegistry, pool: PreparePool | None = None) -> Router:
    return Router(make_scheduler(CONFIG, registry), PODS, registry=registry, preparing=pool)


def blocking(router: Router) -> BlockingTokenizer:
    """The router's tokenizer for "m", made to block."""
    plugin = next(p for p in router.scheduler.preparers if isinstance(p, PrecisePrefixCache))
    tok = plugin.tokenizers["m"]
    wrapper = BlockingTokenizer(tok.tokenizer)
    tok.tokenizer = wrapper  # type: ignore[assignment]
    return wrapper


def prompt(model: str, text: str) -> bytes:
    return orjson.dumps({"model": model, "prompt": text})


def send(s: Server, rid: str, data: bytes) -> list[ep.ProcessingResponse]:
    """The request's replies, on either protocol (timeouts long enough for a loaded CI)."""
    if s.protocol == "epp":
        return list(s.bidi(iter([headers(rid=rid), body(data)]), timeout=20))
    return [s.one_round.process(iter([routed_body(rid, data)]), timeout=20)]


def routed(replies: list[ep.ProcessingResponse]) -> list[str]:
    return next(destination(r) for r in replies if r.dynamic_metadata.fields)


def fallbacks(registry: CollectorRegistry, reason: str) -> float:
    labels = {"reason": reason}
    return registry.get_sample_value("extproc_precise_prefix_fallbacks_total", labels) or 0


@pytest.fixture(params=["one-round", "epp"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as clients:
        yield clients


def test_a_cold_prompt_being_tokenized_holds_up_no_other_stream(
    protocol: str, server_kind: str, pool: ThreadPoolExecutor
) -> None:
    registry = CollectorRegistry()
    router = precise_router(registry)
    warm = prompt("m", "a conversation seen before " * 20)
    with Server(protocol, router, server_kind) as s:
        assert routed(send(s, "warm-up", warm))
        tok = blocking(router)
        try:
            cold = pool.submit(send, s, "cold", prompt("m", "a long new document " * 2000))
            assert tok.started.wait(20)  # being tokenized (and held there)
            # Answered while the cold one is still tokenizing: on the loop server, the
            # tokenizing ran on the loop thread itself before, and this timed out.
            assert routed(send(s, "other", prompt("other", "a short question " * 10)))
            assert routed(send(s, "warm", warm))  # the memo has it all: routed on the spot
            assert not cold.done()
        finally:
            tok.release.set()
        assert len(routed(cold.result(timeout=20))) == 3
    assert fallbacks(registry, "busy") == 0
    # (the reply goes out before the pool counts the work done)
    wait_until(lambda: registry.get_sample_value("extproc_preparing_requests") == 0)


def test_a_full_pool_routes_from_the_approximate_view_and_counts_it(
    protocol: str, server_kind: str, pool: ThreadPoolExecutor
) -> None:
    registry = CollectorRegistry()
    router = precise_router(registry, PreparePool(num_threads=1, max_waiting=1))
    tok = blocking(router)
    with Server(protocol, router, server_kind) as s:
        try:
            first = pool.submit(send, s, "first", prompt("m", "the first new document " * 50))
            assert tok.started.wait(20)
            # The pool is full: this cold prompt is routed at once, approximately.
            assert routed(send(s, "second", prompt("m", "the second new document " * 50)))
            assert fallbacks(registry, "busy") == 1
            assert not first.done()
        finally:
            tok.release.set()
        assert routed(first.result(timeout=20))
    assert fallbacks(registry, "busy") == 1


def test_the_drain_routes_what_waits_for_preparation(
    protocol: str, server_kind: str, pool: ThreadPoolExecutor
) -> None:
    registry = CollectorRegistry()
    router = precise_router(registry, PreparePool(num_threads=1, max_waiting=4))
    tok = blocking(router)
    with Server(protocol, router, server_kind) as s:
        try:
            running = pool.submit(send, s, "running", prompt("m", "being tokenized " * 50))
            assert tok.started.wait(20)
            waiting: list[Future[list[ep.ProcessingResponse]]] = [
                pool.submit(send, s, f"waiting{i}", prompt("m", f"waits {i} " * 50))
                for i in range(2)
            ]
            wait_until(lambda: router.preparing.num_in == 3, 20)
            closing = pool.submit(router.close, 20)
            # The waiting ones are routed without their tokens, the running one is not.
            for future in waiting:
                assert routed(future.result(timeout=20))
            assert fallbacks(registry, "busy") == 2
            assert not closing.done() and not running.done()
        finally:
            tok.release.set()
        assert closing.result(timeout=20) is True
        assert routed(running.result(timeout=20))
        # Closed: a cold prompt now is routed at once, approximately.
        assert routed(send(s, "late", prompt("m", "after the drain " * 50)))
        assert fallbacks(registry, "busy") == 3


def test_an_error_after_preparing_is_answered_as_one_before_it(
    protocol: str, server_kind: str
) -> None:
    registry = CollectorRegistry()
    router = precise_router(registry)
    router.set_pods([replace(p, ready=False) for p in PODS])
    with Server(protocol, router, server_kind) as s:
        replies = send(s, "cold", prompt("m", "tokenized, then no pod is ready " * 50))
    assert error_of(replies[-1])[0] == 503
    labels = {"status": "503", "code": "no_ready_pods"}
    assert registry.get_sample_value("extproc_route_errors_total", labels) == 1
    tokenized = "extproc_precise_prefix_tokenize_seconds_count"
    assert registry.get_sample_value(tokenized, {"model": "m"}) == 1


def test_a_route_prepared_after_the_caller_gave_up_is_forgotten(
    protocol: str, server_kind: str
) -> None:
    router = precise_router(CollectorRegistry())
    tok = blocking(router)
    with Server(protocol, router, server_kind) as s:
        data = prompt("m", "Envoy stops waiting for this one " * 50)
        messages = (
            [headers(rid="late"), body(data)] if protocol == "epp" else [routed_body("late", data)]
        )
        try:
            with pytest.raises(grpc.RpcError) as info:
                list(s.bidi(iter(messages), timeout=2))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert tok.started.wait(20)  # it was being tokenized when the caller left
        finally:
            tok.release.set()
        wait_until(lambda: router.preparing.num_in == 0)
        wait_settled(router)
