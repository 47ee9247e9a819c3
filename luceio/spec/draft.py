"""Draft-model proposer: a small model with the target's tokenizer drafts k tokens per request,
batched across requests, with its own paged KV cache managed by the same block-pool code.

The draft cache of a request holds the tokens it was fed; after verification the valid part is
the longest common prefix of what it was fed and the request's (now verified) tokens, so the
cache stays consistent after rejections and the next round only feeds the 1–2 new tokens.

A chain's draft steps are launched back to back with no host read between them: from the second
step on, a request's input id is the draft the step before sampled, gathered on the device
(`runner.DeviceTokenIds`, overlapped scheduling's mechanism, inside graph replays too), so the
host prepares step j+1 while the device runs step j and the drafts reach the host in one read
after the last step. Which requests a step extends, its block allocations and its draws (one
per step over the same rows, so per-request generators advance alike) are those of drafting
step by step with a read after each: greedy and seeded drafts do not depend on it."""
from __future__ import annotations

import torch

from ..cache import KVCacheManager
from ..models.cpu_decode import VERIFY_ROWS
from ..pipeline import DeviceSamples
from ..sampler import device_tensor
from ..scheduler import ScheduledRequest, SchedulerOutput
from .chain import DraftChain, plain_argmax
from .draft_cache import DraftCache, DraftSeq
from .proposer import Proposal, ProposalInput, Proposer
from .tree import MAX_ROWS, DraftTree
from .tree_graph import DraftTreeGraph, tree_levels


