"""The decoder's vocabulary: plain data and the two protocols (``Drafter``, with its optional capabilities, and
``Policy``). A leaf module: it imports nothing from sacpolicy but the sampling math, and every other layer (policies,
traces, training, export) imports it, never the reverse.

A policy sees three things, all plain data:
- ``RequestInfo`` once per request (prompt length, category, load signal, drafters on offer), to start its memory
  of the request;
- ``DecodeState`` of every row before each step (``PolicyRow``: the state and that memory), to return a
  ``Decision`` per row (drafter name or None, and k);
- the drafted tokens' confidence (``DraftToken``) as they are drafted, if it wants to stop early
  (``needs_token_feedback``; costs one host sync per drafted token on GPUs), and the finished ``StepRecord``.
New inputs go into these dataclasses, never into new method parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch

from sacpolicy.decoding.sampling import SamplingConfig

__all__ = ["Autoregressive", "DecodeState", "Decision", "DraftBlock", "DraftRow", "DraftToken", "Drafter",
           "DraftsTrees", "GenerationResult", "Peekable", "Policy", "PolicyRow", "ReadsFeatures", "RequestInfo",
           "Resettable", "StepRecord", "StopFn", "TeacherForced", "TeacherForcing", "TokenTree", "feature_layers",
           "fresh_drafters", "propose_each", "reset_drafters", "teacher_force"]


# ---------------------------------------------------------------------- requests, state, decisions
@dataclass(frozen=True)
class RequestInfo:
    """What is known of a request before it is decoded. ``generate`` fills ``prompt_len``, ``max_new_tokens``,
    ``drafters`` and, when left None, ``sampling`` (the decoder's); callers pass the rest (``RequestInfo(category=...,
    load=..., seed=...)``)."""

    prompt_len: int = 0
    max_new_tokens: int = 0
    drafters: tuple[str, ...] = ()
    category: str | None = None
    load: float = 0.0  # serving load signal in [0, 1]; 0 = idle
    seed: int | None = None  # sampling seed of this request (None: the decoder's generator continues)
    sampling: SamplingConfig | None = None  # this request's sampling settings (None: the decoder's); rows of one
    # batch may differ, each is verified with its own


@dataclass
class DecodeState:
    """What the decoder knows before a step (and while drafting it)."""

    request: RequestInfo
    step: int = 0  # speculative steps taken so far (prefill excluded)
    context_len: int = 0  # committed tokens: prompt + generated
    generated: int = 0
    remaining: int = 0  # new tokens still allowed
    drafters: tuple[str, ...] = ()  # drafters still usable (a failing drafter is dropped for the request)
    last: StepRecord | None = None
    # per drafter, its acceptance history in the request (``runtime.features.next_accept_history``)
    accept_history: dict[str, tuple[float, float]] = field(default_factory=dict)
    drafter: str | None = None  # while drafting: the drafter in use
    # before deciding, for policies that ask (``uses_peeks``): drafters that can tell cheaply what they would propose
    # (n-gram, suffix) -> each proposed token's confidence (top-1, entropy, margin), or None when they propose nothing
    peeks: dict[str, tuple[tuple[float, float, float], ...] | None] = field(default_factory=dict)
    batch_size: int = 1  # rows the decoder verifies together this step (live, not configured)
    load: float | None = None  # live load in [0, 1] (rows / max_batch when decoding in batches); None: the request's

    @property
    def load_signal(self) -> float:
        """The load policies and features read: live when the decoder measures it, else the request's."""
        return self.request.load if self.load is None else self.load


@dataclass(frozen=True)
class Decision:
    drafter: str | None  # None = autoregressive step
    k: int  # a chain's length; a tree's depth at most
    # a token tree of at most this many nodes (depth <= k; ``DraftsTrees`` drafters only), 0 a chain of k; None: the
    # drafter's own default (``DraftsTrees.tree_budget``, 0 for drafters that draft chains only)
    tree: int | None = None

    @classmethod
    def autoregressive(cls) -> Decision:
        return cls(None, 0)


@dataclass(frozen=True)
class DraftToken:
    """Confidence of one drafted token, at temperature 1 whatever the sampling settings."""

    position: int  # 0-based index within the draft block
    top1: float
    entropy: float
    margin: float  # top-1 minus top-2 probability


