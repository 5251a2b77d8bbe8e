"""SpeculativeDecoder: draft k tokens, verify them in one target pass, keep what the target would have produced.

One loop serves every setting: k = 0 (no drafter) is plain autoregressive decoding, so AR and speculative timings
come from the same code. Batch size 1. The decoder never knows which policy it runs; the policy never sees a cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from sacpolicy.decoding.drafters import DraftBlock, Drafter
from sacpolicy.decoding.records import GenerationResult, StepRecord
from sacpolicy.decoding.sampling import (
    SamplingConfig,
    acceptance_stats,
    draft_stats,
    probs_from_logits,
    select_token,
    verify,
    verify_greedy,
)
from sacpolicy.policy.base import DecodeState, Decision, DraftToken, Policy, RequestInfo

logger = logging.getLogger(__name__)

_T1 = SamplingConfig(temperature=1.0)  # distributions behind the records when decoding greedily


@dataclass
class DecoderConfig:
    max_k: int = 16  # largest block a policy may ask for
    # Degradation: when the moving acceptance rate (EMA over speculative steps) falls below fallback_floor, decode
    # autoregressively for fallback_cooldown steps, then try speculating again. None disables it.
    fallback_floor: float | None = None
    fallback_ema: float = 0.5  # weight of the newest step in the moving acceptance
    fallback_cooldown: int = 8
    fallback_min_steps: int = 3  # speculative steps observed before the floor applies
    timing: bool = True  # per-step wall times (synchronizes the device once more per step on GPUs)

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"decoder max_k must be >= 0, got {self.max_k}")
        if self.fallback_floor is not None and not 0.0 <= self.fallback_floor <= 1.0:
            raise ValueError(f"fallback_floor must be in [0, 1] or None, got {self.fallback_floor}")
        if not 0.0 < self.fallback_ema <= 1.0:
            raise ValueError(f"fallback_ema must be in (0, 1], got {self.fallback_ema}")


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
        from sacpolicy.policy.rules import Autoregressive

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
        self.policy.validate(tuple(self.drafters), self.config.max_k)
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        if stop_token_ids is None:
            eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.sampling.seed or 0)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        if self.config.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        out = self.target(input_ids=ids.view(1, -1), cache=cache, use_cache=True, logits_to_keep=keep)
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
        if not isinstance(d.k, int) or d.k < 0 or d.k > self.config.max_k:
            raise ValueError(f"policy {self.policy!r} chose k={d.k!r}; k must be an integer in [0, {self.config.max_k}]")
        if d.drafter is not None and d.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy!r} chose unknown drafter {d.drafter!r}; known: {list(self.drafters)}")

    def _stop_fn(self, state: DecodeState):
        if not self.policy.needs_token_feedback:
            return None

        def stop(position: int, stats: torch.Tensor) -> bool:
            top1, entropy, margin = stats.tolist()
            return self.policy.should_stop(state, DraftToken(position, top1, entropy, margin))

        return stop

    def _block_stats(self, block: DraftBlock, logits: torch.Tensor, pq) -> torch.Tensor:
        """[k, 6] = draft (top1, entropy, margin) + (q(x), p(x), beta), on device. ``pq``: the processed (p, q)
        verification used when sampling; None when greedy, where the records use temperature-1 distributions."""
        k = block.k
        if pq is None:
            p = probs_from_logits(logits[:k], _T1)
            q = self._draft_probs(block, _T1)
        else:
            p, q = pq
        if block.logits is not None:
            conf = draft_stats(block.logits)
        elif block.confidence is not None:
            conf = block.confidence.to(self.device, torch.float32)
        else:
            conf = torch.tensor([[1.0, 0.0, 1.0]], device=self.device).expand(k, 3)
        return torch.cat([conf, acceptance_stats(p, q, block.tokens)], dim=-1)

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
        stop_token_ids: Sequence[int] | None = None,
        category: str | None = None,
        load: float = 0.0,
        seed: int | None = None,
        keep_logits: bool = False,
    ) -> GenerationResult:
        """Decode one prompt. Returns the new tokens (ending at the first stop token, included) and step records.

        ``keep_logits``: also return the target's raw logits behind every new token (``result.logits``, [new, V], on
        the device), the distributions the target's own decode saw: trace collection reads them instead of running the
        target again."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = self._prompt(input_ids)
        if seed is not None:
            self.generator.manual_seed(seed)
        L = prompt.numel()
        limit = max_new_tokens if self.max_context is None else min(max_new_tokens, self.max_context - L)
        run = _Run(
            buf=torch.empty(L + limit + self.config.max_k + 1, dtype=torch.long, device=self.device),
            cache=DynamicCache(config=self.target.config),
            stops=self.stop_token_ids if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids),
            limit=limit,
            state=DecodeState(RequestInfo(L, max_new_tokens, tuple(self.drafters), category, float(load)),
                              drafters=tuple(self.drafters)),
        )
        run.buf[:L] = prompt
        run.logits = [] if keep_logits else None
        for d in self.drafters.values():
            d.reset()
        self.policy.reset(run.state.request)

        t_start = self._now()
        prefill = self._forward(run.buf[:L], run.cache, 1)
        first = select_token(prefill[-1], self.sampling, self.generator)
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
        """Decide, draft, verify in one target pass, commit the accepted tokens and roll back the rest."""
        state, n = run.state, run.n
        remaining = run.limit - len(run.out)
        state.context_len, state.generated, state.remaining, state.drafter = n, len(run.out), remaining, None
        fallback = run.cooldown > 0
        if fallback:
            run.cooldown -= 1
            decision = Decision.autoregressive()
        else:
            if self.policy.uses_peeks:
                state.peeks = {d: self.drafters[d].peek(run.buf[:n]) for d in state.drafters
                               if callable(getattr(self.drafters[d], "peek", None))}
            decision = self.policy.decide(state)
            self._check_decision(decision)
        name = decision.drafter if decision.drafter in state.drafters else None
        k = min(decision.k, remaining - 1) if name is not None else 0

        t0 = self._now()
        block = DraftBlock.empty(self.device)
        if k > 0:
            state.drafter = name
            try:
                block = self.drafters[name].propose(run.buf[:n], k, self.sampling, self.generator, self._stop_fn(state))
            except Exception as exc:  # a broken drafter must not break decoding: drop it, stay exact
                self._drop(run, name, exc)
                name = None
        t1 = self._now()

        kb = block.k
        logits = self._forward(torch.cat([run.buf[n - 1 : n], block.tokens]), run.cache, kb + 1)
        n_acc, nxt, pq = self._verify(logits, block)
        run.buf[n : n + kb] = block.tokens
        run.buf[n + n_acc] = nxt  # device-side index: no sync before the write
        stats = self._block_stats(block, logits, pq) if kb else None
        head = torch.cat([n_acc.view(1), nxt.view(1), block.tokens]).tolist()  # the step's one host sync
        t2 = self._now()

        acc = head[0]
        if kb - acc:
            run.cache.crop(-(kb - acc))
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
        new = new[:remaining]
        if run.logits is not None:  # row i of the verify pass is the distribution of the step's i-th new token
            run.logits.append(logits[: len(new)])
        run.out.extend(new)
        run.n += len(new)

        rec = StepRecord(step=state.step, drafter=name, k=decision.k, drafted=kb, accepted=acc, emitted=len(new),
                         context_len=n, draft_s=t1 - t0, verify_s=t2 - t1, fallback=fallback)
        if stats is not None:
            rec.top1, rec.entropy, rec.margin, rec.q, rec.p, rec.beta = stats.t().tolist()
        run.records.append(rec)
        state.step += 1
        state.last = rec
        return rec

    def _verify(self, logits: torch.Tensor, block: DraftBlock):
        """-> (n_accepted, next token, (p, q) processed probs or None when greedy), all on device."""
        if self.sampling.greedy:
            return (*verify_greedy(logits, block.tokens), None)
        p = probs_from_logits(logits, self.sampling)
        q = self._draft_probs(block, self.sampling)
        return (*verify(p, q, block.tokens, self.generator), (p, q))

    def _drop(self, run: _Run, name: str, exc: Exception) -> None:
        logger.warning("drafter %r raised %r; dropped for this request, decoding continues", name, exc)
        run.dropped.append(name)
        run.state.drafters = tuple(d for d in run.state.drafters if d != name)

    def _track_acceptance(self, run: _Run, rec: StepRecord) -> None:
        """Per-drafter EMA for policies; the overall EMA drives the fallback to autoregressive decoding."""
        if not rec.drafted or rec.drafter is None:
            return
        a, rate = self.config.fallback_ema, rec.accepted / rec.drafted
        prev = run.state.accept_ema.get(rec.drafter)
        run.state.accept_ema[rec.drafter] = rate if prev is None else a * rate + (1 - a) * prev
        run.ema = rate if run.ema is None else a * rate + (1 - a) * run.ema
        run.spec_steps += 1
        floor = self.config.fallback_floor
        if floor is not None and run.spec_steps >= self.config.fallback_min_steps and run.ema < floor:
            logger.info("moving acceptance %.3f < floor %.3f: autoregressive for %d steps",
                        run.ema, floor, self.config.fallback_cooldown)
            run.cooldown, run.ema, run.spec_steps = self.config.fallback_cooldown, None, 0


@dataclass
class _Run:
    """Mutable state of one request."""

    buf: torch.Tensor  # [prompt + limit + max_k + 1] committed tokens, then scratch space for a block
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
