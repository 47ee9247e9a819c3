"""The engine's model runner, built from `EngineArgs`: its context, speculation rows, the draft
model's share of the KV pool and the experts' offload."""
from __future__ import annotations

from .config import EngineArgs
from .memory import kv_bytes_per_block, kv_dtype
from .models import context_limit
from .runner import ModelRunner


def build_runner(args: EngineArgs, ckpt, model, dtype, device, draft, stages) -> ModelRunner:
    """The target's runner; `draft`: the draft model (or None), whose KV blocks share the pool's
    memory when it runs on the same device; `stages`: the pipeline stage group, or None."""
    return ModelRunner(ckpt, dtype, device, args.cache_config(),
                       context_limit(ckpt, model, args.max_model_len), model=model,
                       enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                       quantization=args.quantization,
                       fit_context=args.max_model_len is None,
                       max_spec_tokens=args.num_speculative_tokens
                       if args.speculative_method else 0,
                       tree_rows=args.spec_tree_budget + 1
                       if args.speculative_method and args.spec_tree_budget else 0,
                       extra_bytes_per_block=kv_bytes_per_block(
                           draft.cfg, args.block_size, kv_dtype(args.kv_cache_dtype, dtype, device))
                       if draft is not None and args.speculative_method == "draft" and
                       args.resolved_draft_device() == device else 0,
                       stages=stages,
                       expert_offload=args.expert_offload_config())
