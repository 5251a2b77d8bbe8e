"""EAGLE-3 heads that ship with sacpolicy, one per embedded target, each a head directory (``model.safetensors``,
``config.json``, ``provenance.json``) whose provenance records how it was trained (command, settings, data recipe,
seed, curve) and the SHA-256 of its weights.

    path = shipped_head("embedded:smollm2-135m-instruct")    # verified against its provenance, or an error

``head.init_from=shipped`` (the pipeline's default) warm-starts the ``head`` stage from the head shipped for the
run's target; ``head.init_from=null`` trains from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path

from sacpolicy.runtime.artifact import file_sha256

HERE = Path(__file__).resolve().parent
SHIPPED = {"embedded:smollm2-135m-instruct": "smollm2-135m-instruct-eagle3"}  # target spec -> directory name


class ShippedHeadError(ValueError):
    pass


def verify(path) -> dict:
    """The provenance of the head directory ``path`` after checking that its weights are the ones it records."""
    path = Path(path)
    prov_file, weights = path / "provenance.json", path / "model.safetensors"
    if not prov_file.is_file() or not weights.is_file():
        raise ShippedHeadError(f"{path} lacks provenance.json or model.safetensors; reinstall sacpolicy (pip install "
                               "-e .) or train a head with head.init_from=null")
    provenance = json.loads(prov_file.read_text())
    actual = file_sha256(weights)
    if provenance.get("sha256") != actual:
        raise ShippedHeadError(f"{weights} has SHA-256 {actual} but its provenance records "
                               f"{provenance.get('sha256')}: the file is corrupt or was replaced (a Git LFS pointer?). "
                               "Fix: restore it from git (git checkout -- sacpolicy/heads) or set head.init_from=null")
    return provenance


def shipped_head(target_spec: str) -> Path:
    """The verified directory of the head shipped for ``target_spec``."""
    if target_spec not in SHIPPED:
        raise ShippedHeadError(f"no EAGLE-3 head ships for target {target_spec!r} (only for {sorted(SHIPPED)}); "
                               "set head.init_from=null to train one from scratch, or to a head directory")
    path = HERE / SHIPPED[target_spec]
    verify(path)
    return path
