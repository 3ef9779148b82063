"""``/debug/pick``: the decision the router would make now for a request, and why.

``explain_pick`` parses the request as ``Router.route`` does, then runs
``Scheduler.explain`` on the router's pods: the filters, the weighted scores, the
order. Nothing is recorded, credited (``arriving``), counted in flight, added to the
pending table or counted in the router's metrics, and flow control admits nothing: the
answer only says whether it would hold the request now.

Answer (JSON-ready; the keys are stable, ``extproc explain`` reads them)::

    {
      "status": 200, "model": str, "api": str, "prompt_tokens": int, "exact": bool,
      "pinned": bool,                     # session sticky: sent to the bound pod unscored
      "pick": "ns/name", "fallbacks": ["ns/name"], "order": ["ns/name"],  # all ranked
      "prefill": "ns/name" | null,        # prefill/decode disaggregation
      "ties": [["ns/name", ...]],         # pods whose order was drawn at random
      "flow_control": {"enabled": bool, "priority": int, "saturated": bool,
                       "held_now": int, "would_hold": bool},
      "pods": [{                           # the serving pass's candidates, best first
        "id", "address", "rank": int | null, "verdict": "kept" | "removed",
        "removed_by": str | null,
        "scores": {scorer: {"score": int, "weight": int, "weighted": int}},
        "total": int | null, "load": int | null,
        "predicted_cached_tokens": int,
        "cost": {plugin: {term: number}}   # cost-aware / estimated-ttft terms
      }],
      "passes": [{"role", "candidates", "filters": [{"name", "kept", "removed"}],
                  "scores": [{"name", "weight", "scores": {pod: int}}],
                  "totals": {pod: int}, "load": {pod: int}, "order": [pod],
                  "ties": [[pod]]}]
    }

A request the router would refuse answers ``{"status": 4xx|5xx, "error": message,
"code": str, "passes": [...]}`` (the passes run before the refusal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.errors import ExtProcError
from extproc.pods import Pod, PodId
from extproc.request.parse import parse_request
from extproc.routing.router import Router
from extproc.scheduling.interfaces import Cycle, Explainer
from extproc.scheduling.scheduler import Explanation, TracePass


def explain_pick(
    router: Router, path: str, body: bytes, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The router's decision for this request now, explained (module doc)."""
    try:
        request = parse_request(
            path,
            body,
            headers,
            session_header=router.session_header,
            max_body_bytes=router.max_body_bytes,
            rendering=router.rendering,
            default_model=router.default_model,
        )
    except ExtProcError as exc:
        return _error(exc, [])
    cycle = Cycle(request)
    flow = _flow_state(router, cycle, headers)
    pods: Sequence[Pod] = router.pods
    if router.flow is not None and not flow["would_hold"]:
        pods = router.flow.candidates(request.model, pods)
    explanation = router.scheduler.explain(cycle, pods)
    passes = [_pass(p) for p in explanation.trace.passes]
    if explanation.schedule is None:
        assert explanation.error is not None
        return {**_error(explanation.error, passes), "flow_control": flow}
    return _answer(router, cycle, explanation, passes, flow)


def _answer(
    router: Router,
    cycle: Cycle,
    explanation: Explanation,
    passes: list[dict[str, Any]],
    flow: dict[str, Any],
) -> dict[str, Any]:
    schedule = explanation.schedule
    assert schedule is not None
    chosen = [p.id for p in schedule.pods[: 1 + router.num_fallbacks]]
    trace = explanation.trace
    main = next((p for p in trace.passes if p.role in ("serving", "decode")), None)
    return {
        "status": 200,
        "model": cycle.request.model,
        "api": cycle.request.api.value,
        "prompt_tokens": cycle.num_engine_prompt_tokens,
        "exact": cycle.token_ids is not None,
        "pinned": trace.pinned,
        "pick": str(chosen[0]),
        "fallbacks": [str(p) for p in chosen[1:]],
        "order": [str(p.id) for p in schedule.pods],
        "prefill": str(schedule.prefill.id) if schedule.prefill is not None else None,
        "ties": [[str(p) for p in group] for group in main.ties] if main else [],
        "flow_control": flow,
        "pods": _pods(router, cycle, main) if main is not None else [],
        "passes": passes,
    }


