"""Pipeline stages on torch.distributed (Gloo, CPU + CPU): a model cut into layer ranges run by
separate processes gives the same greedy tokens as one process, under chunked prefill,
preemption, aborts, n-gram speculation, a draft model in the engine's process and draft
trees; bad splits and unsupported combinations are refused before any process starts; a
stage that dies fails the step at once, with its exit code; a stage started by hand (`luceio
stage`, several machines; here 127.0.0.1) joins the engine's rendezvous, and an engine whose
stages never come gives up after --stage-join-timeout."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from conftest import engine_kwargs, make_tiny_model
from luceio import LLM, SamplingParams
from luceio.spec import decoding
from luceio.stages import StageError, layer_ranges
from luceio.stages.plan import choose_transport, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GREEDY = dict(temperature=0.0, ignore_eos=True)


def stage_kwargs(devices, **over):
    kw = engine_kwargs(cpu_threads=1, **over)
    kw.pop("device")
    return dict(kw, devices=devices)


def prompts(n):
    """Repeated spans (the n-gram proposer finds matches), long enough to be chunked."""
    out = []
    for i in range(n):
        span = [(7 * i + j) % 300 + 3 for j in range(3 + i % 5)]
        out.append((span * 30)[: 20 + 13 * i])
    return out


def run_with_abort(llm, prompts, params, abort_step=4):
    """{index: (token ids, finish reason)}, request 1 aborted after `abort_step` steps."""
    eng = llm.engine
    ids = [eng.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    last, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
        steps += 1
        if steps == abort_step:
            eng.abort_request(ids[1])
    return {i: (list(last[r].outputs[0].token_ids), last[r].outputs[0].finish_reason)
            for i, r in enumerate(ids) if r in last}


def no_stage_left():
    return not multiprocessing.active_children() and not dist.is_initialized()


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("stages") / "m"), "llama", num_layers=3)


@pytest.mark.parametrize("sched", [
    {"max_num_batched_tokens": 32},  # chunked prefill mixed with decodes
    {"max_num_batched_tokens": 32, "num_kv_blocks": 12},  # and preemption by recompute
], ids=["chunked", "chunked+preempt"])
@pytest.mark.parametrize("micro", [1, 3])
def test_two_stages_equal_one_process(tiny_llama, sched, micro):
    """`micro`: each step's requests cut into up to that many micro-batches."""
    params = SamplingParams(max_tokens=20, **GREEDY)
    batch = prompts(6)
    expected = run_with_abort(LLM(tiny_llama, **engine_kwargs(**sched)), batch, params)
    llm = LLM(tiny_llama, **stage_kwargs("cpu,cpu", layer_split="1,1",
                                         stage_micro_batches=micro, **sched))
    sends, decoded = [], []
    link = llm.engine.stages.link
    real = link.send_hidden
    link.send_hidden = lambda *a: sends.append(1) or real(*a)
    decoder = llm.engine.runner.cpu_decoder  # stage 0's decode steps on the CPU decode path
    if decoder is not None:
        assert (decoder.start, decoder.end) == (0, 1)
        llm.engine.runner.cpu_decoder = lambda *a, **kw: decoded.append(1) or decoder(*a, **kw)
    try:
        assert run_with_abort(llm, batch, params) == expected
        from luceio.kernels import decode_cpu
        assert bool(decoded) == decode_cpu.available()
        steps = llm.engine.counters["steps"]
        assert len(sends) == steps if micro == 1 else len(sends) > steps
        assert expected[1][1] == "abort" and len(expected[1][0]) < 20
        eng = llm.engine
        assert eng.counters["steps"] > 20
        if "num_kv_blocks" in sched:
            assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        assert eng.stages.transport == "host"  # auto between two CPUs
        # stage 0 keeps layer 0's weights and KV only
        assert len(eng.runner.kv_pool) == 1 and not list(eng.runner.model.layers[1].parameters())
    finally:
        llm.shutdown()
    assert no_stage_left()


def test_three_stages_relay_and_speculate(three_layers):
    params = SamplingParams(max_tokens=24, **GREEDY)
    batch = prompts(5)
    ref = LLM(three_layers, **engine_kwargs())
    expected = [o.outputs[0].token_ids for o in ref.generate(batch, params, use_tqdm=False)]
    llm = LLM(three_layers, **stage_kwargs("cpu,cpu,cpu", max_num_batched_tokens=40,
                                           speculative_method="ngram", num_speculative_tokens=3))
    try:
        assert [r for r in llm.engine.stages.plan.layer_ranges] == [(0, 1), (1, 2), (2, 3)]
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        assert got == expected
        assert llm.engine.spec.stats.num_draft_tokens > 0
    finally:
        llm.shutdown()
    assert no_stage_left()


