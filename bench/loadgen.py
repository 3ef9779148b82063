"""The load of the proxy benchmark: ``wrk`` POSTing chat requests over many distinct prefixes.

Workload: ``num_prefixes`` tenants share one chat request shape of ``prompt_bytes``
bytes: a system prompt that opens with the tenant's number (``Tenant 000042.``) and
goes on with the same filler text, then the same short user question. The number sits
in the first 64-byte block, so two tenants share no prefix block and each tenant is one
distinct prefix (up to the 128 blocks x 64 bytes = 8 KB that extproc hashes).

The wrk Lua script builds each body from the two halves around the number:

- ``warm``: thread ``t`` of ``T`` sends tenants ``offset + t, offset + t + T, ...`` in
  order, so a run of ``n`` requests covers ``min(n, num_prefixes)`` tenants once each;
- ``random``: each request picks a tenant uniformly at random (the measured load).

Every run is bounded by wrk's ``-d`` and a subprocess timeout.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.upstreams import MODEL

PATH = "/v1/chat/completions"
ID_MARK = "@@TENANT@@"
ID_FORMAT = "%06d"
WRK_GRACE_S = 30  # beyond -d: wrk's start, its last responses, the report

LUA = """\
wrk.method = "POST"
wrk.path = "%(path)s"
wrk.headers["Content-Type"] = "application/json"
local next_idx = 0
local head, tail, num_prefixes, mode, offset, num_threads
local sent = 0

function setup(thread)
  thread:set("thread_idx", next_idx)
  next_idx = next_idx + 1
end

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("*all")
  f:close()
  return data
end

function init(args)
  head, tail = slurp(args[1]), slurp(args[2])
  num_prefixes, mode, offset = tonumber(args[3]), args[4], tonumber(args[5])
  num_threads = tonumber(args[6])
  math.randomseed(os.time() + thread_idx)
end

function request()
  local i
  if mode == "warm" then
    i = (offset + thread_idx + sent * num_threads) %% num_prefixes
  else
    i = math.random(num_prefixes) - 1
  end
  sent = sent + 1
  return wrk.format(nil, nil, nil, head .. string.format("%(id_format)s", i) .. tail)
end
"""


@dataclass(frozen=True, slots=True)
class Workload:
    """A wrk script and the two halves of the body around the tenant number."""

    script: Path
    head: Path
    tail: Path
    num_prefixes: int
    prompt_bytes: int


@dataclass(frozen=True, slots=True)
class Load:
    """How hard: wrk threads and connections, for how long."""

    threads: int
    connections: int
    seconds: int  # wrk takes whole seconds


def chat_body(prompt_bytes: int) -> bytes:
    """A chat request of about ``prompt_bytes`` bytes with ``ID_MARK`` opening the prompt."""
    opening = f"Tenant {ID_MARK}. "
    filler = "You are a careful assistant for the support team. " * (prompt_bytes // 50 + 1)
    system = opening + filler[: max(prompt_bytes - 200, 0)]
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": "How do I reset my password?"}],
         "max_tokens": 16}
    )  # fmt: skip


def make_workload(prompt_bytes: int, num_prefixes: int, out_dir: Path) -> Workload:
    """Write the body halves and the wrk Lua script into ``out_dir``."""
    head, tail = chat_body(prompt_bytes).split(ID_MARK.encode())
    name = f"chat-{prompt_bytes}"
    paths = [out_dir / f"{name}.{part}" for part in ("head", "tail")]
    paths[0].write_bytes(head)
    paths[1].write_bytes(tail)
    script = out_dir / "chat.lua"
    script.write_text(LUA % {"path": PATH, "id_format": ID_FORMAT})
    return Workload(script, paths[0], paths[1], num_prefixes, prompt_bytes)


def run_wrk(
    url: str, workload: Workload, load: Load, mode: str = "random", offset: int = 0
) -> dict[str, float]:
    """One wrk run; returns req/s, requests, non-2xx count, p50 and p99 in ms."""
    argv = [
        "wrk", f"-t{load.threads}", f"-c{load.connections}", f"-d{load.seconds}s", "--latency",
        "-s", str(workload.script), url,
        "--", str(workload.head), str(workload.tail), str(workload.num_prefixes), mode, str(offset),
        str(load.threads),
    ]  # fmt: skip
    out = subprocess.run(
        argv, capture_output=True, text=True, check=True, timeout=load.seconds + WRK_GRACE_S
    ).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> dict[str, float]:
    """wrk's report (``--latency``) -> rps, requests, non_2xx, errors, p50_ms, p99_ms."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    lat = {k: _ms(v) for k, v in re.findall(r"^\s*(50|99)(?:\.0+)?%\s+(\S+)", out, re.MULTILINE)}
    if not rps or not total or set(lat) != {"50", "99"}:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(rps.group(1)),
        "requests": int(total.group(1)),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(int(n) for n in errors.groups()) if errors else 0,
        "p50_ms": lat["50"],
        "p99_ms": lat["99"],
    }


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return round(float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 3)
