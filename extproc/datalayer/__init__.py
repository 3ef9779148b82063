"""Where pods come from: sources that publish immutable ``tuple[Pod, ...]`` snapshots.

``pods_file`` reads a YAML file and watches it for changes; ``k8s`` watches Kubernetes
pods by label selector or through an InferencePool (on ``reflector``, ``kubeapi``,
``kubeconfig``, ``k8s_objects``); ``sources`` picks one from ``extproc serve``'s flags.
Modules here import only ``extproc.types``, ``extproc.errors`` and each other; the request
path reads the published snapshot.
"""
