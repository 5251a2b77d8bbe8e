"""Toy models behind the causal-LM interface the decoder uses, for exact distribution tests; and ``load_script``, the
tests' one way to call a script's functions in-process."""

import importlib.util
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from transformers import LlamaConfig

from sacpolicy.decoding import DraftRow, NgramDrafter, PolicyRow, SamplingConfig
from sacpolicy.runtime import FEATURE_NAMES
from sacpolicy.runtime.cost import CostModel, PiecewiseLinear
from sacpolicy.runtime.features import feature_spec
from sacpolicy.runtime.predictors import Predictor
from sacpolicy.runtime.rule import DecisionRule
from sacpolicy.training.predictor import fit_mlp, fit_sklearn


def load_script(name: str):
    """``scripts/<name>.py`` as a module (``<name>_cli``), to call its functions in this process (a subprocess costs
    seconds of imports); registered in ``sys.modules``, where a script's dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(f"{name}_cli", Path(__file__).resolve().parents[1] / "scripts"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def policy_rows(policy, states, memories=None) -> list:
    """Rows of new requests for ``Policy.decide`` (each state's request started), or with the given memories."""
    memories = memories or [policy.start(s.request) for s in states]
    return [PolicyRow(s, m) for s, m in zip(states, memories)]


def decide_one(policy, state, memory=None):
    """The policy's decision for one row (a new request's, unless ``memory``)."""
    return policy.decide(policy_rows(policy, [state], None if memory is None else [memory]))[0]


def propose_one(drafter, context, k, sampling=None, generator=None, stop=None, state=None):
    """One row's block from ``drafter`` (a fresh state unless ``state``)."""
    row = DraftRow(drafter.new_state() if state is None else state, context, k, sampling or SamplingConfig(),
                   generator, stop)
    return drafter.propose([row])[0]


def mixed_prompts(lengths, seed: int, repeats: int) -> list[list[int]]:
    """Random prompts of ``lengths`` (ids 3..49151: the tiny target's vocabulary) and one repetitive prompt, [5, 6, 7,
    8] ``repeats`` times, that the n-gram drafter finds long accepted blocks in: the batch tests' mixed workload."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in lengths] + [[5, 6, 7, 8] * repeats]


class FlakyNgram(NgramDrafter):
    """An n-gram drafter that raises on the rows of ``mixed_prompts``' repetitive prompt (their context starts 5, 6, 7,
    8): the decoder drops it for that request and decodes on without it (``GenerationResult.dropped_drafters``)."""

    def propose(self, rows):
        if any(row.context[:4].tolist() == [5, 6, 7, 8] for row in rows):
            raise RuntimeError("draft server went away")
        return super().propose(rows)


def markov_pair(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q): two random [v, v] transition matrices, rows normalised and every entry at least a little likely, for a
    Markov target and a Markov draft that disagree; the chi-square tests' pair."""
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(v, v, generator=g) ** 2 + 0.02
    Q = torch.rand(v, v, generator=g) ** 2 + 0.02
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


