"""Plugin arguments from the configuration's ``pluginConfig[].args``, Kthena's way.

* A misspelled (unknown) key is ignored, so its default is used. Keys match
  case-insensitively (Go decodes the args as JSON, whose field matching folds case),
  and of two keys naming one field the later wins.
* An omitted, zero, negative or infinite number uses the default, unless the argument
  has a closed range (as Kthena's ``TTFTTPOTWeightFactor``, 0 to 1, or one from 0 up
  where 0 turns a term off): then any finite value in the range is used, and one outside
  it (or NaN, or infinite) uses the default and logs
  ``Invalid <key> <value>, using default value <default>``.
* An args block that cannot be parsed (not a mapping, or a value of the wrong type such
  as a string) falls back to all defaults and logs
  ``Failed to unmarshal <ArgsType>, using default values``, or the plugin's own message
  (the args type's ``UNPARSEABLE``: Kthena's plugins word it differently).

A plugin's arguments are the fields of its args dataclass (the plugin's ``args_type``),
each declared with ``arg``: its default, its meaning and, if closed, its range
(``ZERO_UP``: from 0 up). The plugin reference (``docs/reference/plugins.md``) is
generated from them; an argument the plugin reads itself is listed in ``EXTRA_ARGS``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, NamedTuple, TypeVar

log = logging.getLogger("extproc.scheduling.config")

T = TypeVar("T")

ZERO_UP = (0.0, math.inf)  # a range: any finite value from 0 up (0 means "off")


def arg(default: T, help: str, *, within: tuple[float, float] | None = None) -> T:
    """An args dataclass field: its default, its one-line meaning for the plugin
    reference and, if any, the closed range its values must be in."""
    metadata: dict[str, Any] = {"help": help}
    if within is not None:
        metadata["range"] = within
    return dataclasses.field(default=default, metadata=metadata)


class ExtraArg(NamedTuple):
    """An argument a plugin reads itself, not through ``load_args`` (for the reference)."""

    key: str
    type: str
    default: str
    help: str


class _Unparseable(Exception):
    pass


def load_args(args_type: type[T], raw: Any) -> T:
    """Build ``args_type`` (a dataclass of int/float fields with defaults) from ``raw``."""
    try:
        values = _parse(args_type, raw)
    except _Unparseable:
        default = f"Failed to unmarshal {args_type.__name__}, using default values"
        log.warning("%s", getattr(args_type, "UNPARSEABLE", default))
        return args_type()
    return args_type(**values)


def _parse(args_type: type[Any], raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _Unparseable
    fields = {f.name.lower(): f for f in dataclasses.fields(args_type)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields.get(key.lower()) if isinstance(key, str) else None
        if f is None:
            continue
        if value is None:
            continue  # JSON null leaves a Go field as it was: the default, or an earlier key
        values.pop(f.name, None)  # a later key for the same field replaces the earlier
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Unparseable
        if f.type in ("int", int) and not isinstance(value, int):
            raise _Unparseable
        bounds = f.metadata.get("range")
        if bounds is None:
            if value > 0 and math.isfinite(value):
                values[f.name] = value
        elif math.isfinite(value) and bounds[0] <= value <= bounds[1]:
            values[f.name] = value
        else:
            log.warning("Invalid %s %s, using default value %s", f.name, value, f.default)
    return values
