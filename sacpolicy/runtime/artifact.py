"""Policy artifacts: a learned decision rule as a directory a production decoder loads with numpy alone.

    out/policy/
      policy.json            format_version, feature spec, predictor kind + meta (with ``fitted_temperature`` and
                             ``fitted_top_p``: the sampling settings of the traces it was fitted on), rule config,
                             cost model, drafter specs, provenance, metrics, sha256 checksums of every other file
      predictor.safetensors  the predictor's arrays (never a pickle)
      predictor.onnx         MLP predictors only, when ``onnx`` is installed (see ``_write_onnx``)

    save_policy("out/policy", rule, drafters={"draft": {"kind": "model", "path": "out/draft"}},
                provenance={"target": "embedded:smollm2-135m-instruct"}, metrics={"test/auc": 0.74})
    rule = load_policy("out/policy")  # a DecisionRule; load_artifact() also returns drafters, provenance, metrics

Saving builds the directory in a temporary sibling and renames it into place, so a reader sees the old artifact or
the new one, never a mix. Loading checks the format version, every checksum and the feature spec before it builds
anything, and refuses with an ``ArtifactError`` that names the problem and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from sacpolicy.runtime.cost import CostModel
from sacpolicy.runtime.features import feature_spec
from sacpolicy.runtime.predictors import Predictor
from sacpolicy.runtime.rule import DecisionRule
from sacpolicy.runtime.spec import DrafterSpec, SpecError

logger = logging.getLogger(__name__)

ARTIFACT_FORMAT = 1
POLICY_FILE, PREDICTOR_FILE, ONNX_FILE = "policy.json", "predictor.safetensors", "predictor.onnx"


class ArtifactError(ValueError):
    pass


@dataclass(frozen=True)
class PolicyArtifact:
    path: Path
    rule: DecisionRule
    drafters: dict[str, DrafterSpec]  # names and order follow rule.drafters
    provenance: dict
    metrics: dict
    manifest: dict  # the whole policy.json

    @property
    def fitted_sampling(self) -> dict | None:
        """{"temperature", "top_p"} of the traces the policy was fitted on (the pipeline's fit records them in the
        predictor's meta; ``LearnedPolicy`` warns when it decodes at others), or None when the artifact does not say
        (artifacts written before it did)."""
        meta = self.rule.predictor.meta
        if meta.get("fitted_temperature") is None:
            return None
        return {"temperature": float(meta["fitted_temperature"]), "top_p": float(meta.get("fitted_top_p", 1.0))}


# ---------------------------------------------------------------------- save
def save_policy(out_dir, rule: DecisionRule, *, drafters: dict[str, DrafterSpec | dict], provenance: dict,
                metrics: dict) -> Path:
    """Write ``rule`` as a policy artifact at ``out_dir`` (replacing an existing one only once the new one is
    complete). ``drafters``: how to rebuild each of the rule's drafters, e.g. ``{"kind": "model", "path": <draft
    dir or model spec>}``, ``{"kind": "ngram", "max_ngram": 3}``, ``{"kind": "layer_skip", "layers": 2}``."""
    out_dir = Path(out_dir)
    drafters = _check_drafters(rule, drafters)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        pred = rule.predictor
        save_file({k: np.ascontiguousarray(v) for k, v in pred.arrays.items()}, str(tmp / PREDICTOR_FILE))
        if pred.kind == "mlp":
            if find_spec("onnx") is not None:
                _write_onnx(pred, tmp / ONNX_FILE)
            else:
                logger.info("onnx is not installed: %s has no %s (the numpy runtime does not need it)",
                            out_dir, ONNX_FILE)
        manifest = {
            "format_version": ARTIFACT_FORMAT, "feature": feature_spec(),
            "predictor": {"kind": pred.kind, "meta": pred.meta}, "rule": rule.config(),
            "cost_model": rule.cost.to_dict(), "drafters": drafters,
            "provenance": _default_provenance() | dict(provenance), "metrics": dict(metrics),
            "checksums": {f.name: file_sha256(f) for f in sorted(tmp.iterdir())},
        }
        try:
            text = json.dumps(manifest, indent=2, default=_plain)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"cannot write {out_dir / POLICY_FILE}: {e}. Pass provenance and metrics as plain "
                                "JSON data (numbers, strings, lists, dicts)") from e
        (tmp / POLICY_FILE).write_text(text)
        old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("saved policy artifact to %s", out_dir)
    return out_dir


def _check_drafters(rule: DecisionRule, drafters: dict[str, DrafterSpec | dict]) -> dict[str, dict]:
    """The specs' JSON form, one per drafter of the rule, local paths made absolute."""
    if set(drafters) != set(rule.drafters):
        raise ArtifactError(f"drafter specs name {sorted(drafters)} but the rule was trained on {list(rule.drafters)}; "
                            "pass exactly one spec per drafter of the rule")
    return {name: _spec(name, drafters[name]).resolved().to_dict() for name in rule.drafters}


def _spec(name: str, spec: DrafterSpec | dict) -> DrafterSpec:
    if isinstance(spec, DrafterSpec):
        return spec
    try:
        return DrafterSpec.from_dict(name, spec)
    except SpecError as exc:
        raise ArtifactError(str(exc)) from None


def _default_provenance() -> dict:
    from sacpolicy import __version__

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sacpolicy": __version__,
            "git_commit": commit, "command": " ".join(sys.argv)}


