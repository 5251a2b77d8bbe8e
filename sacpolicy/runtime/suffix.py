"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; Snowflake's arctic-inference behind vLLM's
``method="suffix"``) in numpy-free plain Python: the matcher sacpolicy's ``SuffixDrafter`` runs, importable by a
production decoder without torch.

``SuffixIndex`` is a trie of every suffix of its sequences, each cut at ``max_depth`` tokens: the node of a string s
counts the positions where s occurs (``count``) and how many of those occurrences are followed by a token
(``total``, the sum of its children's counts). Appending a token extends the (at most ``max_depth``) suffixes still
shorter than ``max_depth``, so an append costs O(max_depth) dictionary operations; a sequence can be removed again
(its suffixes are walked and their counts taken back), which bounds a shared index by LRU eviction.

A proposal (``SuffixIndex.speculate``) follows, for every match length m (1 .. max_depth) at which the context's last
m tokens occur in the index, the most frequent continuation from that node; each step's estimated probability is the
product of the conditional frequencies count(child) / total(parent) so far, and the walk stops when it falls below
``min_token_prob``, at a leaf, or after ``min(max_tokens, spec_factor * m + spec_offset)`` tokens (the proposal
length adapts to how much of the context matched). Of all match lengths, the draft with the largest score (sum of
the estimated probabilities; ties to the longer match) wins. A node's depth is capped, so match + proposal <=
``max_depth``.

Each proposed token's confidence, in the decoder's draft-stats layout (top-1, entropy, margin), is the frequency
estimate of the continuation distribution at its step with one escape count for "a continuation not seen yet" (PPM's
method A): top-1 = c1 / (n + 1), margin = (c1 - c2) / (n + 1), entropy over the children's c / (n + 1) and the escape
1 / (n + 1), where n = total and c1 >= c2 the two largest child counts. One earlier occurrence gives top-1 1/2, nine
that agree 9/10: the amount of evidence, not just its agreement, reaches the policy.

Against arctic-inference 0.3.0's ``SuffixDecodingCache`` (``tests/test_arctic.py``, on a request's own tree): the
same proposals, except that arctic divides a continuation's count by every occurrence of the matched string (the
context's own, at the sequence's end, included: its estimates are lower, so it stops earlier at ``min_token_prob``),
breaks ties between equally frequent continuations by its sibling-list order (here: the most recently seen), and
matches only suffixes shorter than the context.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_DEPTH = 24  # longest suffix indexed (match + proposal), vLLM's suffix_decoding_max_tree_depth default
SPEC_FACTOR = 1.0  # proposal length <= SPEC_FACTOR * match length (+ offset)
MIN_TOKEN_PROB = 0.1  # stop proposing where the estimated probability of the draft so far falls below this
MAX_NODES = 200_000  # the global index's bound: trie nodes (and stored tokens) it holds at most
MAX_REQUESTS = 1_000  # ... and requests whose outputs it holds at most

_NONE, _STALE = -1, -2  # best-child markers: no child / recompute before use


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal: ``tokens``, the estimated probability that the draft is right through each of them (``probs``,
    non-increasing), each token's (top-1, entropy, margin) ``confidence``, the ``match_len`` it followed and its
    ``score`` (sum of ``probs``, what competing drafts are ranked by)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    confidence: list[tuple[float, float, float]] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        return float(sum(self.probs))

    def __len__(self) -> int:
        return len(self.tokens)


def better(a: SuffixDraft, b: SuffixDraft) -> SuffixDraft:
    """The draft with the larger score; ``a`` on a tie (callers pass the request's own draft first)."""
    return a if a.score >= b.score else b


