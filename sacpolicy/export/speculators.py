"""An EAGLE-3 head (our checkpoint directory, ``sacpolicy.decoding.eagle3``) in the serving engines' formats.

    export_speculators("runs/eagle3/head", "out/spec", verifier_path="HuggingFaceTB/SmolLM2-135M-Instruct", 3)
    export_head_for("runs/eagle3/head", "out/spec", target="Qwen/Qwen2.5-7B-Instruct")  # any model spec, checked
    #  vllm serve <verifier> --speculative-config '{"model": "out/spec", "num_speculative_tokens": 3}'
    export_sglang("runs/eagle3/head", "out/sglang")
    #  python -m sglang.launch_server --model <verifier> --speculative-algorithm EAGLE3 \
    #      --speculative-draft-model-path out/sglang

vLLM reads the speculators format (``speculators_model_type: "eagle3"``): the tensors keep our (= speculators')
names, ``fc.weight``, ``layers.0.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets: target = draft +
d2t[draft]), ``t2d`` [V] bool. SGLang reads SpecForge's layout: ``architectures: ["LlamaForCausalLMEagle3"]``, the
decoder layer as ``midlayer.*``, and aux layer ids in its own convention (id i captures the OUTPUT of layer i, the
input of layer i + 1, so ours minus one). Neither file holds the token embedding: both engines share the target's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from sacpolicy.decoding.eagle3 import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
)
from sacpolicy.decoding.eagle3_formats import check_target
from sacpolicy.io import write_dir, write_json

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose Eagle3SpeculatorConfig this layout follows


def _read_config(head_dir) -> Eagle3Config:
    head_dir = Path(head_dir)
    if not (head_dir / CONFIG_FILE).is_file() or not (head_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{head_dir} is not an EAGLE-3 head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    return Eagle3Config.from_dict(json.loads((head_dir / CONFIG_FILE).read_text()))


def _read_head(head_dir) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    return _in_layer_order(_read_config(head_dir), load_file(str(Path(head_dir) / WEIGHTS_FILE)))


def _in_layer_order(config: Eagle3Config, tensors: dict) -> tuple[Eagle3Config, dict]:
    """The head with its aux layers in increasing order, the order vLLM and SGLang concatenate them in (they capture
    layer by layer, whatever order the config lists): fc's column blocks and the per-aux norms permuted to match."""
    ids = list(config.aux_layer_ids)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == list(range(len(ids))):
        return config, tensors
    tensors = dict(tensors)
    for name in ("fc.weight", "input_norm.weight"):
        if name in tensors:
            blocks = tensors[name].chunk(len(ids), dim=-1)
            tensors[name] = torch.cat([blocks[i] for i in order], dim=-1)
    if config.fc_norm:
        old = {i: tensors[f"fc_norm.{i}.weight"] for i in range(len(ids))}
        tensors.update({f"fc_norm.{j}.weight": old[i] for j, i in enumerate(order)})
    return dataclasses.replace(config, aux_layer_ids=sorted(ids)), tensors


def _legacy_rope(config: Eagle3Config) -> dict:
    """rope_theta / rope_scaling as transformers 4 configs (and engines reading them) expect them."""
    out = {"rope_theta": config.rope_theta}
    if config.rope_scaling:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


def _write_dir(out_dir, config: dict, tensors: dict, head_dir) -> Path:
    """config.json + model.safetensors (+ our provenance), written to a temporary sibling and renamed."""
    def fill(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        if (Path(head_dir) / PROVENANCE_FILE).is_file():
            shutil.copy(Path(head_dir) / PROVENANCE_FILE, tmp / "sacpolicy_provenance.json")

    return write_dir(out_dir, fill)


def _cast(tensors: dict, dtype: torch.dtype | None) -> dict:
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in tensors.items()}


def _verifier_architectures(verifier_path: str) -> list[str]:
    path = Path(verifier_path) / "config.json"
    if path.is_file():
        return list(json.loads(path.read_text()).get("architectures") or [])
    return ["LlamaForCausalLM"]


