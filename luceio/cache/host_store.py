"""Host copies of KV blocks, the data half (worker thread, tensors): it applies the `KVMoves`
that `offload.HostCopies` records, for bounded residency and swap preemption alike; it also
keeps residency's per-block pooled keys and does the `keys` policy's scoring.

It copies exactly the blocks the moves list: the planning half knows which host copies are
still current (kept after a reload, so offloading such a block again only frees the device
block). Host copies are pinned on a GPU so the copies back are DMA transfers."""
from __future__ import annotations

import torch

from .offload import OFFLOADED, KVMoves


class HostKVStore:
    def __init__(self, kv_caches: list[torch.Tensor], device: torch.device,
                 pool_keys: bool = True):
        self.kv_caches = kv_caches
        self.device = device
        self.pool_keys = pool_keys  # only the keys policy scores blocks by their mean keys
        self.blocks: dict[str, dict[int, torch.Tensor]] = {}  # id -> logical -> [L, 2, bs, H, D]
        # id -> (mean keys [capacity, L, H, D] fp32, the logical blocks filled in)
        self.pooled: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def request_ids(self) -> list[str]:
        return list(set(self.blocks) | set(self.pooled))

    def drop(self, rid: str) -> None:
        self.blocks.pop(rid, None)
        self.pooled.pop(rid, None)

    def _gather(self, phys: list[int]) -> torch.Tensor:
        idx = torch.tensor(phys, device=self.device)
        return torch.stack([kv.index_select(1, idx) for kv in self.kv_caches])  # [L, 2, n, ...]

    @torch.inference_mode()
    def apply(self, moves: KVMoves) -> None:
        for rid in moves.drop:
            self.drop(rid)
        for rid, first in moves.repool:
            entry = self.pooled.get(rid)
            if entry is not None:
                entry[1].difference_update([i for i in entry[1] if i >= first])
        for rid, logical, phys in moves.offload:
            store = self.blocks.setdefault(rid, {})
            data = self._gather(phys)  # [L, 2, n, bs, H, D]
            if self.pool_keys:
                self._pool(rid, logical, data[:, 0])
            # block-major on the host: each block one contiguous run, so a reload is one DMA
            # per block straight from pinned memory, with no host-side gather
            host = torch.empty((len(phys), *data.shape[:2], *data.shape[3:]), dtype=data.dtype,
                               pin_memory=self.device.type == "cuda")
            host.copy_(data.permute(2, 0, 1, 3, 4, 5))
            for j, i in enumerate(logical):
                store[i] = host[j]
        for rid, logical, phys in moves.reload:
            store = self.blocks.get(rid, {})  # a release cancels pending reloads: never gone
            if any(i not in store for i in logical):
                raise RuntimeError(f"request {rid!r}: reload of a block that was never offloaded")
            data = torch.stack([store[i].to(self.device, non_blocking=True) for i in logical],
                               dim=2)  # [L, 2, n, bs, H, D]
            idx = torch.tensor(phys, device=self.device)
            for layer, kv in enumerate(self.kv_caches):
                kv.index_copy_(1, idx, data[layer])

    def _pool(self, rid: str, logical: list[int], keys: torch.Tensor) -> None:
        """Mean key per block, layer and head: keys [L, n, bs, H, D]."""
        means = keys.float().mean(2).transpose(0, 1)  # [n, L, H, D]
        buf, have = self.pooled.get(rid, (None, set()))
        need = max(logical) + 1
        if buf is None or buf.shape[0] < need:
            grown = torch.zeros((max(need, 2 * (0 if buf is None else buf.shape[0]), 64),
                                 *means.shape[1:]), dtype=torch.float32, device=means.device)
            if buf is not None:
                grown[:buf.shape[0]] = buf
            buf = grown
        buf[torch.tensor(logical, device=means.device)] = means
        have.update(logical)
        self.pooled[rid] = (buf, have)

    @torch.inference_mode()
    def score(self, rid: str, table: list[int], num_old: int, queries: torch.Tensor,
              scale: float) -> torch.Tensor | None:
        """Scores of the request's first `num_old` (full) blocks for its latest queries
        [L, num_heads, D]: per layer and head a softmax over blocks of q·mean(k), then the max
        over heads and layers. Resident blocks are pooled here on first use. None when the
        request was dropped meanwhile (aborted while this step ran)."""
        if rid not in self.pooled and OFFLOADED in table[:num_old]:
            return None
        have = self.pooled.get(rid, (None, set()))[1]
        missing = [i for i in range(num_old) if i not in have]
        if missing:
            if any(table[i] < 0 for i in missing):
                raise RuntimeError(f"request {rid!r}: an offloaded block has no pooled key")
            self._pool(rid, missing, self._gather([table[i] for i in missing])[:, 0])
        keys = self.pooled[rid][0][:num_old]  # [B, L, Hkv, D]
        num_layers, num_heads, head_dim = queries.shape
        num_kv = keys.shape[2]
        q = queries.float().view(num_layers, num_kv, num_heads // num_kv, head_dim)
        s = torch.einsum("lkgd,blkd->lkgb", q, keys) * scale
        return s.softmax(-1).amax(dim=(0, 1, 2))


class QueryProbe:
    """Forward probe that keeps, per layer, the queries of chosen token rows."""

    def __init__(self, rows: list[int], device: torch.device):
        self.rows = torch.tensor(rows, device=device)
        self.per_layer: list[torch.Tensor] = []

    def __call__(self, q, k_cache, meta, scale: float) -> None:
        self.per_layer.append(q.index_select(0, self.rows))

    def queries(self, j: int) -> torch.Tensor:
        """[L, num_heads, D] for the j-th chosen row."""
        return torch.stack([q[j] for q in self.per_layer])
