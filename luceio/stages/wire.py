"""What crosses a stage boundary, through torch.distributed point-to-point (Gloo, host-staged:
tensors are copied to host memory before a send and to the stage's device after a receive, so
any two devices of any vendor, in any two processes, can be neighbours).

One step, stage r -> stage r + 1, is three messages in this order:
  1. header: int64 [HEADER_LEN] = op, num_tokens, num_seqs, max_blocks, max_query_len,
     max_seq_len, prefill (op SHUTDOWN: the rest is unused and nothing follows);
  2. ints: int64, positions [num_tokens] | slot_mapping [num_tokens] |
     block_tables [num_seqs * max_blocks] | seq_lens [num_seqs] | query_start_loc [num_seqs + 1];
  3. hidden: the model dtype, [2, num_tokens, hidden_size] = the last layer's output and the
     residual stream.
Middle stages relay 1 and 2 unchanged. The last stage sends rank 0 one message: the final
normalised hidden states [num_tokens, hidden_size]; rank 0 computes the logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models import AttnMetadata

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 7


@dataclass
class StepMessage:
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttnMetadata
    hidden: tuple[torch.Tensor, torch.Tensor]  # (x, residual), each [num_tokens, hidden_size]
    prefill: bool  # rows computing known tokens: the CPU's dense path (runner._prefill_rows)


def send_step(dst: int, msg: StepMessage) -> None:
    m = msg.meta
    n, (num_seqs, max_blocks) = msg.positions.numel(), m.block_tables.shape
    header = torch.tensor([OP_STEP, n, num_seqs, max_blocks, m.max_query_len, m.max_seq_len,
                           int(msg.prefill)], dtype=torch.int64)
    ints = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in (
        msg.positions, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc)])
    dist.send(header, dst)
    dist.send(ints, dst)
    dist.send(torch.stack(msg.hidden).cpu(), dst)


def send_shutdown(dst: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = OP_SHUTDOWN
    dist.send(header, dst)


def recv_step(src: int, device: torch.device, dtype: torch.dtype,
              hidden_size: int) -> StepMessage | None:
    """The next step from `src`, on `device`; None when `src` shuts the pipeline down."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src)
    op, n, num_seqs, max_blocks, max_query_len, max_seq_len, prefill = header.tolist()
    if op == OP_SHUTDOWN:
        return None
    ints = torch.empty(2 * n + num_seqs * max_blocks + 2 * num_seqs + 1, dtype=torch.int64)
    dist.recv(ints, src)
    hidden = torch.empty(2, n, hidden_size, dtype=dtype)
    dist.recv(hidden, src)
    pos, slots, tables, seq_lens, qsl = ints.to(device).split(
        [n, n, num_seqs * max_blocks, num_seqs, num_seqs + 1])
    meta = AttnMetadata(slots, tables.view(num_seqs, max_blocks).int(), seq_lens.int(),
                        qsl.int(), max_query_len, max_seq_len)
    x, residual = hidden.to(device).unbind(0)
    return StepMessage(pos, meta, (x, residual), bool(prefill))


def send_final(hidden: torch.Tensor) -> None:
    dist.send(hidden.contiguous().cpu(), 0)


def recv_final(src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    out = torch.empty(num_tokens, hidden_size, dtype=dtype)
    dist.recv(out, src)
    return out.to(device)
