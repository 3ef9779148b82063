"""The kernels' pure reference: the functions ``_compiled.pyx`` must equal, written with
NumPy (no Python step per block or pod)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.int64]
Masks = npt.NDArray[np.int64]  # two dimensions: pages x blocks

_MASK_BITS = np.arange(63, dtype=np.int64)  # the bits of a non-negative int64 mask


class DeepestHeld(Protocol):
    def __call__(self, masks: Masks, first_slots: Keys, places: Keys, out: Keys) -> None: ...


def deepest_held(masks: Masks, first_slots: Keys, places: Keys, out: Keys) -> None:
    """Each slot's deepest block, from owner masks: ``masks[p, i]`` has bit ``b`` set when
    slot ``first_slots[p] + b`` holds block ``i``; for each such slot, ``out`` at its place
    (``places[slot]``, skipped where it is -1) becomes the number of blocks up to its
    deepest held one."""
    held_from = np.bitwise_or.accumulate(masks[:, ::-1], axis=1)[:, ::-1]  # here or later
    ends = held_from.copy()
    ends[:, :-1] &= ~held_from[:, 1:]  # the slots holding this block but no later one
    page_idx, block_idx = np.nonzero(ends)
    bit_set = (ends[page_idx, block_idx][:, np.newaxis] >> _MASK_BITS) & 1 != 0
    match_idx, bit = np.nonzero(bit_set)
    at = places[first_slots[page_idx[match_idx]] + bit]
    found = at >= 0
    out[at[found]] = block_idx[match_idx][found] + 1


class Kernels(NamedTuple):
    deepest_held: DeepestHeld


KERNELS = Kernels(deepest_held)
