"""Where pods and their load come from; everything here runs in the background.

``pods_file`` reads a YAML file and watches it for changes; ``k8s`` watches Kubernetes
pods by label selector or through an InferencePool (on the lightkube client, with
``reflector``, ``kubeconfig``, ``k8s_objects``); ``sources`` picks one from ``extproc serve``'s flags.
``scrape`` reads each pod's ``/metrics`` (``engine_metrics`` parses the page); ``store``
merges the source's pods and their load into the immutable ``tuple[Pod, ...]`` the
router reads without locks. Modules here import only ``extproc.pods``,
``extproc.errors``, each other and third-party libraries.
"""
