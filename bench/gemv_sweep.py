"""Launch-config sweep of the one-row int8 quantized GEMV (kernels/quant_gemv.py) on the GPU.

    python bench/gemv_sweep.py [--out DIR] [--repeats N]
    python bench/gemv_sweep.py --rows 4,8 [--block-ns 1,2,4,8] [--row-blocks 1,2]
                               [--rows-prefetch 0,1]

`--rows`: instead, the several-row launches' `gemv_rows_block_n` (and `gemv_row_blocks`: 2,
rows in two blocks, 5 = 4 + 1, instead of padded to a power of two;
`gemv_rows_prefetch`: the next tile's code words loaded while this one computes) is swept at
each M given (the arch's one-row config otherwise), each config checked for rows bit-equal to
one row alone;
writes DIR/gemv_rows_sweep.json (`--json-name`).

GEMV_SWEEP_QTYPES, GEMV_SWEEP_GRID ("bn,bk,warps,prefetch;...") and GEMV_SWEEP_SPLITS
("2048:1,4096:2": gemv_split_min_programs:gemv_min_tiles_per_split) narrow the sweep.

For each qtype: every tile config in GRID (block_n, block_k, num_warps, prefetch) is timed at
M = 1 on the MATRICES shapes (bench/qgemm.py's timing: CUDA graph over weight copies spanning
256 MiB, so every call reads from HBM); the config with the best geometric-mean bandwidth is
then swept over the split-K target. Bandwidth is reported as % of a device copy measured in the
same run. Writes DIR/gemv_sweep.json (default bench/results/h200); the winners go into the
arch's row of kernels/configs.py by hand (one config serves all qtypes: the script prints the
best overall too).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, env_info, write_json  # noqa: E402
from qgemm import time_per_call, verify, weight_copies  # noqa: E402

from luceio.kernels import configs, prepare_weight  # noqa: E402
from luceio.kernels.quant import dequantize, nbytes, random_quant_weight  # noqa: E402
from luceio.kernels.quant_triton import quant_matmul_skinny  # noqa: E402

MATRICES = [("llama-3.1-8b qkv", 6144, 4096), ("llama-3.1-8b o", 4096, 4096),
            ("llama-3.1-8b gate_up", 28672, 4096), ("llama-3.1-8b down", 4096, 14336),
            ("qwen2.5-7b qkv", 4608, 3584), ("qwen2.5-7b o", 3584, 3584),
            ("qwen2.5-7b gate_up", 37888, 3584), ("qwen2.5-7b down", 3584, 18944),
            ("9728x1024 (0.5B gate_up, K rounded up to 256s)", 9728, 1024),
            ("qwen2.5-0.5b down", 896, 4864)]
QTYPES = ["q4_k", "q6_k", "q5_0", "q8_0"]
if os.environ.get("GEMV_SWEEP_QTYPES"):
    QTYPES = os.environ["GEMV_SWEEP_QTYPES"].split(",")
GRID = [(bn, bk, nw, pf) for bn, bk, nw in
        [(8, 1024, 2), (8, 2048, 4), (16, 1024, 2), (32, 1024, 2), (8, 1024, 1), (16, 2048, 2),
         (16, 512, 1), (32, 512, 2)] for pf in (0, 1)]
SPLITS = [(256, 2), (2048, 1), (2048, 2), (4096, 1), (4096, 2), (8192, 1), (8192, 2)]
if os.environ.get("GEMV_SWEEP_GRID"):  # "bn,bk,warps,prefetch;..." (a shorter sweep)
    GRID = [tuple(int(v) for v in c.split(",")) for c in os.environ["GEMV_SWEEP_GRID"].split(";")]
if os.environ.get("GEMV_SWEEP_SPLITS") is not None:
    SPLITS = [tuple(int(p) for p in v.split(":")) for v in os.environ["GEMV_SWEEP_SPLITS"].split(",")
              if v]


def run_config(cfg, cases, repeats, copy_bps) -> list[float]:
    pct = []
    for name, w, wcopies, x, out, exact, w_bytes in cases:
        with configs.use_config(cfg):
            ok, err = verify(quant_matmul_skinny(x, w), exact)
            if not ok:
                raise AssertionError(f"{name} {w.qtype}: max error {err}")
            t = time_per_call([lambda w=wc: quant_matmul_skinny(x, w, out=out)
                               for wc in wcopies], repeats)
        pct.append(100 * (w_bytes + 2 * (x.numel() + out.numel())) / t / copy_bps)
    return pct


def _weights(qtype: str, m: int, dev):
    """Per matrix of MATRICES that `qtype` fits: (name, weight, its copies, x [m, K] bf16,
    out [m, N], weight bytes)."""
    for name, n, k in MATRICES:
        if qtype.endswith("_k") and k % 256:
            continue
        w = prepare_weight(random_quant_weight(qtype, n, k, device=dev), torch.bfloat16)
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        yield (name, w, weight_copies(w, nbytes(w)), x,
               torch.empty(m, n, device=dev, dtype=torch.bfloat16), nbytes(w))


def rows_sweep(args, dev, base, copy_bps) -> int:
    """gemv_rows_block_n at each M of --rows: % of copy per matrix and qtype, gmean per qtype."""
    ms = [int(v) for v in args.rows.split(",")]
    block_ns = [int(v) for v in args.block_ns.split(",")]
    blocks = [int(v) for v in args.row_blocks.split(",")]
    prefetches = [bool(int(v)) for v in args.rows_prefetch.split(",")]
    combos = [(bn, sp, pf) for bn in block_ns for sp in blocks for pf in prefetches]
    results = []
    for qtype in QTYPES:
        for m in ms:
            cases = list(_weights(qtype, m, dev))
            for bn, row_blocks, prefetch in combos:
                cfg = replace(base, gemv_rows_block_n=bn, gemv_row_blocks=row_blocks,
                              gemv_rows_prefetch=prefetch)
                pct, us, equal = [], [], True
                with configs.use_config(cfg):
                    for name, w, wcopies, x, out, w_bytes in cases:
                        rows = quant_matmul_skinny(x, w)
                        alone = torch.cat([quant_matmul_skinny(x[i:i + 1], w) for i in range(m)])
                        equal &= bool(torch.equal(rows, alone))
                        t = time_per_call([lambda w=wc: quant_matmul_skinny(x, w, out=out)
                                           for wc in wcopies], args.repeats)
                        pct.append(100 * (w_bytes + 2 * (x.numel() + out.numel())) / t / copy_bps)
                        us.append(t * 1e6)
                results.append(dict(qtype=qtype, M=m, rows_block_n=bn, row_blocks=row_blocks,
                                    rows_prefetch=prefetch,
                                    rows_equal_alone=equal,
                                    matrices=[c[0] for c in cases], pct_copy=pct, us=us,
                                    gmean=gmean(pct)))
                print(f"{qtype} M={m} rows_block_n={bn:2d} blocks={row_blocks} "
                      f"prefetch={int(prefetch)}: "
                      + " ".join(f"{p:5.1f}" for p in pct)
                      + f"  gmean {gmean(pct):5.1f}%  rows==alone {equal}", flush=True)
            del cases
            torch.cuda.empty_cache()
    for m in ms:
        best = max(combos, key=lambda c: gmean([
            r["gmean"] for r in results
            if r["M"] == m and (r["rows_block_n"], r["row_blocks"], r["rows_prefetch"]) == c]))
        print(f"M={m}: best (rows_block_n, row_blocks, rows_prefetch) over all qtypes {best}")
    write_json(os.path.join(args.out, args.json_name),
               dict(env=env_info(), copy_GBps=copy_bps / 1e9, config=configs.config_to_dict(base),
                    results=results))
    return 0 if all(r["rows_equal_alone"] for r in results) else 1


def gmean(v: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in v) / len(v))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", default=None, help="sweep gemv_rows_block_n at these M instead")
    ap.add_argument("--block-ns", default="1,2,4,8", help="gemv_rows_block_n values (--rows)")
    ap.add_argument("--row-blocks", default="1", help="gemv_row_blocks values (--rows)")
    ap.add_argument("--rows-prefetch", default="1", help="gemv_rows_prefetch values (--rows)")
    ap.add_argument("--json-name", default="gemv_rows_sweep.json", help="--rows' result file")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(dev)
    base = configs.get_config(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy {copy_bps / 1e9:.0f} GB/s", flush=True)
    if args.rows:
        return rows_sweep(args, dev, base, copy_bps)
    results = {}
    for qtype in QTYPES:
        cases = [(name, w, copies, x, out, x.float() @ dequantize(w).T, w_bytes)
                 for name, w, copies, x, out, w_bytes in _weights(qtype, 1, dev)]
        rows = []
        for bn, bk, nw, pf in GRID:
            cfg = replace(base, gemv_block_n=bn, gemv_block_k=bk, gemv_num_warps=nw,
                          gemv_prefetch=bool(pf))
            pct = run_config(cfg, cases, args.repeats, copy_bps)
            rows.append(dict(block_n=bn, block_k=bk, num_warps=nw, prefetch=pf,
                             split_min_programs=base.gemv_split_min_programs,
                             min_tiles_per_split=base.gemv_min_tiles_per_split,
                             pct_copy=pct, gmean=gmean(pct)))
            print(f"{qtype} bn={bn:3d} bk={bk} w={nw} pf={pf}: "
                  + " ".join(f"{p:5.1f}" for p in pct) + f"  gmean {gmean(pct):5.1f}%",
                  flush=True)
        best = max(rows, key=lambda r: r["gmean"])
        for sp, mt in SPLITS:
            cfg = replace(base, gemv_block_n=best["block_n"], gemv_block_k=best["block_k"],
                          gemv_num_warps=best["num_warps"], gemv_prefetch=bool(best["prefetch"]),
                          gemv_split_min_programs=sp, gemv_min_tiles_per_split=mt)
            pct = run_config(cfg, cases, args.repeats, copy_bps)
            rows.append(dict(best, split_min_programs=sp, min_tiles_per_split=mt, pct_copy=pct,
                             gmean=gmean(pct)))
            print(f"{qtype} best tile, split target {sp} (>= {mt} tiles): "
                  + " ".join(f"{p:5.1f}" for p in pct) + f"  gmean {gmean(pct):5.1f}%",
                  flush=True)
        results[qtype] = dict(matrices=[c[0] for c in cases], rows=rows)
        del cases
        torch.cuda.empty_cache()
    # one config for all qtypes: best geometric mean over every qtype's tile rows
    keys = [(r["block_n"], r["block_k"], r["num_warps"], r["prefetch"]) for r in
            results[QTYPES[0]]["rows"][:len(GRID)]]
    overall = {key: gmean([results[q]["rows"][i]["gmean"] for q in QTYPES])
               for i, key in enumerate(keys)}
    best_key = max(overall, key=overall.get)
    print(f"best tile over all qtypes (block_n, block_k, warps, prefetch): {best_key}, "
          f"gmean {overall[best_key]:.1f}% of copy")
    write_json(os.path.join(args.out, "gemv_sweep.json"),
               dict(env=env_info(), copy_GBps=copy_bps / 1e9, config=configs.config_to_dict(base),
                    results=results, overall={str(k): v for k, v in overall.items()},
                    best_overall=best_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
