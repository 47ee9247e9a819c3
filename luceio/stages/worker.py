"""A stage worker: the process of pipeline stage `rank` >= 1 (rank 0 is the engine's own),
spawned by the engine (`group.py`) or, on several machines, started by hand:
`luceio stage MODEL --devices ... --dist-init tcp://HOST:PORT --world-size W --rank R` (also
`python -m luceio.cli stage ...`), which takes the engine's flags and exits 0 once the engine
shuts the pipeline down, 1 on any failure.

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
import socket
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.qdot_cpu import set_activations as set_cpu_activations
from .plan import StagePlan, choose_transport, layer_ranges, nccl_vendor, parse_dist_init
from .timing import PhaseTimer, step_kind
from .wire import Link

# a step may be a long prefill on a slow stage; a dead local peer is reported at once anyway
OP_TIMEOUT = datetime.timedelta(minutes=30)
# an NCCL transfer waits for its peer's layers of one step (GPUs: seconds at most); past this
# the NCCL watchdog ends the process (a peer that died between a step's Gloo and NCCL messages)
NCCL_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class WorkerSpec:
    args: object  # the engine's EngineArgs
    model_path: str
    rank: int
    plan: StagePlan


def join_group(plan: StagePlan, rank: int, join_timeout_s: float) -> Link:
    """Joins the stages' process group and returns this process's `Link`: rank 0 listens at
    `plan.dist_init`, and every process waits at most `join_timeout_s` for all of them (then a
    RuntimeError saying who is missing), while a step may take OP_TIMEOUT: a store of our own
    gives the two their own timeouts. The default group is Gloo (control messages, and hidden
    states on the host path); with NCCL chosen, a second group of every stage carries the
    hidden states, its connections made here by one tiny transfer around the ring."""
    host, port = parse_dist_init(plan.dist_init)
    device = torch.device(plan.devices[rank])
    if device.type == "cuda":  # NCCL binds each process to the current device
        torch.cuda.set_device(device)
    try:
        store = dist.TCPStore(host, port, plan.num_stages, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=join_timeout_s))
    except RuntimeError as e:  # DistStoreError: the others did not come, or no engine there
        hint = "" if plan.spawn else " (start every other stage with `luceio stage ... " \
            "--rank R`, and rank 0, the engine, with the same --dist-init and --world-size)"
        raise RuntimeError(f"pipeline stage {rank}: the {plan.num_stages} stages did not all "
                           f"join {plan.dist_init} within {join_timeout_s} s: {e}{hint}") from None
    dist.init_process_group("gloo", store=store, rank=rank, world_size=plan.num_stages,
                            timeout=OP_TIMEOUT)
    try:
        return _link(plan, rank, device)
    except BaseException:
        dist.destroy_process_group()
        raise


def _link(plan: StagePlan, rank: int, device: torch.device) -> Link:
    sent = [None] * plan.num_stages
    dist.all_gather_object(sent, (plan.transport, nccl_vendor(), socket.gethostname()))
    asked, vendors, hosts = zip(*sent)
    try:
        transport = choose_transport(asked, plan.devices, vendors, hosts)
    except ValueError as e:
        raise RuntimeError(f"pipeline stage {rank}: {e}") from None
    if transport == "host":
        return Link(device)
    nccl = dist.new_group(backend="nccl", timeout=NCCL_TIMEOUT)
    ring = torch.full((1,), rank, dtype=torch.int64, device=device)
    got = torch.empty_like(ring)
    prev, nxt = (rank - 1) % plan.num_stages, (rank + 1) % plan.num_stages
    if rank == 0:  # the order of a step: 0 sends first, every other stage receives first
        dist.send(ring, nxt, group=nccl)
        dist.recv(got, prev, group=nccl)
    else:
        dist.recv(got, prev, group=nccl)
        dist.send(ring, nxt, group=nccl)
    if got.item() != prev:
        raise RuntimeError(f"pipeline stage {rank}: the NCCL warm-up from stage {prev} "
                           f"delivered {got.item()}")
    return Link(device, nccl)


def run_worker(spec: WorkerSpec) -> None:
    """Runs stage `spec.rank` until the engine shuts the pipeline down; exits non-zero on any
    failure."""
    from .model import kv_budget_error, stage_kv_caches
    rank, plan = spec.rank, spec.plan
    try:
        link = join_group(plan, rank, spec.args.stage_join_timeout)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    healthy = False
    try:
        device = link.device
        if device.type == "cpu":  # stages compute one after another: no oversubscription
            torch.set_num_threads(spec.args.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
            set_cpu_activations(spec.args.cpu_activations)
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
                error = kv_budget_error(spec.args, device, rank)
            except RuntimeError as e:  # out of memory
                error = f"stage {rank} on {device}: no room for the KV pool: {e}"
        graphs = None
        if error is None and engine_plan.get("graphs") and device.type == "cuda":
            try:
                graphs = _capture(model, kv_caches, plan, rank, engine_plan, device, dtype)
            except RuntimeError as e:
                error = f"stage {rank} on {device}: CUDA graph capture failed: {e}"
        statuses = [None] * plan.num_stages
        dist.all_gather_object(statuses, error)
        if any(s is not None for s in statuses):
            sys.exit(1)
        _serve(model, kv_caches, plan, rank, link, dtype, graphs)
        healthy = True
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        close_link(link, healthy)


def close_link(link: Link, healthy: bool) -> None:
    """Ends this process's groups: the NCCL one (`end_nccl`), then the default (Gloo) one."""
    end_nccl(link, healthy)
    if dist.is_initialized():
        dist.destroy_process_group()


