"""A deterministic pseudo-tokenizer, a ChatML-like chat template and the simulated output.

Tokens. Text is encoded as UTF-8 and cut into 4-byte chunks, the last of which may be
shorter; each chunk is one token, ``XXH32(chunk) mod TEXT_VOCAB_SIZE``. So the same text
always gives the same tokens, in every process, and about 4 bytes make a token.

Prefix property. If text ``b`` starts with text ``a`` (as bytes), then
``tokenize(b)[:k] == tokenize(a)[:k]`` with ``k = len(a.encode()) // 4``: every full chunk
of ``a`` is shared. When ``a``'s length in bytes is a multiple of 4 (``a`` ends at a
4-byte boundary), ``tokenize(a)`` is a prefix of ``tokenize(b)``; otherwise ``a``'s last,
partial chunk becomes a different token in ``b``.

Chat. ``render_chat`` follows ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` per
message, then ``<|im_start|>assistant\\n`` for the answer) and tokenizes each piece on its
own, with the three markers as single special tokens, the way real templates keep special
tokens atomic. Pieces never share a chunk, so rendering messages 1..n+1 extends the tokens
of messages 1..n, whatever the byte lengths.

Output. ``generate_words`` returns the "model's" answer: 4-byte ASCII words (three
letters and a space), one token each, chosen by hashing the prompt's tokens and a seed.
Words are 4 bytes, so an answer re-tokenizes to exactly the tokens generated; sent back
as the assistant message of the next turn, it re-renders to the tokens the engine
produced (and cached), which is what makes the next turn hit the cache as in vLLM.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import xxhash

CHUNK_BYTES = 4
TEXT_VOCAB_SIZE = 151_643  # ids 0..151642 are text; the specials follow, as in Qwen
ENDOFTEXT = 151_643
IM_START = 151_644
IM_END = 151_645
VOCAB_SIZE = 151_646
SPECIAL_TEXT = {ENDOFTEXT: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}

_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"
# 17 * 5 * 17 = 1445 words of exactly 4 ASCII bytes.
WORDS: tuple[str, ...] = tuple(
    a + v + b + " " for a in _CONSONANTS for v in _VOWELS for b in _CONSONANTS
)

_xxh32 = xxhash.xxh32_intdigest
_xxh64 = xxhash.xxh64_intdigest


class ChatMessage(NamedTuple):
    role: str
    content: str


def tokenize(text: str) -> list[int]:
    """One token per 4-byte chunk of the UTF-8 text (see the module docstring)."""
    data = text.encode()
    return [
        _xxh32(data[i : i + CHUNK_BYTES]) % TEXT_VOCAB_SIZE
        for i in range(0, len(data), CHUNK_BYTES)
    ]


def render_chat(messages: Iterable[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """ChatML-like rendering to tokens; each piece is tokenized on its own.

    Args:
        messages: the conversation, oldest first.
        add_generation_prompt: end with ``<|im_start|>assistant\\n`` for the answer.

    Returns:
        The prompt's token ids.
    """
    tokens: list[int] = []
    for message in messages:
        tokens.append(IM_START)
        tokens += tokenize(message.role + "\n")
        tokens += tokenize(message.content)
        tokens.append(IM_END)
        tokens += tokenize("\n")
    if add_generation_prompt:
        tokens.append(IM_START)
        tokens += tokenize("assistant\n")
    return tokens


def prompt_seed(prompt_token_ids: Sequence[int], seed: int = 0) -> int:
    """A 64-bit digest of the prompt's tokens and ``seed``: the output's only input."""
    packed = struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)
    return _xxh64(packed, seed & 0xFFFF_FFFF_FFFF_FFFF)


def generate_words(prompt_token_ids: Sequence[int], num_tokens: int, seed: int = 0) -> list[str]:
    """The simulated answer to a prompt: ``num_tokens`` words of 4 ASCII bytes.

    The same prompt and seed give the same answer in every process; ``tokenize`` of the
    joined words gives one token per word.
    """
    base = prompt_seed(prompt_token_ids, seed)
    return [WORDS[_xxh64(struct.pack("<I", i), base) % len(WORDS)] for i in range(num_tokens)]


def word_token(word: str) -> int:
    """The token id of one generated word (a single 4-byte chunk)."""
    return _xxh32(word.encode()) % TEXT_VOCAB_SIZE
