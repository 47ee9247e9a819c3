"""GPU benchmark (one run, random weights at real shapes, bf16): decode at batch 1 vs the
copy-bandwidth roofline and vs HF transformers, concurrency through AsyncEngine, attention
kernel bandwidth, and the cost of speculative verification. Writes bench/results/<card>/.

    python bench/gpu_bench.py [--out DIR] [--quick] [--sections decode,hf,concurrency,kernels,spec]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (SHAPES, copy_bandwidth, env_info, kv_bytes_per_token, random_model,  # noqa: E402
                    run_sections, weight_bytes_per_token)

from luceio import AsyncEngine, EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from luceio.sampling_params import RequestOutputKind  # noqa: E402
from luceio.spec.proposer import Proposal, Proposer  # noqa: E402

RESULTS: dict = {}


def make_engine(model, max_len: int, kv_gib: float = 16, max_num_seqs: int = 64,
                tokenizer=None, **kw) -> LLMEngine:
    args = EngineArgs(model="random", dtype="bfloat16", device="cuda", max_model_len=max_len,
                      kv_cache_memory=int(kv_gib * 2**30), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=8192, **kw)
    return LLMEngine(args, model=model, tokenizer=tokenizer)


def luceio_decode_tps(engine: LLMEngine, ctx: int, new: int = 128, batch: int = 1) -> float:
    vocab = engine.runner.cfg.vocab_size
    for i in range(batch):
        engine.add_request(None, torch.randint(0, vocab, (ctx,)).tolist(),
                           SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill (chunked) until every request has its first token
    torch.cuda.synchronize()
    t, n0 = time.perf_counter(), engine.counters["generation_tokens"]
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return (engine.counters["generation_tokens"] - n0) / (time.perf_counter() - t)


def hf_model_from(shape: str):
    import transformers
    fields = dict(SHAPES[shape])
    fields.pop("architectures")
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def hf_decode_tps(hf, ctx: int, new: int = 64, **gen_kw) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (1, ctx), device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **gen_kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    run(new + 1)  # warm-up (and compilation, where the config compiles)
    return new / (run(new + 1) - run(1))


def section_decode(bw: float, quick: bool, with_hf: bool, contexts=(512, 8192)) -> None:
    out = RESULTS.setdefault("decode_batch1", [])
    shapes = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "llama-3.1-8b"]
    for shape in shapes:
        hf = hf_model_from(shape) if with_hf else None
        for ctx in contexts:
            model = random_model(shape, max_positions=ctx + 512)
            if hf is not None:
                model.load_weights(hf.state_dict().items(), torch.bfloat16, torch.device("cuda"))
            eng = make_engine(model, ctx + 256, kv_gib=4, max_num_seqs=8)
            tps = luceio_decode_tps(eng, ctx)
            bytes_tok = weight_bytes_per_token(model) + kv_bytes_per_token(model, ctx + 64)
            row = {"shape": shape, "context": ctx, "luceio_tok_s": round(tps, 1),
                   "roofline_tok_s": round(bw / bytes_tok, 1),
                   "fraction_of_roofline": round(tps * bytes_tok / bw, 3)}
            del eng
            from torch_floor import floor_decode_tps
            try:  # the same weights, plain torch ops, the whole step one CUDA graph
                row["torch_graph_floor_tok_s"] = round(floor_decode_tps(model, ctx), 1)
                row["speedup_vs_torch_floor"] = round(tps / row["torch_graph_floor_tok_s"], 2)
            except Exception as e:  # report, keep measuring
                row["torch_graph_floor_error"] = repr(e)[:200]
            if hf is not None:
                configs = [("hf_eager_dynamic", {}),
                           ("hf_static_no_compile", dict(cache_implementation="static",
                                                         disable_compile=True))]
                if not quick:  # torch.compile takes minutes per shape and context
                    configs.append(("hf_static_compiled", dict(cache_implementation="static")))
                for name, kw in configs:
                    try:
                        row[name + "_tok_s"] = round(hf_decode_tps(hf, ctx, **kw), 1)
                    except Exception as e:  # report, keep measuring
                        row[name + "_error"] = repr(e)[:200]
                hf_best = max(v for k, v in row.items() if k.startswith("hf_") and k.endswith("_tok_s"))
                row["speedup_vs_best_hf"] = round(tps / hf_best, 2)
            print(row, flush=True)
            out.append(row)
            del model
            torch.cuda.empty_cache()
        del hf
        torch.cuda.empty_cache()


async def _concurrent(engine: AsyncEngine, n: int, prompt_len: int, new: int) -> dict:
    vocab = engine.engine.runner.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ttft, itl = [], []

    async def one(i):
        t0 = time.perf_counter()
        last = None
        async for _ in engine.generate(torch.randint(0, vocab, (prompt_len,)).tolist(), params, f"c{n}-{i}"):
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t

    def pct(xs, q):
        xs = sorted(xs)
        return round(1000 * xs[min(int(q * len(xs)), len(xs) - 1)], 1)
    return {"concurrency": n, "output_tok_s": round(n * new / wall, 1),
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99)}


def section_concurrency(quick: bool, tokenizer: str | None = None, repeats: int = 1) -> None:
    """Token ids only; with `tokenizer` (a folder `bench/assist.py --export-tokenizer` wrote)
    a second pass detokenizes every output as a server does (`concurrency_1.5b_text`)."""
    model = random_model("qwen2.5-coder-1.5b", max_positions=2048)
    engine = AsyncEngine(make_engine(model, 1024, kv_gib=8, max_num_seqs=64))
    _concurrency_rows(engine, RESULTS.setdefault("concurrency_1.5b", []), quick, repeats)
    engine.close()
    if tokenizer is not None:
        from assist import load_tokenizer
        engine = AsyncEngine(make_engine(model, 1024, kv_gib=8, max_num_seqs=64,
                                         tokenizer=load_tokenizer(tokenizer)))
        _concurrency_rows(engine, RESULTS.setdefault("concurrency_1.5b_text", []), quick, repeats)
        engine.close()


def _concurrency_rows(engine: AsyncEngine, rows: list, quick: bool, repeats: int = 1) -> None:
    """Per concurrency, the run with the median throughput of `repeats` (the others' rates in
    `output_tok_s_runs`): at 64 streams single runs on one machine spread by a third."""
    # warm-up at every concurrency first: Triton compiles kernel specialisations the first time
    # a shape class appears, which would otherwise land in that phase's TTFT
    for n in (1, 8, 32, 64):
        asyncio.run(_concurrent(engine, n, 512, 4))
    for n in (1, 8, 32, 64):
        runs = sorted((asyncio.run(_concurrent(engine, n, 512, 64 if quick else 256))
                       for _ in range(repeats)), key=lambda r: r["output_tok_s"])
        row = dict(runs[len(runs) // 2], output_tok_s_runs=[r["output_tok_s"] for r in runs])
        print(row, flush=True)
        rows.append(row)
    base = rows[0]["output_tok_s"]
    for r in rows:
        r["throughput_vs_batch1"] = round(r["output_tok_s"] / base, 1)


def section_kernels(bw: float) -> None:
    from luceio import kernels
    rows = RESULTS.setdefault("attention_kernels", [])
    for heads, kv_heads, batch, ctx in [(12, 2, 1, 8192), (12, 2, 32, 4096), (32, 8, 1, 8192),
                                        (32, 8, 16, 4096), (14, 2, 64, 2048)]:
        d, bs = 128 if heads != 14 else 64, 16
        nblk = batch * ctx // bs
        kc = torch.randn(nblk, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.arange(nblk, device="cuda", dtype=torch.int32).view(batch, -1)
        seq = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        f = lambda: kernels.paged_attention(q, kc, vc, bt, seq, qsl, 1, ctx, d ** -0.5)  # noqa: E731
        import triton.testing
        ms = triton.testing.do_bench(f, warmup=10, rep=50)
        nbytes = 2 * kc.numel() * kc.element_size()
        row = {"kernel": "paged_decode", "heads": heads, "kv_heads": kv_heads, "head_dim": d,
               "batch": batch, "context": ctx, "us": round(ms * 1000, 1),
               "GB_s": round(nbytes / ms / 1e6, 1), "fraction_of_copy_bw": round(nbytes / (ms / 1000) / bw, 3)}
        print(row, flush=True)
        rows.append(row)
    # varlen prefill: 4 requests x 2048 new tokens on top of 2048 cached tokens
    heads, kv_heads, d, bs, nreq, new, cached = 12, 2, 128, 16, 4, 2048, 2048
    tot = new + cached
    nblk = nreq * tot // bs
    kc = torch.randn(nblk, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.arange(nblk, device="cuda", dtype=torch.int32).view(nreq, -1)
    seq = torch.full((nreq,), tot, device="cuda", dtype=torch.int32)
    qsl = torch.arange(nreq + 1, device="cuda", dtype=torch.int32) * new
    q = torch.randn(nreq * new, heads, d, device="cuda", dtype=torch.bfloat16)
    import triton.testing
    ms = triton.testing.do_bench(lambda: kernels.paged_attention(q, kc, vc, bt, seq, qsl, new, tot, d ** -0.5))
    flops = nreq * heads * 4 * d * sum(cached + i + 1 for i in range(new))
    row = {"kernel": "paged_prefill", "heads": heads, "kv_heads": kv_heads, "requests": nreq,
           "new_tokens": new, "cached_tokens": cached, "us": round(ms * 1000, 1),
           "TFLOP_s": round(flops / ms / 1e9, 1)}
    print(row, flush=True)
    rows.append(row)


def section_spec(quick: bool) -> None:
    """Cost of verifying k drafts vs one plain decode step (1.5B target), and of one draft-model
    step (0.5B), at several batch sizes. Drafts are random: only time is measured here."""
    rows = RESULTS.setdefault("spec_cost", [])
    target = make_engine(random_model("qwen2.5-coder-1.5b", max_positions=2048), 1536, kv_gib=4)
    from luceio.cuda_graphs import StepGraphs
    r = target.runner  # verify graphs up to k = 8 (the engine itself captures up to its k)
    r.graphs = StepGraphs(r.model, r.kv_caches, 64, 1536, r.block_size, r.device, max_spec_tokens=8,
                          staging=r.staging)
    r.graphs.capture()
    draft = make_engine(random_model("qwen2.5-coder-0.5b", max_positions=2048), 1536, kv_gib=2)
    vocab = target.runner.cfg.vocab_size
    for batch in (1, 4, 16):
        for name, eng in (("target", target), ("draft", draft)):
            for i in range(batch):
                eng.add_request(None, torch.randint(0, vocab, (512,)).tolist(),
                                SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
                eng.step()
        for k in range(0, 9):
            times = []
            for _ in range(5 if quick else 10):
                for r in target.scheduler.running:
                    r.spec_token_ids = torch.randint(0, vocab, (k,)).tolist()
                torch.cuda.synchronize()
                t = time.perf_counter()
                target.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            rows.append({"batch": batch, "k": k, "target_step_ms": round(1000 * statistics.median(times), 3)})
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            draft.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rows.append({"batch": batch, "draft_step_ms": round(1000 * statistics.median(times), 3)})
        for eng in (target, draft):
            eng.abort_request(list(eng.states))
            eng.step()
        print(rows[-10:], flush=True)


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, each draft corrupted with probability
    1 - accept_rate: a proposer of known quality, to check the speedup projection end to end."""

    def __init__(self, references: dict[tuple, list[int]], accept_rate: float, vocab: int):
        self.refs, self.rate, self.vocab = references, accept_rate, vocab
        self.rng = torch.Generator().manual_seed(0)

    def propose(self, inputs):
        out = []
        for inp in inputs:
            toks = list(inp.tokens)
            ref = self.refs[tuple(toks[:16])]
            cont = ref[len(toks):len(toks) + inp.k]
            out.append([t if torch.rand(1, generator=self.rng).item() < self.rate
                        else int(torch.randint(0, self.vocab, (1,), generator=self.rng)) for t in cont])
        return Proposal(out)


