"""Memory the runner holds: the KV pool (zeroed; on the CPU mapped page by page as it is
used), a KV block's size, the pinned buffers that stage each step's inputs, hybrid models'
state slots, handing freed heap back to the OS after loading, and then keeping the heap that
steps free (`keep_freed_heap`)."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch


def return_freed_heap() -> None:
    """Hands the heap that loading freed (the GGUF reader's metadata, repacking's temporaries)
    back to the OS: glibc keeps it otherwise, ~15 MiB for Qwen2.5-Coder-0.5B. A no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
HEAP_KEEP_BYTES = 1 << 30
"""Allocations below this come from the heap once `keep_freed_heap` ran."""


def keep_freed_heap() -> bool:
    """From now on (glibc; the CPU engine calls it after loading): allocations below
    `HEAP_KEEP_BYTES` come from the heap, and freed heap stays mapped (no automatic trim).
    A CPU prefill step allocates each layer's activations afresh, e.g. the fp32 gate/up output
    of the 0.5B, 20 MB at 512 tokens: past glibc's mmap threshold (at most 32 MiB, raised only
    to the largest mapping freed so far) each was a new mapping whose pages fault in on their
    first write, ~25 ms for those 20 MB against ~1 ms to convert them. With the heap kept, a
    512-token prefill of real Qwen2.5-Coder-0.5B took 0.72-0.80 s instead of 0.99-1.17 s
    (2,048 tokens: 4.9-5.0 s against 5.9), for 30-100 MiB more resident memory: the largest
    step's activations stay mapped. Returns whether glibc took both settings."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_KEEP_BYTES)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))
    except (AttributeError, OSError):  # not glibc
        return False


def zeros_pool(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool. On the CPU it is one anonymous mapping in small pages: the OS maps a
    page on its first write, so the process holds the KV it has used rather than the whole pool
    from the start (`torch.zeros` writes every page; huge pages would map 2 MiB per layer for
    the first token)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, max(1, int(np.prod(shape)) * dtype.itemsize))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def kv_dtype(name: str, dtype: torch.dtype, device) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `name` and a model computing in `dtype` on
    `device`. Raises ValueError where it is not supported: a bf16 cache beside another dtype
    on a GPU (the kernels read the cache in the model's dtype)."""
    if name == "auto":
        return dtype
    if name != "bfloat16":
        raise ValueError(f"--kv-cache-dtype {name!r}: auto or bfloat16")
    if torch.device(device).type != "cpu" and dtype != torch.bfloat16:
        raise ValueError(f"--kv-cache-dtype bfloat16 on {device} needs a bfloat16 model "
                         f"(this one computes in {dtype}); on the CPU any")
    return torch.bfloat16


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    shapes = cfg.kv_layer_shapes
    if shapes is not None:  # per-layer shapes (Gemma 4)
        return sum(2 * block_size * heads * dim * elt for heads, dim in shapes)
    return 2 * cfg.num_kv_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elt


_ZEROS = np.zeros(16, np.int64)


class Staging:
    """Host→device transfers of many small int arrays as one copy per dtype, through persistent
    pinned buffers (allocating pinned memory per step costs more than the copy). Each dtype has
    `NUM_BUFFERS` buffers taken in turn, each with an event recorded after its last copy: before
    a buffer is rewritten the host waits for that copy alone, never for the device's other work,
    so the next step is staged while the device still runs this one."""
    NUM_BUFFERS = 2
    ALIGN_BYTES = 16  # each array's start in the packed copy (Triton's alignment specialisation)

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict = {}  # dtype -> [(pinned buffer, event of its last copy)]
        self.turn: dict = {}  # dtype -> index of the buffer to use next

    def to_device(self, dtype, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays as device tensors of `dtype`, each starting `ALIGN_BYTES`-aligned in the
        packed copy: Triton specialises a kernel on its pointers' 16-byte alignment, so packing
        them end to end made each new block-table width a new compile of the prefill kernels
        (~2 s each on an H100, bench/results/h100/triton_compiles_session34.log)."""
        step = max(self.ALIGN_BYTES // np.dtype(dtype).itemsize, 1)
        sizes, parts, starts, at = [], [], [], 0
        for a in arrays:
            parts.append(a.reshape(-1).astype(dtype, copy=False))
            sizes.append(a.size)
            starts.append(at)
            gap = -a.size % step
            if gap:
                parts.append(_ZEROS[:gap].astype(dtype, copy=False))
            at += a.size + gap
        packed = np.concatenate(parts) if parts else np.zeros(0, dtype)
        if self.device.type == "cpu":
            flat = torch.from_numpy(packed)
        else:
            ring = self.buffers.setdefault(dtype, [None] * self.NUM_BUFFERS)
            i = self.turn.get(dtype, 0)
            self.turn[dtype] = (i + 1) % self.NUM_BUFFERS
            buf, event = ring[i] or (None, None)
            if event is not None:
                event.synchronize()  # the last copy out of this buffer has left it
            if buf is None or buf.numel() < packed.size:
                buf = torch.empty(max(packed.size, 1 << 16), dtype=torch.from_numpy(packed[:0]).dtype,
                                  pin_memory=True)
            buf[:packed.size].numpy()[:] = packed
            flat = buf[:packed.size].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(current_stream(self.device))
            ring[i] = (buf, event)
        return [flat[o:o + n] for o, n in zip(starts, sizes)]


_STREAMS: dict = {}


def current_stream(device: torch.device):
    """`torch.cuda.current_stream(device)`, one C call and a dict lookup a step instead of its
    argument parsing (~35 us of host time a decode step in two calls, host_profile.py): the
    stream object is kept per (stream id, device) that torch reports current."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    lookup = getattr(torch._C, "_cuda_getCurrentStream", None)
    if lookup is None:  # a torch without it
        return torch.cuda.current_stream(index)
    key = lookup(index)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


class StateSlots:
    """Hybrid models' state rows: one per running request, taken at its first step and given
    back once the KV manager no longer holds the request (finished, aborted or preempted; a
    preempted request starts again from its first token, so from a zeroed row)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))
        self.of: dict[str, int] = {}

    def assign(self, scheduled, kv) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each scheduled request, the slots to zero first: requests at their first
        token)."""
        for rid in [rid for rid in self.of if rid not in kv.block_tables]:
            self.free.append(self.of.pop(rid))
        slots, fresh = [], []
        for s in scheduled:
            rid = s.req.request_id
            if rid not in self.of:
                if not self.free:
                    raise RuntimeError("no free state slot: more running requests than "
                                       "--max-num-seqs")
                self.of[rid] = self.free.pop()
            slots.append(self.of[rid])
            if s.req.num_computed_tokens == 0:
                fresh.append(self.of[rid])
        return np.asarray(slots, dtype=np.int64), np.asarray(fresh, dtype=np.int64)
