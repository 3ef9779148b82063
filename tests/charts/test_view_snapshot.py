"""The chart's view snapshot (``viewSnapshot``): off, nothing renders; on, the picker gets
``--view-snapshot-dir`` at the mount of a volume every replica shares, its pod name in
``POD_NAME`` (its file's name), a grace period that leaves time for the write, and the
volume is the operator's claim or one the chart makes (ReadWriteMany with several
replicas; a ReadWriteOnce one is refused). Lint, Kubernetes' schemas and the serve-flags
check run on the ``view-snapshot-replicas`` mode with every other (testkit.chart.MODES)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import helm_python
import pytest

from extproc.cli import serve
from testkit.chart import MODES, find, render

FULLNAME = "rel-extproc"
ON = {"enabled": True}


def picker(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def claims(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_off_renders_nothing_new() -> None:
    """Every viewSnapshot value but ``enabled`` changed: still exactly the default chart."""
    off = {
        "enabled": False,
        "mountPath": "/views",
        "maxAgeSeconds": 60,
        "existingClaim": "mine",
        "persistence": {"size": "5Gi", "storageClass": "x", "accessModes": ["ReadWriteMany"]},
        "writeSeconds": 30,
    }
    assert render({"viewSnapshot": off}) == render()


def test_on_the_picker_writes_and_reads_its_directory_on_the_shared_volume() -> None:
    docs = render(MODES["view-snapshot-replicas"])
    pod = picker(docs)
    [container] = pod["containers"]
    assert "--view-snapshot-dir=/var/lib/extproc/views" in container["args"]
    assert "--view-snapshot-max-age-s=3600" in container["args"]
    name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert name in container["env"]
    mount = {"name": "view-snapshot", "mountPath": "/var/lib/extproc/views"}
    assert mount in container["volumeMounts"]
    volume = {"name": "view-snapshot", "persistentVolumeClaim": {"claimName": f"{FULLNAME}-views"}}
    assert volume in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == 10 + 5 + 10  # drain, servers, the write
    [claim] = claims(docs)
    assert claim["metadata"]["name"] == f"{FULLNAME}-views"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "nfs-client",
        "resources": {"requests": {"storage": "1Gi"}},
    }


@pytest.mark.parametrize(
    ("values", "modes"),
    [
        pytest.param({}, ["ReadWriteOnce"], id="one-replica-rwo"),
        pytest.param({"replicas": 2}, ["ReadWriteMany"], id="replicas-rwx"),
        pytest.param(
            {"viewSnapshot": {**ON, "persistence": {"accessModes": ["ReadWriteOncePod"]}}},
            ["ReadWriteOncePod"],
            id="as-set",
        ),
    ],
)
def test_the_chart_made_claims_access_modes(values: dict[str, Any], modes: list[str]) -> None:
    [claim] = claims(render({"viewSnapshot": ON, **values}))
    assert claim["spec"]["accessModes"] == modes
    assert "storageClassName" not in claim["spec"]  # the cluster's default class


def test_an_existing_claim_is_mounted_and_none_is_made() -> None:
    docs = render({"replicas": 3, "viewSnapshot": {**ON, "existingClaim": "views-rwx"}})
    assert claims(docs) == []
    volume = {"name": "view-snapshot", "persistentVolumeClaim": {"claimName": "views-rwx"}}
    assert volume in picker(docs)["volumes"]


def test_the_values_reach_the_flags_and_the_grace_period() -> None:
    vs = {**ON, "mountPath": "/data/views", "maxAgeSeconds": 900, "writeSeconds": 30}
    docs = render({"viewSnapshot": vs, "picker": {"drainSeconds": 20}})
    [container] = picker(docs)["containers"]
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args, _ = parser.parse_known_args(container["args"])
    assert args.view_snapshot_dir == Path("/data/views")
    assert args.view_snapshot_max_age_s == 900
    assert picker(docs)["terminationGracePeriodSeconds"] == 20 + 5 + 30


def test_several_replicas_on_a_read_write_once_claim_are_refused() -> None:
    values = {
        "replicas": 3,
        "viewSnapshot": {**ON, "persistence": {"accessModes": ["ReadWriteOnce"]}},
    }
    with pytest.raises(helm_python.HelmRenderError, match="must be ReadWriteMany"):
        render(values)


@pytest.mark.parametrize(
    "vs",
    [
        pytest.param({"mountPath": "views"}, id="relative-mount"),
        pytest.param({"maxAgeSeconds": 0}, id="zero-max-age"),
        pytest.param({"persistence": {"size": "lots"}}, id="bad-size"),
        pytest.param({"persistence": {"accessModes": ["ReadOnlyMany"]}}, id="read-only"),
        pytest.param({"claim": "x"}, id="misspelled"),
    ],
)
def test_the_schema_refuses_bad_values(vs: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="values don't meet the spec"):
        render({"viewSnapshot": {**ON, **vs}})
