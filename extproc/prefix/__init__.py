"""Prefix matching: prompt -> chained block hashes (``hashing``) -> per-pod LRU index
(``index``: Kthena's rules, its entries kept in ``storage``).

``hash_prompt`` is the public, Kthena-compatible hash function for tools and checks.
"""

from extproc.prefix.hashing import PromptBlockHash, hash_prompt
from extproc.prefix.index import PrefixIndex

__all__ = ["PrefixIndex", "PromptBlockHash", "hash_prompt"]
