"""Draft-model speculation on the GPU: a chain's k draft steps replay the draft's CUDA graphs
back to back without a host synchronisation between them (`spec.draft`), and greedy output
equals plain decoding."""
import pytest
import torch

from conftest import engine_kwargs
from luceio import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=48)


def prompts(n):
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 384, (5 + 9 * i,), generator=g).tolist()}
            for i in range(n)]


def test_draft_steps_launch_without_a_host_sync(tiny_llama, monkeypatch):
    """With torch's sync debug mode set to "error", a host synchronisation while the draft steps
    are launched (a `.tolist()`, a pageable copy, a stream synchronize) raises. Checked: every
    propose call whose steps all replay graphs (each request feeds at most 2 tokens first: the
    draft's (batch, 2) graphs; catching up on a prompt runs eagerly). Every step drafts a chain
    (not the cost model's choice) of up to 4 tokens (4 requests: larger batches draft
    fewer), greedy and seeded sampled requests in one batch; the greedy ones must equal plain
    decoding."""
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    params = [SamplingParams(**GREEDY) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, ignore_eos=True, max_tokens=48)
              for i in range(4)]
    plain = LLM(tiny_llama, **engine_kwargs(device="cuda", enforce_eager=True)).generate(
        prompts(4), SamplingParams(**GREEDY), use_tqdm=False)
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                          draft_model=tiny_llama, num_speculative_tokens=4))
    proposer = llm.engine.spec.proposer
    assert proposer.runner.graphs is not None and proposer.runner.graphs.graphs
    launch, checked = proposer._launch, []

    def strict(seqs, reqs, ks):
        if max(len(s.all_token_ids) - s.num_computed_tokens for s in seqs) > 2:
            return launch(seqs, reqs, ks)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(seqs, reqs, ks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(len(out[0]))  # draft steps launched
        return out

    proposer._launch = strict
    outs = llm.generate(prompts(4), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs][::2] == \
        [o.outputs[0].token_ids for o in plain][::2]
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    assert len(checked) > 5 and max(checked) > 1


def test_greedy_chain_steps_replay_one_graph(tiny_llama, monkeypatch):
    """`spec.chain`: with every request greedy, a chain's steps past the first are one graph
    replay, launched without a host synchronisation (sync debug mode "error" around it), and
    drafting gives what drafting step by step through the draft's one-step graphs gives: the
    same drafts (so the same acceptance counts) and the output of plain decoding."""
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    plain = LLM(tiny_llama, **engine_kwargs(device="cuda", enforce_eager=True)).generate(
        prompts(4), SamplingParams(**GREEDY), use_tqdm=False)

    def run(chained: bool):
        llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                              draft_model=tiny_llama, num_speculative_tokens=4))
        proposer = llm.engine.spec.proposer
        assert proposer.chain is not None and proposer.chain.graphs
        replays = []
        if not chained:
            proposer.chain = None
        else:
            real = proposer.chain.run

            def strict(*a):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out = real(*a)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                replays.append(max(a[2]))
                return out
            proposer.chain.run = strict
        outs = llm.generate(prompts(4), SamplingParams(**GREEDY), use_tqdm=False)
        st = llm.engine.spec.stats
        return ([o.outputs[0].token_ids for o in outs],
                (st.num_verify_steps, st.num_draft_tokens, st.num_accepted_tokens), replays)

    tokens, stats, replays = run(True)
    ref_tokens, ref_stats, _ = run(False)
    assert tokens == ref_tokens == [o.outputs[0].token_ids for o in plain]
    assert stats == ref_stats and stats[1] > 0
    assert len(replays) > 5 and max(replays) == 3


