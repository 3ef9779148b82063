"""``GET /`` on the admin port: a status page for people, as Envoy's admin page is.

Plain HTML rendered here on each request, no script and no build step; the browser
reloads it every ``REFRESH_S`` seconds (``<meta http-equiv="refresh">``). Every value
from outside (pod names, models, request ids, the configuration's path) goes through
``html.escape``. The page shows:

* the replica, its uptime and its scheduler configuration's source;
* per pod: model, role, readiness, the scraped load (waiting, running, KV usage, the
  scrape's age), the requests and tokens extproc has in flight there, the prefix view's
  blocks for the pod and the age of its last record, and the hit ratios side by side:
  *predicted* (the cached tokens the scheduler predicted over the prompt tokens of the
  requests the pod served, from ``RecentPicks``) and *reported* (the engine's own
  ``prefix_cache_hits`` over ``prefix_cache_queries`` since extproc first scraped it);
* the last picks (``RecentPicks``), newest first, with how each ended.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from extproc.admin.recent import DEFAULT_SIZE, Pick, PickEnd, Predicted, RecentPicks
from extproc.admin.server import AdminRequest, AdminResponse, AdminServer
from extproc.pods import Pod, PodMetrics

REFRESH_S = 5

_STYLE = """
:root { color-scheme: light; --line: #e3e6ea; --muted: #66707a; --bad: #b42318;
  --good: #067647; --bar: #4e79a7; }
* { box-sizing: border-box; }
body { margin: 0; padding: 20px 28px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI",
  Roboto, "DejaVu Sans", sans-serif; color: #1d2329; background: #f7f8fa; }
header { display: flex; align-items: baseline; gap: 28px; flex-wrap: wrap;
  margin-bottom: 18px; }
h1 { font-size: 20px; margin: 0; }
h2 { font-size: 15px; margin: 22px 0 8px; }
dl { display: flex; gap: 22px; margin: 0; flex-wrap: wrap; }
dt { color: var(--muted); font-size: 12px; }
dd { margin: 0; font-weight: 600; }
table { border-collapse: collapse; width: 100%; background: #fff;
  border: 1px solid var(--line); border-radius: 6px; }
th, td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: left;
  white-space: nowrap; }
th { font-size: 12px; font-weight: 600; color: var(--muted); background: #fbfbfc; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr:last-child td { border-bottom: 0; }
.sub { color: var(--muted); font-size: 12px; }
.ok { color: var(--good); font-weight: 600; }
.bad { color: var(--bad); font-weight: 600; }
.bar { display: inline-block; width: 60px; height: 8px; margin-right: 6px;
  background: var(--line); border-radius: 4px; vertical-align: middle; overflow: hidden; }
.bar > span { display: block; height: 100%; background: var(--bar); }
.empty { color: var(--muted); padding: 10px; }
.scroll { overflow-x: auto; }
.id { font: 12px ui-monospace, "DejaVu Sans Mono", monospace; }
footer { margin-top: 20px; color: var(--muted); font-size: 12px; }
footer a { color: inherit; }
"""


@dataclass(frozen=True, slots=True)
class Header:
    replica: str
    uptime_s: float
    config_source: str
    facts: tuple[tuple[str, str], ...] = ()  # further (label, value) pairs, e.g. flow control


@dataclass(frozen=True, slots=True)
class PodRow:
    """One pod's line; ``None``: not known (not scraped, no view, no traffic yet)."""

    id: str
    address: str
    models: str
    role: str
    ready: bool
    waiting: int | None
    running: int | None
    kv_usage: float | None  # 0-1
    scrape_age_s: float | None
    in_flight: int
    in_flight_tokens: int
    view_blocks: int | None
    view_age_s: float | None  # since the view's last record for this pod
    view_name: str  # the plugin whose view it is ("" without one)
    view_stale: bool  # distrusted now (precise-prefix-cache after lost events)
    predicted_ratio: float | None
    predicted_prompt_tokens: int
    reported_ratio: float | None
    reported_queries: float | None


def add_status_page(admin: AdminServer, num_picks: int = DEFAULT_SIZE) -> RecentPicks:
    """Serve the page as ``GET /`` on ``admin``, its ``RecentPicks`` on the router's
    observers (only while the admin port is on: it costs an append per request)."""
    recent = RecentPicks(num_picks)
    admin.router.observers.append(recent)

    def page(_request: AdminRequest) -> AdminResponse:
        return AdminResponse.html(status_page(admin.pods_state(), admin.router.pods, recent))

    admin.add_route("GET", "/", page)
    return recent


def status_page(state: Mapping[str, Any], pods: Sequence[Pod], recent: RecentPicks) -> str:
    """The page from ``admin.state.pods_state`` (its documented keys), the pods' scraped
    metrics (the engines' prefix-cache counters) and ``recent``."""
    metrics = {str(p.id): p.metrics for p in pods}
    predicted = {str(pod): tally for pod, tally in recent.predicted().items()}
    rows = [
        pod_row(pod, metrics.get(pod["id"]), predicted.get(pod["id"], Predicted()))
        for pod in state["pods"]
    ]
    flow = state["flow_control"]
    facts = (
        ("flow control", f"on, {flow['held']} held" if flow["enabled"] else "off"),
        ("requests in flight", str(state["pending"])),
    )
    header = Header(state["replica"], state["uptime_s"], state["config_source"], facts)
    return render_status(header, rows, recent.recent())


def pod_row(pod: Mapping[str, Any], metrics: PodMetrics | None, predicted: Predicted) -> PodRow:
    """One pod of ``pods_state``; of several prefix views, the one holding most blocks."""
    load, flight = pod["load"], pod["in_flight"]
    scraped = load["scrape_age_s"] is not None
    views = sorted(pod["views"].items(), key=lambda kv: kv[1]["blocks"], reverse=True)
    view_name, view = views[0] if views else ("", None)
    hits = metrics.prefix_cache_hits if metrics else None
    queries = metrics.prefix_cache_queries if metrics else None
    return PodRow(
        id=pod["id"],
        address=pod["address"],
        models=", ".join(pod["models"]),
        role=pod["role"],
        ready=pod["ready"],
        waiting=load["waiting"] if scraped else None,
        running=load["running"] if scraped else None,
        kv_usage=load["kv_usage"] if scraped else None,
        scrape_age_s=load["scrape_age_s"],
        in_flight=flight["requests"],
        in_flight_tokens=flight["tokens"],
        view_blocks=view["blocks"] if view else None,
        view_age_s=view["last_record_age_s"] if view else None,
        view_name=view_name,
        view_stale=bool(view and view["stale"]),
        predicted_ratio=predicted.ratio,
        predicted_prompt_tokens=predicted.prompt_tokens,
        reported_ratio=hits / queries if hits is not None and queries else None,
        reported_queries=queries,
    )


def render_status(
    header: Header,
    pods: Sequence[PodRow],
    picks: Sequence[tuple[Pick, PickEnd | None]],
) -> str:
    """The whole page."""
    ready = sum(p.ready for p in pods)
    facts = (
        ("replica", header.replica),
        ("uptime", _duration(header.uptime_s)),
        ("configuration", header.config_source),
        ("pods ready", f"{ready} of {len(pods)}"),
        *header.facts,
    )
    return "".join(
        (
            '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="refresh" content="{REFRESH_S}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            '<link rel="icon" href="data:,">',  # no /favicon.ico request
            f"<title>extproc {escape(header.replica)}</title><style>{_STYLE}</style></head>",
            "<body><header><h1>extproc status</h1><dl>",
            "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>" for k, v in facts),
            "</dl></header>",
            "<h2>Pods</h2>",
            _pods_table(pods),
            f"<h2>Recent picks <span class='sub'>(last {len(picks)}, newest first)</span></h2>",
            _picks_table(picks),
            "<footer>Refreshed every ",
            f"{REFRESH_S} s. JSON: <a href='/debug/pods'>/debug/pods</a>, ",
            "<a href='/debug/config'>/debug/config</a>.</footer></body></html>\n",
        )
    )


_POD_COLUMNS = (
    ("Pod", ""),
    ("Model", ""),
    ("Role", ""),
    ("Ready", ""),
    ("Waiting", "n"),
    ("Running", "n"),
    ("KV usage", ""),
    ("Scraped", "n"),
    ("In flight", "n"),
    ("Prefill tokens in flight", "n"),
    ("View blocks", "n"),
    ("Last record", "n"),
    ("Hit ratio predicted", "n"),
    ("Hit ratio reported", "n"),
)


def _pods_table(pods: Sequence[PodRow]) -> str:
    if not pods:
        return "<table><tr><td class='empty'>No pods.</td></tr></table>"
    return _table(_POD_COLUMNS, [_pod_cells(p) for p in pods], "pods")


def _pod_cells(p: PodRow) -> list[str]:
    return [
        f"<span data-pod='{escape(p.id)}'>{escape(p.id)}</span>"
        + f"<div class='sub'>{escape(p.address)}</div>",
        escape(p.models),
        escape(p.role),
        "<span class='ok'>yes</span>" if p.ready else "<span class='bad'>no</span>",
        _num(p.waiting),
        _num(p.running),
        _usage(p.kv_usage),
        _age(p.scrape_age_s),
        str(p.in_flight),
        str(p.in_flight_tokens),
        _view(p),
        _age(p.view_age_s),
        _ratio(p.predicted_ratio, f"{p.predicted_prompt_tokens} prompt tokens"),
        _ratio(
            p.reported_ratio,
            "" if p.reported_queries is None else f"{p.reported_queries:.0f} queried tokens",
        ),
    ]


_PICK_COLUMNS = (
    ("Time (UTC)", ""),
    ("Request id", ""),
    ("Model", ""),
    ("Pick", ""),
    ("Fallbacks", ""),
    ("Prompt tokens", "n"),
    ("Predicted cached", "n"),
    ("Queued", "n"),
    ("Preparing", "n"),
    ("Served by", ""),
    ("Outcome", ""),
    ("Duration", "n"),
)


def _picks_table(picks: Sequence[tuple[Pick, PickEnd | None]]) -> str:
    if not picks:
        return "<table><tr><td class='empty'>No request routed yet.</td></tr></table>"
    return _table(_PICK_COLUMNS, [_pick_cells(p, e) for p, e in picks], "picks")


def _pick_cells(pick: Pick, end: PickEnd | None) -> list[str]:
    first, *rest = pick.pods or ("",)
    tokens = f"{pick.prompt_tokens}" + ("" if pick.exact else " <span class='sub'>est.</span>")
    return [
        time.strftime("%H:%M:%S", time.gmtime(pick.at_unix_s)),
        f"<span class='id'>{escape(pick.request_id or '—')}</span>",
        escape(pick.model),
        escape(str(first)),
        f"<span class='sub'>{escape(', '.join(map(str, rest))) or '—'}</span>",
        tokens,
        str(pick.predicted_cached_tokens),
        f"{pick.queued_s * 1000:.0f} ms",
        f"{pick.preparing_s * 1000:.1f} ms",
        "—" if end is None or end.served_by is None else escape(str(end.served_by)),
        _outcome(end),
        "—" if end is None or end.duration_s is None else f"{end.duration_s * 1000:.0f} ms",
    ]


def _outcome(end: PickEnd | None) -> str:
    if end is None:
        return "<span class='sub'>in flight</span>"
    tries = "" if end.attempts <= 1 else f" <span class='sub'>({end.attempts} attempts)</span>"
    verdict = "<span class='ok'>ok</span>" if end.succeeded else "<span class='bad'>failed</span>"
    return verdict + tries


def _table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], name: str) -> str:
    head = "".join(f"<th class='{cls}'>{escape(title)}</th>" for title, cls in columns)
    body = "".join(
        "<tr>"
        + "".join(f"<td class='{c}'>{cell}</td>" for (_, c), cell in zip(columns, row, strict=True))
        + "</tr>"
        for row in rows
    )
    return (
        f"<div class='scroll'><table id='{name}'><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


def _view(p: PodRow) -> str:
    stale = " <span class='bad'>stale</span>" if p.view_stale else ""
    name = f"<div class='sub'>{escape(p.view_name)}</div>" if p.view_name else ""
    return _num(p.view_blocks) + stale + name


def _num(value: int | None) -> str:
    return "—" if value is None else str(value)


def _usage(value: float | None) -> str:
    if value is None:
        return "—"
    pct = 100 * min(1.0, max(0.0, value))
    return f"<span class='bar'><span style='width:{pct:.0f}%'></span></span>{pct:.0f}%"


def _ratio(value: float | None, basis: str) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f}%<div class='sub'>{escape(basis)}</div>"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else _duration(seconds)


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
