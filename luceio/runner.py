"""ModelRunner: owns the model and its KV cache; turns a `SchedulerOutput` into one flat varlen
batch, runs the forward, and returns logits for the rows that need them.

KV cache sizing: `--num-kv-blocks` fixes the pool; else `--kv-cache-memory` bytes; else on GPU
what `--gpu-memory-utilization` leaves, and on CPU room for `CPU_KV_TOKENS` tokens (or one
`--max-model-len` sequence, if longer), at most `CPU_KV_MAX_FRACTION` of the memory available
once the weights are loaded. A pool sized from memory must hold one full-context sequence: given
`--max-model-len`, a smaller pool is an error; without it the context shrinks to what the pool
holds (logged), down to `MIN_FITTED_CONTEXT` tokens."""
from __future__ import annotations

import contextlib
import itertools
import logging

import numpy as np
import psutil
import torch

from .config import CPU_KV_MAX_FRACTION, CPU_KV_TOKENS, MIN_FITTED_CONTEXT, CacheConfig, \
    ExpertOffloadConfig
from .loader import Checkpoint
from .models import AttnMetadata, build_model
from .models.cpu_decode import CpuDecoder
from .models.expert_offload import ExpertOffload
from .models.hybrid_verify import KeptStates
from .models.moe import routes_on_host
from .cache.host_store import HostKVStore, QueryProbe
from .memory import (Staging, StateSlots, keep_freed_heap, kv_bytes_per_block, kv_dtype,
                     return_freed_heap, zeros_pool)
from .scheduler import SchedulerOutput
from .step_inputs import DeviceTokenIds, HostBatch, StepInputs, in_inference_mode  # noqa: F401

logger = logging.getLogger("luceio")


