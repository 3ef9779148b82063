"""estimated-ttft's costs, from which it scores, on its per-pod and its table path (the
tests compare the two and check the formula's terms)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from extproc.pods import Pod, PodId
from extproc.scheduling.interfaces import Cycle
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT
from extproc.scheduling.podtable import PodTable, Positions


def costs(plugin: EstimatedTTFT, cycle: Cycle, pods: Sequence[Pod]) -> dict[PodId, float]:
    """``est_ms + write_ms`` with the affinity pods' hysteresis applied, per pod (``score``)."""
    return plugin._costs(cycle, pods, plugin.matched_blocks(cycle, pods))


def costs_table(
    plugin: EstimatedTTFT, cycle: Cycle, table: PodTable, positions: Positions
) -> npt.NDArray[np.float64]:
    """The same costs per row of ``positions`` (ascending), as ``score_table`` has them."""
    return plugin._table_pass(cycle, table, positions)[0]
