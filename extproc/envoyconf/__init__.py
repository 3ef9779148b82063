"""Envoy configuration for extproc: ``build`` makes it from typed protobuf objects,
``render`` writes it as commented YAML, ``cli`` is the ``extproc envoy-config`` command.
"""
