"""Where pods and their load come from; everything here runs in the background.

``pods_file`` reads a YAML file and watches it for changes; ``scrape`` reads each pod's
``/metrics`` (``engine_metrics`` parses the page); ``store`` merges both into the
immutable ``tuple[Pod, ...]`` the router reads. Modules here import only
``extproc.types`` and ``extproc.errors`` from extproc; the request path reads the
published snapshot without locks.
"""
