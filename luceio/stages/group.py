"""Rank 0's side of pipeline stages: the engine's process runs the scheduler, sampler and
tokenizer, stage 0's layers on `--devices`' first device, and this group, which spawns one
process per further stage (`worker.py`), or with `--world-size` waits for the stages started by
hand (`luceio stage`), and joins them with torch.distributed: Gloo, plus an NCCL group for the
hidden states when every stage is a CUDA device of one vendor (`wire.py`).

Rules:
- Startup: `StageGroup(plan, ...)` spawns the workers (if `plan.spawn`) and joins the process
  group, waiting at most `--stage-join-timeout` for every stage (a RuntimeError);
  `build_model` loads stage 0's layers only (its KV pool is sized around them); once the
  engine has sized its KV pool, `connect(num_blocks, ...)` broadcasts the plan (model identity,
  layer split, pool size) and gathers every stage's answer; any refusal is a RuntimeError that
  names the stage, after the workers have exited.
- Steps: `forward` runs stage 0's layers, sends the step on (`wire.py`) and waits for the last
  stage's final hidden states. Only one thread calls it at a time (the engine's execute).
- Failure: a stage that dies or raises makes `forward` raise `StageError` (Gloo reports the
  closed connection at once; on the NCCL path too, as every NCCL transfer follows a Gloo
  message, see `wire.py`); the group is then broken and every later step raises too.
- `close()` relays a shutdown through the stages, joins them (killing any that outlive
  `JOIN_TIMEOUT_S`; stages started by hand end themselves on the shutdown message, or on the
  closed connections when the pipeline is broken) and destroys the process group; it also
  runs when the group is collected or the interpreter exits. One group per process at a
  time: it owns the default process group."""
from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import EngineDeadError
from .model import keep_layers
from .plan import StagePlan, model_identity
from .timing import PhaseTimer, step_kind
from .wire import Link, pack_step, send_shutdown, split_step
from .worker import WorkerSpec, close_link, end_nccl, join_group, run_worker

logger = logging.getLogger("luceio")

JOIN_TIMEOUT_S = 10


class StageError(EngineDeadError):
    """A pipeline stage failed; the engine cannot step any more."""