class DraftModelProposer(DraftCache, Proposer):
    def __init__(self, runner, block_size: int, sampler, tree_budget: int = 0,
                 tree_topk: int = 2, max_chain: int = 0, target_vocab: int | None = None,
                 window: int = 0):
        """`max_chain`: the longest chain asked for (k_max); where the draft runner has CUDA
        graphs, greedy chains run their steps past the first in one replay (`spec.chain`).
        `target_vocab`: the target's vocabulary size where the draft's is a few padding rows
        shorter (`spec.check_draft_vocab`): ids the draft has no row for are fed to it as id 0
        and its logits are padded with -inf to the target's size, so its drafts and their
        probabilities are over the target's ids (the padded ones at probability 0).
        `window`: the draft's context window (`DraftCache.window`; 0: whole prompts)."""
        self.runner = runner  # a ModelRunner over the draft model
        self.vocab = runner.cfg.vocab_size
        self.pad = max(0, (target_vocab or self.vocab) - self.vocab)
        self.sampler = sampler  # the engine's: drafts are drawn with each request's parameters
        # with prefix caching: a request's verified full blocks are registered as the draft
        # catches up with them (`_sync`), so a new request whose tokens begin with an earlier
        # one's (a chat's next turn, an agent's next call, a shared system prompt) starts
        # from them (`_adopt`) instead of feeding its whole prompt to the draft again
        self.kv = KVCacheManager(runner.num_blocks, block_size)
        self.seqs: dict[str, DraftSeq] = {}
        self.window = window
        self.tree_budget, self.tree_topk = tree_budget, tree_topk
        self.chain = None
        if runner.graphs is not None and max_chain > 1:
            self.chain = DraftChain(runner, max_chain - 1, runner.graphs.max_seqs)
            self.chain.capture()
        # greedy trees built on the device (`spec.tree_graph`); None: the host path only
        self.tree_graph = None
        if tree_budget and max_chain > 1 and getattr(runner.model, "tree_span", False) \
                and not runner.stateful:
            self.tree_graph = DraftTreeGraph(runner, tree_topk, max_chain)
            if runner.graphs is not None:
                self.tree_graph.capture()

    def propose(self, batch: list[ProposalInput]) -> Proposal:
        """Drafts batch[i].k tokens for each batch[i].request (tokens: batch[i].tokens), in one
        draft forward per draft position, all launched before the one host read of the drafts
        (see the module docstring). `Proposal.probs`: when any request samples, the
        distributions [sum(len(drafts)), vocab] the drafts were drawn from, on the device. With
        a tree budget: `propose_trees`."""
        if self.tree_budget and all(p.tree for p in batch):
            return self.propose_trees(batch)
        reqs = [p.request for p in batch]
        seqs = [self._sync(p.request.request_id, list(p.tokens)) for p in batch]
        fed = self._behind(seqs, batch)
        steps, sampled, probs = self._launch(seqs, reqs, [p.k for p in batch])
        drafts, order = self._read_drafts(seqs, steps, sampled)
        if not probs:
            return Proposal(drafts, None, fed=fed)
        flat = torch.cat(probs)  # step-major rows, as `order` counts them
        return Proposal(drafts, flat[device_tensor(order, torch.int64, flat.device)], fed=fed)

    def _launch(self, seqs: list[DraftSeq], reqs, ks: list[int]):
        """Queues the draft steps without reading anything back. Returns the requests each step
        extended (indices into `seqs`), its sampled ids and, when any request samples, the
        probabilities it drew them from (device tensors, one row per request it extended)."""
        any_sampled = any(not r.params.greedy for r in reqs)
        steps: list[list[int]] = []
        sampled: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        live = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            live = [i for i in live if step < ks[i] and self._room(seqs[i], step)]
            if not live:
                break
            if step == 1 and self.chain is not None and plain_argmax(reqs):
                chained = self._launch_chain(seqs, ks, live, steps[0], sampled[0])
                if chained is not None:
                    steps += chained[0]
                    sampled.append(chained[1])
                    break
            previous = DeviceSamples([seqs[i].request_id for i in steps[-1]], sampled[-1], None,
                                     []) if steps else None
            live_reqs = [reqs[i] for i in live]
            processed = self._step_logits(seqs, live, live_reqs, step, previous)
            steps.append(live)
            sampled.append(self.sampler.draw(processed, live_reqs))
            if any_sampled:
                probs.append(processed.softmax(-1))
        return steps, sampled, probs

    def _launch_chain(self, seqs: list[DraftSeq], ks: list[int], live: list[int],
                      first_live: list[int], first: torch.Tensor):
        """Steps 1.. of a greedy chain in one `DraftChain` launch (graph replay), for the
        requests `live` at step 1 (room for it allocated). Returns (the requests each step
        extended, their drafts step-major in one device tensor), or None where no graph fits;
        blocks allocated for the steps stay (the step-by-step path would allocate them too)."""
        # as many steps as drafting step by step would run, blocks allocated in its order
        num_steps, going = [1] * len(live), list(range(len(live)))
        for step in range(2, max(ks[i] for i in live)):
            going = [r for r in going if step < ks[live[r]] and self._room(seqs[live[r]], step)]
            for r in going:
                num_steps[r] = step
        n, most = len(live), max(num_steps)
        if self.runner.device.type == "cuda" and self.chain.bucket(n, most) is None:
            return None
        if live != first_live:
            where = {i: r for r, i in enumerate(first_live)}
            first = first[device_tensor([where[i] for i in live], torch.int64, first.device)]
        out = self.chain.run(first, [seqs[i] for i in live], num_steps, self.kv)
        steps = [[i for i, m in zip(live, num_steps) if m >= j] for j in range(1, most + 1)]
        if min(num_steps) == most:
            drafts = out.reshape(-1)
        else:
            rows = [j * n + r for j in range(most) for r, m in enumerate(num_steps) if m > j]
            drafts = out.reshape(-1)[device_tensor(rows, torch.int64, out.device)]
        for i, m in zip(live, num_steps):
            seqs[i].num_computed_tokens = len(seqs[i].all_token_ids) + m
        return steps, drafts

    def _step_logits(self, seqs: list[DraftSeq], live: list[int], live_reqs, step: int,
                     previous: DeviceSamples | None) -> torch.Tensor:
        """Draft step `step` over `seqs[i]` for i in `live`: their processed logits. Past the
        first step a request's input is its draft from `previous`, which only the device holds:
        its draft sequence counts it as computed without having it, so `prepare` leaves a
        placeholder for it."""
        sched = SchedulerOutput([ScheduledRequest(seqs[i], len(seqs[i].all_token_ids) + step -
                                                  seqs[i].num_computed_tokens) for i in live], [])
        inp = self._prepare(sched)
        if previous is not None:
            inp.ids_from = previous.ids_for(inp.device_ids)
        logits = self._logits(inp)
        for i in live:
            seqs[i].num_computed_tokens = len(seqs[i].all_token_ids) + step
        return self.sampler.process(logits, live_reqs)

    @staticmethod
    def _read_drafts(seqs: list[DraftSeq], steps: list[list[int]], sampled: list[torch.Tensor]
                     ) -> tuple[list[list[int]], list[int]]:
        """Reads every step's drafts in one transfer and appends them to the draft sequences.
        Returns the drafts per request and, request by request, the step-major row of each."""
        flat = torch.cat(sampled).tolist() if sampled else []
        drafts: list[list[int]] = [[] for _ in seqs]
        rows: list[list[int]] = [[] for _ in seqs]
        for row, i in enumerate(i for live in steps for i in live):
            drafts[i].append(flat[row])
            rows[i].append(row)
        for s, d in zip(seqs, drafts):
            s.all_token_ids.extend(d)
        return drafts, [row for r in rows for row in r]

    def propose_trees(self, batch: list[ProposalInput]) -> Proposal:
        """Draft trees (`spec.tree`), EAGLE-2 style: level by level, the `tree_topk` most
        probable next tokens (under each request's sampling parameters) of the `tree_topk`
        nodes of the last level whose paths are most probable, up to batch[i].k levels (one
        draft forward per level over every request's tree so far: its rows from the root, with
        their ancestor masks); then the `tree_budget` nodes of highest path probability are
        kept (a node's path is never more probable than its parent's, so that set is a
        subtree). Children are point masses for acceptance (`spec.tree.accept`): the drafts
        carry no probabilities and the output distribution stays the target's. Greedy
        batches of a few requests build their levels on the device (`_device_trees`)."""
        reqs, ks = [p.request for p in batch], [p.k for p in batch]
        seqs = [self._sync(p.request.request_id, list(p.tokens)) for p in batch]
        behind = self._behind(seqs, batch)
        if self.tree_graph is not None and plain_argmax(reqs):
            trees = self._device_trees(seqs, reqs, ks)
            if trees is not None:
                return Proposal([t.tokens for t in trees], None,
                                [t if t.num_nodes else None for t in trees], fed=behind)
        trees = [DraftTree() for _ in reqs]
        path_p: list[list[float]] = [[] for _ in reqs]  # per node: its path's probability
        live = [i for i, k in enumerate(ks) if k > 0 and self._room(seqs[i])]
        if live:  # catch up to the root; its logits give the first level
            sched = SchedulerOutput([ScheduledRequest(seqs[i], seqs[i].num_tokens_with_spec -
                                                      seqs[i].num_computed_tokens) for i in live], [])
            probs = self._level_probs(sched, live, reqs)
            for i, p in zip(live, probs):
                self._expand(trees[i], path_p[i], [(-1, 1.0, p[-1])])
                seqs[i].num_computed_tokens = len(seqs[i].all_token_ids) - 1  # all but the root
        fed = list(live)
        width = self.tree_topk * self.tree_topk  # nodes a level adds past the first
        for depth in range(2, max(ks, default=0) + 1):
            live = [i for i in live if depth <= ks[i] and trees[i].num_nodes + width < MAX_ROWS
                    and self._room_for_tree(seqs[i], trees[i])]
            if not live:
                break
            for i in live:  # rows: the root again, then the nodes so far
                seqs[i].spec_tree, seqs[i].spec_token_ids = trees[i], list(trees[i].tokens)
            sched = SchedulerOutput([ScheduledRequest(seqs[i], 1 + trees[i].num_nodes,
                                                      list(trees[i].tokens), trees[i])
                                     for i in live], [])
            probs = self._level_probs(sched, live, reqs)
            for i, p in zip(live, probs):
                d = trees[i].depths()
                last = [n for n in range(trees[i].num_nodes) if d[n] == depth - 1]
                last = sorted(last, key=lambda n: -path_p[i][n])[:self.tree_topk]
                self._expand(trees[i], path_p[i], [(n, path_p[i][n], p[n + 1]) for n in last])
        for i in fed:  # the root's KV is valid; the nodes' is scratch, past the computed count
            s = seqs[i]
            s.num_computed_tokens = len(s.all_token_ids)
            s.spec_tree, s.spec_token_ids = None, []
        trees = [self._best(t, pp) for t, pp in zip(trees, path_p)]
        return Proposal([t.tokens for t in trees], None,
                        [t if t.num_nodes else None for t in trees], fed=behind)

    def _device_trees(self, seqs: list[DraftSeq], reqs, ks: list[int]) -> list[DraftTree] | None:
        """`propose_trees` with levels 2.. built on the device (`spec.tree_graph`), or None
        (nothing run) where it cannot take the batch: too many requests, or no room in the
        context or the draft cache for a tree's rows."""
        graph = self.tree_graph
        live = [i for i, k in enumerate(ks) if k > 0]
        levels = min(tree_levels(max(ks, default=0), self.tree_topk), graph.levels)
        if not live or graph.bucket(len(live)) is None:
            return None
        fed = graph.fed_rows(levels)  # cache entries from the root on
        limit = self.runner.max_model_len  # the graphs' block tables
        for i in live:
            s = seqs[i]
            end = len(s.all_token_ids) - 1 + fed  # cache length through the last fed node
            if end >= self.runner.cfg.max_position_embeddings or end > limit or \
                    not self.kv.allocate_slots(s, end - s.num_computed_tokens):
                return None
        sched = SchedulerOutput([ScheduledRequest(seqs[i], len(seqs[i].all_token_ids) -
                                                  seqs[i].num_computed_tokens) for i in live], [])
        inp = self._prepare(sched)  # catch up to the root: its logits
        root = self.sampler.process(self._logits(inp), [reqs[i] for i in live])
        toks, parents, scores = graph.run(root, [seqs[i] for i in live], levels, self.kv)
        depth = graph.depth
        trees = [DraftTree() for _ in seqs]
        for j, i in enumerate(live):
            seqs[i].num_computed_tokens = len(seqs[i].all_token_ids)  # the nodes' KV: scratch
            index, path_p, tree = {0: -1}, [], trees[i]  # row -> node
            for row, (t, p, sc) in enumerate(zip(toks[j], parents[j], scores[j]), start=1):
                if depth[row] <= ks[i] and p in index and sc != float("-inf"):
                    index[row] = tree.num_nodes
                    tree.tokens.append(t)
                    tree.parents.append(index[p])
                    path_p.append(sc)
            trees[i] = self._best(tree, path_p)
        return trees

    def _best(self, tree: DraftTree, path_p: list[float]) -> DraftTree:
        """The `tree_budget` nodes of highest path probability, in their original order."""
        if tree.num_nodes <= self.tree_budget:
            return tree
        depth = tree.depths()
        keep = sorted(range(tree.num_nodes), key=lambda n: (-path_p[n], depth[n], n))
        keep = sorted(keep[:self.tree_budget])
        index = {n: j for j, n in enumerate(keep)}
        return DraftTree([tree.tokens[n] for n in keep],
                         [index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in keep])

    def _level_probs(self, sched, live: list[int], reqs) -> list[torch.Tensor]:
        """One draft forward; per live request, its rows' next-token probabilities under its
        sampling parameters (greedy requests: the softmax of the raw logits)."""
        inp = self._prepare(sched)
        logits = self._logits(inp)
        out = []
        for i, s in zip(live, sched.scheduled):
            rows = inp.row_slices[s.req.request_id]
            processed = self.sampler.process(logits[rows], [reqs[i]] * (rows.stop - rows.start))
            out.append(processed.softmax(-1))
        return out

    def _expand(self, tree: DraftTree, path_p: list[float], frontier) -> None:
        """Adds the `tree_topk` children of each frontier (node, path probability, next-token
        probabilities)."""
        for node, pp, p in frontier:
            top = torch.topk(p, min(self.tree_topk, p.shape[-1]))
            for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
                if prob > 0.0:
                    tree.tokens.append(tok)
                    tree.parents.append(node)
                    path_p.append(pp * prob)

    def _prepare(self, sched: SchedulerOutput):
        """`runner.prepare` for a draft forward. Catching up with the target's verified tokens
        is no prompt chunk: on the CPU a few rows take the decode path's multi-row matvec, as
        a verify does, where the prompt path multiplies every quantized weight dense (a 5-row
        feed of the 0.5B draft took 130 ms against 19 ms a one-row draft step)."""
        inp = self.runner.prepare(sched, self.kv)
        if inp.prefill and self.runner.device.type == "cpu" and inp.host.tree_mask is None \
                and int(inp.host.q_lens.max()) <= VERIFY_ROWS:
            inp.prefill = False
        return inp

    def _logits(self, inp) -> torch.Tensor:
        """The draft forward's logits, padded to the target's vocabulary with -inf."""
        logits = self.runner.execute(inp)
        if self.pad:
            logits = torch.nn.functional.pad(logits, (0, self.pad), value=float("-inf"))
        return logits
