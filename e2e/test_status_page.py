"""The admin port's status page in headless Chromium (Debian's ``chromium`` package,
driven by Playwright without its own browsers), after traffic through real Envoy: the
page loads with no console error, failed request or script error, shows every pod by
id, the recent picks with their ends, and predicted and reported hit ratios; a
screenshot is saved (``STATUS_PAGE_SCREENSHOT=path`` writes it there too: the docs'
``docs/img/status-page.png`` comes from such a run).

Chromium runs headless with the flags this machine's closed network needs (no
background networking, component updates, sync or QUIC) and a fresh profile.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import ConsoleMessage, Page, Response, sync_playwright

from e2e.support import MODEL, send_and_wait_recorded, unique_prefix
from extproc.sim.launch import SimPods, Stack
from testkit.waiting import wait_until

CHROMIUM_FLAGS = (
    "--no-sandbox",  # the tests may run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
NUM_PREFIXES = 4
NUM_SENDS = 3  # of each prefix, each after the last was recorded: predicted cached


def chromium() -> str:
    """Debian's Chromium; missing is an install error (``make system-deps``), not a skip."""
    path = shutil.which("chromium")
    if path is None:
        raise FileNotFoundError("chromium not found: apt-get install chromium (make system-deps)")
    return path


class Browser:
    """One headless Chromium page that records every console error, script error and
    failed or refused request."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.problems.append(f"page error: {exc}"))
        page.on("requestfailed", lambda req: self.problems.append(f"failed: {req.url}"))
        page.on("response", self._response)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.problems.append(f"console {message.type}: {message.text}")

    def _response(self, response: Response) -> None:
        if response.status >= 400:
            self.problems.append(f"{response.status}: {response.url}")

    def cells(self, table: str) -> list[list[str]]:
        rows = self.page.locator(f"table#{table} tbody tr")
        return [r.locator("td").all_inner_texts() for r in rows.all()]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "profile",  # a fresh profile
            executable_path=chromium(),
            headless=True,
            args=list(CHROMIUM_FLAGS),
            viewport={"width": 1500, "height": 760},
        )
        try:
            yield Browser(context.new_page())
        finally:
            context.close()


def send_traffic(stack: Stack) -> set[str]:
    """Returns the names of the pods that served."""
    served = set()
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        for _ in range(NUM_PREFIXES):
            prompt = unique_prefix() + "question?"
            for _ in range(NUM_SENDS):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                served.add(send_and_wait_recorded(stack, client, "/v1/completions", body))
    return served


def test_status_page_shows_every_pod_and_the_picks_without_errors(
    admin: tuple[Stack, str], sim: SimPods, browser: Browser, tmp_path: Path
) -> None:
    stack, admin_url = admin
    url = f"{admin_url}/"
    served = send_traffic(stack)
    num_requests = NUM_PREFIXES * NUM_SENDS

    def ready() -> bool:
        """Every pick ended, and the pods that served have both ratios."""
        browser.page.goto(url)
        picks = browser.cells("picks")
        pods = {r[0].splitlines()[0]: r for r in browser.cells("pods")}
        ratios = [pods[f"default/{name}"][-2:] for name in served if f"default/{name}" in pods]
        ended = sum(r[10] == "ok" for r in picks) >= num_requests
        return ended and all("—" not in pair for pair in ratios)

    wait_until(ready, 30.0, what="the page shows the picks ended and the served pods' ratios")
    browser.problems.clear()  # judge one clean load, after the page has its content
    response = browser.page.goto(url, wait_until="load")
    assert response is not None and response.status == 200
    shown = browser.page.locator("[data-pod]").evaluate_all("els => els.map(e => e.textContent)")
    assert sorted(shown) == sorted(f"default/{p.name}" for p in sim.pods)
    assert len(browser.cells("picks")) >= num_requests
    shot = tmp_path / "status-page.png"
    browser.page.screenshot(path=shot, full_page=True)
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("STATUS_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, target)
    assert browser.problems == []