def test_a_draft_model_on_another_device(tiny_llama, monkeypatch):
    """`--draft-device cpu` with the target on the GPU: greedy output equals plain decoding, and
    seeded sampling with the target drafting for itself (every step a chain) accepts drafts,
    their probabilities moved to the target's device and each device drawing from its own
    generator."""
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    plain = [o.outputs[0].token_ids for o in LLM(tiny_llama, **engine_kwargs(device="cuda")).generate(
        prompts(3), SamplingParams(**GREEDY), use_tqdm=False)]
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                          draft_model=tiny_llama, draft_device="cpu",
                                          num_speculative_tokens=3))
    assert llm.engine.spec.proposer.runner.device == torch.device("cpu")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(3), SamplingParams(**GREEDY),
                                                        use_tqdm=False)]
    assert got == plain
    seeded = SamplingParams(temperature=0.8, seed=3, ignore_eos=True, max_tokens=24)
    out = llm.generate(prompts(3), seeded, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    assert llm.engine.spec.stats.num_accepted_tokens > 0


def test_device_trees_replay_without_a_host_sync(tiny_llama, tmp_path_factory, monkeypatch):
    """`spec.tree_graph`: a greedy draft tree's levels past the first replay one graph each,
    queued without a host synchronisation (sync debug mode "error" around them), and greedy
    tree speculation equals plain decoding, with the device trees and with the host path."""
    from conftest import make_tiny_model
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    draft = make_tiny_model(str(tmp_path_factory.mktemp("gpu_tree") / "m"), "llama", seed=7)
    plain = [o.outputs[0].token_ids for o in LLM(tiny_llama, **engine_kwargs(device="cuda")).generate(
        prompts(4), SamplingParams(**GREEDY), use_tqdm=False)]

    def run(device_trees: bool):
        llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                              draft_model=draft, num_speculative_tokens=5,
                                              spec_tree_budget=16, spec_tree_topk=2))
        proposer = llm.engine.spec.proposer
        graph, launched = proposer.tree_graph, []
        assert graph is not None and len(graph.graphs) == 3 * 4  # buckets 1, 2, 4; levels 2..5
        if not device_trees:
            proposer.tree_graph = None
        else:
            real = graph.launch

            def strict(*a):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    real(*a)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                launched.append(a[2])
            graph.launch = strict
        outs = llm.generate(prompts(4), SamplingParams(**GREEDY), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.spec.stats, launched

    got, stats, launched = run(True)
    assert got == plain and stats.num_accepted_tokens > 0
    assert len(launched) > 5 and max(launched) == 5
    host, host_stats, _ = run(False)
    assert host == plain and host_stats.num_draft_tokens > 0


@pytest.mark.parametrize("tree", [0, 6], ids=["chain", "tree"])
def test_a_draft_with_fewer_vocabulary_rows(tiny_llama, tmp_path_factory, monkeypatch, tree):
    """A target with 64 padding rows past the draft's vocabulary (as Qwen2.5-7B against the
    0.5B): greedy output with graphs equals plain decoding, chains through the chain graph and
    trees through the device levels, with the target emitting ids the draft has no row for."""
    from conftest import VOCAB, make_tiny_model
    from luceio.spec import decoding
    mode = "tree" if tree else "chain"
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: mode)
    target = make_tiny_model(str(tmp_path_factory.mktemp("padded") / "m"), "llama", seed=7,
                             vocab_size=VOCAB + 64)
    plain = LLM(target, **engine_kwargs(device="cuda")).generate(
        prompts(4), SamplingParams(**GREEDY), use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in plain]
    assert any(t >= VOCAB for out in expected for t in out)
    llm = LLM(target, **engine_kwargs(device="cuda", speculative_method="draft",
                                      draft_model=tiny_llama, num_speculative_tokens=4,
                                      spec_tree_budget=tree))
    outs = llm.generate(prompts(4), SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_draft_prefix_cache_on_the_gpu(tiny_llama, monkeypatch):
    """The draft's prefix cache with CUDA graphs: a second turn (the first turn's prompt, its
    output and new tokens) feeds the draft only what follows the cached blocks, and greedy
    output equals plain decoding in both turns (the CPU test: tests/test_spec_draft.py)."""
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "chain")
    params = SamplingParams(**GREEDY)
    first_prompt = prompts(5)[4]["prompt_token_ids"]  # 41 tokens
    plain = LLM(tiny_llama, **engine_kwargs(device="cuda"))
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                          draft_model=tiny_llama, num_speculative_tokens=4))
    prop = llm.engine.spec.proposer
    turn = first_prompt
    for n in range(2):
        want = plain.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
        seen, execute = [], prop.runner.execute

        def spy(inp, probe=None, seen=seen, execute=execute):
            seen.append(int(inp.host.q_lens.max()))
            return execute(inp, probe)
        monkeypatch.setattr(prop.runner, "execute", spy)
        got = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        if n:
            bs = prop.kv.block_size
            assert seen[0] <= len(turn) + 1 - len(first_prompt) // bs * bs
        turn = turn + list(got[0].outputs[0].token_ids) + [11, 12, 13, 14, 15]


@pytest.mark.parametrize("tree", [0, 6], ids=["chain", "tree"])
def test_draft_window_on_the_gpu(tiny_llama, monkeypatch, tree):
    """The draft's context window (`spec_draft_window`) with CUDA graphs: an 80-token prompt's
    first draft feed is the sink block and the 16-token window, later feeds only new tokens, and
    greedy output equals plain decoding (chains and trees; the CPU test:
    tests/test_draft_window.py)."""
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode",
                        lambda self, batch_size, step=None: "tree" if tree else "chain")
    prompt = [(7 * i) % 300 + 3 for i in range(80)]
    params = SamplingParams(**GREEDY)
    want = LLM(tiny_llama, **engine_kwargs(device="cuda")).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm = LLM(tiny_llama, **engine_kwargs(device="cuda", speculative_method="draft",
                                          draft_model=tiny_llama, num_speculative_tokens=3,
                                          spec_draft_window=16, spec_tree_budget=tree))
    prop = llm.engine.spec.proposer
    seen, execute = [], prop.runner.execute

    def spy(inp, probe=None):
        seen.append(int(inp.host.q_lens.max()))
        return execute(inp, probe)
    monkeypatch.setattr(prop.runner, "execute", spy)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.spec.stats.num_verify_steps > 0
    bs = prop.kv.block_size
    assert seen[0] == bs + 16
    assert max(seen[1:]) < bs
