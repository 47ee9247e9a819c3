"""Draft trees (luceio.spec.tree): layout facts, greedy acceptance, and that sampling acceptance
leaves the target's distribution unchanged (chi-square, with negative controls that the same
test catches)."""
from __future__ import annotations

import pytest
import torch

from luceio.spec.tree import MAX_ROWS, DraftTree, accept, masks_tensor

V = 6
ALPHA = 1e-4
N = 30_000
# root -> 2 -> {5, 1 -> 3}; root -> 4 -> 0   (rows: root 0, then nodes 1..6)
TREE = DraftTree(tokens=[2, 4, 5, 1, 0, 3], parents=[-1, -1, 0, 0, 1, 3])


def _dists(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    soft = torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5, -1)
    return (0.7 * soft + 0.3 / V).float()


def _chi2_pvalue(samples, probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.as_tensor(samples, dtype=torch.long), minlength=V).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), stat / 2))


def test_layout():
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    assert TREE.children() == [[1, 2], [3, 4], [5], [], [6], [], []]
    m = TREE.ancestor_masks()
    assert m[0] == 0b1 and m[1] == 0b11 and m[2] == 0b101
    assert m[4] == 0b10011 and m[6] == 0b1010011  # row 6 (token 3): root, 2, 1, itself
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == [-1, 0, 1] and chain.depths() == [1, 2, 3]
    assert chain.ancestor_masks() == [0b1, 0b11, 0b111, 0b1111]  # causal
    assert masks_tensor([1 << 63, 5]).tolist() == [-(1 << 63), 5]


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2], [-1], "parents"), ([1, 2], [1, -1], "precede"), ([1, 1], [-1, -1], "repeats"),
    (list(range(MAX_ROWS)), [-1] * MAX_ROWS, "at most")])
def test_bad_trees_are_refused(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents)


