"""GGUF files dequantized once into a cached Hugging Face directory (safetensors), keyed by the file and transformers'
major version; written atomically, so an interrupted conversion is never reused."""

from __future__ import annotations

import copy
import functools
import hashlib
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
from transformers import AutoModelForCausalLM, AutoTokenizer

from sacpolicy.models.cache import EMBEDDED_TARGET, ModelSpecError, cache_root

log = logging.getLogger(__name__)

# Bump when the cached directory layout or conversion changes, so old caches are not reused. 2: the tokenizer adds
# the special tokens the GGUF says it adds (_gguf_special_tokens)
_CACHE_FORMAT = 2
# Written last into a finished cache dir; a dir without it is never trusted.
_CACHE_MARKER = "sacpolicy-cache.json"
_GGUF_MAGIC = b"GGUF"


def gguf_cache_dir(gguf_path: pathlib.Path, name: str | None = None) -> pathlib.Path:
    """The cache directory a GGUF file converts into. The key is the file's content (and transformers' major version),
    not its path or mtime: every fresh install of the same package shares one conversion instead of adding ~500 MB."""
    st = gguf_path.stat()
    digest = _content_digest(str(gguf_path.resolve()), st.st_size, st.st_mtime_ns)
    h = hashlib.sha256(f"{_CACHE_FORMAT}|{transformers.__version__.split('.')[0]}|{digest}".encode())
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name or gguf_path.stem).strip("-").lower() or "model"
    return cache_root() / "models" / f"{slug}-{h.hexdigest()[:12]}"


@functools.lru_cache(maxsize=32)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """blake2b of the whole file (~0.1 s for 100 MB), once per process per (path, size, mtime)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


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
    _gguf_special_tokens(tokenizer, gguf_path)
    tokenizer.save_pretrained(out_dir)


def _gguf_special_tokens(tokenizer, gguf_path: pathlib.Path) -> None:
    """Make ``tokenizer`` add BOS / EOS to encoded text where the GGUF's ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token`` say the model expects them. transformers' GGUF reader drops these flags for some architectures
    (Gemma 3: its tokenizer then encodes text without ``<bos>``, and the model, which always saw it first, answers a
    plain prompt with nonsense); a chat template writes its own BOS, so only the plain prompt format showed it."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    for flag in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is not None and hasattr(tokenizer, flag):
            wanted = bool(field.parts[field.data[0]][0])
            if bool(getattr(tokenizer, flag)) != wanted:
                setattr(tokenizer, flag, wanted)
