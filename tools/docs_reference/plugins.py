"""plugins.md: every plugin of ``scheduling.registry.BUILTIN``, the extension points it can
be enabled at, the shipped configurations enabling it and its arguments (each plugin's
``args_type`` dataclass: key, type, default, range and meaning, from ``args.arg``)."""

from __future__ import annotations

import dataclasses
import re
import sys

from extproc.scheduling import args as plugin_args
from extproc.scheduling.config import NAMED_CONFIGS, load_config
from extproc.scheduling.registry import BUILTIN
from tools.docs_reference.markdown import GENERATED, bullets, code, table, text


def plugins_page() -> str:
    shipped = _shipped_configs()
    parts = [
        GENERATED.format(source="extproc/scheduling/registry.py and the plugins' args"),
        "# Plugins\n\n",
        (
            "The built-in plugins, by the name the scheduler configuration uses "
            "(`scheduler.plugins.Filter.enabled`, `scheduler.plugins.Score.enabled`, "
            "`scheduler.pluginConfig[].args`). *Shipped in* names the configurations "
            "`extproc serve --config NAME` selects that enable the plugin, with its weight.\n\n"
        ),
        table(
            ["Plugin", "Kind", "Shipped in", "What it does"],
            [
                [
                    f"[{code(name)}](#{name})",
                    ", ".join(_kinds(cls)),
                    ", ".join(shipped.get(name, [])) or "-",
                    text(_summary(cls)),
                ]
                for name, cls in sorted(BUILTIN.items())
            ],
        ),
        "\n## How arguments are read\n\n",
        bullets(plugin_args.__doc__ or ""),
        (
            "\nIn the tables below, *Range* is what a value must be to be used: without a "
            "declared range, any finite value greater than 0.\n"
        ),
    ]
    for name, cls in sorted(BUILTIN.items()):
        parts.append(f"\n## {name}\n\n{text(_summary(cls))}\n\n")
        parts.append(f"Kind: {', '.join(_kinds(cls))}.\n\n")
        rows = _argument_rows(cls.args_type)  # type: ignore[attr-defined]
        parts.append(
            table(["Key", "Type", "Default", "Range", "Meaning"], rows)
            if rows
            else "No arguments.\n"
        )
    return "".join(parts)


def _kinds(cls: type) -> list[str]:
    """The extension points a plugin can be enabled at (``config``'s rule)."""
    return [kind for kind in ("Filter", "Score") if callable(getattr(cls, kind.lower(), None))]


def _summary(cls: type) -> str:
    """The plugin module docstring's first paragraph, after ``name (Kind): ``, without a
    closing parenthesis (where it points developers)."""
    first = re.split(r"\n\s*\n", (sys.modules[cls.__module__].__doc__ or "").strip())[0]
    summary = " ".join(first.split()).split("): ", 1)[-1]
    summary = _CLOSING_PARENTHESIS.sub("", summary)
    return summary[:1].upper() + summary[1:]


_CLOSING_PARENTHESIS = re.compile(r"\s*\((?:[^()]|\([^()]*\))*\)(?=\.?$)")


def _argument_rows(args_type: type | None) -> list[list[str]]:
    if args_type is None:
        return []
    rows = []
    for f in dataclasses.fields(args_type):
        bounds = f.metadata.get("range")
        rows.append(
            [
                code(f.name),
                str(f.type),
                code(f.default),
                _range(bounds),
                text(f.metadata["help"]),
            ]
        )
    for extra in getattr(args_type, "EXTRA_ARGS", ()):
        rows.append([code(extra.key), text(extra.type), code(extra.default), "-", text(extra.help)])
    return rows


def _range(bounds: tuple[float, float] | None) -> str:
    if bounds is None:
        return "> 0"
    lo, hi = bounds
    if hi == float("inf"):
        return f"≥ {lo:g}"
    return f"{lo:g} to {hi:g}"


def _shipped_configs() -> dict[str, list[str]]:
    """Plugin name -> the named configurations enabling it (``default (weight 1)``)."""
    shipped: dict[str, list[str]] = {}
    for config_name in NAMED_CONFIGS:
        config = load_config(config_name)
        weights = {entry.name: entry.weight for entry in config.scores}
        for name in sorted(set(config.filters) | set(weights)):
            roles = ["filter"] if name in config.filters else []
            if name in weights:
                roles.append(f"weight {weights[name]}")
            shipped.setdefault(name, []).append(f"`{config_name}` ({', '.join(roles)})")
    return shipped
