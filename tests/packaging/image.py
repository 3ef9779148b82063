"""The Dockerfile as stages of parsed instructions (``dockerfile``: BuildKit's own parser),
and its build steps replayed on this machine, each stage's ``/`` a directory of its own.

No base image can be pulled here, so the tests run what the Dockerfile runs instead: the
builder's COPY and RUN in a fresh venv, the final stage's RUN in another, with absolute
paths inside a RUN mapped to the stage's directory and a bind mount made a symlink.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
# An absolute path as a word of a shell command, or as a flag's value (--find-links=/x).
_ABSOLUTE = re.compile(r"(?<=[\s=])(/[^\s;&|]*)")
_STEP_TIMEOUT_S = 240


@dataclass
class Stage:
    """One FROM and what follows it, up to the next FROM."""

    base: str
    name: str | None
    commands: list[dockerfile.Command] = field(default_factory=list)

    def all(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd]

    def last(self, cmd: str) -> dockerfile.Command | None:
        found = self.all(cmd)
        return found[-1] if found else None


def stages(path: Path = DOCKERFILE) -> list[Stage]:
    """The Dockerfile's stages in order; the last one is the image."""
    result: list[Stage] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            base, *rest = command.value
            name = rest[1] if len(rest) == 2 and rest[0].upper() == "AS" else None
            result.append(Stage(base, name))
        else:
            assert result, f"line {command.start_line}: {command.cmd} before any FROM"
            result[-1].commands.append(command)
    return result


def mounts(command: dockerfile.Command) -> list[dict[str, str]]:
    """A RUN's ``--mount=k=v,k=v`` flags as dicts."""
    return [
        dict(part.split("=", 1) for part in flag.removeprefix("--mount=").split(","))
        for flag in command.flags
        if flag.startswith("--mount=")
    ]


def fresh_venv(path: Path) -> Path:
    """A new venv from this interpreter's base Python (no site-packages of ours); its bin."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=_STEP_TIMEOUT_S)
    return path / "bin"


class Replay:
    """Runs stages' COPY/WORKDIR/ENV/RUN with each stage's ``/`` at ``tmp/<stage>``."""

    def __init__(self, tmp: Path, context: Path = REPO) -> None:
        self.tmp = tmp
        self.context = context
        self.roots: dict[str, Path] = {}

    def run_stage(self, stage: Stage, key: str, venv_bin: Path) -> Path:
        """Replays ``stage`` with ``venv_bin`` first on PATH; returns its root directory."""
        root = self.tmp / key
        root.mkdir()
        self.roots[key] = root
        if stage.name:
            self.roots[stage.name] = root
        workdir = "/"
        env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
        env.pop("PYTHONPATH", None)
        # No .pyc for what pip installs here: the slowest part, and a test venv's imports
        # compile what they use anyway.
        env["PIP_COMPILE"] = "0"  # pip --compile off (PIP_NO_COMPILE reads inverted)
        for command in stage.commands:
            if command.cmd == "WORKDIR":
                workdir = os.path.join(workdir, command.value[0])
                self.host(root, workdir).mkdir(parents=True, exist_ok=True)
            elif command.cmd == "ENV":
                pairs = command.value
                env.update(zip(pairs[::2], pairs[1::2], strict=True))
            elif command.cmd == "COPY":
                self._copy(command, root, workdir)
            elif command.cmd == "RUN":
                for mount in mounts(command):
                    assert mount["type"] == "bind", mount
                    source = self.host(self.roots[mount["from"]], mount["source"])
                    target = self.host(root, mount["target"])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(source, target_is_directory=True)
                script = _ABSOLUTE.sub(lambda m: str(self.host(root, m[1])), command.value[0])
                subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", script],
                    cwd=self.host(root, workdir),
                    env=env,
                    check=True,
                    timeout=_STEP_TIMEOUT_S,
                )
        return root

    @staticmethod
    def host(root: Path, container_path: str) -> Path:
        return root / container_path.lstrip("/")

    def _copy(self, command: dockerfile.Command, root: Path, workdir: str) -> None:
        assert not command.flags, f"COPY flags are not replayed: {command.original}"
        *sources, dest = command.value
        target = self.host(root, os.path.join(workdir, dest))
        # As .dockerignore: no bytecode, nor an editable install's build of the kernels.
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "_compiled.c")
        for source in sources:
            path = self.context / source
            if path.is_dir():  # Docker copies a directory's contents, not the directory
                shutil.copytree(path, target, ignore=ignore, dirs_exist_ok=True)
            else:
                assert dest.endswith("/") or dest == ".", f"replayed into a directory: {dest}"
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name)


WHEEL_BUILD_TIMEOUT_S = 300


def clone_and_build_wheel(tmp_path: Path, **env: str) -> tuple[Path, Path]:
    """A clone of the repository in ``tmp_path``, and the wheel ``pip wheel`` builds from
    it (``env`` added to the environment)."""
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(REPO), str(checkout)], check=True, timeout=120)
    wheels = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels)]
        + [str(checkout)],
        check=True,
        capture_output=True,
        timeout=WHEEL_BUILD_TIMEOUT_S,
        env={**os.environ, **env},
    )
    [wheel] = wheels.glob("extproc-*.whl")
    return checkout, wheel
