"""bench.envoy_timings: the timing log Envoy writes for the benchmark, and what reads it."""

from __future__ import annotations

import json
from pathlib import Path

from bench.envoy_timings import FORMAT, RequestTiming, read_timings, timing_log
from bench.replay import Outcome
from bench.routing_quality import slowest
from tests.envoyconf.support import bootstrap, hcm, validate


def test_the_log_is_added_to_the_http_listener_and_envoy_accepts_it(tmp_path: Path) -> None:
    config = timing_log(tmp_path / "t.log")(bootstrap())
    [logger] = [a for a in hcm(config)["access_log"] if a["name"] == "envoy.access_loggers.file"]
    assert logger["typed_config"]["path"] == str(tmp_path / "t.log")
    assert logger["typed_config"]["log_format"]["text_format_source"]["inline_string"] == FORMAT
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    validate(path)


def test_lines_are_read_by_request_index_and_dashes_are_unknown(tmp_path: Path) -> None:
    log = tmp_path / "t.log"
    log.write_text(
        "3 127.0.0.1:8001 1 - 2 35\n"
        "7 127.0.0.1:8002 2 URX - -\n"
        "- 127.0.0.1:8001 1 - 1 4\n"  # a request without the header (a start-up probe)
        "9 127.0.0.1:8001 one - 1 4\n"  # malformed
        "short line\n"
    )
    assert read_timings(log) == {
        3: RequestTiming("127.0.0.1:8001", 1, "-", 2, 35),
        7: RequestTiming("127.0.0.1:8002", 2, "URX", None, None),
    }
    assert read_timings(tmp_path / "absent.log") == {}


def test_slowest_says_where_the_time_went_when_envoy_timed_it() -> None:
    outcomes = [Outcome(True, 2.1, 3.0, 4, at_s=16.5, index=5),
                Outcome(True, 0.05, 1.0, 4, at_s=1.0, index=6),
                Outcome(True, 0.9, 1.0, 4, at_s=2.0, index=None)]  # fmt: skip
    timings = {5: RequestTiming("127.0.0.1:8001", 1, "-", 2040, 12)}
    assert slowest(outcomes, 2, timings) == [
        {"at_s": 16.5, "ttft_ms": 2100.0, "pod": "127.0.0.1:8001", "attempts": 1,
         "flags": "-", "picker_ms": 2040, "pod_ms": 12},
        {"at_s": 2.0, "ttft_ms": 900.0},
    ]  # fmt: skip
