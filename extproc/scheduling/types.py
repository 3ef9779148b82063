"""The scheduler's vocabulary: a scheduling ``Cycle`` and the plugin interfaces.

Plugins are small classes registered by name (``registry.BUILTIN``); one instance per
configured name serves every role it has (a plugin may be both a Filter and a Scorer).

* ``Filter``: pods -> fewer pods.
* ``Scorer``: pods -> a score 0..100 each; the scheduler adds ``weight * score``.
* ``Recorder``: learns from a response that ended successfully (``record``).
* ``PodsListener``: told when the set of known pods changes (e.g. to drop state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry

from extproc.prefix.hashing import BlockHash, hash_prompt
from extproc.prefix.index import Keys, as_keys
from extproc.request import InferenceRequest
from extproc.types import Pod, PodId


@dataclass(slots=True)
class Cycle:
    """One request's pass through the scheduler; plugins share work through it."""

    request: InferenceRequest
    _hashes: dict[tuple[int, int], list[BlockHash]] = field(default_factory=dict)
    _keys: dict[tuple[int, int], Keys] = field(default_factory=dict)

    def block_hashes(self, block_size: int, max_blocks: int) -> list[BlockHash]:
        """The prompt's chained block hashes, computed once per block geometry."""
        key = (block_size, max_blocks)
        hashes = self._hashes.get(key)
        if hashes is None:
            req = self.request
            hashes = hash_prompt(req.model, req.prompt, block_size, max_blocks, req.cache_salt)
            self._hashes[key] = hashes
        return hashes

    def block_keys(self, block_size: int, max_blocks: int) -> Keys:
        """``block_hashes`` as the int64 array ``PrefixIndex`` takes, converted once."""
        key = (block_size, max_blocks)
        keys = self._keys.get(key)
        if keys is None:
            keys = self._keys[key] = as_keys(self.block_hashes(block_size, max_blocks))
        return keys


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a plugin may use when it is built: where to register its metrics."""

    registry: CollectorRegistry


class Plugin(Protocol):
    type_name: ClassVar[str]

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> Plugin: ...


@runtime_checkable
class Filter(Protocol):
    type_name: ClassVar[str]

    def filter(self, cycle: Cycle, pods: Sequence[Pod]) -> Sequence[Pod]: ...


@runtime_checkable
class Scorer(Protocol):
    type_name: ClassVar[str]

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        """0..100 per pod; pods left out score 0."""
        ...


@runtime_checkable
class Recorder(Protocol):
    def record(self, cycle: Cycle, pod: PodId) -> None:
        """Called once, after ``pod`` served the request's response to its end."""
        ...


@runtime_checkable
class PodsListener(Protocol):
    def pods_changed(self, pods: Sequence[Pod]) -> None:
        """The known pods are now exactly ``pods``."""
        ...
