"""Programmatic dependent launch (PDL, NVIDIA sm_90 and later) for the kernels of a step.

A decode step is a chain of ~250 small kernels, each depending on the one before. Launched
with PDL, a kernel may start while the one before it finishes: its programs become resident
and wait in `griddepcontrol.wait` (`pdl_enter`) until every earlier kernel has completed and
its memory is visible, so the launch and ramp of a kernel overlap the tail of the last one.
A kernel that is one small grid also signals at its start that the next one may launch
(`griddepcontrol.launch_dependents`); a large grid does not, since the next kernel's waiting
programs would take the slots its own later programs need (bench/pdl_probe.py: a chain of
4,224-program kernels gets 1.6x slower with the early signal, a chain of 224-program kernels
1.4x faster; bench/results/h200/pdl_probe.json).

Correctness does not depend on which kernels use it: every PDL-launched kernel waits before
its first load or store, so it never reads an input early or overwrites a buffer the kernel
before it still reads, and a kernel launched without PDL waits for the previous kernel's
completion as always. The wait covers all earlier work: the kernel before completed only
after its own wait returned. Captured into CUDA graphs as programmatic edges (CUDA 12.3+).

`KernelConfig.pdl` turns it on per architecture (the sm_90 entry); `LUCEIO_PDL=0|1`
overrides it, read once at import. Never under the Triton interpreter or on ROCm.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ENV = os.environ.get("LUCEIO_PDL")
_CAPABLE: dict[int, bool] = {}


@triton.jit
def pdl_enter(PDL: tl.constexpr, EARLY: tl.constexpr):
    """First statement of a kernel launched by `pdl_kwargs`: wait for the kernels before it
    (and, EARLY, let the next one launch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()


def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = (torch.version.hip is None and
                           torch.cuda.get_device_capability(index)[0] >= 9)
    return _CAPABLE[index]


def pdl_enabled(device: torch.device, cfg) -> bool:
    """Whether kernels on `device` launch with PDL under config `cfg`."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    on = cfg.pdl if _ENV is None else _ENV not in ("0", "false", "")
    return on and _capable(device)


_DECIDED: dict = {}


def pdl_kwargs(device: torch.device, cfg, programs: int) -> dict:
    """Launch keyword arguments for a kernel taking `pdl_enter`'s constexprs as PDL / PDL_EARLY,
    whose grid has `programs` programs: {} where PDL is off (the constexprs' defaults, False)."""
    key = (device, id(cfg))
    seen = _DECIDED.get(key)
    if seen is None or seen[0] is not cfg:  # decided once per (device, config object)
        seen = _DECIDED[key] = (cfg, pdl_enabled(device, cfg))
    if not seen[1]:
        return {}
    return {"PDL": True, "PDL_EARLY": programs <= cfg.pdl_early_max_programs,
            "launch_pdl": True}
