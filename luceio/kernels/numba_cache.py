"""numba's on-disk cache (`cache=True`) keys a jitted function's machine code on a hash of the
function's own source file. The CPU kernels inline LLVM IR and jitted helpers from other
files (`qdot_ir_cpu.py` into `qdot_kernels_cpu.py`, ...). A change to one of those files alone
(an edit, a `git pull`) used to leave the cached builds in place. The kernels then ran the old
code until the dependent file's own text changed; touching it changes nothing, since the key
is the text's hash, not the file's time.

`depend_on` folds the contents of the files a kernel module inlines into the cache key of each
cached function the module defines. It is called at the end of the module, before anything is
compiled or loaded. It relies on numba's `IndexDataCacheFile._source_stamp` (numba 0.49 on),
and does nothing where that is absent.
"""
from __future__ import annotations

import hashlib
import os


def depend_on(namespace: dict, *files: str) -> None:
    """Make the on-disk cache of every cached jitted function defined in the module of
    `namespace` (its `globals()`) depend on `files` too (names beside this file)."""
    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in files:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    extra = digest.hexdigest()
    for value in namespace.values():
        func = getattr(value, "py_func", None)
        if func is None or func.__module__ != namespace["__name__"]:
            continue  # not a dispatcher, or another module's (that module stamps its own)
        index = getattr(getattr(value, "_cache", None), "_cache_file", None)
        if index is not None and hasattr(index, "_source_stamp"):
            index._source_stamp = (index._source_stamp, extra)
