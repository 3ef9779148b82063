"""Precise prefix-cache view: what each pod caches, from vLLM's KV-cache events."""
