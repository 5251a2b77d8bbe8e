"""EAGLE-3 head checkpoints in the formats heads are published in, read into ours (``sacpolicy.decoding.eagle3``), and
the check that a head belongs to a target.

    ckpt = read_head_dir("heads/EAGLE3-LLaMA3.1-Instruct-8B", target.model.config)
    ckpt.format, ckpt.config (``Eagle3Config`` fields), ckpt.tensors (our names), ckpt.embed (its own embedding or None)

The format is told from config.json's keys and the tensor names; weights come from ``model.safetensors`` (or its
shards) or, unpickled with ``torch.load(weights_only=True)`` only, ``pytorch_model.bin``:

- sacpolicy: ``format`` and ``aux_layer_ids`` (our ``Eagle3Config``); tensors ``fc``, ``layers.0.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``. Aux layer id i = the input of decoder layer i (HF ``output_hidden_states[i]``).
- speculators (vLLM): ``speculators_model_type: eagle3``, the layer in ``transformer_layer_config``, the same tensor
  names, aux ids ``eagle_aux_hidden_state_layer_ids`` in our convention (default [2, L // 2, L - 3]), flags
  ``norm_before_residual``, ``norm_before_fc`` (``input_norm``), ``fc_norm`` (``fc_norm.{i}``), ``norm_output``.
- SpecForge / SGLang: ``architectures: [LlamaForCausalLMEagle3]``, the layer's fields at the top level, the layer as
  ``midlayer.*``; aux ids in ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (id i = the
  OUTPUT of layer i, captured as the input of layer i + 1: ours minus one); SpecForge's default [1, L // 2 - 1, L - 4]
  is ours [2, L // 2, L - 3].
- The EAGLE authors' releases (``yuhuili/EAGLE3-*``): SpecForge's layout without ``eagle_config``, often a
  ``pytorch_model.bin``; their target code captures the inputs of layers 2, L // 2 and L - 3.

Shared by all: fc reads the aux states concatenated in increasing layer order (vLLM and SGLang capture them in layer
order, whatever order the config lists); q/k/v read [input_layernorm(embed) ; hidden_norm(h)]; lm_head is over the
draft vocabulary; ``d2t`` holds offsets (target id = draft id + d2t[draft id]) and ``t2d`` is a [V] bool mask; without
``d2t`` the draft vocabulary is the target's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE, BIN_FILE = "config.json", "model.safetensors", "pytorch_model.bin"
SACPOLICY, SPECULATORS, SPECFORGE, EAGLE = "sacpolicy", "speculators", "SpecForge/SGLang", "EAGLE authors'"
LAYER_TYPES = {"llama": False, "qwen3": True}  # decoder layers sacpolicy (and vLLM) run -> per-head q/k norms
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' training targets, not the head's


class HeadFormatError(ValueError):
    pass


def vocab_hash(tokenizer) -> str:
    """A short fingerprint of a tokenizer's id -> token table: a head only drafts for targets that agree on it."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class HeadCheckpoint:
    """A head directory read into our terms: ``config`` holds ``Eagle3Config`` fields, ``tensors`` our names (the
    vocabulary map as offsets and a bool mask, the draft ids increasing), ``embed`` the head's own token embedding
    [V, H] when the file carries one (else the target's is shared)."""

    path: Path
    format: str
    config: dict
    tensors: dict[str, torch.Tensor]
    weights_file: Path
    embed: torch.Tensor | None = None
    layer_prefix: str = "layers.0."  # the file's name for our ``layers.0.``

    def where(self) -> str:
        return f"the EAGLE-3 head at {self.path} ({self.format} format, {self.path / CONFIG_FILE})"

    def file_name(self, ours: str) -> str:
        """Our tensor name -> the name the file uses for it."""
        return self.layer_prefix + ours.removeprefix("layers.0.") if ours.startswith("layers.0.") else ours

    def tensor_problem(self, missing, unexpected) -> str:
        """The message for tensors the head needs and the file lacks, or the file holds and the head has no place
        for, in the file's own names."""
        return (f"{self.weights_file} does not hold the tensors its config ({self.path / CONFIG_FILE}) describes: "
                f"missing {sorted(self.file_name(n) for n in missing)}, unexpected "
                f"{sorted(self.file_name(n) for n in unexpected)}. Fix: re-download or re-export the head; a "
                "config flag (norm_before_fc, fc_norm, qk norms of a qwen3 layer) that disagrees with the tensors "
                "means the config belongs to another checkpoint")


