"""What the decoder returns: the new tokens and one record per step. Plain data, ready for Parquet traces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    fallback: bool = False  # the decoder overrode the policy with an autoregressive step (low acceptance)
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
    def mean_accepted(self) -> float:
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
