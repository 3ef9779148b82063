"""``--log-format json``: one JSON object a line (time, level, logger, message and the
record's ``extra`` fields; an exception as one ``exception`` string field).

Hand-written on orjson (already a dependency, and the fastest encoder here) rather than
python-json-logger: it is these few lines.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

# A record's own attributes: every other one came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON; never more than one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()
