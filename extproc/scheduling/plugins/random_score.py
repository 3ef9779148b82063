"""random (Score): a uniformly random score for each pod (Kthena's random plugin).

Kthena's ``random.go``: every pod scores an integer drawn uniformly from 0 to 100
(inclusive), independently for each request; meant for testing, alone, since random
scores mixed with others only blur them. Kthena's plugin reads no arguments; extproc's
takes an optional ``seed`` so that a benchmark or a simulation repeats its picks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from extproc.pods import Pod, PodId
from extproc.scheduling.args import arg, load_args
from extproc.scheduling.interfaces import Cycle, PluginContext, Scores
from extproc.scheduling.podtable import PodTable, Positions

MAX_SCORE = 100


@dataclass(frozen=True, slots=True)
class RandomArgs:
    seed: int = arg(0, "Seeds the draws, so that a run repeats its scores (0: unseeded).")


class Random:
    """Scores each pod uniformly at random, 0 to 100."""

    type_name: ClassVar[str] = "random"
    args_type: ClassVar[type[RandomArgs]] = RandomArgs

    def __init__(self, rng: np.random.Generator) -> None:
        # NumPy's generators take a lock per call: safe from any thread.
        self.rng = rng

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> Random:
        seed = load_args(cls.args_type, args).seed
        return cls(np.random.default_rng(seed or None))

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        scores = self.rng.integers(0, MAX_SCORE, size=len(pods), endpoint=True)
        return dict(zip((p.id for p in pods), scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        scores: Scores = self.rng.integers(
            0, MAX_SCORE, size=len(positions), dtype=np.int64, endpoint=True
        )
        return scores
