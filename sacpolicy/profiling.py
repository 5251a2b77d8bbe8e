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
import itertools
import logging
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone

import numpy as np
import torch

from sacpolicy.decoding.compat import use_cpu_kernels, with_cache
from sacpolicy.decoding.ragged import RaggedCache, new_cache
from sacpolicy.runtime.cost import COST_FORMAT, CostModel, PiecewiseLinear, _hinge_basis

__all__ = ["COST_FORMAT", "CostModel", "PiecewiseLinear", "fit_cost_model", "monotone_knots", "pool_adjacent_violators",
           "profile"]

logger = logging.getLogger(__name__)

MIN_REPEATS = 5  # fewer timings per cell give no usable interval: every decrease in the verify cost counts as noise
N_BOOT = 200  # bootstrap resamples behind each knot's interval


# ---------------------------------------------------------------------- profiling
def _sync(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu: wait for queued kernels
    if device.type != "cpu" and hasattr(backend, "synchronize"):
        backend.synchronize()


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
# spread from 0.4x to 1.6x the context (mean: the context). On near-equal rows a pass of 4 rows of 4 tokens after ~275
# cached ones cost 1.8x a pass of one token each; on rows of 80 / 180 / 320 / 520 tokens, 2.6x (the masked attention
# grows with the width and the tokens fed; embedded target, 2 cores).
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
        row = RaggedCache(cache, L, device)
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
    speed drifts during the profile moves every batch size alike. Timed one batch size after another, a shared CPU
    that slowed down midway priced a pass of 2 rows at 1.7x one row (48 against 28 ms; 1.1x when re-timed)."""
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


# ---------------------------------------------------------------------- fitting
def pool_adjacent_violators(y, w=None) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in (``w``-weighted) least squares: isotonic regression by pooling
    adjacent violators into their weighted mean."""
    y = np.asarray(y, dtype=float)
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=float)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks]) if blocks else y


def monotone_knots(ys, lo, hi, trust_intervals: bool = True) -> tuple[np.ndarray, list[int]]:
    """``ys`` made non-decreasing, except where knot i + 1 lies below knot i beyond noise (its interval ends below
    the start of knot i's) and ``trust_intervals``: there the curve may fall. -> (ys, [i: kept decreases i -> i+1]).
    Pooling is done within the runs between kept decreases, which only widens each kept decrease."""
    ys, lo, hi = (np.asarray(v, dtype=float) for v in (ys, lo, hi))
    kept = [i for i in range(len(ys) - 1) if trust_intervals and ys[i + 1] < ys[i] and hi[i + 1] < lo[i]]
    bounds = [0] + [i + 1 for i in kept] + [len(ys)]
    return np.concatenate([pool_adjacent_violators(ys[a:b]) for a, b in itertools.pairwise(bounds)]), kept


