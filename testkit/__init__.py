"""Support the tests and benchmarks share, on top of ``extproc.sim.launch`` (which starts
simulated pods, extproc and Envoy, and stays in the product for ``extproc demo``):
in-process simulated pods, replicas with Redis, a process's resource usage, the KV-events
trust wait, and test-only views of the product's state. Not part of the wheel
(``pyproject.toml`` packages only ``extproc*``)."""
