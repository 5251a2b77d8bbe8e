"""The cost model: how long a speculative step takes on one device, and the tokens/s it is expected to buy.

One definition serves the policies (choose k), the simulator (replay traces at a profiled device's speed) and the
exported runtime. Times are measured once per device by `profile` and saved as JSON with a format version:

    cost = profile(target.model, [ModelDrafter(draft.model, name="draft"), NgramDrafter()])
    cost.to_json("cost.json")
    k, tokens_per_s = CostModel.from_json("cost.json").best_k("draft", 300, accept_probs=[0.8] * 8, k_max=8)

Model of a step drafting k tokens on top of `context` committed tokens:
    verify = a(k + 1) + b * context         a: piecewise linear in tokens fed, b: seconds per cached token
    draft  = k * d(context + (k - 1) / 2)   model drafters: one forward per drafted token
    draft  = d(context)                     n-gram (and other model-free) drafters: one lookup per proposal
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

COST_FORMAT = 1
# Floor on every predicted time: a noisy fit extrapolated far from its knots may cross zero, and tokens/s must stay
# finite and positive.
_MIN_S = 1e-7


def _hinge_basis(x, knots: Sequence[float]) -> np.ndarray:
    """[len(x), len(knots)] columns 1, x, max(0, x - knot) per interior knot: any continuous function that is linear
    between the knots (and beyond the outer ones) is one combination of them."""
    x = np.asarray(x, dtype=float)
    cols = [np.ones_like(x)]
    if len(knots) > 1:
        cols += [x] + [np.maximum(0.0, x - kn) for kn in knots[1:-1]]
    return np.stack(cols, axis=1)


@dataclass
class PiecewiseLinear:
    """y(x): linear interpolation between the knots (xs, ys), linear extrapolation beyond; one knot = constant."""

    xs: list[float]
    ys: list[float]

    def __post_init__(self) -> None:
        self.xs, self.ys = [float(v) for v in self.xs], [float(v) for v in self.ys]
        if not self.xs or len(self.xs) != len(self.ys):
            raise ValueError(f"a piecewise-linear curve needs as many ys as xs (>= 1), "
                             f"got {len(self.xs)} and {len(self.ys)}")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"piecewise-linear knots must be strictly increasing, got {self.xs}; "
                             "sort and deduplicate them")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)  # outer segments extend beyond the ends
        return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (x - xs[i])

    @classmethod
    def fit(cls, x, y, knots: Sequence[float]) -> PiecewiseLinear:
        """Least-squares values at `knots` of the piecewise-linear curve closest to the points (x, y)."""
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        if x.size == 0 or x.shape != y.shape:
            raise ValueError(f"fit needs matching, non-empty x and y; got shapes {x.shape} and {y.shape}")
        knots = sorted(float(k) for k in knots)
        coef, *_ = np.linalg.lstsq(_hinge_basis(x, knots), y, rcond=None)
        return cls(knots, (_hinge_basis(knots, knots) @ coef).tolist())


@dataclass
class CostModel:
    device: str
    verify: dict  # {"tokens": PiecewiseLinear over tokens fed (k + 1), "per_context": seconds per cached token}
    draft: dict[str, PiecewiseLinear]  # drafter -> seconds of one draft step (or one proposal) vs context length
    per_token_draft: dict[str, bool]  # True: cost per drafted token (model drafters); False: per proposal (n-gram)
    meta: dict = field(default_factory=dict)  # torch version, device name, dtype, when profiled, target

    def __post_init__(self) -> None:
        if set(self.verify) != {"tokens", "per_context"}:
            raise ValueError(f"verify must have keys 'tokens' and 'per_context', got {sorted(self.verify)}")
        if set(self.draft) != set(self.per_token_draft):
            raise ValueError(f"draft curves {sorted(self.draft)} and per_token_draft {sorted(self.per_token_draft)} "
                             "must name the same drafters")

    def verify_time(self, k: int, context_len: int) -> float:
        return max(_MIN_S, self.verify["tokens"](k + 1) + self.verify["per_context"] * context_len)

    def draft_time(self, drafter: str | None, k: int, context_len: int) -> float:
        if drafter is None or k <= 0:
            return 0.0
        if drafter not in self.draft:
            raise ValueError(f"no draft cost for drafter {drafter!r}; profiled: {sorted(self.draft)}. "
                             "Fix: re-run profile() with this drafter, or pick a profiled one")
        if not self.per_token_draft[drafter]:
            return max(_MIN_S, self.draft[drafter](context_len))
        # draft step i runs on context_len + i cached tokens; the curve is near-linear, so use the block's middle
        return k * max(_MIN_S, self.draft[drafter](context_len + (k - 1) / 2))

    def step_time(self, drafter: str | None, k: int, context_len: int) -> float:
        return self.draft_time(drafter, k, context_len) + self.verify_time(k, context_len)

    @staticmethod
    def expected_tokens(accept_probs: Sequence[float]) -> float:
        """accept_probs[i] = P(drafted token i accepted | all before it accepted). The step emits the accepted tokens
        plus one (the correction or bonus token): 1 + sum_j P(first j+1 accepted) = 1 + sum_j prod_{i<=j} a_i."""
        total, alive = 1.0, 1.0
        for a in accept_probs:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance probabilities must lie in [0, 1], got {a}")
            alive *= a
            total += alive
        return total

    def expected_tokens_per_s(self, drafter: str | None, k: int, context_len: int,
                              accept_probs: Sequence[float]) -> float:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if drafter is None or k == 0:
            return 1.0 / self.verify_time(0, context_len)
        if len(accept_probs) < k:
            raise ValueError(f"k={k} drafted tokens need {k} acceptance probabilities, got {len(accept_probs)}; "
                             "pass one per position up to k_max")
        return self.expected_tokens(accept_probs[:k]) / self.step_time(drafter, k, context_len)

    def best_k(self, drafter: str | None, context_len: int, accept_probs: Sequence[float],
               k_max: int) -> tuple[int, float]:
        """(k, expected tokens/s) maximising tokens/s over k in 0..k_max; ties go to the smaller k."""
        best = (0, self.expected_tokens_per_s(None, 0, context_len, ()))
        for k in range(1, k_max + 1 if drafter is not None else 1):
            tps = self.expected_tokens_per_s(drafter, k, context_len, accept_probs)
            if tps > best[1]:
                best = (k, tps)
        return best

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": COST_FORMAT, "device": self.device,
                "verify": {"tokens": asdict(self.verify["tokens"]), "per_context": float(self.verify["per_context"])},
                "draft": {name: asdict(curve) for name, curve in self.draft.items()},
                "per_token_draft": dict(self.per_token_draft), "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "cost model") -> CostModel:
        found = d.get("format") if isinstance(d, Mapping) else None
        if found != COST_FORMAT:
            raise ValueError(f"{source} has cost format {found!r} but this sacpolicy reads cost format {COST_FORMAT}. "
                             "Fix: re-profile this device with sacpolicy.policy.cost.profile() and save it again")
        return cls(device=d["device"],
                   verify={"tokens": PiecewiseLinear(**d["verify"]["tokens"]),
                           "per_context": float(d["verify"]["per_context"])},
                   draft={name: PiecewiseLinear(**curve) for name, curve in d["draft"].items()},
                   per_token_draft={name: bool(v) for name, v in d["per_token_draft"].items()},
                   meta=dict(d.get("meta", {})))

    def to_json(self, path) -> None:
        """Write atomically (temp file + rename), so a reader never sees half a file."""
        from sacpolicy.io import write_json

        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))


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
            if per_token[name]:
                if _fits(drafter.model, c, 1):
                    t = _forward_times(drafter.model, c, [1], device, gen, repeats, warmup)[1]
                    draft_rows[name].append((c, t))
                continue
            context = torch.randint(target.config.vocab_size, (c,), generator=gen).to(device)
            propose = functools.partial(drafter.propose, context, k_max, SamplingConfig())
            draft_rows[name].append((c, _median_time(propose, drafter.reset, device, repeats, warmup)))
    return verify_rows, draft_rows


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
    timed as one single-token forward on its own KV cache; any other drafter as one propose() call on random tokens
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
    per_token = {name: isinstance(getattr(d, "model", None), torch.nn.Module) for name, d in named.items()}
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
