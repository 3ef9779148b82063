"""What the precise-prefix-cache tests share: the block size they configure, and storing
token blocks in a pod's view as its engine's KV events would."""

from __future__ import annotations

from extproc.pods import Pod
from extproc.prefix.precise.keys import Tokens
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache

BS = 16


def store(
    plugin: PrecisePrefixCache,
    pod: Pod,
    ids: Tokens,
    salt: str | None = None,
    lora: str | None = None,
) -> None:
    """What the pod's engine would publish after serving ``ids`` (for LoRA adapter
    ``lora``: its blocks' extra keys start with the adapter's name)."""
    tokens = [int(t) for t in ids]  # as the events carry them
    num = len(tokens) // BS
    extra = [
        ([lora] if lora else []) + ([salt] if salt and i == 0 else []) or None for i in range(num)
    ]
    hashes = [hash((pod.id, salt, tuple(tokens[: (i + 1) * BS]))) for i in range(num)]
    plugin.index.stored(pod.id, hashes, None, tokens[: num * BS], BS, extra)
