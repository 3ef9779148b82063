"""The last Kthena parity points of issue 33, each a table of cases from Kthena's code
(``plugins/prefix_cache.go``, ``conf/conf.go``, ``factory.go``,
``datastore/model_server.go``, ``scheduler_impl.go``) or its tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.errors import ConfigError
from extproc.pods import Pod, PodMetrics
from extproc.scheduling.args import load_args
from extproc.scheduling.config import build_scheduler, parse_config
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.pdgroup import PDGroup
from extproc.scheduling.plugins.least_request import LeastRequest
from extproc.scheduling.plugins.precise_prefix_cache import PreciseArgs
from extproc.scheduling.plugins.prefix_cache import PrefixCacheArgs, PrefixCacheScorer
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_cycle, make_pod

BLOCK = 64  # prefix-cache's default blockSizeToHash


# 1. The prefix score: Kthena's int((float64(matched) / float64(total)) * 100).


@pytest.mark.parametrize(
    ("matched", "hashed", "score"),
    [
        pytest.param(29, 50, 57, id="29-of-50-is-57-not-58"),
        pytest.param(57, 100, 56, id="57-of-100-is-56"),
        pytest.param(58, 100, 57, id="58-of-100-is-57"),
        pytest.param(24, 32, 75, id="spec-24-of-32"),
        pytest.param(10, 11, 90, id="truncated-not-rounded"),
        pytest.param(1, 3, 33, id="one-third"),
        pytest.param(50, 50, 100, id="whole-prompt"),
    ],
)
def test_prefix_score_is_kthenas_float_arithmetic_truncated(
    matched: int, hashed: int, score: int
) -> None:
    """Both scoring paths (per pod, per snapshot row) give Kthena's number."""
    plugin = PrefixCacheScorer.from_args({}, PluginContext(CollectorRegistry()))
    held, other = make_pod("held"), make_pod("other")
    prompt = "p" * (hashed * BLOCK)
    plugin.record(make_cycle(prompt[: matched * BLOCK]), held.id)
    assert plugin.score(make_cycle(prompt), [held, other]) == {held.id: score}
    rows = plugin.score_table(
        make_cycle(prompt), PodTable([held, other]), np.arange(2, dtype=np.int64)
    )
    assert rows.tolist() == [score, 0]


# 2. A score weight: the spec refuses a missing, 0 or negative one; Kthena's code at
# conf.go/factory.go takes a missing one as 0 and a negative one as 0 (logged). The spec
# is not silent, so extproc follows it (the parity page lists the difference).


def weight_config(weight: str | None) -> str:
    line = "" if weight is None else f", weight: {weight}"
    return f"scheduler:\n  plugins:\n    Score:\n      enabled:\n        - {{name: prefix-cache{line}}}\n"


@pytest.mark.parametrize(
    ("weight", "got"),
    [
        pytest.param(None, "got 0", id="missing-kthena-code-0"),
        pytest.param("null", "got 0", id="null-kthena-code-0"),
        pytest.param("0", "got 0", id="zero-kthena-code-0"),
        pytest.param("-3", "got -3", id="negative-kthena-code-logged-then-0"),
    ],
)
def test_a_weight_that_is_not_positive_stops_start_up_as_the_spec_says(
    weight: str | None, got: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(weight_config(weight), "cm.yaml")
    assert str(info.value).endswith(
        f'score plugin "prefix-cache" must set a weight greater than 0, {got}'
    )


@pytest.mark.parametrize("weight", [1, 2, 100])
def test_a_positive_weight_is_taken_as_written(weight: int) -> None:
    config = parse_config(weight_config(str(weight)), "cm.yaml")
    assert [(s.name, s.weight) for s in config.scores] == [("prefix-cache", weight)]


# 3. An invalid argument resets only that argument (Kthena's per-field ``<= 0`` checks);
# a value that cannot be decoded (a string, a fraction for an int) resets prefix-cache's
# whole block, as its code and the spec do ("all four arguments fall back").

CUSTOM = {
    "blockSizeToHash": 32,
    "maxBlocksToMatch": 256,
    "maxHashCacheSize": 1000,
    "topKMatches": 3,
}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param({"blockSizeToHash": 0, "maxBlocksToMatch": 0}, {}, id="kthena-zero-values"),
        pytest.param(
            {"blockSizeToHash": -10, "maxBlocksToMatch": -20}, {}, id="kthena-negative-values"
        ),
        pytest.param(
            {**CUSTOM, "blockSizeToHash": -1},
            {**CUSTOM, "blockSizeToHash": 64},
            id="one-negative-only-that-one",
        ),
        pytest.param(
            {**CUSTOM, "topKMatches": 0}, {**CUSTOM, "topKMatches": 5}, id="one-zero-only-that-one"
        ),
        pytest.param(
            {**CUSTOM, "maxHashCacheSize": float("inf")}, {}, id="an-infinity-the-whole-block"
        ),
        pytest.param({**CUSTOM, "topKMatches": "three"}, {}, id="a-string-the-whole-block"),
        pytest.param({**CUSTOM, "topKMatches": 2.5}, {}, id="a-fraction-the-whole-block"),
    ],
)
def test_prefix_cache_args(raw: dict[str, Any], expected: dict[str, int]) -> None:
    assert load_args(PrefixCacheArgs, raw) == PrefixCacheArgs(**expected)


