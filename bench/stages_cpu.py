"""CPU pipeline stages on a real GGUF: batch-1 decode tok/s of one process against two CPU
stages (`--devices cpu,cpu`), on this tree and on `--baseline REV` (a temporary git worktree;
before session 20 a CPU stage ran the module forward, not the CPU decode path of
`models/cpu_decode.py`). One thread per process, so two stages use two cores; the trees
alternate over `--rounds` and each row keeps its best.

    python bench/stages_cpu.py [--model smollm2-135m] [--prompt 64] [--new 32] [--rounds 2]
                               [--baseline b35b4b3] [--out bench/results/cpu/stages_cpu.json]

Each row runs in a subprocess of its own (stage processes and thread counts start fresh).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import env_info, source_trees, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = {"one process": "cpu", "two stages": "cpu,cpu"}


def child(model: str, devices: str, prompt: int, new: int) -> dict:
    import torch

    from luceio import LLM, SamplingParams
    kw = dict(cpu_threads=1, max_model_len=prompt + new + 16, num_kv_blocks=64)
    kw.update(device="cpu") if devices == "cpu" else kw.update(devices=devices)
    llm = LLM(model, **kw)
    try:
        eng = llm.engine
        vocab = eng.runner.cfg.vocab_size
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0))
        eng.add_request("r", {"prompt_token_ids": ids}, params)
        while not any(r.num_output_tokens for r in eng.scheduler.running):
            eng.step()  # the prompt, to its first token
        t, n0 = time.perf_counter(), eng.counters["generation_tokens"]
        tokens = []
        while eng.has_unfinished_requests():
            tokens += [o.outputs[0].token_ids[-1] for o in eng.step() if o.outputs]
        tps = (eng.counters["generation_tokens"] - n0) / (time.perf_counter() - t)
        return {"tok_s": round(tps, 2), "tokens": tokens}
    finally:
        llm.shutdown()


def _run(root: str, a, devices: str, what: str) -> dict:
    """One row in a process of its own running `root`'s code."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "stages_cpu.py"), "--model",
                          a.model, "--prompt", str(a.prompt), "--new", str(a.new), "--child",
                          devices], cwd=root, env=dict(os.environ, PYTHONPATH=root),
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{what}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu",
                                                  "stages_cpu.json"))
    ap.add_argument("--baseline", help="a git revision measured alternately with this tree")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.child, a.prompt, a.new)))
        return
    tmp = tempfile.mkdtemp()
    best: dict[str, dict] = {}
    try:
        with source_trees(os.path.dirname(HERE), a.baseline, tmp) as trees:
            for _ in range(a.rounds):
                for tree, root in trees.items():
                    for name, devices in ROWS.items():
                        row = _run(root, a, devices, f"{tree}, {name}")
                        key = f"{name}, {tree}"
                        print(key, row["tok_s"], flush=True)
                        if key not in best or row["tok_s"] > best[key]["tok_s"]:
                            best[key] = row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = len({tuple(r["tokens"]) for r in best.values()}) == 1
    res = {"env": env_info(), "model": a.model, "prompt": a.prompt, "new": a.new,
           "rounds": a.rounds, "baseline": a.baseline, "load_average": os.getloadavg(),
           "same_tokens": same, "rows": [{"config": k, "tok_s": v["tok_s"]} for k, v in best.items()]}
    write_json(a.out, res)
    for r in res["rows"]:
        print(f"{r['config']:34s} {r['tok_s']:8.2f} tok/s")
    print("greedy tokens identical across rows:", same)


if __name__ == "__main__":
    main()
