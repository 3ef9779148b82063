"""Where ``python -m e2e.real_vllm.prepare`` caches what the real-vLLM tests and the
benchmarks need (``$EXTPROC_E2E_CACHE``, default ``~/.cache/extproc-e2e``), and the mark
that skips a test without the cached model's tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def cache_dir() -> Path:
    return Path(os.environ.get("EXTPROC_E2E_CACHE", "~/.cache/extproc-e2e")).expanduser()


def model_dir() -> Path:
    """The tiny Qwen3 model's directory (weights, config and tokenizer files)."""
    return cache_dir() / "model" / "qwen3-tiny"


MODEL_DIR = model_dir()
needs_model_tokenizer = pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").exists(), reason="run `python -m e2e.real_vllm.prepare`"
)