def end_nccl(link: Link, healthy: bool) -> None:
    """Ends the NCCL group, if any: destroyed when the pipeline shuts down (every stage does so
    on the shutdown message, at about the same time), aborted when it broke (a dead peer cannot
    take part in a clean shutdown)."""
    if link.nccl is None:
        return
    try:
        if healthy:
            dist.destroy_process_group(link.nccl)
        else:
            dist.distributed_c10d._abort_process_group(link.nccl)
    except Exception:  # the process is ending: a failed abort must not hide the cause
        traceback.print_exc()
    link.nccl = None


def _load(spec: WorkerSpec, device: torch.device, dtype: torch.dtype):
    """(model, identity, None) or (None, None, why not). The model keeps this stage's layers
    only, so what is left of the device's budget is known before the KV pool is placed."""
    from ..loader import load_checkpoint
    from ..models import build_model
    from .model import keep_layers
    from .plan import model_identity
    args = spec.args
    try:
        ckpt = load_checkpoint(spec.model_path)
        model = build_model(ckpt, dtype, device, args.quantization)
    except Exception as e:
        return None, None, f"stage {spec.rank} could not load {spec.model_path}: {e}"
    keep_layers(model, spec.plan.layer_ranges[spec.rank], spec.rank)
    return model, model_identity(ckpt.config), None


def _check_plan(engine_plan: dict, identity: str, own_ranges, rank: int) -> str | None:
    """`own_ranges`: the split this stage computes from its own checkpoint and flags."""
    if engine_plan["identity"] != identity:
        return f"stage {rank} loaded another model than stage 0 (its config differs)"
    if tuple(engine_plan["layer_ranges"]) != own_ranges:
        return (f"stage {rank} splits the layers as {own_ranges}, stage 0 as "
                f"{engine_plan['layer_ranges']}")
    return None


def _capture(model, kv_caches, plan: StagePlan, rank: int, engine_plan: dict,
             device: torch.device, dtype: torch.dtype):
    """This stage's decode graphs (`graphs.py`), for the buckets and context stage 0 gave."""
    from ..memory import Staging
    from .graphs import StageGraphs
    g = engine_plan["graphs"]
    graphs = StageGraphs(model, kv_caches, plan.layer_ranges[rank], False, g["max_num_seqs"],
                         g["max_model_len"], engine_plan["block_size"], device, dtype,
                         Staging(device))
    graphs.capture()
    return graphs


def _cpu_decoder(model, kv_caches, layer_range, device: torch.device, dtype: torch.dtype):
    """The CPU decode path for this stage's layers (`models/cpu_decode.py`), as stage 0's
    runner builds its own, or None."""
    from ..models.cpu_decode import CpuDecoder
    stateful = getattr(model, "has_state", False)
    if device.type != "cpu" or not CpuDecoder.supports(dtype) or stateful:
        return None
    return CpuDecoder.for_stage(model, kv_caches, layer_range)


