"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, and the
engine-side planner/verifier."""
from __future__ import annotations

from .decoding import SpecDecoder, SpecStats
from .ngram import NgramProposer
from .proposer import Proposal, ProposalInput, Proposer
from .rejection import rejection_sample, rejection_sample_batch

__all__ = ["SpecDecoder", "SpecStats", "NgramProposer", "Proposal", "ProposalInput", "Proposer",
           "rejection_sample", "rejection_sample_batch", "build_spec_decoder", "build_spec_prefill",
           "build_draft_model"]


def build_draft_model(args, dtype, device):
    """The `--draft-model` (None without one), on `--draft-device` (default: `device`, the
    engine's). On another device than the target's it drafts there and only its drafts (host
    lists) and, for sampled requests, their probabilities (moved) cross over; speculative
    prefill and the draft-scored KV residency, which hand the target's tensors to the draft
    model, need it on the target's device."""
    from ..loader import load_checkpoint
    from ..loader.resolve import model_path
    from ..models import build_model
    draft_device = args.resolved_draft_device()
    if not args.draft_model:
        return None
    shares_target_tensors = args.spec_prefill_keep is not None or \
        args.kv_resident_policy == "spec"
    if draft_device != device and shares_target_tensors:
        raise ValueError(f"--draft-device {draft_device} differs from the engine's device "
                         f"({device}): --spec-prefill-keep and --kv-resident-policy spec need "
                         "the draft model on the engine's device")
    draft = build_model(load_checkpoint(model_path(args.draft_model)), dtype, draft_device,
                        args.quantization)
    if getattr(draft, "has_state", False):  # its state would need the same rollback
        raise ValueError(f"--draft-model: {draft.family} (hybrid linear-attention) "
                         "models cannot draft")
    return draft


def build_spec_decoder(args, target_runner, sampler, max_model_len: int,
                       draft_model=None) -> SpecDecoder | None:
    method = args.speculative_method
    if method is None:
        if args.spec_tree_budget:
            raise ValueError("--spec-tree-budget needs --speculative-method ngram or draft")
        return None
    if not 0 <= args.spec_tree_budget < 64:
        raise ValueError(f"--spec-tree-budget is 0 (chains) to 63 nodes, got "
                         f"{args.spec_tree_budget}")
    if args.spec_tree_topk < 1:
        raise ValueError(f"--spec-tree-topk must be >= 1, got {args.spec_tree_topk}")
    if args.spec_draft_window < 0 or (args.spec_draft_window and method != "draft"):
        raise ValueError(f"--spec-draft-window is >= 0 and only for --speculative-method draft, "
                         f"got {args.spec_draft_window} with {method}")
    if method == "ngram":
        proposer = NgramProposer(tree_budget=args.spec_tree_budget)
        proposer.warmup()
    elif method == "draft":
        proposer = _draft_proposer(args, target_runner, max_model_len, draft_model, sampler)
    else:
        raise ValueError(f"unknown speculative method {method!r} (ngram or draft)")
    return SpecDecoder(method, args.num_speculative_tokens, proposer, sampler,
                       tree_budget=args.spec_tree_budget)


def _draft_proposer(args, target_runner, max_model_len: int, draft_model, sampler):
    from ..config import CacheConfig
    from ..runner import ModelRunner
    from .draft import DraftModelProposer
    if draft_model is None:
        raise ValueError("--speculative-method draft needs --draft-model")
    check_draft_vocab(args, draft_model.cfg.vocab_size, target_runner.cfg.vocab_size)
    # as many blocks as the target: the target's cache was sized to leave room for them
    cache = CacheConfig(args.block_size, target_runner.num_blocks, 0, 0.0, False,
                        kv_dtype=args.kv_cache_dtype)
    runner = ModelRunner(None, target_runner.dtype, args.resolved_draft_device(), cache,
                         max_model_len,
                         model=draft_model, enforce_eager=args.enforce_eager,
                         max_num_seqs=args.max_num_seqs, max_spec_tokens=1,
                         tree_rows=_draft_tree_rows(args))
    return DraftModelProposer(runner, args.block_size, sampler, args.spec_tree_budget,
                              args.spec_tree_topk, max_chain=args.num_speculative_tokens,
                              target_vocab=target_runner.cfg.vocab_size,
                              window=args.spec_draft_window)


MAX_VOCAB_PADDING = 256


def check_draft_vocab(args, draft_vocab: int, target_vocab: int) -> None:
    """A draft model must share the target's tokenizer; its embedding may have fewer padding
    rows past the tokenizer's ids (Qwen2.5: 151,936 rows up to 3B, 152,064 from 7B, one
    tokenizer of 151,665 ids), at most MAX_VOCAB_PADDING fewer. The proposer then feeds it id
    0 for target ids it has no row for and pads its distributions with zeros
    (`DraftModelProposer`), so verification stays exact. Refused: a larger draft vocabulary
    (drafts the target could not score), a much smaller one (another tokenizer), and a shorter
    one with speculative prefill or the draft-scored KV residency, which feed the draft the
    prompt's ids as they are."""
    if draft_vocab == target_vocab:
        return
    short = target_vocab - draft_vocab
    if short < 0 or short > MAX_VOCAB_PADDING:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is not the target's "
                         f"({target_vocab}) or at most {MAX_VOCAB_PADDING} padding rows "
                         "shorter; they must share a tokenizer")
    if args.spec_prefill_keep is not None or args.kv_resident_policy == "spec":
        raise ValueError(f"--spec-prefill-keep and --kv-resident-policy spec need a draft model "
                         f"with the target's vocabulary size ({target_vocab}); this one has "
                         f"{draft_vocab}")


def _draft_tree_rows(args) -> int:
    """Rows of the draft model's largest tree level (`DraftModelProposer.propose_trees`): the
    root and the nodes before the last level, topk + topk^2 per level after the first."""
    if not args.spec_tree_budget:
        return 0
    k, topk = args.num_speculative_tokens, args.spec_tree_topk
    return min(1 + topk + max(k - 2, 0) * topk * topk, 64)


def build_spec_prefill(args, target_runner, draft_model, max_model_len: int):
    """The speculative-prefill scorer, with its own small KV cache (it runs on the worker
    thread beside the draft proposer, so it shares the draft's weights but not its blocks)."""
    if draft_model is None:
        if args.spec_prefill_keep is not None:
            raise ValueError("--spec-prefill-keep needs --draft-model")
        return None
    from ..cache import KVCacheManager
    from ..config import CacheConfig
    from ..runner import ModelRunner
    from .prefill import SpecPrefill
    blocks = -(-max_model_len // args.block_size) + 1
    runner = ModelRunner(None, target_runner.dtype, target_runner.device,
                         CacheConfig(args.block_size, blocks, 0, 0.0, False), max_model_len,
                         model=draft_model, enforce_eager=True)
    # scoring chunks as long as the engine's step budget: fewer, fuller forwards
    return SpecPrefill(runner, KVCacheManager(blocks, args.block_size, False),
                       chunk=max(2048, args.max_num_batched_tokens))