class ModelRunner:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 cache_config: CacheConfig, max_model_len: int, model=None,
                 enforce_eager: bool = False, max_num_seqs: int = 128, max_spec_tokens: int = 0,
                 extra_bytes_per_block: int = 0, quantization: str = "auto",
                 fit_context: bool = False, tree_rows: int = 0, stages=None,
                 expert_offload: ExpertOffloadConfig | None = None):
        """`max_model_len`: the context wanted; with `fit_context` (none was asked for) it
        shrinks to what a memory-sized KV pool holds. The context used: `self.max_model_len`.
        `tree_rows`: rows of the largest tree-speculation step (its own CUDA graphs).
        `stages`: a `stages.StageGroup`: this runner holds stage 0's layers and their KV, and
        every forward goes through the group (no CPU decode path; on GPUs, decode steps replay
        CUDA graphs of each stage's layers, `stages/graphs.py`). Its pool is sized as
        if it held every layer, and the other stages allocate as many blocks.
        `expert_offload`: --expert-memory's experts in host memory (`models/expert_offload.py`;
        on GPUs the steps read them in place and replay CUDA graphs, `expert_tables.py`; on
        the CPU it runs in rounds); its counters are `self.expert_offload.stats()`."""
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_dtype(cache_config.kv_dtype, dtype, device)
        if stages is not None and self.kv_dtype != dtype:
            raise ValueError("--kv-cache-dtype applies without --devices (pipeline stages) yet")
        if expert_offload is not None and model is not None:
            raise ValueError("--expert-memory applies when the engine loads the model itself")
        self.expert_offload = ExpertOffload(expert_offload) if expert_offload else None
        self.model = model if model is not None else build_model(ckpt, dtype, device,
                                                                 quantization, self.expert_offload)
        in_place = self.expert_offload is not None and self.expert_offload.start(device)
        self.cfg = self.model.cfg
        self.block_size = cache_config.block_size
        # hybrid models (Qwen3.5): a state slot per running request, before the KV pool's sizing
        self.stateful = getattr(self.model, "has_state", False)
        if self.stateful:
            self.state_slots = StateSlots(max_num_seqs)
            # one more row: the scratch slot that CUDA graphs' padded requests use
            self.model.allocate_state(max_num_seqs + 1, dtype, device)
            logger.info("%s state: %d slots (--max-num-seqs), %.1f MiB", self.model.family,
                        max_num_seqs, max_num_seqs * self.model.state_bytes_per_slot(dtype) / 2**20)
        # a draft model's cache gets as many blocks: size both from one budget
        self.extra_bytes_per_block = extra_bytes_per_block
        self.num_blocks, self.max_model_len = self._num_blocks(cache_config, max_model_len,
                                                               fit_context)
        shape = (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.stages = stages  # one [2, ...] tensor per layer: kv[0] keys, kv[1] values
        end = stages.layer_range[1] if stages is not None else self.cfg.num_kv_layers
        per_layer = self.cfg.kv_layer_shapes if stages is None else None
        if per_layer is None:
            self.kv_pool = zeros_pool((end, 2, *shape), self.kv_dtype, device)
            # indexed by layer: the layers of later stages have no cache here
            self.kv_caches = list(self.kv_pool) + [None] * (self.cfg.num_layers - end)
        else:  # layers of different shapes (Gemma 4): a tensor each, the same block ids
            self.kv_pool = None
            self.kv_caches = [zeros_pool((2, *shape[:2], heads, dim), self.kv_dtype, device)
                              for heads, dim in per_layer]
        self.staging = Staging(device)
        self.stage_graphs = None  # pipeline stages: CUDA graphs of stage 0's layers
        if stages is not None:
            from .stages.graphs import StageGraphs, wanted
            graphed = wanted(device, enforce_eager, self.stateful, self.kv_caches[0],
                             stages.micro_batches)
            stages.connect(self.model, ckpt.config, self.num_blocks, self.block_size,
                           dict(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
                           if graphed else None)
            if graphed:
                self.stage_graphs = StageGraphs(
                    self.model, self.kv_caches, stages.layer_range, True, max_num_seqs,
                    self.max_model_len, self.block_size, device, dtype, self.staging)
                self.stage_graphs.capture()
        # host copies of KV blocks (bounded residency, swap preemption): the engine applies
        # each step's `KVMoves` here before its forward; pooled keys for the keys policy only
        self.host_store = HostKVStore(self.kv_caches, device, pool_keys=bool(
            cache_config.resident_tokens) and cache_config.resident_policy == "keys")
        self.graphs = None
        self.cpu_decoder = None
        if device.type == "cpu" and CpuDecoder.supports(dtype) and not self.stateful:
            self.cpu_decoder = CpuDecoder(self.model, self.kv_caches) if stages is None else \
                CpuDecoder.for_stage(self.model, self.kv_caches, stages.layer_range)
        if device.type == "cpu":
            return_freed_heap()
            keep_freed_heap()  # steps reuse their activations' pages: no page faults
        offloaded = (self.expert_offload is not None and self.expert_offload.active
                     and not in_place) or routes_on_host(self.model)  # routing on the host
        if offloaded and device.type == "cuda":
            logger.info("the experts' routing is read on the host: no CUDA graphs")
        if device.type == "cuda" and not enforce_eager and stages is None and not offloaded:
            from . import kernels
            from .cuda_graphs import StepGraphs
            if kernels.use_triton(self.kv_caches[0]):  # graphs need the static-shape kernels
                verify = 0 if self.stateful else max_spec_tokens  # hybrid: eager verify steps
                self.graphs = StepGraphs(self.model, self.kv_caches, max_num_seqs,
                                         self.max_model_len, self.block_size, device,
                                         verify, self.staging, capture_queries=bool(
                                             cache_config.resident_tokens) and
                                         cache_config.resident_policy == "keys",
                                         tree_rows=tree_rows,
                                         scratch_slot=max_num_seqs if self.stateful else None)
                self.graphs.capture()
                if in_place:  # the capture's warm-up runs counted experts
                    self.expert_offload.tables.reset_counts()

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.cfg, self.block_size, self.kv_dtype)

    @property
    def pool_bytes_per_block(self) -> int:
        """One block in the target's cache and in a draft model's."""
        return self.bytes_per_block + self.extra_bytes_per_block

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.pool_bytes_per_block

    def _kv_budget(self, cc: CacheConfig, max_model_len: int, fit_context: bool) -> int:
        if cc.kv_cache_memory:
            return cc.kv_cache_memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_allocated(self.device)
            # a fixed 1 GiB of headroom for activations and the CUDA-graph pool
            return int(total * cc.gpu_memory_utilization) - used_by_others - \
                torch.cuda.memory_allocated(self.device) - (1 << 30)
        tokens = CPU_KV_TOKENS if fit_context else max(CPU_KV_TOKENS, max_model_len)
        wanted = -(-tokens // self.block_size) * self.pool_bytes_per_block
        return min(wanted, int(psutil.virtual_memory().available * CPU_KV_MAX_FRACTION))

    def _num_blocks(self, cc: CacheConfig, max_model_len: int,
                    fit_context: bool) -> tuple[int, int]:
        """(blocks in the pool, the context it allows): see the module docstring."""
        if cc.num_blocks:  # a fixed pool: requests that outgrow it are refused one by one
            return cc.num_blocks, max_model_len
        budget = self._kv_budget(cc, max_model_len, fit_context)
        n = max(budget // self.pool_bytes_per_block, 0)
        longest = max_model_len if not cc.resident_tokens else min(max_model_len, cc.resident_tokens)
        if n >= -(-longest // self.block_size) + (2 if cc.resident_tokens else 0):
            return n, max_model_len
        held = n * self.block_size
        fit = fit_context and not cc.resident_tokens  # residency: the pool does not bound it
        if fit and held >= MIN_FITTED_CONTEXT:
            logger.info("context capped to %d tokens to fit the KV cache (%d blocks, %.1f MiB); "
                        "pass --max-model-len / --kv-cache-memory to change", held, n,
                        n * self.pool_bytes_per_block / 2**20)
            return n, held
        if fit:
            raise ValueError(f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {n} blocks "
                             f"({held} tokens), fewer than the shortest context served "
                             f"({MIN_FITTED_CONTEXT} tokens); raise --kv-cache-memory")
        raise ValueError(f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {n} blocks, "
                         f"fewer than one {longest}-token sequence needs; lower "
                         f"--max-model-len or raise --kv-cache-memory")

    # batch building ----------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, kv) -> StepInputs:
        """`kv`: the KVCacheManager whose block tables the batch reads (with bounded residency,
        attention reads the resident blocks only: offloaded ones are left out of the table
        and the sequence length shortened by as much; positions stay the original ones)."""
        ids: list[int] = []
        pos: list[int] = []
        seq_lens, q_starts, tables = [], [0], []
        logits_idx: list[int] = []
        rows: dict[str, slice] = {}
        prompt_rows: dict[str, tuple[slice, int]] = {}
        device_ids: dict[str, int] = {}
        trees: list[tuple[int, object]] = []  # (flat index of the root row, its draft tree)
        prefill = False
        bs = self.block_size
        # per request, the loop below runs every step: plain rows take no method calls
        block_tables = kv.block_tables if kv.residency is None else None
        one_token_each = True  # a decode step: its slots are found without numpy
        for s in out.scheduled:
            r = s.req
            start = r.num_computed_tokens
            end = start + s.num_new_tokens
            one_token_each = one_token_each and s.num_new_tokens == 1
            n_all = len(r.all_token_ids)
            # a prompt token to compute (or an older token: a recomputed request)
            prefill = prefill or start < n_all - 1 or \
                (start == n_all - 1 and start < r.num_prompt_tokens)
            tokens = r.all_token_ids + s.spec_token_ids if s.spec_token_ids else r.all_token_ids
            base = len(ids)
            ids.extend(tokens[start:end])
            if end > len(tokens):  # its last token is still on the device (one at most)
                device_ids[r.request_id] = len(ids)
                ids.append(0)
            if s.spec_tree is not None:  # rows: the root, then the nodes at root + depth
                trees.append((base, s.spec_tree))
                root = r.positions(start, start + 1)[0]
                pos.append(root)
                pos.extend(root + d for d in s.spec_tree.depths())
            elif r.position_ids is None:
                pos.extend(range(start, end))
            else:
                pos.extend(r.positions(start, end))
            if block_tables is not None:
                table, skipped = block_tables[r.request_id], 0
            else:
                table, skipped = kv.attention_table(r.request_id)
            seq_lens.append(end - skipped)
            q_starts.append(len(ids))
            tables.append(table)
            if r.params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1 \
                    and len(r.prompt_logprobs) < r.num_prompt_tokens:
                last = min(end, r.num_prompt_tokens - 1)
                prompt_rows[r.request_id] = (slice(len(logits_idx), len(logits_idx) + last - start),
                                             start)
                logits_idx.extend(range(base, base + last - start))
            if end >= r.num_tokens_with_spec:  # the step ends at its last token: it samples
                n_rows = 1 + len(s.spec_token_ids)
                rows[r.request_id] = slice(len(logits_idx), len(logits_idx) + n_rows)
                logits_idx.extend(range(len(ids) - n_rows, len(ids)))
        if len(tables) == 1:
            bt = np.array(tables, dtype=np.int32)
        else:
            lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
            bt = np.zeros((len(tables), int(lens.max())), dtype=np.int32)
            bt[np.arange(bt.shape[1]) < lens[:, None]] = np.fromiter(
                itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
        if one_token_each:  # a sequence's only token sits at cache index seq_len - 1
            slots = np.array([t[(n - 1) // bs] * bs + (n - 1) % bs
                              for t, n in zip(tables, seq_lens)], dtype=np.int64)
        else:
            q_lens = np.diff(q_starts)
            seq_of_tok = np.repeat(np.arange(len(tables)), q_lens)
            # cache index of each token (its rotary position may differ: speculative prefill)
            cache_idx = np.asarray(seq_lens, dtype=np.int64)[seq_of_tok] - \
                np.repeat(np.asarray(q_starts[1:], dtype=np.int64), q_lens) + np.arange(len(ids))
            slots = bt[seq_of_tok, cache_idx // bs].astype(np.int64) * bs + cache_idx % bs
        host = HostBatch(np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), slots, bt,
                         np.asarray(seq_lens, dtype=np.int32), np.asarray(q_starts, dtype=np.int32),
                         np.asarray(logits_idx, dtype=np.int64))
        if trees:
            from .spec.tree import masks_tensor
            host.tree_mask = np.full(len(ids), -1, dtype=np.int64)
            for base, tree in trees:
                words = masks_tensor(tree.ancestor_masks()).numpy()
                host.tree_mask[base:base + len(words)] = words
        inp = StepInputs(host, rows, prompt_rows, device_ids, prefill=prefill)
        if self.stateful:
            host.state_slots, host.fresh_slots = self.state_slots.assign(out.scheduled, kv)
            inp.kept = KeptStates.of(out.scheduled)
        index = {s.req.request_id: i for i, s in enumerate(out.scheduled)}
        for rid in out.kv_score_ids:
            i = index[rid]
            r, n_new = out.scheduled[i].req, out.scheduled[i].num_new_tokens
            # the row of the step's last real token (drafts excluded)
            last = min(r.num_computed_tokens + n_new, r.num_tokens) - r.num_computed_tokens
            inp.score_rows[rid] = q_starts[i] + last - 1
            inp.score_tables[rid] = (list(kv.blocks_of(rid)), (r.num_computed_tokens + last) // bs)
        return inp

    # forward -----------------------------------------------------------------------------------
    @in_inference_mode
    def execute(self, inp: StepInputs, probe=None) -> torch.Tensor:
        """Returns fp32 logits [num_rows, vocab] for the batch's `logits_indices`. A `probe`
        (called per layer with the rotated queries) forces the eager path."""
        graphed = self.graphs is not None and probe is None and self.graphs.fits(inp.host)
        if inp.score_rows:
            if probe is not None:
                raise ValueError("a step cannot both score KV blocks and run another probe")
            if not graphed or self.graphs.q_buf is None:  # graphs capture queries themselves
                probe = QueryProbe(list(inp.score_rows.values()), self.device)
        if self.expert_offload is not None:
            self.expert_offload.before_step()
        logits = self._forward(inp, probe, graphed and probe is None)
        if self.expert_offload is not None:
            self.expert_offload.after_step()
        if inp.score_rows:
            inp.kv_scores = self._score_blocks(inp, probe)
        return logits

    def _score_blocks(self, inp: StepInputs, probe: QueryProbe | None) -> dict:
        """Residency `keys` policy: scores of each scored request's blocks before its tail."""
        scores = {}
        scale = self.cfg.head_dim ** -0.5
        for j, (rid, (table, num_old)) in enumerate(inp.score_tables.items()):
            q = probe.queries(j) if probe is not None else \
                self.graphs.queries(inp.host, inp.score_rows[rid])
            s = self.host_store.score(rid, table, num_old, q, scale)
            if s is not None:
                scores[rid] = s.cpu().numpy()
        return scores

    def _forward(self, inp: StepInputs, probe, graphed: bool) -> torch.Tensor:
        h = inp.host
        if graphed:
            if h.fresh_slots is not None and len(h.fresh_slots):  # a one-token prompt's step
                self.model.reset_state(torch.from_numpy(h.fresh_slots).to(self.device))
            hidden, rows, logits = self.graphs.run(h, inp.ids_from)
            if logits is not None:
                return logits[rows]
        elif self._stage_graphed(h, probe):
            # stage 0's graph is queued, then the message is packed from the host batch while
            # it runs: no inputs go to the device for eager layers, none come back
            first, rows = self.stage_graphs.run_first(h, inp.ids_from)
            meta = AttnMetadata(*(torch.from_numpy(a) for a in (
                h.slot_mapping, h.block_tables, h.seq_lens, h.query_start_loc)),
                1, int(h.seq_lens.max()))
            hidden = self.stages.forward(self.model, None, torch.from_numpy(h.positions),
                                         self.kv_caches, meta, inp.prefill, first)
        else:
            gather = [inp.ids_from.src, inp.ids_from.dst] if inp.ids_from is not None else []
            state = [h.state_slots, h.fresh_slots] if h.state_slots is not None else []
            ids, pos, slots, rows, *more = self.staging.to_device(np.int64, [
                h.input_ids, h.positions, h.slot_mapping, h.logits_indices, *state, *gather])
            state, gather = more[:len(state)], more[len(state):]
            if gather:
                ids.index_copy_(0, gather[1], inp.ids_from.token_ids[gather[0]])
            bt, seq_lens, qsl = self.staging.to_device(
                np.int32, [h.block_tables.reshape(-1), h.seq_lens, h.query_start_loc])
            meta = AttnMetadata(slots, bt.view(h.block_tables.shape), seq_lens, qsl,
                                int(h.q_lens.max()), int(h.seq_lens.max()))
            if h.tree_mask is not None:
                meta.tree_mask = torch.from_numpy(h.tree_mask).to(self.device)
            if state:  # hybrid models: the slots, and the ones to zero first
                meta.state_slots, meta.kept = state[0], inp.kept
                if len(h.fresh_slots):
                    self.model.reset_state(state[1])
            with _prefill_rows(inp.prefill and self.device.type == "cpu"):
                if self.stages is not None:
                    if probe is not None:
                        raise ValueError("pipeline stages cannot run a per-layer probe")
                    hidden = self.stages.forward(
                        self.model, ids, pos, self.kv_caches, meta, inp.prefill,
                        decoder=self.cpu_decoder if self._cpu_decode(inp, probe) else None)
                elif self._cpu_decode(inp, probe):
                    hidden = self.cpu_decoder(ids, pos, meta)
                else:
                    hidden = self.model(ids, pos, self.kv_caches, meta, probe=probe)
        return self.model.compute_logits(hidden[rows])

    def _stage_graphed(self, h: HostBatch, probe) -> bool:
        """Whether stage 0's layers replay their CUDA graph for this step (`stages/graphs.py`);
        the step's message and the later stages' graphs follow from the host batch."""
        return self.stage_graphs is not None and probe is None and self.stage_graphs.fits(h)

    def _cpu_decode(self, inp: StepInputs, probe) -> bool:
        """Whether the CPU decode path takes this step (`CpuDecoder.takes`: decode steps and
        verifies of chains and trees), with no probe."""
        h, dec = inp.host, self.cpu_decoder
        if dec is None or probe is not None:
            return False
        rows, seqs = len(h.input_ids), len(h.seq_lens)
        if rows == seqs:  # a decode step: nothing more to look at
            return CpuDecoder.takes(rows, seqs)
        return CpuDecoder.takes(rows, seqs, int(h.q_lens.max()), inp.prefill,
                                h.tree_mask is not None and (self.stages is not None or not dec.trees))


def _prefill_rows(on: bool):
    """quant_cpu.prefill_rows() when `on`: a CPU step computing prompt tokens multiplies
    16-bit weights on the block kernel at any M (quantized ones choose by M, as always)."""
    if not on:
        return contextlib.nullcontext()
    from .kernels.quant_cpu import prefill_rows
    return prefill_rows()
