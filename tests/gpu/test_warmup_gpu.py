"""The eager warm-up (luceio/warmup.py): after an engine starts, prefill and mixed steps compile
no new variant of the varlen attention kernels (the cold 64-stream stall of session 33)."""
import pytest
import torch
import triton
import triton.language as tl

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@triton.jit
def _probe_kernel(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N))


def test_warm_engine_compiles_no_attention_variant_while_serving(tiny_llama, monkeypatch):
    monkeypatch.setenv("LUCEIO_EAGER_WARMUP", "1")
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", dtype="bfloat16", max_num_seqs=8,
                                          max_num_batched_tokens=64))
    misses = []

    def hook(**kw):
        misses.append(str(kw.get("repr", "")))
        return None
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", hook)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}
               for n in (5, 20, 37, 90, 150, 3, 64, 17)]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    attention = [m.split("[")[0] for m in misses if "_prefill" in m]
    assert not attention, attention
    # the hook sees compiles in this Triton: a kernel never launched before is one
    _probe_kernel[(1,)](torch.empty(16, dtype=torch.int32, device="cuda"), N=16)
    assert any("_probe_kernel" in m for m in misses)
