"""SpeculativeDecoder: draft k tokens, verify them in one target pass, keep what the target would have produced.

One loop serves every setting: k = 0 (no drafter) is plain autoregressive decoding, so AR and speculative timings
come from the same code, and one request (``generate``) is a batch of one row (``generate_batch``: continuous batching
over B rows, each with its own draft block and accepted prefix, verified together in one target pass; the ragged KV
cache is ``sacpolicy.decoding.ragged``). The decoder never knows which policy it runs; the policy never sees a cache.
Each step is four small methods: decide, draft, verify-and-commit, record (``sacpolicy.decoding.step``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from sacpolicy.decoding.aux import AuxCapture
from sacpolicy.decoding.compat import use_cpu_kernels, with_cache
from sacpolicy.decoding.ragged import RaggedCache, new_cache
from sacpolicy.decoding.sampling import SamplingConfig, select_token
from sacpolicy.decoding.step import BatchStep, Clock, Row, WallClock, stop_callback
from sacpolicy.decoding.types import (
    Autoregressive,
    DecodeState,
    Drafter,
    GenerationResult,
    Policy,
    RequestInfo,
)

__all__ = ["BATCH_K", "DecoderConfig", "SpeculativeDecoder", "WallClock", "stop_callback"]

logger = logging.getLogger(__name__)

BATCH_K = ("row", "shared")


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
    max_batch: int = 1  # rows generate_batch decodes together by default; the live load is rows / max_batch
    batch_k: str = "row"  # "row": each row's own k (blocks padded to the longest); "shared": one k for the batch (vLLM)
    compact_slack: float = 0.25  # compact the batch's KV cache when rejected columns exceed this share of its width

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"decoder max_batch must be an integer >= 1, got {self.max_batch!r}")
        if self.batch_k not in BATCH_K:
            raise ValueError(f"decoder batch_k must be one of {list(BATCH_K)}, got {self.batch_k!r}")
        if self.k_max < 0:
            raise ValueError(f"decoder k_max must be >= 0, got {self.k_max}")
        if self.cooldown_floor is not None and not 0.0 <= self.cooldown_floor <= 1.0:
            raise ValueError(f"cooldown_floor must be in [0, 1] or None, got {self.cooldown_floor}")
        if not 0.0 < self.cooldown_ema <= 1.0:
            raise ValueError(f"cooldown_ema must be in (0, 1], got {self.cooldown_ema}")


class SpeculativeDecoder(BatchStep):
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
        # the same results up to float rounding, on the CPU's faster kernels for decoding's passes
        use_cpu_kernels(target, self.drafters.values())
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
        self.dtype = next(target.parameters()).dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.sampling.seed or 0)
        self.features = AuxCapture(target, [i for d in self.drafters.values() for i in d.aux_layers])
        self.clock: Clock = WallClock()  # every time the decoder reads or waits on (a replay sets a virtual one)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        if self.config.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock.now()

    def _prompt(self, input_ids, index: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"generate decodes one sequence; got a batch of {ids.shape[0]}. Pass the prompts as a list to "
                    "generate_batch (rows of different lengths need no padding)"
                )
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"empty prompt (request {index}): give at least one token (e.g. the chat template's "
                             "generation prompt)")
        if self.max_context is not None and ids.numel() >= self.max_context:
            raise ValueError(
                f"prompt of request {index} has {ids.numel()} tokens and does not fit the target's context of "
                f"{self.max_context} tokens; truncate it (data.max_prompt_tokens) or use a longer-context target"
            )
        return ids.to(self.device)

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
        trace collection reads them instead of running the target again. The same loop as ``generate_batch`` with
        one row."""
        return self.generate_batch([input_ids], max_new_tokens, requests=[request], stop_token_ids=stop_token_ids,
                                   keep_logits=keep_logits, max_batch=1)[0]

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence,
        max_new_tokens: int | Sequence[int] = 128,
        *,
        requests: Sequence[RequestInfo | None] | None = None,
        max_batch: int | None = None,
        arrivals: Sequence[float] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> list[GenerationResult]:
        """Decode many prompts, up to ``max_batch`` rows at a time (default ``config.max_batch``) with continuous
        batching: a finished row leaves the batch at once and the next waiting request takes its place. Each row
        drafts its own block; the target verifies all rows in one pass; each row keeps its own accepted prefix, so
        every row's output is what decoding it alone would give.

        ``arrivals``: seconds after the call at which each request arrives (Poisson traces); a request is admitted
        when it has arrived and a row is free, and its ``queued_s`` is the wait. Results come back in input order."""
        B = self.config.max_batch if max_batch is None else max_batch
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (rows decoded together), got {B!r}")
        if not len(prompts):
            raise ValueError("generate_batch needs at least one prompt")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        requests = [None] * len(prompts) if requests is None else list(requests)
        arrivals = [0.0] * len(prompts) if arrivals is None else [float(a) for a in arrivals]
        if not len(budgets) == len(requests) == len(arrivals) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many token budgets, requests and arrival times; got "
                             f"{len(budgets)}, {len(requests)} and {len(arrivals)}")
        if any(a < 0 for a in arrivals):
            raise ValueError("arrival times are seconds after the call: they must be >= 0")
        stops = self.stop_token_ids if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids)
        runs = [self._new_run(i, p, m, r, a, stops, keep_logits, B)
                for i, (p, m, r, a) in enumerate(zip(prompts, budgets, requests, arrivals))]
        waiting = sorted(runs, key=lambda r: r.arrival)[::-1]  # pop() takes the earliest
        batch: list[Row] = []
        cache: RaggedCache | None = None
        t0 = self._now()
        while waiting or batch:
            while waiting and len(batch) < B and waiting[-1].arrival <= self._now() - t0:
                run = waiting.pop()
                run.queued_s = self._now() - t0 - run.arrival
                row_cache = self._prefill(run)
                if run.active:
                    if cache is None:
                        cache = row_cache
                    else:
                        cache.join(row_cache)
                    batch.append(run)
                else:
                    self._finish(run)
            if not batch:
                if waiting:
                    self.clock.sleep(max(0.0, waiting[-1].arrival - (self._now() - t0)))
                continue
            for rec, run in zip(self._step(batch, cache), batch):
                self._track_acceptance(run, rec)
                run.policy.observe(rec)
            live = [i for i, r in enumerate(batch) if r.active]
            for r in batch:
                if not r.active:
                    self._finish(r)
            if len(live) < len(batch):
                batch = [batch[i] for i in live]
                if batch:
                    cache.select(live)
                else:
                    cache = None
        return [r.result for r in runs]

    def _new_run(self, index, input_ids, max_new_tokens, request, arrival, stops, keep_logits, B) -> Row:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens} (request {index})")
        prompt = self._prompt(input_ids, index)
        L = prompt.numel()
        request = replace(request or RequestInfo(), prompt_len=L, max_new_tokens=max_new_tokens,
                          drafters=tuple(self.drafters))
        if request.sampling is not None and not isinstance(request.sampling, SamplingConfig):
            raise ValueError(f"request {index}: sampling must be a SamplingConfig (or None for the decoder's), got "
                             f"{type(request.sampling).__name__}")
        limit = max_new_tokens if self.max_context is None else min(max_new_tokens, self.max_context - L)
        if B == 1:  # one row at a time: the decoder's own policy, drafters and generator, as they always were
            policy, drafters, generator = self.policy, self.drafters, self.generator
        else:  # per-row state: forks share weights and models, never caches
            policy, drafters = self.policy.fork(), {n: d.fork() for n, d in self.drafters.items()}
            generator = self.generator if request.seed is None else torch.Generator(device=self.device)
        run = Row(
            buf=torch.empty(L + limit + self.config.k_max + 1, dtype=torch.long, device=self.device),
            stops=stops, limit=limit, max_new_tokens=max_new_tokens,
            state=DecodeState(request, drafters=tuple(self.drafters)),
            logits=[] if keep_logits else None, policy=policy, drafters=drafters, generator=generator,
            arrival=arrival, index=index, sampling=request.sampling or self.sampling,
        )
        run.buf[:L] = prompt
        run.n = L
        return run

    def _prefill(self, run: Row) -> RaggedCache:
        """Admit a request: prefill its prompt alone, pick its first token. -> its one-row cache."""
        request, L = run.state.request, run.n
        if request.seed is not None:
            run.generator.manual_seed(request.seed)
        for d in run.drafters.values():
            d.reset()
        run.policy.reset(request)
        run.t_start = self._now()
        cache = new_cache(self.target.config)
        with self.features:
            prefill = self.target(input_ids=run.buf[:L].view(1, -1), **with_cache(self.target, cache),
                                  use_cache=True, logits_to_keep=1).logits[0]
        first = select_token(prefill[-1], run.sampling, run.generator)
        self._extend_features(run, 0, L)
        if run.logits is not None:
            run.logits.append(prefill[-1:])
        run.buf[L] = first
        run.out, run.n = [int(first)], L + 1
        run.prefill_s = self._now() - run.t_start
        if run.out[0] in run.stops:
            run.finish = "eos"
        return RaggedCache(cache, L, self.device, self.config.compact_slack)

    def _finish(self, run: Row) -> None:
        if run.finish is None:
            run.finish = "length" if len(run.out) >= run.max_new_tokens else "context"
        logits = torch.cat(run.logits)[: len(run.out)] if run.logits is not None else None
        run.result = GenerationResult(run.out, run.records, run.state.request.prompt_len, run.prefill_s,
                                      self._now() - run.t_start, run.finish, run.dropped, logits, run.queued_s)