@torch.inference_mode()
def _serve(model, kv_caches, plan: StagePlan, rank: int, link: Link, dtype: torch.dtype,
           graphs=None) -> None:
    from ..runner import _prefill_rows
    from ..spec.commit import move_kv
    from .wire import send_shutdown, step_moves, unpack_step
    layer_range = plan.layer_ranges[rank]
    last = rank == plan.num_stages - 1
    timer = PhaseTimer(rank)
    decoder = _cpu_decoder(model, kv_caches, layer_range, link.device, dtype)
    try:
        while True:
            timer.start()
            got = link.recv_ints(rank - 1, dtype, model.cfg.hidden_size, timer)
            if got is None:
                if not last:
                    send_shutdown(rank + 1)
                return
            header_t, ints = got
            if not last and link.ints_ahead:  # the next stage prepares its step meanwhile
                link.send_ints(rank + 1, header_t, ints)
            header = header_t.tolist()
            moves = step_moves(header, ints, link.device)
            if moves is not None:  # the last tree verify's accepted KV, before anything reads it
                move_kv(kv_caches, *moves)
            # a step a graph takes has its inputs filled from the host's ints while the hidden
            # states are still on their way; nothing else of it goes to the device
            bs = graphs.prepare(header, ints) if graphs is not None else None
            timer.mark("prepare")
            hidden = link.recv_hidden(on_host=bs is not None)
            timer.mark("recv")
            if bs is not None:
                out = graphs.replay(bs, hidden)
            else:
                positions, meta, prefill = unpack_step(header, ints, link.device)
                # tokens, seqs, max query length, prompt rows, tree
                if decoder is not None and decoder.takes(*header[1:3], header[4], prefill,
                                                         bool(header[7])):
                    out = decoder(None, positions, meta, hidden=tuple(hidden.unbind(0)))
                else:
                    with _prefill_rows(prefill and link.device.type == "cpu"):
                        out = model(None, positions, kv_caches, meta, layer_range=layer_range,
                                    hidden=tuple(hidden.unbind(0)))
            timer.mark("layers")
            if last:
                link.send_final(out)
            else:
                if not link.ints_ahead:
                    link.send_ints(rank + 1, header_t, ints)
                link.send_hidden(rank + 1, out)
            link.post_step(rank - 1)  # the next step may come as soon as it is ready
            link.finish_sends()
            timer.step("send", step_kind(header[2], header[4]))
    finally:
        timer.write()


def make_parser(parser=None):
    """`luceio stage`'s options: `[MODEL]` and the engine's flags, whose stage-related ones
    must match the engine's."""
    import argparse

    from ..config import EngineArgs
    parser = parser or argparse.ArgumentParser(prog="luceio stage")
    parser.description = ("one pipeline stage of a staged engine on several machines: give the "
                          "engine's model, --devices, --layer-split, --dist-init and "
                          "--world-size, and this stage's --rank")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the engine's model (same as --model)")
    EngineArgs.add_cli_args(parser)
    return parser


def run_stage(ns) -> int:
    """Parsed options -> exit status: 0 once the engine shut the pipeline down, 1 on a mistake
    in the options (one line on stderr) or any failure."""
    from ..config import EngineArgs
    from ..loader.resolve import model_path
    from ..loader import load_checkpoint
    from ..loader.resolve import ModelResolveError
    from .plan import plan_stages
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    try:
        if args.world_size is None or args.rank < 1:
            raise ValueError("a stage needs --world-size W and its --rank, 1 to W-1 (rank 0 is "
                             "the engine: `luceio serve` or LLM)")
        path = model_path(args.model)
        plan = plan_stages(args, load_checkpoint(path).config["num_hidden_layers"])
    except (ValueError, OSError, ModelResolveError) as e:
        print(f"luceio stage: error: {e}", file=sys.stderr)
        return 1
    run_worker(WorkerSpec(args, path, args.rank, plan))
    return 0