# ---------------------------------------------------------------------- what the decoder returns
@dataclass
class StepRecord:
    """One speculative step: draft (maybe nothing), verify in one target pass, emit accepted + 1 tokens.

    Per drafted token (lists of length ``drafted``): draft confidence at temperature 1 (``top1``, ``entropy``,
    ``margin``), and ``q``/``p``/``beta``: the draft and target probability of the drafted token and
    beta = sum_x min(p, q). When sampling they come from the processed distributions (the ones verification uses);
    when greedy (where processed distributions are one-hot) from the temperature-1 distributions, so they stay
    informative.
    """

    step: int
    drafter: str | None
    k: int  # decided
    drafted: int  # actually drafted (a drafter may stop early or find nothing)
    accepted: int
    emitted: int  # tokens appended to the output (accepted + 1, fewer when EOS or the length limit cut the block)
    context_len: int  # committed tokens before the step
    draft_s: float
    verify_s: float
    cooldown: bool = False  # the decoder overrode the policy with an autoregressive step (low moving acceptance)
    batch_size: int = 1  # rows verified in the same target pass (verify_s is that whole pass)
    tree: int = 0  # a token tree's node budget (``drafted`` its nodes, ``accepted`` its accepted path); 0: a chain
    top1: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    p: list[float] = field(default_factory=list)
    beta: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    steps: list[StepRecord]
    prompt_len: int
    prefill_s: float
    total_s: float
    finish_reason: str  # "eos" | "length" | "context"
    dropped_drafters: list[str] = field(default_factory=list)
    logits: object = None  # generate(keep_logits=True): the target's logits behind each new token, [new, V] tensor
    queued_s: float = 0.0  # generate_batch: from the request's arrival to its admission into the batch

    @property
    def latency_s(self) -> float:
        """Arrival to last token: time queued + prefill + decoding."""
        return self.queued_s + self.total_s

    @property
    def target_calls(self) -> int:
        return len(self.steps) + 1  # + the prefill pass

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens emitted per target call (the 'tau' of the papers), counting the prefill pass's first token."""
        return len(self.tokens) / self.target_calls

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(s.drafted for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)


# ---------------------------------------------------------------------- drafters
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


# Called after each drafted token with (position in block, draft_stats of that position: [top-1 prob, entropy,
# margin]); True stops the block after this token.
StopFn = Callable[[int, torch.Tensor], bool]


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [k] long, on the target's device
    logits: torch.Tensor | None  # [k, V] raw draft logits the tokens were chosen from; None = deterministic proposal
    # [k, 3] confidence in the draft_stats layout (top-1, entropy, margin) the drafter assigns its tokens: a
    # deterministic proposal's own (None = certain, [1, 0, 1]), or a model draft's draft_stats of ``logits`` made
    # by the drafter over its own vocabulary (None = the decoder makes them)
    confidence: torch.Tensor | None = None
    # sampled model drafts only: [k, V] the processed distribution q each token was drawn from (sampling.
    # probs_from_logits of ``logits`` at the row's settings), handed to verification as is; None = the decoder makes it
    probs: torch.Tensor | None = None
    # a token tree (``tokens`` its nodes in order; ``logits`` and ``probs`` None: its nodes are verified as proposals
    # of probability one, ``sampling.verify_tree``); None: a chain
    tree: TokenTree | None = None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls, device: torch.device) -> DraftBlock:
        return cls(torch.empty(0, dtype=torch.long, device=device), None)


@dataclass
class TeacherForced:
    """What a drafter proposes at each generated position of a sequence the target wrote, given the true prefix
    (row g: the proposal made on top of ``ids[:start + g]``).

    ``tokens`` [G, w] long, -1 after a proposal's end. ``chained=False`` (w = 1): the drafter's next token after an
    accepted one is its proposal from the next row (a token-level model reads only tokens, which equal the target's
    once accepted), so accepted runs are read down the rows. ``chained=True``: row g is the whole block the drafter
    would propose from there (n-gram copies, feature heads whose later tokens read the draft's own features).
    ``logits`` [G, V]: the raw draft logits of each row's first token (None for deterministic proposals);
    ``confidence`` [G, 3]: (top-1, entropy, margin) of it, when ``logits`` is None. ``block_confidence``: for a
    chained deterministic drafter whose proposed tokens each have a confidence of their own (the suffix drafter), row
    g's per token (lists of (top-1, entropy, margin), one per proposed token); None: every token has its row's.
    """

    tokens: torch.Tensor
    chained: bool
    logits: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    block_confidence: list[list[tuple[float, float, float]]] | None = None

    def proposal_confidence(self, g: int) -> list[list[float]] | None:
        """Row g's ``block_confidence`` as the traces' ``proposal_confidence`` column holds it (None: none)."""
        return None if self.block_confidence is None else [list(c) for c in self.block_confidence[g]]


