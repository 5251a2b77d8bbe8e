"""``FeatureDrafter``: the drafter protocol over an EAGLE-3 head (``sacpolicy.decoding.eagle3``), fed the target's
hidden states by the decoder after every target pass."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sacpolicy.decoding.eagle3 import Eagle3Head, KVCache, load_head
from sacpolicy.decoding.protocols import Drafter, DraftsTrees, ReadsFeatures
from sacpolicy.decoding.sampling import draft_stats, probs_from_logits, sample
from sacpolicy.decoding.teacher import TeacherForced, TeacherForcing
from sacpolicy.decoding.tree import TokenTree, best_nodes, grow_tree
from sacpolicy.decoding.types import DraftBlock, DraftRow
from sacpolicy.runtime.spec import TREE_WIDTH


@dataclass
class FeatureDraftState:
    """A feature drafter's row: the target's feature rows not fed to the head yet, the head's KV cache and the last
    true entry's output."""

    pending: list = field(default_factory=list)  # [m, A] feature rows not fed yet
    rows: int = 0  # feature rows received this request
    cache: KVCache = field(default_factory=KVCache)
    true: int = 0  # true entries in the cache
    tail: tuple | None = None  # (pre-norm output [1, 1, H], draft logits [Vd]) of the last true entry


class FeatureDrafter(Drafter, DraftsTrees, ReadsFeatures, TeacherForcing):
    """Drafts a chain with an ``Eagle3Head`` from the target's hidden states.

    A row's state (``FeatureDraftState``): the feature rows of committed positions (``extend_features``; row t pairs
    with token t + 1) and the head's KV cache. Invariant between steps: the cache holds the true entries of the rows
    fed so far; a proposal feeds the pending (row, token) pairs, then one chain entry per drafted token but the last.
    Chain entries were computed from the head's own hidden states, so ``accept`` crops all of them; the accepted
    tokens return as true pairs with the next rows.

    ``propose`` drafts every row's block together: each drafted token's draft logits come from ONE output projection
    over the rows still drafting (the projection to the vocabulary is most of a head step, and one matrix product
    over b rows reads its weights once instead of b times), and the layer runs once over every row's entries
    (``Eagle3Head.layer_step_rows``: its projections and MLP over all of them, the attention per row on the row's own
    cache, since rows hold caches of different lengths), for each drafted token and for the target features handed
    over since each row's last proposal, whose last outputs share one projection.

    Token trees (``DraftRow.tree`` = n > 0; ``tree``: the budget of decisions that name none): EAGLE-2's dynamic tree
    (``tree.grow_tree``) of at most n nodes and depth k, ``tree_width`` nodes expanded per depth in one masked layer
    step (``Eagle3Head.layer_step_masked``: each node attends the row's true entries and its ancestors' entries, at
    position true + depth - 1, as a chain along its path would). The tree is chosen deterministically from the head's
    distributions (top-k, whatever the sampling settings), so its nodes are verified as proposals of probability one
    (``sampling.verify_tree``). Its entries are cropped like a chain's (``accept``): the accepted path returns as true
    entries with the target's features of it. Tree rows grow one after another, after the rows' common feed."""

    def __init__(self, head: Eagle3Head, name: str = "feature", tree: int = 0, tree_width: int = TREE_WIDTH):
        if tree < 0 or tree_width < 1:
            raise ValueError(f"feature drafter {name!r}: tree must be >= 0 (0 = chains) and tree_width >= 1, got "
                             f"{tree} and {tree_width}")
        self.head, self.name = head, name
        self.tree_budget, self.tree_width = int(tree), int(tree_width)
        self.tree_cost = None  # (CostModel, its name for this head): trees sized by it (``size_trees_by``)
        self.vocab_size = head.config.target_vocab_size
        self.aux_layers = tuple(head.config.aux_layer_ids)

    def size_trees_by(self, cost, drafter: str | None = None) -> None:
        """Size every token tree by ``cost`` (a ``runtime.cost.CostModel``) after growing it, as EAGLE-2 does: of the
        row's tree of at most n nodes, keep the m <= n best that maximise expected tokens per second
        (``CostModel.best_tree_budget``, at the row's context length and the number of rows proposing, or one where
        the cost model was profiled at one row only), a node's
        acceptance taken as its cumulative draft probability (EAGLE-2's estimate: the head's own confidence, not
        calibrated against the target). The decision's budget is then the most nodes a tree may keep. ``drafter``: the
        cost model's name for this head (default: the drafter's name). ``cost=None``: trees keep their budget."""
        if cost is None:
            self.tree_cost = None
            return
        name = drafter or self.name
        if name not in cost.draft:
            raise ValueError(f"the cost model prices drafters {sorted(cost.draft)}, not {name!r}: pass the name it "
                             "profiled this head under (size_trees_by(cost, drafter=...))")
        self.tree_cost = (cost, name)

    def new_state(self) -> FeatureDraftState:
        return FeatureDraftState()

    def extend_features(self, state: FeatureDraftState, aux: torch.Tensor) -> None:
        width = len(self.aux_layers) * self.head.config.hidden_size
        if aux.dim() != 2 or aux.shape[-1] != width:
            raise ValueError(f"feature rows must be [m, {width}] (aux layers {list(self.aux_layers)}), got "
                             f"{tuple(aux.shape)}")
        state.pending.append(aux)
        state.rows += aux.shape[0]

    @staticmethod
    def _take_pending(state: FeatureDraftState, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending (row, token) pairs, now counted as fed: feature rows [m, A] and their tokens [m]. The caller
        runs them through the head, which caches them as true entries."""
        rows = torch.cat(state.pending)
        m, start = rows.shape[0], state.true
        state.pending, state.true = [], start + m
        return rows, context[start + 1 : start + 1 + m]

    def _start(self, row: DraftRow, label: str) -> bool:
        """Settle the row's last proposal and say whether to propose (the rows handed over since still to feed)."""
        n = row.context.shape[0]
        if row.state.rows != n - 1:
            raise ValueError(f"{label} holds hidden states of {row.state.rows} positions but the context has {n} "
                             f"tokens (it needs {n - 1}: every committed position but the last); the decoder must "
                             "call extend_features after every target pass")
        self.accept(row.state, 0)  # drop the chain of an unsettled proposal
        return row.k > 0 and n >= 2

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        out: list[DraftBlock | None] = [None] * len(rows)
        tails, fed = {}, {}
        for i, row in enumerate(rows):
            if not self._start(row, "the feature drafter" if len(rows) == 1 else f"the feature drafter of row {i}"):
                out[i] = DraftBlock.empty(row.context.device)
            elif row.state.pending:  # target features handed over since the row's last proposal: fed below
                fed[i] = self._take_pending(row.state, row.context)
            else:
                tails[i] = row.state.tail
        if fed:  # every fed row's entries through the layer at once; their last outputs through one projection
            feats, ids = (torch.cat(parts) for parts in zip(*fed.values()))
            counts = [f.shape[0] for f, _ in fed.values()]
            hidden = self.head.project(feats).unsqueeze(0)  # [1, M, H]
            h = self.head.layer_step_rows(hidden, ids.view(1, -1), [rows[i].state.cache for i in fed], counts)
            last = h[0, torch.tensor(counts, device=h.device).cumsum(0) - 1].unsqueeze(1)  # [b, 1, H]
            logits = self.head.logits(last)  # [b, 1, Vd]
            for r, i in enumerate(fed):
                rows[i].state.tail = tails[i] = (last[r : r + 1], logits[r, -1])
        trees = {i: tails.pop(i) for i in sorted(tails) if rows[i].tree > 0}
        tails = dict(sorted(tails.items()))
        live = list(tails)
        tokens: dict[int, list] = {i: [] for i in live}
        block_logits: dict[int, list] = {i: [] for i in live}
        block_probs: dict[int, list] = {i: [] for i in live}  # sampled rows: q over the draft vocabulary
        while live:
            # the live rows' draft logits at once, over the draft vocabulary: its argmax is the full vocabulary's (ties
            # included: ``set_vocab``) and q = 0 outside it, so the confidence is the same, 6x fewer logits to read
            # than per row over the target's vocabulary (``scripts/bench_head.py --stop`` times it)
            trimmed = torch.stack([tails[i][1] for i in live])  # [b, Vd]
            greedy = self.head.draft_ids[trimmed.argmax(-1)]
            stats = draft_stats(trimmed) if any(rows[i].stop is not None for i in live) else None
            going = []
            for r, i in enumerate(live):
                row = rows[i]
                if row.sampling.greedy:
                    tok = greedy[r]
                else:  # q over the draft vocabulary: the target-vocabulary q is 0 elsewhere, so temperature, top-k
                    # and top-p give the same distribution there at a sixth of the work; drawn from and verified with
                    q = probs_from_logits(trimmed[r], row.sampling)
                    tok = self.head.draft_ids[sample(q, row.generator)]
                    block_probs[i].append(q)
                tokens[i].append(tok)
                block_logits[i].append(trimmed[r])
                n = len(tokens[i])
                if not (n == row.k or (row.stop is not None and row.stop(n - 1, stats[r]))):
                    going.append(i)
            if going:
                h = self.head.layer_step_rows(torch.cat([tails[i][0] for i in going], dim=1),
                                              torch.cat([tokens[i][-1].view(1) for i in going]).view(1, -1),
                                              [rows[i].state.cache for i in going], [1] * len(going))  # [1, b, H]
                logits = self.head.logits(h)  # [1, b, Vd]
                for r, i in enumerate(going):
                    tails[i] = (h[:, r : r + 1], logits[0, r])
            live = going
        for i, drafted in tokens.items():
            trimmed, sampled = torch.stack(block_logits[i]), bool(block_probs[i])
            out[i] = DraftBlock(torch.stack(drafted), self.head.full_logits(trimmed),
                                confidence=draft_stats(trimmed) if sampled else None,
                                probs=self.head.full_probs(torch.stack(block_probs[i])) if sampled else None)
        for i, tail in trees.items():
            out[i] = self._tree(rows[i], tail, len(rows))
        return out

    def _tree(self, row: DraftRow, tail: tuple, batch: int = 1) -> DraftBlock:
        """The row's token tree grown from its last true entry's (output, draft logits) ``tail``."""
        head, cache = self.head, row.state.cache
        true, device = cache.length, tail[0].device
        outputs: dict[int, torch.Tensor] = {}  # an expanded node's output [1, 1, H] (what its children read)
        slots: dict[int, int] = {}  # an expanded node's entry in the cache

        def expand(nodes, tokens, parents, depths) -> torch.Tensor:
            start, m = cache.length, len(nodes)
            mask = torch.zeros(m, start + m, dtype=torch.bool)
            mask[:, :true] = True
            for r, j in enumerate(nodes):
                a = parents[j]
                while a >= 0:
                    mask[r, slots[a]] = True
                    a = parents[a]
                mask[r, start + r] = True
            hidden = torch.cat([tail[0] if parents[j] < 0 else outputs[parents[j]] for j in nodes], dim=1)
            ids = head.draft_ids[torch.tensor([tokens[j] for j in nodes], device=device)].view(1, -1)
            pos = torch.tensor([true + depths[j] - 1 for j in nodes], device=device)
            h = head.layer_step_masked(hidden, ids, cache, pos, mask.to(device))
            for r, j in enumerate(nodes):
                outputs[j], slots[j] = h[:, r : r + 1], start + r
            return torch.log_softmax(head.logits(h)[0].float(), dim=-1)

        tokens, parents, scores = grow_tree(torch.log_softmax(tail[1].float(), dim=-1), expand, row.tree, row.k,
                                            self.tree_width, return_scores=True)
        if self.tree_cost is not None and len(tokens) > 1:
            cost, name = self.tree_cost
            n, _ = cost.best_tree_budget(name, row.k, int(row.context.shape[0]), [math.exp(s) for s in scores],
                                         range(1, len(tokens) + 1), batch=batch if cost.batch else 1,
                                         width=self.tree_width)
            tokens, parents = best_nodes(tokens, parents, scores, n)
        tree = TokenTree.build(head.draft_ids[torch.tensor(tokens, dtype=torch.long, device=device)], parents)
        return DraftBlock(tree.tokens, None, tree=tree)

    def accept(self, state: FeatureDraftState, n_accepted: int) -> None:
        state.cache.crop(state.true)

    @torch.inference_mode()
    def teacher_force(self, ids, start, k_max, aux=None) -> TeacherForced:
        """Row g: the greedy chain proposed after ``ids[:start + g]``, all rows from ONE ``ttt_forward`` of k_max
        greedy steps (row g's chain starts at feature row start + g - 2)."""
        N = ids.shape[0]
        if aux is None or aux.shape[0] < N - 2:
            raise ValueError(f"a feature drafter's teacher_force needs aux: the target's hidden states at aux layers "
                             f"{list(self.aux_layers)} for the first {N - 2} positions at least")
        if start < 2:
            raise ValueError(f"a feature drafter proposes after two committed tokens at least; start={start}")
        if start >= N or k_max <= 0:
            return TeacherForced(ids.new_zeros(0, max(k_max, 0)), chained=True,
                                 logits=self.head.lm_head.weight.new_zeros(0, self.vocab_size))
        steps = self.head.ttt_forward(ids[1 : N - 1].view(1, -1), aux[: N - 2].unsqueeze(0), k_max, greedy=True)
        rows = slice(start - 2, N - 2)
        tokens = torch.stack([self.head.draft_ids[s[0, rows].argmax(-1)] for s in steps], dim=-1)  # [G, k_max]
        return TeacherForced(tokens, chained=True, logits=self.head.full_logits(steps[0][0, rows]))


def load_feature_drafter(target, path, name: str = "feature", tree: int = 0,
                         tree_width: int = TREE_WIDTH) -> FeatureDrafter:
    """The head at ``path`` as a drafter for ``target`` (a ``LoadedModel``), on the target's device and dtype, after
    checking that the head belongs to this target. ``path``: a head directory in any format ``load_head`` reads (ours,
    speculators' / vLLM's, SpecForge / SGLang's, the EAGLE authors'). ``tree``, ``tree_width``: its token trees
    (``FeatureDrafter``)."""
    return FeatureDrafter(load_head(path, device=target.device, dtype=target.dtype, target=target), name=name,
                          tree=tree, tree_width=tree_width)
