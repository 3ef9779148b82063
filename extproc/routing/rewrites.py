"""Model rewrites and weighted splits: the ``modelRewrites`` section and the Gateway API
Inference Extension's ``InferenceModelRewrite`` rules -> the model a request really goes to.

Format: a list of rules, each the ``spec.rules[*]`` of an ``InferenceModelRewrite``::

    modelRewrites:
      - matches: [{model: {value: food-review}}]     # type: Exact (the only type) is implied
        targets:
          - {modelRewrite: food-review-v2, weight: 90}
          - {modelRewrite: food-review-v1, weight: 10}
      - matches: [{model: chat}]                     # short form: the value alone
        targets: [{modelRewrite: chat-2025-06}]      # one target: a plain rewrite

A rule matches when the body's ``model`` equals one of its ``matches`` (a rule without
``matches`` matches every model no other rule names: at most one such rule). Weights are
integers from 0 to 1,000,000, all given or all left out (then equal), summing above 0.
One rewrite at most: a target is not matched again.

Where both are used, the file's rule for a model wins over a watched object's
(``merged``); among the objects the oldest wins, then the first rule in it, as the
Inference Extension orders them.

The split is deterministic per session key (its hash placed into the weights: a session
stays on one target while the weights stay), random without one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.errors import ConfigError
from extproc.pods import Pod
from extproc.request.parse import load_body

log = logging.getLogger(__name__)

MAX_WEIGHT = 1_000_000  # the Inference Extension's bound
_RULE_KEYS = {"matches", "targets"}
_MATCH_KEYS = {"model"}
_MODEL_MATCH_KEYS = {"type", "value"}
_TARGET_KEYS = {"modelRewrite", "weight"}


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    weight: int


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """One rule: the models it matches (empty: any other) and its weighted targets."""

    models: tuple[str, ...]
    targets: tuple[Target, ...]
    where: str  # names the rule in messages: its file and index, or its object
    _bounds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds, total = [], 0
        for target in self.targets:
            total += target.weight
            bounds.append(total)
        object.__setattr__(self, "_bounds", tuple(bounds))

    def choose(self, session_key: str | None) -> str:
        """The target model: by the session key's hash when there is one, else at random."""
        total = self._bounds[-1]
        if session_key is None:
            point = random.randrange(total)
        else:
            digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "big") % total
        return self.targets[bisect.bisect_right(self._bounds, point)].model


@dataclass(frozen=True, slots=True)
class Rewrites:
    """The rules in force, looked up by the request's model."""

    by_model: Mapping[str, RewriteRule] = field(default_factory=dict)
    any_model: RewriteRule | None = None

    def rule_for(self, model: str) -> RewriteRule | None:
        rule = self.by_model.get(model)
        return rule if rule is not None else self.any_model

    @property
    def rules(self) -> list[RewriteRule]:
        """Each rule once, in force (for the admin page)."""
        unique = {id(r): r for r in self.by_model.values()}
        if self.any_model is not None:
            unique[id(self.any_model)] = self.any_model
        return list(unique.values())


NO_REWRITES = Rewrites()


def merged(file_rules: Sequence[RewriteRule], watched: Sequence[RewriteRule]) -> Rewrites:
    """The rules in force: for each model (and for any model), the file's rule, else the
    first watched one (``watched`` comes oldest object first)."""
    by_model: dict[str, RewriteRule] = {}
    any_model = None
    for rule in [*file_rules, *watched]:
        for model in rule.models:
            by_model.setdefault(model, rule)
        if not rule.models and any_model is None:
            any_model = rule
    return Rewrites(by_model, any_model)


def parse_model_rewrites(section: Any, source: str) -> tuple[RewriteRule, ...]:
    """The ``modelRewrites`` section (None: no rules).

    Raises:
        ConfigError: a malformed rule, a bad weight or a model matched twice, named.
    """
    if section is None:
        return ()
    rules = parse_rules(section, f"{source}: modelRewrites")
    _refuse_overlaps(rules)
    return rules


def parse_rules(section: Any, where: str) -> tuple[RewriteRule, ...]:
    """A list of ``InferenceModelRewrite`` rules (``where``: names the list).

    Raises:
        ConfigError: a malformed rule or weight, named.
    """
    if not isinstance(section, list):
        raise ConfigError(f"{where} must be a list of rules, got {type(section).__name__}")
    return tuple(_rule(raw, f"{where}[{i}]") for i, raw in enumerate(section))


def _rule(raw: Any, where: str) -> RewriteRule:
    rule = _mapping(raw, where, _RULE_KEYS)
    matches = rule.get("matches") or []
    if not isinstance(matches, list):
        raise ConfigError(f"{where}.matches must be a list, got {type(matches).__name__}")
    models = tuple(_match(m, f"{where}.matches[{i}]") for i, m in enumerate(matches))
    if len(set(models)) != len(models):
        raise ConfigError(f"{where}.matches names a model twice")
    named = f"{where} ({', '.join(models) or 'any model'})"
    targets = _targets(rule.get("targets"), named)
    return RewriteRule(models, targets, named)


