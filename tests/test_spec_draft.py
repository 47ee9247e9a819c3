"""The draft-model proposer's chain path (issue 14 item 5): its k draft steps are launched back to
back with the drafts on the device, read back once per `propose` call. The oracle is drafting
step by step with a host read after each step (the code before): drafts, their probabilities
and the draft cache's blocks must be identical, for greedy, seeded and unseeded sampling, mixed
k in one batch, sequences that reach the context limit and a draft cache that runs out of
blocks part-way (tiny random models, fp32, CPU)."""
import pytest
import torch

from conftest import engine_kwargs, plain_and_self_draft
from luceio import LLM, SamplingParams
from luceio.request import Request
from luceio.scheduler import ScheduledRequest, SchedulerOutput
from luceio.spec.proposer import Proposal, ProposalInput

PARAMS = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5),
          SamplingParams(temperature=1.1, min_p=0.05, seed=6),
          SamplingParams(temperature=0.8)]  # unseeded: the sampler's own generator
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def proposer_of(path, num_kv_blocks=256):
    llm = LLM(path, **engine_kwargs(speculative_method="draft", draft_model=path,
                                    num_speculative_tokens=5, num_kv_blocks=num_kv_blocks))
    return llm.engine.spec.proposer


def step_by_step(self, batch: list[ProposalInput]) -> Proposal:
    """The reference: one draft step at a time, its samples read back before the next."""
    reqs, ks, sampler = [p.request for p in batch], [p.k for p in batch], self.sampler
    seqs = [self._sync(p.request.request_id, list(p.tokens)) for p in batch]
    drafts, probs = [[] for _ in reqs], [[] for _ in reqs]
    live = [i for i, k in enumerate(ks) if k > 0]
    any_sampled = any(not r.params.greedy for r in reqs)
    for step in range(max(ks, default=0)):
        live = [i for i in live if len(drafts[i]) < ks[i] and self._room(seqs[i])]
        if not live:
            break
        sched = SchedulerOutput([ScheduledRequest(seqs[i], seqs[i].num_tokens_with_spec -
                                                  seqs[i].num_computed_tokens) for i in live], [])
        logits = self.runner.execute(self._prepare(sched))
        live_reqs = [reqs[i] for i in live]
        processed = sampler.process(logits, live_reqs)
        tokens = sampler.draw(processed, live_reqs).tolist()
        p = processed.softmax(-1) if any_sampled else None
        for row, i in enumerate(live):
            seqs[i].num_computed_tokens = len(seqs[i].all_token_ids)
            seqs[i].all_token_ids.append(tokens[row])
            drafts[i].append(tokens[row])
            if p is not None:
                probs[i].append(p[row])
    flat = [t for i in range(len(reqs)) for t in probs[i]]
    return Proposal(drafts, torch.stack(flat) if any_sampled and flat else None)


