"""The ``sglang.srt.plugins`` entry point in pyproject.toml: SGLang's own plug-in loader finds it and it
registers the backend. The test installs nothing: it writes the entry point, as pyproject.toml declares
it, into a dist-info folder on sys.path (what an install puts in site-packages) and runs
``sglang.srt.plugins.load_plugins`` with SGLang's registry emptied of the name first."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

plugins = pytest.importorskip("sglang.srt.plugins")
registry = pytest.importorskip("sglang.srt.mem_cache.registry")

from tiered_cache.integrations import sglang as backend_pkg  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _entry_points() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]


def test_pyproject_declares_the_plugin():
    assert _entry_points() == {backend_pkg.BACKEND_NAME: "tiered_cache.integrations.sglang:register"}


@pytest.mark.parametrize("allowed", ["", backend_pkg.BACKEND_NAME, "someone-else"])
def test_sglangs_loader_finds_the_entry_point_and_registers_the_backend(tmp_path, monkeypatch, allowed):
    dist = tmp_path / "tiered_cache-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiered-cache\nVersion: 0.0.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in _entry_points().items())
    (dist / "entry_points.txt").write_text(f"[{plugins.GENERAL_PLUGINS_GROUP}]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", allowed)  # SGLang's whitelist ("" loads every plug-in)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)  # the loader runs once per process
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY",
                        {k: v for k, v in registry._RADIX_CACHE_REGISTRY.items() if k != backend_pkg.BACKEND_NAME})
    assert backend_pkg.BACKEND_NAME not in registry.registered_radix_cache_backends()
    plugins.load_plugins()
    if allowed == "someone-else":  # the whitelist leaves it out: not loaded, not registered
        assert backend_pkg.BACKEND_NAME not in registry.registered_radix_cache_backends()
    else:
        assert registry.get_radix_cache_factory(backend_pkg.BACKEND_NAME) is backend_pkg.factory
