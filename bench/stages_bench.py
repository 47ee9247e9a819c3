"""Pipeline stages on two GPUs, one run: random bf16 weights at real shapes, batch-1 decode tok/s
(a 512-token prompt) and the aggregate decode tok/s of 64 concurrent requests, for
  one_gpu_graphs   one GPU, CUDA graphs (the normal engine)
  one_gpu_eager    one GPU, eager (staged runs are eager: this separates the graphs' share)
  nccl             two stages, cuda:0 + cuda:1, hidden states over NCCL (decode steps replay
                   each stage's CUDA graphs, stages/graphs.py)
  host             two stages, the same, hidden states host-staged over Gloo
  host_eager       the same without CUDA graphs (--enforce-eager)
  nccl_mb2,        the same with each step's requests cut into two micro-batches
  host_mb2         (--stage-micro-batches 2): a stage runs one while the one before computes
                   the next (eager: micro-batches take no graphs)
  capped           two stages (auto transport), each GPU capped by --gpu-memory-utilization
                   below the model's weight bytes, so neither GPU alone may hold the model
                   (the 8B shape only: the smaller ones leave no room for the 1 GiB headroom)
Each configuration runs in a subprocess with its own time limit (a hang or a crash is recorded
as that row's error and the others still run); the whole run stops starting new ones when
--budget-s is spent. Staged runs load a checkpoint in every process, so the random weights are
written once per shape as an HF folder (in /dev/shm when it has room). A staged row's
`stage_timing` is where each stage's steps went (luceio/stages/timing.py: µs a step by phase,
batch-1 decode steps apart from the others). Writes
<out>/stages_bench.json and prints a table.

    python bench/stages_bench.py [--quick] [--shapes qwen2.5-coder-1.5b,llama-3.1-8b]
        [--types bf16[,int4]] [--configs one_gpu_graphs,...] [--out bench/results/h200x2]
    python bench/stages_bench.py --one-gpu --configs one_gpu_graphs,one_gpu_eager,host,host_mb2
        --out bench/results/h200   # one GPU: both stages on cuda:0 (host transport only)
    python bench/stages_bench.py --device cpu --shapes tiny   # a dry run of the harness
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SHAPES, env_info, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["one_gpu_graphs", "one_gpu_eager", "nccl", "host", "nccl_mb2", "host_mb2", "capped",
           "host_eager"]
CAP_OF_WEIGHTS = 0.9  # capped: each GPU may use this share of the model's weight bytes
RESULT = "RESULT "  # the child's last line: RESULT {json}


# the parent: checkpoints, configurations, the table -----------------------------------------

def hf_tensors(shape: str):
    """(name, shape) of an HF Llama/Qwen2 checkpoint at `shape`, in file order."""
    c = SHAPES[shape]
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", (rows, h)
            if c["model_type"] == "qwen2":
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, h)


def weight_bytes(shape: str) -> int:
    return sum(2 * torch.Size(s).numel() for _, s in hf_tensors(shape))  # bf16


def write_checkpoint(shape: str, root: str, device: str) -> str:
    """An HF folder of random bf16 weights at `shape` (norms 1, the rest N(0, 0.02)), in
    shards of about 2 GiB."""
    from safetensors.torch import save_file
    folder = os.path.join(root, f"luceio-stages-{shape}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(SHAPES[shape], torch_dtype="bfloat16"), f)
    g = torch.Generator(device=device).manual_seed(0)
    shard, size, n = {}, 0, 0
    for name, dims in hf_tensors(shape):
        t = torch.ones(dims, dtype=torch.bfloat16, device=device) if "norm" in name else \
            torch.empty(dims, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=g)
        shard[name] = t.cpu()
        size += shard[name].numel() * 2
        if size >= 2 << 30:
            save_file(shard, os.path.join(folder, f"model-{n:05d}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, os.path.join(folder, f"model-{n:05d}.safetensors"))
    if device == "cuda":
        torch.cuda.empty_cache()  # the configurations measure the GPU without this process
    return folder


def scratch_root(nbytes: int) -> str:
    """/dev/shm when it holds the checkpoint twice over (reads at memory speed), else tmp."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    return tempfile.gettempdir()


