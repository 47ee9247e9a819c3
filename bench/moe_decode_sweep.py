"""Launch configs of the few-token MoE kernels (`kernels/moe_decode_triton.py`) on the GPU: one
token's top-k experts of a real MoE layer shape, the gate/up launch's fields swept first (the
down launch at the table's), then the down launch's with the best gate/up.

    python bench/moe_decode_sweep.py [--out bench/results/h200/moe_decode_sweep.json]
                                     [--write-user-config]

Each config is timed as 64 calls captured in one CUDA graph (as decode steps run them: no host
launch cost in the time), each call with another of 64 routings, so the experts' weights come
from HBM rather than L2 (a layer's stacks are 0.8-1.2 GB), the graph replayed 5 times; the
bytes moved per call are the k experts' gate/up and down weights. `--write-user-config` stores the
best fields in `$LUCEIO_CACHE/kernel_configs/<arch>.json` (`kernels/configs.py`), which later
engines in the same environment read.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, env_info, write_json  # noqa: E402

from luceio.kernels import configs  # noqa: E402
from luceio.kernels.moe_decode_triton import moe_decode, route_topk  # noqa: E402

SHAPES = {"qwen3.5-35b-a3b": (2048, 512, 256, 8), "qwen3-30b-a3b": (2048, 768, 128, 8)}
GATE_UP = [dict(moe_decode_gu_block_n=n, moe_decode_gu_block_k=k, moe_decode_gu_num_warps=w)
           for n in (2, 4, 8, 16, 32) for k in (128, 256, 512, 1024) for w in (1, 2, 4, 8)
           if n * k <= 16384]
DOWN = [dict(moe_decode_down_block_n=n, moe_decode_down_block_k=k, moe_decode_down_num_warps=w)
        for n in (2, 4, 8, 16, 32) for k in (128, 256, 512) for w in (1, 2, 4, 8)
        if n * k <= 8192]


def time_call(fn, calls: int = 64, replays: int = 5) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph (as the engine's
    decode steps run them: no host launch cost), the graph replayed `replays` times."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)  # allocations of the call made outside the capture first
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h200",
                                                  "moe_decode_sweep.json"))
    ap.add_argument("--write-user-config", action="store_true")
    a = ap.parse_args()
    bw = copy_bandwidth()
    dev = torch.device("cuda")
    base = configs.get_config(dev)
    res = {"env": env_info(), "copy_bandwidth_GB_s": round(bw / 1e9, 1), "shapes": {}}
    setups = []
    for name, (hidden, inter, experts, k) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w_gu = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16,
                           generator=g) * 0.02
        w_d = torch.randn(experts, hidden, inter, device=dev, dtype=torch.bfloat16,
                          generator=g) * 0.02
        x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        routes = [route_topk(torch.randn(1, experts, device=dev, generator=g,
                                         dtype=torch.bfloat16), k, True) for _ in range(64)]
        nbytes = k * 3 * inter * hidden * 2
        setups.append((name, x, w_gu, w_d, routes, nbytes))

    def measure(fields: dict) -> dict:
        row = {**fields}
        with configs.use_config(replace(base, **fields)):
            for name, x, w_gu, w_d, routes, nbytes in setups:
                def call(i, x=x, w_gu=w_gu, w_d=w_d, routes=routes):
                    w, ids = routes[i % len(routes)]
                    moe_decode(x, w_gu, w_d, w, ids)
                us = time_call(call)
                row[name] = {"us": round(us, 2),
                             "copy_fraction": round(nbytes / us / 1e3 / (bw / 1e9), 3)}
        row["geomean_copy_fraction"] = round(float(torch.tensor(
            [row[s[0]]["copy_fraction"] for s in setups]).log().mean().exp()), 4)
        print(row, flush=True)
        return row

    res["baseline"] = measure({})
    rows = [measure(f) for f in GATE_UP]
    best_gu = max(rows, key=lambda r: r["geomean_copy_fraction"])
    gu = {k: best_gu[k] for k in GATE_UP[0]}
    rows += [measure({**gu, **f}) for f in DOWN]
    best = max(rows, key=lambda r: r["geomean_copy_fraction"])
    fields = {k: best[k] for k in list(GATE_UP[0]) + list(DOWN[0]) if k in best}
    fields = {**{k: v for k, v in asdict(base).items() if k.startswith("moe_decode_")}, **fields}
    res.update(rows=rows, best=best, best_fields=fields)
    write_json(a.out, res)
    print("best", json.dumps(fields), best["geomean_copy_fraction"], "baseline",
          res["baseline"]["geomean_copy_fraction"])
    if a.write_user_config:
        path = configs.user_config_path(configs.device_arch(dev))
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**old, **fields}))
        print("wrote", path)


if __name__ == "__main__":
    main()