@pytest.mark.parametrize("sched", [
    {"max_num_batched_tokens": 32},
    {"max_num_batched_tokens": 32, "num_kv_blocks": 12},  # and preemption by recompute
], ids=["chunked", "chunked+preempt"])
def test_draft_model_speculation_across_stages(tiny_llama, tmp_path_factory, sched,
                                               monkeypatch):
    """A draft model in the engine's process, the target over two stages. Another tiny model
    drafting (its drafts rejected): greedy output and the abort as one process decoding
    plainly. The target drafting for itself (its drafts accepted): seeded sampling as the same
    speculating engine in one process (every step drafting, so that measured times, which
    decide when to draft, cannot change the draws)."""
    other = make_tiny_model(str(tmp_path_factory.mktemp("stage_draft") / "m"), "llama", seed=7)
    batch = prompts(6)
    greedy = SamplingParams(max_tokens=20, **GREEDY)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    expected = run_with_abort(LLM(tiny_llama, **engine_kwargs(**sched)), batch, greedy)
    for draft in (other, tiny_llama):
        spec = dict(speculative_method="draft", draft_model=draft, num_speculative_tokens=3)
        if draft == tiny_llama:
            monkeypatch.setattr(decoding.SpecDecoder, "mode",
                                lambda self, batch_size, step=None: "chain")
            one = LLM(tiny_llama, **engine_kwargs(**sched, **spec))
            expected = [o.outputs[0].token_ids for o in one.generate(batch, seeded, use_tqdm=False)]
        llm = LLM(tiny_llama, **stage_kwargs("cpu,cpu", layer_split="1,1", draft_device="cpu",
                                             **sched, **spec))
        try:
            eng = llm.engine
            if draft == other:
                assert run_with_abort(llm, batch, greedy) == expected
            else:
                got = [o.outputs[0].token_ids for o in llm.generate(batch, seeded, use_tqdm=False)]
                assert got == expected and len(got[0]) == 20
                assert eng.spec.stats.num_accepted_tokens > 0
            assert eng.spec.stats.num_draft_tokens > 0
            if "num_kv_blocks" in sched:
                assert eng.scheduler.num_preemptions > 0
            assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        finally:
            llm.shutdown()
        assert no_stage_left()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tree_speculation_across_stages(tiny_llama, method, monkeypatch):
    """Draft trees verified through two stages (every step drafting a tree): the tree mask
    travels with the step and the accepted rows' KV moves in every stage's cache (sent with
    the next step): greedy output and the abort as one process speculating alike, and the
    requests not aborted as plain decoding, with chunked prefill and preemption."""
    from luceio.stages.group import StageGroup
    moved = []
    real = StageGroup.queue_moves
    monkeypatch.setattr(StageGroup, "queue_moves",
                        lambda self, src, dst: moved.append(len(src)) or real(self, src, dst))
    monkeypatch.setattr(decoding.SpecDecoder, "mode", lambda self, batch_size, step=None: "tree")
    from test_spec_tree import _branchy_prompts  # suffixes with several continuations
    sched = dict(max_num_batched_tokens=32, num_kv_blocks=6)
    params = SamplingParams(max_tokens=20, **GREEDY)
    batch = _branchy_prompts(6)
    plain = run_with_abort(LLM(tiny_llama, **engine_kwargs(**sched)), batch, params)
    spec = dict(speculative_method=method, num_speculative_tokens=4, spec_tree_budget=8,
                **({"draft_model": tiny_llama} if method == "draft" else {}))
    expected = run_with_abort(LLM(tiny_llama, **engine_kwargs(**sched, **spec)), batch, params)
    assert {i: v for i, v in expected.items() if i != 1} == \
        {i: v for i, v in plain.items() if i != 1}
    moved.clear()
    llm = LLM(tiny_llama, **stage_kwargs("cpu,cpu", layer_split="1,1", **sched, **spec,
                                         stage_micro_batches=2 if method == "draft" else 1))
    try:
        assert run_with_abort(llm, batch, params) == expected
        eng = llm.engine
        assert eng.spec.stats.num_accepted_tokens > 0 and sum(moved) > 0
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    finally:
        llm.shutdown()
    assert no_stage_left()