def requests(prompts, params):
    return [Request(f"r{i}", p, params[i % len(params)], set(), 512)
            for i, p in enumerate(prompts)]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def verify(reqs, drafts, rnd):
    """Stands in for the target: accepts some drafts, then appends one token of its own."""
    for i, (r, d) in enumerate(zip(reqs, drafts)):
        r.all_token_ids += d[:(i + rnd) % (len(d) + 1)] + [(7 * i + 11 * rnd) % 380 + 3]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("params", [PARAMS[:1], PARAMS], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", ["roomy", "context-limit", "pool-runs-out"])
def test_proposal_equals_step_by_step_drafting(tiny_llama, k, params, case):
    """Three rounds of drafting with verification between them (so the draft cache rolls back
    and catches up): the same drafts, the same probabilities bit for bit, the same blocks."""
    lengths = {"roomy": [9, 30, 17, 46], "context-limit": [9, 509, 30, 17],
               "pool-runs-out": [30, 31, 15, 46]}[case]
    blocks = 9 if case == "pool-runs-out" else 256
    ks = [k, 1, max(k - 2, 1), k]
    new, ref = proposer_of(tiny_llama, blocks), proposer_of(tiny_llama, blocks)
    new_reqs, ref_reqs = (requests(prompts_of(lengths), params) for _ in range(2))
    for rnd in range(3):
        got = new.propose([ProposalInput(r.all_token_ids, k_, r) for r, k_ in zip(new_reqs, ks)])
        want = step_by_step(ref, [ProposalInput(r.all_token_ids, k_, r)
                                  for r, k_ in zip(ref_reqs, ks)])
        assert got.drafts == want.drafts
        assert (got.probs is None) == (want.probs is None)
        if want.probs is not None:
            assert torch.equal(got.probs, want.probs)
        assert new.kv.block_tables == ref.kv.block_tables
        assert [(s.all_token_ids, s.num_computed_tokens) for s in new.seqs.values()] == \
            [(s.all_token_ids, s.num_computed_tokens) for s in ref.seqs.values()]
        verify(new_reqs, got.drafts, rnd)
        verify(ref_reqs, want.drafts, rnd)
    if case != "roomy":  # some request drafted fewer than it asked for
        assert any(len(d) < k_ for d, k_ in zip(got.drafts, ks))


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("case", ["roomy", "context-limit", "pool-runs-out"])
def test_greedy_chain_launch_equals_step_by_step_drafting(tiny_llama, k, case):
    """`spec.chain`: a greedy chain's steps past the first in one launch (a CUDA graph replay on
    GPUs; here its body runs eagerly, unpadded) give the drafts, draft caches and blocks of
    drafting step by step, with mixed k (some chains shorter than others) and chains cut by the
    context or the pool. Both run the model's reference forward (no CPU decode path), so
    their arithmetic is the same."""
    from luceio.spec.chain import DraftChain
    lengths = {"roomy": [9, 30, 17, 46], "context-limit": [9, 509, 30, 17],
               "pool-runs-out": [30, 31, 15, 46]}[case]
    blocks = 9 if case == "pool-runs-out" else 256
    ks = [k, 1, max(k - 2, 1), k]
    new, ref = proposer_of(tiny_llama, blocks), proposer_of(tiny_llama, blocks)
    for p in (new, ref):
        p.runner.cpu_decoder = None
    new.chain = DraftChain(new.runner, 4, 16)
    runs = []
    real_run = new.chain.run
    new.chain.run = lambda *a: runs.append(a[2]) or real_run(*a)
    new_reqs, ref_reqs = (requests(prompts_of(lengths), PARAMS[:1]) for _ in range(2))
    for rnd in range(3):
        got = new.propose([ProposalInput(r.all_token_ids, k_, r) for r, k_ in zip(new_reqs, ks)])
        want = step_by_step(ref, [ProposalInput(r.all_token_ids, k_, r)
                                  for r, k_ in zip(ref_reqs, ks)])
        assert got.drafts == want.drafts
        assert new.kv.block_tables == ref.kv.block_tables
        assert [(s.all_token_ids, s.num_computed_tokens) for s in new.seqs.values()] == \
            [(s.all_token_ids, s.num_computed_tokens) for s in ref.seqs.values()]
        verify(new_reqs, got.drafts, rnd)
        verify(ref_reqs, want.drafts, rnd)
    # every round chained its steps past the first (once the pool runs out, a round may have
    # no chain past its first step)
    assert len(runs) == 3 if case != "pool-runs-out" else runs
    if k == 5:  # chains of 4 and 2 steps past the first in one launch
        assert any(len(set(steps)) > 1 for steps in runs)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_one_host_read_per_propose_call(tiny_llama, k, monkeypatch):
    """However many draft steps run, the drafts come back in one read (the old code read each
    step's samples before launching the next: k reads). Reads inside the draft forwards are
    left out: the CPU's kernels read their inputs on the host by design (the GPU test checks
    the graph-replayed steps with torch's sync debug mode)."""
    proposer = proposer_of(tiny_llama)
    reqs = requests(prompts_of([9, 30, 17]), PARAMS[:3])
    proposer.propose([ProposalInput(r.all_token_ids, k, r) for r in reqs])  # the prompts
    verify(reqs, [[]] * len(reqs), 0)
    reads, in_forward = [], []

    def counted(name, real):
        def read(t, *a, **kw):
            if not in_forward:
                reads.append(name)
            return real(t, *a, **kw)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    forward = proposer.runner.execute

    def execute(inp):
        in_forward.append(True)
        try:
            return forward(inp)
        finally:
            in_forward.pop()

    monkeypatch.setattr(proposer.runner, "execute", execute)
    proposal = proposer.propose([ProposalInput(r.all_token_ids, k, r) for r in reqs])
    monkeypatch.undo()
    assert [len(d) for d in proposal.drafts] == [k] * len(reqs)
    assert reads == ["tolist"]


def test_draft_device_option(tiny_llama):
    """`--draft-device`: the draft runner runs there (the engine's device by default); without
    a draft model, or away from the target's device with speculative prefill, it is refused."""
    eng = LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                          draft_device="cpu")).engine
    assert eng.spec.proposer.runner.device == torch.device("cpu")
    with pytest.raises(ValueError, match="--draft-device needs --draft-model"):
        LLM(tiny_llama, **engine_kwargs(draft_device="cpu"))
    with pytest.raises(ValueError, match="--spec-prefill-keep and --kv-resident-policy spec"):
        LLM(tiny_llama, **engine_kwargs(speculative_method="draft", draft_model=tiny_llama,
                                        draft_device="meta", spec_prefill_keep=0.5))


