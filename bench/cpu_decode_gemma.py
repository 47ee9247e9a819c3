"""Gemma 3 decode on the CPU: the CPU decode step (`models/cpu_decode.py`, Gemma 3's own step)
against the module forward, in one run. Random fp32 weights at the Gemma 3 270M text shape
(written once as an HF checkpoint through transformers), decode tok/s at batch 1 and 4 after a
64-token prompt, interleaved trials, medians.

    python bench/cpu_decode_gemma.py [--trials 3] [--new 32] [--threads 1]
                                     [--out bench/results/cpu]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, write_json  # noqa: E402

# google/gemma-3-270m's text config (random weights)
SHAPE = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
             num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
             sliding_window=512, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
             rope_local_base_freq=10_000.0, max_position_embeddings=2048,
             layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(18)],
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


def write_checkpoint(folder: str) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE)).float()
    model.save_pretrained(folder)
    return folder


def decode_tps(llm, batch: int, new: int) -> float:
    from luceio import SamplingParams
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(None, torch.randint(3, 20000, (64,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    t, n0 = time.perf_counter(), eng.counters["generation_tokens"]
    while eng.has_unfinished_requests():
        eng.step()
    return (eng.counters["generation_tokens"] - n0) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu"))
    a = ap.parse_args()
    from luceio import LLM
    folder = write_checkpoint(tempfile.mkdtemp(prefix="luceio-gemma3-"))
    llm = LLM(folder, device="cpu", dtype="float32", cpu_threads=a.threads, max_model_len=1024,
              num_kv_blocks=256)
    runner = llm.engine.runner
    decoder = runner.cpu_decoder
    assert decoder is not None and decoder.gemma, "the CPU decode step does not run here"
    rows = []
    for batch in (1, 4):
        times: dict[str, list[float]] = {"cpu_decode": [], "module_forward": []}
        decode_tps(llm, batch, 4)  # warm-up (numba's compile cache, first allocations)
        for _ in range(a.trials):
            for mode in times:
                runner.cpu_decoder = decoder if mode == "cpu_decode" else None
                times[mode].append(decode_tps(llm, batch, a.new))
        runner.cpu_decoder = decoder
        row = {"batch": batch, **{f"{m}_tok_s": round(statistics.median(v), 2)
                                  for m, v in times.items()},
               "trials": {m: [round(x, 2) for x in v] for m, v in times.items()}}
        row["speedup"] = round(row["cpu_decode_tok_s"] / row["module_forward_tok_s"], 2)
        print(row, flush=True)
        rows.append(row)
    write_json(os.path.join(a.out, "cpu_decode_gemma.json"),
               {"env": env_info(), "shape": "gemma-3-270m (random fp32 weights)",
                "threads": a.threads, "prompt": 64, "new": a.new, "rows": rows})


if __name__ == "__main__":
    main()
