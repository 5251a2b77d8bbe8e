"""Token trees (EAGLE-2 / SpecInfer): a draft of several candidate continuations sharing prefixes, verified by the
target in one pass with a tree attention mask.

A tree hangs below the row's last committed token (the root, column 0 of the verify pass). Node j (0-based) is column
j + 1; ``parents[j]`` is its parent node (-1: the root) and ``depths[j]`` its depth (1 below the root). Nodes are in
topological order (a parent before its children) and a node's children in the order verification tries them (most
likely first). A chain of k tokens is the tree whose node j has parent j - 1.

``TokenTree.attention`` is the part of the verify pass's mask among the block's own columns: a node sees the root,
its ancestors and itself, at position (committed length - 1) + depth, so the target computes each node exactly as if
its path were the committed sequence. ``grow_tree`` builds a tree the EAGLE-2 way (Li et al. 2024, "EAGLE-2: faster
inference of language models with dynamic draft trees"): depth by depth, expand the ``width`` best nodes of the last
depth by cumulative draft log-probability, each into its ``width`` best children; finally keep the ``budget`` best
nodes of all. A child's score is at most its parent's, so the kept nodes always include their ancestors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["TokenTree", "best_nodes", "grow_tree"]


@dataclass(frozen=True)
class TokenTree:
    """A draft tree (``sacpolicy.decoding.tree``: the layout and how trees grow): ``tokens`` [N] long (on the target's
    device), ``parents`` (-1: the root, the last committed token) and ``depths`` per node (host ints)."""

    tokens: torch.Tensor
    parents: tuple[int, ...]
    depths: tuple[int, ...]

    def __post_init__(self) -> None:
        n = int(self.tokens.shape[0])
        if self.tokens.dim() != 1 or len(self.parents) != n or len(self.depths) != n:
            raise ValueError(f"a token tree needs one parent and one depth per token; got {tuple(self.tokens.shape)} "
                             f"tokens, {len(self.parents)} parents, {len(self.depths)} depths")
        for j, (p, d) in enumerate(zip(self.parents, self.depths)):
            if not -1 <= p < j or d != (1 if p < 0 else self.depths[p] + 1):
                raise ValueError(f"tree node {j} has parent {p} and depth {d}: a parent must come before its child "
                                 "(-1 = the root) and a node's depth must be its parent's + 1; build trees with "
                                 "TokenTree.build or grow_tree")

    @classmethod
    def build(cls, tokens: torch.Tensor, parents: Sequence[int]) -> TokenTree:
        """A tree of these tokens and parents (the depths follow)."""
        depths: list[int] = []
        for j, p in enumerate(parents):
            p = int(p)
            if not -1 <= p < j:
                raise ValueError(f"tree node {j} has parent {p}; a parent must come before its child (-1 = the root)")
            depths.append(1 if p < 0 else depths[p] + 1)
        return cls(tokens, tuple(int(p) for p in parents), tuple(depths))

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> TokenTree:
        """The chain of these tokens: node j's parent is node j - 1."""
        n = int(tokens.shape[0])
        return cls(tokens, tuple(range(-1, n - 1)), tuple(range(1, n + 1)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.size - 1))

    def children(self) -> list[list[int]]:
        """Per column (0 = the root, j + 1 = node j): its children's node indices, in the order they are tried."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for j, p in enumerate(self.parents):
            out[p + 1].append(j)
        return out

    def attention(self, T: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify pass's view of T >= size + 1 columns (the root, the nodes, then padding): (mask [T, T] bool, True
        where column c attends column c'; offsets [T] long, each column's position after the root's). A node attends
        the root, its ancestors and itself, at offset = its depth; padding columns are causal, at their own index."""
        if T < self.size + 1:
            raise ValueError(f"a tree of {self.size} nodes needs {self.size + 1} columns, got {T}")
        mask = torch.ones(T, T, dtype=torch.bool).tril_()
        mask[: self.size + 1, : self.size + 1] = False
        mask[0, 0] = True
        for j, p in enumerate(self.parents):
            mask[j + 1] = mask[p + 1]
            mask[j + 1, j + 1] = True
        offsets = torch.arange(T)
        offsets[1 : self.size + 1] = torch.tensor(self.depths, dtype=torch.long)
        return mask.to(device), offsets.to(device)

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to ``node`` (-1: the root alone, an empty path)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


