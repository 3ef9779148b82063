"""Plugin arguments from the configuration's ``pluginConfig[].args``, Kthena's way.

* A misspelled (unknown) key is ignored, so its default is used. Keys match
  case-insensitively (Go decodes the args as JSON, whose field matching folds case),
  and of two keys naming one field the later wins.
* An omitted, zero, negative or infinite number uses the default, unless the field declares a
  closed range (``field(metadata={"range": (lo, hi)})``, as Kthena's
  ``TTFTTPOTWeightFactor`` in [0, 1], or ``ZERO_UP`` where 0 turns a term off): then any
  finite value in the range is used, and one outside it (or NaN, or infinite) uses the
  default and logs ``Invalid <key> <value>, using default value <default>``.
* An args block that cannot be parsed (not a mapping, or a value of the wrong type such
  as a string) falls back to all defaults and logs
  ``Failed to unmarshal <ArgsType>, using default values``, or the args type's own
  ``UNPARSEABLE`` message (Kthena's plugins word it differently).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, TypeVar

log = logging.getLogger("extproc.scheduling.config")

T = TypeVar("T")

ZERO_UP = (0.0, math.inf)  # a range: any finite value from 0 up (0 means "off")


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
