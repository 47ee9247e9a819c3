"""Bounded KV residency: a request keeps at most N tokens of KV on the device, colder blocks
wait in host memory, attention reads the resident blocks only (tiny random models, fp32, CPU)."""
import asyncio

import numpy as np
import pytest
import torch

from conftest import engine_kwargs, make_tiny_model, watch_host_copies
from luceio import LLM, AsyncEngine, EngineArgs, SamplingParams
from luceio.cache import BlockPool
from luceio.cache.offload import HostCopies
from luceio.cache.residency import OFFLOADED, Residency, ResidencyConfig

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def run(path, prompts, max_tokens=40, **kw):
    llm = LLM(path, **engine_kwargs(**kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.outputs[0].token_ids for o in outs], llm.engine


def assert_clean(eng):
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.runner.host_store.request_ids() == []
    assert eng.kv.residency.states == {}
    assert eng.kv.swapped == {} and eng.kv.host.current == {}


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("res") / "d"), "qwen2", seed=7)


@pytest.mark.parametrize("policy", ["keys", "recency"])
def test_budget_covering_the_context_is_exactly_plain(tiny_llama, policy):
    ps = [prompt(150, i) for i in range(3)]
    plain, _ = run(tiny_llama, ps)
    spy = []
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=256, kv_resident_policy=policy))
    original = llm.engine.runner.host_store.apply
    llm.engine.runner.host_store.apply = lambda m: (spy.append(m), original(m))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=40, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert not any(m.offload or m.reload for m in spy)
    assert_clean(llm.engine)


