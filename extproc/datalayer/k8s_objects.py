"""Kubernetes objects as extproc values: a lightkube Pod -> ``Pod`` (one a target port);
an InferencePool -> ``PodTarget``.

Pod rules (``make_pods``):

* no ``status.podIP`` yet, or phase ``Succeeded``/``Failed`` (finished: its IP may
  already belong to another pod) -> no endpoint, the pod is not listed;
* one endpoint a target port (``pods_file.rank_pods``): id
  ``(metadata.namespace, metadata.name)`` and address ``podIP:port`` (``[ip]:port`` for
  IPv6) with one port; with several (data-parallel ranks), the Nth is named
  ``<name>-rank-N``, as the Inference Extension names them, at ``podIP:ports[N]`` and
  labelled ``extproc.io/dp-rank: N``;
* ready: the ``Ready`` condition is ``"True"`` and ``metadata.deletionTimestamp`` is unset
  (a terminating pod takes no new requests but may finish its streams);
* models: the annotation ``model_annotation``, comma-separated (annotations may hold
  ``/``, which Hugging Face names need and label values cannot), else the label
  ``model_label``, else ``default_model``, else none: the pod is listed but serves nothing
  (``pod_warnings`` says so);
* adapters: the annotation ``adapter_annotation``, comma-separated: LoRA adapters the
  pod serves or can load, added to its models (an adapter also named a model is an
  adapter; a pod whose models are all adapters is warned about);
* role: the label ``role_label`` (llm-d's ``llm-d.ai/role`` by default): ``prefill``,
  ``decode`` or ``both``; missing or another value -> both;
* labels: all of them, sorted.

A snapshot (``make_snapshot``) is sorted by id and keeps one pod per address (the ready
one, else the first by id), since Envoy picks hosts by address.

InferencePool (``parse_pool``): ``inference.networking.k8s.io/v1`` has
``spec.selector.matchLabels`` and ``spec.targetPorts[*].number`` (every one an endpoint);
the older ``inference.networking.x-k8s.io/v1alpha2`` has ``spec.selector`` (the map
itself) and ``spec.targetPortNumber``. Both shapes are read, whichever version was asked
for.

A label selector (``--k8s-selector`` or a pool's) goes to lightkube as a map of operators
(``parse_selector``): ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``,
``k``, ``!k``, comma-separated, one term per key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightkube import operators
from lightkube.core.client import LabelSelector
from lightkube.resources.core_v1 import Pod as K8sPod

from extproc.datalayer.pods_file import parse_host, rank_pods
from extproc.pods import Pod, PodId, PodRole

DEFAULT_MODEL_ANNOTATION = "extproc.io/models"
DEFAULT_MODEL_LABEL = "extproc.io/model"
DEFAULT_ADAPTER_ANNOTATION = "extproc.io/adapters"
DEFAULT_ROLE_LABEL = "llm-d.ai/role"  # llm-d's; Kthena's is modelserving.volcano.sh/role

_ROLES = {r.value: r for r in PodRole}
_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class PodMapping:
    """How a Kubernetes pod's labels and annotations become models, adapters and a role."""

    model_annotation: str = DEFAULT_MODEL_ANNOTATION
    model_label: str = DEFAULT_MODEL_LABEL
    default_model: str | None = None
    role_label: str = DEFAULT_ROLE_LABEL
    adapter_annotation: str = DEFAULT_ADAPTER_ANNOTATION


class PodTarget(NamedTuple):
    """Which pods to send to, and on which ports (given, or read from an InferencePool):
    each port an endpoint of its own (a data-parallel rank)."""

    selector: str  # "k1=v1,k2=v2", sorted
    target_ports: tuple[int, ...]


def make_pods(obj: K8sPod, mapping: PodMapping, target_ports: Sequence[int]) -> tuple[Pod, ...]:
    """A pod object's endpoints, one a target port; none if it cannot take traffic."""
    metadata, status = obj.metadata, obj.status
    pod_ip = status.podIP if status else None
    if metadata is None or status is None or not pod_ip or status.phase in _FINISHED_PHASES:
        return ()
    try:
        host = parse_host(f"[{pod_ip}]" if ":" in pod_ip else pod_ip)
    except ValueError:
        return ()
    labels = metadata.labels or {}
    annotations = metadata.annotations or {}
    if models_text := annotations.get(mapping.model_annotation):
        models = _names(models_text)
    elif model := labels.get(mapping.model_label) or mapping.default_model:
        models = frozenset({model})
    else:
        models = frozenset()
    adapters = _names(annotations.get(mapping.adapter_annotation, ""))
    ready = metadata.deletionTimestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in status.conditions or ()
    )
    pod = Pod(
        id=PodId(metadata.namespace or "", metadata.name or ""),
        address="",  # rank_pods sets it
        models=models | adapters,
        adapters=adapters,
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        role=_ROLES.get(labels.get(mapping.role_label, ""), PodRole.BOTH),
        ready=ready,
    )
    return rank_pods(pod, host, target_ports)