def engine_options(config: str, shape: str, a) -> dict | None:
    """EngineArgs fields of a configuration, or None where it does not apply."""
    cpu = a.device == "cpu"
    one = "cpu" if cpu else "cuda:0"
    two = "cpu,cpu" if cpu else "cuda:0,cuda:0" if a.one_gpu else "cuda:0,cuda:1"
    kv = dict(kv_cache_memory=int(a.kv_gib * 2**30))
    if config == "one_gpu_graphs":
        return None if cpu else dict(device=one, **kv)
    threads = {"cpu_threads": 1} if cpu else {}  # CPU: a thread per process, cores = stages
    if config == "one_gpu_eager":
        return dict(device=one, enforce_eager=True, **kv, **threads)
    if config in ("nccl", "host", "nccl_mb2", "host_mb2", "host_eager"):
        if (cpu or a.one_gpu) and config.startswith("nccl"):
            return None  # NCCL needs a GPU per stage
        return dict(devices=two, stage_transport=config.split("_")[0], **kv, **threads,
                    **({"stage_micro_batches": 2} if config.endswith("_mb2") else {}),
                    **({"enforce_eager": True} if config.endswith("_eager") else {}))
    if config == "capped":
        if cpu or a.one_gpu or shape != "llama-3.1-8b":
            return None
        total = torch.cuda.get_device_properties(0).total_memory
        return dict(devices=two, gpu_memory_utilization=round(
            CAP_OF_WEIGHTS * weight_bytes(shape) / total, 4))
    raise ValueError(f"unknown configuration {config!r}")


