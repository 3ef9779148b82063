"""The image's build replayed: the Dockerfile's builder makes the wheels in a fresh venv,
its final stage installs them into another, with the tracing extra only (pip resolves nothing from
the network there). The runtime commands then work for real from that install, and the
simulator's commands name the extra they need instead of failing with a traceback.

About a minute and a half on a loaded 2-core machine: pip takes the dependencies' wheels
from PyPI or its cache once, for the whole module.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.prefix.hashing import hash_prompt
from extproc.request.parse import Api, parse_request
from extproc.sim.launch import envoy_binary, free_port, start_extproc
from testkit.example_pods import EXAMPLE_PODS_FILE
from tests.packaging.image import REPO, Replay, fresh_venv, mounts, stages

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
RUN_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 300


@dataclass
class Image:
    """The replayed build: the wheels the builder made and the final stage's venv."""

    wheels: Path
    bin: Path
    entrypoint: list[str]
    cmd: list[str]

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / "extproc"), *args],
            check=False,
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=RUN_TIMEOUT_S,
            env={"PATH": f"{self.bin}:/usr/bin:/bin"},
        )


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    builder, final = stages()
    tmp = tmp_path_factory.mktemp("image")
    replay = Replay(tmp)
    build_root = replay.run_stage(builder, "builder", fresh_venv(tmp / "builder-venv"))
    final_bin = fresh_venv(tmp / "final-venv")
    replay.run_stage(final, "final", final_bin)
    entrypoint, cmd = final.last("ENTRYPOINT"), final.last("CMD")
    assert entrypoint is not None and cmd is not None
    [wheels_dir] = {m["source"] for c in final.all("RUN") for m in mounts(c)}
    return Image(build_root / wheels_dir.lstrip("/"), final_bin, [*entrypoint.value], [*cmd.value])


def _extra_names(extra: str) -> set[str]:
    return {_name(r) for r in PROJECT["optional-dependencies"][extra]}


def _name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split("<")[0].split(">")[0].strip().lower()


@pytest.fixture(scope="module")
def repo_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel .`` makes from the repository: a copy of the files git does
    not ignore, so the build leaves nothing in the work tree."""
    tmp = tmp_path_factory.mktemp("repo")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=RUN_TIMEOUT_S,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, tmp / "src" / name
        if source.is_file():  # a tracked file deleted in the work tree is still listed
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    wheel_dir = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheel_dir)]
        + [str(tmp / "src")],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    [wheel] = wheel_dir.glob("extproc-*.whl")
    return wheel


def _files(wheel: Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("dist-info/RECORD")}


def test_the_wheel_holds_the_package_only(repo_wheel: Path) -> None:
    names = _files(repo_wheel)
    dist_info = f"extproc-{PROJECT['version']}.dist-info/"
    assert all(n.startswith(("extproc/", dist_info)) for n in names), sorted(
        {n.split("/")[0] for n in names}
    )
    assert {"extproc/data/config.yaml", "extproc/cli/serve.py"} <= names


def test_the_image_builds_the_same_wheel(image: Image, repo_wheel: Path) -> None:
    """The Dockerfile copies everything the package is made of."""
    [wheel] = image.wheels.glob("extproc-*.whl")
    assert _files(wheel) == _files(repo_wheel)


def test_the_image_has_tracing_and_no_other_extra(image: Image) -> None:
    listed = subprocess.run(
        [str(image.bin / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=RUN_TIMEOUT_S,
    )
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    base = {_name(r) for r in PROJECT["dependencies"]}
    assert base | _extra_names("tracing") <= installed  # the chart's tracing.otlpEndpoint
    exporter = "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter"  # not xds-protos'
    subprocess.run([str(image.bin / "python"), "-c", exporter], check=True, timeout=RUN_TIMEOUT_S)
    for extra in ("sim", "test", "envoy"):
        assert not (_extra_names(extra) - base) & installed, extra


def test_extproc_is_imported_from_the_install(image: Image, tmp_path: Path) -> None:
    found = subprocess.run(
        [str(image.bin / "python"), "-c", "import extproc; print(extproc.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=RUN_TIMEOUT_S,
    )
    assert Path(found.stdout.strip()).is_relative_to(image.bin.parent)


@pytest.mark.parametrize(
    "args, expect",
    [
        pytest.param(["--help"], "serve", id="help"),
        pytest.param(["serve", "--help"], "--grpc-port", id="serve-help"),
        pytest.param(["envoy-config", "--help"], "--extproc-address", id="envoy-config-help"),
        # The image's build context has no .git: the commit cannot be known there.
        # The builder compiles the kernels (``extproc.kernels``).
        pytest.param(["--version"], "commit: unknown\nhot path: compiled (Cython)", id="version"),
    ],
)
def test_help(image: Image, tmp_path: Path, args: list[str], expect: str) -> None:
    result = image.run(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert expect in result.stdout


def test_hash_prints_the_block_hashes(image: Image, tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "tenant 7: " + "x" * 300}]}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    result = image.run("hash", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    req = parse_request(Api.CHAT_COMPLETIONS.value, path.read_bytes())
    expected = hash_prompt(req.model, req.prompt, 64, 128, req.cache_salt)
    assert result.stdout.split() == [str(h) for h in expected] and len(expected) > 1


def test_envoy_config_writes_a_bootstrap_envoy_accepts(image: Image, tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    args = [
        *("--pods", str(EXAMPLE_PODS_FILE)),
        *("--extproc-address", "127.0.0.1:19002", "--listen-port", "18080", "-o", str(out)),
    ]
    result = image.run("envoy-config", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    bootstrap = yaml.safe_load(out.read_text())
    [listener] = bootstrap["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 18080
    assert "19002" in out.read_text()
    subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(out)],
        check=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["demo"], id="demo"),
        pytest.param(["sim-pods", "--pods", "2", "--port", "1"], id="sim-pods"),
        pytest.param(["simulate", "--workload", "burst"], id="simulate"),
    ],
)
def test_simulator_commands_name_their_extra(image: Image, tmp_path: Path, args: list[str]) -> None:
    result = image.run(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "pip install 'extproc[sim]'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_the_image_command_serves_and_drains_on_sigterm(image: Image, tmp_path: Path) -> None:
    """ENTRYPOINT + CMD as the image runs them, bound to 127.0.0.1 and free ports here."""
    assert image.cmd[0] == "serve"
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    here = [  # after the image's flags: the last one wins
        "--address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        f"--health-port={health_port}",
        f"--metrics-port={metrics_port}",
    ]
    proc = start_extproc(
        EXAMPLE_PODS_FILE,
        tmp_path,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        extra_args=[*image.cmd[1:], *here],
        command=[str(image.bin / image.entrypoint[0]), *image.entrypoint[1:]],
    )
    try:
        # The health port listens (NOT_SERVING) a moment before serve reports SERVING.
        deadline = time.monotonic() + RUN_TIMEOUT_S
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            while True:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=RUN_TIMEOUT_S, wait_for_ready=True
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert time.monotonic() < deadline, "health never reported SERVING"
                time.sleep(0.05)
    finally:
        code = proc.stop(signal.SIGTERM)
    log = proc.log_tail()
    assert code == 0, log
    assert "serving ext_proc on 127.0.0.1" in log and "drained" in log, log
    assert "Traceback" not in log
