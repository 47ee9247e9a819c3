"""The Gated DeltaNet's prefill on the GPU: the chunked Triton kernels
(`kernels/delta_rule_prefill_triton.py`) against the torch reference they replaced there
(`delta_rule.gated_delta_rule_chunked`, chunks of 64 per sequence) and, when it imports, the
`fla-core` package's `chunk_gated_delta_rule` (flash-linear-attention's Triton kernels, the
engines' usual choice), one layer's delta rule at Qwen3.5's shape (16 key / 32 value heads of
128), random bf16 inputs, fp32 state.

    python bench/gdn_prefill.py [--tokens 512,4096] [--seqs 1,8]
                                [--configs '32,32,ieee,4,4,2;64,64,tf32,8,4,2']
                                [--out bench/results/h200/gdn_prefill.json]

Each row: `--seqs` sequences of tokens / seqs tokens in one varlen batch, the median of 20
timed calls (after 3 warm-up calls) of each, and the largest output / state difference from the
reference, on these inputs and (corr_*) on keys sharing one direction (`--corr`), where the
chunk's triangular system is hardest. `--configs`: launch configs to time, each gdn_block_t, gdn_block_v,
gdn_dot_precision, gdn_num_warps, gdn_chunk_num_warps, gdn_num_stages[, gdn_inverse_blocks
0/1] (default: the arch's
table entry only, whose wide tile replaces gdn_block_t / gdn_block_v in launches of enough
programs: the row records the narrow tile; listed configs run their own tile, the wide one off);
a config that does not compile or launch is recorded with its error.
fla gets q and k repeated to the 32 value heads before timing (its grouped-head support varies
by version) and l2-normalises them in its kernel, as luceio's does.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_median_ms, env_info, write_json  # noqa: E402

from luceio.kernels import configs  # noqa: E402
from luceio.kernels.delta_rule import gated_delta_rule_chunked  # noqa: E402
from luceio.kernels.delta_rule_prefill_triton import gdn_prefill  # noqa: E402

FIELDS = ("gdn_block_t", "gdn_block_v", "gdn_dot_precision", "gdn_num_warps",
          "gdn_chunk_num_warps", "gdn_num_stages", "gdn_inverse_blocks")


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    return cuda_median_ms(fn, reps)


def parse_configs(text: str | None) -> list[dict]:
    if not text:
        base = configs.get_config(torch.device("cuda"))
        return [{f: getattr(base, f) for f in FIELDS}]
    out = []
    for spec in text.split(";"):
        vals = spec.split(",")
        out.append({f: (v if f == "gdn_dot_precision" else bool(int(v)) if f == "gdn_inverse_blocks"
                        else int(v)) for f, v in zip(FIELDS, vals)})
    return out


def fla_fn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or it does not import on this torch/triton
        print(f"fla: {type(e).__name__}: {e}", flush=True)
        return None
    return chunk_gated_delta_rule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--configs", default=None)
    ap.add_argument("--corr", type=float, default=2.0, help="the accuracy rows' keys: randn + "
                    "this times one random direction a head (mean cosine ~0.8 at 2)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "gdn_prefill.json"))
    a = ap.parse_args()
    cfgs = parse_configs(a.configs)
    if a.configs:  # each row runs the tile it names (the table's wide tile stays off)
        for c in cfgs:
            c.setdefault("gdn_wide_min_programs", 0)
    fla = fla_fn()
    res = {"env": env_info(), "shape": "16 k heads, 32 v heads, 128 x 128", "configs": cfgs,
           "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    base = configs.get_config(torch.device("cuda"))
    for tokens in map(int, a.tokens.split(",")):
        for seqs in map(int, a.seqs.split(",")):
            n = tokens - tokens % seqs
            q, k = (torch.randn(n, 16, 128, device="cuda", generator=g).bfloat16()
                    for _ in "qk")
            shared = torch.randn(16, 128, device="cuda", generator=g) * a.corr
            k_corr = (k.float() + shared).bfloat16()  # keys sharing one direction a head
            v = torch.randn(n, 32, 128, device="cuda", generator=g).bfloat16()
            gate = -torch.rand(n, 32, device="cuda", generator=g) * 0.3
            beta = torch.rand(n, 32, device="cuda", generator=g).bfloat16()
            cu = torch.arange(0, n + 1, n // seqs, device="cuda", dtype=torch.int32)
            slots = torch.arange(seqs, device="cuda")
            state = torch.randn(seqs, 32, 128, 128, device="cuda", generator=g) * 0.1
            ref_state = state.clone()
            ref = gated_delta_rule_chunked(q, k, v, gate, beta, ref_state, cu, slots)
            corr_state = state.clone()
            corr_ref = gated_delta_rule_chunked(q, k_corr, v, gate, beta, corr_state, cu, slots)
            row = {"tokens": n, "seqs": seqs, "torch_ms": round(median_ms(
                lambda: gated_delta_rule_chunked(q, k, v, gate, beta, state.clone(), cu,
                                                 slots)), 3), "configs": []}
            for c in cfgs:
                try:
                    with configs.use_config(dataclasses.replace(base, **c)):
                        tri_state = state.clone()
                        tri = gdn_prefill(q, k, v, gate, beta, tri_state, cu, slots)
                        corr_tri_state = state.clone()
                        corr_tri = gdn_prefill(q, k_corr, v, gate, beta, corr_tri_state, cu,
                                               slots)
                        ms = median_ms(lambda: gdn_prefill(q, k, v, gate, beta, state.clone(),
                                                           cu, slots))
                except Exception as e:  # out of shared memory, registers, ...
                    row["configs"].append({**c, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                row["configs"].append({
                    **c, "ms": round(ms, 3), "speedup": round(row["torch_ms"] / ms, 2),
                    "max_out_diff": (ref.float() - tri.float()).abs().max().item(),
                    "max_state_diff": (ref_state - tri_state).abs().max().item(),
                    "corr_max_out_diff": (corr_ref.float() - corr_tri.float()).abs().max().item(),
                    "corr_max_state_diff": (corr_state - corr_tri_state).abs().max().item()})
            if fla is not None:
                qf, kf = (x.repeat_interleave(2, dim=1)[None] for x in (q, k))
                args = (qf, kf, v[None], gate[None], beta[None])
                kw = dict(scale=128 ** -0.5, initial_state=state.clone(),
                          output_final_state=True, cu_seqlens=cu.long(),
                          use_qk_l2norm_in_kernel=True)
                try:
                    fo, fs = fla(*args, **kw)
                    row["fla_ms"] = round(median_ms(lambda: fla(*args, **{
                        **kw, "initial_state": state.clone()})), 3)  # the clone, as luceio's
                    row["fla_max_out_diff"] = (ref.float() - fo[0].float()).abs().max().item()
                    row["fla_max_state_diff"] = (ref_state - fs.float()).abs().max().item()
                    fo, fs = fla(qf, k_corr.repeat_interleave(2, dim=1)[None], *args[2:], **kw)
                    row["fla_corr_max_out_diff"] = (corr_ref.float() - fo[0].float()).abs().max().item()
                    row["fla_corr_max_state_diff"] = (corr_state - fs.float()).abs().max().item()
                except Exception as e:
                    row["fla_error"] = f"{type(e).__name__}: {e}"[:300]
            best = min((r for r in row["configs"] if "ms" in r), key=lambda r: r["ms"],
                       default=None)
            print({k: v for k, v in row.items() if k != "configs"}, "best:", best, flush=True)
            res["rows"].append(row)
            write_json(a.out, res)


if __name__ == "__main__":
    main()
