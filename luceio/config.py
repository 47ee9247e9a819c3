"""Engine configuration: frozen dataclasses, one per subsystem, built from one `EngineArgs`.

Each `EngineArgs` field's `help` metadata becomes the CLI help of its `--flag`, so the server,
`LLM(...)` keyword arguments and `AsyncEngine.from_engine_args` share one source of truth.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch


# CPU KV cache default (--kv-cache-memory 0); see runner.py
CPU_KV_TOKENS = 8192  # room for this many tokens (or one --max-model-len sequence, if longer)
CPU_KV_MAX_FRACTION = 0.5  # of the memory available once the weights are loaded
MIN_FITTED_CONTEXT = 256  # without --max-model-len, the shortest context the KV cache may cap to


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    seed: int


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int | None  # None: size from memory
    kv_cache_memory: int  # bytes, CPU budget or explicit GPU budget (0 = use fraction)
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    resident_tokens: int | None = None  # bounded residency: a request's device KV cap
    resident_policy: str = "keys"
    kv_dtype: str = "auto"  # --kv-cache-dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_queued_requests: int
    preemption_mode: str = "recompute"


@dataclass(frozen=True)
class ExpertOffloadConfig:
    memory: int | float  # device bytes for the experts (int), or a fraction of all of them (float)
    placement: str | None  # `luceio calibrate-experts` file: experts kept on the device for good


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None
    draft_model: str | None
    num_speculative_tokens: int


class CliArgs:
    """Mixin for frozen dataclasses whose fields are command-line options."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for f in dataclasses.fields(cls):
            add_field_arg(parser, f)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace):
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class EngineArgs(CliArgs):
    model: str | None = _opt(None, "HF checkpoint folder, .gguf file, or short name "
                             "(smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b); "
                             "default smollm2-135m")
    dtype: str = _opt("auto", "weights and activations: auto (bf16 on GPU, fp32 on CPU), "
                      "float32, float16, bfloat16", choices=["auto", "float32", "float16", "bfloat16"])
    device: str = _opt("auto", "auto (the GPU when torch sees one, else cpu), cpu, cuda, cuda:N")
    devices: str | None = _opt(None, "pipeline stages: comma-separated devices, one stage and "
                               "one process each, in layer order (cuda:0,cpu; cpu,cpu); the "
                               "first runs the engine. Eager only; no swap preemption, bounded "
                               "residency, tree or draft-model speculation, speculative "
                               "prefill. Default: one stage on --device")
    layer_split: str = _opt("auto", "decoder layers per stage with --devices: auto (as even as "
                            "possible, the later stages taking the remainder) or N1,N2,... "
                            "(one positive count per stage, summing to the model's layers)")
    dist_init: str | None = _opt(None, "torch.distributed rendezvous of the stages, "
                                 "tcp://HOST:PORT, where the engine (rank 0) listens; default "
                                 "a free localhost port chosen by the engine")
    world_size: int | None = _opt(None, "pipeline stages on several machines: the number of "
                                  "stages (--devices' entries). The engine (--rank 0) then "
                                  "spawns none: start each other stage by hand with `luceio "
                                  "stage` and the same flags but its --rank; needs --dist-init. "
                                  "Default: the engine spawns the stages on its machine")
    rank: int = _opt(0, "with --world-size: this process's stage, 0 for the engine "
                     "(`luceio serve`, LLM), 1 to W-1 for `luceio stage`")
    stage_join_timeout: int = _opt(300, "seconds every process waits for the others to join "
                                   "--dist-init before it gives up")
    stage_micro_batches: int = _opt(1, "pipeline stages: cut each step's requests into up to "
                                    "this many micro-batches, so that a stage runs one while "
                                    "the one before it computes the next (1: whole steps)")
    stage_transport: str = _opt("auto", "how hidden states cross the stage boundaries: nccl "
                                "(device to device; every stage a CUDA device of its own, one "
                                "vendor's PyTorch in every process), host (Gloo through pinned "
                                "host memory; any devices, vendors and machines) or auto (nccl "
                                "where it can serve, else host)",
                                choices=["auto", "host", "nccl"])
    quantization: str = _opt("auto", "weights: auto (a GGUF keeps its 4/5/6/8-bit types, "
                             "read by luceio's quantized kernels; safetensors stay as stored), "
                             "none (dequantize a GGUF at load), int8 / int4 (quantize a 16-bit "
                             "checkpoint's layer weights at load: round-to-nearest in groups of "
                             "32, int8 symmetric, int4 with a per-group minimum)",
                             choices=["auto", "none", "int8", "int4"])
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens; default the "
                                     "model's own context length, shortened to what the KV "
                                     "cache holds when that is less (logged; at least "
                                     f"{MIN_FITTED_CONTEXT})")
    seed: int = _opt(0, "seed for requests that set none")
    cpu_threads: int | None = _opt(None, "torch threads on CPU; default: cores - 1, leaving one "
                                   "for the event loop (oversubscribed threads slow small "
                                   "matmuls by an order of magnitude)")
    cpu_activations: str = _opt("auto", "how the CPU's quantized matrix-vector kernels round "
                                "their activations: int16 (~2e-5 relative), int8 (AVX-512 "
                                "VNNI or AVX2; ~1e-2, as llama.cpp; faster), auto = int8 where "
                                "the CPU has either, else int16",
                                choices=["auto", "int16", "int8"])
    block_size: int = _opt(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _opt(None, "fixed number of KV blocks (overrides memory sizing)")
    kv_cache_memory: int = _opt(0, "bytes for the KV cache; 0 = on GPU what "
                                "--gpu-memory-utilization leaves after the weights; on CPU room "
                                f"for {CPU_KV_TOKENS} tokens (or one --max-model-len sequence, "
                                f"if longer), at most {CPU_KV_MAX_FRACTION:g} of the memory "
                                "available after loading the weights")
    kv_cache_dtype: str = _opt("auto", "dtype of the KV cache: auto (the model's: fp32 on the "
                               "CPU) or bfloat16 (on the CPU half the bytes a decode step reads "
                               "at long contexts and half the memory, keys and values rounded to "
                               "bf16 as a bf16 model's GPU cache holds them; on GPUs only for "
                               "bf16 models, where it is the default)",
                               choices=["auto", "bfloat16"])
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory the engine may use")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    max_num_seqs: int = _opt(128, "most requests running at once")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (long prompts are "
                                       "prefilled in chunks of at most this)")
    max_queued_requests: int = _opt(1024, "most requests waiting; more are refused")
    preemption_mode: str = _opt("recompute", "when KV blocks run out, the newest request is "
                                "preempted: recompute (free its blocks, prefill again later) or "
                                "swap (copy its blocks to host memory and back; no recompute)",
                                choices=["recompute", "swap"])
    enforce_eager: bool = _opt(False, "never capture CUDA graphs")
    expert_memory: str | None = _opt(None, "mixture-of-experts models: device memory for the "
                                     "experts' weights, in bytes (suffixes K, M, G, T: powers "
                                     "of 1024) or as a fraction of all experts' bytes (0.6; a "
                                     "decimal point makes it a fraction), split evenly over "
                                     "the sparse layers (a GGUF's quantized experts count at "
                                     "their quantized size; offloading them needs a GPU); the "
                                     "rest wait in (pinned) host memory; on GPUs a step reads "
                                     "them there in place and they are copied into the layer's "
                                     "device slots between steps (LRU), so decode steps keep "
                                     "their CUDA graphs. "
                                     "Default: every expert on the device")
    expert_placement: str | None = _opt(None, "with --expert-memory: a placement file from "
                                        "`luceio calibrate-experts`; each layer's most-used "
                                        "experts keep device slots for good (at most half its "
                                        "slots, and all but top-k; the rest stay the LRU "
                                        "cache). Default: every slot is LRU")
    speculative_method: str | None = _opt(None, "speculative decoding: ngram or draft (default off)",
                                          choices=["ngram", "draft"])
    draft_model: str | None = _opt(None, "draft model for --speculative-method draft")
    draft_device: str | None = _opt(None, "device of the draft model, in the engine's process "
                                    "(default: the engine's device; with --devices, the first "
                                    "stage's), e.g. the GPU of another stage")
    num_speculative_tokens: int = _opt(4, "most draft tokens proposed per request per step")
    spec_tree_budget: int = _opt(0, "tree speculation: verify a tree of up to this many draft "
                                 "nodes, --num-speculative-tokens levels deep, in one target "
                                 "forward (0: one chain; at most 63; such steps run without "
                                 "CUDA graphs). n-gram: the continuations of every earlier "
                                 "occurrence of the context's suffix; draft model: per level "
                                 "the --spec-tree-topk likeliest children of the --spec-tree-topk "
                                 "likeliest paths, then the N likeliest nodes")
    spec_tree_topk: int = _opt(2, "tree speculation with a draft model: children per expanded "
                               "node (the draft's most probable next tokens), and nodes "
                               "expanded per level")
    spec_draft_window: int = _opt(0, "draft model: a request whose prompt would leave the "
                                  "draft more than N tokens to read is read as its first KV "
                                  "block and its last N tokens only (a shorter draft prefill "
                                  "for long prompts; drafts that need older context are "
                                  "accepted less often; output unchanged). 0: the whole prompt")
    spec_prefill_keep: float | None = _opt(None, "speculative prefill: for prompts of at least "
                                           "--spec-prefill-min-tokens, the draft model scores the "
                                           "prompt and the target prefills only this fraction of "
                                           "it (needs --draft-model; inexact by design; default off)")
    spec_prefill_min_tokens: int = _opt(1024, "shortest prompt that speculative prefill shortens")
    kv_resident_tokens: int | None = _opt(None, "bounded KV residency: each request keeps at most "
                                          "this many tokens of KV on the device; colder blocks "
                                          "wait in host memory and attention skips them (inexact "
                                          "once a request outgrows it; default off)")
    kv_resident_policy: str = _opt("keys", "which blocks stay resident: keys (the target's "
                                   "pooled keys vs its latest query), spec (the draft model's "
                                   "prompt scores; needs --draft-model) or recency",
                                   choices=["keys", "spec", "recency"])
    kv_rescore_interval: int = _opt(16, "keys policy: decode steps between re-scorings")
    async_scheduling: bool | None = _opt(None, "overlapped scheduling: the host schedules and "
                                         "builds step N+1 while the device runs step N (sampled "
                                         "tokens stay on the device and feed the next step's "
                                         "inputs there); steps whose next step needs the tokens "
                                         "on the host (speculation, structured output, a KV pool "
                                         "about to preempt, bounded residency) run synchronously. "
                                         "Default: on for GPUs, off on the CPU, where the host "
                                         "runs the step itself and there is nothing to overlap")

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}[self.dtype]

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        return device.type != "cpu" if self.async_scheduling is None else self.async_scheduling

    def resolved_device(self) -> torch.device:
        if self.devices:  # the engine's process runs the first stage
            return torch.device(self.devices.split(",")[0].strip())
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_draft_device(self) -> torch.device:
        """Where the draft model runs: --draft-device, else the engine's own device."""
        if self.draft_device is None:
            return self.resolved_device()
        if not self.draft_model:
            raise ValueError("--draft-device needs --draft-model")
        return torch.device(self.draft_device)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                               self.max_queued_requests, self.preemption_mode)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory,
                           self.gpu_memory_utilization, self.enable_prefix_caching,
                           self.kv_resident_tokens, self.kv_resident_policy,
                           self.kv_cache_dtype)

    def residency_config(self):
        if not self.kv_resident_tokens:
            return None
        from .cache.residency import ResidencyConfig
        return ResidencyConfig(self.kv_resident_tokens, self.block_size, self.kv_resident_policy,
                               self.kv_rescore_interval)

    def expert_offload_config(self) -> ExpertOffloadConfig | None:
        """--expert-memory / --expert-placement, parsed; None when off. Raises ValueError."""
        if self.expert_memory is None:
            if self.expert_placement is not None:
                raise ValueError("--expert-placement applies with --expert-memory")
            return None
        if self.devices:
            raise ValueError("--expert-memory cannot be combined with --devices (pipeline "
                             "stages) yet")
        return ExpertOffloadConfig(parse_memory(self.expert_memory, "--expert-memory"),
                                   self.expert_placement)

    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative_method, self.draft_model,
                                 self.num_speculative_tokens)


