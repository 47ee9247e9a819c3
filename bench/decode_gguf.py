"""Decode at batch 1 from GGUF files, luceio beside llama.cpp on the same files in the same run,
with the roofline (bytes read per token / measured copy bandwidth); and the 32B shape at 4 bits
inside a 24 GiB memory budget.

    GGUF_DIR=/tmp/gguf bash ../shared/tools/llamacpp/bench.sh cuda OUT qwen2.5-0.5b ...  # first
    python bench/decode_gguf.py --gguf-dir /tmp/gguf --llamacpp OUT/llamacpp_cuda.json \
        [--shapes qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b] [--types F16,Q8_0,Q4_K_M] \
        [--contexts 512,8192] [--big32b] [--out bench/results/h200]

The files are random-weight GGUFs at real shapes with the family's vocabulary (`make_gguf.py`),
quantized by llama.cpp's own `llama-quantize`: luceio reads them through its normal load path
(`--quantization auto`: quantized tensors stay quantized, F16 becomes bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (copy_bandwidth, env_info, kv_bytes_per_token, run_sections,  # noqa: E402
                    weight_bytes_per_token)
from gpu_bench import luceio_decode_tps  # noqa: E402

from luceio import EngineArgs, LLMEngine  # noqa: E402

RESULTS: dict = {}


def llamacpp_rows(path: str | None) -> dict[str, dict]:
    """file name -> {"tg128": tok/s, "pp512": tok/s, "tg128@d8192": tok/s, ...} from one or more
    llama-bench JSON files (comma-separated paths); `@dN` marks a run at context depth N."""
    out: dict[str, dict] = {}
    for p in (path or "").split(","):
        if not p or not os.path.isfile(p):
            continue
        for r in json.load(open(p)):
            test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
            if r.get("n_depth"):
                test += f"@d{r['n_depth']}"
            out.setdefault(os.path.basename(r["model_filename"]), {})[test] = round(r["avg_ts"], 1)
    return out


def compare(row: dict, ref: dict) -> None:
    """Adds llama-bench's decode speed on the same file to a luceio row: its plain tg128 (from an
    empty context) for context 512, its run at that depth (-d) for longer contexts."""
    test = "tg128" if row["context"] == 512 else f"tg128@d{row['context']}"
    if ref.get(row["file"], {}).get(test):
        row["llamacpp_test"] = test
        row["llamacpp_tg128_tok_s"] = ref[row["file"]][test]
        row["speedup_vs_llamacpp"] = round(row["luceio_tok_s"] / row["llamacpp_tg128_tok_s"], 2)


def section_files(bw: float, a) -> None:
    rows = RESULTS.setdefault("decode_batch1", [])
    ref = llamacpp_rows(a.llamacpp)
    for shape in a.shapes.split(","):
        for kind in a.types.split(","):
            name = f"{shape}-{kind}.gguf"
            path = os.path.join(a.gguf_dir, name)
            if not os.path.isfile(path):
                print("missing", path, flush=True)
                continue
            for ctx in map(int, a.contexts.split(",")):
                args = EngineArgs(model=path, dtype="bfloat16", device="cuda",
                                  max_model_len=ctx + 256, kv_cache_memory=4 << 30,
                                  max_num_seqs=8, max_num_batched_tokens=8192)
                t = time.perf_counter()
                eng = LLMEngine(args)
                load_s = time.perf_counter() - t
                model = eng.runner.model
                tps = luceio_decode_tps(eng, ctx)
                bytes_tok = weight_bytes_per_token(model) + kv_bytes_per_token(model, ctx + 64)
                row = {"file": name, "shape": shape, "type": kind, "context": ctx,
                       "luceio_tok_s": round(tps, 1), "load_s": round(load_s, 1),
                       "weight_GiB": round(model.weight_bytes() / 2**30, 3),
                       "roofline_tok_s": round(bw / bytes_tok, 1),
                       "fraction_of_roofline": round(tps * bytes_tok / bw, 3)}
                compare(row, ref)
                print(row, flush=True)
                rows.append(row)
                del eng, model
                torch.cuda.empty_cache()


# random weights at real shapes, through the load path (no files) -------------------------------
QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
            max_position_embeddings=32768, rms_norm_eps=1e-6)
RANDOM_SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def random_config(shape: str) -> dict:
    h, inter, layers, heads, kv, vocab, tied = RANDOM_SHAPES[shape]
    return dict(QWEN, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                tie_word_embeddings=tied)


def random_weights(cfg: dict, kind: str, seed: int = 0):
    """HF-named weights of a Qwen2.5-shaped model with random values. `kind`: bf16 (dense), Q8_0,
    or Q4_K_M, typed the way llama-quantize types that mix (Q6_K for attn_v, the output and half
    of ffn_down, Q4_K elsewhere; Q8_0 / Q5_0 instead where a row is not a multiple of 256), as
    random GGUF blocks repacked through the loader's `repack_gguf`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from luceio.kernels.quant import repack_gguf

    g = torch.Generator(device="cuda").manual_seed(seed)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    scale = torch.tensor([2e-4], dtype=torch.float16).view(torch.uint8).cuda()

    def blocks(rows: int, cols: int, qtype):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, device="cuda",
                            generator=g)
        if qtype == T.Q6_K:
            raw[..., -2:] = scale  # d is last
        else:
            raw[..., 0:2] = scale  # d (and dmin or m) first
            if qtype in (T.Q4_K, T.Q5_K, T.Q4_1, T.Q5_1):
                raw[..., 2:4] = scale
        return repack_gguf(raw.reshape(rows, -1).cpu().numpy(), qtype, (rows, cols))

    def w(name, rows, cols, big=False):
        if kind == "bf16":
            return name, torch.randn(rows, cols, device="cuda", generator=g,
                                     dtype=torch.bfloat16) * 0.02
        if kind == "Q8_0":
            return name, blocks(rows, cols, T.Q8_0)
        fits = cols % 256 == 0
        qtype = (T.Q6_K if fits else T.Q8_0) if big else (T.Q4_K if fits else T.Q5_0)
        return name, blocks(rows, cols, qtype)

    yield w("model.embed_tokens.weight", cfg["vocab_size"], h, big=cfg["tie_word_embeddings"])
    yield "model.norm.weight", torch.ones(h)
    if not cfg["tie_word_embeddings"]:
        yield w("lm_head.weight", cfg["vocab_size"], h, big=True)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(h)
        yield p + "post_attention_layernorm.weight", torch.ones(h)
        yield w(p + "self_attn.q_proj.weight", h, h)
        yield w(p + "self_attn.k_proj.weight", kv, h)
        yield w(p + "self_attn.v_proj.weight", kv, h, big=True)
        for proj, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.bias", torch.zeros(rows)
        yield w(p + "self_attn.o_proj.weight", h, h)
        yield w(p + "mlp.gate_proj.weight", inter, h)
        yield w(p + "mlp.up_proj.weight", inter, h)
        yield w(p + "mlp.down_proj.weight", h, inter, big=i % 2 == 0)


