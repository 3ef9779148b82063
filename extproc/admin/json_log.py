"""``--log-format json``: one JSON object a line (time, level, logger, message and the
record's ``extra`` fields; an exception as one ``exception`` string field).

Hand-written on orjson (already a dependency, and the fastest encoder here) rather than
python-json-logger: it is these few lines.

What reaches file descriptor 2 from outside logging (gRPC's C core logs there itself, in
absl's format; a library may print) becomes a record too (``StderrRecords``), so that
every line is JSON.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import types
from datetime import UTC, datetime
from typing import IO, Any

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


# absl's line, as gRPC's C core writes it: "I1206 04:41:34.607103    7713 file.cc:1403] text".
_ABSL_LINE = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ ([^\]\s]+)\] ?(.*)")
_ABSL_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_JOIN_S = 2.0


def log_stderr_line(line: str) -> None:
    """One line written to fd 2 outside logging, as a record: an absl line on logger
    ``grpc`` at its own level (``source``: the C file and line), any other on ``stderr``."""
    if not line.strip():
        return
    absl = _ABSL_LINE.match(line)
    if absl is None:
        logging.getLogger("stderr").warning(line)
    else:
        level, source, text = absl.groups()
        logging.getLogger("grpc").log(_ABSL_LEVELS[level], text, extra={"source": source})


class StderrRecords:
    """File descriptor 2 becomes a pipe whose lines a thread logs (``log_stderr_line``);
    ``stream`` writes to the original stderr, for the log handler. By hand: no library
    turns a C library's own stderr writes into records."""

    def __init__(self) -> None:
        self._original_fd = os.dup(2)
        self.stream: IO[str] = os.fdopen(
            os.dup(self._original_fd), "w", buffering=1, encoding="utf-8", errors="replace"
        )
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = threading.Thread(
            target=self._read, args=(read_fd,), name="stderr-records", daemon=True
        )
        self._reader.start()

    @staticmethod
    def _read(read_fd: int) -> None:
        with open(read_fd, "rb") as pipe:
            for raw in pipe:
                log_stderr_line(raw.decode(errors="replace").rstrip("\r\n"))

    def close(self) -> None:
        """fd 2 back to the original, then the pipe's last lines logged: none is lost."""
        os.dup2(self._original_fd, 2)
        os.close(self._original_fd)
        self._reader.join(_JOIN_S)


def log_uncaught(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: a thread's uncaught exception as one record (the default
    prints the traceback over many lines)."""
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    exc_info: tuple[type[BaseException], BaseException, types.TracebackType | None] = (
        args.exc_type,
        args.exc_value,
        args.exc_traceback,
    )
    logging.getLogger("extproc").critical("uncaught in thread %s", name, exc_info=exc_info)