def killed_stage_fails_at_once(llm) -> None:
    """Kills stage 1 after one request; the next request raises StageError within 10 s, and so
    does every later step; then the LLM shuts down with nothing left behind."""
    try:
        params = SamplingParams(max_tokens=8, **GREEDY)
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
        worker = llm.engine.stages.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        start = time.monotonic()
        with pytest.raises(StageError, match="stage 1 .* exited with code -9"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(StageError):  # broken for good: no silent output from stage 0 alone
            llm.engine.runner.stages.forward(None, None, None, None, None, False)
    finally:
        llm.shutdown()
    assert no_stage_left()


def test_a_killed_stage_fails_the_step_at_once(tiny_llama):
    killed_stage_fails_at_once(LLM(tiny_llama, **stage_kwargs("cpu,cpu")))


def test_a_killed_stage_fails_a_micro_batched_step(tiny_llama):
    """The micro-batches' results are received asynchronously: a dead stage still fails the
    step within 10 s, through the transfers themselves (the check of the stage processes
    before a step is kept from seeing it)."""
    llm = LLM(tiny_llama, **stage_kwargs("cpu,cpu", stage_micro_batches=2))
    try:
        params = SamplingParams(max_tokens=4, **GREEDY)
        assert len(llm.generate(prompts(3), params, use_tqdm=False)) == 3
        group = llm.engine.stages
        worker = group.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        group.procs = []  # reaped: only Gloo can tell now
        start = time.monotonic()
        with pytest.raises(StageError, match="pipeline stage failed"):
            llm.generate(prompts(3), params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert no_stage_left()


@pytest.mark.parametrize("split, message", [
    ("1", "has 1 counts for 2 stages"),
    ("2,1", "sums to 3 layers; the model has 2"),
    ("0,2", "at least one layer"),
    ("one,one", "comma-separated layer counts"),
])
def test_a_bad_layer_split_is_refused_before_any_stage_starts(tiny_llama, split, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **stage_kwargs("cpu,cpu", layer_split=split))
    assert no_stage_left()


@pytest.mark.parametrize("over, message", [
    ({"devices": None, "layer_split": "1,1"}, "--layer-split needs --devices"),
    ({"devices": "cpu,gpu"}, "'gpu' is not a device"),
    ({"preemption_mode": "swap"}, "do not support --preemption-mode swap"),
    ({"kv_resident_tokens": 64}, "do not support --kv-resident-tokens"),
    ({"speculative_method": "draft", "draft_model": "x", "spec_prefill_keep": 0.5},
     "--spec-prefill-keep"),
    ({"devices": "cpu,cuda:99"}, "cuda:99 is not on this machine"),
    ({"stage_transport": "nccl"}, "--stage-transport nccl needs every stage on a CUDA device"),
    ({"world_size": 3, "dist_init": "tcp://127.0.0.1:1"}, "names 2 stages"),
    ({"world_size": 2}, "--world-size needs --dist-init"),
    ({"rank": 1}, "--rank needs --world-size"),
    ({"world_size": 2, "rank": 2, "dist_init": "tcp://127.0.0.1:1"}, r"not in \[0, --world"),
    ({"world_size": 2, "rank": 1, "dist_init": "tcp://127.0.0.1:1"}, "start it with `luceio stage`"),
    ({"dist_init": "file:///tmp/x"}, "give tcp://HOST:PORT"),
    ({"stage_micro_batches": 0}, "--stage-micro-batches must be >= 1"),
])
def test_unsupported_combinations_are_refused(tiny_llama, over, message):
    kw = stage_kwargs("cpu,cpu")
    kw.update(over)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **kw)
    assert no_stage_left()


def test_a_step_cut_into_micro_batches():
    """`split_step`: whole requests per micro-batch, in order, each meta re-based on its own
    rows (query starts from 0, its own longest query and context), the tree mask cut along."""
    import torch
    from luceio.models import AttnMetadata
    from luceio.stages.wire import split_step
    seq_lens = [10, 7, 30, 4, 9]
    qsl = torch.tensor([0, 3, 4, 5, 9, 11], dtype=torch.int32)  # 3, 1, 1, 4 and 2 tokens
    meta = AttnMetadata(torch.arange(100, 111), torch.arange(25).view(5, 5).int(),
                        torch.tensor(seq_lens, dtype=torch.int32), qsl, 4, 30)
    meta.tree_mask = torch.arange(11) * 3
    ids, pos = torch.arange(50, 61), torch.arange(11)
    parts = split_step(ids, pos, meta, 2)
    assert len(parts) == 2 and len(split_step(ids, pos, meta, 1)) == 1
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1] for p in parts]), pos)
    first, second = parts[0][2], parts[1][2]
    assert first.query_start_loc.tolist() == [0, 3, 4]  # requests 0-1, then 2-4
    assert second.query_start_loc.tolist() == [0, 1, 5, 7]
    assert (first.max_query_len, first.max_seq_len) == (3, 10)
    assert (second.max_query_len, second.max_seq_len) == (4, 30)
    assert torch.equal(second.block_tables, meta.block_tables[2:])
    assert torch.equal(second.seq_lens, meta.seq_lens[2:])
    assert torch.equal(second.slot_mapping, meta.slot_mapping[4:])
    assert torch.equal(torch.cat([first.tree_mask, second.tree_mask]), meta.tree_mask)
    assert len(split_step(ids, pos, meta, 9)) == 5  # at most one request each