def random_model(shape: str, kind: str, max_positions: int):
    from luceio.models import LlamaConfig, LlamaForCausalLM, _rope_cache
    cfg_dict = random_config(shape)
    cfg_dict["max_position_embeddings"] = max_positions
    cfg = LlamaConfig.from_hf(cfg_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, bias=True)
    model.load_weights(random_weights(cfg_dict, kind), torch.bfloat16, torch.device("cuda"))
    model.cos_sin = _rope_cache(cfg).to("cuda")
    return model


def section_random(bw: float, a) -> None:
    from gpu_bench import make_engine
    rows = RESULTS.setdefault("decode_batch1_random", [])
    contexts = list(map(int, a.contexts.split(",")))
    kinds = ["bf16" if k in ("F16", "BF16") else k for k in a.types.split(",")]
    unknown = set(kinds) - {"bf16", "Q8_0", "Q4_K_M"}
    if unknown:
        raise SystemExit(f"--random takes --types from bf16, Q8_0, Q4_K_M; got {sorted(unknown)}")
    for shape in a.shapes.split(","):
        for kind in kinds:
            t = time.perf_counter()
            model = random_model(shape, kind, max(contexts) + 512)
            load_s = time.perf_counter() - t
            for ctx in contexts:
                eng = make_engine(model, ctx + 256, kv_gib=4, max_num_seqs=8)
                tps = luceio_decode_tps(eng, ctx)
                bytes_tok = weight_bytes_per_token(model) + kv_bytes_per_token(model, ctx + 64)
                row = {"shape": shape, "type": kind, "context": ctx, "luceio_tok_s": round(tps, 1),
                       "load_s": round(load_s, 1),
                       "weight_GiB": round(model.weight_bytes() / 2**30, 3),
                       "roofline_tok_s": round(bw / bytes_tok, 1),
                       "fraction_of_roofline": round(tps * bytes_tok / bw, 3)}
                print(row, flush=True)
                rows.append(row)
                del eng
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()