def _pods(router: Router, cycle: Cycle, main: TracePass) -> list[dict[str, Any]]:
    """The main pass's candidates, ranked ones first, each with its whole story."""
    by_id = {p.id: p for p in router.pods}
    removed_by: dict[PodId, str] = {}
    alive = list(main.candidates)
    for name, kept in main.filters:
        keep = set(kept)
        for pod in alive:
            if pod not in keep:
                removed_by[pod] = name
        alive = [p for p in alive if p in keep]
    costs = _costs(router, cycle, [by_id[p] for p in main.order if p in by_id])
    rank = {pod: i + 1 for i, pod in enumerate(main.order)}
    ordered = main.order + [p for p in main.candidates if p not in rank]
    out = []
    for pod in ordered:
        scores = {
            name: {"score": s[pod], "weight": w, "weighted": w * s[pod]}
            for name, w, s in main.scores
            if pod in s
        }
        out.append(
            {
                "id": str(pod),
                "address": by_id[pod].address if pod in by_id else None,
                "rank": rank.get(pod),
                "verdict": "removed" if pod in removed_by else "kept",
                "removed_by": removed_by.get(pod),
                "scores": scores,
                "total": main.totals.get(pod),
                "load": main.load.get(pod),
                "predicted_cached_tokens": cycle.predicted_cached_tokens(pod) if pod in rank else 0,
                "cost": {name: terms[pod] for name, terms in costs.items() if pod in terms},
            }
        )
    return out


def _costs(
    router: Router, cycle: Cycle, pods: list[Pod]
) -> dict[str, dict[PodId, dict[str, float]]]:
    """Each cost plugin's terms per pod, computed on a cycle of their own (so the real
    cycle's predicted cached tokens stay those of the scoring)."""
    out: dict[str, dict[PodId, dict[str, float]]] = {}
    for ws in router.scheduler.scorers:
        plugin = ws.scorer
        if not isinstance(plugin, Explainer) or not pods:
            continue
        scratch = Cycle(
            cycle.request, token_ids=cycle.token_ids, tokenized=cycle.tokenized, explaining=True
        )
        out[plugin.type_name] = {
            t.pod: {k: _number(v) for k, v in t.terms.items()}
            for t in plugin.explain(scratch, pods)
        }
    return out


def _number(value: float) -> float:
    """A term as JSON shows it best: counts as integers, times to the microsecond."""
    if isinstance(value, int):
        return value
    return round(float(value), 3)


def _pass(p: TracePass) -> dict[str, Any]:
    filters = []
    alive = p.candidates
    for name, kept in p.filters:
        keep = set(kept)
        filters.append(
            {
                "name": name,
                "kept": [str(x) for x in kept],
                "removed": [str(x) for x in alive if x not in keep],
            }
        )
        alive = kept
    return {
        "role": p.role,
        "candidates": [str(x) for x in p.candidates],
        "filters": filters,
        "scores": [
            {"name": name, "weight": w, "scores": {str(k): v for k, v in s.items()}}
            for name, w, s in p.scores
        ],
        "totals": {str(k): v for k, v in p.totals.items()},
        "load": {str(k): v for k, v in p.load.items()},
        "order": [str(x) for x in p.order],
        "ties": [[str(x) for x in g] for g in p.ties] if p.order else [],
    }


def _flow_state(router: Router, cycle: Cycle, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """Whether flow control would hold the request now (read, not admitted): its
    model's pods saturated for its priority, or requests already held."""
    flow = router.flow
    if flow is None:
        return {
            "enabled": False,
            "priority": 0,
            "saturated": False,
            "held_now": 0,
            "would_hold": False,
        }
    request = cycle.request
    priority = flow.classify(headers, request.data).priority
    saturated = flow.saturation.saturated(request.model, priority)
    return {
        "enabled": True,
        "priority": priority,
        "saturated": saturated,
        "held_now": flow.held,
        "would_hold": saturated,
    }


def _error(exc: ExtProcError, passes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"status": exc.http_status, "error": exc.message, "code": exc.code, "passes": passes}
