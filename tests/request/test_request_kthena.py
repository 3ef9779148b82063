"""Rendering against Kthena's router (``utils.go``: ParsePrompt, parseMessageContent,
GetPromptString): its own test table (``TestParsePrompt``) and every branch of its code,
each case a body and the prompt both modes render, or the 400 where Kthena refuses.

``Rendering.KTHENA`` reads the body Kthena's way on every path; ``Rendering.EXTENDED``
(the default) reads the path's field and must render the same text wherever that field
is the one Kthena reads.
"""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.prefix.hashing import hash_prompt
from extproc.request.parse import Api, parse_request
from extproc.request.render import Rendering

C, CHAT, R = Api.COMPLETIONS, Api.CHAT_COMPLETIONS, Api.RESPONSES


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def render(api: Api, body: dict[str, object], rendering: Rendering) -> str:
    return parse_request(
        api.value, orjson.dumps({"model": "m", **body}), rendering=rendering
    ).prompt


USER_HI = {"role": "user", "content": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}

# (path, body without model, prompt): both modes render this prompt.
RENDERED = [
    # -- Kthena's TestParsePrompt table ------------------------------------------------
    pytest.param(C, {"prompt": "hello"}, "hello", id="kthena-prompt-as-string"),
    pytest.param(
        CHAT,
        {"messages": [USER_HI, {"role": "assistant", "content": "hello"}]},
        chatml(("user", "hi"), ("assistant", "hello")),
        id="kthena-messages-as-list",
    ),
    pytest.param(
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello"},
                        {"type": "text", "text": "world"},
                    ],
                }
            ]
        },
        chatml(("user", "hello\nworld")),
        id="kthena-text-blocks",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}, IMAGE]}]},
        chatml(("user", "describe")),
        id="kthena-mixed-text-and-image",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": [IMAGE]}]},
        "",
        id="kthena-image-only-turn-dropped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "call-1", "type": "function"}]}]},
        "",
        id="kthena-tool-call-without-content-dropped",
    ),
    pytest.param(
        CHAT,
        {
            "system": "You are a helpful assistant.",
            "messages": [{"role": "user", "content": "hello"}],
        },
        chatml(("system", "You are a helpful assistant."), ("user", "hello")),
        id="kthena-top-level-system",
    ),
    pytest.param(
        CHAT,
        {
            "system": [
                {"type": "text", "text": "Follow policy."},
                {"type": "text", "text": "Be concise."},
            ],
            "messages": [{"role": "user", "content": "hello"}],
        },
        chatml(("system", "Follow policy.\nBe concise."), ("user", "hello")),
        id="kthena-system-as-text-blocks",
    ),
    pytest.param(
        R,
        {"instructions": "Be concise.", "input": "Reply OK"},
        chatml(("developer", "Be concise."), ("user", "Reply OK")),
        id="kthena-responses-string-input",
    ),
    pytest.param(
        R,
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "hello"},
                        {"type": "input_text", "text": "world"},
                    ],
                },
                {"type": "message", "role": "assistant", "content": "previous answer"},
            ]
        },
        chatml(("user", "hello\nworld"), ("assistant", "previous answer")),
        id="kthena-responses-message-items",
    ),
    pytest.param(
        R,
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "https://x/y.png"}],
                }
            ]
        },
        "",
        id="kthena-responses-non-text-input",
    ),
    # -- the branches of ParsePrompt / parseMessageContent ------------------------------
    pytest.param(
        CHAT,
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}, USER_HI]},
        chatml(("user", "hi")),
        id="null-content-dropped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": 5}, {"role": "user", "content": {"t": 1}}]},
        "",
        id="number-and-object-content-dropped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": []}, USER_HI]},
        chatml(("user", "hi")),
        id="empty-part-list-dropped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": ""}]},
        chatml(("user", "")),
        id="empty-string-content-kept",
    ),
    pytest.param(
        CHAT,
        {"messages": ["hi", 3, None, [USER_HI], USER_HI]},
        chatml(("user", "hi")),
        id="non-object-messages-skipped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"content": "x"}, {"role": 1, "content": "x"}, {"role": None}, USER_HI]},
        chatml(("user", "hi")),
        id="non-string-role-skipped",
    ),
    pytest.param(
        CHAT,
        {"messages": [{"role": "", "content": "x"}]},
        chatml(("", "x")),
        id="empty-role-kept-in-chat",
    ),
    pytest.param(
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"text": "untyped"},
                        {"type": 7, "text": "odd type"},
                        {"type": "text", "text": 1},
                        {"type": "text"},
                        "loose string",
                        {"type": "output_text", "text": "out"},
                    ],
                }
            ]
        },
        chatml(("user", "untyped\nodd type\nout")),
        id="parts-untyped-accepted-non-text-skipped",
    ),
    pytest.param(
        CHAT,
        {"system": "", "messages": [USER_HI]},
        chatml(("system", ""), ("user", "hi")),
        id="empty-system-kept",
    ),
    pytest.param(
        CHAT,
        {"system": 5, "messages": [USER_HI]},
        chatml(("user", "hi")),
        id="unreadable-system-skipped",
    ),
    pytest.param(
        CHAT,
        {"system": [IMAGE], "messages": [USER_HI]},
        chatml(("user", "hi")),
        id="image-only-system-skipped",
    ),
    pytest.param(
        R, {"instructions": "", "input": "q"}, chatml(("user", "q")), id="empty-instructions"
    ),
    pytest.param(
        R, {"instructions": 3, "input": "q"}, chatml(("user", "q")), id="number-instructions"
    ),
    pytest.param(
        R,
        {
            "input": [
                {"type": "", "role": "user", "content": "empty type kept"},
                {"type": None, "role": "user", "content": "null type kept"},
                {"type": 5, "role": "user", "content": "number type kept"},
                {"role": "user", "content": "untyped kept"},
                {"type": "message", "content": "no role"},
                {"type": "message", "role": "", "content": "empty role"},
                {"type": "message", "role": 3, "content": "number role"},
                {"type": "function_call", "role": "user", "content": "call"},
                {"type": "message", "role": "user", "content": None},
                "a string item",
                7,
            ]
        },
        chatml(
            ("user", "empty type kept"),
            ("user", "null type kept"),
            ("user", "number type kept"),
            ("user", "untyped kept"),
        ),
        id="responses-item-rules",
    ),
    pytest.param(R, {"input": []}, "", id="responses-empty-list"),
    pytest.param(C, {"prompt": ""}, "", id="empty-prompt-unscored"),
]


