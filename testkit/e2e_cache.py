"""Where ``python -m e2e.real_vllm.prepare`` caches what the real-vLLM tests and the
benchmarks need (``$EXTPROC_E2E_CACHE``, default ``~/.cache/extproc-e2e``), and the mark
that skips a test without the cached model's tokenizer, except under CI (``CI`` set, as
CI services do), where ``.ci/run`` prepares the cache and a missing tokenizer must fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def cache_dir() -> Path:
    return Path(os.environ.get("EXTPROC_E2E_CACHE", "~/.cache/extproc-e2e")).expanduser()


def model_dir() -> Path:
    """The tiny Qwen3 model's directory (weights, config and tokenizer files)."""
    return cache_dir() / "model" / "qwen3-tiny"


def under_ci() -> bool:
    """``CI`` set to anything but empty, ``0`` or ``false`` (CI services set ``true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


MODEL_DIR = model_dir()
# Under CI the mark skips nothing: the test runs and fails on the missing files.
needs_model_tokenizer = pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").exists() and not under_ci(),
    reason="run `python -m e2e.real_vllm.prepare`",
)