def speculators_config(config: Eagle3Config, verifier_path: str, num_speculative_tokens: int,
                       dtype: torch.dtype = torch.float32, architectures: list[str] | None = None) -> dict:
    """The config.json of speculators' ``Eagle3SpeculatorConfig`` (every field written explicitly: vLLM defaults a
    missing ``norm_before_residual`` to True, speculators to False). ``architectures``: the verifier's (default: read
    from its directory's config.json, Llama where there is none)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if config.qk_norm:
        raise ValueError("this head runs a Qwen3 decoder layer (qk_norm); the speculators export writes Llama layers "
                         "only: serve the head from the directory it was published in")
    layer = config.layer_config().to_diff_dict()
    layer.update(_legacy_rope(config))
    layer.update({"architectures": ["LlamaForCausalLM"], "dtype": str(dtype).removeprefix("torch.")})
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_path),
                         "architectures": architectures or _verifier_architectures(verifier_path)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": None,  # the head's hidden size is the target's
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_residual": config.norm_before_residual,  # False: residual = the un-normed hidden part
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,  # False: the chain feeds back the pre-norm hidden state
        "embed_requires_grad": False,
        "dtype": str(dtype).removeprefix("torch."),
    }


def export_speculators(head_dir, out_dir, verifier_path: str, num_speculative_tokens: int = 3,
                       dtype: torch.dtype | None = None, architectures: list[str] | None = None) -> Path:
    """Write the head in the vLLM speculators format (``config.json`` + ``model.safetensors``). ``verifier_path``: the
    target's hub id or HF directory (speculators loads the embedding from it; vLLM serves it as the target), written
    as given: ``export_head_for`` takes any model spec and checks the head against it first."""
    config, tensors = _read_head(head_dir)
    if config.draft_vocab_size == config.target_vocab_size:  # speculators keeps no vocabulary map then
        tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    tensors = _cast(tensors, dtype)
    saved = dtype or tensors["fc.weight"].dtype
    return _write_dir(out_dir, speculators_config(config, verifier_path, num_speculative_tokens, saved,
                                                  architectures), tensors, head_dir)


def head_target(head_dir) -> str:
    """The model spec the head at ``head_dir`` was trained for (its config's ``verifier``), else the embedded target."""
    from sacpolicy.models import EMBEDDED_TARGET

    return _read_config(head_dir).verifier or EMBEDDED_TARGET


def export_head_for(head_dir, out_dir, target: str | None = None, num_speculative_tokens: int = 3,
                    dtype: torch.dtype | None = None) -> Path:
    """The head at ``head_dir`` in the speculators format for ``target``: any model spec (embedded, ``.gguf``,
    directory, hub id; default ``head_target``, the one it was trained for). The head is first checked against the
    target's config and tokenizer (``check_target``; no weights are loaded), and the export names, as its verifier,
    what vLLM loads for the target (``served_model``: its directory or hub id) and the target's architectures."""
    from transformers import AutoConfig

    from sacpolicy.models import load_tokenizer, served_model

    target = target or head_target(head_dir)
    served = served_model(target)
    target_config = AutoConfig.from_pretrained(served)
    # check_target reads a LoadedModel's spec, tokenizer and model.config: the same without the weights
    view = SimpleNamespace(spec=target, tokenizer=load_tokenizer(target), model=SimpleNamespace(config=target_config))
    check_target(_read_config(head_dir), view, where=f"the head at {head_dir}")
    return export_speculators(head_dir, out_dir, served, num_speculative_tokens, dtype=dtype,
                              architectures=list(target_config.architectures or []) or None)


def export_shipped_head(out_dir, verifier_path: str, num_speculative_tokens: int = 3,
                        target: str | None = None) -> Path:
    """The EAGLE-3 head shipped for ``target`` (default: the embedded target, the one head that ships) in the
    speculators format at ``out_dir``, in float32 (what vLLM runs on a CPU): ``export_speculators`` of
    ``sacpolicy.heads.shipped_head``."""
    from sacpolicy.heads import shipped_head
    from sacpolicy.models import EMBEDDED_TARGET

    return export_speculators(shipped_head(target or EMBEDDED_TARGET), out_dir, verifier_path, num_speculative_tokens,
                              dtype=torch.float32)


def sglang_config(config: Eagle3Config, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json SGLang's ``LlamaForCausalLMEagle3`` (as SpecForge exports it) reads."""
    if len(config.aux_layer_ids) != 3 or min(config.aux_layer_ids) < 1:
        raise ValueError(f"SGLang's EAGLE-3 reads exactly 3 aux layers, each the output of a decoder layer (ids >= 1 "
                         f"here); this head reads {config.aux_layer_ids}: train it with 3 aux layers >= 1")
    variants = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "qk_norm")
                if getattr(config, k)]
    if variants:
        raise ValueError(f"SGLang's LlamaForCausalLMEagle3 runs the plain EAGLE-3 layer; this head sets {variants}: "
                         "export it with format=speculators for vLLM instead")
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})},
        **_legacy_rope(config),
        "vocab_size": config.target_vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
        "pad_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # SGLang captures layer id + 1's input for configured ids: ours (inputs of layer i) minus one
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids],
                         "use_aux_hidden_state": True},
    }


def export_sglang(head_dir, out_dir, dtype: torch.dtype | None = None) -> Path:
    """Write the head in SGLang's EAGLE-3 layout (SpecForge's ``to_sglang``): ``midlayer.*`` names, d2t/t2d kept."""
    config, tensors = _read_head(head_dir)
    tensors = _cast({("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                     for k, v in tensors.items()}, dtype)
    return _write_dir(out_dir, sglang_config(config, dtype or tensors["fc.weight"].dtype), tensors, head_dir)
