"""The pseudo-tokenizer's prefix property, the chat template, the generated answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.sim.tokenizer import (
    IM_END,
    IM_START,
    TEXT_VOCAB_SIZE,
    ChatMessage,
    generate_words,
    render_chat,
    tokenize,
    word_token,
)


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.text(), st.text())
def test_extension_shares_every_full_chunk(a: str, b: str) -> None:
    k = len(a.encode()) // 4
    assert tokenize(a + b)[:k] == tokenize(a)[:k]


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.text(), st.text())
def test_text_ending_on_a_4_byte_boundary_is_a_token_prefix(a: str, b: str) -> None:
    pad = "x" * (-len(a.encode()) % 4)
    a += pad
    assert tokenize(a + b)[: len(tokenize(a))] == tokenize(a)


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.text())
def test_about_4_bytes_per_token_and_ids_in_the_text_vocabulary(text: str) -> None:
    tokens = tokenize(text)
    assert len(tokens) == -(-len(text.encode()) // 4)
    assert all(0 <= t < TEXT_VOCAB_SIZE for t in tokens)
    assert tokenize(text) == tokens  # deterministic


def test_a_partial_last_chunk_is_its_own_token() -> None:
    assert tokenize("abcdef") == tokenize("abcd") + tokenize("ef")
    assert tokenize("abcdefgh")[1] != tokenize("abcdef")[1]


@settings(deadline=None)  # no per-example deadline on a loaded runner
@given(st.lists(st.text(), min_size=1, max_size=4), st.integers(0, 2**32), st.integers(1, 40))
def test_answer_sent_back_extends_the_previous_prompt_and_answer(
    turns: list[str], seed: int, num_tokens: int
) -> None:
    history = [ChatMessage("system", "be brief"), ChatMessage("user", turns[0])]
    prompt = render_chat(history)
    words = generate_words(prompt, num_tokens, seed)
    generated = [word_token(w) for w in words]
    assert all(len(w.encode()) == 4 for w in words)
    assert tokenize("".join(words)) == generated
    next_turn = [*history, ChatMessage("assistant", "".join(words)), ChatMessage("user", "more")]
    assert render_chat(next_turn)[: len(prompt) + num_tokens] == prompt + generated


def test_chat_rendering_uses_atomic_special_tokens() -> None:
    tokens = render_chat([ChatMessage("user", "hi")])
    assert tokens[0] == IM_START
    assert tokens.count(IM_END) == 1
    assert render_chat([ChatMessage("user", "hi")], add_generation_prompt=False)[-1] != IM_START


def test_answers_depend_on_prompt_and_seed_only() -> None:
    a, b = tokenize("prompt one"), tokenize("prompt two")
    assert generate_words(a, 8) == generate_words(list(a), 8)
    assert generate_words(a, 8) != generate_words(b, 8)
    assert generate_words(a, 8, seed=1) != generate_words(a, 8)
    assert generate_words(a, 4) == generate_words(a, 8)[:4]
