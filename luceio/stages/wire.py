"""What crosses a stage boundary, through torch.distributed point-to-point. Control messages
(header, ints) always travel on Gloo from host memory; the hidden states travel one of two ways
(`Link`, chosen once per run, see `plan.choose_transport`):
- host: on Gloo too, through host memory (copied there from the device through a pinned buffer,
  and to the receiving stage's device after), so any two devices of any vendor, in any two
  processes, can be neighbours;
- nccl: device to device on an NCCL group of every stage (CUDA devices of one vendor). The
  receiving buffer is allocated on the device for each step (from the caching allocator).

One step, stage r -> stage r + 1, is three messages in this order:
  1. header: int64 [HEADER_LEN] = op, num_tokens, num_seqs, max_blocks, max_query_len,
     max_seq_len, prefill, tree, num_moves (op SHUTDOWN: the rest is unused and nothing
     follows);
  2. ints: int64, positions [num_tokens] | slot_mapping [num_tokens] |
     block_tables [num_seqs * max_blocks] | seq_lens [num_seqs] | query_start_loc [num_seqs + 1]
     | with tree: the tree mask [num_tokens] (draft-tree verification) | KV moves: source
     slots [num_moves] | destination slots [num_moves]. The moves are the last tree verify's
     accepted rows (`spec.commit`), which every stage applies to its own cache before the
     step's layers;
  3. hidden: the model dtype, [2, num_tokens, hidden_size] = the last layer's output and the
     residual stream.
Middle stages relay 1 and 2 unchanged. The last stage sends rank 0 two messages: num_tokens
(int64 [1], Gloo), then the final normalised hidden states [num_tokens, hidden_size]; rank 0
computes the logits.

Why Gloo first: a peer that died is reported by Gloo at once (its connection closed), while an
NCCL transfer with a dead peer waits until the group's timeout. Every NCCL transfer is preceded
by a Gloo message from the same sender, so a stage that dies is seen on Gloo by whoever waits
for it; only a death between the two messages of one step is left to the NCCL timeout."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models import AttnMetadata

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 9


@dataclass
class StepMessage:
    header: torch.Tensor  # int64 [HEADER_LEN], host
    ints: torch.Tensor  # int64, host: positions | slot_mapping | block_tables | seq_lens | qsl
    hidden: tuple[torch.Tensor, torch.Tensor]  # (x, residual), each [num_tokens, hidden_size]


def pack_step(positions: torch.Tensor, meta: AttnMetadata, prefill: bool,
              moves: tuple[list[int], list[int]] = ((), ())):
    """(header, ints) of a step, on the host: messages 1 and 2. `moves`: (source, destination)
    KV slots for every stage to move before the step (`spec.commit.commit_tree_kv`)."""
    n, (num_seqs, max_blocks) = positions.numel(), meta.block_tables.shape
    tree = meta.tree_mask is not None
    header = torch.tensor([OP_STEP, n, num_seqs, max_blocks, meta.max_query_len,
                           meta.max_seq_len, int(prefill), int(tree), len(moves[0])],
                          dtype=torch.int64)
    parts = [positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
             meta.query_start_loc] + ([meta.tree_mask] if tree else [])
    ints = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in parts] +
                     [torch.tensor(m, dtype=torch.int64) for m in moves])
    return header, ints


def split_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
               parts: int) -> list[tuple]:
    """A step cut into up to `parts` micro-batches of whole requests, in order:
    [(input_ids, positions, meta)] with each meta re-based on its own requests (their rows of
    the step are consecutive), so the rows of the micro-batches, concatenated, are the step's.
    One part where the step has one request (or a hybrid model's state slots)."""
    num_seqs = meta.seq_lens.shape[0]
    parts = min(parts, num_seqs)
    if parts < 2 or meta.state_slots is not None or meta.kept is not None:
        return [(input_ids, positions, meta)]
    qsl = meta.query_start_loc.to("cpu", torch.int64)
    lens = meta.seq_lens.to("cpu", torch.int64)
    bounds = [num_seqs * i // parts for i in range(parts + 1)]  # requests of each part
    out = []
    for a, b in zip(bounds, bounds[1:]):
        r0, r1 = int(qsl[a]), int(qsl[b])
        q = qsl[a:b + 1] - r0
        sub = AttnMetadata(meta.slot_mapping[r0:r1], meta.block_tables[a:b], meta.seq_lens[a:b],
                           q.to(meta.query_start_loc.device, meta.query_start_loc.dtype),
                           int((q[1:] - q[:-1]).max()), int(lens[a:b].max()))
        if meta.tree_mask is not None:
            sub.tree_mask = meta.tree_mask[r0:r1]
        out.append((input_ids[r0:r1] if input_ids is not None else None, positions[r0:r1], sub))
    return out


def ints_length(header: list[int]) -> int:
    _, n, num_seqs, max_blocks, _, _, _, tree, num_moves = header
    return 2 * n + num_seqs * max_blocks + 2 * num_seqs + 1 + tree * n + 2 * num_moves


def split_ints(header: list[int], ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's ints (message 2) as (positions, slot_mapping, block_tables (flat), seq_lens,
    query_start_loc, tree_mask (empty without a tree), move sources, move destinations)."""
    _, n, num_seqs, max_blocks, _, _, _, tree, num_moves = header
    return ints.split([n, n, num_seqs * max_blocks, num_seqs, num_seqs + 1, tree * n,
                       num_moves, num_moves])


def unpack_step(msg: StepMessage, device: torch.device):
    """(positions, meta, prefill, moves) of a received step, on `device`. `prefill`: rows
    computing known tokens (the CPU's dense path, runner._prefill_rows); `moves`: (source,
    destination) KV slots to move before the step's layers, or None."""
    header = msg.header.tolist()
    _, n, num_seqs, max_blocks, max_query_len, max_seq_len, prefill, tree, num_moves = header
    pos, slots, tables, seq_lens, qsl, tree_mask, src, dst = split_ints(header,
                                                                        msg.ints.to(device))
    meta = AttnMetadata(slots, tables.view(num_seqs, max_blocks).int(), seq_lens.int(),
                        qsl.int(), max_query_len, max_seq_len)
    if tree:
        meta.tree_mask = tree_mask
    return pos, meta, bool(prefill), (src, dst) if num_moves else None


def send_shutdown(dst: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = OP_SHUTDOWN
    dist.send(header, dst)


class Link:
    """One process's ends of its stage boundaries: sends and receives of steps, on `device`.
    `nccl`: the NCCL group the hidden states travel on, or None for host-staged Gloo."""

    def __init__(self, device: torch.device, nccl: dist.ProcessGroup | None = None):
        self.device, self.nccl = device, nccl
        self._pinned: dict[str, torch.Tensor] = {}  # "send" / "recv" -> grow-only buffer

    @property
    def transport(self) -> str:
        return "host" if self.nccl is None else "nccl"

    def send_step(self, dst: int, header: torch.Tensor, ints: torch.Tensor,
                  hidden: tuple[torch.Tensor, torch.Tensor]) -> None:
        dist.send(header, dst)
        dist.send(ints, dst)
        self._send_hidden(torch.stack(hidden), dst)

    def recv_step(self, src: int, dtype: torch.dtype, hidden_size: int) -> StepMessage | None:
        """The next step from `src`, its hidden states on this stage's device; None when
        `src` shuts the pipeline down."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src)
        fields = header.tolist()
        if fields[0] == OP_SHUTDOWN:
            return None
        n = fields[1]
        ints = torch.empty(ints_length(fields), dtype=torch.int64)
        dist.recv(ints, src)
        x, residual = self._recv_hidden((2, n, hidden_size), dtype, src).unbind(0)
        return StepMessage(header, ints, (x, residual))

    def send_final(self, hidden: torch.Tensor) -> None:
        dist.send(torch.tensor([hidden.shape[0]], dtype=torch.int64), 0)
        self._send_hidden(hidden.contiguous(), 0)

    def recv_final(self, src: int, num_tokens: int, hidden_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
        count = torch.empty(1, dtype=torch.int64)
        dist.recv(count, src)
        if count.item() != num_tokens:
            raise RuntimeError(f"stage {src} returned {count.item()} rows for a step of "
                               f"{num_tokens} tokens")
        return self._recv_hidden((num_tokens, hidden_size), dtype, src)

    def post_final(self, src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype):
        """`recv_final` posted ahead (micro-batches: the last stage may send one micro-batch's
        result while this process still sends it the next). Returns a function that waits for
        it and gives the hidden states [num_tokens, hidden_size] on this stage's device."""
        count = torch.empty(1, dtype=torch.int64)
        works = [dist.irecv(count, src)]
        nccl = self.nccl is not None
        out = torch.empty((num_tokens, hidden_size), dtype=dtype,
                          device=self.device if nccl else "cpu")
        works.append(dist.irecv(out, src, group=self.nccl) if nccl else dist.irecv(out, src))

        def wait() -> torch.Tensor:
            for w in works:  # the Gloo count first: a dead stage is reported there at once
                w.wait()
            if count.item() != num_tokens:
                raise RuntimeError(f"stage {src} returned {count.item()} rows for a "
                                   f"micro-batch of {num_tokens} tokens")
            return out.to(self.device)
        return wait

    def _send_hidden(self, t: torch.Tensor, dst: int) -> None:
        if self.nccl is not None:
            dist.send(t, dst, group=self.nccl)
        elif t.device.type == "cpu":
            dist.send(t, dst)
        else:  # the copy into pinned memory is synchronous: the buffer is ours again after
            host = self._host_buffer("send", t.shape, t.dtype)
            host.copy_(t)
            dist.send(host, dst)

    def _recv_hidden(self, shape: tuple, dtype: torch.dtype, src: int) -> torch.Tensor:
        if self.nccl is not None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(out, src, group=self.nccl)
            return out
        if self.device.type == "cpu":  # a new tensor per step: the model reads it as is
            out = torch.empty(shape, dtype=dtype)
            dist.recv(out, src)
            return out
        host = self._host_buffer("recv", shape, dtype)
        dist.recv(host, src)
        return host.to(self.device)  # synchronous from pinned memory: the buffer is free after

    def _host_buffer(self, use: str, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        buf = self._pinned.get(use)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 20), dtype=dtype, pin_memory=True)
            self._pinned[use] = buf
        return buf[:numel].view(shape)
