"""Helpers shared by the benchmarks: random-weight models at real shapes, the copy-bandwidth
roofline, and result files."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import time

import torch

# HF config.json fields of the shapes we measure (random weights: only shapes matter for speed)
SHAPES = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         rms_norm_eps=1e-5),
    "qwen2.5-coder-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                               hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                               rope_theta=1000000.0, max_position_embeddings=32768,
                               tie_word_embeddings=True, rms_norm_eps=1e-6),
    "qwen2.5-coder-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                               hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                               rope_theta=1000000.0, max_position_embeddings=32768,
                               tie_word_embeddings=True, rms_norm_eps=1e-6),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         rms_norm_eps=1e-5),
    # the tests' tiny model: a step is almost all host work, so per-step overheads show in full
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384, rope_theta=10000.0,
                 max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def random_model(shape: str, dtype=torch.bfloat16, device="cuda", max_positions: int | None = None):
    """A luceio model with random weights at a real shape, built directly on the device."""
    from luceio.models import LlamaConfig, LlamaForCausalLM
    cfg_dict = dict(SHAPES[shape])
    if max_positions:
        cfg_dict["max_position_embeddings"] = max_positions
    cfg = LlamaConfig.from_hf(cfg_dict)
    bias = cfg_dict["model_type"] == "qwen2"
    with torch.device(device):
        model = LlamaForCausalLM(cfg, bias=bias).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    model.cos_sin = model.cos_sin.float()
    return model


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every weight (quantized ones at their packed size)
    except the embedding table (one row is gathered), but the LM head (tied or not) is read
    whole."""
    total = model.weight_bytes()
    if model.cfg.tie_word_embeddings:
        return total  # the shared matrix is read by the LM head
    return total - model.embed_tokens.weight_bytes()


def kv_bytes_per_token(model, context: int, dtype=torch.bfloat16) -> int:
    c = model.cfg
    return 2 * c.num_layers * context * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=dtype).element_size()


def copy_bandwidth(device="cuda", nbytes=2 << 30, iters=20) -> float:
    """Bytes/s moved by a device-to-device copy (read + write)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * iters / (time.perf_counter() - t)


def env_info() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cuda_median_ms(fn, repeats: int = 20) -> float:
    """The median of `repeats` timings of fn() in ms, each between two CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cpu_median_ms(fn, repeats: int = 20) -> float:
    """The median of `repeats` wall-clock timings of fn() in ms, after one call to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


def run_sections(todo: list, results: dict, path: str) -> None:
    """Runs (name, fn) sections in order: a failing section is recorded in `results["errors"]`
    and the others still run; the JSON is rewritten after each."""
    import traceback
    for name, fn in todo:
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            results.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            traceback.print_exc()
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
        write_json(path, results)


def timed_decode(engine) -> tuple[int, float]:
    """Steps an engine whose requests were just added: the first step (prefill and first token)
    untimed, then the rest; returns (timed steps, their seconds)."""
    engine.step()
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t


@contextlib.contextmanager
def source_trees(repo: str, baseline: str | None, tmp: str):
    """{name: source root}: this tree, and with `baseline` (a git revision) a temporary worktree
    of it under `tmp` first, removed on exit. A measurement runs each root's code by starting
    a process with cwd and PYTHONPATH at that root."""
    trees = {"this tree": repo}
    if baseline:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", base, baseline], cwd=repo,
                       check=True, capture_output=True)
        trees = {f"baseline {baseline}": base, **trees}
    try:
        yield trees
    finally:
        if baseline:
            subprocess.run(["git", "worktree", "remove", "--force", trees[f"baseline {baseline}"]],
                           cwd=repo, capture_output=True)