def _plain(o):
    if isinstance(o, (np.generic, np.ndarray)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} {o!r} is not JSON-serializable")


def file_sha256(path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks (artifact checksums, shipped heads)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_onnx(pred: Predictor, path: Path) -> None:
    """The MLP as an ONNX graph: input ``features`` [n, F] float64 (raw feature rows), output ``p_raw`` [n, 1], the
    *uncalibrated* acceptance probability. It standardizes like the runtime ((x - mean) / scale, then NaN and +-inf
    to 0); the isotonic calibration map stays in predictor.safetensors (``calib_x``/``calib_y``: apply it with a
    linear interpolation, as ``Predictor.predict`` does)."""
    from onnx import TensorProto, helper, numpy_helper, save

    a = pred.arrays
    inits = [numpy_helper.from_array(np.asarray(a[k], np.float64), k) for k in ("mean", "scale")]
    inits.append(numpy_helper.from_array(np.zeros((), np.float64), "zero"))
    nodes = [helper.make_node("Sub", ["features", "mean"], ["centered"]),
             helper.make_node("Div", ["centered", "scale"], ["z"]),
             helper.make_node("IsNaN", ["z"], ["z_nan"]), helper.make_node("IsInf", ["z"], ["z_inf"]),
             helper.make_node("Or", ["z_nan", "z_inf"], ["z_bad"]),
             helper.make_node("Where", ["z_bad", "zero", "z"], ["h0"])]
    layers, h = sum(1 for k in a if k.startswith("w")), "h0"
    for i in range(layers):
        inits += [numpy_helper.from_array(np.asarray(a[f"w{i}"], np.float64), f"w{i}"),
                  numpy_helper.from_array(np.asarray(a[f"b{i}"], np.float64), f"b{i}")]
        out = "logit" if i == layers - 1 else f"pre{i + 1}"
        nodes.append(helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [out], transB=1))  # h @ w.T + b
        if i < layers - 1:
            h = f"h{i + 1}"
            nodes.append(helper.make_node("Relu", [out], [h]))
    nodes.append(helper.make_node("Sigmoid", ["logit"], ["p_raw"]))
    n_features = len(a["mean"])
    graph = helper.make_graph(
        nodes, "sacpolicy_acceptance_mlp",
        [helper.make_tensor_value_info("features", TensorProto.DOUBLE, ["n", n_features])],
        [helper.make_tensor_value_info("p_raw", TensorProto.DOUBLE, ["n", 1])], inits)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


# ---------------------------------------------------------------------- load
def load_artifact(path) -> PolicyArtifact:
    """Verify and load a policy artifact; raises ``ArtifactError`` before building anything if it is unreadable,
    from another format version, modified, or computed on another feature spec."""
    path = Path(path)
    manifest_path = path / POLICY_FILE
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} is not a policy artifact: {POLICY_FILE} is missing. Export one with "
                            "sacpolicy.runtime.save_policy (or scripts/export.py format=runtime)")
    try:
        m = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({e}); the artifact was modified or truncated; "
                            "re-export it") from e
    version = m.get("format_version") if isinstance(m, dict) else None
    if version != ARTIFACT_FORMAT:
        fix = ("upgrade sacpolicy" if isinstance(version, int) and version > ARTIFACT_FORMAT
               else "re-export the policy with this sacpolicy")
        raise ArtifactError(f"{path} has artifact format version {version!r}; this runtime reads format version "
                            f"{ARTIFACT_FORMAT}. Fix: {fix}")
    try:
        checksums = dict(m["checksums"])
        if PREDICTOR_FILE not in checksums:
            raise ArtifactError(f"{manifest_path} lists no checksum for {PREDICTOR_FILE}; re-export the artifact")
        for name, digest in checksums.items():
            f = path / name
            if not f.is_file():
                raise ArtifactError(f"{path} lacks {name}, which {POLICY_FILE} lists; the artifact is incomplete; "
                                    "re-export it")
            if file_sha256(f) != digest:
                raise ArtifactError(f"checksum mismatch for {f}: the artifact was modified or truncated; re-export it")
        if m["feature"] != feature_spec():
            raise ArtifactError(
                f"{path} was trained on feature spec version {m['feature'].get('version')!r} ({m['feature']}), but "
                f"this runtime computes version {feature_spec()['version']} ({feature_spec()}); use the sacpolicy "
                "version that trained it, or retrain and re-export the policy")
        arrays = load_file(str(path / PREDICTOR_FILE))
        r = m["rule"]
        rule = DecisionRule(Predictor(m["predictor"]["kind"], arrays, m["predictor"]["meta"]),
                            CostModel.from_dict(m["cost_model"], source=str(manifest_path)), tuple(r["drafters"]),
                            int(r["k_max"]), (r["fallback"]["drafter"], r["fallback"]["k"]), r["mode"],
                            float(r["optimism"]), online=r.get("online"))
        drafters = {name: _spec(name, m["drafters"][name]) for name in rule.drafters}
    except ArtifactError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # PredictorError, RuleError: ValueErrors
        raise ArtifactError(f"{path} is not a valid policy artifact ({type(e).__name__}: {e}); re-export it") from e
    return PolicyArtifact(path, rule, drafters, dict(m.get("provenance", {})), dict(m.get("metrics", {})), m)


def load_policy(path) -> DecisionRule:
    """The decision rule of the artifact at ``path`` (see ``load_artifact``)."""
    return load_artifact(path).rule