AsyncEngineArgs = EngineArgs  # vLLM's name for the async engine's arguments: one set serves both


_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_memory(value: str | int | float, flag: str) -> int | float:
    """Bytes (an int, or a string with an optional K/M/G/T suffix, `iB`/`B` allowed) or a
    fraction in (0, 1] (a float, or a string with a decimal point). Raises ValueError."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = value
    else:
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        try:
            amount = float(text) if "." in text else \
                int(text.rstrip("KMGT") or "x") * _SUFFIXES[text[len(text.rstrip("KMGT")):]]
        except (KeyError, ValueError):
            raise ValueError(f"{flag} {value!r}: give bytes (8G, 512M, 1073741824) or a "
                             "fraction of the total (0.6)") from None
    if isinstance(amount, float) and not 0 < amount <= 1:
        raise ValueError(f"{flag} {value!r}: a fraction must be in (0, 1]")
    if isinstance(amount, int) and amount <= 0:
        raise ValueError(f"{flag} {value!r}: must be positive")
    return amount


def add_field_arg(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    """One `--flag` from a dataclass field: its type, default, choices and help."""
    flag = "--" + f.name.replace("_", "-")
    meta = f.metadata
    kw = {"default": f.default, "help": meta.get("help", "")}
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    if f.type in ("bool", bool, "bool | None"):  # None: --flag / --no-flag left unsaid
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = _parse_type(str(f.type))
    parser.add_argument(flag, dest=f.name, **kw)


def _parse_type(type_str: str):
    if "int" in type_str:
        return int
    if "float" in type_str:
        return float
    return str
