"""Load a target or draft model from one spec string.

    from sacpolicy.models import load_model
    target = load_model("embedded:smollm2-135m-instruct", device="auto", dtype="auto")
    draft = load_model("tiny:llama-1l", seed=1)

Accepted specs (see `load_model`): `embedded:<name>` (``models.embedded``: SmolLM2-135M-Instruct, Gemma 3 270M),
`tiny:<preset>`, a `.gguf` path, a local Hugging Face model directory, or a hub id `org/name`.

GGUF files are dequantized once by transformers (~20 s) and the result is cached as a plain safetensors directory
under `cache_root()/models/`, so every later load is a normal `from_pretrained` of that directory.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sacpolicy.runtime.weights import safetensors_damage
from sacpolicy.models.cache import (  # noqa: F401 (part of this module's API)
    EMBEDDED_TARGET,
    ModelSpecError,
    TokenizerMismatchError,
    cache_root,
)
from sacpolicy.models.embedded import EMBEDDED_MODELS, embedded_gguf
from sacpolicy.models.gguf import ensure_gguf_converted

log = logging.getLogger(__name__)

# Tiny random-init models share the embedded SmolLM2 tokenizer, so their ids (bos 1, eos 2, pad 2) and vocab match.
_TINY_BASE = dict(
    vocab_size=49152,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_PRESETS: dict[str, dict] = {
    "llama-4l": {**_TINY_BASE, "num_hidden_layers": 4},
    "llama-1l": {**_TINY_BASE, "num_hidden_layers": 1},
    # other families (``model_type``; default llama), sliding windows of 8 tokens: tests' prompts outgrow them
    "gemma3-2l": {**_TINY_BASE, "model_type": "gemma3_text", "num_hidden_layers": 2, "head_dim": 16,
                  "query_pre_attn_scalar": 16, "sliding_window": 8, "layer_types": ["sliding_attention",
                                                                                    "full_attention"]},
    "qwen2-2l": {**_TINY_BASE, "model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": True,
                 "sliding_window": 8, "max_window_layers": 1},  # layer 0 full, layer 1 sliding
    "qwen3-2l": {**_TINY_BASE, "model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 16},
    "mistral-2l": {**_TINY_BASE, "model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8},
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclasses.dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(getattr(self.model, "generation_config", None), self.tokenizer)


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    """The ids ``generate()`` stops on: any in ``generation_config`` (chat models often list several; None: none),
    plus the tokenizer's eos."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    candidates = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    ids: list[int] = []
    for i in [*candidates, tokenizer.eos_token_id]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: CUDA when present, else CPU. A CUDA device without an index is this rank's GPU
    (``cuda:$LOCAL_RANK`` under torchrun or Lightning's DDP launcher: ``sacpolicy.ranks.local_device``)."""
    from sacpolicy.ranks import local_device

    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return local_device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """Map a dtype name to torch. "auto": bfloat16 on CUDA (fast, range-safe), float32 elsewhere (CPU bf16 is slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if resolve_device(device or "auto").type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}. Use 'auto' or one of: {', '.join(_DTYPES)}.") from None


def load_model(
    spec: str = EMBEDDED_TARGET,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load model and tokenizer for `spec`, moved to `device`/`dtype`, in eval mode.

    `seed` only matters for `tiny:` presets (their weights are random); the global RNG state is left untouched.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    kind, arg = _parse_spec(spec)
    if kind == "tiny":
        model = _build_tiny(arg, seed)
        tokenizer = load_tokenizer(EMBEDDED_TARGET)
    elif kind == "hub":
        model = _from_hub(AutoModelForCausalLM, arg, dtype=dtype, trust_remote_code=trust_remote_code)
        tokenizer = _from_hub(AutoTokenizer, arg, trust_remote_code=trust_remote_code)
    else:
        model_dir = _local_model_dir(kind, arg)
        model = _from_dir(AutoModelForCausalLM, model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        tokenizer = _from_dir(AutoTokenizer, model_dir, trust_remote_code=trust_remote_code)
    model.to(device=device, dtype=dtype)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec)


def load_tokenizer(spec: str = EMBEDDED_TARGET) -> PreTrainedTokenizerBase:
    """Load only the tokenizer for `spec` (tiny presets use the embedded target's tokenizer)."""
    kind, arg = _parse_spec(spec)
    if kind == "tiny":
        return load_tokenizer(EMBEDDED_TARGET)
    if kind == "hub":
        return _from_hub(AutoTokenizer, arg)
    return _from_dir(AutoTokenizer, _local_model_dir(kind, arg))


def check_tokenizers_compatible(
    target_tok: PreTrainedTokenizerBase,
    draft_tok: PreTrainedTokenizerBase,
    *,
    target_name: str = "target",
    draft_name: str = "draft",
    prefix: bool = False,
) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map the same ids to the same tokens and share eos.
    ``prefix``: the draft's tokenizer may hold fewer ids than the target's, when each id it holds is the target's (a
    draft with a smaller vocabulary, whose logits are padded to the target's)."""
    a, b = _id_to_token(target_tok), _id_to_token(draft_tok)
    problems = []
    if prefix and len(draft_tok) <= len(target_tok) and len(b) <= len(a):
        a = a[: len(b)]  # the target's ids past the draft's are the target's alone
    elif len(target_tok) != len(draft_tok):
        problems.append(f"vocab size: {target_name} has {len(target_tok)}, {draft_name} has {len(draft_tok)}")
    if a != b:
        width = max(len(a), len(b))
        diffs = [i for i in range(width) if _token_at(a, i) != _token_at(b, i)]
        i = diffs[0]
        problems.append(
            f"token id {i}: {target_name} {_describe(a, i)}, {draft_name} {_describe(b, i)} "
            f"({len(diffs)} id(s) differ in total)"
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        problems.append(
            f"eos token: {target_name} has {target_tok.eos_token!r} (id {target_tok.eos_token_id}), "
            f"{draft_name} has {draft_tok.eos_token!r} (id {draft_tok.eos_token_id})"
        )
    if problems:
        raise TokenizerMismatchError(
            f"The {target_name} and {draft_name} tokenizers differ:\n  - "
            + "\n  - ".join(problems)
            + "\nSpeculative decoding needs the draft to use exactly the target's tokenizer (same token ids). "
            f"Fix: pick a {draft_name} from the same model family as the {target_name}, "
            "or use the n-gram / layer-skip drafters, which reuse the target's tokenizer."
        )


# --- spec parsing ------------------------------------------------------------------------------------------------


def _accepted_kinds() -> str:
    return (
        "Accepted model specs:\n"
        f"  embedded:<name>  weights shipped in a pip package; names: {', '.join(sorted(EMBEDDED_MODELS))}\n"
        f"  tiny:<preset>    random-init test model; presets: {', '.join(sorted(TINY_PRESETS))}\n"
        f"  <path>.gguf      a GGUF file (dequantized once, cached under {cache_root() / 'models'})\n"
        "  <directory>      a local Hugging Face model directory containing config.json\n"
        "  <org>/<name>     a Hugging Face hub id (needs network or a populated HF_HOME cache)"
    )


def _parse_spec(spec: str) -> tuple[str, str]:
    """Classify `spec` as (kind, argument), kind one of embedded, tiny, gguf, dir, hub."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"Empty model spec {spec!r}.\n{_accepted_kinds()}\nFix: pass e.g. {EMBEDDED_TARGET!r}.")
    for kind, known, example in (("embedded", EMBEDDED_MODELS, EMBEDDED_TARGET), ("tiny", TINY_PRESETS, "tiny:llama-4l")):
        if spec.startswith(f"{kind}:"):
            name = spec.removeprefix(f"{kind}:")
            if name not in known:
                raise ModelSpecError(f"Unknown {kind} model {name!r} in spec {spec!r}. Known {kind} names: "
                                     f"{', '.join(sorted(known))}. Fix: use e.g. {example!r}.")
            return kind, name
    path = pathlib.Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return "gguf", str(path)
    if path.is_dir():
        return "dir", str(path)
    if _HUB_ID.match(spec):
        return "hub", spec
    raise ModelSpecError(f"Unrecognised model spec {spec!r}.\n{_accepted_kinds()}\nFix: pass one of these kinds.")


def model_dir(spec: str = EMBEDDED_TARGET) -> pathlib.Path:
    """The Hugging Face directory behind an embedded, ``.gguf`` or directory spec (converting a GGUF once), for
    engines that load a directory themselves (vLLM, speculators)."""
    kind, arg = _parse_spec(spec)
    if kind not in ("embedded", "gguf", "dir"):
        raise ModelSpecError(f"{spec!r} is a {kind} spec; model_dir needs an embedded, .gguf or directory spec "
                             "(a hub id is the engine's own to download)")
    return _local_model_dir(kind, arg)


def served_model(spec: str = EMBEDDED_TARGET) -> str:
    """What an engine that loads the model itself (vLLM; the verifier a speculators export names) is given for
    ``spec``: its local Hugging Face directory (embedded, ``.gguf`` converted once, a directory), or a hub id as it is
    (the engine downloads it, or reads the Hugging Face cache)."""
    kind, arg = _parse_spec(spec)
    if kind == "hub":
        return arg
    if kind == "tiny":
        raise ModelSpecError(f"{spec!r} is a random-init test model with no weights on disk, so an engine cannot load "
                             f"it. Fix: pass a model it can load: {EMBEDDED_TARGET!r}, a .gguf file, a Hugging Face "
                             "directory or a hub id")
    return str(_local_model_dir(kind, arg))


def _local_model_dir(kind: str, arg: str) -> pathlib.Path:
    """A directory `from_pretrained` can read for an embedded, gguf or dir spec (converting GGUF if needed)."""
    if kind == "embedded":
        return ensure_gguf_converted(embedded_gguf(arg), name=arg)
    if kind == "gguf":
        return ensure_gguf_converted(pathlib.Path(arg))
    model_dir = pathlib.Path(arg)
    if not (model_dir / "config.json").is_file():
        raise ModelSpecError(
            f"Directory {model_dir} has no config.json, so it is not a Hugging Face model directory. "
            "Fix: point at the directory that holds config.json (and the weights), or pass a .gguf file."
        )
    return model_dir


# --- other spec kinds --------------------------------------------------------------------------------------------


def _build_tiny(preset: str, seed: int) -> PreTrainedModel:
    kwargs = dict(TINY_PRESETS[preset])
    config = AutoConfig.for_model(kwargs.pop("model_type", "llama"), **kwargs)
    # fork_rng restores the caller's CPU RNG afterwards, so loading a model never perturbs sampling elsewhere.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def _from_dir(auto_cls, model_dir: pathlib.Path, **kwargs):
    """``from_pretrained`` of a local directory; when it fails, an error naming the fix: a truncated or corrupt weights
    file by name (a download or copy cut short; transformers passes on safetensors' own "incomplete metadata")."""
    try:
        return auto_cls.from_pretrained(model_dir, **kwargs)
    except Exception as e:
        damaged = [d for f in sorted(model_dir.glob("*.safetensors")) if (d := safetensors_damage(f)) is not None]
        if damaged:
            raise ModelSpecError(f"Could not load {auto_cls.__name__} from {model_dir}: " + "; ".join(damaged)) from e
        raise ModelSpecError(
            f"Could not load {auto_cls.__name__} from {model_dir}: {e}. Fix: check the directory is a complete "
            "Hugging Face model (config.json, weights, tokenizer files); if it is a sacpolicy cache dir, delete it "
            "to force re-conversion."
        ) from e


def _from_hub(auto_cls, repo_id: str, **kwargs):
    try:
        return auto_cls.from_pretrained(repo_id, **kwargs)
    except Exception as e:
        raise ModelSpecError(
            f"Could not load {repo_id!r} as a Hugging Face hub id ({type(e).__name__}: {e}). There may be no network "
            f"here, or no such repository. Fix: pass a local model directory or .gguf file, use {EMBEDDED_TARGET!r}, "
            "or pre-populate the HF cache (HF_HOME) on a machine with network access. If you meant a local "
            f"directory, {pathlib.Path(repo_id).resolve()} does not exist."
        ) from e


def _id_to_token(tok: PreTrainedTokenizerBase) -> list[str | None]:
    vocab = tok.get_vocab()
    table: list[str | None] = [None] * max(len(tok), max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = token
    return table


def _token_at(table: list[str | None], i: int) -> str | None:
    return table[i] if i < len(table) else None


def _describe(table: list[str | None], i: int) -> str:
    token = _token_at(table, i)
    return "lacks it" if token is None else f"has {token!r}"
