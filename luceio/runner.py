"""ModelRunner: owns the model and its KV cache; turns a `SchedulerOutput` into one flat varlen
batch, runs the forward, and returns logits for the rows that need them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import CacheConfig
from .loader import Checkpoint
from .models import AttnMetadata, build_model
from .scheduler import SchedulerOutput

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttnMetadata
    logits_indices: torch.Tensor  # [num_rows]: token rows whose logits are needed
    row_slices: dict[str, slice]  # request id -> its rows among the logits (sample/verify)
    prompt_row_slices: dict[str, tuple[slice, int]]  # request id -> (rows, first prompt index)


class ModelRunner:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 cache_config: CacheConfig, max_model_len: int, model=None,
                 enforce_eager: bool = False, max_num_seqs: int = 128):
        self.device, self.dtype = device, dtype
        self.model = model if model is not None else build_model(ckpt, dtype, device)
        self.cfg = self.model.cfg
        self.block_size = cache_config.block_size
        self.num_blocks = self._num_blocks(cache_config, max_model_len)
        shape = (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        # one [2, ...] tensor per layer: kv[0] keys, kv[1] values
        self.kv_caches = [torch.zeros((2, *shape), dtype=dtype, device=device)
                          for _ in range(self.cfg.num_layers)]
        self.graphs = None
        if device.type == "cuda" and not enforce_eager:
            from . import kernels
            from .cuda_graphs import DecodeGraphs
            if kernels.use_triton(self.kv_caches[0]):  # graphs need the static-shape kernels
                self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs,
                                           max_model_len, self.block_size, device)
                self.graphs.capture()

    @property
    def bytes_per_block(self) -> int:
        c = self.cfg
        return (2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim *
                torch.tensor([], dtype=self.dtype).element_size())

    def _num_blocks(self, cc: CacheConfig, max_model_len: int) -> int:
        if cc.num_blocks:
            return cc.num_blocks
        if cc.kv_cache_memory:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_allocated(self.device)
            # leave room for activations of one full step (measured by the warm-up forward)
            budget = int(total * cc.gpu_memory_utilization) - used_by_others - \
                torch.cuda.memory_allocated(self.device) - (1 << 30)
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        n = budget // self.bytes_per_block
        if n < -(-max_model_len // self.block_size):
            raise ValueError(f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {n} blocks, "
                             f"fewer than one {max_model_len}-token sequence needs; lower "
                             f"--max-model-len or raise --kv-cache-memory")
        return int(n)

    # batch building ----------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        seq_lens, q_starts, tables = [], [0], []
        logits_idx: list[int] = []
        rows: dict[str, slice] = {}
        prompt_rows: dict[str, tuple[slice, int]] = {}
        bs = self.block_size
        for s in out.scheduled:
            r = s.req
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            tokens = r.all_token_ids + s.spec_token_ids if s.spec_token_ids else r.all_token_ids
            base = len(ids)
            ids.extend(tokens[start:end])
            pos.extend(range(start, end))
            seq_lens.append(end)
            q_starts.append(len(ids))
            tables.append(block_tables[r.request_id])
            if r.params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1 \
                    and len(r.prompt_logprobs) < r.num_prompt_tokens:
                last = min(end, r.num_prompt_tokens - 1)
                prompt_rows[r.request_id] = (slice(len(logits_idx), len(logits_idx) + last - start),
                                             start)
                logits_idx.extend(range(base, base + last - start))
            if s.samples:
                n_rows = 1 + len(s.spec_token_ids)
                rows[r.request_id] = slice(len(logits_idx), len(logits_idx) + n_rows)
                logits_idx.extend(range(len(ids) - n_rows, len(ids)))
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        pos_np = np.asarray(pos, dtype=np.int64)
        seq_of_tok = np.repeat(np.arange(len(tables)), np.diff(q_starts))
        slots = bt[seq_of_tok, pos_np // bs].astype(np.int64) * bs + pos_np % bs
        dev = self.device
        q_lens = np.diff(q_starts)
        meta = AttnMetadata(
            slot_mapping=_t(slots, dev), block_tables=_t(bt, dev),
            seq_lens=_t(np.asarray(seq_lens, dtype=np.int32), dev),
            query_start_loc=_t(np.asarray(q_starts, dtype=np.int32), dev),
            max_query_len=int(q_lens.max()), max_seq_len=int(max(seq_lens)))
        return StepInputs(_t(np.asarray(ids, dtype=np.int64), dev), _t(pos_np, dev), meta,
                          _t(np.asarray(logits_idx, dtype=np.int64), dev), rows, prompt_rows)

    # forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inp: StepInputs) -> torch.Tensor:
        """Returns fp32 logits [num_rows, vocab] for `inp.logits_indices`."""
        if self.graphs is not None and self.graphs.fits(len(inp.input_ids), inp.meta.max_query_len):
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.meta)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        return self.model.compute_logits(hidden[inp.logits_indices])


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