def test_attention_reads_only_resident_blocks(tiny_llama):
    """Past the budget, the batch's table lists the resident blocks only, its sequence length
    counts their tokens, and positions stay the original ones."""
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96))
    eng = llm.engine
    p = prompt(300)
    eng.add_request("a", {"prompt_token_ids": p}, SamplingParams(max_tokens=30, **GREEDY))
    seen = 0
    while eng.has_unfinished_requests():
        batch = eng.schedule_step()
        if batch is not None and batch.sched.scheduled:
            req = batch.sched.scheduled[0].req
            table = eng.kv.blocks_of("a")
            resident = [b for b in table if b != OFFLOADED]
            h = batch.inputs.host
            if OFFLOADED in table:
                seen += 1
                end = req.num_computed_tokens + batch.sched.scheduled[0].num_new_tokens
                assert h.seq_lens[0] == end - table.count(OFFLOADED) * 16
                assert list(h.block_tables[0, :len(resident)]) == resident
                assert list(h.positions) == list(range(req.num_computed_tokens, end))
                # the budget holds: 96 tokens = 6 blocks, plus the step's own new blocks
                new_blocks = -(-end // 16) - req.num_computed_tokens // 16
                assert len(resident) <= 6 + new_blocks
                assert table[0] != OFFLOADED  # the sink block stays
                # each new token's KV lands in its logical block's physical block and offset
                for j, p in enumerate(range(req.num_computed_tokens, end)):
                    assert h.slot_mapping[j] == table[p // 16] * 16 + p % 16
        eng.finish_step(batch, eng.execute(batch) if batch is not None else None)
    assert seen > 20
    assert_clean(eng)


def test_offloaded_blocks_come_back_bit_identical(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=80, kv_rescore_interval=2))
    # a full block never changes: copied out again, it equals its first copy
    truth, reloaded = watch_host_copies(llm.engine.runner, same_when_offloaded_again=True)
    outs = llm.generate([{"prompt_token_ids": prompt(260, s)} for s in range(2)],
                        SamplingParams(max_tokens=60, **GREEDY))
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert truth and reloaded, "no block went out and came back"
    assert_clean(llm.engine)


def test_plan_moves_blocks_by_score():
    """Planner level: the sink and recent blocks stay, the best-scored fill the rest, and a
    change of scores reloads what became important and offloads what did not."""
    res = Residency(ResidencyConfig(budget_tokens=8 * 16, block_size=16, policy="keys"),
                    HostCopies())
    pool = BlockPool(64)
    table = pool.allocate(20)  # 20 full blocks; the step adds token 320 (block 20)
    res.set_scores("r", np.arange(20)[::-1].astype(float))  # older = more important
    res.plan("r", table, 320, 21, pool)
    kept = [i for i, b in enumerate(table) if b != OFFLOADED]
    # budget 8 blocks - 1 tail block = 7 old blocks: sink 0, recent 18..19, best 1..4
    assert kept == [0, 1, 2, 3, 4, 18, 19]
    assert res.host.take().offload[0][1] == [i for i in range(20) if i not in kept]
    scores = np.arange(20)[::-1].astype(float)
    scores[10] = 100.0
    res.set_scores("r", scores)
    res.plan("r", table, 320, 21, pool)
    moves = res.host.take()
    assert moves.reload[0][1] == [10] and moves.offload[0][1] == [4]
    assert [i for i, b in enumerate(table) if b != OFFLOADED] == [0, 1, 2, 3, 10, 18, 19]
    assert pool.num_free_blocks == 64 - 7
    res.plan("r", table, 320, 21, pool)  # nothing changed: no moves
    assert not res.host.take()
    # a new favourite set comes back at most max_reloads (2 here) blocks per plan
    scores = np.zeros(20)
    scores[[6, 7, 8, 9]] = [50, 40, 30, 20]
    res.set_scores("r", scores)
    res.plan("r", table, 320, 21, pool)
    moves = res.host.take()
    assert moves.reload[0][1] == [6, 7] and len(moves.offload[0][1]) == 2
    res.plan("r", table, 320, 21, pool)  # the rest follows at the next plan
    assert res.host.take().reload[0][1] == [8, 9]
    assert [i for i, b in enumerate(table) if b != OFFLOADED] == [0, 6, 7, 8, 9, 18, 19]
    # hysteresis: an offloaded block scored a little above a resident one does not swap in
    scores[[6, 7, 8, 9]] = 10.0
    scores[12] = 11.0
    res.set_scores("r", scores)
    res.plan("r", table, 320, 21, pool)
    assert not res.host.take()
    scores[12] = 20.0
    res.set_scores("r", scores)
    res.plan("r", table, 320, 21, pool)
    moves = res.host.take()
    # block 6 goes (the oldest of the lowest scored); its host copy from before its reload is
    # still current, so only its device block is freed
    assert moves.reload[0][1] == [12] and not moves.offload
    assert [i for i, b in enumerate(table) if b != OFFLOADED] == [0, 7, 8, 9, 12, 18, 19]
    res.host.release("r")
    assert res.host.take().drop == ["r"]


def test_request_larger_than_the_pool_runs_in_its_budget(tiny_llama):
    """With residency, a request needs only its budget of device blocks: a 400-token request
    runs in a 12-block (192-token) pool."""
    outs, eng = run(tiny_llama, [prompt(340)], max_tokens=60, num_kv_blocks=12,
                    kv_resident_tokens=128)
    assert len(outs[0]) == 60
    assert_clean(eng)
    with pytest.raises(ValueError, match="KV blocks"):
        LLM(tiny_llama, **engine_kwargs(num_kv_blocks=12)).generate(
            [{"prompt_token_ids": prompt(340)}], SamplingParams(max_tokens=60))


def test_policies_and_abort_leave_nothing_behind(tiny_llama, draft):
    for policy in ["keys", "recency", "spec"]:
        llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96, kv_resident_policy=policy,
                                              draft_model=draft if policy == "spec" else None))
        eng = llm.engine
        for i in range(3):
            eng.add_request(f"r{i}", {"prompt_token_ids": prompt(250, i)},
                            SamplingParams(max_tokens=50, **GREEDY))
        if policy == "spec":
            assert eng.kv.residency.states["r0"].scores is not None
        for _ in range(40):
            eng.step()
        assert eng.runner.host_store.request_ids(), f"{policy}: nothing was offloaded"
        eng.abort_request(["r0", "r1"])
        while eng.has_unfinished_requests():
            eng.step()
        assert_clean(eng)


def test_spec_policy_needs_a_draft(tiny_llama):
    with pytest.raises(ValueError, match="draft"):
        LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96, kv_resident_policy="spec"))
    with pytest.raises(ValueError, match="at least 4 blocks"):
        LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=32))


