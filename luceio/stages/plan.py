"""Stage plans: which decoder layers run on which device, checked before any process starts.

Pure logic (no tensors, no processes): `--devices` and `--layer-split` become one `StagePlan`,
and every combination a staged run does not support is refused here with a ValueError that
names the flag, so nothing is done wrong later.

Two ways to start the stages: by default the engine's process spawns one process per further
stage on its own machine (`spawn`). With `--world-size W` (several machines) it spawns none:
every stage r in 1..W-1 is started by hand with `luceio stage ... --rank r`, with the same
model, `--devices` (all W, in rank order; each process uses entry r), `--layer-split`,
`--dist-init` and `--world-size`, and all of them join the rendezvous at `--dist-init`, the
engine's machine (`--rank 0`, the default).

Transport (`--stage-transport`): `host` sends hidden states over Gloo through host memory
between any two devices; `nccl` sends them device to device over NCCL (RCCL on a ROCm build),
which needs every stage on a CUDA device and every process on the same vendor's PyTorch build;
`auto` takes NCCL when that holds and host otherwise. One transport serves every boundary of a
run. The plan checks what it can see (the devices); the vendors are known once the processes
have joined (`choose_transport`, called by every process with what they all sent)."""
from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StagePlan:
    devices: tuple[str, ...]  # one per stage, rank order
    layer_ranges: tuple[tuple[int, int], ...]  # [start, end) of each stage's decoder layers
    dist_init: str  # the rendezvous, tcp://HOST:PORT (rank 0 listens there)
    spawn: bool = True  # rank 0 spawns the other stages; else they are started by hand
    transport: str = "auto"  # --stage-transport as asked: auto, host or nccl

    @property
    def num_stages(self) -> int:
        return len(self.devices)


def parse_devices(devices: str) -> tuple[str, ...]:
    """`cuda:0,cpu` -> ("cuda:0", "cpu"); each entry must be a device torch knows."""
    names = tuple(d.strip() for d in devices.split(","))
    for d in names:
        try:
            torch.device(d)
        except RuntimeError:
            raise ValueError(f"--devices {devices!r}: {d!r} is not a device "
                             "(cpu, cuda, cuda:N)") from None
    return names


