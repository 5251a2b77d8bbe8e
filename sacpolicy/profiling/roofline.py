"""GPU-shaped costs on paper: a ``CostModel`` from a device's published memory bandwidth and peak FLOPs and a model's
size and shape (a roofline), for pricing traces as if they were served on a GPU this machine does not have. The
simulator prices it like a measured profile; its ``meta`` says ``"source": "roofline"`` and carries every constant
with where it comes from, so a table built on it can say plainly that it is simulated.

Each pass is a sum over its operations of max(bytes / bandwidth, FLOPs / peak) (a roofline per operation, not per
pass: at one row the linear layers are bound by reading their weights while attention reads the cache; at many rows
the linear layers become compute-bound first), plus a fixed cost per pass (``Device.pass_overhead_s``: kernel
launches and the engine's step, zero on paper unless given):
  - linear layers (attention projections, MLP, LM head) over T = rows * tokens fed: bytes = their weights (read once
    per pass) + T * hidden activations in and out; FLOPs = 2 * weights * T;
  - attention of T new tokens over each row's ``context`` cached tokens: bytes = the rows' cached K and V
    (rows * context * ``kv_bytes_per_token``) + the new tokens' K and V written; FLOPs = 4 * layers * heads *
    head_dim * T * (context + (tokens + 1) / 2) (QK^T and PV; a new token sees the new ones before it, causally).
Attention is linear in context, so a verify pass is exactly ``a_B(k + 1) + b_B(k + 1) * context``, the shape of
``CostModel.verify`` (per-context slope a curve over tokens fed): the knots at every k + 1 = 1 .. k_max + 1 reproduce
the roofline there. A model drafter drafts one token per row per pass (``draft``: one row, vs context;
``draft_batch``: a row's share when r rows draft together); model-free drafters (n-gram, suffix) are CPU lookups a
GPU roofline does not price: their curves come from a measured profile (``model_free``), or they are left out.

The constants below are the vendors' published figures (dense, no sparsity) and the models' published
``config.json``; a device's achieved fraction of peak is ``Device.efficiency`` (1.0: the paper roofline, an upper
bound on speed). ``scripts/roofline.py`` writes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.curve import PiecewiseLinear

__all__ = ["DEVICES", "MODELS", "Device", "ModelShape", "pass_time", "ridge_tokens", "roofline_cost_model"]


@dataclass(frozen=True)
class Device:
    """A device's published peak memory bandwidth (bytes/s) and dense bf16 tensor FLOP/s, where they come from, the
    fraction of each a real kernel achieves (``efficiency``: 1.0 on paper) and a fixed cost per forward pass."""

    name: str
    bandwidth: float
    flops: float
    source: str
    efficiency: float = 1.0
    pass_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.flops > 0 and 0 < self.efficiency <= 1 and self.pass_overhead_s >= 0):
            raise ValueError(f"device {self.name!r}: bandwidth and flops must be > 0, efficiency in (0, 1] and "
                             f"pass_overhead_s >= 0; got {self.bandwidth}, {self.flops}, {self.efficiency}, "
                             f"{self.pass_overhead_s}")


DEVICES = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): GPU memory bandwidth 3.35 TB/s; BF16 Tensor Core
    # 1,979 teraFLOPS "with sparsity", i.e. 989.5 dense (the datasheet's footnote: shown with sparsity, half without)
    "h100-sxm": Device("NVIDIA H100 SXM5 80GB", 3.35e12, 989.5e12,
                       "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s HBM3, BF16 1,979 TFLOPS with "
                       "sparsity (989.5 dense)"),
    # the same datasheet, H100 NVL column: 3.9 TB/s; BF16 1,671 TFLOPS with sparsity (835.5 dense)
    "h100-nvl": Device("NVIDIA H100 NVL 94GB", 3.9e12, 835.5e12,
                       "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL: 3.9 TB/s HBM3, BF16 1,671 TFLOPS with "
                       "sparsity (835.5 dense)"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 4.8 TB/s HBM3e; BF16 1,979 TFLOPS with sparsity (989.5 dense)
    "h200-sxm": Device("NVIDIA H200 SXM 141GB", 4.8e12, 989.5e12,
                       "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s HBM3e, BF16 1,979 TFLOPS with "
                       "sparsity (989.5 dense)"),
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (its ``config.json``): layers, hidden size, MLP size, attention and KV
    heads, head size, vocabulary, whether the LM head is the embedding (tied), bytes per weight and cached value,
    and weights outside this shape read once per pass (``extra_params``: e.g. an EAGLE-3 head's fusion layer)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    source: str
    head_dim: int | None = None
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16
    extra_params: int = 0
    qkv_in: int | None = None  # the attention projections' input width (an EAGLE-3 layer reads 2 * hidden)

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} attention heads do not split into {self.kv_heads} KV groups")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def linear_params(self) -> int:
        """Weights every token of a pass multiplies by: attention projections, MLP, LM head, extras (the input
        embedding is a lookup: its rows, not its matrix, are read)."""
        q_in = self.qkv_in or self.hidden
        attn = q_in * (self.heads + 2 * self.kv_heads) * self.hd + self.heads * self.hd * self.hidden
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down (SwiGLU)
        return self.layers * (attn + mlp) + self.vocab * self.hidden + self.extra_params

    @property
    def params(self) -> int:
        """Every weight (the input embedding counted once more where it is not tied to the LM head)."""
        return self.linear_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token holds: K and V in every layer."""
        return 2 * self.layers * self.kv_heads * self.hd * self.bytes_per_param


