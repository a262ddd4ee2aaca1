"""Test setup. TRITON_INTERPRET must be set before any @triton.jit is decorated, so it is set here,
before the package is imported, whenever CUDA is absent."""

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
