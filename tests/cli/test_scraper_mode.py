"""``--scraper``: the pods are scraped in a child process unless ``thread`` is asked for."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.cli.app import start
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.scrape_process import ScrapeProcess
from tests.cli.test_request_metrics import serve_args


@pytest.mark.parametrize(
    ("flag", "kind"),
    [((), ScrapeProcess), (("--scraper", "thread"), MetricsScraper)],
)
def test_the_scraper_runs_where_asked(flag: tuple[str, ...], kind: type) -> None:
    running = start(serve_args(*flag), CollectorRegistry())
    try:
        assert type(running.scraper) is kind
        if isinstance(running.scraper, ScrapeProcess):
            assert running.scraper.pid is not None
    finally:
        running.stop(0.0)
    if isinstance(running.scraper, ScrapeProcess):
        assert running.scraper._process is not None and not running.scraper._process.is_alive()


def test_no_scraper_without_scraping() -> None:
    running = start(serve_args("--stale-after-s", "0"), CollectorRegistry())
    try:
        assert running.scraper is None
    finally:
        running.stop(0.0)