MODELS = {
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
    # vocab 128256, untied LM head, bfloat16
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256,
                               "meta-llama/Llama-3.1-8B config.json"),
    # meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, intermediate 8192, 32 heads, 8 KV heads,
    # head_dim 64, vocab 128256, tied embeddings, bfloat16: a draft model with the 8B's tokenizer
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 16, 2048, 8192, 32, 8, 128256, "meta-llama/Llama-3.2-1B config.json",
                               head_dim=64, tied_embeddings=True),
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json: one decoder layer of the 8B's shape whose attention reads the
    # token embedding and the fused hidden state (2 * 4096 wide), a 32000-token draft vocabulary, and the fusion
    # layer fc (3 * 4096 -> 4096) of the target's three hidden states
    "eagle3-llama-3.1-8b": ModelShape("EAGLE-3 head for Llama-3.1-8B", 1, 4096, 14336, 32, 8, 32000,
                                      "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json", extra_params=3 * 4096 * 4096,
                                      qkv_in=2 * 4096),
}


def pass_time(model: ModelShape, device: Device, rows: int, tokens: int, context: float) -> float:
    """Seconds of one forward pass of ``rows`` rows feeding ``tokens`` tokens each on ``context`` cached tokens per
    row (module docstring)."""
    if rows < 1 or tokens < 1 or context < 0:
        raise ValueError(f"a pass has rows >= 1, tokens >= 1 and context >= 0; got {rows}, {tokens}, {context}")
    bw, peak = device.bandwidth * device.efficiency, device.flops * device.efficiency
    b = model.bytes_per_param
    T = rows * tokens
    linear_bytes = model.linear_params * b + 2 * T * model.hidden * b * model.layers
    linear = max(linear_bytes / bw, 2.0 * model.linear_params * T / peak)
    attn_bytes = rows * (context + tokens) * model.kv_bytes_per_token  # read the cache, write the new K and V
    # QK^T and PV of each new token over what it sees: the cache and, causally, the new tokens up to itself
    attn_flops = 4.0 * model.layers * model.heads * model.hd * T * (context + (tokens + 1) / 2)
    return device.pass_overhead_s + linear + max(attn_bytes / bw, attn_flops / peak)


def _verify_curves(model: ModelShape, device: Device, rows: int, k_max: int) -> dict:
    """{"tokens": a(n), "per_context": b(n)} at n = 1 .. k_max + 1 tokens fed: the pass at context 0, and its
    slope in context (exact: the pass is linear in context)."""
    ns = list(range(1, k_max + 2))
    a = [pass_time(model, device, rows, n, 0.0) for n in ns]
    slope = [pass_time(model, device, rows, n, 1.0) - t0 for n, t0 in zip(ns, a)]
    return {"tokens": PiecewiseLinear(ns, a), "per_context": PiecewiseLinear(ns, slope)}