def run_config(spec: dict, limit_s: float) -> dict:
    """One configuration in a subprocess (its own session, killed whole on timeout)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"timed out after {limit_s:.0f} s", "stderr_tail": err[-1500:]}
    lines = [s for s in out.splitlines() if s.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT):])
    return {"error": f"exit code {proc.returncode}, no result", "stderr_tail": err[-1500:]}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'shape':<20} {'type':<5} {'config':<15} {'load s':>7} {'batch-1 tok/s':>14} "
          f"{'concurrent tok/s':>16} {'blocks':>7}  error")
    for r in rows:
        print(f"{r['shape']:<20} {r['type']:<5} {r['config']:<15} {r.get('load_s', ''):>7} "
              f"{r.get('batch1_tok_s', ''):>14} {r.get('concurrent_tok_s', ''):>16} "
              f"{r.get('num_blocks', ''):>7}  {str(r.get('error', ''))[:100]}")


def main(a) -> None:
    deadline = time.monotonic() + a.budget_s
    results = {"env": env_info(), "args": vars(a), "rows": []}
    if a.device == "cuda":
        results["gpus"] = [{"name": torch.cuda.get_device_name(i), "total_bytes":
                            torch.cuda.get_device_properties(i).total_memory}
                           for i in range(torch.cuda.device_count())]
    path = os.path.join(a.out, "stages_bench_one_gpu.json" if a.one_gpu else "stages_bench.json")
    for shape in a.shapes.split(","):
        nbytes = weight_bytes(shape)
        t = time.perf_counter()
        try:
            folder = write_checkpoint(shape, scratch_root(nbytes), a.device)
        except Exception as e:
            results["rows"].append({"shape": shape, "type": "-", "config": "checkpoint",
                                    "error": repr(e)[:500]})
            continue
        results.setdefault("checkpoint_write_s", {})[shape] = round(time.perf_counter() - t, 1)
        try:
            for kind in a.types.split(","):
                for config in a.configs.split(","):
                    row = {"shape": shape, "type": kind, "config": config,
                           "weight_bytes": nbytes}
                    options = engine_options(config, shape, a)
                    left = deadline - time.monotonic()
                    if options is None:
                        row["error"] = "not applicable"
                    elif left < 30:
                        row["error"] = f"skipped: the {a.budget_s} s budget is spent"
                    else:
                        if kind != "bf16":
                            options["quantization"] = kind
                        spec = {"model": folder, "options": options, "prompt": a.prompt,
                                "dtype": "bfloat16" if a.device == "cuda" else "float32",
                                "new": a.new, "concurrent": a.concurrent}
                        row.update(options=options, **run_config(spec, min(a.limit_s, left)))
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    write_json(path, results)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    write_json(path, results)
    print_table(results["rows"])


# the child: one configuration ----------------------------------------------------------------

def decode_tps(engine, prompt: int, new: int, batch: int) -> float:
    """Decode tok/s of `batch` requests of `prompt` random tokens after their prefill (steps
    until every request has its first token are not timed)."""
    from luceio import SamplingParams
    vocab = engine.runner.cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(None, torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                          for r in engine.scheduler.running):
        engine.step()
    sync()
    t, n0 = time.perf_counter(), engine.counters["generation_tokens"]
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return (engine.counters["generation_tokens"] - n0) / (time.perf_counter() - t)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child(spec: dict) -> None:
    from luceio import EngineArgs, LLMEngine
    from luceio.stages.timing import ENV as timing_env
    o = spec["options"]
    args = EngineArgs(model=spec["model"], dtype=spec["dtype"],
                      max_model_len=spec["prompt"] + spec["new"] + 64,
                      max_num_seqs=spec["concurrent"], max_num_batched_tokens=8192, **o)
    out: dict = {}
    timing = tempfile.mkdtemp(prefix="stage_timing")
    os.environ[timing_env] = os.path.join(timing, "t")  # the stages' phases (stages/timing.py)
    t = time.perf_counter()
    try:
        engine = LLMEngine(args)
    except Exception as e:
        print(RESULT + json.dumps({"error": repr(e)[:500]}), flush=True)
        return
    try:
        out["load_s"] = round(time.perf_counter() - t, 1)
        out["num_blocks"] = engine.runner.num_blocks
        out["graphs"] = engine.runner.graphs is not None
        out["stage_graphs"] = getattr(engine.runner, "stage_graphs", None) is not None
        if engine.stages is not None:
            out["transport"] = engine.stages.transport
            out["layer_ranges"] = [list(r) for r in engine.stages.plan.layer_ranges]
        decode_tps(engine, spec["prompt"], 8, 1)  # warm-up: first launches, Triton's cache
        out["batch1_tok_s"] = round(decode_tps(engine, spec["prompt"], spec["new"], 1), 1)
        out["concurrent"] = spec["concurrent"]
        out["concurrent_tok_s"] = round(decode_tps(engine, spec["prompt"], spec["new"],
                                                   spec["concurrent"]), 1)
        out["preemptions"] = engine.scheduler.num_preemptions
        if torch.cuda.is_available():
            out["max_allocated_gib_cuda0"] = round(torch.cuda.max_memory_allocated(0) / 2**30, 2)
    except Exception as e:  # the numbers so far still count
        out["error"] = repr(e)[:500]
    finally:
        engine.close()
    for name in sorted(os.listdir(timing)):  # written as each stage ended
        with open(os.path.join(timing, name)) as f:
            out.setdefault("stage_timing", {})[name.split(".")[1]] = json.load(f)
    shutil.rmtree(timing, ignore_errors=True)
    print(RESULT + json.dumps(out), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen2.5-coder-1.5b,llama-3.1-8b")
    p.add_argument("--types", default="bf16", help="bf16 and/or int4 (--quantization int4)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="64 new tokens instead of 128")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=None, help="new tokens (default 128, quick 64)")
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=8, help="KV budget of the uncapped runs")
    p.add_argument("--limit-s", type=float, default=150, help="per configuration")
    p.add_argument("--budget-s", type=float, default=450, help="the whole run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--one-gpu", action="store_true",
                   help="both stages on cuda:0 (two processes, host transport): a batch-1 step "
                        "is the same serial sum of stages and transfers as on two GPUs")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "h200x2"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.new is None:
        a.new = 64 if a.quick else 128
    return a


if __name__ == "__main__":
    a = parse_args()
    if a.child is not None:
        child(json.loads(a.child))
    elif a.device == "cuda" and torch.cuda.device_count() < (1 if a.one_gpu else 2):
        sys.exit(f"stages_bench: needs two GPUs (or --one-gpu); PyTorch sees {torch.cuda.device_count()}")
    else:
        main(a)