KVCACHE = """scheduler:
  plugins:
    Score:
      enabled: [{name: kvcache-aware, weight: 1}]
  pluginConfig:
  - {name: precise-prefix-cache, args: {capacityBlocks: 1000, cpuWeight: 0.25}}
  - name: kvcache-aware
    args: {blockSizeToHash: VALUE, maxBlocksToMatch: 256}
"""


@pytest.mark.parametrize(
    ("value", "block_size"),
    [
        pytest.param("32", 32, id="read-as-blockSize"),
        pytest.param("0", 16, id="zero-default"),
        pytest.param("-8", 16, id="negative-default"),
        pytest.param("big", 16, id="a-string-only-that-one"),
        pytest.param("1.5", 16, id="a-fraction-only-that-one"),
        pytest.param("true", 16, id="a-bool-only-that-one"),
    ],
)
def test_kvcache_aware_invalid_block_size_resets_only_that_argument(
    value: str, block_size: int
) -> None:
    """Kthena's kvcache-aware keeps its other args when one fails to decode (it logs and
    goes on); carried into precise-prefix-cache, it must not reset that plugin's own."""
    config = parse_config(KVCACHE.replace("VALUE", value), "cm.yaml")
    args = load_args(PreciseArgs, config.plugin_args["precise-prefix-cache"])
    assert (args.blockSize, args.capacityBlocks, args.cpuWeight) == (block_size, 1000, 0.25)


# 4. PD labels: Kthena's matchesLabels compares podLabels[key] != value, and a Go map
# gives "" for a missing key.

GROUP, ROLE, TIER = "group", "role", "tier"


def labelled(**labels: str) -> Pod:
    return replace(make_pod("p"), labels=tuple(sorted(labels.items())))


@pytest.mark.parametrize(
    ("decode_labels", "labels", "is_decode"),
    [
        pytest.param({}, {ROLE: "decode"}, False, id="no-required-labels-match-nothing"),
        pytest.param({ROLE: "decode"}, {ROLE: "decode"}, True, id="equal"),
        pytest.param({ROLE: "decode"}, {ROLE: "prefill"}, False, id="other-value"),
        pytest.param({ROLE: "decode"}, {}, False, id="missing"),
        pytest.param({TIER: ""}, {}, True, id="empty-required-missing-matches"),
        pytest.param({TIER: ""}, {TIER: ""}, True, id="empty-required-empty-matches"),
        pytest.param({TIER: ""}, {TIER: "gold"}, False, id="empty-required-set-does-not"),
        pytest.param({ROLE: "decode", TIER: ""}, {ROLE: "decode"}, True, id="both-rules"),
        pytest.param({ROLE: "decode", TIER: ""}, {}, False, id="one-of-two-missing"),
    ],
)
def test_pd_labels_read_a_missing_label_as_empty(
    decode_labels: dict[str, str], labels: dict[str, str], is_decode: bool
) -> None:
    """The same rule for decode and prefill labels, per pod and per snapshot."""
    pod = labelled(**{GROUP: "g1"}, **labels)
    for side in ("decodeLabels", "prefillLabels"):
        pd = PDGroup.parse({"groupKey": GROUP, side: decode_labels}, "pdGroup")
        matches = pd.is_decode if side == "decodeLabels" else pd.is_prefill
        columns = pd.columns(PodTable([pod]))
        column = columns.is_decode if side == "decodeLabels" else columns.is_prefill
        assert (matches(pod), bool(column[0])) == (is_decode, is_decode)


# 5. A filter listed twice: Kthena's getFilterPlugins appends it twice and runs both (its
# plugin-duration metric observed twice); extproc runs it once. The pods are the same, as
# each filter keeps what it would keep again (tested below for least-request).


@pytest.mark.parametrize("times", [2, 3])
def test_a_filter_listed_more_than_once_runs_once(
    times: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = LeastRequest.filter_table

    def counted(self: LeastRequest, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(LeastRequest, "filter_table", counted)
    names = ", ".join(["least-request"] * times)
    text = (
        f"scheduler:\n  plugins:\n    Filter:\n      enabled: [{names}]\n"
        "    Score:\n      enabled: [{name: gpu-usage, weight: 1}]\n"
    )
    scheduler = build_scheduler(parse_config(text, "cm.yaml"), CollectorRegistry())
    busy = replace(make_pod("busy", port=8001), metrics=PodMetrics(waiting=10))
    picked = scheduler.schedule(make_cycle("x"), [make_pod("idle"), busy])
    assert (len(calls), picked[0].id.name) == (1, "idle")


@pytest.mark.parametrize("waiting", [[0, 10], [9, 10, 11], [0, 0], [12, 3, 10, 1]])
def test_running_least_request_twice_keeps_what_once_keeps(waiting: list[int]) -> None:
    """Why running once is no difference in the pods that pass."""
    plugin = LeastRequest.from_args(None, PluginContext(CollectorRegistry()))
    pods = [
        replace(make_pod(f"p{i}", port=8000 + i), metrics=PodMetrics(waiting=w))
        for i, w in enumerate(waiting)
    ]
    table, cycle = PodTable(pods), make_cycle("x")
    once = plugin.filter_table(cycle, table, np.arange(len(pods), dtype=np.int64))
    assert plugin.filter_table(cycle, table, once).tolist() == once.tolist()
