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


class Command(NamedTuple):
    name: str
    module: str
    extra: str | None  # the optional dependency group it needs; None: the base install


COMMANDS: tuple[Command, ...] = (
    Command("hash", "extproc.cli.hash", None),
    Command("serve", "extproc.cli.serve", None),
    Command("envoy-config", "extproc.cli.envoy_config", None),
    Command("sim-pods", "extproc.sim.pods_cli", "sim"),
    Command("simulate", "extproc.sim.simulate_cli", "sim"),
    Command("demo", "extproc.sim.demo", "sim"),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__.splitlines()[0])
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
