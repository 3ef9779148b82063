"""Command-line flags for every ``EngineConfig`` setting, shared by ``sim-pods`` and
``simulate``: ``--block-size``, ``--num-gpu-blocks``, ... (KV events have their own flags).
A boolean setting gets a ``--x/--no-x`` pair, as vLLM spells them
(``--no-enable-chunked-prefill``); ``--timing-profile`` takes the name of a profile.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from extproc.sim.engine import EngineConfig
from extproc.sim.timing import PROFILES

ENGINE_FIELDS = [f for f in fields(EngineConfig) if f.name != "enable_kv_cache_events"]


def add_engine_flags(group: Any, *, unset_by_default: bool = False) -> None:
    """One flag per setting; with ``unset_by_default`` an omitted flag is None (so a
    caller can layer its own defaults under the flags)."""
    for f in ENGINE_FIELDS:
        assert f.default is not MISSING
        flag = "--" + f.name.replace("_", "-")
        default = None if unset_by_default else f.default
        help_text = f"{f.metadata['help']} (default {f.default})"
        if isinstance(f.default, bool):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif f.name == "timing_profile":
            group.add_argument(flag, choices=sorted(PROFILES), default=default, help=help_text)
        else:
            group.add_argument(flag, type=type(f.default), default=default, help=help_text)


def engine_config_from_args(
    args: argparse.Namespace, defaults: Mapping[str, Any] | None = None
) -> EngineConfig:
    """Flags that were given, over ``defaults``, over ``EngineConfig``'s own."""
    values = dict(defaults or {})
    for f in ENGINE_FIELDS:
        if getattr(args, f.name) is not None:
            values[f.name] = getattr(args, f.name)
    return EngineConfig(**values)
