"""Real vLLM (CPU) pods behind Envoy and extproc; see ``prepare.py`` and ``pods.py``."""