class SuffixIndex:
    """A bounded-depth suffix trie over sequences added with ``add_sequence`` and grown with ``extend``.

    Memory: unbounded by default (a request's own index: O(len * max_depth) nodes). With ``max_nodes`` and/or
    ``max_requests`` (the shared index over earlier requests) it holds at most ``max_nodes`` trie nodes (the root not
    counted), at most ``max_nodes`` stored tokens and at most ``max_requests`` sequences: before a token would break
    a bound, the least recently extended sequence is removed whole, the one being extended included when it is the
    only one left (later tokens of a removed sequence are ignored; its id is never reused). Memory is O(max_nodes).
    """

    def __init__(self, max_depth: int = MAX_DEPTH, max_nodes: int | None = None, max_requests: int | None = None):
        if max_depth < 1:
            raise ValueError(f"suffix max_depth must be >= 1, got {max_depth}")
        if max_nodes is not None and max_nodes < max_depth:
            raise ValueError(f"suffix max_nodes must be >= max_depth ({max_depth}): one token adds up to max_depth "
                             f"nodes; got {max_nodes}")
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"suffix max_requests must be >= 1, got {max_requests} (0 = no shared index: the "
                             "drafter then keeps none)")
        self.max_depth, self.max_nodes, self.max_requests = max_depth, max_nodes, max_requests
        # node i: occurrences, occurrences followed by a token, {token: child} (None: leaf), best child's token
        self._count, self._total, self._children, self._best = [0], [0], [None], [_NONE]
        self._free: list[int] = []
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # LRU order: least recently extended first
        self._active: dict[int, list[int]] = {}  # per sequence: nodes of its suffixes still < max_depth, oldest first
        self._next_id = 0
        self.num_tokens = 0

    # ------------------------------------------------------------------ size
    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free) - 1

    @property
    def sequences(self) -> list[int]:
        """Ids of the sequences held, least recently extended first."""
        return list(self._seqs)

    def count(self, path) -> int:
        """Occurrences of ``path`` (a string of at most ``max_depth`` tokens) in the sequences held."""
        node = self._walk([int(t) for t in path])
        return 0 if node is None else self._count[node]

    # ------------------------------------------------------------------ growing
    def add_sequence(self) -> int:
        """A new, empty sequence's id (evicting the least recently extended one when ``max_requests`` are held)."""
        while self.max_requests is not None and len(self._seqs) >= self.max_requests:
            self.remove(next(iter(self._seqs)))
        seq, self._next_id = self._next_id, self._next_id + 1
        self._seqs[seq], self._active[seq] = [], []
        return seq

    def extend(self, seq: int, tokens) -> None:
        """Append ``tokens`` to sequence ``seq``: O(max_depth) per token. A removed sequence ignores them."""
        if seq >= self._next_id or seq < 0:
            raise KeyError(f"suffix index has no sequence {seq}; add_sequence() makes one")
        for t in tokens:
            if seq not in self._seqs:
                return
            self._append(seq, int(t))

    def _append(self, seq: int, token: int) -> None:
        while self.max_nodes is not None and (self.num_nodes + self.max_depth > self.max_nodes
                                              or self.num_tokens >= self.max_nodes):
            victim = next(iter(self._seqs))
            self.remove(victim)
            if victim == seq:
                return
        self._seqs[seq].append(token)
        self._seqs.move_to_end(seq)
        self.num_tokens += 1
        active = self._active[seq]
        active.append(0)  # the suffix starting at this token, from the root
        for j, node in enumerate(active):
            active[j] = self._increment(node, token)
        if len(active) >= self.max_depth:
            del active[0]  # that suffix reached max_depth: it grows no more

    def _increment(self, node: int, token: int) -> int:
        children = self._children[node]
        if children is None:
            children = self._children[node] = {}
        child = children.get(token)
        if child is None:
            child = children[token] = self._alloc()
        self._count[child] += 1
        self._total[node] += 1
        best = self._best[node]
        if best == _NONE or (best != _STALE and self._count[child] >= self._count[children[best]]):
            self._best[node] = token  # ties go to the most recently seen continuation
        return child

    def _alloc(self) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node], self._total[node], self._children[node], self._best[node] = 0, 0, None, _NONE
            return node
        for column, value in ((self._count, 0), (self._total, 0), (self._children, None), (self._best, _NONE)):
            column.append(value)
        return len(self._count) - 1

    def remove(self, seq: int) -> None:
        """Take sequence ``seq`` out: every count its suffixes added is taken back and emptied nodes are freed."""
        tokens = self._seqs.pop(seq)
        del self._active[seq]
        self.num_tokens -= len(tokens)
        D = self.max_depth
        for s in range(len(tokens)):
            node = 0
            for t in tokens[s : s + D]:  # exactly the path the suffix starting at s was grown along
                children = self._children[node]
                child = children[t]
                self._count[child] -= 1
                self._total[node] -= 1
                if self._best[node] == t:
                    self._best[node] = _STALE
                if self._count[child] == 0:  # no walk passes it any more: free it (its children follow below)
                    del children[t]
                    self._free.append(child)
                node = child

    # ------------------------------------------------------------------ proposing
    def _walk(self, path: list[int]) -> int | None:
        node = 0
        for t in path:
            children = self._children[node]
            node = None if children is None else children.get(t)
            if node is None:
                return None
        return node

    def _best_child(self, node: int) -> tuple[int, int] | None:
        children = self._children[node]
        if not children:
            return None
        best = self._best[node]
        if best == _STALE or best not in children:
            count = self._count
            best = max(children, key=lambda t: count[children[t]])
            self._best[node] = best
        return best, children[best]

    def speculate(self, context, max_tokens: int, spec_factor: float = SPEC_FACTOR, spec_offset: float = 0.0,
                  min_token_prob: float = MIN_TOKEN_PROB) -> SuffixDraft:
        """The most frequent continuation of the context's best-scoring matched suffix (see the module docstring);
        empty when no suffix of ``context`` (ints, only the last ``max_depth`` read) occurs or nothing clears
        ``min_token_prob``."""
        tail = [int(t) for t in context[-self.max_depth :]]
        best, best_path = SuffixDraft(), []
        for m in range(1, len(tail) + 1):
            node = self._walk(tail[len(tail) - m :])
            if node is None:
                break  # a longer suffix that contains this one cannot occur either
            budget = min(max_tokens, int(m * spec_factor + spec_offset + 1e-6))
            tokens, probs, path = self._follow(node, budget, min_token_prob)
            if tokens and sum(probs) >= best.score:
                best, best_path = SuffixDraft(tokens, probs, match_len=m), path
        if not best.tokens:
            return best
        return SuffixDraft(best.tokens, best.probs, [self._confidence(n) for n in best_path], best.match_len)

    def _follow(self, node: int, budget: int, min_token_prob: float) -> tuple[list[int], list[float], list[int]]:
        """Up to ``budget`` most frequent continuations from ``node``: tokens, estimated probabilities, and the node
        each was chosen at."""
        tokens, probs, path, prob = [], [], [], 1.0
        while len(tokens) < budget:
            step = self._best_child(node)
            if step is None:
                break
            prob *= self._count[step[1]] / self._total[node]
            if prob < min_token_prob:
                break
            tokens.append(step[0])
            probs.append(prob)
            path.append(node)
            node = step[1]
        return tokens, probs, path

    def _confidence(self, node: int) -> tuple[float, float, float]:
        """(top-1, entropy, margin) of the continuation distribution at ``node`` with one escape count."""
        counts = [self._count[c] for c in self._children[node].values()]
        denom = self._total[node] + 1.0
        top = sorted(counts, reverse=True)[:2] + [0]
        entropy = -sum(c / denom * math.log(c / denom) for c in counts) + math.log(denom) / denom
        return top[0] / denom, entropy, (top[0] - top[1]) / denom
