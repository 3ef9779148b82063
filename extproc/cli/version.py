"""For ``extproc --version``: the commit extproc was built from, and which implementation
of the per-request hot path runs.

The commit, the first found:

1. the package is a git checkout's own ``extproc/`` (an editable install, or run from the
   source tree): that checkout's ``HEAD``, ``(modified)`` when tracked files differ from it;
2. ``extproc/commit.txt``, which ``setup.py`` writes into the wheel when the build runs in
   a checkout (``pip install .``, ``pip install git+URL``);
3. else ``unknown``: the Dockerfile's build context, an sdist, holds no ``.git``.

Standard library only at import: ``setup.py`` loads this file by path at build time.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

COMMIT_FILE = "commit.txt"  # in the package; written by setup.py's build_py
PACKAGE = Path(__file__).resolve().parents[1]  # this extproc/
_GIT_TIMEOUT_S = 5.0


def checkout_commit(root: Path) -> str | None:
    """The commit of the git checkout whose top directory is ``root``, else None.

    ``root`` must be the checkout's top: a directory merely inside one (a venv in a
    checkout, an sdist unpacked in another project) is not its source. ``(modified)``
    follows the hash when tracked files differ from the commit.
    """

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args],
                capture_output=True,
                text=True,
                timeout=_GIT_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):  # no git, or a hung one
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} (modified)" if changes else commit


def commit(package: Path = PACKAGE) -> str:
    """The commit the ``extproc`` package at ``package`` was built from, or ``unknown``."""
    found = checkout_commit(package.parent)
    if found is not None:
        return found
    recorded = package / COMMIT_FILE
    if recorded.is_file():
        return recorded.read_text(encoding="utf-8").strip() or "unknown"
    return "unknown"


def hot_path() -> str:
    """The implementation of the per-request kernels (``extproc.kernels``): compiled, or
    pure Python and why."""
    from extproc.kernels import IMPLEMENTATION  # imports NumPy: only when asked

    return IMPLEMENTATION