def read_head_dir(path, target_config=None) -> HeadCheckpoint:
    """The head directory ``path`` in any format above. ``target_config`` (the target's HF config), for a format that
    does not record them: its layer count L gives the default aux layers and the head's ``target_num_layers``, and
    the head's ``max_position_embeddings`` is raised to the target's (as speculators' converter does)."""
    target_layers = None if target_config is None else int(target_config.num_hidden_layers)
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not an EAGLE-3 head directory (no {CONFIG_FILE}); point draft.feature.path "
                                "at a head directory: ours (written by EAGLE-3 training), a speculators / vLLM one, a "
                                "SpecForge / SGLang one or an EAGLE authors' release")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise HeadFormatError(f"{config_file} is not JSON ({e}); re-download the head") from None
    weights_file, tensors = _read_weights(path)
    fmt = _detect(raw, tensors, config_file)
    ckpt = HeadCheckpoint(path, fmt, {}, tensors, weights_file,
                          layer_prefix="midlayer." if fmt in (SPECFORGE, EAGLE) else "layers.0.")
    if fmt == SACPOLICY:
        missing = sorted({"hidden_size", "target_vocab_size", "draft_vocab_size"} - set(raw))
        if missing:
            raise HeadFormatError(f"{config_file} lacks {missing}; retrain the head or load it with the sacpolicy "
                                  "that wrote it")
        ckpt.config = dict(raw)
    else:
        layer = raw["transformer_layer_config"] if fmt == SPECULATORS else raw
        ckpt.tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                        for k, v in tensors.items() if k not in TRAINING_ONLY}
        ckpt.embed = ckpt.tensors.pop("embed_tokens.weight", None)
        read = _speculators_fields if fmt == SPECULATORS else _eagle_fields
        ckpt.config = {**_layer_fields(layer, config_file), **read(raw, config_file, target_layers)}
        ckpt.config["target_num_layers"] = target_layers or 0  # 0: the format does not record it
        ckpt.config["max_position_embeddings"] = max(ckpt.config["max_position_embeddings"],
                                                     int(getattr(target_config, "max_position_embeddings", 0) or 0))
        ckpt.config["draft_vocab_size"] = _draft_vocab(raw, ckpt.tensors, weights_file)
    if ckpt.embed is not None and tuple(ckpt.embed.shape) != (ckpt.config["target_vocab_size"],
                                                               ckpt.config["hidden_size"]):
        raise HeadFormatError(f"{weights_file}: embed_tokens.weight is {tuple(ckpt.embed.shape)}, the head's "
                              f"vocabulary and hidden size are ({ckpt.config['target_vocab_size']}, "
                              f"{ckpt.config['hidden_size']}); re-download the head")
    _vocab_map(ckpt.tensors, ckpt.config["target_vocab_size"], ckpt.config["draft_vocab_size"], weights_file)
    return ckpt


