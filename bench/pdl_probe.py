"""Does programmatic dependent launch (PDL, sm_90+) shorten a chain of small dependent Triton
kernels inside a CUDA graph? A decode step is ~250 such kernels, each mostly launch latency
and ramp. Times one graph replay of `--chain` dependent kernels (each reads the previous
one's output, so the result also checks that PDL kept the order) with PDL off, with PDL and
the dependents' launch signalled at the start, and with the default signal (at exit).

python bench/pdl_probe.py [--chain 256] [--programs 224] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _step(x_ptr, y_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
          EARLY: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    acc = v
    for i in range(ITERS):  # some dependent work, as a GEMV's K loop has
        acc = acc * 1.0000001 + 0.0
    tl.store(y_ptr + offs, acc + 1.0, mask=m)


def run(chain: int, programs: int, iters: int, pdl: bool, early: bool) -> tuple[float, float]:
    block = 32
    n = programs * block
    a = torch.zeros(n, device="cuda")
    b = torch.zeros(n, device="cuda")

    def body():
        src, dst = a, b
        for _ in range(chain):
            _step[(programs,)](src, dst, n, ITERS=iters, BLOCK=block, PDL=pdl, EARLY=early,
                               num_warps=1, launch_pdl=pdl)
            src, dst = dst, src

    body()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    a.zero_()
    b.zero_()
    g.replay()
    torch.cuda.synchronize()
    final = (a if chain % 2 == 0 else b)[0].item()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 100
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / reps, final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=256)
    ap.add_argument("--programs", default="224,4224")
    ap.add_argument("--iters", default="0,64")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for programs in map(int, a.programs.split(",")):
        for iters in map(int, a.iters.split(",")):
            for name, pdl, early in (("off", False, False), ("pdl_exit", True, False),
                                     ("pdl_early", True, True)):
                us, final = run(a.chain, programs, iters, pdl, early)
                row = {"programs": programs, "iters": iters, "mode": name, "chain": a.chain,
                       "replay_us": round(us, 1), "us_per_kernel": round(us / a.chain, 3),
                       "final_ok": abs(final - a.chain) < 1e-3 * a.chain}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        env = {"torch": torch.__version__, "triton": triton.__version__,
               "gpu": torch.cuda.get_device_name()}
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