class StageGroup:
    def __init__(self, plan: StagePlan, args, model_path: str):
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed process group: "
                               "close the other staged engine first")
        self.plan = plan
        ctx = mp.get_context("spawn")  # a forked child would inherit torch's threads mid-state
        self.procs = [ctx.Process(target=run_worker, args=(WorkerSpec(args, model_path, rank, plan),),
                                  daemon=True, name=f"luceio-stage-{rank}")
                      for rank in range(1, plan.num_stages if plan.spawn else 1)]
        for p in self.procs:
            p.start()
        try:
            self.link = join_group(plan, 0, args.stage_join_timeout)
        except BaseException:
            _shut_down(self.procs, None, False)
            raise
        self._finalizer = weakref.finalize(self, _shut_down, self.procs, self.link, True)
        self.broken: str | None = None
        self._moves: tuple[list[int], list[int]] = ([], [])  # KV slots for the next step
        self.micro_batches = args.stage_micro_batches
        self.timer = PhaseTimer(0)
        self.dtype = torch.float32  # the model's, from build_model

    def queue_moves(self, src: list[int], dst: list[int]) -> None:
        """KV moves (flat slots) that stage 0 made in its own cache after a tree verify: the
        other stages make them at the start of the next step, before its layers run (each
        verify is a step, so the moves waiting are one verify's, made at once as stage 0
        made them)."""
        self._moves[0].extend(src)
        self._moves[1].extend(dst)

    @property
    def layer_range(self) -> tuple[int, int]:
        return self.plan.layer_ranges[0]

    @property
    def transport(self) -> str:
        """How hidden states cross the boundaries: host or nccl."""
        return self.link.transport

    def build_model(self, ckpt, dtype: torch.dtype, device: torch.device, quantization: str):
        """Stage 0's model: the checkpoint's, less the other stages' layers."""
        from ..models import build_model
        self.dtype = dtype  # the hidden states' too
        model = build_model(ckpt, dtype, device, quantization)
        keep_layers(model, self.layer_range, 0)
        return model

    def connect(self, model, config: dict, num_blocks: int, block_size: int,
                graphs: dict | None = None) -> None:
        """The handshake; then frees stage 0's copy of the other stages' layers. `graphs`:
        {max_num_seqs, max_model_len} when the stages capture CUDA graphs (`graphs.py`)."""
        dist.broadcast_object_list([{"identity": model_identity(config),
                                     "layer_ranges": self.plan.layer_ranges,
                                     "num_blocks": num_blocks, "block_size": block_size,
                                     "graphs": graphs}], src=0)
        statuses = [None] * self.plan.num_stages
        dist.all_gather_object(statuses, None)
        errors = [s for s in statuses if s is not None]
        if errors:
            self.broken = "the stages refused the plan"
            self.close()
            raise RuntimeError("pipeline stages refused the plan: " + "; ".join(errors))
        keep_layers(model, self.layer_range, 0)
        logger.info("pipeline stages: %s", ", ".join(
            f"layers {s}-{e - 1} on {d}"
            for d, (s, e) in zip(self.plan.devices, self.plan.layer_ranges)))

    def forward(self, model, input_ids, positions, kv_caches, meta, prefill: bool,
                first=None, decoder=None) -> torch.Tensor:
        """The final normalised hidden states [num_tokens, hidden_size], on stage 0's device.
        `first`: stage 0's output for the whole step, already queued (its CUDA graph's replay,
        `graphs.StageGraphs.run_first`; then `positions` and `meta` may be on the host), in
        place of the eager layers; only for steps not cut into micro-batches. `decoder`: runs
        stage 0's layers of a decode step (the CPU decode path, `models/cpu_decode.py`)."""
        if self.broken:
            raise StageError(self.broken)
        if any(p.exitcode is not None for p in self.procs):
            # a stage that died since the last step: said at once, with its exit code
            self.broken = self._failure(RuntimeError("a stage process exited"))
            raise StageError(self.broken)
        # the ints go out before this stage's layers run or are waited for (host path), so the
        # next stage prepares its step (fills its graph's inputs) while this device computes
        timer = self.timer
        timer.start()
        parts = split_step(input_ids, positions, meta, self.micro_batches)
        last, waits = self.plan.num_stages - 1, []
        try:
            for ids, pos, sub in parts:  # micro-batches: the next stage runs one while this
                # process computes the next (one part: the whole step)
                header, ints = pack_step(pos, sub, prefill, self._moves)
                self._moves = ([], [])
                if not waits:  # every result's receive posted before a send
                    waits = [self.link.post_final(last, p[1].numel(), model.cfg.hidden_size,
                                                  self.dtype, own=len(parts) > 1)
                             for p in parts]
                ahead = self.link.ints_ahead
                if ahead:
                    self.link.send_ints(1, header, ints)  # the next stage prepares meanwhile
                timer.mark("pack")
                if first is not None:
                    hidden = first
                elif decoder is not None:
                    hidden = decoder(ids, pos, sub)
                else:
                    hidden = model(ids, pos, kv_caches, sub, layer_range=self.layer_range)
                timer.mark("layers")
                if not ahead:
                    self.link.send_ints(1, header, ints)
                self.link.send_hidden(1, hidden)
                timer.mark("send")
            out = waits[0]() if len(waits) == 1 else torch.cat([wait() for wait in waits])
            self.link.finish_sends()  # done: the last stage had them all
            timer.step("final", step_kind(len(meta.seq_lens), meta.max_query_len))
            return out
        except RuntimeError as e:
            self.link.drop_sends()
            self.broken = self._failure(e)
            raise StageError(self.broken) from e

    def _failure(self, error: Exception) -> str:
        for p in self.procs:
            p.join(1)  # the dead one has usually exited by the time its connection closed
        dead = [f"stage {rank} ({p.name}, pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs, 1) if p.exitcode is not None]
        return "pipeline stage failed: " + ("; ".join(dead) if dead else str(error))

    def close(self) -> None:
        self.timer.write()
        if self._finalizer.detach() is not None:  # only the first close ends the stages
            _shut_down(self.procs, self.link, self.broken is None)


def _shut_down(procs: list, link: Link | None, healthy: bool) -> None:
    """Ends the stages: a relayed shutdown message when the pipeline still works, else (or when
    they do not exit in time) a kill; then the process groups go (`link`: None before they
    were joined). An NCCL group goes right after the message, while the stages end theirs."""
    # no processes: the stages run elsewhere, and only the message can end them
    if healthy and dist.is_initialized() and (not procs or any(p.is_alive() for p in procs)):
        try:
            send_shutdown(1)
        except RuntimeError:
            healthy = False  # a stage died meanwhile: the kill below ends the others
    if link is not None and healthy:
        end_nccl(link, True)
    for p in procs:
        p.join(JOIN_TIMEOUT_S if healthy else 0)
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)
    if link is not None:
        close_link(link, healthy)
    elif dist.is_initialized():
        dist.destroy_process_group()
