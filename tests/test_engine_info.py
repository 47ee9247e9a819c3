"""`LLMEngine.model_info()` / `stats()` (and AsyncEngine's): what the server reads instead of the
engine's internals (tiny random models, fp32, CPU)."""
import asyncio
import threading

from conftest import engine_kwargs
from luceio import AsyncEngine, EngineArgs, LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_model_info_matches_the_engine(tiny_llama):
    eng = LLMEngine(EngineArgs(model=tiny_llama, **engine_kwargs()))
    info, mem = eng.model_info(), eng.memory_stats()
    assert info.name == tiny_llama and info.speculative_method is None
    assert info.vocab_size == eng.runner.cfg.vocab_size
    assert (info.max_model_len, info.block_size, info.num_kv_blocks) == (512, 16, 256)
    assert info.kv_capacity_tokens == 256 * 16
    assert (info.weight_bytes, info.kv_cache_bytes) == (mem.weight_bytes, mem.kv_cache_bytes)
    assert (info.device, info.dtype) == ("cpu", "float32")
    assert info.weight_types == tuple(eng.runner.model.weight_types()) and info.weight_types
    ngram = LLMEngine(EngineArgs(model=tiny_llama, speculative_method="ngram",
                                 num_speculative_tokens=3, **engine_kwargs()))
    assert ngram.model_info().speculative_method == "ngram"


def test_stats_count_what_the_engine_did(tiny_llama):
    eng = LLMEngine(EngineArgs(model=tiny_llama, enable_prefix_caching=True, **engine_kwargs()))
    st = eng.stats()
    assert (st.steps, st.num_running, st.num_waiting, st.kv_blocks_used) == (0, 0, 0, 0)
    assert st.kv_blocks_total == 256 and st.kv_blocks_free == 256 and st.kv_usage == 0.0
    assert st.offloaded_blocks is None and st.prefix_cache_hit_rate == 0.0
    shared = list(range(5, 5 + 48))  # three full blocks
    prompts = [shared + [100 + i] for i in range(3)]
    eng.add_request("first", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=6, **GREEDY))
    eng.step()
    mid = eng.stats()
    assert mid.num_running == 1 and mid.kv_blocks_used == 4 and mid.num_request_states == 1
    assert mid.prompt_tokens == 49 and mid.generation_tokens == 1 and mid.steps == 1
    while eng.has_unfinished_requests():
        eng.step()
    for i in (1, 2):  # the same three blocks, cached
        eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]},
                        SamplingParams(max_tokens=6, **GREEDY))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    st = eng.stats()
    assert sorted(o.request_id for o in outs) == ["r1", "r2"]
    assert st.generation_tokens == 3 * 6
    assert st.prompt_tokens == 49 + 2 * 1  # r1 and r2 computed their last token only
    assert st.prefix_cache_hits >= 2 * 3 and st.prefix_cache_lookups >= st.prefix_cache_hits
    assert (st.num_running, st.num_waiting, st.kv_blocks_used, st.num_request_states) == \
        (0, 0, 0, 0)
    assert st.steps >= 6 + 6 and st.preemptions == 0
    assert st.spec_draft_tokens == st.spec_accepted_tokens == 0


def test_stats_from_another_thread_while_the_engine_steps(tiny_llama):
    """What /metrics does: snapshots on one thread while the engine thread steps."""
    engine = AsyncEngine.from_engine_args(EngineArgs(model=tiny_llama, enable_prefix_caching=True,
                                                     **engine_kwargs()))
    errors, snaps, done = [], [], threading.Event()

    def scrape():
        while True:
            try:
                snaps.append(engine.stats())
            except Exception as e:  # noqa: BLE001  the test reports it below
                errors.append(e)
            if done.is_set():
                return

    async def run():
        async def one(i):
            async for out in engine.generate({"prompt_token_ids": list(range(5, 40 + i))},
                                             SamplingParams(max_tokens=24, **GREEDY)):
                last = out
            return last
        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await engine.shutdown()

    t = threading.Thread(target=scrape)
    t.start()
    try:
        outs = asyncio.run(run())
    finally:
        done.set()
        t.join(30)
    assert not errors and snaps
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    steps = [s.steps for s in snaps]
    assert steps == sorted(steps)  # each snapshot reads the counters at some moment
    final = engine.stats()
    assert final.generation_tokens == 8 * 24 and final.num_running == 0
    assert engine.model_info() == engine.engine.model_info()