def test_preemption_with_residency(tiny_llama):
    """A budget covering the context keeps swap preemption exact; with a small budget, swap
    preemption offloads the rest of a request's blocks too (with the keys policy which block
    set is resident also depends on how many blocks are free, so only completion and clean
    accounting are asserted; test_swap.py checks exactness under `recency`), and nothing is
    left behind."""
    ps = [prompt(60, i) for i in range(4)]
    ref, _ = run(tiny_llama, ps, max_tokens=120)
    outs, eng = run(tiny_llama, ps, max_tokens=120, kv_resident_tokens=512, num_kv_blocks=24,
                    preemption_mode="swap")
    assert eng.scheduler.num_preemptions > 0 and outs == ref
    assert_clean(eng)
    outs, eng = run(tiny_llama, ps, max_tokens=120, kv_resident_tokens=96, num_kv_blocks=18,
                    preemption_mode="swap")
    assert eng.scheduler.num_preemptions > 0
    assert all(len(o) == 120 for o in outs)
    assert_clean(eng)


@pytest.mark.parametrize("n, batched", [(300, 2048), (97, 42)])
def test_inexact_blocks_never_enter_the_prefix_cache(tiny_llama, n, batched):
    """Blocks computed after the first offload, or in a last prompt chunk that is computed
    again (97 tokens, 42-token steps: the redo makes the first offload), are never cached."""
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96, max_num_batched_tokens=batched))
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": prompt(n)}, SamplingParams(max_tokens=5, **GREEDY))
    limits = []
    while eng.has_unfinished_requests():
        eng.step()
        exact = eng.kv.residency.exact_blocks("a")
        if exact is not None:
            limits.append(exact)
            assert eng.kv.num_cached_blocks.get("a", 0) <= exact
    assert limits and max(limits) < n // 16
    # a second identical request hits only the exact prefix
    eng.add_request("b", {"prompt_token_ids": prompt(n)}, SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    assert eng.scheduler.requests["b"].num_cached_tokens <= max(limits) * 16


def test_abort_while_a_step_runs(tiny_llama):
    """The loop thread aborts (and sweeps host copies) between a step's scheduling and its
    execution, as the async engine may: the step still runs, and nothing is left behind."""
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96, kv_rescore_interval=1))
    eng = llm.engine
    for i in range(2):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt(250, i)},
                        SamplingParams(max_tokens=40, **GREEDY))
    aborted = 0
    for k in range(60):
        batch = eng.schedule_step()
        if batch is None:
            break
        if k in (25, 35) and (batch.sched.kv_moves.reload or batch.sched.kv_score_ids):
            rid = (batch.sched.kv_moves.reload or [[batch.sched.kv_score_ids[0]]])[0][0]
            eng.abort_request(rid)
            eng.finish_step(None, None)  # the abort's own sweep, while the step is pending
            aborted += 1
        eng.finish_step(batch, eng.execute(batch))
    while eng.has_unfinished_requests():
        eng.step()
    assert aborted
    assert_clean(eng)


def test_shared_blocks_are_never_offloaded():
    """Offloading a block another request holds frees nothing: the planner keeps it."""
    res = Residency(ResidencyConfig(budget_tokens=8 * 16, block_size=16), HostCopies())
    pool = BlockPool(22)
    table = pool.allocate(20)
    pool.touch([table[5]])  # block 5 shared (a prefix-cache hit of another request)
    res.set_scores("r", np.zeros(20))
    res.plan("r", table, 320, 21, pool)
    assert table[5] != OFFLOADED
    scores = np.zeros(20)
    scores[12] = 10.0
    res.set_scores("r", scores)
    res.plan("r", table, 320, 21, pool)  # must not raise for want of a free block
    assert table[5] != OFFLOADED


def test_n_samples_share_the_exact_prefix(tiny_llama):
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96))
    out = llm.generate([{"prompt_token_ids": prompt(250)}],
                       SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=30))[0]
    assert all(len(c.token_ids) == 30 for c in out.outputs)
    assert_clean(llm.engine)


def test_async_engine_with_spec_policy(tiny_llama, draft):
    async def main():
        eng = AsyncEngine.from_engine_args(EngineArgs(
            model=tiny_llama, kv_resident_tokens=96, kv_resident_policy="spec",
            draft_model=draft, **{k: v for k, v in engine_kwargs().items() if k != "model"}))
        outs = await asyncio.gather(*[_collect(eng, prompt(220, i)) for i in range(3)])
        await eng.shutdown()
        return outs, eng.engine
    outs, eng = asyncio.run(main())
    assert all(len(o) == 20 for o in outs)
    assert_clean(eng)


