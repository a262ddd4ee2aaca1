"""A stand-in for ``sgl_kernel`` (SGLang's CUDA kernel wheel, absent on the H200 image), for the tests of
``tiered_cache.integrations.sglang`` only.

With CUDA present, ``sglang.srt.layers.quantization`` (reached from ``mem_cache.memory_pool``) runs
``from sgl_kernel import ...`` at module level, so without it every SGLang test would skip on a GPU.
``install`` adds a finder, last on ``sys.meta_path`` (so only names no other finder has), that serves
``sgl_kernel`` and its submodules as modules whose every name is a placeholder: attributes of a
placeholder are placeholders (``scalar_types.uint4b8``) and calling one raises ``NotImplementedError``,
so a test that reached a kernel would fail loudly, never pass on a fake. Nothing the cache tests run
calls one (measured on the H200, 2026-12-01). Without CUDA or with the real package it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Placeholder:
    def __init__(self, qual: str) -> None:
        self.__qualname__ = qual
        self.__name__ = qual.rsplit(".", 1)[-1]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__qualname__}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.__qualname__}: sgl_kernel stand-in (tests/support/sgl_kernel_stub.py)")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self.__qualname__}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sgl_kernel":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name, "stand-in (tests/support/sgl_kernel_stub.py)")
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    import torch

    if not torch.cuda.is_available():
        return  # SGLang's is_cuda() is False: it never imports sgl_kernel at module level
    if importlib.util.find_spec("sgl_kernel") is not None:
        return  # the real one
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
