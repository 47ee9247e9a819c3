"""What crosses a stage boundary, through torch.distributed point-to-point. Control messages
(header, ints) always travel on Gloo from host memory; the hidden states travel one of two ways
(`Link`, chosen once per run, see `plan.choose_transport`):
- host: on Gloo too, through host memory (copied there from the device through a pinned buffer,
  and to the receiving stage's device after), so any two devices of any vendor, in any two
  processes, can be neighbours;
- nccl: device to device on an NCCL group of every stage (CUDA devices of one vendor). The
  receiving buffer is allocated on the device for each step (from the caching allocator).

One step, stage r -> stage r + 1, is two messages: the first (Gloo, bytes) as soon as it is
known, before stage r's layers are done, so stage r + 1 prepares its step meanwhile
(`Link.send_ints`; on NCCL right before the second, see below), the second once they are
(`Link.send_hidden`):
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
     residual stream (on NCCL: an NCCL transfer).
1 and 2 travel as one message (a step whose ints pass CAPACITY bytes sends its header first).
Middle stages relay 1 and 2 unchanged, as soon as they have them. The last stage sends rank 0
one message: num_tokens (int64), then (host) the final normalised hidden states
[num_tokens, hidden_size] (on NCCL: an NCCL transfer after it); rank 0 checks the count and
computes the logits.

Why Gloo first: a peer that died is reported by Gloo at once (its connection closed), while an
NCCL transfer with a dead peer waits until the group's timeout. Every NCCL transfer is preceded
by a Gloo message from the same sender, so a stage that dies is seen on Gloo by whoever waits
for it; only a death between the two messages of one step is left to the NCCL timeout. So
on NCCL the ints are not sent ahead of a stage's layers (`Link.ints_ahead`): a stage that died
during them would leave the next one waiting on NCCL, and with it the engine.

Why stage 0 waits for its sends only after the step's last receive: a send to a stage killed
just before a step once waited out the group's 30-minute timeout in the CPU suite, where a
receive fails at once. In Gloo's source (`transport/tcp/pair.cc`), a connection's error fails
the receives posted on it and the sends still waiting for the receiver, but not a send queued
after its write failed (the peer had reset the connection before Gloo's thread saw it close).
The final hidden states' receive fails instead, and once it is in, the step's sends are done."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..models import AttnMetadata

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 9
CAPACITY = 4 << 20  # bytes: a step message up to this size travels whole (`Link`)


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


def unpack_step(header: list[int], ints: torch.Tensor, device: torch.device):
    """(positions, meta, prefill) of a received step, on `device`. `prefill`: rows computing
    known tokens (the CPU's 16-bit block kernel, runner._prefill_rows)."""
    _, n, num_seqs, max_blocks, max_query_len, max_seq_len, prefill, tree, _ = header
    pos, slots, tables, seq_lens, qsl, tree_mask, _, _ = split_ints(header, ints.to(device))
    meta = AttnMetadata(slots, tables.view(num_seqs, max_blocks).int(), seq_lens.int(),
                        qsl.int(), max_query_len, max_seq_len)
    if tree:
        meta.tree_mask = tree_mask
    return pos, meta, bool(prefill)


def step_moves(header: list[int], ints: torch.Tensor, device: torch.device):
    """(source, destination) KV slots of a received step, on `device`, to move before its
    layers run; None when it has none."""
    if not header[-1]:
        return None
    src, dst = split_ints(header, ints)[-2:]
    return src.to(device), dst.to(device)


def send_shutdown(dst: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = OP_SHUTDOWN
    dist.send(header, dst)


class Link:
    """One process's ends of its stage boundaries: sends and receives of steps, on `device`.
    `nccl`: the NCCL group the hidden states travel on, or None for host-staged Gloo.

    Gloo sends only once the receiver has posted its receive (a round trip between the two
    processes' Gloo threads before any data moves, ~0.2 ms on a 2-core VM), so every message a
    step needs is posted ahead where its size is known: a stage posts the next step's receive
    (CAPACITY bytes, which takes any smaller message) as soon as it has sent the last one on,
    the hidden states' receive as soon as the step's ints are in, and stage 0 posts the final
    hidden states' receive before it sends the step. Gloo sends are posted without waiting
    (`finish_sends` waits for a step's). On a GPU the host buffers are pinned and reused: each
    copy in or out is synchronous, and each send not yet finished has a buffer of its own; on
    the CPU every message gets its own."""

    def __init__(self, device: torch.device, nccl: dist.ProcessGroup | None = None):
        self.device, self.nccl = device, nccl
        self._buffers: dict[str, torch.Tensor] = {}  # use -> grow-only pinned buffer
        self._posted: tuple | None = None  # (work, buffer) of the next step's receive
        self._hidden: tuple | None = None  # (work, tensor) of this step's hidden states
        self._sends: list[tuple] = []  # (work, buffer) of the Gloo sends not yet waited for

    @property
    def transport(self) -> str:
        return "host" if self.nccl is None else "nccl"

    @property
    def ints_ahead(self) -> bool:
        """Whether a step's ints go before the stage's layers run (host path), or just before
        its hidden states (NCCL: a stage that dies during its layers is then still seen on
        Gloo, as the ints it has not sent, rather than at the NCCL transfer's timeout)."""
        return self.nccl is None

    def _hidden_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of hidden states in a Gloo message: none when they travel on NCCL."""
        return 0 if self.nccl is not None else numel * dtype.itemsize

    def send_ints(self, dst: int, header: torch.Tensor, ints: torch.Tensor) -> None:
        """Messages 1 and 2 of a step: as soon as they are known (before this stage's layers
        are done), so the next stage prepares its step meanwhile."""
        head, ib = HEADER_LEN * 8, ints.numel() * 8
        inline = head + ib <= CAPACITY
        if not inline:
            self._send(header, dst)
        buf = self._send_buffer(head + ib)
        buf[:head].view(torch.int64).copy_(header)
        buf[head:].view(torch.int64).copy_(ints)
        self._send(buf if inline else buf[head:], dst)

    def send_hidden(self, dst: int, hidden: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Message 3 of a step: (x, residual), each [num_tokens, hidden_size]."""
        x = hidden[0]
        if self.nccl is not None:
            dist.send(torch.stack(hidden), dst, group=self.nccl)
            return
        buf = self._send_buffer(self._hidden_bytes(2 * x.numel(), x.dtype))
        out = buf.view(x.dtype).view(2, *x.shape)
        if x.device.type == "cpu":
            out[0].copy_(x)
            out[1].copy_(hidden[1])
        else:  # one copy out of the device: it waits for this stage's layers
            out.copy_(torch.stack(hidden))
        self._send(buf, dst)

    def _send(self, buf: torch.Tensor, dst: int) -> None:
        """Sends `buf` to `dst` on Gloo without waiting for it (`finish_sends` waits)."""
        self._sends.append((dist.isend(buf, dst), buf))

    def _send_buffer(self, nbytes: int) -> torch.Tensor:
        """The host buffer of the step's next send: one per send not yet finished."""
        return self._buffer(f"send{len(self._sends)}", nbytes)

    def finish_sends(self) -> None:
        """Waits for this step's Gloo sends. Stage 0 calls it once the step's last receive
        is in, when they are done (the receiver had them all): see the module's docstring."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def drop_sends(self) -> None:
        """Forgets this step's sends without waiting: the pipeline failed, and a send to a
        stage that died may never complete."""
        self._sends = []

    def post_step(self, src: int) -> None:
        """Posts the receive of the next step from `src` (`recv_ints` posts it if not)."""
        buf = self._buffer("recv", CAPACITY)
        self._posted = (dist.irecv(buf, src), buf)

    def recv_ints(self, src: int, dtype: torch.dtype, hidden_size: int,
                  timer=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(header, ints) of the next step from `src`, or None when `src` shuts the pipeline
        down; the receive of its hidden states is posted at once (`recv_hidden` waits for
        it). `timer` (`timing.PhaseTimer`): the wait for the message is its phase "wait"."""
        if self._posted is None:
            self.post_step(src)
        work, buf = self._posted
        self._posted = None
        work.wait()
        if timer is not None:
            timer.mark("wait")
        head = HEADER_LEN * 8
        header = buf[:head].view(torch.int64).clone()
        fields = header.tolist()
        if fields[0] == OP_SHUTDOWN:
            return None
        ib = ints_length(fields) * 8
        if head + ib <= CAPACITY:
            ints = buf[head:head + ib].view(torch.int64).clone()
        else:  # too large to come whole: the ints follow the header
            ints = torch.empty(ib // 8, dtype=torch.int64)
            dist.recv(ints, src)
        shape = (2, fields[1], hidden_size)
        if self.nccl is not None:
            hidden = torch.empty(shape, dtype=dtype, device=self.device)
            self._hidden = (dist.irecv(hidden, src, group=self.nccl), hidden)
        else:
            raw = self._buffer("recv_hidden", self._hidden_bytes(2 * shape[1] * hidden_size,
                                                                 dtype))
            self._hidden = (dist.irecv(raw, src), raw.view(dtype).view(shape))
        return header, ints

    def recv_hidden(self, on_host: bool = False) -> torch.Tensor:
        """The hidden states [2, num_tokens, hidden_size] of the step `recv_ints` gave, on this
        stage's device. `on_host`: host-staged ones stay in the pinned buffer they came in
        (valid until the next step's `recv_ints`)."""
        work, hidden = self._hidden
        self._hidden = None
        work.wait()
        if self.nccl is None and self.device.type != "cpu" and not on_host:
            hidden = hidden.to(self.device)  # synchronous: the buffer is free after
        return hidden

    def send_final(self, hidden: torch.Tensor) -> None:
        """The last stage's output to rank 0: its row count, then the rows."""
        hb = self._hidden_bytes(hidden.numel(), hidden.dtype)
        buf = self._send_buffer(8 + hb)
        buf[:8].view(torch.int64)[0] = hidden.shape[0]
        if hb:
            buf[8:8 + hb].view(hidden.dtype).view(hidden.shape).copy_(hidden)
        self._send(buf[:8 + hb], 0)
        if self.nccl is not None:
            dist.send(hidden.contiguous(), 0, group=self.nccl)

    def post_final(self, src: int, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                   own: bool = False):
        """Posts the receive of the last stage's output for `num_tokens` rows, before the step
        (or micro-batch) is sent, so that the last stage sends it at once. Returns a function
        that waits for it and gives the hidden states [num_tokens, hidden_size] on this stage's
        device. `own`: a buffer of its own (micro-batches: several are posted at a time)."""
        hb = self._hidden_bytes(num_tokens * hidden_size, dtype)
        buf = torch.empty(8 + hb, dtype=torch.uint8) if own else self._buffer("final", 8 + hb)
        works = [dist.irecv(buf, src)]
        if self.nccl is not None:
            out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
            works.append(dist.irecv(out, src, group=self.nccl))

        def wait() -> torch.Tensor:
            for w in works:  # the Gloo count first: a dead stage is reported there at once
                w.wait()
            count = int(buf[:8].view(torch.int64)[0])
            if count != num_tokens:
                raise RuntimeError(f"stage {src} returned {count} rows for a step of "
                                   f"{num_tokens} tokens")
            if self.nccl is not None:
                return out
            rows = buf[8:8 + hb].view(dtype).view(num_tokens, hidden_size)
            return rows.to(self.device) if self.device.type != "cpu" else rows
        return wait

    def _buffer(self, use: str, nbytes: int) -> torch.Tensor:
        """A host byte buffer: a fresh one on the CPU, a reused pinned one for a GPU."""
        if self.device.type == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        buf = self._buffers.get(use)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._buffers[use] = buf
        return buf[:nbytes]
