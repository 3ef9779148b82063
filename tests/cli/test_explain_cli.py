"""``extproc explain`` against a running admin server: the table, --json, and its errors."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.admin.server import AdminServer
from extproc.cli import main
from extproc.pods import PodMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.inflight import InFlight
from testkit.factories import make_pod
from tests.admin.explain_setup import SHARED, TTFT_AND_FILTER


def chat(question: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SHARED},
            {"role": "user", "content": question},
        ],
    }


@pytest.fixture
def admin() -> Iterator[AdminServer]:
    in_flight = InFlight()
    registry = CollectorRegistry()
    scheduler = build_scheduler(parse_config(TTFT_AND_FILTER, "t.yaml"), registry, in_flight)
    pods = [
        make_pod(f"p{i}", port=8000 + i, metrics=PodMetrics(waiting=9 if i == 3 else 0))
        for i in range(4)
    ]
    router = Router(scheduler, pods, registry=registry, in_flight=in_flight)
    warm = router.route("/v1/chat/completions", json.dumps(chat("first")).encode(), request_id="a")
    router.complete("a", warm.pods[0].address, True)
    server = AdminServer(router, config_source="t.yaml")
    server.start()
    yield server
    server.stop()


def url(admin: AdminServer) -> str:
    return f"http://127.0.0.1:{admin.port}"


def test_table_has_a_row_per_pod_best_first(
    admin: AdminServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps(chat("second")))
    assert main(["explain", str(body), "--admin", url(admin)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    warm = next(iter(admin.router.in_flight.snapshot()), None)  # nothing in flight
    assert warm is None
    assert lines[0].startswith("model m (/v1/chat/completions), prompt ")
    assert lines[1].startswith("pick default/p")
    assert lines[2] == "flow control: off"
    header = lines[4].split()
    assert header[:5] == ["rank", "pod", "verdict", "estimated-ttft", "least-request"]
    assert "cached" in header and "cost" in header
    rows = lines[5:9]
    assert [r.split()[0] for r in rows] == ["1", "2", "3", "-"]
    pick = lines[1].split()[1].rstrip(",")
    assert rows[0].split()[1] == pick
    assert "removed by least-request" in rows[3] and "default/p3" in rows[3]
    assert " x2 " in rows[0]  # the score with its weight


def test_json_is_the_answer_as_is(admin: AdminServer, capsys: pytest.CaptureFixture[str]) -> None:
    inline = json.dumps({"model": "m", "prompt": "Hello there"})
    code = main(
        ["explain", inline, "--path", "/v1/completions", "--admin", url(admin) + "/", "--json"]
    )
    assert code == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["api"] == "/v1/completions" and len(answer["pods"]) == 4


def test_stdin_headers_and_a_refusal(
    admin: AdminServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"model": "x", "messages": []})))
    assert main(["explain", "-", "--header", "x-session-id: s", "--admin", url(admin)]) == 0
    assert capsys.readouterr().out.startswith("extproc would answer 404: ")


def test_unreachable_admin_port_is_said_plainly(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["explain", "{}", "--admin", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the admin port at http://127.0.0.1:{port}" in err
    assert "--admin-port" in err and "Traceback" not in err


def test_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["explain", "{}", "--admin", "http://x", "--header", "nocolon"]) == 2
    assert "expected NAME:VALUE" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.json"), "--admin", "http://x"]) == 2
    assert "cannot read" in capsys.readouterr().err
