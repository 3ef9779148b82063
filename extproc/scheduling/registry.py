"""Built-in plugins by configuration name: one explicit table, no import side effects."""

from __future__ import annotations

from extproc.scheduling.plugins.prefix_cache import PrefixCacheScorer
from extproc.scheduling.types import Plugin

BUILTIN: dict[str, type[Plugin]] = {cls.type_name: cls for cls in (PrefixCacheScorer,)}
