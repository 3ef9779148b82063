"""The admin port: its routes over a real router, its errors, its bind address and flags."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.admin.server import AdminRequest, AdminResponse, AdminServer, start_admin
from extproc.cli import build_parser
from extproc.datalayer.kv_events import EventsSettings, KvEventsSubscriber
from extproc.datalayer.pods_file import parse_pods
from extproc.errors import ConfigError
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.sim.kv_cache import BlockStored, hash_request_tokens
from extproc.sim.kv_events import encode_event_batch
from testkit.factories import make_pod

PODS = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]
PROMPT = "You are the support assistant of a very large shop. " * 20
# estimated-ttft with one argument given: the others must show with their defaults.
CONFIG = """
scheduler:
  plugins:
    Score:
      enabled:
        - name: estimated-ttft
          weight: 2
  pluginConfig:
    - name: estimated-ttft
      args: {queuedMs: 40}
"""


def make_router(config: str = CONFIG) -> Router:
    registry = CollectorRegistry()
    in_flight = InFlight()
    scheduler = build_scheduler(parse_config(config, "t.yaml"), registry, in_flight)
    return Router(scheduler, PODS, registry=registry, in_flight=in_flight)


@pytest.fixture
def admin() -> Iterator[AdminServer]:
    server = AdminServer(make_router(), max_body_bytes=4096, config_source="t.yaml")
    server.start()
    yield server
    server.stop()


def call(admin: AdminServer, path: str, body: Any = None, raw: bytes | None = None) -> Any:
    """(status, parsed JSON or text) of one request to ``admin``."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{admin.port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            status, text, kind = reply.status, reply.read().decode(), reply.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        status, text, kind = exc.code, exc.read().decode(), exc.headers["Content-Type"]
    return status, json.loads(text) if kind == "application/json" else text


def chat(prompt: str = PROMPT) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()


def test_pods_show_in_flight_then_the_view_after_the_end(admin: AdminServer) -> None:
    status, state = call(admin, "/debug/pods")
    assert status == 200
    assert state["replica"] == admin.router.replica_id
    assert state["config_source"] == "t.yaml"
    assert [p["id"] for p in state["pods"]] == ["default/p0", "default/p1", "default/p2"]
    assert all(p["in_flight"] == {"requests": 0, "tokens": 0} for p in state["pods"])
    assert all(p["views"]["estimated-ttft"]["blocks"] == 0 for p in state["pods"])

    decision = admin.router.route("/v1/chat/completions", chat(), request_id="r1")
    pick = str(decision.pods[0].id)
    by_id = {p["id"]: p for p in call(admin, "/debug/pods")[1]["pods"]}
    assert by_id[pick]["in_flight"]["requests"] == 1
    assert by_id[pick]["in_flight"]["tokens"] > 0
    assert state["pending"] == 0 and call(admin, "/debug/pods")[1]["pending"] == 1

    admin.router.complete("r1", decision.pods[0].address, True)
    by_id = {p["id"]: p for p in call(admin, "/debug/pods")[1]["pods"]}
    assert by_id[pick]["in_flight"]["requests"] == 0
    view = by_id[pick]["views"]["estimated-ttft"]
    assert view["blocks"] > 0 and view["last_record_age_s"] is not None
    others = [p for i, p in by_id.items() if i != pick]
    assert all(p["views"]["estimated-ttft"]["last_record_age_s"] is None for p in others)
    assert set(by_id[pick]["load"]) == {"waiting", "running", "kv_usage", "scrape_age_s"}


def test_pods_show_their_adapters_and_data_parallel_rank() -> None:
    ranks = parse_pods(
        "pods:\n  - {name: dp, address: 127.0.0.1, ports: [8000, 8001], models: [m], "
        "adapters: [sql-lora]}\n  - {name: one, address: '127.0.0.1:8002', models: [m]}\n",
        "pods.yaml",
    )
    router = Router(make_router().scheduler, ranks, registry=CollectorRegistry())
    server = AdminServer(router, max_body_bytes=4096)
    server.start()
    try:
        state = {p["id"]: p for p in call(server, "/debug/pods")[1]["pods"]}
    finally:
        server.stop()
    assert [(p["rank"], p["adapters"], p["address"]) for p in state.values()] == [
        (0, ["sql-lora"], "127.0.0.1:8000"),
        (1, ["sql-lora"], "127.0.0.1:8001"),
        (None, [], "127.0.0.1:8002"),
    ]
    assert list(state) == ["default/dp-rank-0", "default/dp-rank-1", "default/one"]


def test_config_fills_defaults_and_follows_a_swapped_scheduler(admin: AdminServer) -> None:
    status, config = call(admin, "/debug/config")
    assert status == 200
    score = config["scheduler"]["plugins"]["Score"]["enabled"]
    assert score == [{"name": "estimated-ttft", "weight": 2}]
    args = config["scheduler"]["pluginConfig"][0]["args"]
    assert args["queuedMs"] == 40 and args["blockSizeToHash"] == 64  # given, default
    assert config["flowControl"]["enabled"] is False
    assert config["flowControl"]["saturation"]["maxWaiting"] == 1

    prefix = "scheduler: {plugins: {Score: {enabled: [{name: prefix-cache, weight: 1}]}}}"
    swapped = build_scheduler(parse_config(prefix, "new.yaml"), CollectorRegistry())
    admin.router.set_scheduler(swapped)
    config = call(admin, "/debug/config")[1]
    assert config["scheduler"]["pluginConfig"][0] == {
        "name": "prefix-cache",
        "args": {
            "blockSizeToHash": 64,
            "maxBlocksToMatch": 128,
            "maxHashCacheSize": 50000,
            "topKMatches": 5,
        },
    }