def _logits_with_argmax(best: list[int]) -> torch.Tensor:
    out = torch.zeros(len(best), V)
    out[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return out


def test_greedy_takes_the_matching_branch():
    # root predicts 4 (row 2), row 2 predicts 0 (row 5), row 5 predicts 3: leaf -> bonus 3
    rows, toks = accept(TREE, _logits_with_argmax([4, 1, 0, 1, 1, 3, 1]), greedy=True)
    assert rows == [2, 5] and toks == [4, 0, 3]
    # root predicts 2, row 1 predicts 1 (row 4), row 4 predicts 2: no child 2 -> stop
    rows, toks = accept(TREE, _logits_with_argmax([2, 1, 0, 0, 2, 0, 0]), greedy=True)
    assert rows == [1, 4] and toks == [2, 1, 2]
    rows, toks = accept(TREE, _logits_with_argmax([3, 0, 0, 0, 0, 0, 0]), greedy=True)
    assert rows == [] and toks == [3]  # nothing under the root matches


def test_greedy_chain_equals_chain_verification():
    chain = DraftTree.chain([1, 2, 3])
    rows, toks = accept(chain, _logits_with_argmax([1, 2, 5, 0]), greedy=True)
    assert rows == [1, 2] and toks == [1, 2, 5]


def _sample_paths(target, generator, n=N):
    return [accept(TREE, target, greedy=False, generator=generator)[1] for _ in range(n)]


def test_sampling_keeps_the_target_distribution():
    """The first token is distributed as the root's p; the second, given a first token that was a
    node, as that node's p (here p of row 1 given 2, of row 2 given 4)."""
    g = torch.Generator().manual_seed(0)
    p = _dists(1, TREE.num_nodes + 1)
    outs = _sample_paths(p, g)
    assert _chi2_pvalue([o[0] for o in outs], p[0]) > ALPHA
    assert _chi2_pvalue([o[1] for o in outs if o[0] == 2], p[1]) > ALPHA
    assert _chi2_pvalue([o[1] for o in outs if o[0] == 4], p[2]) > ALPHA
    # every accepted path emits one token past its accepted nodes, and follows the tree
    for o in outs[:2000]:
        assert 1 <= len(o) <= 4


def test_a_point_mass_child_is_always_accepted():
    p = torch.zeros(TREE.num_nodes + 1, V)
    p[:, 1] = 1.0
    p[0] = torch.nn.functional.one_hot(torch.tensor(4), V).float()  # root: all on token 4
    p[2] = torch.nn.functional.one_hot(torch.tensor(0), V).float()  # row 2: all on 0
    rows, toks = accept(TREE, p, greedy=False, generator=torch.Generator().manual_seed(0))
    assert rows == [2, 5] and toks == [4, 0, 1]


def test_negative_controls_are_caught():
    """The same chi-square test rejects two wrong acceptance rules."""
    g = torch.Generator().manual_seed(1)
    p = _dists(2, TREE.num_nodes + 1)
    kids = [TREE.tokens[c - 1] for c in TREE.children()[0]]
    firsts_wrong_a, firsts_wrong_b = [], []
    for _ in range(N):
        # (a) accept a child with p(t) but on rejection resample from the full p
        t = next((k for k in kids if float(torch.rand((), generator=g)) < float(p[0, k])), None)
        firsts_wrong_a.append(t if t is not None else int(torch.multinomial(p[0], 1, generator=g)))
        # (b) accept the first child with probability 1/2, whatever p says
        firsts_wrong_b.append(kids[0] if float(torch.rand((), generator=g)) < 0.5
                              else int(torch.multinomial(p[0], 1, generator=g)))
    assert _chi2_pvalue(firsts_wrong_a, p[0]) < ALPHA
    assert _chi2_pvalue(firsts_wrong_b, p[0]) < ALPHA


# in the engine (tiny random models, fp32, CPU) ---------------------------------------------------
def _run(path, prompts, params, **kw):
    from conftest import engine_kwargs
    from luceio import LLM
    llm = LLM(path, **engine_kwargs(**kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


def _branchy_prompts(n):
    """Prompts whose suffix occurs several times with different continuations."""
    out = []
    for i in range(n):
        a, b = [(5 * i + j) % 300 + 3 for j in range(3)], [(11 * i + j) % 300 + 3 for j in range(4)]
        out.append((a + [200 + i] + b + a + [250 + i] + b + a + b + a)[: 14 + 3 * (i % 5)])
    return out


class _TreeCounter:
    """Wraps the n-gram proposer: counts the trees it proposed that branch."""

    def __init__(self, proposer):
        self.inner, self.branching = proposer, 0

    def propose(self, batch):
        out = self.inner.propose(batch)
        self.branching += sum(1 for t in out.trees or [] if len(set(t.parents)) < t.num_nodes)
        return out

    def release(self, rid):
        self.inner.release(rid)


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 40, "num_kv_blocks": 10}],
                         ids=["plain", "chunked+preempt"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tree_speculation_equals_plain_decoding(tiny_models, sched, arch, monkeypatch):
    from luceio import SamplingParams
    from luceio.spec import decoding
    counters = []
    real_init = decoding.SpecDecoder.__init__

    def counting_init(self, method, k, proposer, sampler, **kw):
        proposer = _TreeCounter(proposer)
        counters.append(proposer)
        real_init(self, method, k, proposer, sampler, **kw)
    monkeypatch.setattr(decoding.SpecDecoder, "__init__", counting_init)
    # every step drafts trees: with chunked prefill most steps carry a prompt chunk, and the
    # cost model (which measures decode-only steps) would leave the batch to plain decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    prompts = _branchy_prompts(16)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    expected, _ = _run(tiny_models[arch], prompts, params)
    got, eng = _run(tiny_models[arch], prompts, params, speculative_method="ngram",
                    num_speculative_tokens=4, spec_tree_budget=12, **sched)
    assert got == expected
    st = eng.spec.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    assert counters[-1].branching > 0  # trees, not only chains, were verified
    if sched:
        assert eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_tree_commit_leaves_the_kv_of_plain_decoding(tiny_llama):
    """After a tree verify the accepted rows' KV sits at their depths: the cache of a request
    equals the one plain decoding writes for the same tokens (fp32 rounding apart)."""
    from conftest import engine_kwargs
    from luceio import EngineArgs, LLMEngine, SamplingParams
    prompt = _branchy_prompts(3)[2]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
    caches = []
    for kw in ({}, dict(speculative_method="ngram", num_speculative_tokens=4,
                        spec_tree_budget=12)):
        eng = LLMEngine(EngineArgs(model=tiny_llama, **engine_kwargs(**kw)))
        eng.add_request("r", {"prompt_token_ids": prompt}, params)
        while eng.scheduler.running or eng.scheduler.waiting:
            req = eng.scheduler.requests["r"]
            if req.num_computed_tokens >= len(prompt) + 24:
                break
            eng.step()
        n = req.num_computed_tokens
        blocks = eng.kv.blocks_of("r")
        pool = eng.runner.kv_pool  # [layers, 2, blocks, block_size, kv heads, head dim]
        kv = pool[:, :, torch.tensor(blocks)].flatten(2, 3)[:, :, :n]
        caches.append((kv.clone(), list(req.all_token_ids[:n])))
        if kw:
            assert eng.spec.stats.num_accepted_tokens > 0
    (plain, toks_a), (tree, toks_b) = caches
    m = min(plain.shape[2], tree.shape[2])
    assert toks_a[:m] == toks_b[:m] and m >= len(prompt) + 24
    torch.testing.assert_close(tree[:, :, :m], plain[:, :, :m], atol=1e-4, rtol=1e-4)


def test_seeded_tree_sampling_is_reproducible(tiny_llama, monkeypatch):
    """Seeded sampling through trees gives the same tokens run after run. Every step drafts a
    tree: which steps draft, and how, is otherwise the adaptive budget's choice from measured
    step times, and a seeded request's tokens depend on it (each way consumes its generator
    differently), so two runs could differ by timing alone."""
    from luceio import SamplingParams
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    params = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=20, ignore_eos=True)
    kw = dict(speculative_method="ngram", num_speculative_tokens=4, spec_tree_budget=10)
    a, eng = _run(tiny_llama, _branchy_prompts(6), params, **kw)
    b, _ = _run(tiny_llama, _branchy_prompts(6), params, **kw)
    assert a == b and all(len(x) == 20 for x in a) and eng.spec.stats.num_draft_tokens > 0


def test_tree_budget_is_refused_where_it_cannot_work(tiny_llama):
    from conftest import engine_kwargs
    from luceio import EngineArgs, LLMEngine
    for kw, match in [(dict(spec_tree_budget=8), "needs --speculative-method"),
                      (dict(speculative_method="draft", draft_model=tiny_llama,
                            spec_tree_budget=8, spec_tree_topk=0), "topk"),
                      (dict(speculative_method="ngram", spec_tree_budget=64), "63")]:
        with pytest.raises(ValueError, match=match):
            LLMEngine(EngineArgs(model=tiny_llama, **engine_kwargs(**kw)))


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 40, "num_kv_blocks": 14}],
                         ids=["plain", "chunked+preempt"])
