"""numba's on-disk cache keys a function on its own file's text only; the CPU kernel modules
fold the files whose IR and jitted helpers they inline into that key (kernels/numba_cache.py),
so an edit or a `git pull` that changes only those files recompiles them."""
from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("numba")
from luceio.kernels.numba_cache import depend_on  # noqa: E402

MODULES = ["qdot_kernels_cpu", "qdot8_kernels_cpu", "decode_cpu", "half_cpu", "rows_attention_cpu"]


def _stamps(module) -> dict:
    out = {}
    for name, value in vars(module).items():
        index = getattr(getattr(value, "_cache", None), "_cache_file", None)
        if getattr(getattr(value, "py_func", None), "__module__", None) == module.__name__ and \
                index is not None:
            out[name] = index._source_stamp
    return out


@pytest.mark.parametrize("name", MODULES)
def test_kernel_modules_fold_their_dependencies_into_the_cache_key(name):
    module = importlib.import_module(f"luceio.kernels.{name}")
    stamps = _stamps(module)
    assert stamps  # it has cached kernels
    for stamp in stamps.values():
        assert isinstance(stamp, tuple) and len(stamp) == 2 and len(stamp[1]) == 64


def test_a_dependency_changes_the_key_and_only_its_modules(tmp_path, monkeypatch):
    (tmp_path / "dep.py").write_text("X = 1\n")
    (tmp_path / "kern.py").write_text(
        "from numba import njit\nfrom luceio.kernels.decode_cpu import silu_and_mul\n\n\n"
        "@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(tag):
        spec = importlib.util.spec_from_file_location(f"kern_{tag}", tmp_path / "kern.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    imported = _stamps(importlib.import_module("luceio.kernels.decode_cpu"))
    a = load("a")
    plain = a.f._cache._cache_file._source_stamp
    depend_on(vars(a), str(tmp_path / "dep.py"))
    first = a.f._cache._cache_file._source_stamp
    assert first[0] == plain and first != plain
    (tmp_path / "dep.py").write_text("X = 2\n")
    b = load("b")
    depend_on(vars(b), str(tmp_path / "dep.py"))
    second = b.f._cache._cache_file._source_stamp
    assert second[0] == plain and second != first  # the same file, another dependency: stale
    # the imported kernel (another module's) keeps its own key
    assert _stamps(importlib.import_module("luceio.kernels.decode_cpu")) == imported
