"""What the skinny quantized dot (kernels/quant_triton.py `_skinny_kernel`) compiles to for a GPU
arch, with no GPU: Triton compiles it ahead of time for the target (its bundled ptxas), and
the machine code is read with its bundled nvdisasm / cuobjdump. Per config: registers a thread,
spills, shared memory, and each loop's instruction count and mix, a loop being the code from a
label to the branch back to it (the K loop is the long one). A way to compare kernel variants
between GPU sessions; time them on the GPU (bench/skinny_sweep.py) before a config changes.

    python bench/sass_stats.py [--arch 90] [--qtypes q4_k,q6_k] [--block-ms 16,32]
        [--block-ns 64] [--block-ks 128,256] [--warps 4] [--stages 3] [--swaps 0,1]
        [--packed 0,1] [--prefetch 0,1] [--n 17920 --k 1536] [--json OUT.json]

`--n` / `--k` set the integer arguments Triton specialises on (multiples of 16 are marked
divisible by 16, as a launch marks them): the 1.5B gate/up projection by default. Needs the
`triton` wheel's NVIDIA backend (ptxas, nvdisasm, cuobjdump under triton/backends/nvidia/bin).
"""
from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_INSTR = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")
_LABEL = re.compile(r"\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?\.(L_x_\d+)")


def _bin(name: str) -> str:
    import triton
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                   name))
    if not found:
        raise SystemExit(f"no {name} in the triton wheel's NVIDIA backend")
    return found[0]


def compile_skinny(arch: int, qtype: str, block_m: int, block_n: int, block_k: int, warps: int,
                   stages: int, swap: bool, n: int, k: int, packed: bool = False,
                   prefetch: bool = False):
    """The compiled `_skinny_kernel` (a triton CompiledKernel) for one config, on the dot path,
    unsplit, no bias, no PDL; q4_k / q5_k scales in the paired form the GPU keeps them in."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from luceio.kernels import quant_triton as qt
    fn = qt._skinny_kernel
    names = list(fn.arg_names)
    ptrs = {"x_ptr": "*bf16", "qs_ptr": "*u8", "qh_ptr": "*i32", "d_ptr": "*fp16",
            "m_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8", "bias_ptr": "*bf16",
            "out_ptr": "*bf16", "part_ptr": "*fp32"}
    kg = k // 32
    paired = 2 if qtype in ("q4_k", "q5_k") else 1
    ints = {"N": n, "K": k, "KG": kg, "s_qs": k // 2 if qtype != "q8_0" else k, "s_qh": kg,
            "s_d": paired * max(1, kg // 8), "s_sc": paired * kg, "e_d": paired,
            "e_sc": paired, "s_xm": k, "s_om": n}
    const = dict(QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=True,
                 DOT_F32=False, DOT_IEEE=False, SPLIT=False, HAS_BIAS=False, PDL=False,
                 PDL_EARLY=False, SWAP=swap, PACKED=packed, ASM=packed,
                 PREFETCH=packed and prefetch)
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        sig[name] = ptrs.get(name, "constexpr" if name in const else "i32")
        if name in ptrs or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(c),): v for c, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def sass_stats(cubin: bytes) -> dict:
    """Registers, spills and shared memory (cuobjdump -res-usage), the instruction count, and
    per loop its length and its 12 most frequent opcodes."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.search(line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            ops = collections.Counter(mm.group(2) for x in lines[labels[m.group(1)]:i + 1]
                                      if (mm := _INSTR.match(x)))
            if sum(ops.values()) > 1:
                loops.append({"instructions": sum(ops.values()), "mix": ops.most_common(12)})
    total = sum(1 for x in lines if _INSTR.match(x))
    return {"registers": int(res.get("REG", 0)), "stack": int(res.get("STACK", 0)),
            "local": int(res.get("LOCAL", 0)), "instructions": total, "loops": loops}


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 89, 86")
    ap.add_argument("--qtypes", default="q4_k,q6_k")
    ap.add_argument("--block-ms", default="16,32")
    ap.add_argument("--block-ns", default="64")
    ap.add_argument("--block-ks", default="128,256")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--swaps", default="0,1")
    ap.add_argument("--packed", default="0", help="0,1: packed bf16x2 dequantization "
                    "(qgemm_packed; 4-bit types, swapped operands only)")
    ap.add_argument("--prefetch", default="0", help="0,1: packed tiles' scales loaded a K tile "
                    "ahead (qgemm_prefetch_scales)")
    ap.add_argument("--n", type=int, default=17920)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = []
    for qtype, bm, bn, bk, w, s, sw, pk, pf in itertools.product(
            a.qtypes.split(","), _ints(a.block_ms), _ints(a.block_ns), _ints(a.block_ks),
            _ints(a.warps), _ints(a.stages), _ints(a.swaps), _ints(a.packed), _ints(a.prefetch)):
        if pf and not pk:
            continue
        kernel = compile_skinny(a.arch, qtype, bm, bn, bk, w, s, bool(sw), a.n, a.k, bool(pk),
                                bool(pf))
        st = sass_stats(kernel.asm["cubin"])
        loop = max(st["loops"], key=lambda lp: lp["instructions"], default=None)
        per_weight = loop and loop["instructions"] * w * 32 / (bn * bk)
        row = dict(arch=a.arch, qtype=qtype, block_m=bm, block_n=bn, block_k=bk, warps=w,
                   stages=s, swap=bool(sw), packed=bool(pk), prefetch=bool(pf),
                   shared=kernel.metadata.shared, **st,
                   loop_instructions_per_weight=per_weight and round(per_weight, 2))
        rows.append(row)
        print(f"{qtype} m{bm} n{bn} k{bk} w{w} s{s} swap{sw} packed{pk} prefetch{pf}: "
              f"{st['registers']} regs, "
              f"stack {st['stack']}, shared {kernel.metadata.shared} B, K loop "
              f"{loop and loop['instructions']} instructions a thread "
              f"({row['loop_instructions_per_weight']} per weight), "
              f"{loop and dict(loop['mix'][:8])}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
