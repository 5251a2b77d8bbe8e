"""Profiling a device into a ``CostModel`` (the model itself lives in ``sacpolicy.runtime.cost``, numpy only, so the
exported runtime shares it). See that module for what is modelled; ``profile`` measures it:

    cost = profile(target.model, [ModelDrafter(draft.model, name="draft"), NgramDrafter()])
    cost.to_json("cost.json")
"""

from __future__ import annotations

import functools
import logging
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from sacpolicy.runtime.cost import COST_FORMAT, CostModel, PiecewiseLinear, _hinge_basis

__all__ = ["COST_FORMAT", "CostModel", "PiecewiseLinear", "profile"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- profiling
def _sync(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu: wait for queued kernels
    if device.type != "cpu" and hasattr(backend, "synchronize"):
        backend.synchronize()


def _median_time(run: Callable[[], object], undo: Callable[[], object], device, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        undo()
    return statistics.median(times)


def _forward_times(model, context_len: int, feeds: Sequence[int], device, gen, repeats: int, warmup: int) -> dict:
    """{n: median seconds of one forward of n new tokens on top of a KV cache holding context_len tokens}."""
    from transformers import DynamicCache

    def ids(n):
        return torch.randint(model.config.vocab_size, (1, n), generator=gen).to(device)

    cache = DynamicCache(config=model.config)
    model(input_ids=ids(context_len), cache=cache, use_cache=True, logits_to_keep=1)
    times = {}
    for n in feeds:
        x = ids(n)
        times[n] = _median_time(lambda: model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=n),
                                lambda: cache.crop(-n),  # back to context_len cached tokens for the next repeat
                                device, repeats, warmup)
    return times


def _fits(model, context_len: int, new_tokens: int) -> bool:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context_len + new_tokens > limit:
        logger.warning("skipping context %d: with %d new tokens it exceeds %s's max_position_embeddings=%d",
                       context_len, new_tokens, type(model).__name__, limit)
        return False
    return True


def _fit_verify(rows: list[tuple[int, int, float]]) -> dict:
    """rows (tokens fed, context, seconds) -> t = a(tokens) + b * context, both fitted in one least-squares solve."""
    n, c, t = (np.array(v, dtype=float) for v in zip(*rows))
    knots = sorted(set(n.tolist()))
    basis = _hinge_basis(n, knots)
    if len(set(c.tolist())) > 1:
        coef, *_ = np.linalg.lstsq(np.column_stack([basis, c]), t, rcond=None)
        a, b = coef[:-1], float(coef[-1])
    else:  # one context length cannot separate b from a: fold it into a
        a, b = np.linalg.lstsq(basis, t, rcond=None)[0], 0.0
    return {"tokens": PiecewiseLinear(knots, (_hinge_basis(knots, knots) @ a).tolist()), "per_context": b}


def _measure(target, drafters: dict, per_token: dict, ks, context_lens, device, gen, repeats: int, warmup: int):
    """-> verify rows (tokens fed, context, seconds) and {drafter: [(context, seconds)]}."""
    from sacpolicy.decoding.sampling import SamplingConfig

    verify_rows, draft_rows = [], {name: [] for name in drafters}
    feeds, k_max = sorted({k + 1 for k in ks}), max(max(ks), 1)
    for c in context_lens:
        if not _fits(target, c, feeds[-1]):
            continue
        logger.info("profiling context %d on %s", c, device)
        verify_rows += [(n, c, t) for n, t in _forward_times(target, c, feeds, device, gen, repeats, warmup).items()]
        for name, drafter in drafters.items():
            if drafter.aux_layers:  # a feature head: one chain step per drafted token, on the target's features
                draft_rows[name].append((c, _feature_step_time(target, drafter, c, k_max, device, gen, repeats,
                                                               warmup)))
                continue
            if per_token[name]:
                if _fits(drafter.model, c, 1):
                    t = _forward_times(drafter.model, c, [1], device, gen, repeats, warmup)[1]
                    draft_rows[name].append((c, t))
                continue
            context = torch.randint(target.config.vocab_size, (c,), generator=gen).to(device)
            propose = functools.partial(drafter.propose, context, k_max, SamplingConfig())
            draft_rows[name].append((c, _median_time(propose, drafter.reset, device, repeats, warmup)))
    return verify_rows, draft_rows


def _feature_step_time(target, drafter, c: int, k_max: int, device, gen, repeats: int, warmup: int) -> float:
    """Seconds per drafted token of a feature drafter on top of c committed tokens (its cache already holds them):
    a block of max(k_max, 2) tokens timed, divided by its length."""
    from sacpolicy.decoding.aux import aux_pass
    from sacpolicy.decoding.sampling import SamplingConfig

    k = max(k_max, 2)
    context = torch.randint(target.config.vocab_size, (c,), generator=gen).to(device)
    _, capture = aux_pass(target, context, 1, drafter.aux_layers)
    drafter.reset()
    drafter.extend_features(capture.rows(drafter.aux_layers, c - 1))
    drafter.propose(context, 1, SamplingConfig())  # feeds the context: the timed blocks draft from it
    block = functools.partial(drafter.propose, context, k, SamplingConfig())
    return _median_time(block, lambda: drafter.accept(0), device, repeats, warmup) / k


def _fit_draft(name: str, rows: list[tuple[int, float]], per_token: bool) -> PiecewiseLinear:
    if not rows:
        raise ValueError(f"drafter {name!r} could not be timed at any of the context lengths; "
                         "pass context_lens that fit its max_position_embeddings")
    x, t = zip(*rows)
    if per_token:  # one forward per token: a line in context length (attention reads the whole cache)
        return PiecewiseLinear.fit(x, t, sorted({min(x), max(x)}))
    return PiecewiseLinear([0.0], [statistics.median(t)])  # model-free lookup: one constant per proposal


@torch.inference_mode()
def profile(target_model, drafters=(), *, ks=(0, 1, 2, 4, 8), context_lens=(64, 256, 1024), repeats: int = 5,
            device=None, warmup: int = 2, seed: int = 0) -> CostModel:
    """Measure the target's verify pass and each drafter's step on the device the models live on; fit a CostModel.

    drafters: a list of drafters or {name: drafter}. A drafter with a `.model` (ModelDrafter, LayerSkipDrafter) is
    timed as one single-token forward on its own KV cache, a feature drafter (EAGLE-3 head) per token of a drafted
    chain on the target's hidden states; any other drafter as one propose() call on random tokens
    (for the n-gram drafter that is the no-match case, its slowest lookup). Each time is the median of `repeats`.
    """
    import transformers

    from sacpolicy.models import LoadedModel

    target = target_model.model if isinstance(target_model, LoadedModel) else target_model
    param = next(target.parameters())
    device = param.device if device is None else torch.device(device)
    if param.device != device:
        raise ValueError(f"the target is on {param.device} but device={device}; "
                         f"move it first (model.to({str(device)!r})) or leave device=None")
    if not ks or min(ks) < 0 or not context_lens or min(context_lens) < 1 or repeats < 1:
        raise ValueError(f"profile needs ks >= 0, context_lens >= 1 and repeats >= 1; "
                         f"got ks={ks}, context_lens={context_lens}, repeats={repeats}")
    named = dict(drafters) if isinstance(drafters, Mapping) else {d.name: d for d in drafters}
    gen = torch.Generator().manual_seed(seed)  # CPU generator: same token ids on every device
    per_token = {name: isinstance(getattr(d, "model", None), torch.nn.Module) or bool(d.aux_layers)
                 for name, d in named.items()}
    verify_rows, draft_rows = _measure(target, named, per_token, ks, context_lens, device, gen, repeats, warmup)
    if not verify_rows:
        raise ValueError(f"every context length in {tuple(context_lens)} exceeds the target's context window; "
                         "pass shorter context_lens")
    draft = {name: _fit_draft(name, rows, per_token[name]) for name, rows in draft_rows.items()}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(param.dtype),
            "device_name": device_name or platform.machine(),
            "profiled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": getattr(target.config, "name_or_path", "") or type(target).__name__,
            "ks": list(ks), "context_lens": sorted({c for _, c, _ in verify_rows}), "repeats": repeats}
    return CostModel(str(device), _fit_verify(verify_rows), draft, per_token, meta)
