"""A wheel built in a git checkout (``pip install .``, ``pip install git+URL``) records the
commit, which ``extproc --version`` reports; the image's build, without .git, says
``unknown`` (test_install.py)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.image import REPO

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

BUILD_TIMEOUT_S = 300


def test_a_wheel_built_in_a_checkout_records_its_commit(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(REPO), str(checkout)], check=True, timeout=120)
    head = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    wheels = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels)]
        + [str(checkout)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    [wheel] = wheels.glob("extproc-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("extproc/commit.txt").decode() == f"{head}\n"
        # and, with this machine's C compiler, the compiled kernels (test_no_compiler.py)
        assert [n for n in archive.namelist() if n.startswith("extproc/kernels/_compiled.cp")]
