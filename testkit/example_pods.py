"""The repository's example pods file: the demo's four simulated pods on localhost, which
envoy/envoy.yaml is generated from. A file of the repository, not of the installed package."""

from __future__ import annotations

from pathlib import Path

EXAMPLE_PODS_FILE = Path(__file__).resolve().parents[1] / "examples" / "pods.yaml"
