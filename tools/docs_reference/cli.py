"""cli.md: the ``extproc`` parser and every sub-command's (``extproc.cli.build_parser``),
group by group: each flag's value, default, help and environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import extproc
from extproc.cli import build_parser
from tools.docs_reference.markdown import GENERATED, code, paragraphs, table, text

PACKAGE = Path(extproc.__file__).resolve().parent

_PROBE = "(probe: from the environment)"  # a default no flag has


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` without any ``EXTPROC_*`` variable, plus ``values``, for a while."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("EXTPROC_")]:
        del os.environ[key]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _env_var(flag: str) -> str:
    return "EXTPROC_" + flag.lstrip("-").upper().replace("-", "_")


def cli_page() -> str:
    with environment({}):
        parser = build_parser()
    # Flags whose default comes from the environment: built again with every candidate
    # variable set to a probe, their default is the probe.
    names = {
        _env_var(flag)
        for sub in _subcommands(parser).values()
        for action in sub._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
    with environment(dict.fromkeys(names, _PROBE)):
        probed = _subcommands(build_parser())
    parts = [
        GENERATED.format(source="the argument parsers (extproc/cli/)"),
        "# Command line\n\n",
        (
            "Every `extproc` sub-command with its flags, group by group, as `--help` shows "
            "them (each also takes `-h`, `--help`). *Environment*: the variable that sets "
            "the flag's default.\n\n"
        ),
        "## extproc\n\n",
        _description(parser),
        _groups(parser, set()),
    ]
    helps = {a.dest: a.help for a in _choices_actions(parser)}
    for name, sub in _subcommands(parser).items():
        if sub.prefix_chars != "-":
            raise SystemExit(f"extproc {name}: its extra is not installed ({helps.get(name)})")
        from_env = {
            flag
            for action in probed[name]._actions
            if action.default == _PROBE
            for flag in action.option_strings
        }
        parts += [f"\n## extproc {name}\n\n", text(helps.get(name) or ""), "\n\n"]
        parts.append(_description(sub))
        parts.append(_groups(sub, from_env))
    return "".join(parts)


def _choices_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action._choices_actions)
    return []


def _description(parser: argparse.ArgumentParser) -> str:
    description = parser.description or ""
    if not description:
        return ""
    formatter = parser.formatter_class
    if isinstance(formatter, type) and issubclass(formatter, argparse.RawDescriptionHelpFormatter):
        return f"```text\n{description.strip()}\n```\n\n"
    return paragraphs(description) + "\n"


def _groups(parser: argparse.ArgumentParser, from_env: set[str]) -> str:
    parts = []
    formatter = argparse.HelpFormatter(parser.prog)
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))
        ]
        if not actions:
            continue
        parts.append(f"\n### {group.title}\n\n")
        if group.description:
            parts.append(text(group.description) + "\n\n")
        env_column = any(f in from_env for a in actions for f in a.option_strings)
        header = ["Flag", "Value", "Default", "Description"] + (["Environment"] * env_column)
        rows = []
        for action in actions:
            row = [
                ", ".join(code(s) for s in action.option_strings) or code(action.dest),
                _value(action),
                _default(action),
                text(formatter._expand_help(action) if action.help else ""),
            ]
            if env_column:
                long = [f for f in action.option_strings if f in from_env]
                row.append(code(_env_var(long[0])) if long else "")
            rows.append(row)
        parts.append(table(header, rows))
    return "".join(parts)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(code(c) for c in action.choices)
    metavar = action.metavar or (action.dest if not action.option_strings else action.dest.upper())
    shown = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    if action.nargs in ("*", "+"):
        shown += " ..."
    return code(shown)


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default == argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(default, Path) or (isinstance(default, str) and str(PACKAGE) in default):
        shown = str(default).replace(str(PACKAGE), "extproc")  # the package's own data
        return code(shown)
    if isinstance(default, str) and not default:
        return code('""')
    if isinstance(default, (list, tuple)):
        return ", ".join(code(item) for item in default)
    return code(default)
