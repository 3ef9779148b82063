"""The generated reference pages (docs/reference/) are what ``python -m tools.docs_reference``
writes from the code now, and the metrics page names every family a running ``extproc
serve`` exposes, read from its /metrics with every plugin configured."""

from __future__ import annotations

import re
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from extproc.scheduling.registry import BUILTIN
from extproc.sim.launch import free_port, start_extproc
from testkit.factories import write_tokenizer
from tools import docs_reference
from tools.docs_reference import PAGES, REFERENCE


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_page_is_what_the_generator_writes_now(name: str) -> None:
    generate: Callable[[], str] = PAGES[name]
    assert (REFERENCE / name).read_text() == generate(), (
        f"docs/reference/{name} is out of date: run python -m tools.docs_reference"
    )


def test_check_names_the_stale_page_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(REFERENCE, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr(docs_reference, "REFERENCE", tmp_path)
    assert docs_reference.main(["--check"]) == 0
    page = tmp_path / "plugins.md"
    page.write_text(page.read_text().replace("`50000`", "`40000`", 1))
    assert docs_reference.main(["--check"]) == 1
    assert "docs/reference/plugins.md" in capsys.readouterr().err
    assert docs_reference.main([]) == 0  # writes it again
    assert docs_reference.main(["--check"]) == 0


def test_the_metrics_page_lists_exactly_the_families_serve_exposes(tmp_path: Path) -> None:
    """Every plugin configured (precise-prefix-cache with a tokenizer), flow control on,
    scraping on, Redis sharing on (unreachable: its metrics are there all the same)."""
    plugins = sorted(BUILTIN)
    config = {
        "scheduler": {
            "plugins": {
                "Filter": {"enabled": ["least-request"]},
                "Score": {"enabled": [{"name": name, "weight": 1} for name in plugins]},
            },
            "pluginConfig": [
                {
                    "name": "precise-prefix-cache",
                    "args": {"models": {"m": str(write_tokenizer(tmp_path / "m"))}},
                }
            ],
        },
        "flowControl": {},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "views").mkdir()
    (tmp_path / "pods.yaml").write_text(
        "pods:\n  - name: p0\n    address: 127.0.0.1:9\n    models: [m]\n"
    )
    metrics_port = free_port()
    proc = start_extproc(
        tmp_path / "pods.yaml",
        tmp_path,
        grpc_port=free_port(),
        metrics_port=metrics_port,
        config=tmp_path / "config.yaml",
        extra_args=[
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--view-snapshot-dir",
            str(tmp_path / "views"),
        ],
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            exposition = r.read().decode()
    finally:
        proc.stop()
    types = set(re.findall(r"^# TYPE (\S+) ", exposition, re.MULTILINE))
    # the text format shows a counter's or histogram's creation time as a family of its own
    created = {n for n in types if n.endswith("_created") and {n[:-8], f"{n[:-8]}_total"} & types}
    exposed = types - created
    page = (REFERENCE / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_:]+)` \|", page, re.MULTILINE))
    assert "extproc_precise_prefix_segments_total" in exposed
    assert "extproc_flow_queue_requests" in exposed
    assert "extproc_view_snapshot_loads_total" in exposed
    assert exposed == listed
