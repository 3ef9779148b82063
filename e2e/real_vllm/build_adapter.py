"""Build a tiny LoRA adapter for the tiny Qwen3; run by the vLLM venv's Python (with peft).

    VLLM_VENV/bin/python e2e/real_vllm/build_adapter.py MODEL_DIR OUT_DIR SEED RANK

Rank RANK (``prepare.LORA_RANK``, which the pods' ``--max-lora-rank`` allows) on the
attention projections (q, k, v, o) of both layers, saved as peft writes it
(``adapter_config.json``, ``adapter_model.safetensors``), which is what vLLM's
``--lora-modules NAME=PATH`` loads. Both matrices are random (peft's default leaves B at
zero, an adapter that changes nothing), seeded, so two seeds give two adapters whose
answers differ from the base model's. Nothing is downloaded. This file imports only what
the vLLM venv has (torch, transformers, peft), never extproc.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build(model: Path, out: Path, seed: int, rank: int) -> None:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGET_MODULES,
        init_lora_weights=False,  # random A and B: the adapter changes the output
        task_type="CAUSAL_LM",
    )
    adapter = get_peft_model(base, config)
    out.mkdir(parents=True, exist_ok=True)
    adapter.save_pretrained(out, safe_serialization=True)
    if not (out / "adapter_model.safetensors").exists():
        raise FileNotFoundError(f"peft wrote no adapter_model.safetensors in {out}")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
