"""A model's optional-kernel functions on their torch implementations, for one test.

transformers routes some module-level functions of a modeling module (the gated-delta chunk rule, the
short convolutions, Mamba2's scans) to a kernel package where one is installed (flash-linear-attention,
causal-conv1d, mamba-ssm: ``use_kernel_func_from_hub_with_fallback``), keeping the torch function as the
wrapper's ``__wrapped__`` (under 5.25 with the ``kernels`` package installed, inside an ``nn.Module``
instance that stands for the function: ``split_forward.hub_function``). The GPU machine always has fla
(it is carried for the benchmarks), whose Triton kernels compute in TF32: there a lossless cached run
drifted 1.7e-2 from the no-cache run (both deterministic; H200, 2026-11-30), so an exact-equality test
would test fla, not the cache. The engine's
split forward (``engine.runner.split_forward``) may have wrapped two of them again; that wrapper is taken
off too, and an engine built in the test puts it back over the torch function.
"""

from __future__ import annotations

import inspect
import sys

from tiered_cache.engine.runner.split_forward import hub_function


def _kernel_routed(fn) -> bool:
    """Whether ``fn`` is transformers' wrapper that picked an implementation at import."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None or not callable(fn):
        return False
    try:
        return "implementation" in inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return False


def bare_torch_kernels(monkeypatch, model) -> list[str]:
    """Set every kernel-routed function of the modules ``model``'s layers come from to its torch function
    (``monkeypatch`` undoes it after the test); returns the names set."""
    mods = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__ in sys.modules}
    done = []
    for mod in sorted(mods, key=lambda m: m.__name__):
        for name, fn in list(vars(mod).items()):
            fn = getattr(fn, "__tiered_cache_split__", fn)
            inner = hub_function(fn)
            if inner is not fn:  # 5.25 with ``kernels``: an nn.Module standing for the function
                if getattr(inner, "__name__", None) != name:
                    continue
                fn = inner
            elif not _kernel_routed(fn):
                continue
            monkeypatch.setattr(mod, name, fn.__wrapped__ if _kernel_routed(fn) else fn)
            done.append(f"{mod.__name__}.{name}")
    return done