def test_greedy_draft_model_trees_equal_plain_decoding(tiny_llama, tmp_path_factory, sched):
    """Best-first draft-model trees (another tiny model drafting, so some branches are wrong):
    greedy output equals plain decoding, and with the target as its own draft every first
    branch is accepted."""
    from conftest import make_tiny_model
    from luceio import SamplingParams
    other = make_tiny_model(str(tmp_path_factory.mktemp("tree_draft") / "m"), "llama", seed=7)
    prompts = _branchy_prompts(12)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    expected, _ = _run(tiny_llama, prompts, params)
    for draft in (other, tiny_llama):
        got, eng = _run(tiny_llama, prompts, params, speculative_method="draft",
                        draft_model=draft, num_speculative_tokens=3, spec_tree_budget=8,
                        spec_tree_topk=2, **sched)
        assert got == expected, draft
        st = eng.spec.stats
        assert st.num_draft_tokens > 0
        if draft == tiny_llama:  # the draft's argmax path is in every tree and always accepted
            assert st.num_accepted_tokens >= st.num_verify_steps * 1
        if sched:
            assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_device_trees_equal_the_host_path(tiny_llama, tmp_path_factory):
    """Levels built on the device (`spec.tree_graph`, no host read between them) give the
    host path's trees: the same nodes, parents and budget cut, for requests of different k."""
    from conftest import make_tiny_model
    from luceio.request import Request
    from luceio.sampling_params import SamplingParams
    from luceio.spec.proposer import ProposalInput
    draft = make_tiny_model(str(tmp_path_factory.mktemp("devtree") / "m"), "llama", seed=7)
    _, eng = _run(tiny_llama, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1),
                  speculative_method="draft", draft_model=draft, num_speculative_tokens=5,
                  spec_tree_budget=12, spec_tree_topk=2)
    prop = eng.spec.proposer
    assert prop.tree_graph is not None and prop.tree_graph.fed_rows(5) == 9
    reqs = [Request(f"r{i}", list(range(3 + i, 20 + 2 * i)), SamplingParams(temperature=0.0),
                    eos_token_ids=set(), max_model_len=256) for i in range(3)]
    batch = [ProposalInput(list(r.all_token_ids), 5 - i, r) for i, r in enumerate(reqs)]
    device = prop.propose(batch)
    graph, prop.tree_graph = prop.tree_graph, None
    for r in reqs:
        prop.release(r.request_id)
    host = prop.propose(batch)
    assert [t.num_nodes for t in device.trees] == [12, 12, 10]
    assert device.trees == host.trees and device.drafts == host.drafts
    assert max(t.depths()[-1] for t in device.trees) > 2  # the device levels ran
    assert all(max(t.depths()) <= p.k for t, p in zip(device.trees, batch))
    assert graph.levels == 5 and prop.kv.pool.num_free_blocks < prop.kv.pool.num_blocks


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 40, "num_kv_blocks": 7}],
                         ids=["plain", "chunked+preempt"])
