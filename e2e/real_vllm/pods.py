"""Start real vLLM (CPU) pods on free 127.0.0.1 ports, in parallel, and stop them by PID.

    with start_vllm_pods(3, log_dir) as pods:
        pods[0].url, pods[0].kv_events_endpoint, pods[0].metrics_text()
    with start_vllm_pods(1, log_dir, extra_args=["--num-gpu-blocks-override", "20"],
                         replay=True) as (pod,):
        pod.replay_port  # vLLM's replay ROUTER for missed event batches
    with start_vllm_pods(2, log_dir, adapters=[{"a": dir_a}, {}]) as pods:
        pods[0].adapters  # ("a",): served with --enable-lora; pods[1] has LoRA on, none loaded
    with start_vllm_pods(3, log_dir, cpu_quota=0.5) as pods:
        pods[0].cpu_group  # each pod held to half a core (``cpu_quota``)

Each pod is ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv
(``prepare.py``), serving the tiny Qwen3 as ``MODEL`` with prefix caching, metrics (vLLM
serves ``/metrics`` by default), cached-token usage details and KV-cache events published
over ZMQ to an endpoint of its own (the publisher connects; a subscriber binds it when it
wants the events), with a replay endpoint if asked, and LoRA adapters if given. The processes start together and are waited for with one deadline;
on any failure, or on leaving the ``with``, every started pod gets SIGTERM by PID, then
SIGKILL if it lingers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from e2e.real_vllm.cpu_quota import CpuGroup, cpu_group
from e2e.real_vllm.prepare import LORA_RANK, vllm_python
from extproc.pods import Pod, PodId
from extproc.sim.launch import Proc, free_port, spawn
from testkit.e2e_cache import model_dir

MODEL = "qwen3-tiny"
BLOCK_SIZE = 32  # tokens; vLLM on CPU needs a multiple of 32
MAX_MODEL_LEN = 512
# About 70 s for one pod alone on 2 cores; three share them (a busier machine: the env).
START_TIMEOUT_S = float(os.environ.get("EXTPROC_VLLM_START_TIMEOUT_S", "420"))
STOP_TIMEOUT_S = 20.0
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per pod
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache, for the benchmark
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass
class VllmPod:
    """One running vLLM server."""

    name: str
    port: int
    kv_events_endpoint: str  # tcp://127.0.0.1:P: bind a SUB socket here to receive events
    proc: Proc
    replay_port: int | None = None  # the publisher's replay ROUTER on 127.0.0.1, if any
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves (``--lora-modules``)
    cpu_group: CpuGroup | None = None  # the cgroup capping its CPU, if any

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def as_pod(self) -> Pod:
        """The pod as a pods file lists it: its base model and its adapters."""
        adapters = frozenset(self.adapters)
        return Pod(PodId("default", self.name), self.address, adapters | {MODEL}, adapters=adapters)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())

    def kill(self) -> None:
        """SIGKILL the server and its engine processes by PID, as a crashed pod."""
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.popen.wait(STOP_TIMEOUT_S)

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text page (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from ``/proc``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def vllm_argv(
    port: int,
    kv_endpoint: str,
    topic: str,
    replay_endpoint: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        kv_config["replay_endpoint"] = replay_endpoint
    return [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir()), "--served-model-name", MODEL,
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--enforce-eager", "--dtype", "bfloat16", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--enable-scale-out",  # the /render endpoints vllm-router's cache_aware policy calls
        "--kv-events-config", json.dumps(kv_config), *extra_args,
    ]  # fmt: skip


def lora_args(adapters: Mapping[str, Path]) -> list[str]:
    """LoRA on, one adapter in the engine at a time, and ``adapters`` (name -> directory)
    served from the start (none: LoRA on, nothing loaded)."""
    args = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(LORA_RANK)]
    if adapters:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return args


def num_cores() -> int:
    """The machine's cores, which the engines take round robin."""
    return os.cpu_count() or 1


def engine_core(index: int) -> int:
    """The core pod ``index`` binds its engine to: one core per pod, round robin."""
    return index % num_cores()


def cores_shared(num_pods: int) -> bool:
    """Whether ``num_pods`` engines share cores (more pods than the machine has)."""
    return num_pods > num_cores()


def _start_one(
    index: int,
    log_dir: Path,
    extra_args: Sequence[str],
    replay: bool,
    adapters: Mapping[str, Path] | None,
    port: int,
    group: CpuGroup | None,
) -> VllmPod:
    kv_port = free_port()
    replay_port = free_port() if replay else None
    endpoint = f"tcp://127.0.0.1:{kv_port}"
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}" if replay_port else None
    # By default every engine binds core 0.
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": str(engine_core(index))}
    name = f"vllm-{index}"
    topic = f"kv@127.0.0.1:{port}@{MODEL}"
    if adapters is not None:
        extra_args = [*extra_args, *lora_args(adapters)]
    argv = vllm_argv(port, endpoint, topic, replay_endpoint, extra_args)
    proc = spawn(name, group.wrap(argv) if group else argv, log_dir, env)
    return VllmPod(name, port, endpoint, proc, replay_port, tuple(adapters or ()), group)


def wait_healthy(pods: Sequence[VllmPod], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until every pod answers ``/health``; fail early, with its log, if one exits."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pods)
    while waiting:
        for pod in list(waiting):
            if not pod.proc.alive():
                raise RuntimeError(
                    f"{pod.name} exited ({pod.proc.popen.returncode}):\n{pod.proc.log_tail()}"
                )
            if pod.healthy():
                waiting.remove(pod)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(
                f"{waiting[0].name} not healthy after {timeout_s} s:\n{waiting[0].proc.log_tail()}"
            )
        time.sleep(0.5)


@contextmanager
def start_vllm_pods(
    num_pods: int,
    log_dir: Path,
    timeout_s: float = START_TIMEOUT_S,
    *,
    extra_args: Sequence[str] = (),
    replay: bool = False,
    adapters: Sequence[Mapping[str, Path]] | None = None,
    cpu_quota: float | None = None,
) -> Iterator[list[VllmPod]]:
    """Start ``num_pods`` vLLM pods at once, wait for all, stop all on leaving.

    Args:
        extra_args: more ``vllm serve`` flags for every pod.
        replay: each pod also binds a replay endpoint for its KV events.
        adapters: one mapping a pod (LoRA adapter name -> directory): every pod runs
            with LoRA on (``lora_args``) and serves its own adapters.
        cpu_quota: hold each pod (server and engine) to this many cores once all are
            healthy (``cpu_quota.cpu_group``; they start at full speed): equal, fixed
            compute, whatever the other pods do.
    """
    if adapters is not None and len(adapters) != num_pods:
        raise ValueError(f"{len(adapters)} adapter mappings for {num_pods} pods")
    if not vllm_python().exists() or not (model_dir() / "config.json").exists():
        raise FileNotFoundError("run `python -m e2e.real_vllm.prepare` first")
    with ExitStack() as stack:
        pods: list[VllmPod] = []
        for i in range(num_pods):
            port = free_port()
            group = None
            if cpu_quota is not None:  # entered first: removed once the pod has stopped
                group = stack.enter_context(cpu_group(f"extproc-vllm-{port}", cpu_quota))
            adapter_map = adapters[i] if adapters else None
            pod = _start_one(i, log_dir, extra_args, replay, adapter_map, port, group)
            stack.callback(pod.proc.stop, timeout_s=STOP_TIMEOUT_S)
            pods.append(pod)
        wait_healthy(pods, timeout_s)
        for pod in pods:
            if pod.cpu_group is not None:
                pod.cpu_group.cap()
        yield pods