@dataclass
class DraftRow:
    """One row of a ``Drafter.propose`` call: what to draft after which context, with the row's own state."""

    state: object  # the drafter's state for this row's request (``Drafter.new_state``), owned by the decoder
    context: torch.Tensor  # [n] committed tokens (prompt + output so far)
    k: int  # at most this many tokens
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None
    stop: StopFn | None = None  # called after each drafted token; True ends the block there
    tree: int = 0  # ``DraftsTrees`` drafters: draft a token tree of at most this many nodes and depth k (0: a chain)


class Drafter(Protocol):
    """The drafter protocol's core, with the defaults of its optional parts (``new_state``, ``accept``): subclass it
    and write ``propose``, or match it structurally. A drafter holds what its rows share (weights, a model); what one
    request needs between steps (a KV cache, nothing at all) lives in a state object it makes with ``new_state`` and
    the decoder keeps for the row, handing it back in every call. After verification the drafter is told how many of
    the row's tokens the target accepted (``accept``), so it can roll that state back exactly.

    ``propose`` takes the rows of a batch together, one row being a list of one: model drafters run their rows
    through one forward per drafted token; others may propose row after row.

    What only some drafters can do is a capability protocol of its own, which callers test with ``isinstance``:
    ``Peekable`` (a cheap look at the next proposal), ``ReadsFeatures`` (the target's hidden states, EAGLE-3 heads),
    ``TeacherForcing`` (a faster teacher-forced pass than proposing position by position: ``teacher_force``) and
    ``Resettable`` (state kept across requests, which an evaluation starts afresh for each run).
    """

    name: str
    vocab_size: int | None = None  # logits width; None for drafters without a distribution (n-gram)

    def new_state(self) -> object:
        """The state of one request's row (a new request gets a new one). The default, None: nothing kept."""
        return None

    def propose(self, rows: list[DraftRow]) -> list[DraftBlock]:
        """One block per row, at most ``row.k`` tokens each."""
        raise NotImplementedError

    def accept(self, state, n_accepted: int) -> None:
        """The target accepted the first n_accepted tokens of the row's last proposal."""


@runtime_checkable
class Peekable(Protocol):
    """A drafter whose proposal is a cheap lookup (the n-gram, the suffix tree): ``peek`` tells what ``propose``
    would make now, as cheaply as proposing it, so a policy (``Policy.uses_peeks``) may decide before drafting."""

    def peek(self, state, context: torch.Tensor) -> tuple[tuple[float, float, float], ...] | None:
        """The proposal ``propose`` would make now: the confidence (top-1, entropy, margin) of each of its tokens
        (``sacpolicy.runtime.features.Peek``), or None when it would propose nothing."""
        ...


@runtime_checkable
class DraftsTrees(Protocol):
    """A drafter that drafts token trees (EAGLE-2): for a row whose ``DraftRow.tree`` is n > 0 it proposes a block
    carrying a ``TokenTree`` of at most n nodes and depth ``k``. ``tree_budget``: the budget a ``Decision`` without one
    (``tree=None``) gets (0: chains). Other drafters are always asked for chains."""

    tree_budget: int


@runtime_checkable
class ReadsFeatures(Protocol):
    """A feature drafter (EAGLE-3 heads) reads the target's hidden states: it lists the target layers it needs in
    ``aux_layers`` (HF ``output_hidden_states`` indices: the input of decoder layer i), and after every target pass
    the decoder hands each row's state those states for the newly committed positions (``extend_features``).
    Token-level drafters do not implement it and never see a hidden state."""

    aux_layers: tuple[int, ...]

    def extend_features(self, state, aux: torch.Tensor) -> None:
        """``aux`` [m, len(aux_layers) * H], the target's hidden states at the row's next m committed positions (in
        order; position t's row is read with token t + 1). After every target pass the row's state holds rows for
        every committed position but the last."""
        ...


@runtime_checkable
class TeacherForcing(Protocol):
    """A drafter with its own teacher-forced pass (one batched forward for a model draft); the others are teacher
    forced by proposing at each position (``teacher_force``)."""

    def teacher_force(self, ids: torch.Tensor, start: int, k_max: int,
                      aux: torch.Tensor | None = None) -> TeacherForced:
        """Proposals at every position ``start .. len(ids) - 1`` given the true prefix (see ``TeacherForced``);
        ``aux`` [len(ids), A]: the target's hidden states at ``aux_layers`` for feature drafters."""
        ...


@runtime_checkable
class Resettable(Protocol):
    """A drafter that keeps state across requests (the suffix drafter's global index): ``reset`` forgets every
    earlier request by binding a new, empty state, so a shallow copy reset this way shares nothing of it with the
    original. Runs that must not see each other's outputs (policies evaluated live on the same prompts, in turn)
    decode with their own copies (``fresh_drafters``) or reset between them (``reset_drafters``)."""

    def reset(self) -> None:
        ...


