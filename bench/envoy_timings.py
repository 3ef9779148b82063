"""Where a slow request spent its time, from Envoy's own clock: a file access log.

``bench.replay`` tags each request with its index (``REQUEST_HEADER``); the Envoy +
extproc contenders add a file access log (``timing_log``) that writes, per request, the
index, the pod, the upstream attempts and response flags, and two spans:

* ``picker_ms``: the request fully received to its first byte sent upstream: ext_proc
  (extproc's pick) plus the upstream connection, if a new one was opened;
* ``pod_ms``: the request sent upstream to the pod's first response byte, its headers (a
  streaming server may send them before its first token; the rest of the TTFT is then the
  pod's too).

So a stall in a run's slowest requests can be told apart: the picker, the pod, or a retry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUEST_HEADER = "x-bench-request"
LOG_NAME = "envoy-timings.log"  # in a run's log directory
FILE_LOGGER = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
HCM = (
    "type.googleapis.com/envoy.extensions.filters.network"
    ".http_connection_manager.v3.HttpConnectionManager"
)
FORMAT = (
    f"%REQ({REQUEST_HEADER.upper()})% %UPSTREAM_HOST% %UPSTREAM_REQUEST_ATTEMPT_COUNT% "
    "%RESPONSE_FLAGS% %COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)% "
    "%COMMON_DURATION(US_TX_END:US_RX_BEG:ms)%\n"
)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    pod: str
    attempts: int
    flags: str  # Envoy's response flags, "-" for none
    picker_ms: int | None
    pod_ms: int | None


def http_managers(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The HTTP connection managers of a bootstrap's static listeners, to edit in place."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["typed_config"].get("@type") == HCM:
                    yield f["typed_config"]


def timing_log(path: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An ``envoy_transform`` adding the timing log at ``path`` to every HTTP listener."""

    def transform(config: dict[str, Any]) -> dict[str, Any]:
        for manager in http_managers(config):
            manager.setdefault("access_log", []).append({
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": FILE_LOGGER, "path": str(path),
                    "log_format": {"text_format_source": {"inline_string": FORMAT}},
                },
            })  # fmt: skip
        return config

    return transform


def _ms(field: str) -> int | None:
    return None if field == "-" else int(field)


def read_timings(path: Path) -> dict[int, RequestTiming]:
    """The timing log's lines by request index; untagged or malformed lines are skipped
    (Envoy writes "-" for a value it does not have)."""
    if not path.exists():
        return {}
    out: dict[int, RequestTiming] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) != 6 or not fields[0].isdigit():
            continue
        try:
            attempts = int(fields[2]) if fields[2] != "-" else 0
            out[int(fields[0])] = RequestTiming(
                fields[1], attempts, fields[3], _ms(fields[4]), _ms(fields[5])
            )
        except ValueError:
            continue
    return out
