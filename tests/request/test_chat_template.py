"""``ChatTemplateSandbox`` renders what jinja2's immutable sandbox renders, and refuses
what it refuses, with its attribute checks remembered."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import jinja2
import jinja2.ext
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.request.chat_template import ChatTemplateSandbox, compile_template
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer


def reference(source: str) -> jinja2.Template:
    """The template in jinja2's own immutable sandbox, set up as ``compile_template``."""
    fast = compile_template(source)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = fast.environment.filters["tojson"]
    env.globals["raise_exception"] = fast.environment.globals["raise_exception"]
    return env.from_string(source)


def both(source: str, **context: Any) -> tuple[str, str]:
    return compile_template(source).render(**context), reference(source).render(**context)


@pytest.mark.parametrize(
    ("source", "context", "expected"),
    [
        # a key read as an attribute, and a missing one
        ("{{ m.content }}|{{ m.missing }}|{{ m.missing is defined }}", {"m": {"content": "hi"}},
         "hi||False"),
        # a key named like a dict method: the method wins, as in the sandbox
        ("{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}", {"m": {"items": 1, "a": 2}},
         "items=1;a=2;"),
        ("{{ m.get('a') }}", {"m": {"get": "shadowed", "a": 2}}, "2"),
        # string methods, checked once per type and name
        ("{{ s.strip().upper() }}{{ s.startswith(' a') }}{{ t.split(',')|length }}",
         {"s": " ab ", "t": "1,2,3"}, "ABTrue3"),
        # a dict subclass takes the sandbox's own path
        ("{{ m.content }}", {"m": type("D", (dict,), {})(content="x")}, "x"),
        ("{{ m | tojson }}", {"m": {"a": [1, "é"]}}, json.dumps({"a": [1, "é"]}, ensure_ascii=False)),
    ],
)  # fmt: skip
def test_renders_as_the_immutable_sandbox(
    source: str, context: dict[str, Any], expected: str
) -> None:
    fast, ref = both(source, **context)
    assert fast == ref == expected


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append(1) }}",  # mutating a list
        "{{ m.pop('a') }}",  # mutating a dict
        "{{ m.update({'b': 1}) }}",
        "{{ ''.__class__.__mro__ }}",  # reaching for the type hierarchy
        "{{ f.__globals__ }}",  # a function's internals
    ],
)
def test_refuses_what_the_sandbox_refuses(source: str) -> None:
    context = {"messages": [], "m": {"a": 1}, "f": lambda: None}
    outcomes = []
    for template in (compile_template(source), reference(source)):
        try:
            outcomes.append(("rendered", template.render(**context)))
        except (SecurityError, jinja2.exceptions.UndefinedError) as exc:
            outcomes.append(("refused", type(exc).__name__))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "refused" or outcomes[0][1] == ""
    assert context["messages"] == [] and context["m"] == {"a": 1}


def test_a_remembered_answer_is_per_type_and_name() -> None:
    env = ChatTemplateSandbox()
    plain = ImmutableSandboxedEnvironment()
    cases = [
        ("abc", "upper"), ([], "append"), ([], "index"), ({}, "pop"), ({}, "get"),
        (set(), "add"), (deque(), "append"), (len, "__self__"), (str, "mro"),
        (lambda: None, "__code__"), ((n for n in range(0)), "gi_frame"), ("abc", "_private"),
        ("abc", "append"), ([], "upper"),
    ]  # fmt: skip
    for _ in range(2):  # the second round answers from memory
        for obj, attr in cases:
            value = getattr(obj, attr, None)
            assert env.is_safe_attribute(obj, attr, value) == plain.is_safe_attribute(
                obj, attr, value
            ), (type(obj), attr)
    assert not env.is_safe_attribute([], "append", [].append)
    assert env.is_safe_attribute("abc", "upper", "abc".upper)


chats = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}
    ),
    min_size=1,
    max_size=6,
)


@needs_model_tokenizer
@settings(max_examples=100, deadline=None)
@given(chats, st.booleans())
def test_the_models_template_renders_as_in_the_sandbox(
    messages: list[dict[str, str]], thinking: bool
) -> None:
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text("utf-8"))
    source = config["chat_template"]
    context = {"messages": messages, "add_generation_prompt": True, "enable_thinking": thinking}
    fast, ref = both(source, **context)
    assert fast == ref