class Markov(torch.nn.Module):
    """An order-1 Markov chain: logits of the next token depend on the last token only. ``logp`` [vocab, out]: rows
    are log-probabilities over ``out`` tokens (fewer than the vocabulary for a trimmed-vocabulary draft)."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.logp = torch.nn.Parameter(logp, requires_grad=False)
        self.head = torch.nn.Linear(1, logp.shape[1], bias=False)
        self.config = LlamaConfig(vocab_size=logp.shape[0], num_hidden_layers=1, max_position_embeddings=64)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=1, **batch):
        # batch: a batched decoder's position_ids and 4D mask; an order-1 chain reads neither
        if cache is not None:  # hold one (empty) entry per token, as a real model's cache does, so crops have rows
            z = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1)
            cache.update(z, z, 0)

        class Out:
            logits = self.logp[input_ids[:, -logits_to_keep:]]

        return Out


def synthetic_traces(n_prompts: int = 60, length: int = 48, drafters=("draft", "ngram"), seed: int = 0,
                     vocab: int = 1000, k_max: int = 8) -> list[dict]:
    """Teacher-forced trace rows whose acceptance follows the draft's confidence: a drafted token is accepted with
    probability top1 (calibrated draft), top1 drawn per position; drafter 1 (when given) is a model-free drafter that
    proposes spans in repetitive stretches. Gives predictors a real signal to learn and policies a real choice."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    cats = ("writing", "coding", "math", "code")
    for i in range(n_prompts):
        pid, cat, L = f"synthetic/{i}", cats[i % len(cats)], int(rng.integers(8, 200))
        target = rng.integers(3, vocab, length)
        easy = rng.random() < 0.5  # prompts differ: some are easy to draft, some hard
        for d, name in enumerate(drafters):
            if d == 0:
                top1 = rng.beta(4, 1.5, length) if easy else rng.beta(1.5, 4, length)
                match = rng.random(length) < top1
                entropy, margin, plen = (1 - top1) * 3, top1 * 0.8, [k_max] * length
            else:
                match = rng.random(length) < (0.6 if easy else 0.05)
                top1, entropy, margin = np.ones(length), np.zeros(length), np.ones(length)
                plen = [k_max if m else 0 for m in match]
            run, r = [0] * length, 0
            for g in range(length - 1, -1, -1):
                r = r + 1 if match[g] else 0
                run[g] = min(r, k_max, plen[g])
            for g in range(length):
                rows.append({
                    "prompt_id": pid, "category": cat, "prompt_len": L, "drafter": name, "position": g,
                    "target_token": int(target[g]), "draft_token": int(target[g]) if match[g] else -1,
                    "match": bool(match[g]), "top1": float(top1[g]), "entropy": float(entropy[g]),
                    "margin": float(margin[g]), "p_target": 0.5, "q_target": float(top1[g]) if match[g] else 0.0,
                    "beta": float(top1[g]), "run_len": int(run[g]), "proposal_len": int(plen[g]),
                    "proposal": d > 0,
                })
    return rows


# The three predictor kinds with small settings, as a conf/predictor option instantiates them (partials).
PREDICTORS = {
    "hgb": partial(fit_sklearn, estimator=HistGradientBoostingClassifier(max_iter=50, max_depth=6, random_state=0)),
    "logreg": partial(fit_sklearn, estimator=LogisticRegression(max_iter=500)),
    "mlp": partial(fit_mlp, max_epochs=4, hidden=(32,), lr=3e-3, weight_decay=1e-4, batch_size=512, patience=4,
                   trainer_kwargs={"enable_progress_bar": False}),
}


# ---------------------------------------------------------------------- rules for vLLM's proposer (test_vllm, test_serve)
def ngram_rule(mode: str) -> DecisionRule:
    """A rule that reads what the vLLM proposer must reproduce: the peeked match length (top1 = n / 3), the
    request's acceptance history (accept_ema) and the position; so its blocks vary from AR to long ones."""
    coef = np.zeros(len(FEATURE_NAMES))
    for name, c in {"top1": 3.0, "accept_ema": 4.0, "has_accept_ema": -1.5, "position": -0.35}.items():
        coef[FEATURE_NAMES.index(name)] = c
    pred = Predictor("linear", {"mean": np.zeros(len(coef)), "scale": np.ones(len(coef)), "coef": coef,
                                "intercept": np.array([-1.0])}, {"features": feature_spec()})
    cost = CostModel(device="cpu", verify={"tokens": PiecewiseLinear([1, 2, 4, 9], [0.06, 0.07, 0.08, 0.11]),
                                           "per_context": 1e-5},
                     draft={"ngram": PiecewiseLinear([0], [2e-4])}, per_token_draft={"ngram": False})
    return DecisionRule(pred, cost, ("ngram",), 8, ("ngram", 4), mode, 1.0)


def lookup_rule(mode: str = "stop") -> DecisionRule:
    """``ngram_rule`` over both lookup drafters (n-gram, suffix), as a pool of ``draft=[ngram,suffix]`` serves in vLLM:
    the drafter index, the peeks' agreement and each drafter's own acceptance history weigh in, so the rule picks
    either drafter, or none, from step to step."""
    coef = np.zeros(len(FEATURE_NAMES))
    for name, c in {"top1": 3.0, "accept_ema": 4.0, "has_accept_ema": -1.5, "position": -0.35,
                    "drafter_index": 0.3, "agree": 0.8}.items():
        coef[FEATURE_NAMES.index(name)] = c
    pred = Predictor("linear", {"mean": np.zeros(len(coef)), "scale": np.ones(len(coef)), "coef": coef,
                                "intercept": np.array([-1.0])}, {"features": feature_spec()})
    cost = CostModel(device="cpu", verify={"tokens": PiecewiseLinear([1, 2, 4, 9], [0.06, 0.07, 0.08, 0.11]),
                                           "per_context": 1e-5},
                     draft={"ngram": PiecewiseLinear([0], [2e-4]), "suffix": PiecewiseLinear([0], [3e-4])},
                     per_token_draft={"ngram": False, "suffix": False})
    return DecisionRule(pred, cost, ("ngram", "suffix"), 8, ("ngram", 4), mode, 1.0)


