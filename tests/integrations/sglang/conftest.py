"""Test set-up for SGLang 0.5.23 on a CPU machine (constraints/sglang-test.txt, installed by scripts/setup.sh).

SGLang's import chain (``sglang.srt.configs`` -> ``deepseek_ocr`` / ``internvl_utils``) runs
``from torchvision.transforms import InterpolationMode`` and ``... import functional`` at module level,
and PyPI's torchvision needs a CUDA torch. Where torchvision is absent this conftest puts a stand-in
into ``sys.modules`` with exactly those names, before any test module imports sglang. The stand-in
lives here and only here: the library never imports torchvision, and never sees this module.

transformers decides once per process (``is_torchvision_available`` is cached) whether torchvision
exists, and imports its image helpers from torchvision when it does; it is asked first, while
torchvision is still truly absent, so it keeps answering False and never reaches into the stand-in.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types

import pytest


def _stand_in(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, "stand-in for the tests of tiered_cache.integrations.sglang (conftest.py)")
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = mod
    return mod


class InterpolationMode(enum.Enum):
    """The names SGLang's image configs read as defaults; nothing here resizes an image."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _install_torchvision_stand_in() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return  # a real torchvision (the H200 image, a user's environment): use it
    if importlib.util.find_spec("sglang") is None:
        return  # the tests skip; nothing to prepare
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # cached False, before the stand-in exists
    tv = _stand_in("torchvision")
    transforms = _stand_in("torchvision.transforms")
    functional = _stand_in("torchvision.transforms.functional")
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    transforms.functional = functional
    tv.transforms = transforms


_install_torchvision_stand_in()
if importlib.util.find_spec("sglang") is not None:
    from tests.support import sgl_kernel_stub

    sgl_kernel_stub.install()  # with CUDA and no sgl_kernel (the H200 image) SGLang imports it at module level


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Where a test builds SGLang's pools (and so the tiers above them): the CPU, and the GPU under
    ``-m gpu`` (tests/conftest.py skips it where CUDA is absent)."""
    return request.param