@pytest.mark.parametrize("rendering", list(Rendering), ids=lambda r: r.value)
@pytest.mark.parametrize(("api", "body", "prompt"), RENDERED)
def test_renders_as_kthena(
    api: Api, body: dict[str, object], prompt: str, rendering: Rendering
) -> None:
    assert render(api, body, rendering) == prompt


def test_a_dropped_turn_leaves_the_hashes_of_the_conversation_without_it() -> None:
    """The tool-call turn adds no empty ChatML block: the same blocks as without it."""
    system = {"role": "system", "content": "S" * 100}
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}
    with_turn = render(CHAT, {"messages": [system, tool_turn, USER_HI]}, Rendering.EXTENDED)
    without = render(CHAT, {"messages": [system, USER_HI]}, Rendering.EXTENDED)
    assert hash_prompt("m", with_turn) == hash_prompt("m", without)
    assert len(hash_prompt("m", with_turn)) == 3  # 160 bytes: 64 + 64 + 32


# (path, body, error fragment): Kthena refuses these ("prompt not found", HTTP 404); both
# modes answer 400 naming the field.
REFUSED_BY_BOTH = [
    pytest.param(C, {"prompt": 123}, "'prompt' must be", id="kthena-prompt-not-a-string"),
    pytest.param(CHAT, {"messages": "x"}, "'messages' must be a list", id="kthena-messages"),
    pytest.param(R, {"input": 123}, "'input' must be a string or a list", id="kthena-input"),
    pytest.param(R, {"input": {"role": "user"}}, "'input' must be", id="input-object"),
    pytest.param(C, {"prompt": None}, "'prompt'", id="prompt-null"),
    pytest.param(CHAT, {"messages": None}, "'messages'", id="messages-null"),
]