LOOKUP_DRAFTERS = {"ngram": {"kind": "ngram", "max_ngram": 3}, "suffix": {"kind": "suffix", "max_depth": 24,
                                                                          "spec_factor": 2.0, "min_token_prob": 0.1,
                                                                          "max_nodes": 200_000, "max_requests": 1000}}


def ngram_batch_rule() -> DecisionRule:
    """The same predictor with a cost model profiled over batch sizes in which drafting is free alone and dear in any
    batch: its k-by-batch-size map for vLLM is [(1, 1, 4), (2, 4, 0)]."""
    from dataclasses import replace

    rule = ngram_rule("k")
    cost = CostModel("cpu", {"tokens": PiecewiseLinear([1, 9], [0.06, 0.0602]), "per_context": 1e-5}, rule.cost.draft,
                     rule.cost.per_token_draft,
                     batch={2: {"tokens": PiecewiseLinear([1, 9], [0.07, 0.60]), "per_context": 1e-5},
                            4: {"tokens": PiecewiseLinear([1, 9], [0.08, 1.2]), "per_context": 1e-5}})
    return replace(rule, cost=cost)


class MarkovTreeDrafter:
    """Token trees from an order-1 Markov draft (``logq`` [vocab, vocab] log-probabilities), grown as the feature
    drafter grows them (``tree.grow_tree``): a ``DraftsTrees`` drafter for exact distribution tests of tree decoding
    with a ``Markov`` target. ``tree``: the budget of decisions that name none."""

    vocab_size = None

    def __init__(self, logq: torch.Tensor, name: str = "tree", tree: int = 0, width: int = 2):
        self.logq, self.name, self.tree_budget, self.width = logq, name, tree, width

    def new_state(self):
        return None

    def accept(self, state, n_accepted):
        pass

    def propose(self, rows):
        from sacpolicy.decoding import DraftBlock
        from sacpolicy.decoding.tree import TokenTree, grow_tree

        out = []
        for row in rows:
            budget, width = (row.tree, self.width) if row.tree else (row.k, 1)  # budget 0: the greedy chain
            tokens, parents = grow_tree(self.logq[row.context[-1]], lambda nodes, toks, par, dep: self.logq[
                torch.tensor([toks[j] for j in nodes])], budget, row.k, width)
            tree = TokenTree.build(torch.tensor(tokens, dtype=torch.long), parents)
            out.append(DraftBlock(tree.tokens, None, tree=tree if row.tree else None))
        return out


class ModelTreeDrafter(MarkovTreeDrafter):
    """Token trees from a causal LM's own next-token log-probabilities plus a fixed random bias per token (``scale``:
    0 is the target itself, larger scales make its best guess wrong more often, so accepted paths run through other
    children too), each node's distribution from a cache-free pass over the context and its path: a slow, obviously
    correct ``DraftsTrees`` drafter for exactness tests on a real transformers target."""

    def __init__(self, model, scale: float, name: str = "model-tree", tree: int = 0, width: int = 3, seed: int = 1):
        self.model, self.name, self.tree_budget, self.width = model, name, tree, width
        self.bias = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(seed)) * scale

    def _logp(self, seqs) -> torch.Tensor:
        return torch.stack([torch.log_softmax(self.model(input_ids=x.view(1, -1)).logits[0, -1].float() + self.bias,
                                              -1) for x in seqs])

    def propose(self, rows):
        from sacpolicy.decoding import DraftBlock
        from sacpolicy.decoding.tree import TokenTree, grow_tree

        out = []
        for row in rows:
            def expand(nodes, toks, par, dep, ctx=row.context):
                paths = [[toks[a] for a in _ancestry(j, par)] for j in nodes]
                return self._logp([torch.cat([ctx, torch.tensor(p, dtype=torch.long)]) for p in paths])

            budget, width = (row.tree, self.width) if row.tree else (row.k, 1)
            tokens, parents = grow_tree(self._logp([row.context])[0], expand, budget, row.k, width)
            tree = TokenTree.build(torch.tensor(tokens, dtype=torch.long), parents)
            out.append(DraftBlock(tree.tokens, None, tree=tree if row.tree else None))
        return out


def _ancestry(node: int, parents) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
