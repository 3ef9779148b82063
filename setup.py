"""setuptools' build, plus the commit it was built from in the wheel (``extproc --version``)
and the compiled kernels when a C compiler is there.

The metadata is pyproject.toml's. Two steps are added: when the build runs in a git
checkout, ``build_py`` writes ``extproc/commit.txt`` (``extproc/cli/version.py`` reads it);
``extproc/kernels/_compiled.pyx`` is compiled (Cython, a build requirement), an optional
extension: without a compiler the build goes on and extproc runs the kernels' pure
reference (``extproc.kernels``).
Hand-written, not setuptools-scm: that library derives the version from git tags (there
are none; without them it makes 0.1.devN) and writes nothing for a static version such as
extproc's 0.1.0, which the image and the chart are tagged with.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _version_module() -> ModuleType:
    """extproc/cli/version.py by path: the package's dependencies are not installed yet."""
    spec = importlib.util.spec_from_file_location(
        "_extproc_version", ROOT / "extproc/cli/version.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCommit(build_py):  # type: ignore[misc]  # setuptools is untyped
    """``build_py``, then the checkout's commit into the built package (not the source
    tree: an editable install asks git itself)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        version = _version_module()
        found = version.checkout_commit(ROOT)
        if found is not None:
            target = Path(self.build_lib) / "extproc" / version.COMMIT_FILE
            target.write_text(found + "\n", encoding="utf-8")


KERNELS = Extension(
    "extproc.kernels._compiled",
    ["extproc/kernels/_compiled.pyx"],
    optional=True,  # no C compiler: skipped, with setuptools' warning in the build log
    # xxHash's C compiled into the module from its vendored header (vendor/README.md)
    include_dirs=["extproc/kernels/vendor"],
    define_macros=[("XXH_INLINE_ALL", None)],
    depends=["extproc/kernels/vendor/xxhash.h"],
    # No fused multiply-add: the compiled arithmetic must round as NumPy's does.
    extra_compile_args=["-O2", "-ffp-contract=off"],
)

setup(cmdclass={"build_py": BuildPyWithCommit}, ext_modules=[KERNELS])