def _bootstrap(cells: Sequence[np.ndarray], fit: Callable[[np.ndarray], np.ndarray], n_boot: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cells: per measured cell, its [repeats] seconds; fit: cell medians [cells, B] -> fitted values [m, B].
    -> (fit of the medians, 2.5th and 97.5th percentile over ``n_boot`` fits of resampled medians), each [m]."""
    medians = np.array([[np.median(c)] for c in cells])
    boot = np.stack([np.median(c[rng.integers(len(c), size=(n_boot, len(c)))], axis=1) for c in map(np.asarray, cells)])
    lo, hi = np.percentile(fit(boot), [2.5, 97.5], axis=1)
    return fit(medians)[:, 0], lo, hi


def _knot_fit(x, knots: Sequence[float], extra: np.ndarray | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Least squares of a piecewise-linear curve at ``knots`` (plus one coefficient per ``extra`` column, appended
    after the knot values): targets [cells, B] -> [len(knots) (+ extras), B]."""
    basis, at_knots = _hinge_basis(x, knots), _hinge_basis(knots, knots)
    X = basis if extra is None else np.column_stack([basis, extra])

    def fit(T: np.ndarray) -> np.ndarray:
        coef = np.linalg.lstsq(X, T, rcond=None)[0]
        return np.vstack([at_knots @ coef[: basis.shape[1]], coef[basis.shape[1]:]])

    return fit


def _fit_verify(cells: list[tuple[int, int, np.ndarray]], repeats: int, n_boot: int, rng,
                per_token_slope: bool = False) -> dict:
    """cells (tokens fed, context, seconds) -> t = a(tokens) + b * context, non-decreasing in tokens within noise.
    ``per_token_slope`` (batches, whose every query reads a cache as wide as the longest row): b(tokens) too, one line
    over the profiled contexts per knot; the monotone check runs on the curve at the middle profiled context."""
    n, c = (np.array(v, dtype=float) for v in list(zip(*cells))[:2])
    knots = sorted(set(n.tolist()))
    contexts = sorted(set(c.tolist()))
    # one context length cannot separate b from a: fold it into a
    split = len(contexts) > 1
    if split and per_token_slope:
        ref = contexts[len(contexts) // 2]
        basis, at_knots, K = _hinge_basis(n, knots), _hinge_basis(knots, knots), len(knots)
        X = np.column_stack([basis, basis * c[:, None]])

        def fit(T: np.ndarray) -> np.ndarray:  # -> [the curve at context ref; the slope curve] at the knots
            coef = np.linalg.lstsq(X, T, rcond=None)[0]
            a, b = at_knots @ coef[:K], at_knots @ coef[K:]
            return np.vstack([a + b * ref, b])

        ys, lo, hi = _bootstrap([t for *_, t in cells], fit, n_boot, rng)
        slope = ys[K:]
        ys, lo, hi = ys[:K], lo[:K], hi[:K]
    else:
        fit = _knot_fit(n, knots, c[:, None] if split else None)
        ys, lo, hi = _bootstrap([t for *_, t in cells], fit, n_boot, rng)
        slope = float(ys[-1]) if split else 0.0
        ys, lo, hi = ys[: len(knots)], lo[: len(knots)], hi[: len(knots)]
    mono, kept = monotone_knots(ys, lo, hi, trust_intervals=repeats >= MIN_REPEATS)
    for i in range(len(knots) - 1):
        x0, x1 = int(knots[i]), int(knots[i + 1])
        if i in kept:
            logger.warning("verify cost falls from %d to %d tokens fed beyond noise (%.3g s, 95%% [%.3g, %.3g] -> "
                           "%.3g s, [%.3g, %.3g]); kept", x0, x1, ys[i], lo[i], hi[i], ys[i + 1], lo[i + 1], hi[i + 1])
        elif ys[i + 1] < ys[i]:
            why = "within noise" if repeats >= MIN_REPEATS else f"with repeats={repeats} < {MIN_REPEATS} to tell"
            logger.info("verify cost measured lower at %d than at %d tokens fed (%.3g < %.3g s) %s; pooled", x1, x0,
                        ys[i + 1], ys[i], why)
    if isinstance(slope, float):
        return {"tokens": PiecewiseLinear(knots, mono.tolist(), lo.tolist(), hi.tolist()), "per_context": slope}
    at_zero = slope * ref  # the curve at context 0 (its intervals: those at ref, the slope held)
    return {"tokens": PiecewiseLinear(knots, (mono - at_zero).tolist(), (lo - at_zero).tolist(),
                                      (hi - at_zero).tolist()),
            "per_context": PiecewiseLinear(knots, slope.tolist())}


def _fit_draft(name: str, cells: list[tuple[int, np.ndarray]], per_token: bool, n_boot: int, rng) -> PiecewiseLinear:
    if not cells:
        raise ValueError(f"drafter {name!r} could not be timed at any of the context lengths; "
                         "pass context_lens that fit its max_position_embeddings")
    x = np.array([c for c, _ in cells], dtype=float)
    if per_token:  # one forward per token: a line in context length (attention reads the whole cache)
        knots = sorted({x.min(), x.max()})
        fit = _knot_fit(x, knots)
    else:  # model-free lookup: one constant per proposal, the median over contexts
        knots, fit = [0.0], lambda T: np.median(T, axis=0, keepdims=True)
    ys, lo, hi = _bootstrap([t for _, t in cells], fit, n_boot, rng)
    return PiecewiseLinear(knots, ys.tolist(), lo.tolist(), hi.tolist())


def fit_cost_model(device: str, verify_cells: list[tuple[int, int, np.ndarray]],
                   draft_cells: Mapping[str, list[tuple[int, np.ndarray]]], per_token: Mapping[str, bool],
                   meta: Mapping | None = None, *, batch_cells: Mapping[int, list] | None = None,
                   fixed_cells: Mapping[str, list] | None = None, prefill_cells: list | None = None,
                   n_boot: int = N_BOOT, seed: int = 0) -> CostModel:
    """A CostModel from timings: ``verify_cells`` (tokens fed, context, [repeats] seconds of one target forward),
    ``draft_cells`` {drafter: [(context, [repeats] seconds of one draft step or proposal)]}, ``batch_cells`` {batch
    size > 1: verify cells of a pass over that many rows}, ``fixed_cells`` {per-token drafter: [(context, [repeats]
    seconds it spends once per proposal)]}, ``prefill_cells`` [(prompt tokens, [repeats] seconds of its prefill)]."""
    rng = np.random.default_rng(seed)
    repeats = min(len(t) for *_, t in verify_cells)
    draft = {name: _fit_draft(name, cells, per_token[name], n_boot, rng) for name, cells in draft_cells.items()}
    batch = {b: _fit_verify(cells, min(len(t) for *_, t in cells), n_boot, rng, per_token_slope=True)
             for b, cells in sorted((batch_cells or {}).items())}
    meta = {**(meta or {}), "knot_interval": f"95% bootstrap over repeats ({n_boot} resamples)"}
    fixed = {name: _fit_draft(name, cells, True, n_boot, rng) for name, cells in (fixed_cells or {}).items()}
    prefill = _fit_draft("prefill", prefill_cells, True, n_boot, rng) if prefill_cells else None
    return CostModel(device, _fit_verify(verify_cells, repeats, n_boot, rng), draft, dict(per_token), meta,
                     batch=batch, draft_fixed=fixed, prefill=prefill)


# ---------------------------------------------------------------------- measuring
def _measure(target, drafters: dict, per_token: dict, ks, context_lens, device, gen, repeats: int, warmup: int):
    """-> prefill cells [(prompt tokens, [repeats] seconds)], {drafter: [(context, [repeats] seconds)]} and the same
    for the drafters' once-per-proposal seconds (feature drafters). The verify pass: ``_verify_times``."""
    from sacpolicy.decoding.sampling import SamplingConfig

    prefill_rows, draft_rows, fixed_rows = [], {name: [] for name in drafters}, {}
    feeds, k_max = sorted({k + 1 for k in ks}), max(max(ks), 1)
    for c in context_lens:
        if not _fits(target, c, feeds[-1]):
            continue
        logger.info("profiling context %d on %s", c, device)
        prefill_rows.append((c, _prefill_times(target, c, device, gen, repeats, warmup)))
        for name, drafter in drafters.items():
            if drafter.aux_layers:  # a feature head: a feed of the new rows, then one chain step per drafted token
                per_token_s, fixed_s = _feature_step_times(target, drafter, c, k_max, device, gen, repeats, warmup)
                draft_rows[name].append((c, per_token_s))
                fixed_rows.setdefault(name, []).append((c, fixed_s))
                continue
            if per_token[name]:
                if _fits(drafter.model, c, 1):
                    t = _forward_times(drafter.model, c, [1], device, gen, repeats, warmup)[1]
                    draft_rows[name].append((c, t))
                continue
            context = torch.randint(target.config.vocab_size, (c,), generator=gen).to(device)
            propose = functools.partial(drafter.propose, context, k_max, SamplingConfig())
            draft_rows[name].append((c, _times(propose, drafter.reset, device, repeats, warmup)))
    return prefill_rows, draft_rows, fixed_rows


def _feature_step_times(target, drafter, c: int, k_max: int, device, gen, repeats: int, warmup: int):
    """A feature drafter timed as the decoder runs it on top of c committed tokens: each proposal first feeds the rows
    committed since the last one (here 2: the last token and one accepted draft), then drafts its chain. Blocks of 1
    and of K = max(k_max, 2) tokens are timed in the same rounds; -> ([repeats] seconds per drafted token,
    [repeats] seconds once per proposal), the two solving t(k) = fixed + k * per_token at k = 1 and K."""
    from sacpolicy.decoding.aux import aux_pass
    from sacpolicy.decoding.sampling import SamplingConfig

    K, pending = max(k_max, 2), 2
    context = torch.randint(target.config.vocab_size, (c + pending,), generator=gen).to(device)
    _, capture = aux_pass(target, context, 1, drafter.aux_layers)
    rows = capture.rows(drafter.aux_layers, c + pending - 1)

    def committed():  # the drafter after a proposal at c tokens, the next 2 rows handed over and not fed yet
        drafter.reset()
        drafter.extend_features(rows[: c - 1])
        drafter.propose(context[:c], 1, SamplingConfig())
        drafter.extend_features(rows[c - 1:])

    committed()
    cells = {k: (functools.partial(drafter.propose, context, k, SamplingConfig()), committed) for k in (1, K)}
    t = _interleaved_times(cells, device, repeats, warmup)
    per_token = (t[K] - t[1]) / (K - 1)
    return per_token, t[1] - per_token


@torch.inference_mode()
def profile(target_model, drafters=(), *, ks=(0, 1, 2, 4, 8), context_lens=(64, 256, 1024), repeats: int = 5,
            device=None, warmup: int = 2, seed: int = 0, batch_sizes=(1,)) -> CostModel:
    """Measure the target's verify pass and each drafter's step on the device the models live on; fit a CostModel.

    drafters: a list of drafters or {name: drafter}. A drafter with a `.model` (ModelDrafter, LayerSkipDrafter) is
    timed as one single-token forward on its own KV cache, a feature drafter (EAGLE-3 head) per token of a drafted
    chain on the target's hidden states plus once per proposal (its feed of the newly committed rows); any other
    drafter as one propose() call on random tokens (for the n-gram drafter that is the no-match case, its slowest
    lookup). Every cell is timed `repeats` times
    (>= 5 for knot intervals that can tell a real decrease in verify cost from noise; see the module docstring).
    ``batch_sizes``: also time the verify pass over that many rows (the batched decoder's ragged cache and mask), so
    policies can weigh drafting at the live batch size.
    """
    import transformers

    from sacpolicy.models import LoadedModel

    target = target_model.model if isinstance(target_model, LoadedModel) else target_model
    named = dict(drafters) if isinstance(drafters, Mapping) else {d.name: d for d in drafters}
    # time the kernels the decoder will run
    use_cpu_kernels(target, named.values())
    param = next(target.parameters())
    device = param.device if device is None else torch.device(device)
    if param.device != device:
        raise ValueError(f"the target is on {param.device} but device={device}; "
                         f"move it first (model.to({str(device)!r})) or leave device=None")
    if not ks or min(ks) < 0 or not context_lens or min(context_lens) < 1 or repeats < 1:
        raise ValueError(f"profile needs ks >= 0, context_lens >= 1 and repeats >= 1; "
                         f"got ks={ks}, context_lens={context_lens}, repeats={repeats}")
    gen = torch.Generator().manual_seed(seed)  # CPU generator: same token ids on every device
    per_token = {name: isinstance(getattr(d, "model", None), torch.nn.Module) or bool(d.aux_layers)
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
    return fit_cost_model(str(device), verify_rows, draft_rows, per_token, meta, batch_cells=batch_rows,
                          fixed_cells=fixed_rows, prefill_cells=prefill_rows, seed=seed)
