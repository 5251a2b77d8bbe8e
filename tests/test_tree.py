"""Token trees (EAGLE-2 style): the tree attention mask, greedy tree decoding identical to autoregressive decoding
(one row, batched, trees and chains in one batch), both caches rolled back to the accepted path, a budget of 0
exactly today's chain, and the multi-draft acceptance rule (``sampling.verify_tree``) sampling the target's
distribution, directly and through the decoder."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from toys import Markov, MarkovTreeDrafter, ModelTreeDrafter, markov_pair, mixed_prompts

from sacpolicy.decoding import DecoderConfig, RequestInfo, SamplingConfig, SpeculativeDecoder
from sacpolicy.decoding.protocols import Policy
from sacpolicy.decoding.sampling import draw_uniforms, verify_tree, verify_tree_greedy
from sacpolicy.decoding.tree import TokenTree, best_nodes, grow_tree
from sacpolicy.decoding.types import Decision
from sacpolicy.policy import Static


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts((5, 23, 1, 37, 12), seed=0, repeats=6)


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    dec = SpeculativeDecoder(tiny_target.model, stop_token_ids=[])
    return [dec.generate(p, 20).tokens for p in prompts]


# ---------------------------------------------------------------- the tree itself
def test_tree_mask_sees_the_root_the_ancestors_and_itself():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    tree = TokenTree.build(torch.tensor([10, 11, 12, 13, 14]), [-1, -1, 0, 0, 1])
    assert tree.depths == (1, 1, 2, 2, 2) and tree.depth == 2 and not tree.is_chain
    assert tree.children() == [[0, 1], [2, 3], [4], [], [], []]
    mask, offsets = tree.attention(7)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [1, 0, 1, 0, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0],
                             [1, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # the last column is padding: causal
    assert torch.equal(mask, expected)
    assert offsets.tolist() == [0, 1, 1, 2, 2, 2, 6]
    chain = TokenTree.chain(torch.tensor([1, 2, 3]))
    assert chain.is_chain and torch.equal(chain.attention(4)[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.path(4) == [1, 4] and tree.path(-1) == []
    with pytest.raises(ValueError, match="parent must come before"):
        TokenTree.build(torch.tensor([1, 2]), [1, -1])


def test_grow_tree_keeps_the_best_nodes_with_their_ancestors():
    g = torch.Generator().manual_seed(3)
    logq = torch.log_softmax(torch.randn(12, 12, generator=g) * 2, -1)
    for budget, depth, width in [(1, 4, 3), (5, 3, 2), (10, 5, 3), (30, 4, 4)]:
        tokens, parents = grow_tree(logq[0], lambda nodes, toks, par, dep: logq[torch.tensor([toks[j] for j in
                                                                                                nodes])],
                                    budget, depth, width)
        tree = TokenTree.build(torch.tensor(tokens), parents)  # validates: parents first
        assert 1 <= tree.size <= budget and tree.depth <= depth
        assert all(len(c) <= width for c in tree.children())
        scores = [sum(float(logq[0 if i == 0 else tokens[path[i - 1]], tokens[n]]) for i, n in enumerate(path))
                  for path in (tree.path(j) for j in range(tree.size))]
        for c in tree.children():  # siblings in descending probability
            assert all(scores[a] >= scores[b] for a, b in zip(c, c[1:]))
    chain, parents = grow_tree(logq[0], lambda nodes, toks, par, dep: logq[torch.tensor([toks[j] for j in nodes])],
                               4, 4, 1)
    assert parents == [-1, 0, 1, 2]  # width 1: the greedy chain
    assert chain[0] == int(logq[0].argmax()) and chain[1] == int(logq[chain[0]].argmax())


def test_a_grown_tree_cut_to_its_best_nodes_is_the_tree_grown_with_that_budget():
    g = torch.Generator().manual_seed(5)
    logq = torch.log_softmax(torch.randn(12, 12, generator=g) * 2, -1)

    def expand(nodes, toks, par, dep):
        return logq[torch.tensor([toks[j] for j in nodes])]

    big = grow_tree(logq[0], expand, 24, 5, 3, return_scores=True)
    for n in (1, 2, 5, 11, 24):
        assert best_nodes(*big, n) == grow_tree(logq[0], expand, n, 5, 3)
        TokenTree.build(torch.tensor(best_nodes(*big, n)[0]), best_nodes(*big, n)[1])  # ancestors kept


def test_greedy_tree_walk_takes_the_child_the_target_chooses():
    tree = TokenTree.build(torch.tensor([3, 4, 1, 2, 0]), [-1, -1, 1, 1, 3])
    V = 5
    argmax = [4, 0, 2, 0, 0, 3]  # per column: root -> node 1 (token 4) -> node 3 (token 2) -> node 4 (token 0) -> 3
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
    path, nxt = verify_tree_greedy(logits, tree.tokens, tree.children())
    assert path == [1, 3, 4] and int(nxt) == argmax[5]
    argmax[0] = 2  # no child of the root is the target's token
    path, nxt = verify_tree_greedy(torch.nn.functional.one_hot(torch.tensor(argmax), V).float(), tree.tokens,
                                   tree.children())
    assert path == [] and int(nxt) == 2


# ---------------------------------------------------------------- greedy: identical to autoregressive decoding
@pytest.mark.parametrize("budget", [1, 4, 9])
@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_trees_equal_autoregressive_decoding(tiny_target, prompts, reference, budget, max_batch):
    drafter = ModelTreeDrafter(tiny_target.model, scale=0.2)
    dec = SpeculativeDecoder(tiny_target.model, [drafter], Static(4, tree=budget), stop_token_ids=[],
                             config=DecoderConfig(max_batch=max_batch))
    results = dec.generate_batch(prompts, 20)
    assert [r.tokens for r in results] == reference
    steps = [s for r in results for s in r.steps if s.drafted]  # the last step of a row drafts nothing
    assert all(s.tree == budget and s.drafted <= budget for s in steps)
    assert sum(s.accepted for s in steps) > 0
    if budget > 4:
        assert max(s.drafted for s in steps) > 4  # more nodes than the chain's depth: real trees


class TreeForSome(Policy):
    """Trees for rows whose request's category is "tree", chains for the others: both in one batch."""

    def decide(self, rows):
        return [Decision("model-tree", 3, 6 if row.state.request.category == "tree" else 0) for row in rows]