def _read_weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The directory's tensors: model.safetensors (or its index's shards), else pytorch_model.bin (or its shards),
    the latter through ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers."""
    from safetensors.torch import load_file

    from sacpolicy.runtime.weights import read_safetensors  # a truncated download: an error naming the file and the fix

    for name, load in ((WEIGHTS_FILE, lambda f: read_safetensors(f, load_file, HeadFormatError)),
                       (BIN_FILE, _load_bin)):
        file, index = path / name, path / f"{name}.index.json"
        if file.is_file():
            return file, load(file)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return index, {k: v for shard in shards for k, v in load(path / shard).items()}
    raise FileNotFoundError(f"{path} holds {CONFIG_FILE} but no weights ({WEIGHTS_FILE} or {BIN_FILE}, or an index of "
                            "their shards); download the head's weights into it")


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # an UnpicklingError naming the global it refused, or a corrupt file
        raise HeadFormatError(f"{file} is not a plain dict of tensors ({type(e).__name__}: {e}); sacpolicy reads "
                              ".bin checkpoints with torch.load(weights_only=True) only and never unpickles other "
                              "objects. Fix: convert it to model.safetensors where you trust the file") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HeadFormatError(f"{file} holds no flat dict of tensors; save the head's state_dict as model.safetensors")
    return state


def _detect(raw: dict, tensors: dict, config_file: Path) -> str:
    """Which format wrote this directory, from config.json's keys and the tensor names."""
    if "aux_layer_ids" in raw and "format" in raw:
        return SACPOLICY
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != "eagle3":
            raise HeadFormatError(f"{config_file} describes a speculators {kind!r} model; sacpolicy drafts with "
                                  "EAGLE-3 heads (speculators_model_type: eagle3) only")
        return SPECULATORS
    if "LlamaForCausalLMEagle3" in (raw.get("architectures") or []) or any(k.startswith("midlayer.") for k in tensors):
        return SPECFORGE if raw.get("eagle_config") else EAGLE
    raise HeadFormatError(
        f"{config_file} is no EAGLE-3 head sacpolicy knows: none of format + aux_layer_ids (sacpolicy), "
        "speculators_model_type (speculators / vLLM), architectures [LlamaForCausalLMEagle3] or midlayer.* tensors "
        f"(SpecForge / SGLang, EAGLE authors); tensors {sorted(tensors)[:6]}... Fix: a draft model (a causal LM "
        "sharing the target's tokenizer) is draft=model draft.draft.path=<dir>, not draft=feature")


