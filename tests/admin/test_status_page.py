"""The status page's HTML: every pod, values escaped, no script, unknowns shown as such."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from prometheus_client import CollectorRegistry

from extproc.admin.recent import Pick, PickEnd, RecentPicks
from extproc.admin.server import AdminRequest, AdminServer
from extproc.admin.status_page import (
    REFRESH_S,
    Header,
    PodRow,
    add_status_page,
    render_status,
    status_page,
)
from extproc.pods import PodId, PodMetrics
from extproc.routing.observe import Ended
from extproc.routing.router import Router
from testkit.factories import PREFIX_ONLY, make_pod, make_scheduler

HOSTILE = "<script>alert(1)</script>"


class Page(HTMLParser):
    """Tags, the pods named by ``data-pod``, and each table's cell texts by row."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.pods: list[str | None] = []
        self.rows: dict[str, list[list[str]]] = {}
        self._table = ""
        self._in_cell = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        self.tags.append((tag, named))
        if "data-pod" in named:
            self.pods.append(named["data-pod"])
        if tag == "table":
            self._table = named.get("id") or ""
        elif tag == "tr":
            self.rows.setdefault(self._table, []).append([])
        elif tag == "td":
            self._in_cell = True
            self.rows[self._table][-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[self._table][-1][-1] += data


def row(pod_id: str, **changes: object) -> PodRow:
    values: dict[str, object] = {
        "id": pod_id,
        "address": "127.0.0.1:8000",
        "models": "m",
        "role": "both",
        "ready": True,
        "waiting": 1,
        "running": 2,
        "kv_usage": 0.25,
        "scrape_age_s": 0.1,
        "in_flight": 3,
        "in_flight_tokens": 4096,
        "view_blocks": 120,
        "view_age_s": 2.5,
        "view_name": "prefix-cache",
        "view_stale": False,
        "predicted_ratio": 0.5,
        "predicted_prompt_tokens": 1000,
        "reported_ratio": 0.4375,
        "reported_queries": 800.0,
    }
    return PodRow(**values | changes)  # type: ignore[arg-type]


HEADER = Header("replica-1", 3725.0, "/etc/extproc/config.yaml", (("flow control", "on"),))


def test_every_pod_is_on_the_page_with_its_figures() -> None:
    page = Page(render_status(HEADER, [row("default/a"), row("default/b", ready=False)], []))
    assert page.pods == ["default/a", "default/b"]
    (a, b) = page.rows["pods"][1:]
    assert a[:7] == ["default/a127.0.0.1:8000", "m", "both", "yes", "1", "2", "25%"]
    assert a[-2:] == ["50.0%1000 prompt tokens", "43.8%800 queried tokens"]
    assert b[3] == "no"


def test_unknown_values_are_dashes() -> None:
    unknown = row(
        "default/a",
        waiting=None,
        running=None,
        kv_usage=None,
        scrape_age_s=None,
        view_blocks=None,
        view_age_s=None,
        view_name="",
        predicted_ratio=None,
        reported_ratio=None,
        reported_queries=None,
    )
    (cells,) = Page(render_status(HEADER, [unknown], [])).rows["pods"][1:]
    assert [cells[i] for i in (4, 5, 6, 7, 10, 11, 12, 13)] == ["—"] * 8


def test_outside_values_are_escaped_and_the_page_has_no_script() -> None:
    pick = Pick(0.0, HOSTILE, HOSTILE, (PodId("ns", HOSTILE),), 10, 0, True, 0.0, 0.0)
    html = render_status(
        Header(HOSTILE, 1.0, HOSTILE), [row(HOSTILE, models=HOSTILE)], [(pick, None)]
    )
    page = Page(html)
    assert "script" not in [tag for tag, _ in page.tags]
    assert page.pods == [HOSTILE]  # shown as text
    assert page.rows["picks"][1][1] == HOSTILE


def test_the_browser_refreshes_the_page_and_asks_for_no_favicon() -> None:
    tags = Page(render_status(HEADER, [], [])).tags
    assert ("meta", {"http-equiv": "refresh", "content": str(REFRESH_S)}) in tags
    assert ("link", {"rel": "icon", "href": "data:,"}) in tags


def test_recent_picks_show_pick_fallbacks_and_how_they_ended() -> None:
    a, b = PodId("default", "a"), PodId("default", "b")
    ended = Pick(0.0, "r1", "m", (a, b), 800, 512, False, 0.02, 0.0015)
    open_ = Pick(1.0, "r2", "m", (b,), 100, 0, True, 0.0, 0.0)
    picks = [(open_, None), (ended, PickEnd(b, True, 2, 0.75))]
    rows = Page(render_status(HEADER, [], picks)).rows["picks"][1:]
    assert rows[0][1:] == ["r2", "m", "default/b", "—", "100", "0", "0 ms", "0.0 ms", "—",
                           "in flight", "—"]  # fmt: skip
    assert rows[1][0] == "00:00:00"
    assert rows[1][3:] == ["default/a", "default/b", "800 est.", "512", "20 ms", "1.5 ms",
                           "default/b", "ok (2 attempts)", "750 ms"]  # fmt: skip


def pod_state(
    name: str, *, scraped: bool = True, views: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One pod as ``admin.state.pods_state`` gives it."""
    return {
        "id": f"default/{name}",
        "address": "127.0.0.1:8000",
        "models": ["m", "n"],
        "role": "both",
        "ready": True,
        "load": {
            "waiting": 2,
            "running": 5,
            "kv_usage": 0.5,
            "scrape_age_s": 0.2 if scraped else None,
        },
        "in_flight": {"requests": 1, "tokens": 300},
        "views": {} if views is None else views,
        "kv_events": None,
    }


def test_the_page_joins_pods_state_the_scraped_counters_and_the_recent_picks() -> None:
    a, b = (
        make_pod("a"),
        make_pod("b", metrics=PodMetrics(prefix_cache_hits=30, prefix_cache_queries=120)),
    )
    views = {
        "prefix-cache": {"blocks": 7, "last_record_age_s": 1.5, "stale": False},
        "precise-prefix-cache": {"blocks": 9, "last_record_age_s": 0.5, "stale": True},
    }
    state = {
        "replica": "r-1",
        "config_source": "config.yaml",
        "uptime_s": 61.0,
        "pending": 4,
        "flow_control": {"enabled": True, "held": 2},
        "pods": [pod_state("a", scraped=False), pod_state("b", views=views)],
    }
    recent = RecentPicks()
    recent.ended(
        Ended("r", "m", b.id, True, 1, None, prompt_tokens=200, predicted_cached_tokens=50)
    )
    html = status_page(state, [a, b], recent)
    page = Page(html)
    assert page.pods == ["default/a", "default/b"]
    (row_a, row_b) = page.rows["pods"][1:]
    assert row_a[4:8] == ["—"] * 4  # never scraped: no load shown as zeros
    assert row_a[-2:] == ["—", "—"]  # no prediction, no counters
    assert row_b[1] == "m, n" and row_b[4:7] == ["2", "5", "50%"]
    assert row_b[8:12] == ["1", "300", "9 staleprecise-prefix-cache", "500 ms"]  # the larger view
    assert row_b[-2:] == ["25.0%200 prompt tokens", "25.0%120 queried tokens"]
    assert "on, 2 held" in html and "1 min 1 s" in html


def test_get_slash_serves_the_page_of_a_real_router_with_its_picks() -> None:
    """``add_status_page`` puts its observer on the router: a routed and completed
    request shows in the picks and in the serving pod's predicted ratio."""
    pods = [make_pod(f"p{i}", port=8000 + i) for i in range(3)]
    router = Router(make_scheduler(PREFIX_ONLY), pods, registry=CollectorRegistry())
    admin = AdminServer(router, config_source="t.yaml")
    recent = add_status_page(admin)
    assert recent in router.observers
    body = b'{"model": "m", "prompt": "' + b"hello there " * 50 + b'"}'
    for request_id in ("r1", "r2"):  # the second is predicted cached on the first's pod
        decision = router.route("/v1/completions", body, request_id=request_id)
        router.complete(request_id, decision.pods[0].address, succeeded=True)
    answer = admin.handle(AdminRequest("GET", "/", {}, {}, b""))
    assert answer.status == 200 and answer.content_type.startswith("text/html")
    page = Page(answer.body.decode())
    assert page.pods == ["default/p0", "default/p1", "default/p2"]
    assert [row[1] for row in page.rows["picks"][1:]] == ["r2", "r1"]
    served = decision.pods[0].id
    (row,) = [r for r in page.rows["pods"][1:] if r[0].startswith(str(served))]
    predicted = recent.predicted()[served]
    assert predicted.cached_tokens > 0 and predicted.ratio is not None
    assert row[-2].startswith(f"{100 * predicted.ratio:.1f}%")
