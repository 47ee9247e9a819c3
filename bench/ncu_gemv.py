"""Run the one-row quantized GEMV once per qtype on a large matrix, for `ncu` to profile.

    ncu --clock-control none -k regex:_gemv_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python bench/ncu_gemv.py q4_k

Random weights at the Llama-3.1-8B gate_up shape (28672 x 4096) through `quant_matmul_skinny`;
five calls, so `--launch-skip` can step past the first (compiling) ones. Prints nothing of its
own: the profiler's report is the output. Used to find what limits the kernel (stall reasons,
achieved occupancy, DRAM throughput) where timing alone cannot say.
"""
from __future__ import annotations

import sys

import torch

from luceio.kernels import prepare_weight
from luceio.kernels.quant import random_quant_weight
from luceio.kernels.quant_triton import quant_matmul_skinny


def main(argv: list[str]) -> int:
    qtype = argv[0] if argv else "q4_k"
    n, k = (int(v) for v in argv[1:3]) if len(argv) >= 3 else (28672, 4096)
    torch.manual_seed(0)
    w = prepare_weight(random_quant_weight(qtype, n, k, device="cuda"), torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        quant_matmul_skinny(x, w)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
