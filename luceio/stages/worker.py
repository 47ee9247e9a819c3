"""A stage worker: the process of pipeline stage `rank` >= 1 (rank 0 is the engine's own).

Order of life: join the process group (first, so the engine never waits on a stage that failed
to load), load the checkpoint on the stage's device and keep only its layers, then the
handshake (`group.py`): the engine broadcasts its plan, every stage answers with None or the
reason it cannot serve it (another model, another layer count, a KV pool that does not fit).
Then one step at a time (`wire.py`): receive from rank - 1, run the stage's layers into its own
KV pool (the engine's block ids index it), send on to rank + 1, or the final hidden states back
to rank 0 from the last stage. A shutdown message is relayed and ends the loop.

Failure: any exception ends the process with a non-zero code after printing its traceback; its neighbours'
sends and receives then fail at once (Gloo reports the closed connection) and so does the
engine's step, which raises `StageError`. Nothing retries."""
from __future__ import annotations

import datetime
import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import StagePlan, layer_ranges

# a step may be a long prefill on a slow stage; a dead local peer is reported at once anyway
OP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class WorkerSpec:
    args: object  # the engine's EngineArgs
    model_path: str
    rank: int
    plan: StagePlan


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of a spawned stage process; exits non-zero on any failure."""
    from .model import keep_layers, stage_kv_caches
    rank, plan = spec.rank, spec.plan
    dist.init_process_group("gloo", init_method=plan.dist_init, rank=rank,
                            world_size=plan.num_stages, timeout=OP_TIMEOUT)
    try:
        device = torch.device(plan.devices[rank])
        if device.type == "cpu":  # stages compute one after another: no oversubscription
            torch.set_num_threads(spec.args.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        dtype = spec.args.resolved_dtype(device)
        model, identity, error = _load(spec, device, dtype)
        wanted = [None]
        dist.broadcast_object_list(wanted, src=0)
        engine_plan = wanted[0]
        if error is None:
            error = _check_plan(engine_plan, identity, layer_ranges(
                spec.args.layer_split, plan.num_stages, model.cfg.num_layers), rank)
        kv_caches = None
        if error is None:
            try:
                kv_caches = stage_kv_caches(model.cfg, plan.layer_ranges[rank],
                                            engine_plan["num_blocks"], engine_plan["block_size"],
                                            dtype, device)
            except RuntimeError as e:  # out of memory
                error = f"stage {rank} on {device}: no room for the KV pool: {e}"
        statuses = [None] * plan.num_stages
        dist.all_gather_object(statuses, error)
        if any(s is not None for s in statuses):
            sys.exit(1)
        keep_layers(model, plan.layer_ranges[rank], rank)
        _serve(model, kv_caches, plan, rank, device, dtype)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        dist.destroy_process_group()


def _load(spec: WorkerSpec, device: torch.device, dtype: torch.dtype):
    """(model, identity, None) or (None, None, why not)."""
    from ..loader import load_checkpoint
    from ..models import build_model
    from .plan import model_identity
    args = spec.args
    try:
        ckpt = load_checkpoint(spec.model_path)
        model = build_model(ckpt, dtype, device, args.quantization)
    except Exception as e:
        return None, None, f"stage {spec.rank} could not load {spec.model_path}: {e}"
    return model, model_identity(ckpt.config), None


def _check_plan(engine_plan: dict, identity: str, own_ranges, rank: int) -> str | None:
    """`own_ranges`: the split this stage computes from its own checkpoint and flags."""
    if engine_plan["identity"] != identity:
        return f"stage {rank} loaded another model than stage 0 (its config differs)"
    if tuple(engine_plan["layer_ranges"]) != own_ranges:
        return (f"stage {rank} splits the layers as {own_ranges}, stage 0 as "
                f"{engine_plan['layer_ranges']}")
    return None


@torch.inference_mode()
def _serve(model, kv_caches, plan: StagePlan, rank: int, device: torch.device,
           dtype: torch.dtype) -> None:
    from ..runner import _prefill_rows
    from .wire import recv_step, send_final, send_shutdown, send_step
    layer_range = plan.layer_ranges[rank]
    last = rank == plan.num_stages - 1
    while True:
        msg = recv_step(rank - 1, device, dtype, model.cfg.hidden_size)
        if msg is None:
            if not last:
                send_shutdown(rank + 1)
            return
        with _prefill_rows(msg.prefill and device.type == "cpu"):
            out = model(None, msg.positions, kv_caches, msg.meta, layer_range=layer_range,
                        hidden=msg.hidden)
        if last:
            send_final(out)
        else:
            msg.hidden = out
            send_step(rank + 1, msg)
