"""EAGLE-3 feature-level draft head (Li et al. 2025) and the drafter that runs it.

The head reads the target's own hidden states. Symbols: H hidden size, A = len(aux_layer_ids) * H, Vd draft
vocabulary (a trimmed subset of the target's V tokens), t a position of the committed sequence x_0 .. x_{n-1}.

- ``fc`` [A -> H] projects the target's aux hidden states at position t (the inputs of decoder layers
  ``aux_layer_ids``, HF ``output_hidden_states[i]``, as vLLM collects them, concatenated in that order) to one
  feature h_t; with ``norm_before_fc`` one RMSNorm (``input_norm``) over all A first, with ``fc_norm`` one per aux
  state (``fc_norm.{i}``).
- One Llama decoder layer (``layers.0``) reads the pair (h_t, x_{t+1}): q/k/v take
  [input_layernorm(embed(x_{t+1})) ; hidden_norm(h_t)] (2H), the residual is h_t itself (pre-norm; with
  ``norm_before_residual`` hidden_norm(h_t)), MLP as Llama; ``qk_norm``: per-head RMSNorms on q and k (Qwen3's layer).
- ``norm`` + ``lm_head`` [H -> Vd] give the logits of x_{t+2}; ``d2t`` maps a draft id to a target id as an OFFSET
  (target = draft + d2t[draft], the speculators / SpecForge / SGLang convention), ``t2d`` [V] bool marks the draft
  vocabulary among the target's ids.
- Chain drafting: step j > 0 reads (the layer's own pre-norm output of step j - 1, or with ``norm_output`` its normed
  output, the token drafted at step j - 1).
  Positions follow vLLM: the pair (h_t, x_{t+1}) sits at position t, chain step j at t + j (RoPE only sees position
  differences, so speculators' training offset of +1 changes nothing).
- Token embeddings are the target's, frozen and shared (never saved with the head; a published head that carries its
  own is loaded with it, as vLLM does).

Parameter names are those of a speculators ``Eagle3DraftModel`` checkpoint (``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight``, buffers ``d2t``, ``t2d``). Our checkpoint directory: ``model.safetensors`` (those
tensors), ``config.json`` (``Eagle3Config``), ``provenance.json`` (how it was trained). ``load_head`` also reads
speculators', SpecForge / SGLang's and the EAGLE authors' checkpoints (``sacpolicy.decoding.eagle3_formats``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

# WEIGHTS_FILE and vocab_hash: re-exported, part of this module's API
from sacpolicy.decoding.eagle3_formats import CONFIG_FILE, check_target, read_head_dir
from sacpolicy.decoding.eagle3_formats import WEIGHTS_FILE as WEIGHTS_FILE
from sacpolicy.decoding.eagle3_formats import vocab_hash as vocab_hash

PROVENANCE_FILE = "provenance.json"
HEAD_FORMAT = 1


@dataclass
class Eagle3Config:
    """Everything that fixes the head's shapes and the target it belongs to (our ``config.json``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_num_layers: int
    verifier: str = ""  # the target's model spec (sacpolicy.models) or hub id
    vocab_hash: str = ""  # vocab_hash(target tokenizer)
    rope_scaling: dict | None = None  # the target's rope_parameters minus rope_theta, when not "default"
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h), not h (speculators' training default)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc (``input_norm``)
    fc_norm: bool = False  # one RMSNorm per aux state before fc (``fc_norm.{i}``)
    norm_output: bool = False  # the chain feeds back norm(h), and lm_head reads it as it is (speculators' Eagle 3.1)
    qk_norm: bool = False  # per-head RMSNorms on q and k before RoPE (a Qwen3 decoder layer)
    format: int = HEAD_FORMAT

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids=None, verifier: str = "",
                    vocab_hash: str = "") -> Eagle3Config:
        """The head for a Llama-like target config; ``aux_layer_ids`` default to [2, L // 2, L - 3] (vLLM's)."""
        c, L = target_config, int(target_config.num_hidden_layers)
        explicit = aux_layer_ids is not None
        ids = [int(i) for i in (aux_layer_ids if explicit else (2, L // 2, L - 3))]
        if not ids or min(ids) < 0 or max(ids) >= L or len(set(ids)) != len(ids):
            what = f"aux_layer_ids {ids}" if explicit else f"the default aux_layer_ids {ids} ([2, L // 2, L - 3])"
            raise ValueError(f"{what} must be distinct layer ids in [0, {L - 1}] for a target with {L} decoder layers "
                             "(id i = the input of decoder layer i); pass aux_layer_ids= explicitly, e.g. "
                             f"{list(range(max(0, L - 3), L))}")
        V = int(c.vocab_size)
        if not 0 < draft_vocab_size <= V:
            raise ValueError(f"draft_vocab_size must be in [1, {V}] (the target's vocabulary), got {draft_vocab_size}")
        rope = dict(getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)})
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", None) or 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        H, heads = int(c.hidden_size), int(c.num_attention_heads)
        return cls(hidden_size=H, intermediate_size=int(c.intermediate_size), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or H // heads), rms_norm_eps=float(c.rms_norm_eps),
                   rope_theta=theta, rope_scaling=scaling, max_position_embeddings=int(c.max_position_embeddings),
                   target_vocab_size=V, draft_vocab_size=int(draft_vocab_size), aux_layer_ids=ids,
                   target_num_layers=L, verifier=verifier, vocab_hash=vocab_hash,
                   # Gemma's configs call it hidden_activation (gelu_pytorch_tanh)
                   hidden_act=str(getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", None) or "silu"))

    def layer_config(self) -> LlamaConfig:
        """The decoder layer as a LlamaConfig (also the ``transformer_layer_config`` of a speculators export)."""
        return LlamaConfig(
            vocab_size=self.target_vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
            rope_parameters={"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})},
            attention_bias=False, mlp_bias=False, tie_word_embeddings=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown or d.get("format", HEAD_FORMAT) != HEAD_FORMAT:
            raise ValueError(f"not an EAGLE-3 head config of format {HEAD_FORMAT} (unknown keys {sorted(unknown)}, "
                             f"format {d.get('format')}); retrain the head or load it with the sacpolicy that wrote it")
        return cls(**d)


# ---------------------------------------------------------------------- the head
class KVCache:
    """Preallocated keys/values [B, Hkv, capacity, D]. Entry i sits at position i, so rolling back is ``crop``."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, m, D] -> every cached key and value [B, Hkv, length + m, D]."""
        n, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:  # grow (doubling) and keep the cached entries
            new_k = k.new_zeros(k.shape[0], k.shape[1], max(256, 2 * end), k.shape[3])
            new_v = torch.zeros_like(new_k)
            if self.k is not None:
                new_k[:, :, :n], new_v[:, :, :n] = self.k[:, :, :n], self.v[:, :, :n]
            self.k, self.v = new_k, new_v
        self.k[:, :, n:end], self.v[:, :, n:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)
        if cfg.qk_norm:
            self.q_norm = LlamaRMSNorm(D, eps=cfg.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(D, eps=cfg.rms_norm_eps)


class Eagle3Layer(nn.Module):
    """The Llama decoder layer whose attention reads [embedding ; hidden] (2H). Split in two halves so the same code
    serves the KV-cached inference path and the training-time test, which differ only in the keys they attend."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(cfg.layer_config())
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_before_residual, self.qk_norm = cfg.norm_before_residual, cfg.qk_norm

    def qkv(self, emb, hidden, cos, sin):
        """emb, hidden [B, Q, H]; cos, sin [B, Q, D] -> q [B, Hq, Q, D], k and v [B, Hkv, Q, D] (RoPE applied)."""
        a = self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        B, Q, _ = x.shape
        q, k = a.q_proj(x).view(B, Q, a.heads, a.head_dim), a.k_proj(x).view(B, Q, a.kv_heads, a.head_dim)
        if self.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = a.v_proj(x).view(B, Q, a.kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, q, keys, values, mask, hidden):
        """Attention of q over keys/values (mask [B, 1, Q, K] bool, True = attend; None = all), then the residual
        (the un-normed hidden part) and the MLP -> [B, Q, H]."""
        return self.after_attention(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True),
                                    hidden)

    def after_attention(self, out, hidden):
        """Attention outputs [B, Hq, Q, D] -> the layer's outputs [B, Q, H]: output projection, the residual (the
        un-normed hidden part, or the normed one with ``norm_before_residual``) and the MLP, all per entry."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.o_proj(out.transpose(1, 2).flatten(2))
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """Attention of the training-time test at ``step``: valid [B, T] bool -> [B, 1, T, (step + 1) T] bool.

    Keys are the step-0 entries of every position, then those of steps 1 .. step. A step-j query at position t sees
    the step-0 keys at positions <= t (the true features, as a KV cache of committed positions holds them) and its own
    chain's keys: step i <= j at the same t (the diagonal of each later block), exactly the cache of a chain drafted
    from t at inference."""
    B, T = valid.shape
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    first = (causal & valid[:, None, :]) | eye  # the diagonal keeps padded rows from attending nothing
    return torch.cat([first] + [eye.expand(B, T, T)] * step, dim=-1).unsqueeze(1)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = cfg = config
        A = len(cfg.aux_layer_ids) * cfg.hidden_size
        self.fc = nn.Linear(A, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(A, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
                                         for _ in cfg.aux_layer_ids)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.layer_config())  # buffers not persistent: not in the checkpoint
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size), persistent=False)  # arange + d2t
        self._embed = [embed_tokens]  # the target's, frozen and shared: not a submodule, never saved or trained
        if embed_tokens.weight.shape != (cfg.target_vocab_size, cfg.hidden_size):
            raise ValueError(f"the target's embedding is {tuple(embed_tokens.weight.shape)}, the head expects "
                             f"({cfg.target_vocab_size}, {cfg.hidden_size}): load the target this head belongs to")

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd]: the target ids of the draft vocabulary, strictly increasing (so a draft argmax is the
        full-vocabulary argmax of ``full_logits``, ties included). Fills d2t (offsets) and t2d."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).to(self.d2t.device)
        cfg = self.config
        if ids.shape != (cfg.draft_vocab_size,) or int(ids.min()) < 0 or int(ids.max()) >= cfg.target_vocab_size \
                or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"the draft vocabulary must be {cfg.draft_vocab_size} strictly increasing target ids in "
                             f"[0, {cfg.target_vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self.draft_ids.copy_(ids)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.draft_ids.copy_(torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # frozen: no gradient reaches the target's embedding
            return self._embed[0](ids).to(self.fc.weight.dtype)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [..., A] -> features h [..., H] (fc, after the input norms the head has)."""
        x = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(x)

    def chain(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's outputs -> what the next chain step reads (and ``logits`` takes): norm(out) with
        ``norm_output``, else out itself."""
        return self.norm(out) if self.config.norm_output else out

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] -> [..., V] over the target's ids, -inf outside the draft vocabulary (q(x) = 0)."""
        return self._to_target_vocab(logits, float("-inf"))

    def full_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities [..., Vd] -> [..., V] over the target's ids, 0 outside the draft vocabulary."""
        return self._to_target_vocab(probs, 0.0)

    def _to_target_vocab(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        full = x.new_full((*x.shape[:-1], self.config.target_vocab_size), fill)
        return full.index_copy_(-1, self.draft_ids, x)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, cache: KVCache, logits_to_keep: int = 0):
        """Inference over one row's m new entries after its cached ones: hidden [1, m, H] (projected target features or
        the head's own outputs), input_ids [1, m] -> (outputs [1, m, H] as ``chain`` feeds them back, draft logits
        [1, m', Vd]) of the last m' = ``logits_to_keep`` entries (0: all m)."""
        out = self.layer_step(hidden, input_ids, cache)
        return out, self.logits(out[:, -logits_to_keep:])

    def layer_step(self, hidden: torch.Tensor, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``forward`` without the draft logits, for one row: the outputs [1, m, H], the entries cached."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"layer_step steps one row, got {input_ids.shape[0]}; rows with caches of their own step "
                             "together through layer_step_rows")
        return self.layer_step_rows(hidden, input_ids, [cache], [input_ids.shape[1]])

    def layer_step_rows(self, hidden: torch.Tensor, input_ids: torch.Tensor, caches: list[KVCache],
                        counts: list[int]) -> torch.Tensor:
        """The layer's cached step for rows with caches of their own: row r's ``counts[r]`` new entries follow its
        cache, and the rows' entries lie one after another in hidden [1, M, H] and input_ids [1, M] (M = sum of
        counts). The projections and the MLP run once over all M entries (one read of the layer's weights for every
        row, which is most of a one-token step); the attention runs per row over its own cache. -> outputs
        [1, M, H] (``chain``: pre-norm, or normed with ``norm_output``)."""
        layer = self.layers[0]
        pos = torch.cat([torch.arange(c.length, c.length + m, device=input_ids.device) for c, m in zip(caches, counts)])
        cos, sin = self.rotary_emb(hidden, pos.view(1, -1))
        q, k, v = layer.qkv(self.embed(input_ids), hidden, cos, sin)
        outs, s = [], 0
        for cache, m in zip(caches, counts):
            start = cache.length
            keys, values = cache.append(k[:, :, s : s + m], v[:, :, s : s + m])
            mask = None
            if m > 1:  # entry start + i sees the cache and the new entries up to itself
                mask = torch.ones(m, start + m, dtype=torch.bool, device=hidden.device).tril(start)[None, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, s : s + m], keys, values, attn_mask=mask,
                                                       enable_gqa=True))
            s += m
        return self.chain(layer.after_attention(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2), hidden))

    def layer_step_masked(self, hidden: torch.Tensor, input_ids: torch.Tensor, cache: KVCache,
                          positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer's cached step for one row's m new entries at any positions and attending any cached entries: a
        token tree's nodes (``FeatureDrafter``), each attending the row's true entries and its ancestors' entries.
        hidden [1, m, H], input_ids [1, m], positions [m], mask [m, cache.length + m] bool (True = attend; the new
        entries' own columns last) -> outputs [1, m, H] (``chain``), the entries cached after the cache's."""
        layer = self.layers[0]
        cos, sin = self.rotary_emb(hidden, positions.view(1, -1))
        q, k, v = layer.qkv(self.embed(input_ids), hidden, cos, sin)
        keys, values = cache.append(k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], enable_gqa=True)
        return self.chain(layer.after_attention(out, hidden))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [..., H] (as ``chain`` gives them) -> draft logits [..., Vd]."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))

    def ttt_forward(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int,
                    attention_mask: torch.Tensor | None = None, greedy: bool = False) -> list[torch.Tensor]:
        """Training-time test: ``steps`` chain steps at every position at once, as one masked attention per step.

        input_ids [B, T]: the token paired with each feature row (x_{t+1} with the target's aux at t); aux [B, T, A];
        attention_mask [B, T] (1 = real row). Step j's tokens are the true ones shifted by j (what the chain reads
        while its drafts are accepted), or with ``greedy`` the head's own argmax of step j - 1 (the exact greedy
        chain); its hidden inputs are step j - 1's outputs. Returns per step the draft logits [B, T, Vd]; step j at
        t predicts x_{t+2+j} (rows past a sequence's end are garbage: mask them)."""
        layer = self.layers[0]
        B, T = input_ids.shape
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        pos = (valid.long().cumsum(-1) - 1).clamp_min(0)  # [B, T]
        hidden = self.project(aux)
        ids, keys, values, out_logits = input_ids, [], [], []
        for j in range(steps):
            cos, sin = self.rotary_emb(hidden, pos + j)
            q, k, v = layer.qkv(self.embed(ids), hidden, cos, sin)
            keys.append(k)
            values.append(v)
            hidden = self.chain(layer.finish(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(valid, j), hidden))
            logits = self.logits(hidden)
            out_logits.append(logits)
            if greedy:
                ids = self.draft_ids[logits.argmax(-1)]
            else:
                ids = torch.cat([input_ids[:, j + 1 :], input_ids.new_zeros(B, min(j + 1, T))], dim=1)
        return out_logits


# ---------------------------------------------------------------------- checkpoint
def load_head(path, embed_tokens: nn.Embedding | None = None, device=None, dtype=None, target=None) -> Eagle3Head:
    """A head directory in any format ``read_head_dir`` reads (ours, speculators', SpecForge / SGLang's, the EAGLE
    authors') -> an ``Eagle3Head`` in eval mode. With ``target`` (a ``LoadedModel``) a head for another target is
    refused before any tensor is loaded (``check_target``), a format without aux layer ids gets the target's default,
    and ``embed_tokens`` defaults to the target's. A file's own token embedding is used unless it equals that."""
    ckpt = read_head_dir(path, None if target is None else target.model.config)
    try:
        config = Eagle3Config.from_dict(ckpt.config)
    except TypeError as e:  # a required field missing from our own config.json
        raise ValueError(f"{ckpt.path / CONFIG_FILE} is no complete EAGLE-3 head config ({e}); retrain the head or "
                         "load it with the sacpolicy that wrote it") from None
    if target is not None:
        check_target(config, target, where=ckpt.where())
        embed_tokens = target.model.get_input_embeddings() if embed_tokens is None else embed_tokens
    if embed_tokens is None and ckpt.embed is None:
        raise ValueError(f"{ckpt.where()} carries no token embedding: pass the target's (embed_tokens= or target=)")
    weight = ckpt.embed if embed_tokens is None else embed_tokens.weight
    device, dtype = device or weight.device, dtype or weight.dtype
    if ckpt.embed is not None and not (embed_tokens is not None and ckpt.embed.shape == weight.shape
                                       and torch.equal(ckpt.embed.to(weight), weight)):
        embed_tokens = nn.Embedding.from_pretrained(ckpt.embed.to(device=device, dtype=dtype), freeze=True)
    head = Eagle3Head(config, embed_tokens)
    try:
        missing, unexpected = head.load_state_dict(ckpt.tensors, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config gives
        raise ValueError(f"{ckpt.weights_file} does not match its config {ckpt.path / CONFIG_FILE}: {e}") from None
    if missing or unexpected:
        raise ValueError(ckpt.tensor_problem(missing, unexpected))
    return head.to(device=device, dtype=dtype).eval()
