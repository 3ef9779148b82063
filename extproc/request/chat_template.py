"""The jinja2 environment chat templates render in, as Hugging Face's
``apply_chat_template`` sets it up: jinja2's immutable sandbox with ``trim_blocks``,
``lstrip_blocks``, loop controls, HF's ``tojson`` and ``raise_exception``.

The sandbox checks every attribute a template reads. Two of its checks are repeated work
on a chat template's hot path, so ``ChatTemplateSandbox`` answers them from what it has
already decided, with the same answers (``tests/request/test_chat_template.py``):

* ``is_safe_attribute`` depends, in jinja2's immutable sandbox, only on the object's
  type and the attribute's name (a leading underscore, the internal attributes of
  functions, methods, types, code, frames and generators, the mutating methods of lists,
  dicts, sets and deques), so its answer is kept per (type, name);
* ``message.content`` on a plain dict first looks for a dict attribute named
  ``content``, fails, and then reads the key; for a name that is no attribute of ``dict``
  the key is read at once, which is where the sandbox ends up.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateSandbox", "compile_template"]

_DICT_ATTRIBUTES = frozenset(dir(dict))
_MAX_REMEMBERED = 4096  # (type, name) answers kept: a template names few; bounds names from data


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, its attribute checks remembered (module doc)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < _MAX_REMEMBERED:
                self._safe[key] = safe
        return safe

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the environment Hugging Face renders chat templates in.

    Raises:
        ValueError: the template does not compile (its line and jinja2's message).
    """
    env = ChatTemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: line {exc.lineno}: {exc}") from None
