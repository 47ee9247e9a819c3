"""Long prompts on the GPU (random weights at Qwen2.5-Coder-1.5B target / 0.5B draft shapes,
bf16, one run): time to first token, plain vs speculative prefill (draft scoring included), and
decode tokens/s at long context with the full KV vs a bounded residency budget.

    python bench/long_context.py [--out DIR] [--lengths 8192,16384,32768] [--budget 2048]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, random_model, write_json  # noqa: E402

from luceio import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from luceio.spec import build_spec_prefill  # noqa: E402

MAX_POS = int(os.environ.get("LONG_CONTEXT_MAX_LEN", 40960))
KV_BYTES = int(float(os.environ.get("LONG_CONTEXT_KV_GIB", 8)) * 2**30)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script only


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine(target, draft=None, max_len=MAX_POS, kv_bytes=KV_BYTES, **kw) -> LLMEngine:
    args = EngineArgs(model="random", dtype="bfloat16", device=DEVICE, max_model_len=max_len,
                      kv_cache_memory=kv_bytes, max_num_seqs=8, max_num_batched_tokens=8192,
                      enable_prefix_caching=False, **kw)
    eng = LLMEngine(args, model=target)
    if draft is not None:
        eng.spec_prefill = build_spec_prefill(args, eng.runner, draft, MAX_POS)
    return eng


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def ttft(eng: LLMEngine, ids: list[int], keep: float | None) -> float:
    """Seconds from the request's arrival to its first token, draft scoring included."""
    sync()
    t = time.perf_counter()
    eng.add_request("t", {"prompt_token_ids": ids},
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                   spec_prefill_keep=keep))
    while eng.has_unfinished_requests():
        eng.step()
    sync()
    return time.perf_counter() - t


def decode_tps(eng: LLMEngine, ids: list[int], new: int) -> tuple[float, int]:
    """Decode tokens/s after the prompt, and the device blocks the request held at the end."""
    eng.add_request("d", {"prompt_token_ids": ids},
                    SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    req = eng.scheduler.requests["d"]
    while req.num_output_tokens == 0:
        eng.step()
    sync()
    t, n0 = time.perf_counter(), req.num_output_tokens
    used = 0
    while eng.has_unfinished_requests():
        used = max(used, eng.kv.pool.num_used_blocks)
        eng.step()
    sync()
    return (new - n0) / (time.perf_counter() - t), used


def small_pool(target, vocab: int, budget: int, n_req: int = 8, ctx: int = 16384,
               new: int = 128) -> dict:
    """A KV pool of 1 GiB (two full 16K-token sequences of the 1.5B shape), eight 16K-token
    requests at once: full KV runs them two at a time; a resident budget runs all eight."""
    out = {"requests": n_req, "prompt_tokens": ctx, "new_tokens": new, "kv_pool_gib": 1.0}
    for name, kw in (("full_kv", {}), (f"resident_{budget}", dict(kv_resident_tokens=budget))):
        eng = engine(target, max_len=ctx + 2 * new, kv_bytes=1 << 30, **kw)
        ttft(eng, prompt(2 * budget, vocab, 499), None)  # warm-up: kernels and graphs
        for i in range(n_req):
            eng.add_request(f"p{i}", {"prompt_token_ids": prompt(ctx, vocab, 500 + i)},
                            SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        sync()
        t, peak = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            peak = max(peak, len(eng.scheduler.running))
            eng.step()
        sync()
        wall = time.perf_counter() - t
        out[name] = {"wall_s": round(wall, 2), "output_tok_s": round(n_req * new / wall, 1),
                     "peak_running": peak, "kv_blocks": eng.kv.pool.num_blocks}
        print(name, out[name], flush=True)
        del eng
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one draft scoring pass")
    ap.add_argument("--sections", default="ttft,decode,pool")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    target = random_model("qwen2.5-coder-1.5b", device=DEVICE, max_positions=MAX_POS)
    draft = random_model("qwen2.5-coder-0.5b", device=DEVICE, max_positions=MAX_POS)
    vocab = target.cfg.vocab_size
    res: dict = {"env": env_info(), "ttft": [], "decode": [], "budget_tokens": a.budget}

    warm = min(4096, lengths[0])
    if "pool" in a.sections:
        res["small_pool"] = small_pool(target, vocab, a.budget)
    out_path = os.path.join(a.out, "long_context.json")
    if "ttft" not in a.sections:
        write_json(out_path, res)
        return
    eng = engine(target, draft)
    for keep in (None, 0.1, 0.25):  # warm-up: every kernel specialisation and graph
        ttft(eng, prompt(warm, vocab, 99), keep)
    for n in lengths:
        ids = prompt(n, vocab, n)
        row = {"prompt_tokens": n}
        for name, keep in (("plain", None), ("keep_0.25", 0.25), ("keep_0.1", 0.1)):
            row[name + "_s"] = round(min(ttft(eng, ids, keep) for _ in range(a.repeats)), 4)
        for name in ("keep_0.25", "keep_0.1"):
            row[name + "_speedup"] = round(row["plain_s"] / row[name + "_s"], 2)
        # the draft's scoring pass alone
        t = time.perf_counter()
        eng.spec_prefill.scores(ids)
        sync()
        row["draft_scoring_s"] = round(time.perf_counter() - t, 4)
        res["ttft"].append(row)
        print(row, flush=True)
    if a.profile and DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile
        ids = prompt(lengths[0], vocab, 7)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.spec_prefill.scores(ids)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
    del eng

    full = engine(target)
    bounded = engine(target, kv_resident_tokens=a.budget, kv_resident_policy="keys",
                     kv_rescore_interval=16)
    recency = engine(target, kv_resident_tokens=a.budget, kv_resident_policy="recency")
    for e in (full, bounded, recency):
        decode_tps(e, prompt(warm, vocab, 98), 32)  # warm-up
    base_tps, _ = decode_tps(full, prompt(a.budget, vocab, 1), a.new)
    res["decode_at_budget_tps"] = round(base_tps, 1)
    for n in lengths:
        ids = prompt(n, vocab, n + 1)
        f_tps, f_blocks = decode_tps(full, ids, a.new)
        b_tps, b_blocks = decode_tps(bounded, ids, a.new)
        r_tps, _ = decode_tps(recency, ids, a.new)
        row = {"context": n, "full_kv_tps": round(f_tps, 1), "full_kv_blocks": f_blocks,
               "resident_tps": round(b_tps, 1), "resident_blocks": b_blocks,
               "resident_recency_tps": round(r_tps, 1),
               "resident_vs_decode_at_budget": round(b_tps / base_tps, 3),
               "resident_vs_full": round(b_tps / f_tps, 3)}
        res["decode"].append(row)
        print(row, flush=True)
    res["rescore_interval"] = 16
    write_json(out_path, res)


if __name__ == "__main__":
    main()
