"""Live reload and JSON logs through real Envoy: extproc (``--config-poll-s 0.2
--log-format json --log-picks``) in front of the simulated pods, its configuration file
rewritten while requests flow."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from e2e.support import (
    MODEL,
    PREFIX_CONFIG,
    background_load,
    metric,
    names_by_address,
    send_and_wait_recorded,
    served_by,
    unique_prefix,
)
from extproc.admin.reload import content_hash
from extproc.sim.launch import SimPods, Stack, run_stack
from testkit.waiting import wait_until

RELOADS = "extproc_config_reloads_total"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reload") / "config.yaml"
    path.write_text(PREFIX_CONFIG.read_text())
    return path


@pytest.fixture(scope="module")
def reload_stack(sim: SimPods, config_file: Path) -> Iterator[Stack]:
    args = ["--config-poll-s", "0.2", "--log-format", "json", "--log-picks"]
    with run_stack(sim.as_pods(), config=config_file, extproc_args=args) as running:
        yield running


def completion(prefix: str, question: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prefix + question, "max_tokens": 4}


def count(stack: Stack, result: str) -> float:
    return metric(stack, RELOADS, f'result="{result}"', absent=0.0)


def info_hash(stack: Stack) -> str:
    (line,) = [
        line
        for line in stack.metrics_text().splitlines()
        if line.startswith("extproc_config_info{")
    ]
    return line.split('hash="', 1)[1].split('"', 1)[0]


def test_a_reload_under_load_keeps_the_views_and_an_invalid_one_is_refused(
    reload_stack: Stack, config_file: Path
) -> None:
    stack = reload_stack
    prefixes = [unique_prefix(), unique_prefix()]
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        warm = [
            send_and_wait_recorded(stack, client, "/v1/completions", completion(p, " Hi?"))
            for p in prefixes
        ]
        assert count(stack, "applied") == 1
        valid = PREFIX_CONFIG.read_text().replace("weight: 1", "weight: 3")
        assert valid != PREFIX_CONFIG.read_text()
        with background_load(stack.url, workers=2, max_s=60) as load:
            load.wait_for_answers(5)
            config_file.write_text(valid)
            wait_until(lambda: count(stack, "applied") == 2, 10, what="the valid file applied")
            assert info_hash(stack) == content_hash(valid)
            # The view was kept: each warm prefix still goes to the pod that holds it.
            for prefix, pod in zip(prefixes, warm, strict=True):
                reply = client.post("/v1/completions", json=completion(prefix, " Again?"))
                assert served_by(reply) == pod
            since = time.monotonic()
            load.wait_for_answers(5, since)
            config_file.write_text("scheduler:\n  plugins: [unclosed\n")
            wait_until(lambda: count(stack, "invalid") == 1, 10, what="the invalid file refused")
            assert metric(stack, "extproc_config_last_reload_success") == 0
            assert info_hash(stack) == content_hash(valid)  # the valid one stays in force
            reply = client.post("/v1/completions", json=completion(prefixes[0], " Still?"))
            assert served_by(reply) == warm[0]
            # SIGHUP loads the file again at once (refused again, counted, not fatal).
            os.kill(stack.extproc.pid, signal.SIGHUP)
            wait_until(lambda: count(stack, "invalid") == 2, 10, what="SIGHUP's reload")
            assert stack.extproc.alive()
            load.wait_for_answers(5, time.monotonic())
        statuses = load.statuses()
    assert set(statuses) == {200}, statuses  # no request failed across the reloads
    assert statuses.total() >= 15


def parse_log_line(line: str) -> dict[str, Any]:
    try:
        record: dict[str, Any] = orjson.loads(line)
    except orjson.JSONDecodeError as error:
        raise AssertionError(f"not a JSON log line ({error}): {line!r}") from None
    return record


def test_json_logs_parse_line_by_line_with_the_picks(reload_stack: Stack, sim: SimPods) -> None:
    stack = reload_stack

    def lines() -> list[dict[str, Any]]:
        text = stack.extproc.log_path.read_text()
        return [parse_log_line(line) for line in text.splitlines() if line.strip()]

    before = len(lines())  # no other request is sent meanwhile
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        reply = client.post("/v1/completions", json=completion(unique_prefix(), " Log me."))
        pod = served_by(reply)
    (pick,) = [r for r in lines()[before:] if "pick" in r]  # picked before the answer
    assert pick["logger"] == "extproc.picks" and pick["model"] == MODEL
    assert pick["x_request_id"] and names_by_address(sim)[pick["pick"]] == pod

    def ends() -> list[dict[str, Any]]:  # the access log may bring earlier requests' too
        return [r for r in lines() if r.get("x_request_id") == pick["x_request_id"]][1:]

    wait_until(ends, 10, what="the request's end line")
    records = lines()  # every line is one JSON object: loads would raise otherwise
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    (end,) = ends()
    assert end["succeeded"] is True and end["served_by"] == f"default/{pod}"
    # The reloads of the other test are there too, each on one line.
    assert any(r["logger"] == "extproc.reload" for r in records)
