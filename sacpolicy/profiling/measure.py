"""Profiling a device into a ``CostModel`` (the model itself lives in ``sacpolicy.runtime.cost``, numpy only, so the
exported runtime shares it). See that module for what is modelled; ``profile`` measures it:

    cost = profile(target.model, [ModelDrafter(draft.model, name="draft"), NgramDrafter()])
    cost.to_json("cost.json")

Every cell (tokens fed, context) is timed ``repeats`` times; knots are fitted to the cells' medians and each knot gets a
95% interval by bootstrapping the repeats (resample each cell, refit). The verify cost is then made non-decreasing in
tokens fed by pooling adjacent violators (isotonic regression): a pass over more tokens never costs less, unless the
two knots' intervals do not overlap (a decrease beyond noise, kept and logged). On a tiny model the raw profile can put
two tokens below one, and the simulator would then find that drafting a token it never gets accepted beats
autoregressive decoding.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone

import numpy as np
import torch

from sacpolicy.decoding.compat import cpu_kernels, with_cache
from sacpolicy.decoding.layout import attention_layout
from sacpolicy.decoding.protocols import feature_layers, fresh_drafters
from sacpolicy.decoding.ragged import RaggedCache, new_cache
from sacpolicy.decoding.sampling import SamplingConfig
from sacpolicy.decoding.types import DraftRow
from sacpolicy.profiling.fit import MIN_REPEATS, fit_cost_model, fit_step_overhead
from sacpolicy.profiling.loop import decoder_steps
from sacpolicy.runtime.cost import CostModel

__all__ = ["ROW_SPREAD", "SPEED_PROBE_REPEATS", "batch_row_lengths", "middle_context", "prefilled_batch",
           "probe_pass", "profile"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- profiling
def _sync(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu: wait for queued kernels
    if device.type != "cpu" and hasattr(backend, "synchronize"):
        backend.synchronize()


_COMMITTED = 2  # tokens a step commits between a row's proposals when the profile times one (a last token + one draft)


def _times(run: Callable[[], object], undo: Callable[[], object], device, repeats: int, warmup: int) -> np.ndarray:
    """[repeats] seconds of ``run()``, each after ``undo()`` of the previous one, after ``warmup`` untimed runs."""
    return _interleaved_times({None: (run, undo)}, device, repeats, warmup)[None]


def _interleaved_times(cells: dict, device, repeats: int, warmup: int) -> dict:
    """{key: [repeats] seconds} of cells {key: (run, undo)} timed in rounds, one call of each cell per round, each
    round starting one cell later: a machine that slows down or speeds up while it is profiled (a shared CPU does)
    moves every cell alike instead of tilting the curve along the order the cells were timed in."""
    keys, times = list(cells), {key: [] for key in cells}
    for r in range(warmup + repeats):
        for i in range(len(keys)):
            key = keys[(i + r) % len(keys)]
            run, undo = cells[key]
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            if r >= warmup:
                times[key].append(time.perf_counter() - t0)
            undo()
    return {key: np.array(t) for key, t in times.items()}


def _forward_cells(model, context_len: int, feeds: Sequence[int], device, gen) -> dict:
    """{n: (run, undo)}: one forward of n new tokens on top of a KV cache holding context_len tokens, and the crop
    back to context_len cached tokens for the next call."""
    def ids(n):
        return torch.randint(model.config.vocab_size, (1, n), generator=gen).to(device)

    cache = new_cache(model.config)
    model(input_ids=ids(context_len), **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    return {n: (lambda x=ids(n), n=n: model(input_ids=x, **with_cache(model, cache), use_cache=True,
                                            logits_to_keep=n),
                lambda n=n: cache.crop(-n))
            for n in feeds}


def _forward_times(model, context_len: int, feeds: Sequence[int], device, gen, repeats: int, warmup: int) -> dict:
    """{n: [repeats] seconds of one forward of n new tokens on top of a KV cache holding context_len tokens}."""
    return _interleaved_times(_forward_cells(model, context_len, feeds, device, gen), device, repeats, warmup)


def _prefill_times(model, context_len: int, device, gen, repeats: int, warmup: int) -> np.ndarray:
    """[repeats] seconds of one forward over a prompt of context_len tokens on an empty cache (as decoding admits a
    request: logits of the last position only)."""
    x = torch.randint(model.config.vocab_size, (1, context_len), generator=gen).to(device)

    def run():
        model(input_ids=x, **with_cache(model, new_cache(model.config)), use_cache=True, logits_to_keep=1)

    return _times(run, lambda: None, device, repeats, warmup)


# A batch's rows hold prompts of different lengths, and the cache is as wide as the longest: the rows a profile times
# spread from 0.4x to 1.6x the context (mean: the context). Profiled on near-equal rows, a multi-token pass would be
# priced too low: the masked attention grows with the cache's width and the tokens fed (docs/benchmarks.md, "Cost
# model fidelity").
ROW_SPREAD = (0.4, 1.6)


def batch_row_lengths(rows: int, context_len: int) -> list[int]:
    """The cached lengths of the rows a batch of ``rows`` is profiled on: spread evenly over ``ROW_SPREAD`` times the
    context, their mean the context."""
    if rows == 1:
        return [context_len]
    lo, hi = ROW_SPREAD
    return [max(1, round(context_len * (lo + (hi - lo) * i / (rows - 1)))) for i in range(rows)]


def prefilled_batch(model, lengths: Sequence[int], device, gen, make_cache=None) -> RaggedCache:
    """The ragged cache the batched decoder keeps for rows of these cached lengths: each row prefilled alone on random
    tokens and joined as requests join, so a pass on it carries its 4D mask as in decoding. ``make_cache``: the empty
    one-row cache (default: the decoder's, ``new_cache``)."""
    batch = None
    for L in lengths:
        cache = make_cache() if make_cache is not None else new_cache(model.config)
        x = torch.randint(model.config.vocab_size, (1, L), generator=gen).to(device)
        model(input_ids=x, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        row = RaggedCache(cache, L, device, layout=attention_layout(model.config))  # a window: its masks too
        if batch is None:
            batch = row
        else:
            batch.join(row)
    return batch


def _batch_forward_cells(model, rows: int, context_len: int, feeds: Sequence[int], device, gen) -> dict:
    """``_forward_cells`` for a batch: ``rows`` rows of n new tokens each, on ``prefilled_batch`` rows of
    ``batch_row_lengths`` tokens."""
    def ids(b, n):
        return torch.randint(model.config.vocab_size, (b, n), generator=gen).to(device)

    batch = prefilled_batch(model, batch_row_lengths(rows, context_len), device, gen)
    dtype = next(model.parameters()).dtype
    return {n: (lambda x=ids(rows, n), n=n, extra=batch.inputs(n, dtype): model(
                    input_ids=x, **with_cache(model, batch.cache), use_cache=True, logits_to_keep=n, **extra),
                lambda n=n: batch.cache.crop(-n))
            for n in feeds}


def _verify_times(model, batch_sizes: Sequence[int], context_lens: Sequence[int], feeds: Sequence[int], device, gen,
                  repeats: int, warmup: int) -> dict:
    """{batch size: [(tokens fed, context, [repeats] seconds)]} of the target's verify pass: every (batch size,
    context, tokens fed) cell that fits, all timed in the same rounds (``_interleaved_times``), so a machine whose
    speed drifts during the profile moves every batch size alike; timed one batch size after another, a slowdown
    midway would price the later batch sizes too high (docs/benchmarks.md, "Cost model fidelity"). The price: every
    cell's cache is held at once, the sum over batch sizes and contexts rather than the largest one."""
    cells = {}
    for b in sorted(batch_sizes):
        for c in context_lens:
            if not _fits(model, batch_row_lengths(b, c)[-1], feeds[-1]):
                continue
            made = (_forward_cells(model, c, feeds, device, gen) if b == 1
                    else _batch_forward_cells(model, b, c, feeds, device, gen))
            cells |= {(b, c, n): cell for n, cell in made.items()}
    times = _interleaved_times(cells, device, repeats, warmup)
    out = {b: [] for b in batch_sizes}
    for (b, c, n), t in times.items():
        out[b].append((n, c, t))
    return out


def _fits(model, context_len: int, new_tokens: int) -> bool:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context_len + new_tokens > limit:
        logger.warning("skipping context %d: with %d new tokens it exceeds %s's max_position_embeddings=%d",
                       context_len, new_tokens, type(model).__name__, limit)
        return False
    return True


SPEED_PROBE_REPEATS = 7


def middle_context(context_lens) -> int:
    """The middle of the profiled contexts: where the decoder's own work, batched drafting and the speed probe are
    timed."""
    contexts = sorted(context_lens)
    return int(contexts[len(contexts) // 2])


@torch.inference_mode()
def probe_pass(target, context_len: int, *, repeats: int = SPEED_PROBE_REPEATS, seed: int = 0) -> float:
    """Median seconds of the target's one-token pass on a KV cache of ``context_len`` random tokens, with the kernels
    the decoder runs (after one untimed call): the machine's speed in one number, timed in about a second. ``profile``
    records it (``meta["speed_probe"]``); the evaluation times it again between live prompts (``profiling.drift``)."""
    device = next(target.parameters()).device
    with cpu_kernels(target):
        cells = _forward_cells(target, context_len, [1], device, torch.Generator().manual_seed(seed))
        return float(np.median(_interleaved_times(cells, device, repeats, warmup=1)[1]))


# ---------------------------------------------------------------------- measuring
def _measure(target, drafters: dict, per_token: dict, ks, context_lens, device, gen, repeats: int, warmup: int):
    """-> prefill cells [(prompt tokens, [repeats] seconds)], {drafter: [(context, [repeats] seconds)]} and the same
    for the drafters' once-per-proposal seconds (feature drafters). The verify pass: ``_verify_times``."""
    prefill_rows, draft_rows, fixed_rows = [], {name: [] for name in drafters}, {}
    feeds, k_max = sorted({k + 1 for k in ks}), max(max(ks), 1)
    for c in context_lens:
        if not _fits(target, c, feeds[-1]):
            continue
        logger.info("profiling context %d on %s", c, device)
        prefill_rows.append((c, _prefill_times(target, c, device, gen, repeats, warmup)))
        for name, drafter in drafters.items():
            if feature_layers(drafter):  # a feature head: a feed of the new rows, then one chain step per drafted token
                per_token_s, fixed_s = _feature_step_times(target, drafter, c, k_max, device, gen, repeats, warmup)
                draft_rows[name].append((c, per_token_s))
                fixed_rows.setdefault(name, []).append((c, fixed_s))
                continue
            if per_token[name]:
                if _fits(drafter.model, c, 1):
                    t = _forward_times(drafter.model, c, [1], device, gen, repeats, warmup)[1]
                    draft_rows[name].append((c, t))
                continue
            # a lookup drafter as the decoder runs it between steps: its row has seen all but the tokens the last
            # step committed (a suffix drafter's index grows by those; building it over the whole context, as a
            # new row's first proposal does, is once per request, not per step). A copy of the drafter, so its
            # global index (a suffix drafter's) gets none of these random contexts.
            context = torch.randint(target.config.vocab_size, (c,), generator=gen).to(device)
            drafter, state = fresh_drafters([drafter])[0], [None]

            def seen(drafter=drafter, context=context, state=state):
                state[0] = drafter.new_state()
                drafter.propose([DraftRow(state[0], context[:-_COMMITTED], k_max, SamplingConfig())])

            def propose(drafter=drafter, context=context, state=state):
                return drafter.propose([DraftRow(state[0], context, k_max, SamplingConfig())])

            seen()
            draft_rows[name].append((c, _times(propose, seen, device, repeats, warmup)))
    return prefill_rows, draft_rows, fixed_rows


def _feature_cells(target, drafter, c: int, sizes: Sequence[int], ks: Sequence[int], device, gen) -> dict:
    """Timing cells {(r, k): (run, undo)} of a feature drafter as the decoder runs it on top of c committed tokens:
    r rows each hold c - 1 fed rows and 2 more handed over since their last proposal (the last token and one accepted
    draft), and ``run`` proposes k tokens for all r in one ``propose`` call, which first feeds those rows; ``undo``
    restores that state."""
    from sacpolicy.decoding.aux import aux_pass

    pending = 2
    context = torch.randint(target.config.vocab_size, (c + pending,), generator=gen).to(device)
    _, capture = aux_pass(target, context, 1, feature_layers(drafter))
    feats = capture.rows(feature_layers(drafter), c + pending - 1)
    states = {r: [] for r in sizes}

    def propose(r: int, ctx: torch.Tensor, k: int) -> None:
        drafter.propose([DraftRow(st, ctx, k) for st in states[r]])

    def committed(r: int) -> None:  # each row after a proposal at c tokens, the next rows handed over, not fed
        states[r][:] = [drafter.new_state() for _ in range(r)]
        for st in states[r]:
            drafter.extend_features(st, feats[: c - 1])
        propose(r, context[:c], 1)
        for st in states[r]:
            drafter.extend_features(st, feats[c - 1 :])

    for r in sizes:
        committed(r)
    return {(r, k): (functools.partial(propose, r, context, k), functools.partial(committed, r))
            for r in sizes for k in ks}


def _feature_step_times(target, drafter, c: int, k_max: int, device, gen, repeats: int, warmup: int):
    """A feature drafter timed as the decoder runs it on top of c committed tokens (``_feature_cells``, one row):
    blocks of 1 and of K = max(k_max, 2) tokens timed in the same rounds; -> ([repeats] seconds per drafted token,
    [repeats] seconds once per proposal), the two solving t(k) = fixed + k * per_token at k = 1 and K."""
    K = max(k_max, 2)
    t = _interleaved_times(_feature_cells(target, drafter, c, [1], (1, K), device, gen), device, repeats, warmup)
    per_token = (t[(1, K)] - t[(1, 1)]) / (K - 1)
    return per_token, t[(1, 1)] - per_token


def _model_cells(target, drafter, c: int, sizes: Sequence[int], ks: Sequence[int], device, gen,
                 states: dict | None = None) -> dict:
    """Timing cells {(r, k): (run, undo)} of a model drafter (a KV cache per row) as the decoder runs a batch's rows:
    r rows each hold c committed tokens in their caches and are handed one more (the token the target emitted), and
    ``run`` proposes k tokens for all r in one ``propose`` call (the rows' caches stacked, one forward per drafted
    token); ``undo`` restores that state. ``states``: a dict that receives the rows' states, {r: [state] * r}."""
    context = torch.randint(target.config.vocab_size, (c + 1,), generator=gen).to(device)
    states = {} if states is None else states
    states.update({r: [] for r in sizes})

    def propose(r: int, k: int) -> None:
        drafter.propose([DraftRow(st, context, k) for st in states[r]])

    def committed(r: int) -> None:  # each row's cache holds the c tokens before the one handed over
        states[r][:] = [drafter.new_state() for _ in range(r)]
        drafter.propose([DraftRow(st, context[:c], 1) for st in states[r]])

    for r in sizes:
        committed(r)
    return {(r, k): (functools.partial(propose, r, k), functools.partial(committed, r)) for r in sizes for k in ks}


def _batch_shares(target, drafter, c: int, k_max: int, batch_sizes: Sequence[int], device, gen, repeats: int,
                  warmup: int) -> dict[int, np.ndarray]:
    """A model or feature drafter's rows drafting together (one ``propose`` call, as the decoder drafts a batch's rows
    that chose it; ``_feature_cells`` or ``_model_cells``): -> {r: [repeats] per-row share}, the
    seconds of r rows' proposals over r, as a fraction of one row's, blocks of 1 and of K tokens counted alike (the
    share of their sum). Every size is timed in the same rounds."""
    K, sizes = max(k_max, 2), sorted({1, *batch_sizes})
    cells = (_feature_cells(target, drafter, c, sizes, (1, K), device, gen) if feature_layers(drafter)
             else _model_cells(target, drafter, c, sizes, (1, K), device, gen))
    t = _interleaved_times(cells, device, repeats, warmup)
    one = t[(1, 1)] + t[(1, K)]
    return {r: (t[(r, 1)] + t[(r, K)]) / r / one for r in sizes if r > 1}


@torch.inference_mode()
def profile(target_model, drafters=(), *, ks=(0, 1, 2, 4, 8), context_lens=(64, 256, 1024), repeats: int = 5,
            device=None, warmup: int = 2, seed: int = 0, batch_sizes=(1,), sampling=None,
            loop_tokens: int = 32) -> CostModel:
    """Measure the target's verify pass and each drafter's step on the device the models live on; fit a CostModel.

    drafters: a list of drafters or {name: drafter}. A drafter with a `.model` (ModelDrafter, LayerSkipDrafter) is
    timed as one single-token forward on its own KV cache, a feature drafter (EAGLE-3 head) per token of a drafted
    chain on the target's hidden states plus once per proposal (its feed of the newly committed rows); any other
    drafter as one propose() call on random tokens (for the n-gram drafter that is the no-match case, its slowest
    lookup). Every cell is timed `repeats` times
    (>= 5 for knot intervals that can tell a real decrease in verify cost from noise; see the module docstring).
    ``batch_sizes``: also time the verify pass over that many rows (the batched decoder's ragged cache and mask), so
    policies can weigh drafting at the live batch size, and a model or feature drafter's proposals for that many rows
    drafting together (``CostModel.draft_batch``: each row's share of their batched drafting), at the middle profiled
    context.
    ``sampling`` (a ``SamplingConfig`` or its fields; None: skipped): then the real decoder also decodes
    ``loop_tokens`` tokens per drafter and k in ``ks`` (and autoregressively) ``repeats`` times at the middle profiled
    context with these settings, and what its steps take beyond the passes timed above becomes ``step_base`` and
    ``step_draft`` (``sacpolicy.profiling.loop``; the cost model's docstring says what they hold). Profile with the
    settings the decoder will sample with: sampled verification costs more per drafted token than greedy.
    """
    from sacpolicy.models import LoadedModel

    target = target_model.model if isinstance(target_model, LoadedModel) else target_model
    named = dict(drafters) if isinstance(drafters, Mapping) else {d.name: d for d in drafters}
    with cpu_kernels(target, named.values()):  # time the kernels the decoder will run
        cost = _profile(target, named, ks, context_lens, repeats, device, warmup, seed, batch_sizes)
        if sampling is None:
            return cost
        if not isinstance(sampling, SamplingConfig):
            sampling = SamplingConfig(**dict(sampling))
        c = middle_context(cost.meta["context_lens"])
        logger.info("timing the decoder's own work per step at context %d (%s)", c, sampling)
        gen = torch.Generator().manual_seed(seed + 1)
        base, drafted = decoder_steps(target, named, cost, sampling, ks, c, loop_tokens, repeats, seed, gen)
        return fit_step_overhead(cost, base, drafted, {**asdict(sampling), "context": c, "tokens": loop_tokens},
                                 context_len=c)


def _profile(target, named: dict, ks, context_lens, repeats: int, device, warmup: int, seed: int,
             batch_sizes) -> CostModel:
    import transformers

    param = next(target.parameters())
    device = param.device if device is None else torch.device(device)
    if param.device != device:
        raise ValueError(f"the target is on {param.device} but device={device}; "
                         f"move it first (model.to({str(device)!r})) or leave device=None")
    if not ks or min(ks) < 0 or not context_lens or min(context_lens) < 1 or repeats < 1:
        raise ValueError(f"profile needs ks >= 0, context_lens >= 1 and repeats >= 1; "
                         f"got ks={ks}, context_lens={context_lens}, repeats={repeats}")
    gen = torch.Generator().manual_seed(seed)  # CPU generator: same token ids on every device
    per_token = {name: isinstance(getattr(d, "model", None), torch.nn.Module) or bool(feature_layers(d))
                 for name, d in named.items()}
    if not batch_sizes or min(batch_sizes) < 1 or 1 not in batch_sizes:
        raise ValueError(f"batch_sizes must hold 1 and sizes >= 1, got {batch_sizes}")
    prefill_rows, draft_rows, fixed_rows = _measure(target, named, per_token, ks, context_lens, device, gen, repeats,
                                                    warmup)
    feeds = sorted({k + 1 for k in ks})
    logger.info("profiling the verify pass at batch sizes %s on %s", sorted(set(batch_sizes)), device)
    by_batch = _verify_times(target, sorted(set(batch_sizes)), context_lens, feeds, device, gen, repeats, warmup)
    verify_rows = by_batch.pop(1)
    batch_rows = by_batch
    shares = {}
    if len(set(batch_sizes)) > 1:
        c, K = middle_context(context_lens), max(max(ks), 2)  # K: the longest block _batch_shares times
        for name, drafter in named.items():
            fits = (_fits(target, c, 2) if feature_layers(drafter)
                    else per_token[name] and _fits(drafter.model, c, K + 1))
            if fits:
                logger.info("profiling %s drafting rows together at batch sizes %s", name, sorted(set(batch_sizes)))
                shares[name] = _batch_shares(target, drafter, c, max(max(ks), 1), batch_sizes, device, gen, repeats,
                                             warmup)
    if not verify_rows:
        raise ValueError(f"every context length in {tuple(context_lens)} exceeds the target's context window; "
                         "pass shorter context_lens")
    if repeats < MIN_REPEATS:
        logger.warning("profiling with repeats=%d: too few to tell a real decrease in verify cost from noise, so every "
                       "decrease is pooled; use repeats >= %d", repeats, MIN_REPEATS)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(param.dtype),
            "device_name": device_name or platform.machine(),
            "profiled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": getattr(target.config, "name_or_path", "") or type(target).__name__,
            "ks": list(ks), "context_lens": sorted({c for _, c, _ in verify_rows}), "repeats": repeats,
            "batch_sizes": sorted(set(batch_sizes)), "batch_row_spread": list(ROW_SPREAD)}
    c = middle_context(meta["context_lens"])  # timed as the evaluation times it (profiling.drift)
    meta["speed_probe"] = {"context": c, "seconds": probe_pass(target, c, repeats=max(repeats, SPEED_PROBE_REPEATS),
                                                               seed=seed)}
    return fit_cost_model(str(device), verify_rows, draft_rows, per_token, meta, batch_cells=batch_rows,
                          fixed_cells=fixed_rows, prefill_cells=prefill_rows, share_cells=shares, seed=seed)
