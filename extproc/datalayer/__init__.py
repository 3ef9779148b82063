"""Where pods come from: sources that publish immutable ``tuple[Pod, ...]`` snapshots.

``pods_file`` reads a YAML file and watches it for changes. Modules here import only
``extproc.types`` and ``extproc.errors``; the request path reads the published snapshot.
"""