def _wire_peer(rank: int, port: int, capacity: int, steps: list) -> None:
    """One end of `test_the_wire_carries_steps_whole_and_split`: rank 0 sends `steps` and
    checks the finals that come back; rank 1 checks each step and returns its hidden rows."""
    import torch
    import torch.distributed as dist
    from luceio.stages import wire
    wire.CAPACITY = capacity
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        link = wire.Link(torch.device("cpu"))
        for header, ints, hidden in steps:
            if rank == 0:
                wait = link.post_final(1, hidden.shape[1], hidden.shape[2], hidden.dtype)
                link.send_ints(1, header, ints)
                link.send_hidden(1, (hidden[0], hidden[1]))
                assert torch.equal(wait(), hidden[0] * 2)
            else:
                got_header, got_ints = link.recv_ints(0, hidden.dtype, hidden.shape[2])
                assert torch.equal(got_header, header) and torch.equal(got_ints, ints)
                got = link.recv_hidden()
                assert torch.equal(got, hidden)
                link.send_final(got[0] * 2)
                link.post_step(0)
        if rank == 0:
            wire.send_shutdown(1)
        else:
            assert link.recv_ints(0, torch.float32, 8) is None
    finally:
        dist.destroy_process_group()


def test_the_wire_carries_steps_whole_and_split():
    """`wire.Link` on Gloo: a step's header and ints travel as one message where they fit
    CAPACITY, else the header and then the ints; either way they and the hidden states after
    them arrive as sent, the final rows come back with their count checked, and a shutdown
    ends the receiver."""
    import torch
    import torch.multiprocessing as mp
    from luceio.stages.wire import HEADER_LEN, OP_STEP, ints_length
    g = torch.Generator().manual_seed(0)
    steps = []
    for n, num_seqs, max_blocks in [(1, 1, 2), (60, 3, 4), (2, 2, 1), (300, 1, 24)]:
        header = torch.tensor([OP_STEP, n, num_seqs, max_blocks, n, 64, 1, 0, 0])
        assert header.numel() == HEADER_LEN
        ints = torch.randint(0, 1000, (ints_length(header.tolist()),), generator=g)
        steps.append((header, ints, torch.randn(2, n, 8, generator=g)))
    capacity = 1024  # the 300-token step's ints (5,016 bytes) come after its header
    mp.spawn(_wire_peer, args=(free_port(), capacity, steps), nprocs=2, join=True)


def test_auto_split_gives_the_remainder_to_later_stages():
    assert layer_ranges("auto", 3, 8) == ((0, 2), (2, 5), (5, 8))
    assert layer_ranges("auto", 2, 2) == ((0, 1), (1, 2))
    assert layer_ranges("3,5", 2, 8) == ((0, 3), (3, 8))
    with pytest.raises(ValueError, match="at least as many"):
        layer_ranges("auto", 3, 2)


