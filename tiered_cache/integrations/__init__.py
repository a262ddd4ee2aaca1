"""Adapters that plug the cache into serving engines as their prefix-cache backend.

``tiered_cache.integrations.sglang``: SGLang 0.5.23 (``pip install tiered-cache[sglang]``). Each
adapter imports its engine; nothing else in the package imports an engine.
"""