def _layer_fields(c: dict, config_file: Path) -> dict:
    """The decoder layer's shape, rope and target vocabulary from a Llama-style config dict."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise HeadFormatError(f"{config_file} lacks {missing} of the head's decoder layer; re-download the head")
    bad = {k: c[k] for k in ("attention_bias", "mlp_bias") if c.get(k)}
    if int(c.get("num_hidden_layers", 1)) != 1 or bad:
        raise HeadFormatError(f"{config_file}: a head of {c.get('num_hidden_layers')} decoder layers {bad or ''}; "
                              "sacpolicy runs the one-layer EAGLE-3 head without biases. Fix: serve this head in "
                              "vLLM, or use a one-layer head")
    model_type = c.get("model_type", "llama")
    if model_type not in LAYER_TYPES:
        raise HeadFormatError(f"{config_file}: a {model_type!r} decoder layer; sacpolicy runs {sorted(LAYER_TYPES)} "
                              "EAGLE-3 layers (as vLLM does)")
    H, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    theta, scaling = _rope(c, config_file)
    return dict(hidden_size=H, intermediate_size=int(c["intermediate_size"]), num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or H // heads), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                target_vocab_size=int(c["vocab_size"]), hidden_act=str(c.get("hidden_act", "silu")),
                qk_norm=LAYER_TYPES[model_type])


def _rope(c: dict, config_file: Path) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling: the parameters besides theta with ``rope_type``, None when default) from a
    transformers 5 ``rope_parameters`` dict or a transformers 4 ``rope_theta`` + ``rope_scaling`` pair (defaults of
    LlamaConfig: theta 10000, no scaling)."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise HeadFormatError(f"{config_file}: rope parameters per layer type {sorted(params)}; sacpolicy's one "
                              "decoder layer takes one rope setting")
    theta = float(params.pop("rope_theta", None) or c.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return theta, ({"rope_type": kind, **params} if kind != "default" else None)


def _default_aux(target_layers: int | None, config_file: Path, key: str) -> list[int]:
    if target_layers is None:
        raise HeadFormatError(f"{config_file} does not say which target layers the head reads ({key}); load it with "
                              "its target (load_head(..., target=...)), whose layer count L gives the default "
                              "[2, L // 2, L - 3]")
    L = int(target_layers)
    return [2, L // 2, L - 3]


def _speculators_fields(raw: dict, config_file: Path, target_layers: int | None) -> dict:
    layer = raw["transformer_layer_config"]
    if "model_type" not in layer:
        raise HeadFormatError(f"{config_file}: transformer_layer_config has no model_type, which speculators reads as "
                              "qwen3 and vLLM as llama; add the verifier's (\"llama\" or \"qwen3\")")
    if "norm_before_residual" not in raw:
        raise HeadFormatError(f"{config_file} lacks norm_before_residual, which speculators reads as false and vLLM as "
                              "true; add the value the head was trained with")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(layer["hidden_size"]):
        raise HeadFormatError(f"{config_file}: target_hidden_size {target_hidden} differs from the head's "
                              f"{layer['hidden_size']}; sacpolicy runs heads as wide as their target")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    aux = sorted(int(i) for i in ids) if ids else _default_aux(target_layers, config_file,
                                                               "eagle_aux_hidden_state_layer_ids")
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    return dict(aux_layer_ids=aux, verifier=str(verifier), norm_before_residual=bool(raw["norm_before_residual"]),
                **{k: bool(raw.get(k, False)) for k in ("norm_before_fc", "fc_norm", "norm_output")})


def _eagle_fields(raw: dict, config_file: Path, target_layers: int | None) -> dict:
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise HeadFormatError(f"{config_file}: use_aux_hidden_state is false, an EAGLE-1/2 style head reading the last "
                              "hidden state only; sacpolicy runs EAGLE-3 heads")
    if raw.get("norm_output") is False:
        raise HeadFormatError(f"{config_file}: SpecForge's norm_output false (lm_head without the final norm) is not "
                              "supported; use a head trained with the default")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    # SGLang captures the input of layer id + 1 for a configured id (the output of layer id): ours is id + 1
    aux = sorted(int(i) + 1 for i in ids) if ids else _default_aux(target_layers, config_file,
                                                                   "eagle_config.eagle_aux_hidden_state_layer_ids")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(raw["hidden_size"]):
        raise HeadFormatError(f"{config_file}: target_hidden_size {target_hidden} differs from the head's "
                              f"{raw['hidden_size']}; sacpolicy runs heads as wide as their target")
    return dict(aux_layer_ids=aux, verifier="", norm_before_residual=bool(raw.get("norm_before_residual", False)),
                norm_before_fc=bool(eagle.get("norm_before_fc", raw.get("norm_before_fc", False))),
                fc_norm=bool(raw.get("fc_norm", False)), norm_output=False)


def _draft_vocab(raw: dict, tensors: dict, weights_file: Path) -> int:
    """The draft vocabulary size: lm_head's rows, which the config's draft_vocab_size must agree with."""
    if "lm_head.weight" not in tensors:
        raise HeadFormatError(f"{weights_file} has no lm_head.weight (the head's own output layer over its draft "
                              "vocabulary); re-download or re-export the head")
    rows, said = int(tensors["lm_head.weight"].shape[0]), raw.get("draft_vocab_size")
    if said is not None and int(said) != rows:
        raise HeadFormatError(f"{weights_file}: lm_head.weight has {rows} rows but draft_vocab_size is {said}; the "
                              "config belongs to another checkpoint")
    return rows


def _vocab_map(tensors: dict, V: int, Vd: int, weights_file: Path) -> None:
    """Fill ``d2t`` (offsets, draft ids increasing: lm_head's rows reordered if the file's were not) and ``t2d``
    [V] bool in ``tensors``, after checking them. d2t is read as offsets (every format's convention), else as
    absolute ids if only that reading gives Vd distinct ids in [0, V) agreeing with t2d."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if t2d is not None and tuple(t2d.shape) != (V,):
        raise HeadFormatError(f"{weights_file}: t2d has shape {tuple(t2d.shape)}, the target vocabulary is {V}")
    mask = None if t2d is None else t2d.bool()
    if d2t is None:
        if Vd != V:
            raise HeadFormatError(f"{weights_file} has no d2t but drafts over {Vd} of the target's {V} ids: a trimmed "
                                  "vocabulary needs its map (draft id -> target id); re-export the head with it")
        ids = torch.arange(V)
    else:
        if tuple(d2t.shape) != (Vd,):
            raise HeadFormatError(f"{weights_file}: d2t has shape {tuple(d2t.shape)}, lm_head drafts over {Vd} ids")
        d2t = d2t.long()
        ids = _draft_ids(d2t, mask, V)
        if ids is None:
            raise HeadFormatError(f"{weights_file}: d2t does not map the {Vd} draft ids onto distinct target ids in "
                                  f"[0, {V}){'' if mask is None else ' that t2d marks'}, read as offsets (target = "
                                  "draft + d2t[draft]: speculators, SpecForge, SGLang, EAGLE) or as absolute ids; "
                                  "the file is corrupt or belongs to another target")
    order = ids.argsort()
    if not torch.equal(order, torch.arange(Vd)):
        ids, tensors["lm_head.weight"] = ids[order], tensors["lm_head.weight"][order]
    tensors["d2t"] = ids - torch.arange(Vd)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)


