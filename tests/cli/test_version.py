"""``extproc --version``: the version, the commit it was built from, the hot path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.cli.version import COMMIT_FILE, checkout_commit, commit
from extproc.kernels import IMPLEMENTATION, KERNELS_ENV

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout of one commit, holding a file and a directory."""
    root = tmp_path / "checkout"
    (root / "extproc").mkdir(parents=True)
    (root / "extproc" / "__init__.py").write_text("")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "one")
    return root


def test_version_prints_version_commit_and_hot_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"extproc {VERSION}"
    # This test runs from the repository's checkout: its own commit, maybe modified.
    assert re.fullmatch(r"commit: [0-9a-f]{40}( \(modified\))?", lines[1]), lines[1]
    assert lines[2] == f"hot path: {IMPLEMENTATION}"


def _version_command(**env: str) -> str:
    """``python -m extproc --version``'s output, with ``env`` added to the environment."""
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, **env},
    )
    return done.stdout


def test_version_says_when_the_pure_kernels_are_chosen() -> None:
    lines = _version_command(**{KERNELS_ENV: "pure"}).splitlines()
    assert lines[2] == f"hot path: pure Python ({KERNELS_ENV}=pure)"


def test_version_from_the_command_line() -> None:
    assert _version_command().startswith(f"extproc {VERSION}\ncommit: ")


def test_a_checkout_gives_its_head_and_says_when_it_is_modified(checkout: Path) -> None:
    head = _git(checkout, "rev-parse", "HEAD")
    assert checkout_commit(checkout) == head
    assert commit(checkout / "extproc") == head
    (checkout / "extproc" / "__init__.py").write_text("changed = True\n")
    assert checkout_commit(checkout) == f"{head} (modified)"


def test_a_directory_inside_a_checkout_is_not_its_source(checkout: Path) -> None:
    """A venv or an unpacked sdist inside someone's checkout must not claim its commit."""
    assert checkout_commit(checkout / "extproc") is None


def test_without_a_checkout_the_commit_recorded_at_build_time(tmp_path: Path) -> None:
    package = tmp_path / "site-packages" / "extproc"
    package.mkdir(parents=True)
    assert checkout_commit(tmp_path) is None
    assert commit(package) == "unknown"
    (package / COMMIT_FILE).write_text("0123abcd\n")
    assert commit(package) == "0123abcd"