@pytest.mark.parametrize("rendering", list(Rendering), ids=lambda r: r.value)
@pytest.mark.parametrize(("api", "body", "fragment"), REFUSED_BY_BOTH)
def test_refuses_what_kthena_refuses(
    api: Api, body: dict[str, object], fragment: str, rendering: Rendering
) -> None:
    with pytest.raises(BadRequest) as info:
        render(api, body, rendering)
    assert info.value.http_status == 400 and fragment in info.value.message


@pytest.mark.parametrize("api", list(Api), ids=lambda a: a.value)
def test_kthena_mode_refuses_a_body_with_none_of_the_fields(api: Api) -> None:
    """Kthena's "neither prompt nor messages" case, on every path."""
    with pytest.raises(BadRequest, match="none of the fields 'prompt', 'messages' or 'input'"):
        render(api, {"foo": "bar"}, Rendering.KTHENA)


# Where the modes differ: (path, body, what EXTENDED renders, what KTHENA renders or None
# for a 400). Kthena's order is path-blind: prompt, then messages, then input.
DIFFERENT = [
    pytest.param(C, {"prompt": ["a", "b"]}, "a\nb", None, id="list-prompt"),
    pytest.param(C, {"prompt": [1, 2, 3]}, "", None, id="token-id-prompt"),
    pytest.param(
        R,
        {"prompt": ["a", "b"], "input": "q"},
        chatml(("user", "q")),
        None,
        id="responses-list-prompt-with-input",
    ),
    pytest.param(
        R,
        {"prompt": {"id": "pmpt_1", "version": "2"}, "input": "q"},
        chatml(("user", "q")),
        None,
        id="responses-prompt-template-object",
    ),
    pytest.param(
        CHAT,
        {"prompt": "p", "messages": [USER_HI]},
        chatml(("user", "hi")),
        "p",
        id="chat-with-a-stray-prompt",
    ),
    pytest.param(
        R,
        {"messages": [USER_HI], "input": "q"},
        chatml(("user", "q")),
        chatml(("user", "hi")),
        id="responses-with-stray-messages",
    ),
    pytest.param(
        R, {"instructions": "be brief"}, chatml(("developer", "be brief")), None, id="no-input"
    ),
    pytest.param(
        R,
        {"messages": [USER_HI], "instructions": "be brief", "input": None},
        chatml(("developer", "be brief")),
        chatml(("user", "hi")),
        id="null-input",
    ),
]


@pytest.mark.parametrize(("api", "body", "extended", "kthena"), DIFFERENT)
def test_where_the_modes_differ(
    api: Api, body: dict[str, object], extended: str, kthena: str | None
) -> None:
    assert render(api, body, Rendering.EXTENDED) == extended
    if kthena is None:
        with pytest.raises(BadRequest):
            render(api, body, Rendering.KTHENA)
    else:
        assert render(api, body, Rendering.KTHENA) == kthena


def test_responses_list_prompt_without_input_is_refused_in_both_modes() -> None:
    """Kthena reads ``prompt`` first and refuses a list; extproc's responses path has no
    ``prompt`` text field (OpenAI's is a template reference), so there is no input."""
    for rendering in Rendering:
        with pytest.raises(BadRequest, match="'prompt' must be a string|no 'input'"):
            render(R, {"prompt": ["a", "b"]}, rendering)