def test_greedy_device_trees_equal_plain_decoding(tiny_llama, tmp_path_factory, sched,
                                                  monkeypatch):
    """Up to 4 requests a step take the device levels: greedy output equals plain decoding."""
    from conftest import make_tiny_model
    from luceio import SamplingParams
    from luceio.spec import decoding
    from luceio.spec.draft import DraftModelProposer
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    built = []
    real = DraftModelProposer._device_trees

    def spy(self, *a):
        out = real(self, *a)
        built.append(out is not None)
        return out
    monkeypatch.setattr(DraftModelProposer, "_device_trees", spy)
    other = make_tiny_model(str(tmp_path_factory.mktemp("devtree_plain") / "m"), "llama", seed=7)
    prompts = _branchy_prompts(4)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    expected, _ = _run(tiny_llama, prompts, params)
    got, eng = _run(tiny_llama, prompts, params, speculative_method="draft", draft_model=other,
                    num_speculative_tokens=4, spec_tree_budget=10, spec_tree_topk=2, **sched)
    assert got == expected
    assert built.count(True) >= 3 and eng.spec.stats.num_accepted_tokens > 0
    if sched:
        assert eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_sampled_draft_model_trees_are_seeded(tiny_llama, monkeypatch):
    """Children are point masses, accepted with the target's probability of their token: at a
    low temperature (a peaked p) the draft = target's top child is mostly accepted. Every step
    drafts a tree (as in the test above, so timing cannot change the draws)."""
    from luceio import SamplingParams
    from luceio.spec import decoding
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    params = SamplingParams(temperature=0.1, seed=11, max_tokens=16, ignore_eos=True)
    kw = dict(speculative_method="draft", draft_model=tiny_llama, num_speculative_tokens=3,
              spec_tree_budget=6)
    a, eng = _run(tiny_llama, _branchy_prompts(5), params, **kw)
    b, _ = _run(tiny_llama, _branchy_prompts(5), params, **kw)
    assert a == b and all(len(x) == 16 for x in a)
    assert eng.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_switching_between_trees_and_chains_equals_plain_decoding(tiny_llama, tmp_path_factory,
                                                                  method, monkeypatch):
    """The adaptive budget switches a step between trees and chains (and plain steps): forced
    here to go tree, chain, plain, tree, ... whatever it measures, greedy output equals plain
    decoding for both proposers (the draft model's state follows both kinds of step)."""
    from conftest import make_tiny_model
    from luceio import SamplingParams
    from luceio.spec import decoding
    modes = []

    def forced(self, batch_size, step=None):
        step = self._step if step is None else step
        return ("tree", "chain", None)[step % 3]
    monkeypatch.setattr(decoding.SpecDecoder, "mode", forced)
    prompts = _branchy_prompts(8)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    expected, _ = _run(tiny_llama, prompts, params)
    kw = dict(speculative_method=method, num_speculative_tokens=3, spec_tree_budget=8)
    if method == "draft":
        kw["draft_model"] = make_tiny_model(str(tmp_path_factory.mktemp("switch") / "m"),
                                            "llama", seed=7)
    real_apply = decoding.SpecDecoder.apply

    def spy_apply(self, reqs, drafts, probs, trees=None):
        modes.append(trees is not None)
        real_apply(self, reqs, drafts, probs, trees)
    monkeypatch.setattr(decoding.SpecDecoder, "apply", spy_apply)
    got, eng = _run(tiny_llama, prompts, params, **kw)
    assert got == expected
    assert True in modes and False in modes  # both kinds of step ran
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_adaptive_budget_picks_what_pays():
    """From measured costs and emitted tokens: trees when they are worth more than chains,
    chains when trees cost too much for what they add, plain decoding when neither is worth a
    plain step; the plain baseline is measured first, then what is not measured yet is tried;
    the drafting probe alternates the two."""
    from luceio.request import Request
    from luceio.sampling_params import SamplingParams
    from luceio.spec import SpecDecoder
    spec = SpecDecoder("ngram", 4, proposer=None, sampler=None, tree_budget=12)
    spec._step = 3
    assert spec.mode(1) is None  # nothing measured: the plain baseline first
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), eos_token_ids=set(),
                  max_model_len=64)
    spec.observe(1, drafted=False, num_tokens=1, seconds=0.010)
    assert spec.mode(1) == "tree"  # drafting not measured yet: tried
    spec.observe(1, drafted=True, num_tokens=3, seconds=0.020, tree=True)
    for _ in range(100):
        spec._record(req, 12, 2, tree=True)  # a tree verify emits 3 tokens: worth 1.5 steps
    assert spec.mode(1) == "chain"  # chains not measured yet
    spec.observe(1, drafted=True, num_tokens=2, seconds=0.012)
    for _ in range(100):
        spec._record(req, 4, 2)  # a = 2/3 once tried: ~2.6 tokens a chain verify, over 1.2 steps
    assert spec.mode(1) == "chain"
    for _ in range(200):
        spec._record(req, 12, 4, tree=True)  # trees now emit ~5 tokens: worth ~2.5
    assert spec.mode(1) == "tree"
    spec.observe(16, drafted=False, num_tokens=16, seconds=0.010)
    spec.observe(16, drafted=True, num_tokens=40, seconds=0.060, tree=True)  # ~5 / 6 = 0.83
    spec.observe(16, drafted=True, num_tokens=28, seconds=0.030)  # k = 2: 2.1 / 3 = 0.7
    assert spec.mode(16) is None and spec.mode(1) == "tree"
    # the probes, in turn; both ways lost at step 3, so each skips two cycles (`_back_off`)
    assert spec.mode(16, 8) is None and spec.mode(16, 24) is None
    assert spec.mode(16, 40) == "tree" and spec.mode(16, 56) == "chain"
    assert spec.mode(16, 16) is None  # the plain probe
    # at batch 1 the tree is worth ~2.5 plain steps: plain decoding, measured at step 3 (the
    # cycle of steps 0-15), is probed again only in the fourth cycle after (step 64)
    assert spec.mode(1, 32) == "tree" and spec.mode(1, 48) == "tree" and spec.mode(1, 64) is None
