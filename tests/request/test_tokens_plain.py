"""SegmentTokenizer with tokenizers of its own making (testkit.factories), so these run
without the e2e model: the segment cut with and without added tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from extproc.request.tokens import SegmentTokenizer
from testkit.factories import write_tokenizer


def test_added_tokens_cut_the_text_into_memoized_segments(tmp_path: Path) -> None:
    tok = SegmentTokenizer(write_tokenizer(tmp_path))
    text = "<|im_start|>hello world<|im_end|>hello"
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    assert tok.tokens(text) == whole == [6, 1, 2, 7, 1]
    assert (tok.misses, tok.hits) == (2, 0)


def test_a_tokenizer_without_added_tokens_tokenizes_the_text_as_one_segment(
    tmp_path: Path,
) -> None:
    write_tokenizer(tmp_path)
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    doc["added_tokens"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    tok = SegmentTokenizer(tmp_path)
    assert tok.added == {}
    assert tok.tokens("hello world hello") == [1, 2, 1]
    assert (tok.misses, tok.hits) == (1, 0)


def test_a_chat_template_that_does_not_compile_is_refused_with_its_directory(
    tmp_path: Path,
) -> None:
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}\n{% endfo %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=rf"{tmp_path}: the chat template does not compile: line 2"
    ):
        SegmentTokenizer(tmp_path)