def feature_layers(drafter) -> tuple[int, ...]:
    """The target layers whose hidden states ``drafter`` reads (``ReadsFeatures``); () for token-level drafters."""
    return tuple(drafter.aux_layers) if isinstance(drafter, ReadsFeatures) else ()


def reset_drafters(drafters) -> None:
    """Forget what ``drafters`` (an iterable) kept from earlier requests: ``reset`` every ``Resettable`` one."""
    for d in drafters:
        if isinstance(d, Resettable):
            d.reset()


def fresh_drafters(drafters) -> list:
    """``drafters`` for a run of its own: each ``Resettable`` one a shallow copy, reset (its weights and settings
    shared, its cross-request state new and its own), the others as they are (they keep no request's state)."""
    out = []
    for d in drafters:
        if isinstance(d, Resettable):
            d = copy.copy(d)
            d.reset()
        out.append(d)
    return out


def teacher_force(drafter, ids: torch.Tensor, start: int, k_max: int,
                  aux: torch.Tensor | None = None) -> TeacherForced:
    """``drafter``'s proposals at every position ``start .. len(ids) - 1`` given the true prefix (``TeacherForced``):
    its own pass (``TeacherForcing``), else ``propose`` asked position by position, each on a new state (chained
    blocks). ``aux`` [len(ids), A]: the target's hidden states at the drafter's ``aux_layers``."""
    if isinstance(drafter, TeacherForcing):
        return drafter.teacher_force(ids, start, k_max, aux)
    return propose_each(drafter, ids, start, k_max, aux)


def propose_each(drafter, ids: torch.Tensor, start: int, k_max: int,
                 aux: torch.Tensor | None = None) -> TeacherForced:
    """Teacher forcing by proposing: at each position ``start .. len(ids) - 1``, ``propose`` on the true prefix with
    a new state (fed the features of the prefix first, for feature drafters)."""
    features = aux is not None and bool(feature_layers(drafter))
    rows = []
    for g in range(start, ids.shape[0]):
        state = drafter.new_state()
        if features:
            drafter.extend_features(state, aux[: g - 1])
        block = drafter.propose([DraftRow(state, ids[:g], k_max)])[0]
        row = torch.full((k_max,), -1, dtype=torch.long, device=ids.device)
        row[: block.k] = block.tokens
        conf = block.confidence[0] if block.confidence is not None and block.k else None
        rows.append((row, block.k, conf))
    tokens = torch.stack([r[0] for r in rows]) if rows else torch.empty(0, k_max, dtype=torch.long)
    conf = torch.tensor([[0.0, 0.0, 0.0] if n == 0 else ([1.0, 0.0, 1.0] if c is None else c.tolist())
                         for _, n, c in rows]).view(-1, 3)
    return TeacherForced(tokens, chained=True, confidence=conf)


# ---------------------------------------------------------------------- policies
@dataclass
class PolicyRow:
    """One row of a ``Policy.decide`` call: the decoder's state of the row's request and the policy's own memory of
    it (``Policy.start``), which the decoder keeps for the row and hands back with every call."""

    state: DecodeState
    memory: object = None


class Policy:
    """The policy protocol, with no-op defaults; subclasses override ``decide`` and whatever else they use. A policy
    never touches models or caches. What it remembers of one request lives in the memory ``start`` returns (the
    decoder keeps it per row); what it learns across requests lives on the policy itself. ``None`` as the decoder's
    policy means autoregressive decoding."""

    name: str = "policy"
    needs_token_feedback: bool = False
    uses_peeks: bool = False  # fill DecodeState.peeks before each decision (one lookup per peekable drafter)

    def validate(self, drafters: tuple[str, ...], k_max: int) -> None:
        """Fail before decoding if this policy cannot run with these drafters and this k limit."""

    def start(self, request: RequestInfo) -> object:
        """A request starts: the policy's memory of it (None: nothing to remember)."""
        return None

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        """A decision per row of the batch (one request: a list of one). A policy that plans for the whole batch
        (the learned rule: the batch's tokens/s at its live size) reads all rows at once."""
        raise NotImplementedError

    def should_stop(self, row: PolicyRow, token: DraftToken) -> bool:
        """Called after each drafted token when ``needs_token_feedback``; True ends the block after this token."""
        return False

    def observe(self, row: PolicyRow, record: StepRecord) -> None:
        """The outcome of the step the row just took."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Autoregressive(Policy):
    """Never draft: plain autoregressive decoding through the same loop (the decoder's default policy)."""

    name = "ar"

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        return [Decision.autoregressive()] * len(rows)
