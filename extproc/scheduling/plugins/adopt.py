"""What a plugin's ``adopt`` (``Reloadable``) checks before taking over a view: the
arguments that shape it (its geometry) are unchanged; else the view starts empty, said
once in the log with what changed."""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("extproc.scheduling.reload")


def same_geometry(
    plugin: str, view: str, old_args: object, new_args: object, names: Iterable[str]
) -> bool:
    """Whether the arguments ``names`` are equal in both; logs the dropped view if not."""
    changed = [
        f"{name} {getattr(old_args, name)!r} -> {getattr(new_args, name)!r}"
        for name in names
        if getattr(old_args, name) != getattr(new_args, name)
    ]
    if changed:
        log.warning("reload: %s starts its %s empty (%s)", plugin, view, ", ".join(changed))
    return not changed
