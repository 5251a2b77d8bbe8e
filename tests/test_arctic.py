"""Our suffix matcher (``sacpolicy.runtime.suffix.SuffixIndex``, behind ``SuffixDrafter``) against arctic-inference's
``SuffixDecodingCache``, the suffix tree behind vLLM's ``method="suffix"`` (``scripts/install.sh --vllm`` builds
arctic-inference 0.3.0; these tests skip where it is not importable).

Both propose the most frequent continuation of the best-scoring matched suffix of the context, stopping below
``min_token_prob`` and after ``spec_factor * match length`` tokens; on a request's own tree they agree token for token
except in three documented ways, which the scanning reference ``propose`` below reproduces for each side:
  1. the estimated probability of a continuation: ours divides its count by the occurrences of the matched string
     that are followed by a token; arctic's by all its occurrences, including the one at the end of the sequence (the
     context itself, never followed yet). Arctic's estimates are lower (one occurrence seen before: 1/2, not 1), so
     it stops earlier at ``min_token_prob`` and its scores may prefer another match length;
  2. ties between equally frequent continuations: ours takes the most recently seen; arctic the first of its sibling
     list, an order its count updates keep that no short rule describes: where a tie is met the proposals may differ;
  3. arctic matches suffixes strictly shorter than the context (and than ``max_depth``); ours the whole context too,
     which only matters for contexts shorter than ``max_depth``.
With those, ``propose`` equals ours on every context, and arctic's on every context whose walks meet no tie.
"""

from __future__ import annotations

import random

import pytest

from sacpolicy.runtime.suffix import SuffixIndex

arctic = pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed "
                             "(bash scripts/install.sh <venv> --vllm builds it)")

DEPTH = 24


def propose(seq: list[int], max_tokens: int, *, arctic_rules: bool, min_prob: float = 0.1):
    """(tokens, probs, tied) proposed for the context ``seq`` from its own occurrences, found by scanning: the
    reference both matchers are checked against (module docstring; ``arctic_rules``: rules 1 and 3 as arctic has
    them). ``tied``: some walk chose between equally frequent continuations (the most recently seen here)."""
    tail = seq[-DEPTH:]
    longest = (DEPTH - 1 if len(seq) > DEPTH else len(tail) - 1) if arctic_rules else len(tail)
    best, tied = ([], []), False
    for m in range(1, longest + 1):
        path = tail[len(tail) - m:]
        if not _ends(seq, path):
            break
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < min(max_tokens, m) and len(path) < DEPTH:
            ends = _ends(seq, path)
            after: dict[int, list[int]] = {}
            for p in ends:
                if p < len(seq):
                    after.setdefault(seq[p], []).append(p)
            if not after:
                break
            top = max(len(v) for v in after.values())
            ties = [t for t, v in after.items() if len(v) == top]
            tied |= len(ties) > 1
            token = max(ties, key=lambda t: after[t][-1])
            prob *= top / (len(ends) if arctic_rules else sum(len(v) for v in after.values()))
            if prob < min_prob:
                break
            tokens, probs, path = tokens + [token], probs + [prob], path + [token]
        if tokens and sum(probs) >= sum(best[1]):
            best = (tokens, probs)
    return best[0], best[1], tied


def _ends(seq, path) -> list[int]:
    n = len(path)
    return [i + n for i in range(len(seq) - n + 1) if seq[i:i + n] == path]


def sequences():
    rng = random.Random(0)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    yield [t for _ in range(25) for t in rng.choice(phrases)], 30  # text that repeats phrases
    yield [rng.randrange(8) for _ in range(160)], 40  # a small vocabulary
    yield [rng.randrange(3) for _ in range(80)], 5  # a short prompt: contexts shorter than max_depth


def test_arctic_proposes_the_continuation_of_a_repeated_phrase():
    cache = arctic.SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=0)
    phrase = [11, 12, 13, 14, 15, 16]
    cache.start_request("r", [1, 2, *phrase, 3, 4])
    cache.add_active_response("r", [11, 12, 13])  # the request's output so far: its tree holds what it generated
    draft = cache.speculate("r", [1, 2, *phrase, 3, 4, 11, 12, 13], max_spec_tokens=8)
    assert list(draft.token_ids) == [14, 15, 16] and draft.match_len == 3
    ours = SuffixIndex(max_depth=DEPTH)
    ours.extend(ours.add_sequence(), [1, 2, *phrase, 3, 4, 11, 12, 13])
    got = ours.speculate([1, 2, *phrase, 3, 4, 11, 12, 13], 8)
    assert got.tokens == [14, 15, 16]
    # rule 1: one earlier occurrence; ours is sure of it, arctic counts the context's own occurrence too
    assert got.probs == [1.0] * 3 and list(draft.probs) == pytest.approx([0.5] * 3)


@pytest.mark.parametrize("case", range(3))
def test_ours_and_arctic_differ_only_in_the_documented_rules(case):
    seq, prompt = list(sequences())[case]
    cache = arctic.SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=0)
    cache.start_request("r", seq[:prompt])
    ours = SuffixIndex(max_depth=DEPTH)
    sid = ours.add_sequence()
    ours.extend(sid, seq[:prompt])
    checked_arctic = same = 0
    for i in range(prompt, len(seq)):
        ctx = seq[:i]
        a, b = cache.speculate("r", ctx, max_spec_tokens=8), ours.speculate(ctx, 8)
        tokens, probs, _ = propose(ctx, 8, arctic_rules=False)
        assert (b.tokens, b.probs) == (tokens, pytest.approx(probs)), f"ours at {i}"
        tokens, probs, tied = propose(ctx, 8, arctic_rules=True)
        if not tied:
            assert (list(a.token_ids), list(a.probs)) == (tokens, pytest.approx(probs, rel=1e-5)), f"arctic at {i}"
            checked_arctic += 1
        same += list(a.token_ids) == b.tokens
        cache.add_active_response("r", [seq[i]])
        ours.extend(sid, [seq[i]])
    assert checked_arctic >= 10 and same >= (len(seq) - prompt) // 2