def _draft_ids(d2t: torch.Tensor, mask: torch.Tensor | None, V: int) -> torch.Tensor | None:
    """The target ids of the draft vocabulary: d2t as offsets, else as absolute ids, else None."""
    def fits(ids):
        ok = ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < V and ids.unique().numel() == ids.numel())
        return ok and (mask is None or (int(mask.sum()) == ids.numel() and bool(mask[ids].all())))

    offsets = d2t + torch.arange(d2t.numel())
    if fits(offsets):
        return offsets
    if fits(d2t):
        log.info("d2t holds absolute target ids, not offsets: read as such")
        return d2t
    return None


def _same_model(name: str, target) -> bool:
    """Whether a head's recorded verifier names ``target``: its spec, or the same last path component (a hub id and a
    local copy of it) as its spec or its config's ``_name_or_path``, case aside."""
    def base(s: str) -> str:
        return str(s).rstrip("/").rsplit("/", 1)[-1].lower()

    names = {target.spec, getattr(target.model.config, "_name_or_path", "") or target.spec}
    return name in names or base(name) in {base(n) for n in names}


def check_target(config, target, where: str = "this head") -> None:
    """Raise ValueError naming every mismatch between a head's config (an ``Eagle3Config``) and ``target`` (a
    ``LoadedModel``): verifier name, hidden size, layer count, vocabulary (size; hash where recorded), aux layers."""
    tcfg = target.model.config
    L, problems = int(tcfg.num_hidden_layers), []
    if config.verifier and not _same_model(config.verifier, target):
        problems.append(f"verifier: trained for {config.verifier!r}, the target is {target.spec!r}")
    if config.hidden_size != tcfg.hidden_size:
        problems.append(f"hidden size: head {config.hidden_size}, target {tcfg.hidden_size}")
    if config.target_num_layers and config.target_num_layers != L:
        problems.append(f"decoder layers: head trained on {config.target_num_layers}, target has {L}")
    if config.target_vocab_size != tcfg.vocab_size:
        problems.append(f"vocabulary size: head {config.target_vocab_size}, target {tcfg.vocab_size}")
    if config.vocab_hash and config.vocab_hash != vocab_hash(target.tokenizer):
        problems.append(f"vocabulary hash: head {config.vocab_hash}, target {vocab_hash(target.tokenizer)}")
    aux = list(config.aux_layer_ids)
    if any(not 0 <= i < L for i in aux) or len(set(aux)) != len(aux):
        problems.append(f"aux layers: the head reads the inputs of decoder layers {aux}, the target has layers "
                        f"0..{L - 1}")
    if problems:
        raise ValueError(f"{where} belongs to another target:\n  - " + "\n  - ".join(problems)
                         + "\nFix: load the target it was trained for (draft.feature.path names the head, target= the "
                         "model), or use a head trained for this target.")
