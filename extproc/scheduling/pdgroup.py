"""Prefill/decode groups read from pod labels, as Kthena's ModelServer ``pdGroup`` does.

Configured by the optional top-level ``pdGroup`` section of the configuration file
(Kthena's ``spec.workloadSelector.pdGroup``, the same keys)::

    pdGroup:
      groupKey: modelserving.volcano.sh/group-name
      prefillLabels: {modelserving.volcano.sh/role: prefill}
      decodeLabels: {modelserving.volcano.sh/role: decode}

Kthena's rules (``datastore/model_server.go``): a pod's group is the value of its
``groupKey`` label; a pod without it (or with an empty value) is in no group and gets no
PD traffic. A pod in a group is a decode pod when it has every ``decodeLabels`` label,
else a prefill pod when it has every ``prefillLabels`` label, else neither; an empty set
of labels matches nothing, and a label required with the value ``""`` matches a pod
without that label (Go reads a missing map key as ``""``). Only a decode pod and a
prefill pod of the same group pair up.

With the section, the pods' own ``role`` (pods file, role label) is not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc.errors import ConfigError
from extproc.pods import Pod
from extproc.scheduling.podtable import PodTable

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PDColumns:
    """A snapshot's rows as ``PDGroup`` sees them."""

    group: npt.NDArray[np.object_]  # the group value, None outside every group
    is_decode: npt.NDArray[np.bool_]
    is_prefill: npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class PDGroup:
    group_key: str
    prefill_labels: Labels
    decode_labels: Labels

    @classmethod
    def parse(cls, raw: Any, where: str) -> PDGroup:
        """The ``pdGroup`` section; ``ConfigError`` naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping with groupKey, prefillLabels, ...")
        key = raw.get("groupKey")
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}.groupKey: expected a non-empty label name")
        return cls(
            key,
            _labels(raw.get("prefillLabels"), f"{where}.prefillLabels"),
            _labels(raw.get("decodeLabels"), f"{where}.decodeLabels"),
        )

    def group(self, pod: Pod) -> str | None:
        return pod.label(self.group_key) or None

    def is_decode(self, pod: Pod) -> bool:
        return _matches(pod, self.decode_labels)

    def is_prefill(self, pod: Pod) -> bool:
        return not self.is_decode(pod) and _matches(pod, self.prefill_labels)

    def columns(self, table: PodTable) -> PDColumns:
        """This snapshot's groups and roles, computed once per snapshot (labels may
        change while ids and models stay)."""
        return table.memo((self, "pd"), lambda: self._columns(table))

    def _columns(self, table: PodTable) -> PDColumns:
        n = len(table)
        group = np.empty(n, dtype=object)
        group[:] = [self.group(p) for p in table.pods]
        grouped = np.fromiter((g is not None for g in group), np.bool_, n)
        decode = np.fromiter(map(self.is_decode, table.pods), np.bool_, n) & grouped
        prefill = np.fromiter(map(self.is_prefill, table.pods), np.bool_, n) & grouped
        return PDColumns(group, decode, prefill)


def _matches(pod: Pod, required: Labels) -> bool:
    """Kthena's ``matchesLabels``: every required label, and at least one. A missing
    label reads as ``""`` (a Go map's zero value), so one required as ``""`` matches a
    pod without it."""
    return bool(required) and all((pod.label(k) or "") == v for k, v in required)


def _labels(raw: Any, where: str) -> Labels:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise ConfigError(f"{where}: expected a mapping of label names to string values")
    return tuple(sorted(raw.items()))
