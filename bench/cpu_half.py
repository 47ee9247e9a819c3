"""CPU decode and prefill of 16-bit (BF16 / F16) GGUF files, in one run: luceio's fp32 model
keeping the 16-bit weights (kernels/half_cpu.py, `auto:float32`), the same file widened to
fp32 at load (`none:float32`: what an fp32 model did before), luceio's bf16 model (the module
forward in bf16, `auto:bfloat16`), and llama.cpp's `llama-bench` on the same files and thread
count. The files are made from the cached Q4 GGUFs by llama.cpp's `llama-quantize` (the
quantized values in 16 bits: real shapes and vocabularies). Writes
bench/results/cpu/cpu_half.json.

    python bench/cpu_half.py --llama-bench BUILD/bin/llama-bench [--models ...] [--types BF16,F16]

`--rows` also times one projection (the 0.5B's gate/up) at M = 1 ... 512 rows on the decode
and the prefill kernel (`half_cpu.matvec`, bf16) and as torch's fp32 matmul on a resident fp32
copy.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from cpu_quant import llama_cpp, luceio  # noqa: E402

CONFIGS = ("auto:float32", "none:float32", "auto:bfloat16")


def make_file(model: str, qtype: str, quantize: str, folder: str) -> str:
    from luceio.loader.resolve import resolve_model
    path = os.path.join(folder, f"{model}-{qtype}.gguf")
    if not os.path.exists(path):
        subprocess.run([quantize, "--allow-requantize", resolve_model(model), path, qtype],
                       check=True, capture_output=True, timeout=1800)
    return path


def rows_sweep(threads: int, reps: int = 5) -> dict:
    """One projection at M rows: the decode kernel and the prefill kernel on the bf16 weight
    against torch's fp32 matmul on a resident fp32 copy (what an fp32 model ran), alternating,
    medians in ms."""
    import numpy as np
    import torch

    from luceio.kernels import half_cpu
    torch.set_num_threads(threads)
    w = half_cpu.prepare(torch.randn(9728, 896).to(torch.bfloat16))
    wf = w.tensor.float()
    out = {}
    for m in (1, 4, 16, 64, 128, 512):
        x = torch.randn(m, 896)
        y = np.zeros((m, 9728), np.float32)
        times = {"decode_kernel": [], "prefill_kernel": [], "fp32_matmul": []}
        for _ in range(reps):
            for prefill in (False, True):
                t = time.perf_counter()
                half_cpu.matvec(x.numpy(), w, y, prefill)
                times["prefill_kernel" if prefill else "decode_kernel"].append(
                    time.perf_counter() - t)
            t = time.perf_counter()
            torch.nn.functional.linear(x, wf)
            times["fp32_matmul"].append(time.perf_counter() - t)
        out[m] = {k: round(sorted(v)[len(v) // 2] * 1e3, 3) for k, v in times.items()}
        print("rows", m, out[m], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--types", default="BF16,F16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--llama-quantize", default=None,
                    help="default: llama-quantize beside llama-bench")
    ap.add_argument("--folder", default="/tmp/luceio_half_gguf")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "cpu_half.json"))
    a = ap.parse_args()
    quantize = a.llama_quantize or os.path.join(os.path.dirname(a.llama_bench), "llama-quantize")
    os.makedirs(a.folder, exist_ok=True)
    results = {"env": env_info(), "cores": os.cpu_count(), "threads": a.threads,
               "new_tokens": a.new, "load_avg_1min": {"start": round(os.getloadavg()[0], 2)},
               "files": {}}
    if a.rows:
        results["rows_ms"] = rows_sweep(a.threads)
    for model in a.models.split(","):
        for qtype in a.types.split(","):
            path = make_file(model, qtype, quantize, a.folder)
            rows = results["files"].setdefault(f"{model} {qtype}", {})
            rows["llama.cpp"] = ref = llama_cpp(a.llama_bench, path, a.threads, a.new)
            print(model, qtype, "llama.cpp", ref, flush=True)
            for c in a.configs.split(","):
                quant, dtype = c.split(":")
                rows[f"luceio {c}"] = r = luceio({"model": path, "quantization": quant,
                                                  "dtype": dtype, "threads": a.threads,
                                                  "new": a.new})
                if "decode_tok_s" in r and "decode_tok_s" in ref:
                    r["decode_vs_llama_cpp"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 2)
                    r["prefill_vs_llama_cpp"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"],
                                                      2)
                print(model, qtype, c, r, flush=True)
            results["load_avg_1min"]["end"] = round(os.getloadavg()[0], 2)
            write_json(a.out, results)
    print("\n| file | engine | decode tok/s | vs llama.cpp | prefill 512 tok/s | vs llama.cpp | "
          "weights MiB | RSS after load MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results["files"].items():
        for engine, r in rows.items():
            print(f"| {name} | {engine} | {r.get('decode_tok_s', '-')} | "
                  f"{r.get('decode_vs_llama_cpp', '')} | {r.get('prefill_tok_s', '-')} | "
                  f"{r.get('prefill_vs_llama_cpp', '')} | {r.get('weight_MiB', '')} | "
                  f"{r.get('rss_after_load_MiB', '')} |")


if __name__ == "__main__":
    main()
