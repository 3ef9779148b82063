"""Support the tests and benchmarks share: launching Envoy and extproc locally, the
simulated-pod harness, replicas, and test-only views of the product's state. Not part of
the wheel (``pyproject.toml`` packages only ``extproc*``)."""
