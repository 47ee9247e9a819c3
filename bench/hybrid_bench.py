"""Batch-1 decode of Qwen3.5 hybrid models on the GPU, against the bandwidth roofline: random
bf16 weights at real shapes, built on the device (the load path is not involved), CUDA graphs on
and off.

    python bench/hybrid_bench.py [--shapes qwen3.5-9b,qwen3.5-35b-a3b] [--context 512]
                                 [--out bench/results/h200/hybrid_bench.json]
                                 [--no-eager] [--profile-steps 32] [--batches 1,64]
                                 [--prefill 16384 [--prefill-only]]

Shapes: `qwen3.5-9b` is transformers' `Qwen3_5TextConfig` defaults (hidden 4096, 32 layers, 24
of them Gated DeltaNet, 16 / 32 key / value heads of 128, 8 full-attention layers of 16 heads
(4 KV) of 256, vocab 248320); `qwen3.5-27b` the same with hidden 5120, 64 layers (48 DeltaNet),
MLP 17408, 48 value heads, 24 attention heads (Qwen3.5-27B's published shape);
`qwen3.5-35b-a3b` is `Qwen3_5MoeTextConfig`'s defaults (hidden 2048, 40 layers, 256 experts
of width 512, top-8, a shared expert of 512). Roofline per token
= (weights a decode step reads: every dense weight and the LM head, for an MoE only the top-k
experts' + the KV of the context read + the DeltaNet state read and written) / the copy
bandwidth measured in the same run. With `--profile-steps N` (default 32, 0: none) the CUDA-graph
row also carries step_profile.py's breakdown of N profiled steps: kernels per step, GPU busy
time, idle share, the kernels with the most GPU time. `--batches 1,64`: a CUDA-graph row per
batch size (concurrent requests, decode tok/s summed over them). `--prefill N`: a row of
prompt tok/s for one N-token prompt, with the DeltaNet prefill kernels and with the torch
reference they replaced (same model, same run).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, env_info, write_json  # noqa: E402
from gpu_bench import luceio_decode_tps, make_engine  # noqa: E402

SHAPES = {"qwen3.5-9b": ("qwen3_5", {}), "qwen3.5-35b-a3b": ("qwen3_5_moe", {}),
          # Qwen3.5-27B's dense hybrid shape as published (not checked against a file here)
          "qwen3.5-27b": ("qwen3_5", {"hidden_size": 5120, "num_hidden_layers": 64,
                                      "intermediate_size": 17408, "num_attention_heads": 24,
                                      "num_key_value_heads": 4, "linear_num_value_heads": 48})}


def hf_config(shape: str) -> dict:
    kind, over = SHAPES[shape]
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig as C
        arch = "Qwen3_5ForCausalLM"
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import \
            Qwen3_5MoeTextConfig as C
        arch = "Qwen3_5MoeForCausalLM"
    c = C(**over).to_dict()
    c["architectures"] = [arch]
    return c


def random_hybrid(shape: str, max_positions: int):
    from luceio.models.qwen3_5 import Qwen35Config, Qwen3_5ForCausalLM, rope_cache
    from luceio.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, moe_config
    c = hf_config(shape)
    c["max_position_embeddings"] = max_positions
    cfg = Qwen35Config.from_hf(c)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 35B in fp32 would not fit
    try:
        with torch.device("cuda"):
            model = (Qwen3_5MoeForCausalLM(cfg, *moe_config(c)) if "num_experts" in c
                     else Qwen3_5ForCausalLM(cfg))
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=g).log())
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_()  # (1 + w) norms
        else:
            p.normal_(0.0, 0.02, generator=g)
    model.cos_sin = rope_cache(cfg).cuda()
    return model, c


def bytes_per_token(model, c: dict, context: int) -> dict:
    cfg = model.cfg
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight.numel() * 2
    weights = total if cfg.tie_word_embeddings else total - embed
    if "num_experts" in c:  # only the routed top-k of every layer's experts are read
        e, k = c["num_experts"], c["num_experts_per_tok"]
        expert = 3 * c["moe_intermediate_size"] * cfg.hidden_size * 2
        weights -= cfg.num_layers * (e - k) * expert
    kv = 2 * cfg.num_kv_layers * context * cfg.num_kv_heads * cfg.head_dim * 2
    state = 2 * model.state_bytes_per_slot(torch.bfloat16)
    return {"weights": weights, "kv": kv, "state_read_write": state}


def prefill_tps(model, tokens: int, reference: bool) -> float:
    """Prompt tokens a second of one `tokens`-token prompt (steps of 8192 tokens, eager), the
    DeltaNet layers' delta rule on the Triton kernels or (`reference`) on the torch reference
    those kernels replaced; the second of two such prompts (the first compiles every kernel at
    these shapes)."""
    import time

    import luceio.kernels.delta_rule_prefill_triton as dpt
    from luceio.kernels.delta_rule import gated_delta_rule_chunked
    from luceio import SamplingParams
    saved = dpt.gdn_prefill
    if reference:
        dpt.gdn_prefill = gated_delta_rule_chunked  # the model imports it at each call
    try:
        eng = make_engine(model, tokens + 64, kv_gib=2 * (1 + tokens // 16384), max_num_seqs=4,
                          enforce_eager=True)
        vocab = eng.runner.cfg.vocab_size
        elapsed = 0.0
        for n in (tokens, tokens):
            eng.add_request(None, torch.randint(0, vocab, (n,)).tolist(),
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t
        del eng
        torch.cuda.empty_cache()
        return tokens / elapsed
    finally:
        dpt.gdn_prefill = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3.5-9b,qwen3.5-35b-a3b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--no-eager", action="store_true", help="CUDA-graph rows only")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--batches", default="1", help="concurrent requests per row, e.g. 1,64: "
                    "decode tok/s summed over them (CUDA graphs; the roofline share and the "
                    "profile at batch 1 only)")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prompt of this many "
                    "tokens, the delta rule on the Triton kernels and on the torch reference "
                    "(prompt tok/s)")
    ap.add_argument("--prefill-only", action="store_true", help="no decode rows")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "hybrid_bench.json"))
    a = ap.parse_args()
    bw = copy_bandwidth()
    results = {"env": env_info(), "copy_bandwidth_GB_s": round(bw / 1e9, 1),
               "context": a.context, "rows": []}
    for shape in a.shapes.split(","):
        model, c = random_hybrid(shape, max(a.context + 1024, a.prefill + 64))
        parts = bytes_per_token(model, c, a.context + 64)
        roofline = bw / sum(parts.values())
        if a.prefill:
            rows = {ref: prefill_tps(model, a.prefill, ref) for ref in (False, True)}
            row = {"shape": shape, "prefill_tokens": a.prefill,
                   "prefill_tok_s": round(rows[False], 1),
                   "prefill_tok_s_torch_delta_rule": round(rows[True], 1),
                   "speedup": round(rows[False] / rows[True], 2)}
            print(row, flush=True)
            results["rows"].append(row)
            write_json(a.out, results)
        runs = [] if a.prefill_only else [(False, b) for b in map(int, a.batches.split(","))]
        for eager, batch in runs if a.no_eager or not runs else runs[:1] + [(True, 1)] + runs[1:]:
            eng = make_engine(model, a.context + 512, kv_gib=2 * max(1, batch // 8),
                              max_num_seqs=max(4, batch), enforce_eager=eager)
            tps = luceio_decode_tps(eng, a.context, batch=batch)
            row = {"shape": shape, "cuda_graphs": not eager, "batch": batch,
                   "tok_s": round(tps, 1)}
            if batch == 1:
                row.update(roofline_tok_s=round(roofline, 1),
                           fraction_of_roofline=round(tps / roofline, 3),
                           bytes_per_token=parts)
            if a.profile_steps and not eager and batch == 1:
                from step_profile import profile_decode
                row["profile"] = profile_decode(eng, a.context, a.profile_steps)
            print(row, flush=True)
            results["rows"].append(row)
            write_json(a.out, results)
            del eng
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
