"""The ``extproc`` command: one sub-command per module, listed in ``COMMANDS``.

Each listed module has ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed arguments and returning an exit code.
Modules are imported only here, so ``extproc --help`` stays the single index.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: tuple[str, ...] = (
    "extproc.prefix.cli",  # hash
    "extproc.serve",  # serve
    "extproc.envoyconf.cli",  # envoy-config
    "extproc.sim.pods_cli",  # sim-pods
    "extproc.sim.simulate_cli",  # simulate
    "extproc.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
