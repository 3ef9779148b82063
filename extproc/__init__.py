"""extproc: an Envoy ext_proc endpoint picker for vLLM pods.

Data flows one way: request body -> prompt rendering (``request``) -> block hashes
(``prefix``) -> scheduler (``scheduling``: filters, weighted scores) -> ordered pod
list -> Envoy; completion event -> ``record``.
"""

__version__ = "0.1.0"