def test_seeded_requests_draw_one_stream_per_device(monkeypatch):
    """A seeded request drawing on two devices (a draft model on another device than the
    target's) gets one generator per device, the first seeded as before and the second apart
    from it; the same device always gives back the same generator."""
    from luceio import sampler as sampler_mod

    class FakeGenerator:
        def __init__(self, device):
            self.device = device

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(sampler_mod.torch, "Generator", FakeGenerator)
    s = sampler_mod.Sampler(seed=0)
    req = Request("r", [1, 2], SamplingParams(temperature=1.0, seed=9), set(), 64)
    a = s.request_generator(req, torch.device("cuda", 0))
    b = s.request_generator(req, torch.device("cpu"))
    assert s.request_generator(req, torch.device("cuda", 0)) is a
    assert s.request_generator(req, "cpu") is b
    assert a.seed == 9 + req.index and b.seed != a.seed
    assert (a.device, b.device) == (torch.device("cuda", 0), torch.device("cpu"))


def test_cpu_catch_up_feeds_take_the_decode_path(tiny_llama):
    """The draft's feeds of the target's verified tokens (several rows: the prompt, then what a
    verify accepted) run the CPU decode path's multi-row matvec as a verify does, not the
    prompt path, which multiplies every quantized weight dense (a 5-row feed of the 0.5B draft
    took 130 ms against 19 ms a draft step); greedy output stays plain decoding's."""
    prompt = [(5 * i) % 300 + 3 for i in range(30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, llm = plain_and_self_draft(tiny_llama, prompt, params)
    spec = llm.engine.spec
    runner = spec.proposer.runner
    spec.mode = lambda batch_size, step=None: "chain"  # every step drafts
    seen, execute = [], runner.execute

    def spy(inp, probe=None):
        seen.append((int(inp.host.q_lens.max()), inp.prefill, runner._cpu_decode(inp, probe)))
        return execute(inp, probe)
    runner.execute = spy
    out = llm.generate([{"prompt_token_ids": prompt}], params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    feeds = [s for s in seen if s[0] > 1]
    assert feeds and feeds[0][0] == 31  # the prompt, then the verified tokens a step
    assert all(not prefill and decode for _, prefill, decode in feeds)


@pytest.mark.parametrize("cached", [True, False])
def test_draft_prefix_cache_serves_the_next_turn(tiny_llama, cached):
    """The draft's cache keeps a request's verified full blocks after it finishes, so the next
    turn (its prompt, its output and a new message) feeds the draft only what follows them,
    where it fed the whole conversation before (`cached` False: the draft's prefix caching
    off, the control). Greedy output equals plain decoding's in both turns."""
    from conftest import engine_kwargs
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, llm = plain_and_self_draft(tiny_llama, prompt, params)
    spec = llm.engine.spec
    spec.mode = lambda batch_size, step=None: "chain"  # every step drafts
    prop = spec.proposer
    prop.kv.enable_prefix_caching = cached
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert first == plain[0].outputs[0].token_ids
    turn = prompt + list(first) + [11, 12, 13, 14, 15]
    seen, execute = [], prop.runner.execute

    def spy(inp, probe=None):
        seen.append(int(inp.host.q_lens.max()))
        return execute(inp, probe)
    prop.runner.execute = spy
    second = llm.generate([{"prompt_token_ids": turn}], params)[0].outputs[0].token_ids
    want = LLM(tiny_llama, **engine_kwargs()).generate([{"prompt_token_ids": turn}], params)
    assert second == want[0].outputs[0].token_ids
    # the turn's prompt and its first token: the first feed, less the blocks the cache held
    # (at least the first turn's prompt's full blocks were verified before it finished)
    bs = prop.kv.block_size
    if cached:
        assert seen[0] <= len(turn) + 1 - len(prompt) // bs * bs
    else:
        assert seen[0] == len(turn) + 1


def test_a_cold_request_takes_blocks_cached_after_it_was_adopted(tiny_llama):
    """Two requests with one 40-token prompt arrive together, so both are adopted cold (nothing
    cached yet). Once the first has caught up and its verified blocks are registered (its next
    `_sync`), the second's `uncached` takes them: only the tail is left to feed, and its drafts
    equal the first's first drafts (same tokens, the shared blocks' KV)."""
    prop = proposer_of(tiny_llama)
    bs = prop.kv.block_size
    prompt = prompts_of([40])[0]
    a, b = requests([prompt, prompt], PARAMS[:1])
    for r in (a, b):
        assert prop.uncached(r.request_id, r.num_tokens, r.all_token_ids) == 39
    first = prop.propose([ProposalInput(a.all_token_ids, 3, a)]).drafts[0]
    assert prop.uncached(b.request_id, b.num_tokens, b.all_token_ids) == 39  # none registered
    verify([a], [first], 0)
    prop.propose([ProposalInput(a.all_token_ids, 3, a)])  # registers a's verified blocks
    assert prop.uncached(b.request_id, b.num_tokens, b.all_token_ids) == 39 - 40 // bs * bs
    assert prop.kv.blocks_of("r1")[:40 // bs] == prop.kv.blocks_of("r0")[:40 // bs]
    assert prop.propose([ProposalInput(b.all_token_ids, 3, b)]).drafts[0] == first
