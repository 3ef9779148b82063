"""Segment tokenizing equals whole-prompt tokenizing (the Qwen3 tokenizer and template of
the e2e model), and the memo tokenizes a conversation's history once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.parse import Api
from extproc.request.tokens import NotExact, SegmentTokenizer
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer

pytestmark = needs_model_tokenizer

# Text that stresses the cut: the template's special tokens, other added tokens, spaces,
# newlines and digits around them, and characters that NFC recomposes (e + U+0301).
pieces = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "\n", "\n\n", " ",
     "  ", "e\u0301", "é", "hello", " world", "123", "4567", "日本語", "🙂", "\t", "user", "<|"]
)  # fmt: skip
texts = st.lists(st.one_of(pieces, st.text(max_size=12)), max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok() -> SegmentTokenizer:
    return SegmentTokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def small_memo() -> SegmentTokenizer:
    return SegmentTokenizer(MODEL_DIR, memo_tokens=50)  # evictions mid-call too


@settings(max_examples=300, deadline=None)
@given(texts)
def test_segments_tokenize_like_the_whole_text(small_memo: SegmentTokenizer, text: str) -> None:
    tok = small_memo
    whole = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.tokens(text) == whole
    assert tok.tokens(text) == whole  # from the memo


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant"]), texts), min_size=1, max_size=6))
def test_chat_requests_tokenize_like_the_whole_rendering(
    tok: SegmentTokenizer, turns: list[tuple[str, str]]
) -> None:
    body = {"messages": [{"role": r, "content": c} for r, c in turns]}
    text = tok.render_chat(body)
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt
    assert (
        tok.request_tokens(Api.CHAT_COMPLETIONS, body)
        == tok.tokenizer.encode(text, add_special_tokens=False).ids
    )


def test_a_conversations_history_is_tokenized_once(tok: SegmentTokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse. " * 50}]
    for turn in range(5):
        messages.append({"role": "user", "content": f"question {turn} " * 20})
        before = tok.misses
        tok.request_tokens(Api.CHAT_COMPLETIONS, {"messages": messages})
        assert tok.misses - before <= 2  # the new message (and "assistant\n" the first time)
        messages.append({"role": "assistant", "content": f"answer {turn}"})


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            id="multimodal",
        ),
        pytest.param({"messages": []}, id="no-messages"),
        pytest.param(
            {"messages": [{"role": "user", "content": "hi"}],
             "chat_template_kwargs": {"messages": "clash"}},
            id="kwargs-clash-with-the-templates-own",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "hi"}], "tools": 5}, id="tools-not-a-list"
        ),
    ],
)  # fmt: skip
def test_requests_that_cannot_be_exact_say_so(tok: SegmentTokenizer, body: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(NotExact):
        tok.request_tokens(Api.CHAT_COMPLETIONS, body)


def test_completions_prompts_tokenize_as_is(tok: SegmentTokenizer) -> None:
    prompt = "Once upon a time<|im_end|> there was"
    assert (
        tok.request_tokens(Api.COMPLETIONS, {"prompt": prompt})
        == tok.tokenizer.encode(prompt, add_special_tokens=True).ids
    )
    assert tok.request_tokens(Api.COMPLETIONS, {"prompt": [1, 2, 3]}) == [1, 2, 3]
    for out_of_range in ([-1, 2], [1, 2**32]):  # not 4-byte ids: no exact tokens, no crash
        with pytest.raises(NotExact, match="a token id is out of range"):
            tok.request_tokens(Api.COMPLETIONS, {"prompt": out_of_range})


def test_a_cut_names_the_segments_to_encode_and_encoding_fills_the_memo(
    tok: SegmentTokenizer,
) -> None:
    body = {"messages": [{"role": "user", "content": "a segment never seen before"}]}
    segments = tok.segments(Api.CHAT_COMPLETIONS, body)
    assert "user\na segment never seen before" in segments.missing
    again = tok.segments(Api.CHAT_COMPLETIONS, body)  # cut again before any encoding
    misses = tok.misses
    ids = tok.encode(segments)
    assert tok.misses > misses
    assert tok.segments(Api.CHAT_COMPLETIONS, body).missing == []
    # Encoded meanwhile (by another thread, say): found in the memo, not encoded again.
    misses = tok.misses
    assert tok.encode(again).tolist() == ids.tolist()
    assert tok.misses == misses
