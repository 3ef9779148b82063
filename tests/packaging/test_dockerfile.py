"""The Dockerfile's structure, and the image it builds against what the chart runs.

No base image can be pulled here; test_install.py replays the build steps themselves.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from testkit.chart import CHART_DIR, find, render
from tests.packaging.image import DOCKERFILE, REPO, Stage, mounts, stages

PYTHON_SLIM = re.compile(r"^python:3\.11-slim(@sha256:[0-9a-f]{64})?$")
PYTHON_FULL = re.compile(r"^python:3\.11(@sha256:[0-9a-f]{64})?$")
# Nothing that compiles, nor test or simulator packages, in the image.
FORBIDDEN_IN_IMAGE = re.compile(
    r"apt-get|apk |gcc|g\+\+|build-essential|\[(test|sim|envoy)|pytest|hypothesis"
)
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def image() -> Stage:
    return stages()[-1]


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    docs = render({})
    return find(docs, "Deployment", "rel-extproc")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_the_builder_can_compile_and_the_image_is_slim() -> None:
    """The builder is the full Python image (a C compiler for the kernels); the image the
    slim one."""
    *builders, image = stages()
    assert builders, "a builder stage and the image"
    assert all(PYTHON_FULL.match(s.base) for s in builders), [s.base for s in builders]
    assert PYTHON_SLIM.match(image.base), image.base


def test_the_image_takes_only_the_builders_wheels(image: Stage) -> None:
    """No source or test file is copied in, nothing compiles, nothing comes from an index."""
    assert not image.all("COPY") and not image.all("ADD")
    [install] = image.all("RUN")
    builder_names = {s.name for s in stages()[:-1]}
    assert [m["from"] for m in mounts(install)] and all(
        m["from"] in builder_names for m in mounts(install)
    )
    script = install.value[0]
    assert "--no-index" in script and "pip install" in script
    assert not FORBIDDEN_IN_IMAGE.search(script), script


def test_the_builder_copies_only_the_package(image: Stage) -> None:
    """And .dockerignore keeps the context to what it copies (no .venv sent to Docker)."""
    copied = {src.rstrip("/") for s in stages()[:-1] for c in s.all("COPY") for src in c.value[:-1]}
    assert copied == {"pyproject.toml", "setup.py", "README.md", "extproc"}
    lines = (REPO / ".dockerignore").read_text().splitlines()
    rules = [line.rstrip("/") for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*" and {f"!{c}" for c in copied} <= set(rules)


def test_the_user_is_the_charts_non_root_uid(image: Stage, deployment: dict[str, Any]) -> None:
    user = image.last("USER")
    assert user is not None, "the image runs as root"
    uid, _, gid = user.value[0].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can check it"
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid or uid)) == (security["runAsUser"], security["runAsGroup"])


def test_entrypoint_and_ports_are_the_charts(image: Stage, deployment: dict[str, Any]) -> None:
    container = _container(deployment)
    entrypoint, cmd, expose = image.last("ENTRYPOINT"), image.last("CMD"), image.last("EXPOSE")
    assert entrypoint is not None and entrypoint.json and cmd is not None and cmd.json
    assert [*entrypoint.value] == container["command"] == ["extproc"]
    assert cmd.value[0] == container["args"][0] == "serve"
    assert "--address=0.0.0.0" in cmd.value, "reachable from outside the container"
    ports = re.compile(r"^--(grpc|health|metrics)-port=")
    assert sorted(a for a in cmd.value if ports.match(a)) == sorted(
        a for a in container["args"] if ports.match(a)
    )
    assert expose is not None
    assert {int(p) for p in expose.value} == {p["containerPort"] for p in container["ports"]}


def test_the_charts_default_image_is_what_the_readmes_build(deployment: dict[str, Any]) -> None:
    image = _container(deployment)["image"]
    assert image == f"extproc:{VERSION}"
    build = f"docker build -t {image} ."
    for readme in (REPO / "README.md", CHART_DIR / "README.md", DOCKERFILE):
        assert build in readme.read_text(), readme
