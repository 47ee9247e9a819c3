"""The plain-torch floor of a batch-1 decode step: the same model and weights as a luceio
engine (dense bf16), written the plain way (F.linear, an fp32 RMSNorm, rotary by indexing,
a contiguous KV cache per layer, `F.scaled_dot_product_attention` over it with a mask), with
the whole step, greedy argmax included, captured in one CUDA graph that feeds its own next
input. No custom kernels and no host work between steps: what PyTorch alone gets from one
graph, the reference point for luceio's kernels and host path (gpu_bench.py's decode rows).

The cache holds `ctx + new + 1` positions and every step attends over all of them (masked):
a static graph cannot change its shapes, so at ctx 512 this reads ~25% more KV than needed.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class FloorModel:
    def __init__(self, model, max_len: int):
        cfg = model.cfg
        self.cfg, self.max_len = cfg, max_len
        self.embed = model.embed_tokens.weight
        self.lm_head = model.lm_head.weight
        self.final_norm = model.norm.weight
        self.layers = [(lay.input_layernorm.weight, lay.self_attn.qkv_proj.weight,
                        lay.self_attn.qkv_proj.bias, lay.self_attn.o_proj.weight,
                        lay.post_attention_layernorm.weight, lay.mlp.gate_up_proj.weight,
                        lay.mlp.down_proj.weight) for lay in model.layers]
        if any(w is None for lay in self.layers for w in (lay[1], lay[5], lay[6])):
            raise ValueError("the torch floor takes dense weights")
        dev, dt = self.embed.device, self.embed.dtype
        shape = (1, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers]
        self.cos_sin = model.cos_sin[:max_len].to(dev, torch.float32)
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ar = torch.arange(max_len, device=dev)

    def _norm(self, x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * h.to(x.dtype)

    def _rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def step(self) -> None:
        """One decode step at `self.pos` for `self.token`; leaves the argmax in `self.token` and
        advances `self.pos` (all on the device)."""
        c = self.cfg
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        cs = self.cos_sin.index_select(0, self.pos)                 # [1, hd]
        cos, sin = cs[:, :hd // 2], cs[:, hd // 2:]
        mask = (self.ar <= self.pos).view(1, 1, 1, -1)
        x = F.embedding(self.token, self.embed)                     # [1, hidden]
        for i, (w_in, w_qkv, b_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(self._norm(x, w_in), w_qkv, b_qkv)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            q = self._rope(q.view(1, nh, hd), cos, sin).view(1, nh, 1, hd)
            k = self._rope(k.view(1, nkv, hd), cos, sin).view(1, nkv, 1, hd)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v.view(1, nkv, 1, hd))
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask,
                                               enable_gqa=nh != nkv)
            x = x + F.linear(o.reshape(1, nh * hd), w_o)
            g, u = F.linear(self._norm(x, w_post), w_gu).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, w_down)
        logits = F.linear(self._norm(x, self.final_norm), self.lm_head)
        self.token.copy_(logits.argmax(-1))
        self.pos.add_(1)


def floor_decode_tps(model, ctx: int, new: int = 128) -> float:
    """Tokens per second of `FloorModel` decoding `new` tokens after a context of `ctx` (its
    KV cache filled with zeros: the cost of a step does not depend on the values), one graph
    replay per token."""
    fm = FloorModel(model, ctx + new + 1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up on a side stream, as graph capture asks
            fm.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.step()

    def run(n: int) -> float:
        fm.pos.fill_(ctx)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
        return time.perf_counter() - t
    run(8)
    return new / run(new)
