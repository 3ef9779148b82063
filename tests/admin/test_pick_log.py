"""JSON log lines (``admin.json_log``) and the per-request pick lines (``admin.pick_log``),
and serve's --log-format and --log-picks."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.admin.json_log import JsonFormatter
from extproc.admin.pick_log import PickLog
from extproc.routing.observe import EndTiming
from extproc.routing.router import Router
from testkit.example_pods import EXAMPLE_PODS_FILE
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler

PATH = "/v1/completions"
BODY = orjson.dumps({"model": "m", "prompt": "hello there " * 40, "max_tokens": 8})


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """What the root logger writes, formatted as --log-format json does."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_a_record_is_one_json_line_with_its_extra_fields(json_lines: io.StringIO) -> None:
    logging.getLogger("extproc.test").warning("hello %s", "world", extra={"pod": "ns/p0"})
    (record,) = parsed(json_lines)
    assert record["level"] == "WARNING" and record["logger"] == "extproc.test"
    assert record["message"] == "hello world" and record["pod"] == "ns/p0"
    assert str(record["time"]).endswith("+00:00")


def test_an_exception_is_one_field_on_the_same_line(json_lines: io.StringIO) -> None:
    try:
        raise ValueError("line one\nline two")
    except ValueError:
        logging.getLogger("extproc.test").exception("it failed")
    (record,) = parsed(json_lines)  # one line: the traceback's newlines are escaped
    assert "Traceback" in str(record["exception"]) and "line two" in str(record["exception"])


def test_each_decision_and_end_is_logged_with_its_fields(json_lines: io.StringIO) -> None:
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]
    router = Router(make_scheduler(PREFIX_ONLY), pods, registry=CollectorRegistry())
    router.observers.append(PickLog())
    decision = router.route(PATH, BODY, request_id="r1")
    timing = EndTiming(0.01, 0.5, 300, 2000, 200)
    router.complete("r1", decision.pods[0].address, succeeded=True, timing=timing)
    pick, end = (r for r in parsed(json_lines) if r["logger"] == "extproc.picks")
    assert pick["x_request_id"] == "r1" and pick["model"] == "m"
    assert pick["pick"] == decision.pods[0].address
    assert pick["pod"] == f"{decision.pods[0].id.namespace}/{decision.pods[0].id.name}"
    assert pick["fallbacks"] == [p.address for p in decision.pods[1:]]
    assert pick["candidates"] == 3 and pick["queued_s"] == 0
    assert isinstance(pick["predicted_cached_tokens"], int)
    assert end["x_request_id"] == "r1" and end["succeeded"] is True
    assert end["served_by"] == pick["pod"] and end["duration_s"] == 0.5


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "extproc", "serve", "--pods", str(EXAMPLE_PODS_FILE), *args]
    return subprocess.run(
        argv,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_a_bad_log_format_is_refused_with_a_clear_error() -> None:
    flag = serve("--log-format", "xml")
    assert flag.returncode == 2 and "--log-format: invalid choice: 'xml'" in flag.stderr
    env = serve(env={"EXTPROC_LOG_FORMAT": "xml"})
    assert env.returncode == 2
    assert "--log-format must be one of text, json, got 'xml'" in env.stderr


OUTSIDE_LOGGING = """
import os, threading, warnings
from extproc.cli.serve import configure_logging
captured = configure_logging("info", 0, "json")
os.write(2, b"I1206 04:41:34.607103    7713 chttp2_transport.cc:1403] Got goaway [2]\\n")
os.write(2, b"printed by a library\\n")
warnings.warn("a warning")
def fail():
    raise ValueError("in a thread")
thread = threading.Thread(target=fail, name="worker")
thread.start()
thread.join()
os.write(2, b"E1206 04:41:35.000001    7713 tcp_posix.cc:1] the last line\\n")
captured.close()
"""


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run by this Python in a process of its own (its output captured)."""
    argv = [sys.executable, "-c", code]
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60, env=env)


def test_with_json_logs_what_reaches_stderr_outside_logging_is_a_record_too() -> None:
    """gRPC's C core writes its own lines to fd 2 (a CI run once found one in JSON logs)."""
    done = python(OUTSIDE_LOGGING)
    records = [orjson.loads(line) for line in done.stderr.splitlines()]  # all JSON
    by_message = {r["message"]: r for r in records}
    goaway = by_message["Got goaway [2]"]
    assert goaway["logger"] == "grpc" and goaway["level"] == "INFO"
    assert goaway["source"] == "chttp2_transport.cc:1403"
    assert by_message["printed by a library"]["logger"] == "stderr"
    assert any(r["logger"] == "py.warnings" and "a warning" in r["message"] for r in records)
    uncaught = by_message["uncaught in thread worker"]
    assert "ValueError: in a thread" in uncaught["exception"]
    assert by_message["the last line"]["level"] == "ERROR"  # written just before close: kept
