"""A pod's LoRA adapters, from its OpenAI ``/v1/models`` page.

vLLM lists there its base models (``parent`` null) and every LoRA adapter loaded, at
start-up (``--lora-modules``) or at run time (``/v1/load_lora_adapter``), with
``parent`` the base model it adapts. An entry whose ``parent`` is one of the pod's
models (from the pods file or Kubernetes) is an adapter the pod serves; other entries
are ignored, base models included (the pods source names those).

``MetricsScraper`` reads the page on its own interval (``--models-interval-s``) and
``PodStore`` adds the adapters found to the pod's ``models`` and ``adapters``.
The page is decoded by msgspec into just the two fields read (the others are skipped
unparsed), so a read costs little next to a ``/metrics`` scrape.
"""

from __future__ import annotations

from typing import Final

import msgspec

MODELS_PAGE: Final = "/v1/models"


class _ModelCard(msgspec.Struct):
    id: str
    parent: str | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


_DECODER: Final = msgspec.json.Decoder(_ModelList)


def parse_adapters(page: bytes, models: frozenset[str]) -> frozenset[str]:
    """The ids on a ``/v1/models`` page whose ``parent`` is one of ``models``.

    Raises:
        ValueError: the page is not an OpenAI model list (msgspec names what is wrong).
    """
    listed = _DECODER.decode(page).data
    return frozenset(card.id for card in listed if card.parent in models and card.id)
