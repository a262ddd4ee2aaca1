"""Helpers for tests, benchmarks and demos: not part of the cache (``local_redis``: a redis-server of
our own on a free loopback port)."""
