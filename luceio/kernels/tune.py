"""Times launch configs of the paged-attention and skinny-GEMM kernels on this GPU and saves
the winner.

    python -m luceio.kernels.tune [--dtype bf16|fp16] [--quick] [--dry-run]
                                  [--only attention|qgemm]

Decode (split-KV) and varlen prefill are tuned separately at a few representative shapes
(Llama-8B-like 32/8 heads and Qwen-7B-like 28/4 heads, head_dim 128, pages of 16); the skinny
quantized GEMM (q4_k) at Llama-8B's o_proj and gate_up and Qwen-0.5B's down_proj, M = 1, 4, 16,
its launches cycling through weight copies that span 256 MiB so they read HBM, not L2. A
candidate's score is the geometric mean over the shapes of its time relative to the current
entry; a candidate whose output differs from the current entry's is rejected. The winning
entry goes to `$LUCEIO_CACHE/kernel_configs/<arch>.json` (see configs.py), where it overrides
the built-in table. A full run takes about 5 minutes on an H200 (`--quick`: about 1).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
import time
from dataclasses import replace

import torch

from . import configs


def _batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16):
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages)
    bt = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[used:used + n]
        used += n
    dev = "cuda"
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=dev, dtype=dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=dev)
    return (q, kc, vc, bt.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev), qsl,
            max(q_lens), max(seq_lens), head_dim ** -0.5)


def decode_shapes(quick: bool):
    shapes = [(1, 32768), (8, 8192), (64, 2048), (256, 1024)]
    heads = [(32, 8), (28, 4)]
    if quick:
        shapes, heads = shapes[:3], heads[:1]
    return [([1] * b, [c - 1] * b, h, kv) for (b, c), (h, kv) in itertools.product(shapes, heads)]


def prefill_shapes(quick: bool):
    shapes = [([2048], [0]),                        # one fresh prompt
              ([512] * 4, [4096] * 4),              # chunked prefill on long prefixes
              ([5] * 32, [2048] * 32),              # speculative verification, 4 drafts
              ([300, 1, 1, 1, 700], [0, 900, 3000, 60, 1200])]  # a mixed step
    heads = [(32, 8), (28, 4)]
    if quick:
        shapes, heads = shapes[:3], heads[:1]
    return [(q, c, h, kv) for (q, c), (h, kv) in itertools.product(shapes, heads)]


def _stage_choices(quick: bool):
    if quick:
        return [2]
    return [1, 2] if torch.version.hip is not None else [2, 3]


def decode_candidates(base: configs.KernelConfig, quick: bool):
    block_ns, warps = ([32, 64, 128], [2, 4, 8]) if not quick else ([32, 64], [4])
    kernel = [replace(base, decode_block_n=n, decode_num_warps=w, decode_num_stages=s)
              for n, w, s in itertools.product(block_ns, warps, _stage_choices(quick))]

    def split(c):
        return [replace(c, decode_min_tokens_per_split=t, decode_waves=v)
                for t, v in itertools.product([128, 256, 512, 1024] if not quick else [256, 512],
                                              [1.0, 2.0, 4.0])]
    return kernel, split


def prefill_candidates(base: configs.KernelConfig, quick: bool):
    ms, ns, warps = ([64, 128], [32, 64, 128], [4, 8]) if not quick else ([64, 128], [64], [4, 8])
    return [replace(base, prefill_block_m=m, prefill_block_n=n, prefill_num_warps=w,
                    prefill_num_stages=s)
            for m, n, w, s in itertools.product(ms, ns, warps, _stage_choices(quick))]


def _time(cfg, batches, refs):
    """Per-shape median ms, or None if the config fails to build or gives a different result."""
    from .attention_triton import paged_attention
    times = []
    with configs.use_config(cfg):
        for args, ref in zip(batches, refs):
            try:
                out = paged_attention(*args)
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory / registers for this tile size
                print(f"    skip ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                return None
            if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print("    skip (wrong result)")
                return None
            times.append(_bench(lambda: paged_attention(*args)))
    return times


def _bench(fn) -> float:
    """Median ms of fn replayed in a CUDA graph (no Python launch overhead, as when serving)."""
    import triton.testing
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")
    except Exception:  # graphs unavailable on this stack: time eager launches instead
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _report(name, cfg, shapes, batches):
    """Time and KV-read bandwidth of `cfg` per shape."""
    from .attention_triton import paged_attention
    print(f"{name}, chosen entry:")
    with configs.use_config(cfg):
        for (q_lens, ctx, h, kv), args in zip(shapes, batches):
            ms = _bench(lambda: paged_attention(*args))
            kv_bytes = (sum(ctx) + sum(q_lens)) * kv * 128 * 2 * args[1].element_size()
            print(f"  {len(q_lens):4d} seqs, {sum(q_lens):5d} query tokens, ctx {max(ctx) + 1:6d}, "
                  f"heads {h}/{kv}: {ms * 1e3:8.1f} us, KV read {kv_bytes / ms / 1e9:6.2f} TB/s")


_T0 = time.monotonic()


def qgemm_cases(quick: bool, dtype):
    """(x, weight copies, fp32 reference) per case; see the module docstring."""
    from .quant import dequantize, nbytes
    from .quant import random_quant_weight
    shapes = [(4096, 4096), (28672, 4096), (896, 4864), (4096, 14336)]
    cases = []
    for n, k in shapes[::3] if quick else shapes:
        w = random_quant_weight("q4_k", n, k, device="cuda")
        copies = [w] + [replace(w, **{a: t.clone() for a, t in w.tensors().items()})
                        for _ in range(min(256, (256 << 20) // nbytes(w)))]
        ref_w = dequantize(w)
        for m in (1, 16) if quick else (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            cases.append((x, copies, x.float() @ ref_w.T))
    return cases


def _time_qgemm(cfg, cases, refs=None):
    """Per-case median ms of the skinny kernel, or None (as `_time`)."""
    from .quant_triton import quant_matmul_skinny
    times = []
    with configs.use_config(cfg):
        for x, copies, ref in cases:
            try:
                out = quant_matmul_skinny(x, copies[0])
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory / registers for this tile size
                print(f"    skip ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                return None
            if not torch.allclose(out.float(), ref, atol=2e-2, rtol=1e-2):
                print("    skip (wrong result)")
                return None
            cycle = itertools.cycle(copies)  # each captured launch reads the next copy
            times.append(_bench(lambda: quant_matmul_skinny(x, next(cycle))))
    return times


def qgemm_candidates(base: configs.KernelConfig, quick: bool):
    """Tiles (gemv for M = 1, dot for more rows, pipelining depth), then split-K settings."""
    # gemv: (block_n, block_k, num_warps, prefetch); bench/gemv_sweep.py sweeps more of them
    gemv = [(8, 1024, 1, True), (8, 1024, 2, False), (16, 512, 2, True), (64, 256, 4, False)] \
        if not quick else [(8, 1024, 1, True), (64, 256, 4, False)]
    dot = [(32, 256), (64, 256), (64, 128)] if not quick else [(32, 256), (64, 256)]
    tiles = [replace(base, gemv_block_n=gn, gemv_block_k=gk, gemv_num_warps=gw, gemv_prefetch=gp,
                     qgemm_block_n=n, qgemm_block_k=k, qgemm_num_stages=s)
             for (gn, gk, gw, gp), (n, k), s in itertools.product(gemv, dot, _stage_choices(quick))]

    def splits(c, sms):
        return [replace(c, qgemm_split_k_min_programs=p, qgemm_min_tiles_per_split=t)
                for p, t in itertools.product([0, sms, 2 * sms, 4 * sms], [1, 2, 4])] + \
            [replace(c, gemv_split_min_programs=p, gemv_min_tiles_per_split=t)
             for p, t in itertools.product([2 * sms, 16 * sms, 32 * sms], [1, 2])]
    return tiles, splits


def tune_qgemm(best, quick: bool, dtype, sms: int):
    """The qgemm_* and gemv_* fields of `best`: tiles first, then split-K."""
    from .quant import nbytes
    cases = qgemm_cases(quick, dtype)
    base_times = _time_qgemm(best, cases)
    if base_times is None:
        print("the current qgemm entry does not run here; tuning from the defaults")
        best = replace(best, **{k: v for k, v in configs.config_to_dict(
            configs.TABLE["default"]).items() if k.startswith(("qgemm", "gemv"))})
        base_times = _time_qgemm(best, cases)
    tiles, splits = qgemm_candidates(best, quick)
    cand, score = _search("qgemm", tiles, cases, None, base_times, _time_qgemm)
    if cand is not None and score < 1.0:
        best = cand
    cand, score2 = _search("qgemm", splits(best, sms), cases, None, base_times, _time_qgemm)
    if cand is not None and score2 < min(score, 1.0):
        best = cand
    print("qgemm, chosen entry:")
    for (x, copies, _), ms in zip(cases, _time_qgemm(best, cases)):
        moved = nbytes(copies[0]) + x.numel() * x.element_size()
        print(f"  q4_k [{copies[0].shape[0]}, {x.shape[1]}] M={x.shape[0]:2d}: "
              f"{ms * 1e3:8.1f} us, {moved / ms / 1e6:6.0f} GB/s")
    return best


def _search(name, candidates, batches, refs, base_times, time_fn=_time):
    best, best_score = None, math.inf
    for cfg in candidates:
        times = time_fn(cfg, batches, refs)
        if times is None:
            continue
        score = math.exp(sum(math.log(t / b) for t, b in zip(times, base_times)) / len(times))
        if score < best_score:
            best, best_score = cfg, score
        print(f"  [{time.monotonic() - _T0:5.0f}s] {name} {_describe(cfg, name)}: {score:.3f}  "
              f"({', '.join(f'{t * 1e3:.0f}us' for t in times)})")
    return best, best_score


def _describe(cfg, name):
    keys = [k for k in configs.config_to_dict(cfg) if k.startswith(name)]
    return " ".join(f"{k[len(name) + 1:]}={getattr(cfg, k)}" for k in keys)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m luceio.kernels.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and candidates")
    ap.add_argument("--dry-run", action="store_true", help="print the entry, write nothing")
    ap.add_argument("--only", choices=["attention", "qgemm"], help="tune only these kernels")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("luceio.kernels.tune: no GPU (torch.cuda.is_available() is False); tuning times "
              "the Triton kernels on a CUDA or ROCm device, nothing to do here.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("luceio.kernels.tune: triton is not installed.", file=sys.stderr)
        return 2

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = torch.device("cuda")
    arch = configs.device_arch(dev)
    base = configs.load_config(arch)
    print(f"tuning on {torch.cuda.get_device_name(dev)} ({arch}, {configs.num_sms(dev)} SMs), "
          f"starting from: {base}")
    torch.manual_seed(0)
    best = base
    from .attention import paged_attention_ref
    sections = [] if args.only == "qgemm" else [("decode", decode_shapes(args.quick)),
                                                ("prefill", prefill_shapes(args.quick))]
    for name, shapes in sections:
        batches = [_batch(q, c, h, kv, 128, dtype) for q, c, h, kv in shapes]
        refs = [paged_attention_ref(*b) for b in batches]
        base_times = _time(best, batches, refs)
        if base_times is None:
            print(f"the current {name} entry does not run here; tuning from the defaults")
            best = replace(best, **{k: v for k, v in configs.config_to_dict(
                configs.TABLE["default"]).items() if k.startswith(name)})
            base_times = _time(best, batches, refs)
        if name == "decode":
            kernel, split = decode_candidates(best, args.quick)
            cand, score = _search(name, kernel, batches, refs, base_times)
            if cand is not None and score < 1.0:
                best = cand
            cand, score2 = _search(name, split(best), batches, refs, base_times)
            if cand is not None and score2 < min(score, 1.0):
                best = cand
        else:
            cand, score = _search(name, prefill_candidates(best, args.quick), batches, refs,
                                  base_times)
            if cand is not None and score < 1.0:
                best = cand
        _report(name, best, shapes, batches)
        del batches, refs
        torch.cuda.empty_cache()

    if args.only != "attention":
        best = tune_qgemm(best, args.quick, dtype, configs.num_sms(dev))

    import triton
    best = replace(best, source=(
        f"measured by luceio.kernels.tune on {torch.cuda.get_device_name(dev)} ({arch}), "
        f"{args.dtype}, triton {triton.__version__}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}{' (quick)' if args.quick else ''}"))
    entry = configs.config_to_dict(best, arch)
    text = json.dumps(entry, indent=2) + "\n"
    if args.dry_run:
        print(text)
        return 0
    path = configs.user_config_path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}:\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