def _names(text: str) -> frozenset[str]:
    """A comma-separated annotation's names (annotations may hold ``/``, which Hugging
    Face names need and label values cannot)."""
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def pod_warnings(pod: Pod, mapping: PodMapping) -> list[str]:
    """What in a listed pod's labels is probably a mistake (it is still published)."""
    problems = []
    if not pod.models:
        problems.append(
            f"no served model: set the annotation {mapping.model_annotation} or the label "
            f"{mapping.model_label}, or pass --k8s-default-model; it gets no requests"
        )
    elif not pod.models - pod.adapters:
        problems.append(
            f"no base model: every model is a LoRA adapter ({mapping.adapter_annotation}); "
            f"name the base model in {mapping.model_annotation} or {mapping.model_label}, "
            "or pass --k8s-default-model"
        )
    role = pod.label(mapping.role_label)
    if role is not None and role not in _ROLES:
        problems.append(f"label {mapping.role_label}={role!r} is not prefill|decode|both: both")
    return problems


def make_snapshot(pods: Iterable[Pod]) -> tuple[tuple[Pod, ...], list[Pod]]:
    """Sort by id and keep one pod per address; returns (kept, dropped)."""
    ordered = sorted(pods, key=lambda p: p.id)
    by_address: dict[str, Pod] = {}
    for pod in ordered:
        other = by_address.get(pod.address)
        if other is None or (pod.ready and not other.ready):
            by_address[pod.address] = pod
    kept = tuple(p for p in ordered if by_address[p.address] is p)
    return kept, [p for p in ordered if by_address[p.address] is not p]


def parse_pool(obj: Mapping[str, Any]) -> PodTarget:
    """Read an InferencePool's selector and target ports (v1 or v1alpha2 shape).

    Raises:
        ValueError: the selector is empty or not a string map, there is no port, a port
            is not 1-65535, or one is listed twice.
    """
    spec = obj.get("spec") or {}
    selector = spec.get("selector") or {}
    if isinstance(selector, Mapping) and "matchLabels" in selector:
        selector = selector["matchLabels"] or {}
    if not isinstance(selector, Mapping) or not selector:
        raise ValueError("spec.selector has no labels (it would select every pod)")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in selector.items()):
        raise ValueError(f"spec.selector must map strings to strings, got {selector!r}")
    listed = spec.get("targetPorts")
    if isinstance(listed, list) and listed:
        where = "targetPorts[{}].number"
        ports = [p.get("number") if isinstance(p, Mapping) else None for p in listed]
    else:
        where, ports = "targetPortNumber", [spec.get("targetPortNumber")]
    checked: list[int] = []
    for idx, port in enumerate(ports):
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"no target port 1-65535 ({where.format(idx)}), got {port!r}")
        checked.append(port)
    if repeated := sorted({p for p in checked if checked.count(p) > 1}):
        raise ValueError(f"targetPorts: {repeated} listed more than once")
    selector_text = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    return PodTarget(selector_text, tuple(checked))


_TERM = re.compile(
    r"(?P<not>!)?\s*(?P<key>[\w./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[\w.-]*)|(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?"
)


def parse_selector(text: str) -> LabelSelector:
    """A label selector string as lightkube's map of operators (see the module docstring).

    Raises:
        ValueError: a term is malformed, a key repeats, or nothing is selected.
    """
    selector: LabelSelector = {}
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", text)):
        if not (match := _TERM.fullmatch(term)) or (match["not"] and (match["op"] or match["set"])):
            raise ValueError(f"label selector {text!r}: cannot parse {term!r}")
        key = match["key"]
        if key in selector:
            raise ValueError(f"label selector {text!r}: {key} appears twice")
        if match["set"]:
            values = [v.strip() for v in match["values"].split(",") if v.strip()]
            in_set = match["set"] == "in"
            selector[key] = operators.in_(values) if in_set else operators.not_in(values)
        elif match["op"]:
            value = match["value"]
            selector[key] = operators.not_equal(value) if match["op"] == "!=" else value
        else:
            selector[key] = operators.not_exists() if match["not"] else None
    return selector