# expand(nodes, tokens, parents, depths): the draft's log-probabilities [len(nodes), V] of the children of ``nodes``,
# given every node grown so far (token ids in the draft's vocabulary, parents, depths)
Expand = Callable[[list[int], list[int], list[int], list[int]], torch.Tensor]


def grow_tree(root_logp: torch.Tensor, expand: Expand, budget: int, depth: int, width: int,
              return_scores: bool = False) -> tuple[list, ...]:
    """EAGLE-2's dynamic tree: (tokens, parents) of at most ``budget`` nodes and ``depth`` levels, topologically
    ordered, siblings in descending draft probability. ``root_logp`` [V]: the draft's log-probabilities after the
    last committed token. Each depth expands (one ``expand`` call) the ``width`` best nodes of the previous depth by cumulative
    log-probability into their ``width`` best children, of which the ``width`` best form the next depth; growth stops
    early once no new node could enter the best ``budget`` (a child never outscores its parent). Token ids are the
    draft's own (the caller maps them to the target's). ``return_scores``: each kept node's cumulative draft
    log-probability as well (what ``best_nodes`` ranks by)."""
    if budget < 1 or depth < 1 or width < 1:
        raise ValueError(f"a token tree needs budget, depth and width >= 1, got {budget}, {depth}, {width}")
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []

    def add(cands: list[tuple[float, int, int]], d: int) -> list[int]:
        new = []
        for s, parent, tok in cands:
            if s != float("-inf"):
                new.append(len(tokens))
                tokens.append(tok), parents.append(parent), depths.append(d), scores.append(s)
        return new

    top = root_logp.float().topk(min(width, root_logp.shape[-1]))
    frontier = add([(s, -1, t) for s, t in zip(top.values.tolist(), top.indices.tolist())], 1)
    for d in range(2, depth + 1):
        if not frontier:
            break
        if len(scores) >= budget and max(scores[f] for f in frontier) <= sorted(scores, reverse=True)[budget - 1]:
            break  # every descendant scores at most its ancestor: none would be kept
        logp = expand(frontier, tokens, parents, depths).float()  # [f, V]
        top = logp.topk(min(width, logp.shape[-1]), dim=-1)
        cand = torch.tensor([scores[f] for f in frontier], dtype=torch.float64)[:, None] + top.values.double()
        best = cand.flatten().topk(min(width, cand.numel()))
        w = top.indices.shape[1]
        ids = top.indices.tolist()
        frontier = add([(s, frontier[i // w], ids[i // w][i % w])
                        for s, i in zip(best.values.tolist(), best.indices.tolist())], d)
    return best_nodes(tokens, parents, scores, budget, return_scores)


def best_nodes(tokens: list[int], parents: list[int], scores: list[float], n: int, return_scores: bool = False):
    """The ``n`` best nodes of a tree by cumulative log-probability ``scores`` (ties: the earlier node), in their
    tree order, parents renumbered: (tokens, parents[, scores]). A child never outscores its parent and comes after
    it, so the kept nodes hold their ancestors: a tree grown with budget N cut to its n best is the tree grown with
    budget n (EAGLE-2 sizes its tree so, after growing it)."""
    keep = sorted(sorted(range(len(tokens)), key=lambda j: (-scores[j], j))[:n])
    index = {old: new for new, old in enumerate(keep)}
    out = [tokens[j] for j in keep], [index[parents[j]] if parents[j] >= 0 else -1 for j in keep]
    return (*out, [scores[j] for j in keep]) if return_scores else out
