"""The suffix drafter (SuffixDecoding): proposes the most frequent continuation of the context's matched suffix, from
the request's own prompt + output and from a global index over earlier requests' outputs (``sacpolicy.runtime.suffix``
holds the matcher; this module only feeds it a row's committed tokens and hands its proposals to the decoder)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sacpolicy.decoding.protocols import Drafter, Peekable, Resettable
from sacpolicy.decoding.teacher import TeacherForced, TeacherForcing
from sacpolicy.decoding.types import DraftBlock, DraftRow
from sacpolicy.runtime.features import PEEK_MAX, Peek
from sacpolicy.runtime.suffix import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_REQUESTS,
    MIN_TOKEN_PROB,
    SPEC_FACTOR,
    SuffixDraft,
    SuffixIndex,
    better,
)


@dataclass
class SuffixState:
    """A suffix drafter's row: the request's own index (prompt + output), its sequence in the drafter's global index,
    how many context tokens both have seen, and the draft of the last ``peek`` (reused by the proposal after it)."""

    local: SuffixIndex | None = None
    local_seq: int = 0
    global_index: SuffixIndex | None = None  # the drafter's global index when the row started (None: none)
    global_seq: int = 0
    seen: int = 0  # context tokens indexed so far
    output_start: int = 0  # context position from which tokens enter the global index
    peeked: tuple[int, SuffixDraft] | None = None  # (context length, draft)


class SuffixDrafter(Drafter, Peekable, Resettable, TeacherForcing):
    """SuffixDecoding over the request's prompt + output (its ``SuffixState``) and over every earlier request's output
    (one global ``SuffixIndex`` shared by all rows and requests of this drafter: a feedback loop across requests).

    Committed tokens are indexed when a row is next seen (``peek`` or ``propose``: the context holds exactly the
    committed tokens, so nothing drafted needs rolling back and ``accept`` has nothing to do). The protocol has no
    end-of-request hook, so a request's output enters the global index incrementally, as its tokens commit; the tokens
    of a request's last step are never seen and stay out. The global index takes a row's tokens from its first
    sighting's last token on: the decoder first shows a row right after prefill (prompt + first token) when a policy
    peeks or drafts at its first step, so the index holds the output only; a row first drafted later loses the
    output before that. Bounded: at most ``max_nodes`` trie nodes and ``max_requests`` requests, least recently
    extended request evicted first (``SuffixIndex``); ``max_requests=0`` keeps no global index.

    A proposal is the matcher's best draft of at most ``max_depth`` tokens, cut to the row's k, so its first j tokens
    do not depend on k (what a policy choosing k expects, and what ``peek`` promises). Confidence per token: the
    matcher's frequency estimate (``sacpolicy.runtime.suffix``), reported to ``stop`` so a policy may cut the block.
    """

    vocab_size = None

    def __init__(self, max_depth: int = MAX_DEPTH, spec_factor: float = SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, max_nodes: int = MAX_NODES, max_requests: int = MAX_REQUESTS,
                 spec_offset: float = 0.0, name: str = "suffix"):
        if spec_factor <= 0:
            raise ValueError(f"suffix spec_factor must be > 0 (proposal length <= spec_factor * match length), got "
                             f"{spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_requests < 0:
            raise ValueError(f"suffix max_requests must be >= 0 (0: no global index), got {max_requests}")
        self.max_depth, self.spec_factor, self.spec_offset = max_depth, spec_factor, spec_offset
        self.min_token_prob, self.name = min_token_prob, name
        self._bounds = (max_nodes, max_requests)
        self.index: SuffixIndex | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every earlier request (a new, empty global index). The global index outlives requests by design, so
        one drafter object serving several evaluations (policies compared on the same prompts, greedy: the same
        outputs) would hand the later ones the earlier ones' answers: reset between them."""
        max_nodes, max_requests = self._bounds
        self.index = SuffixIndex(self.max_depth, max_nodes, max_requests) if max_requests else None

    def new_state(self) -> SuffixState:
        return SuffixState()

    # ------------------------------------------------------------------ indexing
    def _sync(self, state: SuffixState, context: torch.Tensor, output_start: int | None = None) -> None:
        """Index the context tokens ``state`` has not seen (all of them on first sight)."""
        n = int(context.shape[0])
        if state.local is None:
            state.local = SuffixIndex(self.max_depth)
            state.local_seq = state.local.add_sequence()
            state.output_start = max(n - 1, 0) if output_start is None else output_start
            state.global_index = self.index
            state.global_seq = self.index.add_sequence() if self.index is not None else 0
        if n < state.seen:
            raise ValueError(f"suffix drafter state has seen {state.seen} tokens but the row's context has {n}: a "
                             "state belongs to one request (new_state() for each)")
        if n == state.seen:
            return
        new = context[state.seen :].tolist()
        state.local.extend(state.local_seq, new)
        if state.global_index is not None and state.global_index is self.index:  # not reset since the row started
            self.index.extend(state.global_seq, new[max(state.output_start - state.seen, 0) :])
        state.seen = n

    def _draft(self, state: SuffixState, context: torch.Tensor) -> SuffixDraft:
        """The proposal on ``context``, indexes synced first."""
        self._sync(state, context)
        return SuffixDraft() if context.shape[0] == 0 else self._speculate(state.local, context)

    # ------------------------------------------------------------------ the protocol
    def peek(self, state: SuffixState | None, context) -> Peek | None:
        """The proposal ``propose`` would draft now (``Peek``: the confidence of each of its tokens, so its length
        too, and its first token), None when it would propose nothing; the draft is kept for that proposal. Without a
        state (a one-off look) nothing is indexed."""
        if state is None:
            draft = self._lookup(context)
        else:
            draft = self._draft(state, context)
            state.peeked = (int(context.shape[0]), draft)
        return Peek(draft.confidence[:PEEK_MAX], draft.tokens[0]) if draft.tokens else None

    def draft(self, state: SuffixState | None, context) -> SuffixDraft:
        """The matcher's whole draft on ``context`` (what ``propose`` cuts to k), the row's new tokens indexed first
        (as ``peek`` indexes them); without a state a one-off look that indexes nothing."""
        return self._lookup(context) if state is None else self._draft(state, context)

    def _lookup(self, context) -> SuffixDraft:
        """The draft a fresh row would get on ``context``, indexing nothing in the global index."""
        if context.shape[0] == 0:
            return SuffixDraft()
        local = SuffixIndex(self.max_depth)
        local.extend(local.add_sequence(), context.tolist())
        return self._speculate(local, context)

    def _speculate(self, local: SuffixIndex, context: torch.Tensor) -> SuffixDraft:
        """The request's own draft unless the global index's scores higher."""
        tail = context[-self.max_depth :].tolist()
        args = (self.max_depth, self.spec_factor, self.spec_offset, self.min_token_prob)
        draft = local.speculate(tail, *args)
        return draft if self.index is None else better(draft, self.index.speculate(tail, *args))

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        return [self._propose(row) for row in rows]  # row by row: each reads the global index as it stands

    def _propose(self, row: DraftRow) -> DraftBlock:
        context, st = row.context, row.state
        if st is None:
            raise ValueError("SuffixDrafter.propose needs the row's state (DraftRow(drafter.new_state(), ...))")
        peeked, st.peeked = st.peeked, None
        draft = peeked[1] if peeked is not None and peeked[0] == context.shape[0] else self._draft(st, context)
        if not draft.tokens or row.k <= 0:
            return DraftBlock.empty(context.device)
        n = min(row.k, len(draft.tokens))
        conf = torch.tensor(draft.confidence[:n], dtype=torch.float32)
        if row.stop is not None:
            for i in range(n - 1):
                if row.stop(i, conf[i]):
                    n = i + 1
                    break
        tokens = torch.tensor(draft.tokens[:n], dtype=torch.long, device=context.device)
        return DraftBlock(tokens, None, conf[:n].to(context.device))

    def teacher_force(self, ids: torch.Tensor, start: int, k_max: int,
                      aux: torch.Tensor | None = None) -> TeacherForced:
        """Row g: the block ``propose`` would make on ``ids[:start + g]``, on one state grown along the sequence (as a
        live row's is), whose output ``ids[start:]`` enters the global index as it goes, as a finished live request's
        does; the global index is read as it stands (earlier requests' outputs), so sequences teacher-forced in
        request order see what live decoding in that order sees."""
        state, rows, conf, each = self.new_state(), [], [], []
        for g in range(start, ids.shape[0]):
            context = ids[:g]
            if state.local is None:
                self._sync(state, context, output_start=start)
            draft = self._draft(state, context)
            n = min(k_max, len(draft.tokens))
            row = torch.full((k_max,), -1, dtype=torch.long)
            row[:n] = torch.tensor(draft.tokens[:n], dtype=torch.long)
            rows.append(row)
            conf.append(list(draft.confidence[0]) if n else [0.0, 0.0, 0.0])
            each.append(list(draft.confidence[:n]))
        tokens = torch.stack(rows).to(ids.device) if rows else torch.empty(0, k_max, dtype=torch.long)
        return TeacherForced(tokens, chained=True, confidence=torch.tensor(conf, dtype=torch.float32).view(-1, 3),
                             block_confidence=each)
