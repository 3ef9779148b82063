"""The ``extproc`` command: one sub-command per module, listed in ``COMMANDS``.

Each listed module has ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed arguments and returning an exit code.
Modules are imported only here, so ``extproc --help`` stays the single index. A
command whose extra is not installed (the simulator and demo: ``extproc[sim]``) still
appears, and says which extra to install instead of failing with a traceback: checked
against the installed distribution's metadata (some of an extra's packages are imported
only on use, so a successful import proves nothing), then by the import itself.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import extproc
from extproc.cli.version import commit, hot_path

# Where every command's page says the docs are: the site ``make docs`` builds from docs/.
CLI_REFERENCE = "docs/reference/cli.md"

DESCRIPTION = f"""\
Route each OpenAI-style inference request that Envoy receives to the vLLM pod most likely
to hold its prompt's prefix in cache (an Envoy ext_proc server).

Most common:
  extproc serve --pods pods.yaml     route among the pods listed in a file
  extproc demo                       try it on localhost: simulated pods, extproc, Envoy

`extproc COMMAND --help` shows a command's flags. Documentation: the site `make docs`
builds from docs/ (start at docs/getting-started.md); every command and flag is in
{CLI_REFERENCE}."""


class Command(NamedTuple):
    name: str
    module: str
    extra: str | None  # the optional dependency group it needs; None: the base install


# In the order ``extproc --help`` lists them: the server and its Envoy first.
COMMANDS: tuple[Command, ...] = (
    Command("serve", "extproc.cli.serve", None),
    Command("envoy-config", "extproc.cli.envoy_config", None),
    Command("hash", "extproc.cli.hash", None),
    Command("explain", "extproc.cli.explain", None),
    Command("demo", "extproc.sim.demo", "sim"),
    Command("sim-pods", "extproc.sim.pods_cli", "sim"),
    Command("simulate", "extproc.sim.simulate_cli", "sim"),
)


# A requirement line of the metadata: 'httpx<1,>=0.27; extra == "sim"'. Hand-parsed
# because `packaging`, which parses them fully, is not a runtime dependency.
_EXTRA_REQUIREMENT = re.compile(r'^([A-Za-z0-9][A-Za-z0-9._-]*).*;\s*extra\s*==\s*"([^"]+)"\s*$')


def missing_requirement(extra: str) -> str | None:
    """The first distribution that ``extra`` requires and is not installed, else None.

    None too when extproc's own metadata is absent (run from a source tree, not installed).
    """
    try:
        requires = importlib.metadata.requires("extproc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requires:
        match = _EXTRA_REQUIREMENT.match(requirement)
        if match is None or match[2] != extra:
            continue
        try:
            importlib.metadata.distribution(match[1])
        except importlib.metadata.PackageNotFoundError:
            return match[1]
    return None


def _register_missing(sub: Any, command: Command, why: str) -> None:
    install = f"pip install 'extproc[{command.extra}]'"
    # No option prefix: every argument, --help and the command's own flags included, is
    # taken as is, so any command line gets the explanation, not a usage error.
    p = sub.add_parser(
        command.name,
        help=f"(needs the '{command.extra}' extra: {install})",
        prefix_chars="\0",
        add_help=False,
    )
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)

    def explain(_args: argparse.Namespace) -> int:
        print(
            f"extproc {command.name}: needs the optional dependencies of the "
            f"'{command.extra}' extra ({why}); "
            f"install them with: {install}",
            file=sys.stderr,
        )
        return 2

    p.set_defaults(func=explain)


class _VersionAction(argparse.Action):
    """``--version``: printed on demand, since finding the commit may run git."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        print(version_text(), end="")
        parser.exit()


def version_text() -> str:
    """``extproc VERSION``, ``commit: ...`` and ``hot path: ...``, a line each."""
    return f"extproc {extproc.__version__}\ncommit: {commit()}\nhot path: {hot_path()}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extproc",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the version, the commit it was built from and the hot path in use, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        absent = missing_requirement(command.extra) if command.extra else None
        if absent is not None:
            _register_missing(sub, command, f"{absent!r} is not installed")
            continue
        try:
            module = importlib.import_module(command.module)
        except ModuleNotFoundError as exc:
            if command.extra is None or (exc.name or "").startswith("extproc"):
                raise
            _register_missing(
                sub, command, f"{exc.name!r} is not installed" if exc.name else str(exc)
            )
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
