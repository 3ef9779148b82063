"""chart-values.md: every key of ``charts/extproc/values.schema.json`` with its type and
allowed values, its default from ``values.yaml``, and the schema's description (else the
comment above the key in ``values.yaml``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tools.docs_reference.markdown import GENERATED, code, table, text

CHART = Path(__file__).resolve().parents[2] / "charts" / "extproc"


def chart_values_page() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values_text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(values_text)
    comments = _yaml_comments(values_text)
    rows = []
    for path, node in _keys(schema, ()):
        key = ".".join(path)
        description = node.get("description") or comments.get(key, "")
        if "properties" in node:  # a section: its own row only to describe it
            if description:
                rows.append([code(key), "object", "", text(description)])
            continue
        default = _shown_default(_lookup(values, path))
        rows.append([code(key), _schema_type(node), default, text(description)])
    return "".join(
        [
            GENERATED.format(source="charts/extproc/values.schema.json and values.yaml"),
            "# Chart values\n\n",
            (
                "The values of the `charts/extproc` Helm chart: every key the schema "
                "(`values.schema.json`) knows, its type and allowed values, the default "
                "from `values.yaml`, and the schema's description (else the comment above "
                "the key in `values.yaml`).\n\n"
            ),
            table(["Key", "Type", "Default", "Description"], rows),
        ]
    )


def _keys(
    node: Mapping[str, Any], path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], Mapping[str, Any]]]:
    """Every key of the schema, depth first in the schema's order."""
    for name, child in node.get("properties", {}).items():
        yield (*path, name), child
        yield from _keys(child, (*path, name))


_ABSENT = object()  # a key values.yaml does not set


def _lookup(values: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return _ABSENT
        values = values[key]
    return values


def _schema_type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(code(json.dumps(v)) for v in node["enum"])
    if "oneOf" in node:
        return " or ".join(_schema_type(option) for option in node["oneOf"])
    kind = node.get("type", "any")
    shown = " or ".join(kind) if isinstance(kind, list) else kind
    lo, hi = node.get("minimum"), node.get("maximum")
    if lo is not None and hi is not None:
        shown += f", {lo} to {hi}"
    elif lo is not None:
        shown += f", ≥ {lo}"
    elif hi is not None:
        shown += f", ≤ {hi}"
    return shown


def _shown_default(value: Any) -> str:
    if value is _ABSENT:
        return ""
    shown = json.dumps(value, separators=(", ", ": "))
    return code(shown) if len(shown) <= 60 else "see `values.yaml`"


_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def _yaml_comments(source: str) -> dict[str, str]:
    """Dotted key -> the comment lines right above it (or after it on its line) in a
    block-style YAML file such as a chart's values.yaml."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(line)
        if match is None:
            pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        inline = match["rest"].partition(" #")[2].strip()
        comment = " ".join(pending + ([inline] if inline else []))
        if comment:
            comments[".".join(key for _, key in stack)] = comment
        pending = []
    return comments
