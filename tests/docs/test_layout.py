"""The test tree's layout (issue 18): every test file lives in a folder named for its subject, helpers
live in ``tests/support/``, and outputs are poisoned in one way, through conftest's ``poison`` fixture,
so an element nobody wrote looks the same in every test."""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch

from tiered_cache.errors import InvalidArgumentError

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A NaN fill of a new tensor (torch.full / full_like / new_full / fill_ with NaN) or of rows of one
# (``t[:, rows] = nan``). A NaN written into one element (``t[0, 1, 0] = nan``) is a test's input, not
# poison, and stays allowed: the non-finite-state tests plant such values on purpose.
NAN = r"(?:float\(\s*['\"]nan['\"]\s*\)|math\.nan|torch\.nan|np\.nan|numpy\.nan)"
NAN_FILL = re.compile(rf"(?:\bfull(?:_like)?|\.new_full|\.fill_)\([^\n]*{NAN}|\[[^\n=]*:[^\n=]*\]\s*=\s*{NAN}")


def _python_files() -> list[str]:
    out = []
    for top, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        out += [os.path.relpath(os.path.join(top, f), TESTS) for f in files if f.endswith(".py")]
    return sorted(out)


def test_every_test_file_is_in_a_subject_folder():
    """No ``tests/test_*.py`` at the top level (conftest.py is the one file there), and no test file
    among the helpers of ``tests/support/``."""
    files = _python_files()
    assert [f for f in files if os.sep not in f] == ["conftest.py"]
    assert [f for f in files if f.startswith("support" + os.sep) and os.path.basename(f).startswith("test_")] == []
    subjects = {f.split(os.sep)[0] for f in files if os.path.basename(f).startswith("test_")}
    assert len(subjects) >= 8 and "support" not in subjects


def test_no_test_module_imports_another():
    """Shared pieces live in ``tests/support/`` (the host-tier state machine imported the plain one's
    module, the SWA machine the host one's)."""
    imports = []
    for f in _python_files():
        for n in ast.walk(ast.parse(open(os.path.join(TESTS, f)).read())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            imports += [f"{f}: {m}" for m in names if m.split(".")[-1].startswith("test_")]
    assert imports == []


def test_the_poison_helper_is_defined_only_in_conftest():
    """conftest.py defines ``Poison`` and the ``poison`` fixture; no other test file defines either or fills
    a tensor with NaN itself (conftest's own fill takes its value from ``Poison.value``)."""
    defined, filled = [], []
    for f in _python_files():
        src = open(os.path.join(TESTS, f)).read()
        names = {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if names & {"poison", "Poison", "poison_like"}:
            defined.append(f)
        if f != os.path.join("docs", "test_layout.py"):  # this file spells the old ways out, as examples
            filled += [f"{f}:{src.count(chr(10), 0, m.start()) + 1}" for m in NAN_FILL.finditer(src)]
    assert defined == ["conftest.py"]
    assert filled == []


def test_the_nan_fill_pattern_catches_the_old_ways():
    """The check above can fail: each way the tests used to poison is caught, a planted element is not."""
    caught = ['torch.full((2, 3), float("nan"))', "torch.full_like(src, float('nan'))", "x.fill_(math.nan)",
              't.new_full((4,), torch.nan)', 'views.temporal[:, [1, 3, 4]] = float("nan")', "t[:, 1] = math.nan"]
    assert [c for c in caught if not NAN_FILL.search(c)] == []
    assert not NAN_FILL.search('t[0, 1, 0, 0, 0] = float("nan")')
    assert not NAN_FILL.search("BAD = [float('nan'), float('inf')]")


def test_poison_fills_floats_with_nan_and_integers_with_a_value_codes_never_take(poison):
    """NaN for every float dtype; -128 for int8 (the int8 codec clamps to +-127), the most negative value
    for the wider integers, all ones for unsigned; bool has no value to spare."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = poison((2, 3), dtype)
        assert t.shape == (2, 3) and t.dtype == dtype and t.isnan().all()
    assert poison((4,), torch.int8).tolist() == [-128] * 4
    assert poison((1,), torch.int64).item() == -2**63 and poison((1,), torch.int32).item() == -2**31
    assert poison((2,), torch.uint8).tolist() == [255, 255]
    like = poison.like(torch.zeros(3, 2, dtype=torch.bfloat16))
    assert like.shape == (3, 2) and like.dtype == torch.bfloat16 and like.isnan().all()
    with pytest.raises(InvalidArgumentError) as err:
        poison((1,), torch.bool)
    assert err.value.arg == "dtype"