def _match(raw: Any, where: str) -> str:
    model = _mapping(raw, where, _MATCH_KEYS).get("model")
    if isinstance(model, dict):
        spec = _mapping(model, f"{where}.model", _MODEL_MATCH_KEYS)
        kind = spec.get("type", "Exact")
        if kind != "Exact":
            raise ConfigError(f"{where}.model.type must be Exact (the only type), got {kind!r}")
        model = spec.get("value")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}.model must name a model, got {model!r}")
    return model


def _targets(raw: Any, where: str) -> tuple[Target, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: targets must be a non-empty list, got {raw!r}")
    entries = [_mapping(t, f"{where}: targets[{i}]", _TARGET_KEYS) for i, t in enumerate(raw)]
    weighted = sum("weight" in t for t in entries)
    if weighted not in (0, len(entries)):
        raise ConfigError(f"{where}: give every target a weight, or none (equal weights)")
    targets = []
    for i, entry in enumerate(entries):
        model = entry.get("modelRewrite")
        if not isinstance(model, str) or not model:
            raise ConfigError(
                f"{where}: targets[{i}].modelRewrite must name a model, got {model!r}"
            )
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
            raise ConfigError(
                f"{where}: targets[{i}].weight must be an integer from 0 to {MAX_WEIGHT}, "
                f"got {weight!r}"
            )
        targets.append(Target(model, weight))
    names = [t.model for t in targets]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: a target model is named twice: {', '.join(names)}")
    if sum(t.weight for t in targets) == 0:
        raise ConfigError(f"{where}: the targets' weights are all 0")
    return tuple(targets)


def _refuse_overlaps(rules: Iterable[RewriteRule]) -> None:
    """A model (or 'any model') matched by two rules of one file is a mistake.

    Raises:
        ConfigError: naming both rules.
    """
    seen: dict[str, RewriteRule] = {}
    for rule in rules:
        for model in rule.models or ("",):
            first = seen.setdefault(model, rule)
            if first is not rule:
                what = f"model {model!r}" if model else "any model (no matches)"
                raise ConfigError(f"{rule.where}: {what} is matched by {first.where} already")


def check_targets(rules: Iterable[RewriteRule], pods: Sequence[Pod]) -> None:
    """Refuse a target with weight that no known pod serves; with no pod known yet (a
    watch still listing), nothing is refused: such a target is answered 404 per request.

    Raises:
        ConfigError: naming the rule and the target.
    """
    if not pods:
        return
    served = set().union(*(p.models for p in pods))
    for rule in rules:
        for target in rule.targets:
            if target.weight and target.model not in served:
                raise ConfigError(
                    f"{rule.where}: no known pod serves the target {target.model!r} "
                    f"(models served: {', '.join(sorted(served))})"
                )


def rewritten_body(body: bytes, data: Mapping[str, Any], target: str) -> bytes:
    """``body`` with its ``model`` set to ``target``: the other bytes kept when the key is
    written once, plainly, with the model (the result parsed to check the top-level model
    is the one changed); else ``data`` re-serialised (a body naming no model gets one)."""
    if body.count(_MODEL_KEY) == 1:
        start = body.index(_MODEL_KEY) + len(_MODEL_KEY)
        value = _COLON.match(body, start)
        written = orjson.dumps(data.get("model"))  # none: a nested "model" key, not spliced
        assert value is not None  # the pattern matches the empty string
        if body.startswith(written, value.end()):
            spliced = (
                body[: value.end()] + orjson.dumps(target) + body[value.end() + len(written) :]
            )
            if load_body(spliced).get("model") == target:  # decoded as the body was
                return spliced
    rewritten = {**data, "model": target}
    try:
        return orjson.dumps(rewritten)
    except orjson.JSONEncodeError:  # an integer past 64 bits, as vLLM's json.loads reads it
        return json.dumps(rewritten, ensure_ascii=False, separators=(",", ":")).encode()


_MODEL_KEY = b'"model"'
_COLON = re.compile(rb"\s*:\s*")


def _mapping(value: Any, where: str, keys: set[str]) -> dict[str, Any]:
    """``value`` as a mapping of known keys.

    Raises:
        ConfigError: not a mapping, or a key unknown (a misspelling must not be ignored).
    """
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})")
    return value


class WatchedRules:
    """The watched ``InferenceModelRewrite`` objects' rules, parsed: an object with a bad
    rule is left out, said once while it stays so."""

    def __init__(self) -> None:
        self._problems: set[str] = set()

    def parse(self, objects: Iterable[tuple[str, Any]]) -> tuple[RewriteRule, ...]:
        """``(where, spec.rules)`` of each object, oldest first -> their rules, in order."""
        rules: list[RewriteRule] = []
        problems = set()
        for where, raw in objects:
            try:
                rules += parse_rules(raw, f"{where}: spec.rules")
            except ConfigError as exc:
                problems.add(str(exc))
        for problem in sorted(problems - self._problems):
            log.warning("%s; that object is ignored", problem)
        self._problems = problems
        return tuple(rules)
