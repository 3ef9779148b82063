"""``pip install .`` where no C compiler is: the wheel builds without the compiled kernels
(an optional extension), and extproc runs their pure reference (tests/kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.image import REPO

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

BUILD_TIMEOUT_S = 300


def _wheel_names(tmp_path: Path, **env: str) -> set[str]:
    """The files of the wheel ``pip wheel`` builds from a clone of the repository."""
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(REPO), str(checkout)], check=True, timeout=120)
    wheels = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels)]
        + [str(checkout)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, **env},
    )
    [wheel] = wheels.glob("extproc-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_a_build_without_a_c_compiler_leaves_the_kernels_pure(tmp_path: Path) -> None:
    names = _wheel_names(tmp_path, CC="/bin/false")  # every compile fails
    assert "extproc/kernels/pure.py" in names
    assert not [n for n in names if n.startswith("extproc/kernels/_compiled.cpython")]
