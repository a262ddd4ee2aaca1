"""Test setup. TRITON_INTERPRET must be set before any @triton.jit is decorated, so it is set here,
before the package is imported, whenever CUDA is absent.

Also the one NaN-poison fixture (``poison``): every test that fills an output before a kernel or a copy
writes it takes its poison from there, so that "an element nobody wrote" looks the same in every test;
and the model the engine-level tests share (``qwen_long``)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models gain nothing from threads; on 2 shared cores two threads ran a forward 3-10x
    slower. Engine test modules use it with ``autouse`` wrappers or ``usefixtures``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)



@pytest.fixture
def keep_threads():
    """Puts torch's CPU thread count back after a test whose benchmark sets it (``--threads``)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)

class Poison:
    """Tensors an unwritten element shows in. Outputs are filled with it before the code under test writes
    them; a test then compares the written part and checks the rest still holds it. Zeros would hide an
    element nobody wrote (a zero state is a valid state), NaN cannot: it equals nothing, ``torch.equal``
    fails on it, and a kernel that reads it spreads it.

    Floats get NaN. Integers get the most negative value (``0x80`` for int8: -128, which the int8 codec
    never writes since it clamps codes to +-127; ``0x80..0`` for the wider ones), unsigned integers their
    all-ones pattern. Bool has no value to spare and is refused.

    ``poison(shape, dtype, device)`` builds such a tensor, ``poison.like(t)`` one shaped as ``t``, and
    ``poison.value(dtype)`` is the scalar, for poisoning rows of a tensor in place (``t[:, rows] = ...``).
    """

    def value(self, dtype: torch.dtype) -> float | int:
        if dtype == torch.bool:
            # Imported here: a conftest that imports the package breaks the collection of every test,
            # the package-free ones (docs, layout) included, whenever one module of it does not import.
            from tiered_cache.errors import InvalidArgumentError

            raise InvalidArgumentError("dtype", "a float or integer dtype (bool has no poison value)", dtype)
        if dtype.is_floating_point or dtype.is_complex:
            return float("nan")
        info = torch.iinfo(dtype)
        return info.max if info.min == 0 else info.min

    def __call__(self, shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        return torch.full(tuple(shape), self.value(dtype), dtype=dtype, device=device)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, self.value(t.dtype))


@pytest.fixture(scope="module")
def qwen_long():
    """The tiny long-memory Qwen3-Next (seed 0) that the engine, graph and T3 tests run, one a module as
    each module built its own before. Imported here, not at the top: the package (and ``transformers``,
    which the model needs and some machines lack) must not be a condition of collecting every test."""
    from tiered_cache.engine import tiny_qwen3_next

    return tiny_qwen3_next(seed=0, long_memory=True, device="cpu")


@pytest.fixture(scope="session")
def poison() -> Poison:
    """The one NaN-poison helper (see ``Poison``). Module-level helpers that poison take it as an argument."""
    return Poison()