async def _collect(eng, p):
    last = None
    async for out in eng.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=20, **GREEDY)):
        last = out
    return last.outputs[0].token_ids


def test_residency_with_speculative_decoding(tiny_llama):
    """Rejected drafts trim the (resident) tail; a covering budget stays exactly plain, a small
    one runs clean."""
    ps = [prompt(40, i) * 5 for i in range(2)]  # repetitive: n-gram drafts get proposed
    ref, _ = run(tiny_llama, ps, max_tokens=60)
    spec_kw = dict(speculative_method="ngram", num_speculative_tokens=3)
    full, eng = run(tiny_llama, ps, max_tokens=60, kv_resident_tokens=512, **spec_kw)
    assert full == ref and eng.spec.stats.num_draft_tokens > 0
    small, eng = run(tiny_llama, ps, max_tokens=60, kv_resident_tokens=96, **spec_kw)
    assert all(len(o) == 60 for o in small)
    assert_clean(eng)


def test_keys_policy_scores_then_redoes_the_last_prompt_chunk(tiny_llama):
    """A prompt past the budget: its last chunk stops one token short and is scored there;
    then the whole chunk runs again over the blocks the score chose (so the end of the prompt
    attends to them) and samples the first output token."""
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96))
    eng = llm.engine
    p = prompt(200)
    eng.add_request("a", {"prompt_token_ids": p}, SamplingParams(max_tokens=3, **GREEDY))
    steps = []
    while eng.has_unfinished_requests():
        batch = eng.schedule_step()
        s = batch.sched.scheduled[0]
        steps.append((s.req.num_computed_tokens, s.num_new_tokens, "a" in batch.sched.kv_score_ids))
        eng.finish_step(batch, eng.execute(batch))
    # chunks of 48 (half the budget): ..., 144+48 = 192, then 192 + 7 stops one short
    assert steps[-4:] == [(192, 7, True), (192, 8, False), (200, 1, False), (201, 1, False)]
    assert_clean(eng)


def test_release_cancels_pending_copies():
    """A request preempted (or aborted) in the step that planned its moves: the copies are
    cancelled and its host copies dropped, so a recompute never finds stale blocks."""
    res = Residency(ResidencyConfig(budget_tokens=8 * 16, block_size=16), HostCopies())
    pool = BlockPool(64)
    table = pool.allocate(20)
    res.plan("r", table, 320, 21, pool)
    assert res.host.moves.offload
    res.host.release("r")
    moves = res.host.take()
    assert not moves.offload and not moves.reload and moves.drop == ["r"]


def test_metrics_count_moves(tiny_llama):
    from prometheus_client import generate_latest

    from luceio.server.metrics import ServerMetrics
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96))
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": prompt(300)}, SamplingParams(max_tokens=5, **GREEDY))
    for _ in range(4):
        eng.step()

    class Holder:  # the AsyncEngine face ServerMetrics reads
        stats = staticmethod(eng.stats)

        @staticmethod
        def num_open_streams() -> int:
            return 0
    text = generate_latest(ServerMetrics(Holder()).registry).decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("luceio_kv_")}
    assert values["luceio_kv_offloaded_blocks"] == eng.kv.blocks_of("a").count(OFFLOADED) > 0
    assert values["luceio_kv_offloads_total"] >= values["luceio_kv_offloaded_blocks"]


def test_n_samples_and_prompt_logprobs_under_residency(tiny_llama):
    """n > 1 (samples share only the exact prefix) and prompt logprobs (computed over the
    resident blocks) both complete and leave nothing behind."""
    llm = LLM(tiny_llama, **engine_kwargs(kv_resident_tokens=96))
    out = llm.generate([{"prompt_token_ids": prompt(250)}],
                       SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20,
                                      prompt_logprobs=1))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 20 for c in out.outputs)
    assert len(out.prompt_logprobs) == 250 and out.prompt_logprobs[0] is None
    assert_clean(llm.engine)


def test_spec_scores_survive_preemption():
    res = Residency(ResidencyConfig(budget_tokens=8 * 16, block_size=16, policy="spec"), HostCopies())
    res.set_scores("r", np.arange(5.0))
    res.release("r", preempted=True)
    assert list(res.states["r"].scores) == [0, 1, 2, 3, 4]
    res.release("r")  # finished: nothing kept
    assert res.states == {}
