"""Cost of a few rows through the quantized GEMV: the dp4a GEMV / skinny dot / dequantized copy
(the arch's config as it is) against the tensor-core GEMV (kernels/quant_gemv_mma.py) at each
tile given, on the GEMVs of a 7B and a 1.5B Q4_K_M layer.

    python bench/gemv_mma.py [--rows 1,5,8,9,16,17,23,32,48] [--tiles 64:4:32,...] [--out DIR]

Each (matrix, rows, variant) is timed as bench/qgemm.py times a GEMM (CUDA graph over weight
copies spanning 256 MiB, so every call reads W from HBM) and reported in us and as a ratio to
one row's time; every tensor-core variant's output is checked against the exact product with
the int8-rounded x (`ok`, max abs error). Tiles: block_n:num_warps:rows_per_launch.
Writes DIR/gemv_mma.json (default bench/results/h200).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, env_info, write_json  # noqa: E402
from qgemm import time_per_call, weight_copies  # noqa: E402

from luceio.kernels import configs, prepare_weight  # noqa: E402
from luceio.kernels.quant import dequantize, nbytes, random_quant_weight  # noqa: E402
from luceio.kernels.quant_x import quantize_x_ref  # noqa: E402
from luceio.kernels.quant_triton import quant_matmul  # noqa: E402

MATRICES = [("qwen2.5-7b q", 3584, 3584, "q4_k"), ("qwen2.5-7b gate_up", 37888, 3584, "q4_k"),
            ("qwen2.5-7b down", 3584, 18944, "q6_k"), ("qwen2.5-7b v", 512, 3584, "q6_k"),
            ("qwen2.5-1.5b gate_up", 17920, 1536, "q4_k"), ("qwen2.5-1.5b down", 1536, 8960, "q6_k")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,5,8,9,16,17,23,32,48")
    ap.add_argument("--tiles", default="64:4:16,64:8:32,128:8:32,32:4:32,64:4:64",
                    help="block_n:num_warps:rows_per_launch,...")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    base = configs.get_config(dev)
    variants = [("as configured", replace(base, gemv_mma_max_m=0))]
    for t in args.tiles.split(","):
        bn, nw, rl = (int(v) for v in t.split(":"))
        variants.append((f"mma {t}", replace(base, gemv_mma_max_m=64, gemv_mma_block_n=bn,
                                              gemv_mma_num_warps=nw,
                                              gemv_mma_rows_per_launch=rl)))
    rows_list = [int(r) for r in args.rows.split(",")]
    out = {"env": env_info(), "copy_GBps": copy_bandwidth() / 1e9, "results": []}
    for name, n, k, qtype in MATRICES:
        w = prepare_weight(random_quant_weight(qtype, n, k, device=dev), torch.bfloat16)
        ws = weight_copies(w, nbytes(w))
        w32 = dequantize(w).float()   # the reference: x int8-rounded times W in fp32
        print(f"{name} [{n}, {k}] {qtype}: {len(ws)} copies", flush=True)
        one = None
        for m in rows_list:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            for vname, cfg in variants:
                if m <= base.gemv_max_m and vname != "as configured":
                    continue
                with configs.use_config(cfg):
                    exact = None
                    if vname != "as configured":
                        ref = quantize_x_ref(x).float() @ w32.T
                        err = (quant_matmul(x, w).float() - ref.float()).abs().max().item()
                        exact = err <= 2e-2 + 1e-2 * ref.float().abs().max().item()
                    try:
                        t = time_per_call([lambda wi=wi: quant_matmul(x, wi) for wi in ws],
                                          args.repeats)
                    except Exception as e:  # a tile that does not compile: say so, go on
                        print(f"  M={m} {vname}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                if m == 1:
                    one = t
                rec = {"matrix": name, "n": n, "k": k, "qtype": qtype, "rows": m,
                       "variant": vname, "us": t * 1e6, "vs_one_row": t / one,
                       "GBps": nbytes(w) / t / 1e9, "ok": exact}
                out["results"].append(rec)
                print(f"  M={m:2d} {vname:14s} {t * 1e6:8.1f} us  {t / one:5.2f}x one row"
                      + ("" if exact is None else f"  ok={exact}"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "gemv_mma.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