# the 24 GiB card ---------------------------------------------------------------------------------
def gpu_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0])
    except Exception:  # noqa: BLE001  report what we can
        return None


def section_32b(bw: float, a) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    # the engine budgets what torch allocates; the CUDA context and libraries' own memory
    # (what nvidia-smi sees beyond torch's reservations now), plus a margin for the cuBLAS
    # workspaces and graphs that come later, are taken off the 24 GiB first
    smi = gpu_used_mib()
    outside = max(0, int(smi * 2**20) - torch.cuda.memory_reserved()) if smi is not None else 0
    budget = 24 * 2**30 - outside - (512 << 20)
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = random_model("qwen2.5-32b", "Q4_K_M", 8192 + 1024)
    load_s = time.perf_counter() - t
    args = EngineArgs(model="random-32b", dtype="bfloat16", device="cuda",
                      max_model_len=8192 + 512, gpu_memory_utilization=budget / total,
                      max_num_seqs=4, max_num_batched_tokens=2048)
    eng = LLMEngine(args, model=model)
    row = {"shape": "qwen2.5-32b", "type": "Q4_K_M mix (random blocks)",
           "weight_GiB": round(model.weight_bytes() / 2**30, 2), "load_s": round(load_s, 1),
           "kv_blocks": eng.runner.num_blocks,
           "kv_tokens": eng.runner.num_blocks * eng.runner.block_size,
           "gpu_memory_utilization": round(budget / total, 4),
           "outside_torch_GiB": round(outside / 2**30, 2)}
    for ctx in (512, 8192):
        tps = luceio_decode_tps(eng, ctx)
        bytes_tok = weight_bytes_per_token(model) + kv_bytes_per_token(model, ctx + 64)
        row[f"tok_s_ctx{ctx}"] = round(tps, 1)
        row[f"roofline_tok_s_ctx{ctx}"] = round(bw / bytes_tok, 1)
    row["max_memory_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    smi = gpu_used_mib()
    row["nvidia_smi_used_GiB"] = round(smi / 1024, 2) if smi is not None else None
    row["fits_24GiB"] = (smi is None or smi / 1024 <= 24) and \
        torch.cuda.max_memory_reserved() <= budget
    print(row, flush=True)
    RESULTS["qwen2.5_32b_24GiB"] = row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-dir", default=os.environ.get("GGUF_DIR", "/tmp/gguf"))
    ap.add_argument("--llamacpp", default=None,
                    help="llama-bench JSON from bench.sh (comma-separated for several runs)")
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--types", default="F16,Q8_0,Q4_K_M")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--big32b", action="store_true", help="the 32B shape in 24 GiB")
    ap.add_argument("--only32b", action="store_true")
    ap.add_argument("--random", action="store_true", help="random weights through the load path "
                    "instead of files (--types bf16,Q8_0,Q4_K_M)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200"))
    ap.add_argument("--json-name", default="decode_gguf.json")
    ap.add_argument("--merge", default=None, metavar="DECODE_JSON",
                    help="measure nothing: add --llamacpp's numbers to an earlier run's rows")
    a = ap.parse_args()
    if a.merge:
        res = json.load(open(a.merge))
        res["llamacpp"] = ref = llamacpp_rows(a.llamacpp)
        for row in res.get("decode_batch1", []):
            compare(row, ref)
        with open(os.path.join(a.out, a.json_name), "w") as f:
            json.dump(res, f, indent=1)
        return
    RESULTS["env"] = env_info()
    bw = copy_bandwidth()
    RESULTS["copy_bandwidth_GB_s"] = round(bw / 1e9, 1)
    print("copy bandwidth GB/s", RESULTS["copy_bandwidth_GB_s"], flush=True)
    RESULTS["llamacpp"] = llamacpp_rows(a.llamacpp)
    first = ("random", section_random) if a.random else ("files", section_files)
    todo = ([] if a.only32b else [first]) + \
        ([("32b", section_32b)] if a.big32b or a.only32b else [])
    run_sections([(name, lambda fn=fn: fn(bw, a)) for name, fn in todo], RESULTS,
                 os.path.join(a.out, a.json_name))


if __name__ == "__main__":
    main()
