"""``pip install .`` where no C compiler is: the wheel builds without the compiled kernels
(an optional extension), and extproc runs their pure reference (tests/kernels)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.packaging.image import clone_and_build_wheel

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]


def test_a_build_without_a_c_compiler_leaves_the_kernels_pure(tmp_path: Path) -> None:
    _, wheel = clone_and_build_wheel(tmp_path, CC="/bin/false")  # every compile fails
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "extproc/kernels/pure.py" in names
    assert not [n for n in names if n.startswith("extproc/kernels/_compiled.cpython")]
