"""The ``extproc`` command: one sub-command per module, listed in ``COMMANDS``.

Each listed module has ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed arguments and returning an exit code.
Modules are imported only here, so ``extproc --help`` stays the single index. A
command whose extra is not installed (the simulator and demo: ``extproc[sim]``) still
appears, and says which extra to install instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
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


def _register_missing(sub: Any, command: Command, missing: str) -> None:
    install = f"pip install 'extproc[{command.extra}]'"
    p = sub.add_parser(command.name, help=f"(needs the '{command.extra}' extra: {install})")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def explain(_args: argparse.Namespace) -> int:
        print(
            f"extproc {command.name}: needs the optional dependencies of the "
            f"'{command.extra}' extra (module {missing!r} is not installed); "
            f"install them with: {install}",
            file=sys.stderr,
        )
        return 2

    p.set_defaults(func=explain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        try:
            module = importlib.import_module(command.module)
        except ModuleNotFoundError as exc:
            if command.extra is None or exc.name is None or exc.name.startswith("extproc"):
                raise
            _register_missing(sub, command, exc.name)
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
