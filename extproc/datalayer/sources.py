"""Choosing where ``extproc serve`` gets its pods: ``--pods FILE`` or Kubernetes.

Exactly one source, or ``serve`` refuses to start::

    --pods FILE                                  a YAML file, polled
    --k8s-selector SEL --k8s-target-port P       pods matching a label selector
    --inference-pool NAME                        the pods of a GIE InferencePool

Kubernetes options: ``--k8s-namespace`` (default: the kubeconfig context's, or in-cluster
the service account's namespace), ``--kubeconfig``/``--kube-context`` (see
``kubeconfig``), ``--k8s-model-annotation``, ``--k8s-model-label``,
``--k8s-default-model``, ``--k8s-role-label`` (see ``k8s_objects``),
``--inference-pool-api``, and ``--inference-objective-api`` (with an InferencePool, its
InferenceObjectives' priorities for flow control: ``objectives``). Every flag also reads ``EXTPROC_<FLAG>`` through the
caller's ``env`` helper.

``--models-interval-s``: how often the scraper reads each pod's ``/v1/models`` for the
LoRA adapters it serves beyond those its source names (``adapters``); 0 reads none.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from extproc.datalayer.k8s import DEFAULT_POOL_API, KubePodSource, WatchTiming
from extproc.datalayer.k8s_objects import (
    DEFAULT_MODEL_ANNOTATION,
    DEFAULT_MODEL_LABEL,
    DEFAULT_ROLE_LABEL,
    PodMapping,
    PodTarget,
)
from extproc.datalayer.kubeconfig import load_kube_config
from extproc.datalayer.objectives import DEFAULT_OBJECTIVE_API, InferenceObjectiveWatcher
from extproc.datalayer.pods_file import PodsFileWatcher
from extproc.errors import ConfigError
from extproc.pods import Pod


class PodsSource(Protocol):
    """What ``serve`` needs of a source: the current pods, ``start()`` and ``stop()``."""

    pods: tuple[Pod, ...]

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


def add_source_arguments(p: argparse.ArgumentParser, env: Callable[[str, Any], Any]) -> None:
    """Register the pod source flags; ``env(name, default)`` supplies environment defaults."""
    g = p.add_argument_group(
        "pods from a file", "one source of pods is required: a file, or Kubernetes (below)"
    )
    g.add_argument(
        "--pods",
        metavar="FILE",
        default=env("pods", None),
        help="the pods YAML file, watched for changes (default: none)",
    )
    g.add_argument(
        "--pods-poll-s",
        type=float,
        default=env("pods-poll-s", "1.0"),
        help="how often the file is checked for changes (default: %(default)s s)",
    )
    g = p.add_argument_group(
        "pods from Kubernetes", "--k8s-selector with --k8s-target-port, or --inference-pool"
    )
    g.add_argument(
        "--k8s-selector",
        metavar="SEL",
        default=env("k8s-selector", None),
        help="watch the pods matching this label selector, e.g. app=vllm (default: none)",
    )
    g.add_argument(
        "--k8s-target-port",
        metavar="PORT",
        type=int,
        default=env("k8s-target-port", None),
        help="the model servers' port (with --k8s-selector) (default: none)",
    )
    g.add_argument(
        "--inference-pool",
        metavar="NAME",
        default=env("inference-pool", None),
        help="watch this InferencePool's pods, each of its target ports an endpoint (a "
        "data-parallel rank) (default: none)",
    )
    g.add_argument(
        "--inference-pool-api",
        default=env("inference-pool-api", DEFAULT_POOL_API),
        help="the pool's group/version (default: %(default)s)",
    )
    g.add_argument(
        "--inference-objective-api",
        default=env("inference-objective-api", DEFAULT_OBJECTIVE_API),
        help="with --inference-pool and flow control on, the InferenceObjectives' "
        "group/version, watched for their priorities (default: %(default)s)",
    )
    g.add_argument(
        "--k8s-namespace",
        metavar="NS",
        default=env("k8s-namespace", None),
        help="the pods' namespace (default: the kubeconfig context's, or in-cluster the "
        "service account's)",
    )
    g.add_argument(
        "--kubeconfig",
        metavar="FILE",
        default=env("kubeconfig", None),
        help="how to reach the API server (default: $KUBECONFIG, else in-cluster, "
        "else ~/.kube/config)",
    )
    g.add_argument(
        "--kube-context",
        metavar="NAME",
        default=env("kube-context", None),
        help="the kubeconfig's context to use (default: its current context)",
    )
    g.add_argument(
        "--k8s-model-annotation",
        default=env("k8s-model-annotation", DEFAULT_MODEL_ANNOTATION),
        help="pod annotation listing served models, comma-separated (default: %(default)s)",
    )
    g.add_argument(
        "--k8s-model-label",
        default=env("k8s-model-label", DEFAULT_MODEL_LABEL),
        help="pod label naming the served model (default: %(default)s)",
    )
    g.add_argument(
        "--k8s-default-model",
        default=env("k8s-default-model", None),
        help="model of pods with neither, e.g. an InferencePool's base model (default: none)",
    )
    g.add_argument(
        "--k8s-role-label",
        default=env("k8s-role-label", DEFAULT_ROLE_LABEL),
        help="pod label holding prefill|decode|both (default: %(default)s)",
    )
    g.add_argument(
        "--k8s-start-timeout-s",
        type=float,
        default=env("k8s-start-timeout-s", "10.0"),
        help="how long start-up waits for the first list of pods (default: %(default)s s)",
    )
    g = p.add_argument_group(
        "LoRA adapters", "each pod's /v1/models: the adapters loaded beyond its source's"
    )
    g.add_argument(
        "--models-interval-s",
        type=float,
        default=env("models-interval-s", "2.0"),
        help="how often each pod's /v1/models is read, with its /metrics, for the LoRA "
        "adapters it serves (those whose parent is one of its models, loaded at start or "
        "by /v1/load_lora_adapter); 0: only the adapters the pods file or Kubernetes "
        "names (default: %(default)s s)",
    )


def check_pods_source(args: argparse.Namespace) -> None:
    """Exactly one pods source: the demo's localhost pods are never a silent default.

    Raises:
        ConfigError: none, or several.
    """
    chosen = [
        f
        for f, v in (
            ("--pods", args.pods),
            ("--k8s-selector", args.k8s_selector),
            ("--inference-pool", args.inference_pool),
        )
        if v
    ]
    if not chosen:
        raise ConfigError(
            "no pods to route to: give a pods file (--pods FILE) or a Kubernetes source "
            "(--k8s-selector SEL with --k8s-target-port PORT, or --inference-pool NAME)"
        )
    if len(chosen) > 1:
        raise ConfigError(f"choose one pod source, not {' and '.join(chosen)}")


def make_pods_source(
    args: argparse.Namespace, on_change: Callable[[tuple[Pod, ...]], Any]
) -> PodsSource:
    """Build the source the flags choose (not started).

    Raises:
        ConfigError: conflicting or missing flags, a bad pods file or kubeconfig.
    """
    check_pods_source(args)
    if args.pods:
        return PodsFileWatcher(args.pods, on_change, interval_s=args.pods_poll_s)
    if args.k8s_selector and args.k8s_target_port is None:
        raise ConfigError("--k8s-selector needs --k8s-target-port (the model server's port)")
    if args.inference_pool and args.k8s_target_port is not None:
        raise ConfigError("--k8s-target-port conflicts with --inference-pool (the pool has one)")
    if args.k8s_target_port is not None and not 0 < args.k8s_target_port < 65536:
        raise ConfigError(f"--k8s-target-port must be 1-65535, got {args.k8s_target_port}")
    config = load_kube_config(args.kubeconfig, args.kube_context)
    return KubePodSource(
        config,
        on_change,
        namespace=args.k8s_namespace or config.namespace,
        target=PodTarget(args.k8s_selector, (args.k8s_target_port,)) if args.k8s_selector else None,
        pool=args.inference_pool,
        pool_api=args.inference_pool_api,
        mapping=PodMapping(
            model_annotation=args.k8s_model_annotation,
            model_label=args.k8s_model_label,
            default_model=args.k8s_default_model,
            role_label=args.k8s_role_label,
        ),
        timing=WatchTiming(start_timeout_s=args.k8s_start_timeout_s),
    )


def make_objectives_watcher(
    args: argparse.Namespace, on_change: Callable[[Mapping[str, int]], object]
) -> InferenceObjectiveWatcher | None:
    """With an InferencePool, the watcher of its InferenceObjectives' priorities (not
    started); None otherwise."""
    return InferenceObjectiveWatcher.of_pool(args, on_change, api=args.inference_objective_api)


def describe_source(args: argparse.Namespace) -> str:
    """The source in a few words, for the start-up log line."""
    if args.inference_pool:
        return f"InferencePool {args.inference_pool}"
    if args.k8s_selector:
        return f"Kubernetes pods matching {args.k8s_selector}"
    return str(args.pods)
