"""The documentation's reference pages, generated from the code so they cannot drift.

    python -m tools.docs_reference          # write docs/reference/*.md
    python -m tools.docs_reference --check  # exit 1 naming each page that is out of date

One module a page: ``plugins`` (the plugin registry and each plugin's arguments),
``cli`` (the argument parsers), ``metrics`` (what ``extproc serve`` registers, mode by
mode), ``chart_values`` (the chart's ``values.schema.json`` and ``values.yaml``);
``markdown`` formats them.

The output is deterministic: sorted where the code has no order, no timestamps, no paths
of this machine, no environment defaults (``EXTPROC_*`` are ignored while generating).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.docs_reference.chart_values import chart_values_page
from tools.docs_reference.cli import cli_page
from tools.docs_reference.metrics import metrics_page
from tools.docs_reference.plugins import plugins_page

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"

PAGES: dict[str, Callable[[], str]] = {
    "plugins.md": plugins_page,
    "cli.md": cli_page,
    "metrics.md": metrics_page,
    "chart-values.md": chart_values_page,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docs_reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a page is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, generate in PAGES.items():
        path = REFERENCE / name
        page = generate()
        if args.check:
            if not path.exists() or path.read_text() != page:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page)
    if stale:
        print(
            f"out of date: {', '.join(f'docs/reference/{n}' for n in stale)}; "
            "run python -m tools.docs_reference",
            file=sys.stderr,
        )
        return 1
    return 0