@pytest.mark.parametrize("asked, devices, vendors, hosts, chosen", [
    ("auto", ("cpu", "cpu"), ("none", "none"), ("a", "a"), "host"),
    ("auto", ("cpu", "cpu"), ("cuda", "cuda"), ("a", "a"), "host"),
    ("auto", ("cuda:0", "cpu"), ("cuda", "cuda"), ("a", "a"), "host"),
    ("auto", ("cuda:0", "cuda:1"), ("cuda", "cuda"), ("a", "a"), "nccl"),
    ("auto", ("cuda:0", "cuda:1", "cuda:2"), ("rocm",) * 3, ("a",) * 3, "nccl"),
    ("auto", ("cuda:0", "cuda:0"), ("cuda", "cuda"), ("a", "b"), "nccl"),  # two machines
    ("auto", ("cuda:0", "cuda:0"), ("cuda", "cuda"), ("a", "a"), "host"),  # one GPU, two ranks
    ("auto", ("cuda:0", "cuda:0"), ("cuda", "rocm"), ("a", "a"), "host"),  # NVIDIA + AMD
    ("auto", ("cuda:0", "cuda:1"), ("none", "none"), ("a", "a"), "host"),  # no NCCL built
    ("host", ("cuda:0", "cuda:1"), ("cuda", "cuda"), ("a", "a"), "host"),
    ("nccl", ("cuda:0", "cuda:1"), ("cuda", "cuda"), ("a", "a"), "nccl"),
])
def test_transport_choice(asked, devices, vendors, hosts, chosen):
    assert choose_transport((asked,) * len(devices), devices, vendors, hosts) == chosen


@pytest.mark.parametrize("asked, devices, vendors, hosts, message", [
    (("nccl", "nccl"), ("cuda:0", "cpu"), ("cuda", "cuda"), ("a", "a"), "needs every stage on a CUDA"),
    (("nccl", "nccl"), ("cuda:0", "cuda:0"), ("cuda", "rocm"), ("a", "a"), "NCCL is cuda, rocm"),
    (("nccl", "nccl"), ("cuda:0", "cuda:0"), ("cuda", "cuda"), ("a", "a"), "of its own"),
    (("auto", "host"), ("cpu", "cpu"), ("none", "none"), ("a", "a"), "were given auto, host"),
])
def test_a_transport_the_stages_cannot_share_is_refused(asked, devices, vendors, hosts, message):
    with pytest.raises(ValueError, match=message):
        choose_transport(asked, devices, vendors, hosts)


def test_stages_given_different_transports_refuse_to_start(tiny_llama):
    """A stage started by hand with another --stage-transport than the engine's: both fail at
    the join with the reason, before any step."""
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    stage = start_stage(tiny_llama, dist_init, "--stage-transport", "host")
    try:
        with pytest.raises(RuntimeError, match="same --stage-transport.*auto, host"):
            LLM(tiny_llama, **stage_kwargs("cpu,cpu", dist_init=dist_init, world_size=2,
                                           stage_join_timeout=60))
        err = stage.communicate(timeout=60)[1]
        assert stage.returncode == 1 and "same --stage-transport" in err, err
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait(10)
    assert no_stage_left()


def start_stage(model: str, dist_init: str, *flags: str) -> subprocess.Popen:
    """`luceio stage` as another machine would run it (here on 127.0.0.1)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "luceio.cli", "stage", model,
                             "--devices", "cpu,cpu", "--dist-init", dist_init,
                             "--world-size", "2", "--rank", "1", "--dtype", "float32",
                             "--cpu-threads", "1", *flags],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_a_stage_started_by_hand_joins_the_engine(tiny_llama):
    params = SamplingParams(max_tokens=16, **GREEDY)
    batch = prompts(4)
    ref = LLM(tiny_llama, **engine_kwargs())
    expected = [o.outputs[0].token_ids for o in ref.generate(batch, params, use_tqdm=False)]
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    stage = start_stage(tiny_llama, dist_init)
    try:
        llm = LLM(tiny_llama, **stage_kwargs("cpu,cpu", dist_init=dist_init, world_size=2,
                                             stage_join_timeout=60))
        try:
            assert llm.engine.stages.procs == []  # nothing spawned: it joined by itself
            got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
            assert got == expected
        finally:
            llm.shutdown()
        err = stage.communicate(timeout=30)[1]
        assert stage.returncode == 0, err  # ended by the engine's shutdown message
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait(10)
    assert no_stage_left()


def test_stages_that_never_join_time_out_with_a_clear_error(tiny_llama):
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the 2 stages did not all join .* within 2 s"):
        LLM(tiny_llama, **stage_kwargs("cpu,cpu", dist_init=dist_init, world_size=2,
                                       stage_join_timeout=2))
    # the 2 s asked for, not the 300 s default (a loose bound: model loading is in it too)
    assert time.monotonic() - start < 120
    assert no_stage_left()
    stage = start_stage(tiny_llama, dist_init, "--stage-join-timeout", "2")  # and no engine
    err = stage.communicate(timeout=60)[1]
    assert stage.returncode == 1 and "pipeline stage 1: the 2 stages did not all join" in err, err