def section_forced_acceptance(quick: bool, kind: str = "bf16") -> None:
    """End-to-end decode tokens/s with drafts of a forced acceptance rate vs plain decoding;
    `kind` Q4_K_M / Q8_0: random weights quantized through the GGUF load path."""
    key = "spec_forced_acceptance_1.5b" + ("" if kind == "bf16" else "_" + kind)
    rows = RESULTS.setdefault(key, [])
    if kind == "bf16":
        model = random_model("qwen2.5-coder-1.5b", max_positions=2048)
    else:
        from decode_gguf import random_model as random_quant_model
        model = random_quant_model("qwen2.5-1.5b", kind, 2048)
    # random weights give near-flat logits whose bf16 argmax flips between kernel paths; peaked
    # logits keep the greedy trajectory stable so the oracle's references stay valid. bf16: the
    # head's weight (tied to the embedding, so the inputs scale too: what the earlier runs did;
    # scaling the final norm instead left bf16 greedy runs diverging between the verify and
    # decode paths); a quantized head cannot be scaled in place, so the final norm's weight
    if kind == "bf16":
        model.lm_head.weight.mul_(30.0)
    else:
        model.norm.weight.mul_(30.0)
    new = 128 if quick else 256
    for batch in (1, 4, 16):
        prompts = [torch.randint(0, 151936, (512,)).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

        def run(eng):
            for p in prompts:
                eng.add_request(None, p, params)
            outs = {}
            while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
                for o in eng.step():
                    outs[tuple(o.prompt_token_ids[:16])] = o.prompt_token_ids + o.outputs[0].token_ids
            torch.cuda.synchronize()
            t, n0 = time.perf_counter(), eng.counters["generation_tokens"]
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        outs[tuple(o.prompt_token_ids[:16])] = o.prompt_token_ids + o.outputs[0].token_ids
            torch.cuda.synchronize()
            return (eng.counters["generation_tokens"] - n0) / (time.perf_counter() - t), outs
        plain = make_engine(model, 1024, kv_gib=4, max_num_seqs=16)
        base, refs = run(plain)
        del plain
        for rate in (0.5, 0.7, 0.9):
            eng = make_engine(model, 1024, kv_gib=4, max_num_seqs=16, speculative_method="ngram",
                              num_speculative_tokens=4)
            eng.spec.proposer = OracleProposer(refs, rate, 151936)
            tps, outs = run(eng)
            st = eng.spec.stats
            row = {"batch": batch, "forced_accept_rate": rate, "plain_tok_s": round(base, 1),
                   "spec_tok_s": round(tps, 1), "speedup": round(tps / base, 2),
                   "measured_acceptance": round(st.acceptance_rate, 3),
                   "mean_tokens_per_verify": round(st.mean_accepted_length, 2),
                   "outputs_identical": outs == refs,
                   # the cost model's view at the end (why it drafted or not) and the steps
                   "steps": eng.counters["steps"], "sync_steps": dict(eng.counters["sync_steps"]),
                   "cost_model_ms": {f"{b}/{m}": round(v * 1e3, 3) for (b, m), v in eng.spec._cost.items()},
                   "estimated_acceptance": round(eng.spec.acceptance_rate(), 3),
                   "mean_k": {f"{b}/{m}": round(v, 2) for (b, m), v in eng.spec._k.items()}}
            print(row, flush=True)
            rows.append(row)
            del eng
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="decode,hf,concurrency,kernels,spec,forced")
    ap.add_argument("--json-name", default="gpu_bench.json")
    ap.add_argument("--contexts", default="512,8192", help="the decode section's contexts")
    ap.add_argument("--forced-type", default="bf16", help="bf16, Q4_K_M or Q8_0 weights for "
                    "the forced-acceptance section")
    ap.add_argument("--tokenizer", help="a real tokenizer folder (bench/assist.py "
                    "--export-tokenizer): the concurrency section also runs detokenizing")
    ap.add_argument("--concurrency-repeats", type=int, default=1,
                    help="runs per concurrency; the median-throughput run is reported")
    a = ap.parse_args()
    sections = a.sections.split(",")
    RESULTS["env"] = env_info()
    bw = copy_bandwidth()
    RESULTS["copy_bandwidth_GB_s"] = round(bw / 1e9, 1)
    print("copy bandwidth GB/s", RESULTS["copy_bandwidth_GB_s"], flush=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    todo = [("decode", lambda: section_decode(bw, a.quick, "hf" in sections, contexts)),
            ("concurrency", lambda: section_concurrency(a.quick, a.tokenizer,
                                                        a.concurrency_repeats)),
            ("kernels", lambda: section_kernels(bw)), ("spec", lambda: section_spec(a.quick)),
            ("forced", lambda: section_forced_acceptance(a.quick, a.forced_type))]
    todo = sorted((t for t in todo if t[0] in sections), key=lambda t: sections.index(t[0]))
    run_sections(todo, RESULTS, os.path.join(a.out, a.json_name))


if __name__ == "__main__":
    main()
