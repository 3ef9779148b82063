"""LoRA adapters as vLLM 0.32 serves them (``--enable-lora``).

Three parts, each where vLLM keeps it:

- ``LoraRegistry``: the API server's adapters (``OpenAIServingModels.lora_requests``):
  those of ``--lora-modules`` at start, then ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` at run time, with vLLM's messages, error types and
  statuses. An adapter gets ``lora_int_id`` 1, 2, ... in the order of its first load
  (the KV events' ``lora_id``); a reload in place keeps it. Unloading only forgets the
  name, as vLLM 0.32 does: requests in flight finish, and the engine keeps the weights
  in its slot until evicted.
- ``AdapterSlots``: the worker's GPU slots (``--max-loras``), least recently used first
  out. The engine's scheduler lets at most ``max_loras`` distinct adapters into a step,
  so an adapter the step needs always finds a slot held by one it does not.
- ``parse_lora_module``: ``--lora-modules`` entries, ``name=path`` or vLLM's JSON form.

Not modelled: vLLM's CPU cache of adapters (``--max-cpu-loras``, default ``max_loras``,
so with the defaults an adapter entering a slot is read from disk anyway, which the
engine's ``lora_load_ms`` stands for); the preload of an adapter into a slot when it is
registered (the sim's slots start empty, so every load is due to a request); LoRA's
extra compute per step; resolver plugins.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from extproc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """vLLM's ``LoRARequest`` as the engine sees it."""

    name: str
    int_id: int  # lora_int_id, from 1
    path: str


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoraModule:
    """``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}`` (other keys ignored).

    Raises:
        ConfigError: neither form, or an empty name or path.
    """
    if "=" in text and "," not in text:
        name, path = text.split("=", 1)
    else:
        try:
            entry: Any = json.loads(text)
            name, path = entry["name"], entry["path"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise ConfigError(
                f"--lora-modules entry {text!r} is neither name=path nor "
                '{"name": ..., "path": ...}'
            ) from None
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ConfigError(f"--lora-modules entry {text!r} needs a non-empty name and path")
    return LoraModule(name, path)


class LoraError(Exception):
    """A load or unload refused, with vLLM's status, message and error type."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


class LoraRegistry:
    """The adapters one pod serves on top of ``base_model``; see the module docstring."""

    def __init__(self, base_model: str, modules: Iterable[LoraModule] = ()) -> None:
        self.base_model = base_model
        self._adapters: dict[str, LoraRequest] = {}
        self._last_id = 0
        for module in modules:
            try:
                self.load(module.name, module.path)
            except LoraError as e:  # vLLM refuses to start on a bad static module
                raise ConfigError(f"--lora-modules {module.name}={module.path}: {e}") from None

    def get(self, name: str) -> LoraRequest | None:
        return self._adapters.get(name)

    def names(self) -> tuple[str, ...]:
        """In the order vLLM lists them: of their first load."""
        return tuple(self._adapters)

    def load(self, name: str, path: str, load_inplace: bool = False) -> LoraRequest:
        """Register ``name`` at ``path`` (vLLM's checks, in its order).

        Raises:
            LoraError: 400 for an empty field, the base model's name, or a name already
                loaded without ``load_inplace``.
        """
        if not name or not path:
            raise LoraError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                            "InvalidUserInput")  # fmt: skip
        if name == self.base_model:
            raise LoraError(400, f"The lora adapter '{name}' conflicts with a served base "
                            "model.", "InvalidUserInput")  # fmt: skip
        previous = self._adapters.get(name)
        if previous is not None and not load_inplace:
            raise LoraError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if previous is None:
            self._last_id += 1
        adapter = LoraRequest(name, previous.int_id if previous else self._last_id, path)
        self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget ``name``.

        Raises:
            LoraError: 400 for an empty name, 404 for one not loaded.
        """
        if not name:
            raise LoraError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "InvalidUserInput")  # fmt: skip
        if name not in self._adapters:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self._adapters[name]

    def cards(self) -> list[dict[str, Any]]:
        """The adapters' ``/v1/models`` entries, as vLLM lists them after the base model's."""
        return [
            {"id": a.name, "object": "model", "created": 0, "owned_by": "vllm",
             "root": a.path, "parent": self.base_model, "max_model_len": None}
            for a in self._adapters.values()
        ]  # fmt: skip


class AdapterSlots:
    """``max_loras`` GPU slots holding adapters by ``lora_int_id``, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[int, LoraRequest] = OrderedDict()  # oldest use first

    @property
    def resident(self) -> tuple[LoraRequest, ...]:
        """The adapters in slots, least recently used first."""
        return tuple(self._slots.values())

    def bring_in(self, batch: Collection[LoraRequest]) -> list[LoraRequest]:
        """Make every adapter of a step's ``batch`` resident; returns those loaded now.

        The batch's adapters are touched first, so a load evicts the least recently used
        adapter the step does not need.
        """
        if len({a.int_id for a in batch}) > self.max_loras:
            raise ValueError(f"a step needs {len(batch)} adapters but has {self.max_loras} slots")
        loaded: list[LoraRequest] = []
        for adapter in batch:
            if adapter.int_id in self._slots:
                self._slots.move_to_end(adapter.int_id)
        for adapter in batch:
            if adapter.int_id in self._slots:
                continue
            if len(self._slots) == self.max_loras:
                self._slots.popitem(last=False)
            self._slots[adapter.int_id] = adapter
            loaded.append(adapter)
        return loaded

    def drop(self, int_id: int) -> None:
        """Forget a slot's weights (a reload in place): its next use loads them again."""
        self._slots.pop(int_id, None)
