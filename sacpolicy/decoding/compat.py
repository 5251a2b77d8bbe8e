"""What differs between the transformers releases sacpolicy supports (>= 5.0; vLLM pins some below 5.20), and where
what transformers runs on the CPU is not what the CPU runs fastest (``use_cpu_kernels``: the same arithmetic, other
kernels)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import ClassVar

import torch
from transformers.integrations import sdpa_attention

_CACHE_KEYWORD: dict[type, str] = {}


def cache_keyword(model) -> str:
    """The keyword a model's ``forward`` takes its KV cache by: ``cache`` in newer transformers releases,
    ``past_key_values`` before (a release that knows both takes ``cache`` and warns about the other)."""
    cls = type(model)
    if cls not in _CACHE_KEYWORD:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORD[cls]


def with_cache(model, cache) -> dict:
    """``model(input_ids=..., **with_cache(model, cache), use_cache=True)`` in any supported release."""
    return {cache_keyword(model): cache}


MASKED_GQA = "sacpolicy_sdpa"  # the attention implementation ``use_masked_gqa`` registers
_PACKS_SINGLE_QUERIES = hasattr(sdpa_attention, "pack_gqa")  # newer releases copy nothing for one query token


def _masked_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                     **kwargs):
    """transformers' ``sdpa`` attention, except for grouped-query attention under a mask on the CPU: there transformers
    copies every key/value head ``num_key_value_groups`` times per layer and pass (``repeat_kv``), since CUDA's fast
    kernels take no mask with grouped heads; torch's CPU kernel does (``enable_gqa``), with the same arithmetic. The
    masked multi-token passes are verification and every batched pass (our 4D mask), where the copy is the whole KV
    cache, once per layer and pass (its cost: docs/benchmarks.md, "CPU kernels")."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups > 1 and attention_mask is not None and query.device.type == "cpu"
            and (query.shape[2] > 1 or not _PACKS_SINGLE_QUERIES)
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, is_causal=is_causal, **kwargs)


def _on_cpu(module) -> bool:
    """A torch module whose parameters live on the CPU (False for anything else, or a module without parameters)."""
    if not isinstance(module, torch.nn.Module):
        return False
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu"


def use_masked_gqa(model) -> bool:
    """Switch a model on the CPU from transformers' ``sdpa`` attention to ``_masked_gqa_sdpa`` (the same results,
    without the key/value copies of grouped-query attention under a mask); other models and implementations are left
    as they are. Idempotent. -> whether it switched (``model.set_attn_implementation("sdpa")`` switches back)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _on_cpu(model):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # a name of our own in transformers' registries: models that do not ask for it never run it
    AttentionInterface.register(MASKED_GQA, _masked_gqa_sdpa)
    AttentionMaskInterface.register(MASKED_GQA, sdpa_mask)
    model.set_attn_implementation(MASKED_GQA)
    return True


# Which CPU kernel is fastest for a linear of a few rows depends on the CPU and the torch build: on one machine torch's
# GEMV for a single row was the slow path and one GEMM with the weight on the left (the row fed twice) read the
# weights once; on another the GEMV is 3-4x faster than that GEMM; oneDNN's linear (``mkldnn::_linear_pointwise``, the
# kernel inductor emits for CPU linears) wins at some row counts and shapes and serves long prefills. So ``CpuLinear``
# times the candidates once per shape, row count and thread count on first use and keeps the fastest. Timings:
# docs/benchmarks.md, "CPU kernels" (``scripts/bench_verify.py``).
# the weight-on-left GEMM is a candidate up to here: timed alone it also looks faster at 16 rows, where a whole forward
# of 16 rows on it ran 82 ms against torch's 77 (108 ms when its output was a transposed view)
_GEMM_MAX_ROWS = 8
_CALIBRATION_ROUNDS = 5  # timed calls of each candidate (after one untimed) when a shape is first seen
# another kernel replaces torch's only when its median time is below this share of torch's: timed alone, a kernel
# finds its weights in cache, which a forward through every layer does not (a GEMM at 0.7x torch's alone lost there)
_CLEARLY_FASTER = 0.67


def _onednn_linear():
    """oneDNN's fused linear op, or None where this torch build has none (then MKL's paths serve every size)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