def test_pick_answers_and_records_nothing(admin: AdminServer) -> None:
    body = {"path": "/v1/chat/completions", "body": json.loads(chat())}
    status, answer = call(admin, "/debug/pick", body)
    assert status == 200
    assert answer["model"] == "m" and answer["pick"] in {"default/p0", "default/p1", "default/p2"}
    assert len(admin.router.pending) == 0
    assert admin.router.in_flight.snapshot() == {}


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "expected a JSON object"),
        (b'{"path": "nope", "body": {}}', 400, "'path'"),
        (b'{"headers": {"a": 1}, "body": {}}', 400, "'headers'"),
        (b'{"path": "/v1/chat/completions"}', 400, "'body' is required"),
        (b"x" * 5000, 413, "--max-body-bytes"),
    ],
)
def test_pick_refuses_bad_requests_with_json(
    admin: AdminServer, raw: bytes, status: int, message: str
) -> None:
    got, answer = call(admin, "/debug/pick", raw=raw)
    assert got == status
    assert message in answer["error"] and answer["status"] == status


def test_pick_takes_the_request_body_itself_with_its_path_in_the_query(
    admin: AdminServer,
) -> None:
    raw = json.dumps({"model": "m", "prompt": "Hello"}).encode()
    status, answer = call(admin, "/debug/pick?path=/v1/completions", raw=raw)
    assert status == 200 and answer["api"] == "/v1/completions"
    status, answer = call(admin, "/debug/pick", raw=raw)  # the chat API by default
    assert status == 400 and "messages" in answer["error"]


def test_pick_of_a_request_the_router_refuses_says_why(admin: AdminServer) -> None:
    body = {"path": "/v1/chat/completions", "body": {"model": "unknown", "messages": []}}
    status, answer = call(admin, "/debug/pick", body)
    assert status == 404 and "unknown" in answer["error"] and answer["code"]


def test_unknown_paths_and_methods(admin: AdminServer) -> None:
    assert call(admin, "/nope")[0] == 404
    assert call(admin, "/debug/pick")[0] == 405  # a GET
    status, text = call(admin, "/")
    assert status == 200 and "POST /debug/pick" in text


def test_a_failing_handler_answers_500_without_its_traceback(admin: AdminServer) -> None:
    def broken(_request: AdminRequest) -> AdminResponse:
        raise RuntimeError("secret detail")

    admin.add_route("GET", "/broken", broken)
    status, answer = call(admin, "/broken")
    assert status == 500
    assert "secret" not in json.dumps(answer) and "Traceback" not in json.dumps(answer)


def test_routes_can_be_added_and_replaced(admin: AdminServer) -> None:
    admin.add_route("GET", "/", lambda _r: AdminResponse.html("<p>status</p>"))
    assert call(admin, "/") == (200, "<p>status</p>")


def serve_args(*flags: str) -> Any:
    return build_parser().parse_args(["serve", "--pods", "pods.yaml", *flags])


def test_off_by_default_and_local_unless_told() -> None:
    router = make_router()
    assert start_admin(serve_args(), router, "t.yaml") is None
    admin = start_admin(serve_args("--admin-port", str(_free_port())), router, "t.yaml")
    assert admin is not None
    try:
        assert admin.address == "127.0.0.1"
        assert admin._httpd is not None and admin._httpd.server_address[0] == "127.0.0.1"
    finally:
        admin.stop()
    with pytest.raises(ConfigError, match="--admin-port"):
        start_admin(serve_args("--admin-port", "70000"), router, "t.yaml")


def test_a_taken_port_names_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = AdminServer(make_router(), port=taken.getsockname()[1])
        with pytest.raises(OSError, match="cannot bind the admin server to 127.0.0.1"):
            server.start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


PRECISE = """
scheduler:
  plugins:
    Score:
      enabled:
        - name: precise-prefix-cache
          weight: 1
  pluginConfig:
    - name: precise-prefix-cache
      args: {staleSeconds: 60}
"""


def test_pods_show_the_kv_event_sequence_and_the_exact_view() -> None:
    """Events applied in order, then a gap (no replay endpoint): the sequence state and
    the precise view, stale, as /debug/pods shows them."""
    router = make_router(PRECISE)
    precise = router.scheduler.scorers[0].scorer
    assert isinstance(precise, PrecisePrefixCache)
    events = KvEventsSubscriber(precise.index, EventsSettings("connect"), CollectorRegistry())
    pod = PODS[0].id
    tokens = list(range(32))
    hashes = tuple(hash_request_tokens(tokens, 16))
    batch = encode_event_batch(0.0, [BlockStored(hashes, None, tuple(tokens), 16, (None, None))])
    server = AdminServer(router, kv_events=events)
    server.start()
    try:
        events._on_message(pod, 0, batch)
        state = {p["id"]: p for p in call(server, "/debug/pods")[1]["pods"]}
        first = state[str(pod)]
        assert first["kv_events"]["next_seq"] == 1 and first["kv_events"]["gaps"] == 0
        assert first["kv_events"]["last_event_age_s"] is not None
        assert first["views"]["precise-prefix-cache"] == {
            "blocks": 2,
            "last_record_age_s": None,
            "stale": False,
        }
        assert state[str(PODS[1].id)]["kv_events"]["next_seq"] is None
        events._on_message(pod, 3, encode_event_batch(0.0, []))  # 1 and 2 lost
        after = {p["id"]: p for p in call(server, "/debug/pods")[1]["pods"]}[str(pod)]
        assert after["kv_events"] | {"last_event_age_s": 0} == {
            "next_seq": 4,
            "last_event_age_s": 0,
            "gaps": 1,
            "replays": 0,
            "marked_stale": 1,
            "restarts": 0,
        }
        assert after["views"]["precise-prefix-cache"]["stale"] is True
    finally:
        server.stop()
