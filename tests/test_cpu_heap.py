"""`memory.keep_freed_heap`: after it, a large activation allocated and freed again and again
(a CPU prefill step's) reuses its pages instead of faulting in a fresh mapping each time. Run in
a child process: the setting is process-wide, and the parent (any CPU engine sets it) already
has it. Counted in minor page faults, not time."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from luceio.memory import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        t = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: past glibc's largest mmap threshold
        t.fill_(1)
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()  # the first allocation faults in either way
print(faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_keep_their_pages():
    import ctypes
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        pytest.skip("not glibc")
    counts = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        counts[mode] = int(out.stdout.split()[-1])
    # default: each allocation is a new mapping, faulted in at least once per 2 MiB (once per
    # 4 KiB page here: 65,540; fewer where the kernel backs it with huge pages); kept: the
    # heap's pages are reused (0 here)
    assert counts["default"] >= 4 * (64 << 20) // (2 << 20), counts
    assert counts["keep"] < 32, counts
