"""SpeculativeDecoder: draft k tokens, verify them in one target pass, keep what the target would have produced.

One loop serves every setting: k = 0 (no drafter) is plain autoregressive decoding, so AR and speculative timings
come from the same code. Batch size 1. The decoder never knows which policy it runs; the policy never sees a cache.
Each step is four small methods: decide, draft, verify-and-commit, record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import DynamicCache

from sacpolicy.decoding.aux import AuxCapture
from sacpolicy.decoding.compat import with_cache
from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    draft_stats,
    probs_from_logits,
    select_token,
    verify,
    verify_greedy,
)
from sacpolicy.decoding.types import (
    Autoregressive,
    Decision,
    DecodeState,
    DraftBlock,
    Drafter,
    DraftToken,
    GenerationResult,
    Policy,
    RequestInfo,
    StepRecord,
    StopFn,
)
from sacpolicy.runtime.features import next_accept_ema

logger = logging.getLogger(__name__)

_T1 = SamplingConfig(temperature=1.0)  # distributions behind the records when decoding greedily


@dataclass
class DecoderConfig:
    k_max: int = 16  # largest block a policy may ask for
    # Cooldown: when the moving acceptance rate (EMA over speculative steps, weight ``cooldown_ema`` on the newest)
    # falls below cooldown_floor, decode autoregressively for cooldown_steps steps, then speculate again. None: off.
    cooldown_floor: float | None = None
    cooldown_ema: float = 0.5
    cooldown_steps: int = 8
    cooldown_min_steps: int = 3  # speculative steps observed before the floor applies
    timing: bool = True  # per-step wall times (synchronizes the device once more per step on GPUs)

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"decoder k_max must be >= 0, got {self.k_max}")
        if self.cooldown_floor is not None and not 0.0 <= self.cooldown_floor <= 1.0:
            raise ValueError(f"cooldown_floor must be in [0, 1] or None, got {self.cooldown_floor}")
        if not 0.0 < self.cooldown_ema <= 1.0:
            raise ValueError(f"cooldown_ema must be in (0, 1], got {self.cooldown_ema}")


def stop_callback(policy: Policy, state: DecodeState) -> StopFn | None:
    """The ``stop`` a drafter calls after each drafted token: the policy's ``should_stop`` on that token's confidence
    (None when the policy does not ask for token feedback). Production proposers that reuse a drafter call it too."""
    if not policy.needs_token_feedback:
        return None

    def stop(position: int, stats: torch.Tensor) -> bool:
        top1, entropy, margin = stats.tolist()
        return policy.should_stop(state, DraftToken(position, top1, entropy, margin))

    return stop


class SpeculativeDecoder:
    def __init__(
        self,
        target: nn.Module,
        drafters: Sequence[Drafter] | Mapping[str, Drafter] = (),
        policy: Policy | None = None,
        sampling: SamplingConfig | None = None,
        config: DecoderConfig | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ):
        self.target = target
        items = drafters.values() if isinstance(drafters, Mapping) else drafters
        self.drafters: dict[str, Drafter] = {}
        for d in items:
            if d.name in self.drafters:
                raise ValueError(f"two drafters are named {d.name!r}; give each drafter a unique name")
            self.drafters[d.name] = d
        self.policy = policy if policy is not None else Autoregressive()
        self.sampling = sampling or SamplingConfig()
        self.config = config or DecoderConfig()
        self.vocab_size = int(target.get_output_embeddings().out_features)
        for d in self.drafters.values():
            if d.vocab_size is not None and d.vocab_size != self.vocab_size:
                raise ValueError(
                    f"drafter {d.name!r} has a vocabulary of {d.vocab_size} tokens but the target has "
                    f"{self.vocab_size}; drafts must share the target's tokenizer and vocabulary: pick a draft from "
                    "the target's model family, or use the n-gram or layer-skip drafters"
                )
        self.policy.validate(tuple(self.drafters), self.config.k_max)
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        if stop_token_ids is None:
            eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.sampling.seed or 0)
        self.features = AuxCapture(target, [i for d in self.drafters.values() for i in d.aux_layers])

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        if self.config.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        with self.features:
            out = self.target(input_ids=ids.view(1, -1), **with_cache(self.target, cache), use_cache=True,
                              logits_to_keep=keep)
        return out.logits[0]

    def _prompt(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"SpeculativeDecoder decodes one sequence at a time; got a batch of {ids.shape[0]}. "
                    "Loop over the prompts (see README: batched speculation)"
                )
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("empty prompt: give at least one token (e.g. the chat template's generation prompt)")
        if self.max_context is not None and ids.numel() >= self.max_context:
            raise ValueError(
                f"prompt of {ids.numel()} tokens does not fit the target's context of {self.max_context} tokens; "
                "truncate it (data.max_prompt_tokens) or use a longer-context target"
            )
        return ids.to(self.device)

    def _check_decision(self, d: Decision) -> None:
        if not isinstance(d.k, int) or d.k < 0 or d.k > self.config.k_max:
            raise ValueError(f"policy {self.policy!r} chose k={d.k!r}; k must be an integer in [0, {self.config.k_max}]")
        if d.drafter is not None and d.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy!r} chose unknown drafter {d.drafter!r}; known: {list(self.drafters)}")

    def _draft_probs(self, block: DraftBlock, cfg: SamplingConfig) -> torch.Tensor:
        if block.logits is None:  # deterministic proposal: q is the one-hot of the proposed token
            return torch.nn.functional.one_hot(block.tokens, self.vocab_size).float()
        return probs_from_logits(block.logits, cfg)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def generate(
        self,
        input_ids,
        max_new_tokens: int = 128,
        *,
        request: RequestInfo | None = None,
        stop_token_ids: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> GenerationResult:
        """Decode one prompt. Returns the new tokens (ending at the first stop token, included) and step records.

        ``request``: what the policy may know of the request (category, load) and its sampling seed; the decoder
        fills prompt length, token budget and drafters. ``keep_logits``: also return the target's raw logits behind
        every new token (``result.logits``, [new, V], on the device), the distributions the target's own decode saw:
        trace collection reads them instead of running the target again."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = self._prompt(input_ids)
        L = prompt.numel()
        request = replace(request or RequestInfo(), prompt_len=L, max_new_tokens=max_new_tokens,
                          drafters=tuple(self.drafters))
        if request.seed is not None:
            self.generator.manual_seed(request.seed)
        limit = max_new_tokens if self.max_context is None else min(max_new_tokens, self.max_context - L)
        run = _Run(
            buf=torch.empty(L + limit + self.config.k_max + 1, dtype=torch.long, device=self.device),
            cache=DynamicCache(config=self.target.config),
            stops=self.stop_token_ids if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids),
            limit=limit,
            state=DecodeState(request, drafters=tuple(self.drafters)),
            logits=[] if keep_logits else None,
        )
        run.buf[:L] = prompt
        for d in self.drafters.values():
            d.reset()
        self.policy.reset(request)

        t_start = self._now()
        prefill = self._forward(run.buf[:L], run.cache, 1)
        first = select_token(prefill[-1], self.sampling, self.generator)
        self._extend_features(run, L)
        if keep_logits:
            run.logits.append(prefill[-1:])
        run.buf[L] = first
        run.out, run.n = [int(first)], L + 1
        prefill_s = self._now() - t_start
        if run.out[0] in run.stops:
            run.finish = "eos"
        while run.finish is None and len(run.out) < limit:
            rec = self._step(run)
            self._track_acceptance(run, rec)
            self.policy.observe(rec)
        if run.finish is None:
            run.finish = "length" if len(run.out) >= max_new_tokens else "context"
        total_s = self._now() - t_start
        logits = torch.cat(run.logits)[: len(run.out)] if keep_logits else None
        return GenerationResult(run.out, run.records, L, prefill_s, total_s, run.finish, run.dropped, logits)

    def _step(self, run: _Run) -> StepRecord:
        """Decide, draft, verify in one target pass and commit the accepted tokens, record."""
        decision, cooldown = self._decide(run)
        t0 = self._now()
        name, block = self._draft(run, decision)
        t1 = self._now()
        acc, new, stats = self._verify_and_commit(run, name, block)
        return self._record(run, decision, name, block, acc, new, stats, cooldown, (t1 - t0, self._now() - t1))

    def _decide(self, run: _Run) -> tuple[Decision, bool]:
        """The policy's decision for this step (autoregressive while the decoder cools down)."""
        state, n = run.state, run.n
        state.context_len, state.generated, state.remaining, state.drafter = n, len(run.out), run.left, None
        if run.cooldown > 0:
            run.cooldown -= 1
            return Decision.autoregressive(), True
        if self.policy.uses_peeks:
            state.peeks = {d: self.drafters[d].peek(run.buf[:n]) for d in state.drafters if self.drafters[d].peekable}
        decision = self.policy.decide(state)
        self._check_decision(decision)
        return decision, False

    def _draft(self, run: _Run, decision: Decision) -> tuple[str | None, DraftBlock]:
        """(drafter used or None, its block); a drafter that raises is dropped for the request (output stays exact)."""
        name = decision.drafter if decision.drafter in run.state.drafters else None
        k = min(decision.k, run.left - 1) if name is not None else 0
        if k <= 0:
            return name, DraftBlock.empty(self.device)
        run.state.drafter = name
        try:
            return name, self.drafters[name].propose(run.buf[: run.n], k, self.sampling, self.generator,
                                                     stop_callback(self.policy, run.state))
        except Exception as exc:
            self._drop(run, name, exc)
            return None, DraftBlock.empty(self.device)

    def _verify_and_commit(self, run: _Run, name: str | None, block: DraftBlock):
        """One target pass over [last committed token, block]; commit accepted + 1 tokens and roll the caches back.
        -> (accepted, new tokens, [k, 6] record stats or None)."""
        n, kb = run.n, block.k
        logits = self._forward(torch.cat([run.buf[n - 1 : n], block.tokens]), run.cache, kb + 1)
        if self.sampling.greedy:
            n_acc, nxt, pq = *verify_greedy(logits, block.tokens), None
        else:
            p, q = probs_from_logits(logits, self.sampling), self._draft_probs(block, self.sampling)
            n_acc, nxt, pq = *verify(p, q, block.tokens, self.generator), (p, q)
        run.buf[n : n + kb] = block.tokens
        run.buf[n + n_acc] = nxt  # device-side index: no sync before the write
        stats = self._block_stats(block, logits, pq) if kb else None
        head = torch.cat([n_acc.view(1), nxt.view(1), block.tokens]).tolist()  # the step's one host sync
        acc = head[0]
        if kb - acc:
            run.cache.crop(-(kb - acc))
        self._extend_features(run, acc + 1)
        if name is not None:
            try:
                self.drafters[name].accept(acc)
            except Exception as exc:
                self._drop(run, name, exc)
        new = head[2 : 2 + acc] + [head[1]]
        for i, tok in enumerate(new):
            if tok in run.stops:
                new, run.finish = new[: i + 1], "eos"
                break
        new = new[: run.left]
        if run.logits is not None:  # row i of the verify pass is the distribution of the step's i-th new token
            run.logits.append(logits[: len(new)])
        run.out.extend(new)
        run.n += len(new)
        return acc, new, stats

    def _record(self, run: _Run, decision: Decision, name, block, acc, new, stats, cooldown, times) -> StepRecord:
        rec = StepRecord(step=run.state.step, drafter=name, k=decision.k, drafted=block.k, accepted=acc,
                         emitted=len(new), context_len=run.state.context_len, draft_s=times[0], verify_s=times[1],
                         cooldown=cooldown)
        if stats is not None:
            rec.top1, rec.entropy, rec.margin, rec.q, rec.p, rec.beta = stats.t().tolist()
        run.records.append(rec)
        run.state.step += 1
        run.state.last = rec
        return rec

    def _block_stats(self, block: DraftBlock, logits: torch.Tensor, pq) -> torch.Tensor:
        """[k, 6] = draft (top1, entropy, margin) + (q(x), p(x), beta), on device. ``pq``: the processed (p, q)
        verification used when sampling; None when greedy, where the records use temperature-1 distributions."""
        k = block.k
        p, q = (probs_from_logits(logits[:k], _T1), self._draft_probs(block, _T1)) if pq is None else pq
        if block.logits is not None:
            conf = draft_stats(block.logits)
        elif block.confidence is not None:
            conf = block.confidence.to(self.device, torch.float32)
        else:
            conf = torch.tensor([[1.0, 0.0, 1.0]], device=self.device).expand(k, 3)
        return torch.cat([conf, acceptance_stats(p, q, block.tokens)], dim=-1)

    def _extend_features(self, run: _Run, m: int) -> None:
        """Hand feature drafters the target's hidden states of the first m positions of the last pass: the ones that
        are now committed (the prompt after prefill; the last token and the accepted drafts after a verify)."""
        if not self.features.layers:
            return
        for name in run.state.drafters:
            d = self.drafters[name]
            if d.aux_layers:
                try:
                    d.extend_features(self.features.rows(d.aux_layers, m))
                except Exception as exc:
                    self._drop(run, name, exc)

    def _drop(self, run: _Run, name: str, exc: Exception) -> None:
        logger.warning("drafter %r raised %r; dropped for this request, decoding continues", name, exc)
        run.dropped.append(name)
        run.state.drafters = tuple(d for d in run.state.drafters if d != name)

    def _track_acceptance(self, run: _Run, rec: StepRecord) -> None:
        """Per-drafter EMA for policies (the ``accept_ema`` feature, weight fixed by the feature spec); the overall
        EMA drives the cooldown (autoregressive steps)."""
        if not rec.drafted or rec.drafter is None:
            return
        rate = rec.accepted / rec.drafted
        run.state.accept_ema[rec.drafter] = next_accept_ema(run.state.accept_ema.get(rec.drafter), rate)
        a = self.config.cooldown_ema
        run.ema = rate if run.ema is None else a * rate + (1 - a) * run.ema
        run.spec_steps += 1
        floor = self.config.cooldown_floor
        if floor is not None and run.spec_steps >= self.config.cooldown_min_steps and run.ema < floor:
            logger.info("moving acceptance %.3f < floor %.3f: autoregressive for %d steps",
                        run.ema, floor, self.config.cooldown_steps)
            run.cooldown, run.ema, run.spec_steps = self.config.cooldown_steps, None, 0


@dataclass
class _Run:
    """Mutable state of one request."""

    buf: torch.Tensor  # [prompt + limit + k_max + 1] committed tokens, then scratch space for a block
    cache: object  # the target's KV cache: always holds buf[:n - 1]
    stops: frozenset
    limit: int
    state: DecodeState
    n: int = 0  # committed tokens in buf
    out: list = field(default_factory=list)
    records: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    finish: str | None = None
    ema: float | None = None
    cooldown: int = 0
    spec_steps: int = 0
    logits: list | None = None  # keep_logits: the target's logits of each new token

    @property
    def left(self) -> int:
        return self.limit - len(self.out)