def roofline_cost_model(device: Device | str, target: ModelShape | str, *,
                        drafters: Mapping[str, ModelShape | str] | None = None,
                        model_free: Mapping[str, PiecewiseLinear] | None = None, k_max: int = 8,
                        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                        context_lens: Sequence[int] = (64, 256, 1024, 4096), efficiency: float | None = None,
                        pass_overhead_s: float | None = None) -> CostModel:
    """The roofline ``CostModel`` of ``target`` on ``device`` (names of ``DEVICES`` / ``MODELS`` or their objects):
    verify curves at every batch size of ``batch_sizes`` (tokens fed 1 .. k_max + 1), a prefill curve at
    ``context_lens``, per model drafter (``drafters``: name -> its shape) its one-row draft step vs context and its
    rows' shares drafting together, and the model-free drafters' measured curves as given (``model_free``: name ->
    seconds per proposal vs context, e.g. a measured ``cost.json``'s ``draft[name]``). ``efficiency`` and
    ``pass_overhead_s`` replace the device's."""
    device = _named(DEVICES, device, "device")
    target = _named(MODELS, target, "model")
    if efficiency is not None or pass_overhead_s is not None:
        device = replace(device, efficiency=device.efficiency if efficiency is None else efficiency,
                         pass_overhead_s=device.pass_overhead_s if pass_overhead_s is None else pass_overhead_s)
    sizes = sorted(set(int(b) for b in batch_sizes) | {1})
    if k_max < 1 or sizes[0] < 1:
        raise ValueError(f"k_max must be >= 1 and batch sizes >= 1, got {k_max} and {list(batch_sizes)}")
    ctx = sorted(set(int(c) for c in context_lens))
    shapes = {name: _named(MODELS, m, "model") for name, m in (drafters or {}).items()}
    free = dict(model_free or {})
    both = sorted(set(shapes) & set(free))
    if both:
        raise ValueError(f"drafters {both} are given both as a model and as a model-free curve; name each once")
    draft = {name: PiecewiseLinear(ctx, [pass_time(m, device, 1, 1, c) for c in ctx]) for name, m in shapes.items()}
    mid = ctx[len(ctx) // 2]
    share = {name: PiecewiseLinear(sizes, [pass_time(m, device, r, 1, mid) / (r * pass_time(m, device, 1, 1, mid))
                                           for r in sizes]) for name, m in shapes.items() if len(sizes) > 1}
    meta = {"source": "roofline", "simulated": True, "device_name": device.name, "device": asdict(device),
            "target": target.name, "target_shape": asdict(target), "target_params": target.params,
            "drafters": {name: asdict(m) for name, m in shapes.items()}, "model_free_from_measured": sorted(free),
            "dtype": "bfloat16" if target.bytes_per_param == 2 else f"{target.bytes_per_param} bytes",
            "ks": list(range(k_max + 1)), "context_lens": ctx, "batch_sizes": sizes,
            "note": "computed from published constants (a roofline), not measured"}
    return CostModel(device=f"roofline:{device.name}", verify=_verify_curves(target, device, 1, k_max),
                     draft={**draft, **free}, per_token_draft={**dict.fromkeys(draft, True),
                                                               **dict.fromkeys(free, False)},
                     meta=meta, batch={b: _verify_curves(target, device, b, k_max) for b in sizes if b > 1},
                     prefill=PiecewiseLinear(ctx, [pass_time(target, device, 1, n, 0.0) for n in ctx]),
                     draft_batch=share)


def _named(table: Mapping, value, what: str):
    if not isinstance(value, str):
        return value
    if value not in table:
        raise ValueError(f"unknown {what} {value!r}; known: {sorted(table)} (or pass a "
                         f"{'Device' if what == 'device' else 'ModelShape'} with its published constants)")
    return table[value]


def ridge_tokens(model: ModelShape, device: Device) -> float:
    """Tokens per pass at which the linear layers turn compute-bound: weights' bytes / bandwidth = 2 * weights * T /
    peak (the pass's weight reads, ignoring activations): bytes per weight * peak / (2 * bandwidth)."""
    return model.bytes_per_param * device.flops / (2.0 * device.bandwidth)
