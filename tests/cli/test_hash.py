"""``extproc hash`` prints the same hashes as the library."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.cli import main
from extproc.prefix import hash_prompt


def test_hash_command_prints_one_hash_per_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(orjson.dumps({"model": "m", "prompt": "p" * 200, "cache_salt": "s"}))
    assert main(["hash", "--api", "/v1/completions", str(body)]) == 0
    printed = [int(line) for line in capsys.readouterr().out.split()]
    assert printed == hash_prompt("m", "p" * 200, salt="s") and len(printed) == 4


def test_hash_command_reports_bad_bodies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(b"{}")
    assert main(["hash", str(body)]) == 2
    assert "no 'model' field" in capsys.readouterr().err


def test_hash_command_renders_as_kthena_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chat body with a stray ``prompt``: Kthena hashes the prompt, extproc the messages."""
    body = tmp_path / "body.json"
    body.write_bytes(
        orjson.dumps({"model": "m", "prompt": "p", "messages": [{"role": "u", "content": "c"}]})
    )
    assert main(["hash", "--prompt-rendering", "kthena", str(body)]) == 0
    assert [int(x) for x in capsys.readouterr().out.split()] == hash_prompt("m", "p")
    assert main(["hash", str(body)]) == 0
    chatml = "<|im_start|>u\nc<|im_end|>\n"
    assert [int(x) for x in capsys.readouterr().out.split()] == hash_prompt("m", chatml)
