"""least-latency (Score): favour pods whose recent TTFT and inter-token latency are low.

Kthena's least-latency plugin (``least_latency.go``):

* inputs: ``Pod.metrics.ttft_s`` and ``.itl_s`` (Kthena's TPOT), each the mean over the
  last scrape window (``extproc.datalayer.engine_metrics``), ``None`` without recent
  observations; a value of 0 or below counts as none, as in Kthena;
* a pod missing either scores a flat 50 (``MaxScore / 2``);
* the others: per metric, over the candidates that have both,
  ``s = 100 * (max - x) / (max - min)``, 100 for all when ``max == min``;
  ``score = int(f * s_ttft + (1 - f) * s_itl)``, ``f = TTFTTPOTWeightFactor`` (default
  0.5; 0 ranks by ITL only, 1 by TTFT only).

``TTFTTPOTWeightFactor`` outside [0, 1], NaN, infinite or not a number stops start-up
(``check_args``, called by the configuration loader), with Kthena's message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from extproc.pods import Pod, PodId
from extproc.scheduling.args import arg, load_args
from extproc.scheduling.interfaces import Cycle, PluginContext, Scores
from extproc.scheduling.podtable import PodTable, Positions

NO_DATA_SCORE = 50  # Kthena's int(MaxScore / 2)


@dataclass(frozen=True, slots=True)
class LeastLatencyArgs:
    TTFTTPOTWeightFactor: float = arg(
        0.5,
        "Weight of TTFT against ITL (Kthena's TPOT) in the score: 0 ranks by ITL only, 1 by "
        "TTFT only; a value outside 0 to 1 stops start-up.",
        within=(0.0, 1.0),
    )


def check_least_latency_args(raw: Any) -> str | None:
    """Kthena's ``ValidateLeastLatencyArgs``: why ``raw`` is refused, or None.

    Go decodes the args as JSON into a struct: keys match case-insensitively, a null
    leaves the default, a value that is not a number cannot be decoded.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return (
            "unmarshal least-latency arguments: error unmarshaling JSON: while decoding JSON: "
            f"json: cannot unmarshal {_go_json_type(raw)} into Go value of type "
            "plugins.LeastLatencyArgs"
        )
    weight = 0.5
    for key, value in raw.items():
        if not isinstance(key, str) or key.lower() != "ttfttpotweightfactor" or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return (
                "unmarshal least-latency arguments: error unmarshaling JSON: while decoding "
                f"JSON: json: cannot unmarshal {_go_json_type(value)} into Go struct field "
                "LeastLatencyArgs.TTFTTPOTWeightFactor of type float64"
            )
        weight = float(value)
    if not 0.0 <= weight <= 1.0:  # False for NaN and infinities too
        return (
            f"TTFTTPOTWeightFactor must be a finite value between 0 and 1, got {go_float(weight)}"
        )
    return None


def _go_json_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def go_float(value: float) -> str:
    """``value`` as Go's ``%v`` prints a float64: shortest digits, exponent form from
    1e6 up or below 1e-4 (``strconv.FormatFloat(v, 'g', -1, 64)``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    text = "".join(map(str, digits)) or "0"
    point = len(text) + int(exponent)  # decimal point position
    if value == 0:
        return "-0" if sign else "0"
    x = point - 1
    if x < -4 or x >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        out = f"{mantissa}e{'-' if x < 0 else '+'}{abs(x):02d}"
    elif point <= 0:
        out = "0." + "0" * -point + text
    elif point >= len(text):
        out = text + "0" * (point - len(text))
    else:
        out = text[:point] + "." + text[point:]
    return ("-" if sign else "") + out


class LeastLatency:
    """Scores pods by recent TTFT and ITL, normalised over the candidates."""

    type_name: ClassVar[str] = "least-latency"
    args_type: ClassVar[type[LeastLatencyArgs]] = LeastLatencyArgs

    def __init__(self, args: LeastLatencyArgs) -> None:
        self.args = args

    @classmethod
    def from_args(cls, args: Any, ctx: PluginContext) -> LeastLatency:
        return cls(load_args(cls.args_type, args))

    def score(self, cycle: Cycle, pods: Sequence[Pod]) -> Mapping[PodId, int]:
        table = PodTable(pods)
        scores = self.score_table(cycle, table, table.all_positions())
        return dict(zip(table.ids, scores.tolist(), strict=True))

    def score_table(self, cycle: Cycle, table: PodTable, positions: Positions) -> Scores:
        """The same for every request of a snapshot: computed once per candidate set."""
        return table.memo((self, positions.tobytes()), lambda: self._score(table, positions))

    def _score(self, table: PodTable, positions: Positions) -> Scores:
        ttft, itl = table.ttft_s[positions], table.itl_s[positions]
        known = table.has_ttft[positions] & table.has_itl[positions] & (ttft > 0) & (itl > 0)
        scores = np.full(len(positions), NO_DATA_SCORE, dtype=np.int64)
        if known.any():
            f = self.args.TTFTTPOTWeightFactor
            mixed = f * _normalised(ttft[known]) + (1 - f) * _normalised(itl[known])
            scores[known] = mixed.astype(np.int64)  # truncates toward zero, as int() does
        scores.flags.writeable = False  # shared by the snapshot's requests
        return scores


def _normalised(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """100 for the lowest value down to 0 for the highest; 100 for all when equal."""
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        return np.full(len(values), 100.0)
    normalised: npt.NDArray[np.float64] = 100.0 * (hi - values) / (hi - lo)
    return normalised
