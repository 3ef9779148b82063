"""A wheel built in a git checkout (``pip install .``, ``pip install git+URL``) records the
commit, which ``extproc --version`` reports; the image's build, without .git, says
``unknown`` (test_install.py)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.packaging.image import clone_and_build_wheel

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]


def test_a_wheel_built_in_a_checkout_records_its_commit(tmp_path: Path) -> None:
    checkout, wheel = clone_and_build_wheel(tmp_path)
    head = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("extproc/commit.txt").decode() == f"{head}\n"
        # and, with this machine's C compiler, the compiled kernels (test_no_compiler.py)
        assert [n for n in archive.namelist() if n.startswith("extproc/kernels/_compiled.cp")]