def layer_ranges(split: str, num_stages: int, num_layers: int) -> tuple[tuple[int, int], ...]:
    """`auto`: layers as even as possible, the later stages taking one more each where they do
    not divide (the first stage also samples); `N1,N2,...`: one positive count per stage,
    summing to the model's layers."""
    if split == "auto":
        if num_layers < num_stages:
            raise ValueError(f"--layer-split auto: {num_stages} stages need at least as many "
                             f"layers; the model has {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (i >= num_stages - extra) for i in range(num_stages)]
    else:
        try:
            counts = [int(n) for n in split.split(",")]
        except ValueError:
            raise ValueError(f"--layer-split {split!r}: give auto or comma-separated layer "
                             "counts, one per stage (e.g. 12,12)") from None
        if len(counts) != num_stages:
            raise ValueError(f"--layer-split {split!r} has {len(counts)} counts for "
                             f"{num_stages} stages (--devices)")
        if any(n <= 0 for n in counts):
            raise ValueError(f"--layer-split {split!r}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ValueError(f"--layer-split {split!r} sums to {sum(counts)} layers; the model "
                             f"has {num_layers}")
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return tuple((s, s + n) for s, n in zip(starts, counts))


def plan_stages(args, num_layers: int) -> StagePlan | None:
    """The stage plan of `args` (an EngineArgs), or None for a one-device run."""
    if args.stage_micro_batches < 1:
        raise ValueError(f"--stage-micro-batches must be >= 1, got {args.stage_micro_batches}")
    if args.devices is None:
        if args.layer_split != "auto":
            raise ValueError("--layer-split needs --devices (one device per stage)")
        if args.world_size is not None or args.rank != 0:
            raise ValueError("--world-size and --rank need --devices (one device per stage)")
        return None
    devices = parse_devices(args.devices)
    if args.world_size is not None:
        _check_world(args, devices)
    elif args.rank != 0:
        raise ValueError("--rank needs --world-size (stages started by hand on several "
                         "machines)")
    if args.dist_init is not None:
        parse_dist_init(args.dist_init)
    # the devices of this machine's stages: all of them, or with --world-size this rank's
    for d in devices if args.world_size is None else devices[args.rank:args.rank + 1]:
        _check_present(d, args.devices)
    if args.device != "auto" and torch.device(args.device) != torch.device(devices[0]):
        raise ValueError(f"--device {args.device} and --devices {args.devices}: the first "
                         "stage's device is the engine's; give one of the two")
    if len(devices) == 1:
        if args.layer_split != "auto":
            raise ValueError("--layer-split needs at least two --devices")
        return None
    _refuse_unsupported(args)
    if args.stage_transport == "nccl" and any(torch.device(d).type != "cuda" for d in devices):
        raise ValueError(f"--stage-transport nccl needs every stage on a CUDA device; --devices "
                         f"{args.devices} has another: pass --stage-transport host (or auto)")
    if (args.stage_transport == "nccl" and args.world_size is None
            and len({torch.device(d).index or 0 for d in devices}) < len(devices)):
        raise ValueError(f"--stage-transport nccl needs every stage on a CUDA device of its own "
                         f"(two ranks on one GPU cannot join one NCCL group); --devices "
                         f"{args.devices} repeats one: pass --stage-transport host (or auto)")
    return StagePlan(devices, layer_ranges(args.layer_split, len(devices), num_layers),
                     args.dist_init or f"tcp://127.0.0.1:{free_port()}",
                     spawn=args.world_size is None, transport=args.stage_transport)


def nccl_vendor() -> str:
    """The NCCL of this process's PyTorch build: cuda, rocm (RCCL), or none."""
    if not dist.is_nccl_available():
        return "none"
    return "rocm" if torch.version.hip else "cuda"


def choose_transport(asked: tuple[str, ...], devices: tuple[str, ...], vendors: tuple[str, ...],
                     hosts: tuple[str, ...]) -> str:
    """`host` or `nccl` for a run, from every process's --stage-transport (`asked`), the
    stages' devices, every process's `nccl_vendor()` and host name, all in rank order. Every
    process calls it with the same values, so all choose alike. NCCL needs every stage on a
    CUDA device of its own (two ranks on one GPU cannot join one NCCL group) and one vendor's
    NCCL in every process. A ValueError when the processes cannot agree."""
    if len(set(asked)) > 1:
        raise ValueError("every stage must be given the same --stage-transport; ranks 0.."
                         f"{len(asked) - 1} were given {', '.join(asked)}")
    gpus = [(h, torch.device(d)) for h, d in zip(hosts, devices)]
    all_cuda = all(d.type == "cuda" for _, d in gpus)
    own_gpus = len({(h, d.index or 0) for h, d in gpus}) == len(gpus)
    one_vendor = len(set(vendors)) == 1 and vendors[0] in ("cuda", "rocm")
    if asked[0] == "nccl" and not (all_cuda and own_gpus and one_vendor):
        raise ValueError("--stage-transport nccl needs every stage on a CUDA device of its own "
                         f"and one vendor's NCCL; the stages run on {', '.join(devices)} (hosts "
                         f"{', '.join(hosts)}), and their PyTorch builds' NCCL is "
                         f"{', '.join(vendors)}: pass --stage-transport host")
    return "nccl" if asked[0] != "host" and all_cuda and own_gpus and one_vendor else "host"


def _check_present(device: str, devices: str) -> None:
    d = torch.device(device)
    if d.type != "cuda":
        return
    count = torch.cuda.device_count()
    if (d.index or 0) >= count:
        raise ValueError(f"--devices {devices}: {device} is not on this machine (PyTorch sees "
                         f"{count} CUDA device{'s' if count != 1 else ''})")


def _check_world(args, devices: tuple[str, ...]) -> None:
    if args.world_size != len(devices):
        raise ValueError(f"--world-size {args.world_size}: --devices {args.devices} names "
                         f"{len(devices)} stages; give one device per rank, in rank order")
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank {args.rank} is not in [0, --world-size {args.world_size})")
    if args.dist_init is None:  # a port chosen here would be unknown to the other machines
        raise ValueError("--world-size needs --dist-init tcp://HOST:PORT: the engine's "
                         "machine, where every stage joins")


def parse_dist_init(dist_init: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (HOST, PORT): the rendezvous rank 0 listens on."""
    url = urlsplit(dist_init)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or not port or url.path not in ("", "/"):
        raise ValueError(f"--dist-init {dist_init!r}: give tcp://HOST:PORT (the engine's "
                         "machine and a free port there)")
    return url.hostname, port


def _refuse_unsupported(args) -> None:
    refused = {"--preemption-mode swap": args.preemption_mode == "swap",
               "--kv-resident-tokens": bool(args.kv_resident_tokens),
               "--spec-prefill-keep": args.spec_prefill_keep is not None}
    named = [flag for flag, on in refused.items() if on]
    if named:
        raise ValueError(f"pipeline stages (--devices) do not support {', '.join(named)} yet")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_identity(config: dict) -> str:
    """A digest of a checkpoint's config: every stage must load the same model."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