def test_trees_and_chains_share_a_batch(tiny_target, prompts, reference):
    dec = SpeculativeDecoder(tiny_target.model, [ModelTreeDrafter(tiny_target.model, scale=0.2)], TreeForSome(),
                             stop_token_ids=[], config=DecoderConfig(max_batch=4))
    requests = [RequestInfo(category="tree" if i % 2 else "chain") for i in range(len(prompts))]
    results = dec.generate_batch(prompts, 20, requests=requests)
    assert [r.tokens for r in results] == reference
    hf = tiny_target.model.generate(torch.tensor([prompts[1]]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, attention_mask=torch.ones(1, len(prompts[1]), dtype=torch.long))
    assert results[1].tokens == hf[0, len(prompts[1]) :].tolist()  # transformers' own greedy decoding
    for i, r in enumerate(results):
        assert {s.tree for s in r.steps if s.drafted} == ({6} if i % 2 else {0})
    assert max(s.batch_size for r in results for s in r.steps) > 1


def test_the_target_cache_after_tree_steps_is_a_fresh_prefills(tiny_target, prompts):
    """The logits behind every new token (kept by the decoder, read from the cache its tree steps compacted to their
    accepted paths) equal a fresh pass over the committed sequence, one row and batched."""
    for max_batch in (1, 3):
        dec = SpeculativeDecoder(tiny_target.model, [ModelTreeDrafter(tiny_target.model, scale=0.2)],
                                 Static(4, tree=8), stop_token_ids=[], config=DecoderConfig(max_batch=max_batch))
        results = dec.generate_batch(prompts[:4], 16, keep_logits=True)
        for p, r in zip(prompts[:4], results):
            ids = torch.tensor([p + r.tokens])
            with torch.no_grad():
                fresh = tiny_target.model(input_ids=ids).logits[0, len(p) - 1 : -1]
            assert torch.allclose(r.logits, fresh, atol=1e-4), (max_batch, (r.logits - fresh).abs().max())


def test_budget_zero_is_todays_chain(tiny_target, prompts, reference):
    """Decision.tree = 0 drafts exactly the chain a drafter without trees drafts: the same steps."""
    runs = []
    for policy, default in [(Static(4), 0), (Static(4, tree=0), 8)]:
        dec = SpeculativeDecoder(tiny_target.model, [ModelTreeDrafter(tiny_target.model, 0.2, tree=default)],
                                 policy, stop_token_ids=[], config=DecoderConfig(max_batch=2))
        results = dec.generate_batch(prompts, 20)
        assert [r.tokens for r in results] == reference
        runs.append([[(s.drafted, s.accepted, s.tree) for s in r.steps] for r in results])
    assert runs[0] == runs[1]
    assert all(tree == 0 for r in runs[0] for _, _, tree in r)
    # the drafter's default applies when the decision names no budget
    dec = SpeculativeDecoder(tiny_target.model, [ModelTreeDrafter(tiny_target.model, 0.2, tree=5)], Static(3),
                             stop_token_ids=[])
    assert {s.tree for s in dec.generate(prompts[0], 8).steps if s.drafted} == {5}


def test_a_bad_tree_budget_is_refused(tiny_target):
    with pytest.raises(ValueError, match="tree must be"):
        Static(3, tree=-1)
    dec = SpeculativeDecoder(tiny_target.model, [ModelTreeDrafter(tiny_target.model, 0.2)], Static(3, tree=100),
                             stop_token_ids=[])
    with pytest.raises(ValueError, match="tree_max"):
        dec.generate([5, 6, 7], 4)


# ---------------------------------------------------------------- the feature drafter's trees
def test_feature_drafter_trees_are_exact_and_follow_its_chain(tiny_target, prompts, reference, tmp_path):
    from conftest import tiny_head_dir
    from toys import propose_one

    from sacpolicy.decoding.aux import aux_pass
    from sacpolicy.decoding.feature import FeatureDrafter, load_feature_drafter
    from sacpolicy.decoding.types import DraftRow

    head = load_feature_drafter(tiny_target, tiny_head_dir(tiny_target, tmp_path), tree=6)
    for max_batch in (1, 3):
        dec = SpeculativeDecoder(tiny_target.model, [head], Static(4), stop_token_ids=[],
                                 config=DecoderConfig(max_batch=max_batch))
        results = dec.generate_batch(prompts, 20)
        assert [r.tokens for r in results] == reference
        assert {s.tree for r in results for s in r.steps if s.drafted} == {6}
        assert not any(r.dropped_drafters for r in results)
    # the tree's first children from the root are the head's greedy chain (sibling entries in the head's cache,
    # masked out, change nothing), and width 1 grows exactly the chain
    ids = torch.tensor(prompts[3])
    with torch.no_grad():
        _, capture = aux_pass(tiny_target.model, ids, 1, head.aux_layers)
    aux = capture.rows(head.aux_layers)
    for width in (1, 3):
        drafter = FeatureDrafter(head.head, tree=0, tree_width=width)
        chains, trees = drafter.new_state(), drafter.new_state()
        drafter.extend_features(chains, aux[:-1])
        drafter.extend_features(trees, aux[:-1])
        chain = propose_one(drafter, ids, 5, state=chains).tokens.tolist()
        block = drafter.propose([DraftRow(trees, ids, 5, tree=5 if width == 1 else 12)])[0]
        first, col, children = [], 0, block.tree.children()
        while children[col]:
            first.append(int(block.tokens[children[col][0]]))
            col = children[col][0] + 1
        assert len(first) >= 2 and first == chain[: len(first)], (width, first, chain)
        if width == 1:
            assert block.tree.is_chain and first == chain


def _tree_cost(per_token: float):
    """A cost model for the tiny head: each token a pass verifies costs ``per_token`` s on top of 10 ms."""
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.runtime.curve import PiecewiseLinear

    verify = {"tokens": PiecewiseLinear([1, 65], [0.010, 0.010 + 64 * per_token]), "per_context": 0.0}
    return CostModel("cpu", verify, {"feature": PiecewiseLinear([0, 1000], [0.001, 0.001])}, {"feature": True})


def test_trees_sized_by_the_cost_model_are_exact_and_shrink_when_verifying_is_dear(tiny_target, prompts, reference,
                                                                                   tmp_path):
    """EAGLE-2's dynamic size: the tree is cut to the nodes that pay for their verify cost. Free verification keeps
    the budget; dear verification keeps fewer nodes (a chain of one at the extreme); greedy output is unchanged."""
    from conftest import tiny_head_dir

    from sacpolicy.decoding.feature import load_feature_drafter

    head = load_feature_drafter(tiny_target, tiny_head_dir(tiny_target, tmp_path), tree=8)
    sizes = {}
    for per_token in (None, 0.0, 1e-4, 1.0):
        head.size_trees_by(None if per_token is None else _tree_cost(per_token))
        dec = SpeculativeDecoder(tiny_target.model, [head], Static(4), stop_token_ids=[],
                                 config=DecoderConfig(max_batch=3))
        results = dec.generate_batch(prompts[:10], 20)
        assert [r.tokens for r in results] == reference[:10]
        sizes[per_token] = [s.drafted for r in results for s in r.steps if s.drafted]
    assert sizes[0.0] == sizes[None] and max(sizes[None]) == 8  # a free pass: every node the budget allows
    assert max(sizes[1.0]) == 1  # a second per token: one node
    assert 1 < np.mean(sizes[1e-4]) < np.mean(sizes[None]), sizes[1e-4]
    head.size_trees_by(None)
    with pytest.raises(ValueError, match="prices drafters"):
        head.size_trees_by(_tree_cost(0.0), drafter="other")


def test_the_heads_state_after_a_tree_step_is_a_fresh_ones(tiny_target, prompts, tmp_path):
    """After a tree proposal, ``accept`` and the target's features of the accepted path, the head's cache holds the
    true entries only: the next tree equals the tree a fresh state fed every feature grows."""
    from conftest import tiny_head_dir

    from sacpolicy.decoding.aux import aux_pass
    from sacpolicy.decoding.feature import load_feature_drafter
    from sacpolicy.decoding.types import DraftRow

    drafter = load_feature_drafter(tiny_target, tiny_head_dir(tiny_target, tmp_path), tree=6, tree_width=3)
    ids = torch.tensor(prompts[3])
    with torch.no_grad():
        _, capture = aux_pass(tiny_target.model, ids, 1, drafter.aux_layers)
    aux = capture.rows(drafter.aux_layers)
    n = 20
    state = drafter.new_state()
    drafter.extend_features(state, aux[: n - 1])
    for accepted in (2, 0, 3):
        block = drafter.propose([DraftRow(state, ids[:n], 4, tree=6)])[0]
        assert block.tree is not None and state.cache.length > state.true  # the tree's entries, after the true ones
        drafter.accept(state, accepted)
        assert state.cache.length == state.true
        drafter.extend_features(state, aux[n - 1 : n + accepted])  # the verify pass: last token + accepted path
        n += accepted + 1
        fresh = drafter.new_state()
        drafter.extend_features(fresh, aux[: n - 1])
        ours, theirs = (drafter.propose([DraftRow(s, ids[:n], 4, tree=6)])[0] for s in (state, fresh))
        assert torch.equal(ours.tokens, theirs.tokens) and ours.tree.parents == theirs.tree.parents
        drafter.accept(fresh, 0)
        drafter.accept(state, 0)


# ---------------------------------------------------------------- sampling: the multi-draft rule
def _markov_tree(parents, root_token, tokens):
    return TokenTree.build(torch.tensor(tokens), parents), [root_token] + tokens


@pytest.mark.parametrize("drawn", [False, True], ids=["deterministic", "drawn-from-q"])
def test_multi_draft_rule_samples_the_target(drawn):
    """First two emitted tokens of one tree step, with p at a column the Markov target's row of its token: the first
    follows p(root) and, when it is a node with children, the second p(that node). Candidates fixed (q = None: proposals
    of probability one) or drawn i.i.d. from q at their parent, anew for every trial (SpecInfer)."""
    V = 6
    P, Q = markov_pair(V, seed=7)
    parents, root = [-1, -1, -1, 0, 0, 1], 2
    fixed = [4, 1, 0, 1, 3, 5]
    draws = 12_000
    first = np.zeros(V)
    pairs = np.zeros((V, V))
    gen = torch.Generator().manual_seed(11)
    for _ in range(draws):
        if drawn:
            tokens = []
            for j, p in enumerate(parents):
                at = root if p < 0 else tokens[p]
                tokens.append(int(torch.multinomial(Q[at], 1, generator=gen)))
        else:
            tokens = fixed
        tree, cols = _markov_tree(parents, root, tokens)
        p = P[torch.tensor(cols)]
        q = Q[torch.tensor(cols)] if drawn else None
        path, nxt = verify_tree(p, tree.tokens, tree.children(), q, uniforms=draw_uniforms(len(tokens), gen, "cpu"))
        out = [tokens[j] for j in path] + [int(nxt)]
        first[out[0]] += 1
        if path and tree.children()[path[0] + 1]:  # the first token is a node with children: the second is walked
            pairs[out[0], out[1]] += 1
    expected = P[root].double().numpy()
    _, pval = chisquare(first, expected / expected.sum() * draws)
    assert pval > 1e-3, pval
    rows = pairs.sum(1) > 0
    P64 = P.double().numpy()
    expected = (pairs.sum(1, keepdims=True) * P64 / P64.sum(1, keepdims=True))[rows]
    _, pval = chisquare(pairs[rows].ravel(), expected.ravel())
    assert pval > 1e-3, pval


@pytest.mark.parametrize("max_batch", [1, 4])
def test_decoder_tree_sampling_matches_target_distribution(max_batch):
    """At T = 0.7, tokens 2 and 3 (from a tree step: the Markov draft's dynamic tree) follow the target's processed
    distribution, one row and batched."""
    v = 6
    P, Q = markov_pair(v, seed=5)
    sampling = SamplingConfig(temperature=0.7)
    dec = SpeculativeDecoder(Markov(P.log()), [MarkovTreeDrafter(Q.log(), tree=5, width=2)], Static(3),
                             sampling=sampling, config=DecoderConfig(timing=False), stop_token_ids=[])
    draws = 6_000
    counts = np.zeros((v, v))
    for start in range(0, draws, 200):
        results = dec.generate_batch([[0]] * 200, 5, requests=[RequestInfo(seed=start + i) for i in range(200)],
                                     max_batch=max_batch)
        for r in results:
            counts[r.tokens[1], r.tokens[2]] += 1
    assert any(s.tree == 5 and s.drafted > 3 for s in results[0].steps + results[-1].steps)
    Pt = torch.softmax(P.log() / 0.7, -1).double()
    expected = ((Pt[0] @ Pt)[:, None] * Pt).numpy().ravel()
    _, pval = chisquare(counts.ravel(), expected / expected.sum() * draws)
    assert pval > 1e-3, pval


def test_the_feature_spec_carries_the_tree_budget(tiny_target, tmp_path):
    from conftest import tiny_head_dir

    from sacpolicy.build import build_drafter
    from sacpolicy.runtime.spec import DrafterSpec, SpecError

    path = str(tiny_head_dir(tiny_target, tmp_path))
    spec = DrafterSpec.from_dict("head", {"kind": "feature", "path": path, "tree": 12, "tree_width": 3})
    assert DrafterSpec.from_dict("head", spec.to_dict()) == spec
    drafter = build_drafter(spec, tiny_target)
    assert (drafter.tree_budget, drafter.tree_width) == (12, 3)
    chains = DrafterSpec(kind="feature", name="h", path=path)
    assert build_drafter(chains, tiny_target).tree_budget == 0
    # chains write no tree fields: the artifact stays readable by a runtime from before token trees
    assert chains.to_dict() == {"kind": "feature", "path": path}
    assert DrafterSpec.from_dict("h", chains.to_dict()) == chains
    with pytest.raises(SpecError, match="tree >= 0"):
        DrafterSpec(kind="feature", name="h", path=path, tree=-2)
    with pytest.raises(SpecError, match="may have"):
        DrafterSpec.from_dict("n", {"kind": "ngram", "tree": 4})


def test_bench_tree_pairs_tree_and_chain_by_prompt():
    from toys import load_script

    cli = load_script("bench_tree")
    assert cli.configs([8], 6) == {"ar": (0, 0), "chain-k8": (8, 0), "tree-8": (6, 8)}
    per = {"ar": {"tokens": [10, 10, 10], "seconds": [1.0, 1.0, 1.0], "steps": [10, 10, 10], "accepted": [0, 0, 0]},
           "chain-k8": {"tokens": [10, 10, 10], "seconds": [1.0, 1.0, 1.0], "steps": [5, 5, 5],
                        "accepted": [5, 5, 5]},
           "tree-8": {"tokens": [10, 10, 10], "seconds": [0.5, 0.5, 0.5], "steps": [4, 4, 4], "accepted": [6, 6, 6]}}
    s = cli.summarize(per, [8])
    assert s["tree-8"]["accepted_per_step"] == 1.5 and s["chain-k8"]["accepted_per_step"] == 1.0
    assert s["tree-8"]["accepted_per_step_vs_chain"] == pytest.approx(1.5)
    assert s["tree-8"]["tokens_per_s_vs_chain"] == pytest.approx(2.0)
    assert s["tree-8"]["tokens_per_s_interval"] == pytest.approx((2.0, 2.0))
    assert "tree-8" in cli.markdown(s) and "1.50x" in cli.markdown(s)
    assert cli.configs([8], 6, sized=True)["tree-8-sized"] == (6, 8)
    per["tree-8-sized"] = {"tokens": [10, 10, 10], "seconds": [0.4, 0.4, 0.4], "steps": [4, 4, 4],
                           "accepted": [6, 6, 6], "nodes": [12, 12, 12]}
    s = cli.summarize(per, [8])
    assert s["tree-8-sized"]["tokens_per_s_vs_tree"] == pytest.approx(1.25)
    assert s["tree-8-sized"]["tokens_per_s_vs_chain"] == pytest.approx(2.5)
    assert s["tree-8-sized"]["nodes_per_step"] == 3.0 and "1.25x" in cli.markdown(s)


def test_the_cost_model_prices_trees_by_the_tokens_their_pass_verifies():
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.runtime.curve import PiecewiseLinear

    verify = {"tokens": PiecewiseLinear([1, 17, 33], [0.010, 0.012, 0.030]), "per_context": 0.0}
    cost = CostModel("cpu", verify, {"head": PiecewiseLinear([0, 1000], [0.001, 0.001])}, {"head": True},
                     draft_batch={"head": PiecewiseLinear([1, 4], [1.0, 0.5])})
    # nodes + 1 tokens fed, priced as a chain block of as many; depth passes over width entries
    assert cost.tree_step_time("head", 4, 16, 100, width=4) == pytest.approx(4 * 0.5 * 4 * 0.001 + 0.012)
    assert cost.tree_step_time("head", 4, 0, 100) == cost.step_time("head", 4, 100)
    assert cost.verify_time(16, 100) == cost.tree_step_time("head", 4, 16, 100, width=4) - 4 * 0.5 * 0.004
    assert CostModel.expected_tree_tokens([0.9, 0.5, 0.1]) == pytest.approx(2.5)
    # many likely nodes: the bigger tree pays for itself until the pass gets dear (33 tokens fed)
    probs = [0.9] * 4 + [0.5] * 12 + [0.01] * 16
    budget, tps = cost.best_tree_budget("head", 4, 100, probs, [4, 8, 16, 32], width=4)
    assert budget == 16
    assert tps == pytest.approx((1 + sum(sorted(probs, reverse=True)[:16])) / cost.tree_step_time("head", 4, 16, 100,
                                                                                                    width=4))
    with pytest.raises(ValueError, match="budgets"):
        cost.best_tree_budget("head", 4, 100, probs, [0])