class CpuLinear(torch.nn.Linear):
    """``nn.Linear`` whose inference forward on the CPU runs the fastest kernel for the rows fed, measured on this
    machine: torch's own ``linear``, one GEMM with the weight on the left (``(W @ x.T).T``; a single row fed twice) or
    oneDNN's linear. The first call of each (shape, dtype, row count, thread count) times every candidate
    ``_CALIBRATION_ROUNDS`` times; another kernel replaces torch's only when clearly faster (``_CLEARLY_FASTER``), and
    the choice is kept for the process (``choices``); row counts past 8 share a choice per power of two. Training,
    autograd and other devices use ``nn.Linear.forward``; parameters and state dict are unchanged. ``onednn``: the
    oneDNN op, None to leave it out (a subclass or test may set it)."""

    onednn = _onednn_linear()
    # (in, out, dtype, bias, threads, rows bucket, oneDNN offered) -> kernel name (a key of ``KERNELS``)
    choices: ClassVar[dict[tuple, str]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if (self.training or torch.is_grad_enabled() or x.device.type != "cpu" or rows < 1
                or x.dtype != self.weight.dtype):
            return super().forward(x)
        flat = x.reshape(rows, self.in_features)
        key = (self.in_features, self.out_features, x.dtype, self.bias is not None, torch.get_num_threads(),
               rows if rows <= 8 else 1 << (rows - 1).bit_length(), self.onednn is not None)
        kernel = self.choices.get(key)
        if kernel is None:
            kernel = self.choices[key] = self._fastest(flat)
        return self.KERNELS[kernel](self, flat).reshape(*x.shape[:-1], self.out_features)

    def kernels(self, rows: int, dtype: torch.dtype) -> list[str]:
        """The candidate kernels for ``rows`` rows of ``dtype``."""
        names = ["torch"]
        if rows <= _GEMM_MAX_ROWS:
            names.append("gemm")
        if self.onednn is not None and dtype == torch.float32:
            names.append("onednn")
        return names

    def _fastest(self, flat: torch.Tensor) -> str:
        names = self.kernels(len(flat), flat.dtype)
        times = {name: [] for name in names}
        for name in names:
            self.KERNELS[name](self, flat)  # untimed: first-call costs
        for _ in range(_CALIBRATION_ROUNDS):
            for name in names:
                t0 = time.perf_counter()
                self.KERNELS[name](self, flat)
                times[name].append(time.perf_counter() - t0)
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        best = min(names, key=median.get)
        # torch's own unless another is clearly faster: a near-tie is noise, and torch's is transformers' arithmetic
        return best if median[best] < _CLEARLY_FASTER * median["torch"] else "torch"

    def _torch(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(flat, self.weight, self.bias)

    def _gemm(self, flat: torch.Tensor) -> torch.Tensor:
        rows = len(flat)
        if rows == 1:
            flat = torch.cat([flat, flat])  # contiguous: a stride-0 view is copied on every call and loses the gain
        y = (self.weight @ flat.t()).t()[:rows]
        # contiguous, so its cost is timed here: a transposed view made every op after it copy or stride (a sum with
        # the bias keeps the view's strides)
        return (y + self.bias if self.bias is not None else y).contiguous()

    def _onednn(self, flat: torch.Tensor) -> torch.Tensor:
        return self.onednn(flat.contiguous(), self.weight, self.bias, "none", [], "")

    KERNELS: ClassVar[dict[str, Callable]] = {"torch": _torch, "gemm": _gemm, "onednn": _onednn}  # name -> kernel


def use_cpu_kernels(target, drafters=()) -> Callable[[], None]:
    """Run the target and each drafter's model (``.model``, or a feature drafter's ``.head``) on the CPU with the
    faster kernels for what decoding feeds them: masked grouped-query attention without key/value copies
    (``use_masked_gqa``) and linears on the fastest kernel for the rows fed (``CpuLinear``). The same arithmetic up to
    float rounding; modules elsewhere are left as they are. Idempotent. -> a function that undoes what this call
    switched (``cpu_kernels`` is the same for one block of code)."""
    modules = [target, *(getattr(d, attr, None) for d in drafters for attr in ("model", "head"))]
    attention, linears = [], []
    for module in modules:
        if not _on_cpu(module):
            continue
        if use_masked_gqa(module):
            attention.append(module)
        for sub in module.modules():
            if type(sub) is torch.nn.Linear:
                sub.__class__ = CpuLinear
                linears.append(sub)

    def undo() -> None:
        for sub in linears:
            sub.__class__ = torch.nn.Linear
        for module in attention:
            module.set_attn_implementation("sdpa")

    return undo


@contextmanager
def cpu_kernels(target, drafters=(), enabled: bool = True):
    """``use_cpu_kernels`` for the block, undone after it: the models are as they were before. The decoder decodes
    inside it (``DecoderConfig.cpu_kernels``) and the profiler times inside it, so decoding and its cost model time
    the same kernels while the caller's model is left as it gave it. Nested blocks switch nothing more."""
    undo = use_cpu_kernels(target, drafters) if enabled else None
    try:
        yield
    finally:
        if undo is not None:
            undo()
