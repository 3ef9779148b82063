"""``extproc explain``: where a running extproc would send a request now, and why.

Posts the request to the admin port's ``/debug/pick`` (``serve --admin-port``) and
prints its answer as a table a person reads: a row per pod with the filters' verdict,
each scorer's score and weight, the total, the predicted cached tokens, the cost model's
terms and the rank; ``--json`` prints the answer as it came. Nothing is routed: the
server records, credits and counts nothing for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from extproc.cli import CLI_REFERENCE

DESCRIPTION = f"""\
Ask a running extproc (its admin port: serve --admin-port) where it would send a request
now, and why: every pod's filter verdict, scores, total, predicted cached tokens and cost
terms, and the order. Nothing is recorded or counted on the server.

Most common:
  extproc explain body.json --admin http://127.0.0.1:9901
  extproc explain '{{"model": "m", "prompt": "Hello"}}' --path /v1/completions --admin URL
  extproc explain - --header x-session-id:abc --admin URL < body.json

BODY is a file, - for standard input, or the JSON itself. Documentation:
docs/operations/admin.md (every flag in {CLI_REFERENCE})."""

# The cost terms shown as columns, in this order, when a pod has them (the rest: --json).
COST_COLUMNS = (
    ("queued", "queued"),
    ("uncached_tokens", "uncached"),
    ("prefill_ms", "prefill ms"),
    ("queued_ms", "queue ms"),
    ("running_ms", "running ms"),
    ("decode_ms", "decode ms"),
    ("write_ms", "write ms"),
    ("session_ms", "session ms"),
    ("affinity", "affinity"),
    ("cost_ms", "cost ms"),
)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "explain",
        help="show where a running extproc would send a request, and why (its admin port)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("body", metavar="BODY", help="the request body: a file, - (stdin), or JSON")
    p.add_argument(
        "--admin",
        default=os.environ.get("EXTPROC_ADMIN_URL"),
        help="the admin port's URL, e.g. http://127.0.0.1:9901 (default: $EXTPROC_ADMIN_URL)",
    )
    p.add_argument(
        "--path",
        default="/v1/chat/completions",
        help="the request's path, which selects the API (default: %(default)s)",
    )
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a request header, e.g. x-session-id:abc (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print /debug/pick's JSON answer as is")
    p.add_argument(
        "--timeout-s", type=float, default=10.0, help="seconds to wait (default: %(default)s)"
    )
    p.set_defaults(func=run)


class UsageError(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        if not args.admin:
            raise UsageError("--admin URL is required (or $EXTPROC_ADMIN_URL)")
        request = {"path": args.path, "headers": _headers(args.header), "body": _body(args.body)}
        _, answer = post(args.admin, request, args.timeout_s)
    except UsageError as exc:
        print(f"extproc explain: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(render(answer), end="")
    return 0 if "passes" in answer else 1  # explained (a refusal too), or the port refused


def _headers(items: list[str]) -> dict[str, str]:
    headers = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"--header {item!r}: expected NAME:VALUE")
        headers[name.strip().lower()] = value.strip()
    return headers


def _body(text: str) -> Any:
    """The body as JSON (a string when it is not JSON: the server says why it refuses)."""
    if text == "-":
        raw = sys.stdin.read()
    elif text.lstrip().startswith(("{", "[")):
        raw = text
    else:
        try:
            raw = Path(text).read_text("utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read {text}: {exc.strerror or exc}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def post(admin: str, request: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    """``/debug/pick``'s status and JSON answer."""
    url = admin.rstrip("/") + "/debug/pick"
    data = json.dumps(request).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            status, text = reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(
            f"cannot reach the admin port at {admin}: {reason} (is extproc serving with "
            "--admin-port, and is the URL right?)"
        ) from None
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"{url} answered {status} with something other than JSON") from None
    if not isinstance(answer, dict):
        raise UsageError(f"{url} answered {status} with unexpected JSON")
    return status, answer


def render(answer: dict[str, Any]) -> str:
    """The answer as text: a summary, then a row per pod."""
    if "error" in answer and "model" not in answer:
        return _render_error(answer)
    exact = "exact" if answer["exact"] else "estimated"
    summary = f"model {answer['model']} ({answer['api']}), prompt {answer['prompt_tokens']}"
    lines = [
        f"{summary} tokens ({exact})",
        f"pick {answer['pick']}"
        + (f", then {', '.join(answer['fallbacks'])}" if answer["fallbacks"] else "")
        + (f"; prefill on {answer['prefill']}" if answer.get("prefill") else "")
        + (" (session sticky: pinned, not scored)" if answer.get("pinned") else ""),
        _flow_line(answer.get("flow_control") or {}),
        "",
    ]
    lines += _table(answer["pods"])
    for group in answer.get("ties", []):
        lines.append(
            f"tie: {', '.join(group)} score and load alike; their order is drawn at random"
        )
    return "\n".join(lines) + "\n"


def _flow_line(flow: dict[str, Any]) -> str:
    if not flow.get("enabled"):
        return "flow control: off"
    verdict = "would hold it (saturated)" if flow.get("would_hold") else "would admit it now"
    return f"flow control: {verdict}; priority {flow.get('priority')}, {flow.get('held_now')} held"


def _table(pods: list[dict[str, Any]]) -> list[str]:
    scorers = list(dict.fromkeys(name for p in pods for name in p["scores"]))
    plugins = list(dict.fromkeys(name for p in pods for name in p["cost"]))
    costs = [
        (plugin, key, label if len(plugins) == 1 else f"{plugin} {label}")
        for plugin in plugins
        for key, label in COST_COLUMNS
        if any(key in p["cost"].get(plugin, {}) for p in pods)
    ]
    header = ["rank", "pod", "verdict", *scorers, "total", "cached", *(c[2] for c in costs)]
    rows = [header]
    for p in pods:
        verdict = "kept" if p["verdict"] == "kept" else f"removed by {p['removed_by']}"
        cells = [str(p["rank"]) if p["rank"] is not None else "-", p["id"], verdict]
        for name in scorers:
            s = p["scores"].get(name)
            cells.append(f"{s['score']} x{s['weight']}" if s else "-")
        cells += [_num(p["total"]), _num(p["predicted_cached_tokens"])]
        for plugin, key, _ in costs:
            cells.append(_num(p["cost"].get(plugin, {}).get(key)))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    left = {1, 2}  # pod and verdict read left to right; numbers align right
    return [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.1f}"
    return str(int(value))


def _render_error(answer: dict[str, Any]) -> str:
    if "passes" not in answer:  # the admin port's own refusal, not the router's
        return f"the admin port answered {answer.get('status')}: {answer['error']}\n"
    lines = [f"extproc would answer {answer.get('status')}: {answer['error']}"]
    for p in answer.get("passes", []):
        for f in p["filters"]:
            if f["removed"]:
                lines.append(f"  {p['role']}: {f['name']} removed {', '.join(f['removed'])}")
    return "\n".join(lines) + "\n"
