"""Expert offload on the GPU: batch-1 decode of a Qwen3-30B-A3B-shaped MoE with every expert
resident against `--expert-memory` of a fraction of them (LRU only; with a placement calibrated
on prompts run through the same model; with a placement that ranks the experts backwards).

    python bench/moe_offload.py [--layers 16] [--fraction 0.6] [--context 512] [--new 96]
                                [--out bench/results/h200/moe_offload.json] [--batches 64]
                                [--quant-experts q4_k,q6_k [--no-eager]
                                 [--cap-gib 24 --cap-kv-tokens 65536]]

The model is Qwen3-30B-A3B's shape (hidden 2048, 128 experts of width 768, top-8, 32 / 4
heads of 128, vocab 151936) cut to `--layers` layers (every layer has the same shape, so a
step's time scales with them and the offloaded / resident ratio does not depend on the count;
the full 48 layers load the 61 GB of bf16 weights twice over). Random bf16 weights (windows
of one random pool, the routers drawn on their own) stream through the engine's own load path
(`build_model`, so `--expert-memory` pins and places the experts as for a real checkpoint),
the same seed for every engine, so all see one model. Random routers give little skew for a
placement to use, and random hidden states change little from token to token, which makes
the LRU's hit rate high: neither is what a real model's routing looks like, so these rows
measure the offload machinery's cost, not what calibration gains on real weights.
Each row first decodes 8 tokens of another request (Triton compiles, slots and allocator warm),
then times `--new` tokens after a `--context`-token prompt; the expert counters (hits, misses,
bytes loaded) cover both requests, prefills included, the `decode_*` ones the timed decode
steps only. Offloaded rows read their experts in place inside CUDA graphs
(`models/expert_tables.py`); two more rows pin every slot but top-k for the placement (the cap
before `PINNED_SHARE`), and run every step eagerly in rounds (the path before the tables).
On the GPU the result also carries the batch-1 roofline (`read_bytes` over the copy bandwidth);
`--batches` adds resident rows of that many concurrent requests; `--quant-experts` replaces the
bf16 offload rows by quantized ones (`quant_rows`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402
from gpu_bench import luceio_decode_tps  # noqa: E402

import luceio.engine as engine_mod  # noqa: E402
from luceio import LLMEngine, SamplingParams  # noqa: E402
from luceio.config import EngineArgs  # noqa: E402
from luceio.loader import Checkpoint  # noqa: E402
from luceio.models import expert_offload  # noqa: E402
from luceio.models.expert_calibration import count_experts, placement  # noqa: E402
from luceio.models.expert_offload import ExpertOffload  # noqa: E402

NAME = "random-qwen3-30b-a3b"
DEVICE = "cuda"


def hf_config(layers: int, context: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": layers,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": context, "tie_word_embeddings": False,
            "hidden_act": "silu"}


def random_weights(c: dict, seed: int = 0, quant: tuple | None = None):
    """(HF name, bf16 tensor) for every weight of the config, drawn from one CPU generator.
    `quant` (gate/up qtype, down qtype): the experts as random quantized weights instead,
    cycled from a pool of 8 per projection (a GGUF's expert stacks, as the loader yields them
    with keep_quantized)."""
    g = torch.Generator().manual_seed(seed)
    h, e, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    # big matrices are windows of one random pool (drawing 20 GB of normals per engine would
    # take minutes); the routers are drawn on their own
    pool = torch.empty(c["vocab_size"] * h + (1 << 20), dtype=torch.bfloat16).normal_(
        0.0, 0.02, generator=g)
    offsets = torch.randint(0, 1 << 20, (1 << 16,), generator=g).tolist()
    turn = iter(range(1 << 62))

    def rand(*shape, std=0.02):
        n = shape[0] * shape[1]
        if std != 0.02 or n > len(pool) - (1 << 20):
            return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=g)
        start = offsets[next(turn) % len(offsets)]
        return pool[start:start + n].view(shape)
    if quant is not None:
        from luceio.kernels.quant import random_quant_weight
        pools = {proj: [random_quant_weight(qt, *shape, generator=g) for _ in range(8)]
                 for proj, qt, shape in (("gate_proj", quant[0], (inter, h)),
                                         ("up_proj", quant[0], (inter, h)),
                                         ("down_proj", quant[1], (h, inter)))}
    yield "model.embed_tokens.weight", rand(c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        for name, rows, cols in (("q_proj", nh * hd, h), ("k_proj", nkv * hd, h),
                                 ("v_proj", nkv * hd, h), ("o_proj", h, nh * hd)):
            yield p + f"self_attn.{name}.weight", rand(rows, cols)
        yield p + "self_attn.q_norm.weight", torch.ones(hd, dtype=torch.bfloat16)
        yield p + "self_attn.k_norm.weight", torch.ones(hd, dtype=torch.bfloat16)
        yield p + "mlp.gate.weight", rand(e, h, std=0.05)
        for x in range(e):
            if quant is not None:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    yield p + f"mlp.experts.{x}.{proj}.weight", pools[proj][(x + i) % 8]
                continue
            yield p + f"mlp.experts.{x}.gate_proj.weight", rand(inter, h)
            yield p + f"mlp.experts.{x}.up_proj.weight", rand(inter, h)
            yield p + f"mlp.experts.{x}.down_proj.weight", rand(h, inter)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)
    yield "lm_head.weight", rand(c["vocab_size"], h)


def engine(c: dict, context: int, quant: tuple | None = None, **kw) -> LLMEngine:
    ckpt = Checkpoint(config=c, weights=lambda keep_quantized=False: random_weights(
        c, quant=quant), source=NAME)
    engine_mod.load_checkpoint = lambda path: ckpt  # the bench's model, by name
    engine_mod.model_path = lambda name: name
    args = EngineArgs(model=NAME, dtype="bfloat16", device=DEVICE, max_model_len=context + 256,
                      max_num_batched_tokens=2048,
                      **{"kv_cache_memory": 2 << 30, "max_num_seqs": 4, **kw})
    return LLMEngine(args)


def read_bytes(eng: LLMEngine, context: int) -> int:
    """Bytes a batch-1 decode step reads at `context` tokens: every weight but the embedding
    table (one row) and the experts a token does not route to, + the KV of the context."""
    from luceio.models.moe import quantized_expert_bytes
    model, moe = eng.runner.model, eng.runner.model.moe_cfg
    cfg = model.cfg
    total = model.weight_bytes()
    if not cfg.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    experts = quantized_expert_bytes(model) + sum(
        w.numel() * w.element_size() for i in moe.sparse_layers
        for w in (model.layers[i].mlp.w_gate_up, model.layers[i].mlp.w_down))
    kv = context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return int(total - experts * (moe.num_experts - moe.top_k) / moe.num_experts + kv)


def batch_row(a, c: dict, name: str, res: dict, batch: int, **kw) -> None:
    """Decode tok/s summed over `batch` concurrent requests (resident, CUDA graphs)."""
    eng = engine(c, a.context, max_num_seqs=batch, kv_cache_memory=(2 << 30) * max(
        1, batch // 16), **kw)
    luceio_decode_tps(eng, 64, new=8, batch=batch)  # warm
    r = {"config": f"{name}, {batch} concurrent", "batch": batch,
         "tok_s": round(luceio_decode_tps(eng, a.context, new=a.new, batch=batch), 1)}
    print(r, flush=True)
    res.setdefault("batch_rows", []).append(r)
    write_json(a.out, res)
    del eng
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--quant-experts", default=None, help="GU,DOWN qtypes (q4_k,q6_k): "
                    "quantized experts, stacked with CUDA graphs against the per-expert eager "
                    "path and offloaded to --fraction, instead of the bf16 offload rows")
    ap.add_argument("--no-eager", action="store_true", help="with --quant-experts: skip the "
                    "per-expert eager row")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="with --quant-experts: one more "
                    "row under this device memory cap (torch's per-process fraction), the "
                    "experts' budget what the cap leaves after the other weights, a KV pool of "
                    "--cap-kv-tokens tokens and the resident run's other memory")
    ap.add_argument("--cap-kv-tokens", type=int, default=32768)
    ap.add_argument("--batches", default="", help="e.g. 64: resident rows with that many "
                    "concurrent requests (decode tok/s summed)")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: checks the "
                    "script, measures nothing")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "moe_offload.json"))
    a = ap.parse_args()
    c = hf_config(a.layers, a.context + 256)
    if a.tiny:
        global DEVICE
        DEVICE = "cpu"
        torch.cuda.synchronize = lambda *_: None
        c.update(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_experts=16,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    res = {"env": env_info(), "shape": "Qwen3-30B-A3B, " + f"{a.layers} of 48 layers",
           "fraction": a.fraction, "context": a.context, "rows": []}

    def counters(eng: LLMEngine):
        torch.cuda.synchronize()
        if eng.runner.expert_offload is not None:  # counters of the steps in flight
            eng.runner.expert_offload.collect()
        return eng.stats().experts

    def row(name: str, eng: LLMEngine, **extra):
        luceio_decode_tps(eng, 64, new=8)  # warm: Triton compiles, slots filled, allocator
        t = time.perf_counter()
        decode_start = []  # the counters once the prompt is in (the helper syncs there)
        step = eng.step

        def first_step():
            if not decode_start and any(r.num_output_tokens for r in eng.scheduler.running):
                decode_start.append(counters(eng))
            return step()
        eng.step = first_step
        tps = luceio_decode_tps(eng, a.context, new=a.new)
        eng.step = step
        r = {"config": name, "tok_s": round(tps, 2), "seconds": round(time.perf_counter() - t, 1),
             **extra}
        st = counters(eng)
        if st is not None:
            r.update(hits=st.hits, misses=st.misses, gib_loaded=round(st.bytes_loaded / 2**30, 2),
                     hit_rate=round(st.hits / max(st.hits + st.misses, 1), 3),
                     slots_per_layer=st.num_slots)
            d = decode_start[0]
            r.update(decode_misses_per_token=round((st.misses - d.misses) / a.new, 2),
                     decode_hit_rate=round((st.hits - d.hits) / max(
                         st.hits - d.hits + st.misses - d.misses, 1), 3),
                     decode_gib_loaded=round((st.bytes_loaded - d.bytes_loaded) / 2**30, 2))
        print(r, flush=True)
        res["rows"].append(r)
        write_json(a.out, res)

    resident = engine(c, a.context)
    if DEVICE == "cuda":  # the batch-1 roofline: bytes a step reads over the copy bandwidth
        from common import copy_bandwidth
        bw = copy_bandwidth()
        res["copy_bandwidth_GB_s"] = round(bw / 1e9, 1)
        res["roofline_tok_s"] = {"bf16": round(bw / read_bytes(resident, a.context + 48), 1)}
    row("resident, CUDA graphs", resident)
    del resident
    for b in filter(None, a.batches.split(",")):
        batch_row(a, c, "bf16 experts, resident", res, int(b))
    torch.cuda.empty_cache()
    if a.quant_experts:
        quant_rows(a, c, tuple(a.quant_experts.split(",")), res, row)
        return
    eager = engine(c, a.context, enforce_eager=True)
    row("resident, eager", eager)
    # calibration: prompts of random tokens through the resident model, counted per layer
    vocab = c["vocab_size"]
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (256,)).tolist()} for _ in range(8)]
    with count_experts(eager.runner.model) as counts:
        for p in prompts:
            eager.add_request(None, p["prompt_token_ids"],
                              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        while eager.has_unfinished_requests():
            eager.step()
    del eager
    torch.cuda.empty_cache()
    folder = tempfile.mkdtemp()
    good, bad = os.path.join(folder, "placement.json"), os.path.join(folder, "backwards.json")
    with open(good, "w") as f:
        json.dump(placement(counts, NAME), f)
    with open(bad, "w") as f:
        json.dump(placement({i: -c_ for i, c_ in counts.items()}, NAME), f)
    top = sorted(counts[0].tolist(), reverse=True)
    res["calibration"] = {"prompts": len(prompts), "layer0_top8_share": round(
        sum(top[:8]) / max(sum(top), 1), 3), "uniform_top8_share": round(8 / c["num_experts"], 3)}
    for name, place in (("LRU only", None), ("calibrated placement", good),
                        ("backwards placement", bad)):
        eng = engine(c, a.context, expert_memory=str(a.fraction), expert_placement=place)
        row(f"{a.fraction:.0%} of experts, {name}", eng, graphs=eng.runner.graphs is not None)
        del eng
        torch.cuda.empty_cache()
    # a placement pinning every slot but top-k (the cap before PINNED_SHARE)
    expert_offload.PINNED_SHARE = 1.0
    eng = engine(c, a.context, expert_memory=str(a.fraction), expert_placement=good)
    row(f"{a.fraction:.0%} of experts, calibrated placement on all slots but top-k", eng,
        graphs=eng.runner.graphs is not None)
    expert_offload.PINNED_SHARE = 0.5
    del eng
    torch.cuda.empty_cache()
    # the offload's eager path before the in-place tables (every step in rounds), for reference
    start, limit = ExpertOffload.start, expert_offload.IN_PLACE_MAX_TOKENS
    ExpertOffload.start = lambda self, device, in_place=None: start(self, device, False)
    expert_offload.IN_PLACE_MAX_TOKENS = 0
    eng = engine(c, a.context, expert_memory=str(a.fraction))
    row(f"{a.fraction:.0%} of experts, LRU only, eager rounds", eng,
        graphs=eng.runner.graphs is not None)
    ExpertOffload.start, expert_offload.IN_PLACE_MAX_TOKENS = start, limit
    del eng
    torch.cuda.empty_cache()
    base = res["rows"][0]["tok_s"]
    for r in res["rows"]:
        r["vs_resident_graphs"] = round(r["tok_s"] / base, 3)
    write_json(a.out, res)
    print(json.dumps(res["calibration"]))


def quant_rows(a, c: dict, quant: tuple, res: dict, row) -> None:
    """Quantized experts: stacked on the graph-capturable decode path
    (`kernels/moe_quant_triton.py`) all resident, offloaded to `--fraction` of their bytes
    (read in place, LRU only), optionally under `--cap-gib`, and per expert with a host read of
    the routing (eager, the path before the stacks)."""
    import gc
    from luceio.models.moe import SparseMoeBlock, quantized_expert_bytes
    name = "/".join(q.upper() for q in quant)
    gc.collect()  # the bf16 engine's memory, freed before the peak is measured
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = engine(c, a.context, quant=quant)
    if "roofline_tok_s" in res:
        res["roofline_tok_s"][name] = round(res["copy_bandwidth_GB_s"] * 1e9 / read_bytes(
            eng, a.context + 48), 1)
    row(f"{name} experts, stacked, CUDA graphs", eng, graphs=eng.runner.graphs is not None)
    model = eng.runner.model
    experts, weights = quantized_expert_bytes(model), model.weight_bytes()
    peak = torch.cuda.max_memory_allocated() - before
    other = peak - weights - (2 << 30)  # activations, graphs, buffers
    res["memory"] = {"weights_gib": round(weights / 2**30, 2),
                     "experts_gib": round(experts / 2**30, 2),
                     "resident_peak_gib": round(peak / 2**30, 2),
                     "allocated_before_gib": round(before / 2**30, 2),
                     "other_gib": round(other / 2**30, 2)}
    del eng, model
    gc.collect()
    torch.cuda.empty_cache()
    for b in filter(None, a.batches.split(",")):
        batch_row(a, c, f"{name} experts, resident (stacked)", res, int(b), quant=quant)
    eng = engine(c, a.context, quant=quant, expert_memory=str(a.fraction))
    row(f"{name} experts, {a.fraction:.0%} resident, LRU only, CUDA graphs", eng,
        graphs=eng.runner.graphs is not None)
    del eng
    torch.cuda.empty_cache()
    if a.cap_gib:
        gc.collect()
        torch.cuda.empty_cache()
        cap = int(a.cap_gib * 2**30)
        kv = a.cap_kv_tokens * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * \
            c["head_dim"] * 2
        budget = cap - (weights - experts) - kv - other - (512 << 20)  # a 512 MiB margin
        if budget <= 0:
            raise SystemExit(f"a {a.cap_gib} GiB cap leaves no room for experts: {res['memory']}")
        res["memory"].update(cap_gib=a.cap_gib, cap_kv_tokens=a.cap_kv_tokens,
                             cap_kv_gib=round(kv / 2**30, 2),
                             cap_expert_budget_gib=round(budget / 2**30, 2),
                             resident_would_need_gib=round((weights + kv + other) / 2**30, 2),
                             cap_allocated_before_gib=round(
                                 torch.cuda.memory_allocated() / 2**30, 2))
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
        torch.cuda.reset_peak_memory_stats()
        try:
            eng = engine(c, a.context, quant=quant, expert_memory=str(budget),
                         kv_cache_memory=kv)
            row(f"{name} experts under a {a.cap_gib:g} GiB cap ({a.cap_kv_tokens}-token KV "
                "pool), LRU only, CUDA graphs", eng, graphs=eng.runner.graphs is not None,
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            del eng
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    if not a.no_eager:
        stack = SparseMoeBlock._stack_quantized
        SparseMoeBlock._stack_quantized = lambda self: False
        eng = engine(c, a.context, quant=quant)
        row(f"{name} experts, per expert, eager", eng, graphs=eng.runner.graphs is not None)
        SparseMoeBlock._stack_quantized = stack
        del eng
    base, qbase = res["rows"][0]["tok_s"], res["rows"][1]["tok_s"]
    if "roofline_tok_s" in res:
        for r, key in zip(res["rows"], ("bf16", name)):
            r["fraction_of_roofline"] = round(r["tok_s"] / res["roofline_tok_s"][key], 3)
    for r in res["rows"]:
        r["vs_resident_graphs"] = round(r["tok_s"] / base, 3)
        r["vs_quant_resident"] = round(r["tok_s"] / qbase, 3)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
