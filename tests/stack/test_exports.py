"""The package's front door: ``CacheConfig``, ``TieredCache`` and every error class of ``errors.py`` are
importable from ``tiered_cache`` itself."""

from __future__ import annotations

import inspect

import tiered_cache
from tiered_cache import errors


def test_every_error_class_is_exported():
    classes = {n for n, c in vars(errors).items()
               if inspect.isclass(c) and issubclass(c, Exception) and c.__module__ == errors.__name__}
    assert classes and classes <= set(tiered_cache.__all__)
    assert all(getattr(tiered_cache, n) is getattr(errors, n) for n in classes)


def test_the_door_is_exported():
    from tiered_cache.config import CacheConfig
    from tiered_cache.stack import TieredCache

    assert tiered_cache.CacheConfig is CacheConfig and tiered_cache.TieredCache is TieredCache
    assert {"CacheConfig", "TieredCache"} <= set(tiered_cache.__all__)
