"""The README's GPU performance tables, printed as markdown from committed results: decode at
batch 1 and concurrency (`gpu_bench.py --sections decode,hf,concurrency`), forced-acceptance
speculation (`--sections forced`), the draft model's projection (`draft_cost.py`), verify cost by
tree size (`tree_verify_cost.py`) and kernels per step (`step_profile.py`). Files not given are
skipped.

    python bench/perf_tables.py --dir bench/results/h100 --bench gpu_bench_session33_final.json \
        --forced gpu_bench_forced_session33.json --draft draft_cost_session33_h100.json \
        --tree tree_verify_cost_session33_h100.json --profile step_profile_session33.json
"""
from __future__ import annotations

import argparse
import json
import os


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def decode_table(d: dict) -> list[str]:
    out = [_row("shape", "context", "luceio tok/s", "roofline", "% of roofline", "plain-torch graph",
                "luceio ÷ floor", "best transformers", "luceio ÷ transformers"),
           _row(*["---"] * 9)]
    for r in d["decode_batch1"]:
        hf = max(r.get("hf_eager_dynamic_tok_s") or 0, r.get("hf_static_no_compile_tok_s") or 0)
        out.append(_row(r["shape"], r["context"], r["luceio_tok_s"], r["roofline_tok_s"],
                        f"{100 * r['fraction_of_roofline']:.1f}%", r["torch_graph_floor_tok_s"],
                        f"{r['speedup_vs_torch_floor']:.2f}×", hf or "-",
                        f"{r['speedup_vs_best_hf']:.1f}×" if hf else "-"))
    return out


def concurrency_table(d: dict) -> list[str]:
    out = [_row("concurrent", "output tok/s, ids", "TTFT p50 / p99 ms", "inter-token p50 / p99 ms",
                "detokenized tok/s", "TTFT p50 / p99 ms", "inter-token p50 / p99 ms"),
           _row(*["---"] * 7)]
    text = {r["concurrency"]: r for r in d.get("concurrency_1.5b_text", [])}
    for r in d.get("concurrency_1.5b", []):
        t = text.get(r["concurrency"])
        cells = [r["concurrency"], r["output_tok_s"], f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']}",
                 f"{r['itl_ms_p50']} / {r['itl_ms_p99']}"]
        cells += ([t["output_tok_s"], f"{t['ttft_ms_p50']} / {t['ttft_ms_p99']}",
                   f"{t['itl_ms_p50']} / {t['itl_ms_p99']}"] if t else ["-"] * 3)
        out.append(_row(*cells))
    return out


def forced_table(d: dict) -> list[str]:
    rows = next(v for k, v in d.items() if k.startswith("spec_forced_acceptance"))
    rates = sorted({r["forced_accept_rate"] for r in rows})
    out = [_row("batch", "plain tok/s", *(f"acceptance {a}: speedup (tokens a verify)" for a in rates),
                "outputs identical"), _row(*["---"] * (len(rates) + 3))]
    for b in sorted({r["batch"] for r in rows}):
        rs = {r["forced_accept_rate"]: r for r in rows if r["batch"] == b}
        same = all(r["outputs_identical"] for r in rs.values())
        out.append(_row(b, rs[rates[0]]["plain_tok_s"],
                        *(f"{rs[a]['speedup']:.2f}× ({rs[a]['mean_tokens_per_verify']})" for a in rates),
                        "yes" if same else "no"))
    return out


def draft_table(d: dict) -> list[str]:
    out = [_row("drafts", "propose ms", "spec step ms", "plain step ms", "tokens a verify",
                "projected speedup"), _row(*["---"] * 6)]
    for r in d["rows"]:
        if r.get("measured_on_cpu"):
            out.append(_row(f"chain k = {r['k']}", r["propose_ms"], r["spec_step_ms"], r["plain_step_ms"],
                            r["tokens_per_verify"], f"{r['projected_speedup']:.2f}×"))
    for r in d.get("trees", []):
        out.append(_row(f"tree of {r['tree_budget']} ({r['levels']} levels, top-{r['topk']})", "-",
                        r["spec_step_ms"], r["plain_step_ms"], r["tokens_per_verify"],
                        f"{r['projected_speedup']:.2f}×"))
    return out


def tree_table(d: dict) -> list[str]:
    batches = sorted({r["batch"] for r in d["rows"]})
    steps = list(dict.fromkeys(r["step"] for r in d["rows"]))
    out = [_row("step", *(f"batch {b} ms (× plain)" for b in batches)), _row(*["---"] * (len(batches) + 1))]
    for s in steps:
        cells = []
        for b in batches:
            r = next((r for r in d["rows"] if r["step"] == s and r["batch"] == b), None)
            cells.append(f"{r['ms']} ({r['vs_plain']}×)" if r else "-")
        out.append(_row(s, *cells))
    return out


def profile_table(d: dict) -> list[str]:
    out = [_row("shape", "weights", "CUDA graphs", "tok/s unprofiled", "kernels a step",
                "GPU busy µs a step", "step µs unprofiled", "GPU idle, unprofiled step"),
           _row(*["---"] * 8)]
    for r in d["rows"]:
        step = 1e6 / r["tok_s_unprofiled"]
        idle = max(0.0, 1 - r["gpu_busy_us_per_step"] / step)
        graphs = {True: "yes", False: "no"}.get(r.get("cuda_graphs"), "-")
        out.append(_row(r["shape"], r["type"], graphs, r["tok_s_unprofiled"],
                        int(r["kernels_per_step"]), r["gpu_busy_us_per_step"], f"{step:.1f}",
                        f"{100 * idle:.1f}%"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "results", "h100"))
    for name in ("bench", "forced", "draft", "tree", "profile"):
        ap.add_argument("--" + name)
    a = ap.parse_args()
    tables = [("bench", "decode, batch 1", decode_table), ("bench", "concurrency", concurrency_table),
              ("forced", "forced acceptance", forced_table), ("draft", "draft model", draft_table),
              ("tree", "verify cost", tree_table), ("profile", "kernels a step", profile_table)]
    for arg, title, fn in tables:
        name = getattr(a, arg)
        if name:
            with open(os.path.join(a.dir, name)) as f:
                d = json.load(f)
            print(f"<!-- {title}: {name} ({d['env'].get('gpu')}, {d['env'].get('date')}) -->")
            print("\n".join(fn(d)) + "\n")


if __name__ == "__main__":
    main()
