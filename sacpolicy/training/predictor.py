"""Acceptance predictors trained on traces: examples and labels, scikit-learn and Lightning models, held-out metrics,
and the tuning that turns a predictor into a ``DecisionRule``.

Examples come from replaying teacher-forced traces through the real decoder loop (``traces.simulate``) with a
recording policy that drafts ``k`` tokens per block, so every feature is computed by the shared feature function
exactly as live decoding computes it. A drafted position is an example when everything before it in its block was
accepted (later positions never matter); its label is whether it was accepted (greedy traces) or its acceptance
probability (sampled traces: beta, ``traces.draws.accept_probs``). Each example appears in three forms: confidence
known (the stop rule), confidence unknown with the previous token's confidence known (the stop rule's look-ahead) and
both unknown (planning k and the drafter), so one predictor serves every decision. Splits follow the prompt-id split
of the data module.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sacpolicy.data import assign_split
from sacpolicy.policy.base import Decision, DraftToken, PolicyRow
from sacpolicy.policy.features import feature_spec, token_features
from sacpolicy.policy.baselines import Static
from sacpolicy.runtime.features import FEATURE_NAMES
from sacpolicy.runtime.predictors import Predictor, PredictorError
from sacpolicy.traces.simulate import confidence

logger = logging.getLogger(__name__)

FORMS = ("known", "next", "plan")  # confidence known / unknown but previous known / both unknown


@dataclass
class Examples:
    X: np.ndarray  # [n, F] features
    y: np.ndarray  # [n] label: accepted (0/1) or beta
    prompt_id: np.ndarray
    drafter: np.ndarray
    position: np.ndarray
    form: np.ndarray
    split: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def take(self, mask) -> Examples:
        return Examples(*(getattr(self, f.name)[mask] for f in dataclasses.fields(self)))

    def of(self, split: str, form: str | None = None) -> Examples:
        mask = self.split == split
        return self.take(mask if form is None else mask & (self.form == form))

    def classifier_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(X, y, weight) for a binary classifier: a soft label b becomes a positive of weight b and a negative of
        weight 1 - b (the same expected log-loss)."""
        soft = (self.y > 0) & (self.y < 1)
        if not soft.any():
            return self.X, self.y.astype(int), np.ones(len(self.y))
        X = np.concatenate([self.X, self.X])
        y = np.concatenate([np.ones(len(self.y), int), np.zeros(len(self.y), int)])
        return X, y, np.concatenate([self.y, 1.0 - self.y])


class _Recorder(Static):
    """Drafts k tokens a block with one drafter and records each relevant drafted position's features and label."""

    uses_peeks = True  # features before drafting see what the learned policy will see

    def __init__(self, k: int, drafter: str, soft: bool):
        super().__init__(k, drafter)
        self.soft, self.current, self.rows = soft, None, []

    def start(self, request) -> dict:
        return {}  # "snap": the state the row's last decision saw

    def decide(self, rows: list[PolicyRow]) -> list[Decision]:
        out = super().decide(rows)
        for row, d in zip(rows, out):
            row.memory["snap"] = dataclasses.replace(row.state, accept_history=dict(row.state.accept_history),
                                                     drafter=d.drafter)
        return out

    def observe(self, row: PolicyRow, record) -> None:
        if record.drafter is None or not record.drafted:
            return
        state = row.memory["snap"]
        g = state.generated
        cols = self.current["drafters"][record.drafter]
        for j in range(min(record.accepted + 1, record.drafted)):
            token = DraftToken(j, *confidence(cols, g, j))
            prev = confidence(cols, g, j - 1)[0] if j else None
            label = float(cols["accept_prob"][g, j]) if self.soft else float(j < record.accepted)
            for form, feats in zip(FORMS, (token_features(state, token, prev),
                                           token_features(state, None, prev, position=j),
                                           token_features(state, None, None, position=j))):
                self.rows.append((feats, label, self.current["prompt_id"], record.drafter, j, form))


def acceptance_examples(grouped: dict, cost, *, vocab_size: int, k: int, soft: bool = False,
                        fractions=None) -> Examples:
    """Examples from teacher-forced traces grouped by ``traces.simulate.group_traces``: every drafter, ``k`` tokens a
    block. ``soft``: label with beta (sampled traces) instead of the greedy match. On sampled traces the replay walks
    one draw of the acceptances (``traces.draws``), so the positions reached and the acceptance history the features
    read follow sampled acceptance, as live decoding at that temperature does; the labels stay beta."""
    from sacpolicy.traces.draws import is_sampled
    from sacpolicy.traces.simulate import simulate

    if soft and not all(is_sampled(p) for p in grouped.values()):
        raise PredictorError("beta labels (soft=True) need sampled traces: group them with their meta "
                             "(group_traces(rows, read_meta(trace_dir))), whose sampling temperature is > 0")
    grouped = {pid: {**p, "prompt_id": pid, "draws": 1} for pid, p in grouped.items()}
    drafters = list(next(iter(grouped.values()))["drafters"]) if grouped else []
    rows = []
    for name in drafters:
        rec = _Recorder(k, name, soft)
        simulate(rec, grouped, cost, vocab_size=vocab_size)
        rows += rec.rows
    if not rows:
        raise PredictorError("the traces hold no drafted positions; collect traces with at least one drafter")
    feats, y, pid, drafter, pos, form = zip(*rows)
    split_of = {p: assign_split(p, **({"fractions": fractions} if fractions else {})) for p in set(pid)}
    return Examples(np.array(feats, dtype=np.float64), np.array(y, dtype=np.float64), np.array(pid),
                    np.array(drafter), np.array(pos), np.array(form), np.array([split_of[p] for p in pid]))


# ---------------------------------------------------------------------- scikit-learn
def from_hist_gradient_boosting(model) -> Predictor:
    """A fitted binary ``HistGradientBoostingClassifier`` as tree arrays (numeric features; NaN = missing)."""
    if getattr(model, "n_trees_per_iteration_", None) != 1:
        raise PredictorError("only binary HistGradientBoostingClassifier models can be compiled")
    cols = {k: [] for k in ("feature", "threshold", "left", "right", "missing_left", "leaf", "value")}
    roots, offset = [], 0
    for (tree,) in model._predictors:  # sklearn keeps the fitted trees here; nodes is a structured numpy array
        nodes = tree.nodes
        if nodes["is_categorical"].any():
            raise PredictorError("categorical splits are not supported; pass categories as numeric features")
        leaf = nodes["is_leaf"].astype(bool)
        roots.append(offset)
        cols["feature"].append(nodes["feature_idx"].astype(np.int64))
        cols["threshold"].append(nodes["num_threshold"].astype(np.float64))
        cols["left"].append(np.where(leaf, 0, nodes["left"]).astype(np.int64) + offset)
        cols["right"].append(np.where(leaf, 0, nodes["right"]).astype(np.int64) + offset)
        cols["missing_left"].append(nodes["missing_go_to_left"].astype(bool))
        cols["leaf"].append(leaf)
        cols["value"].append(np.where(leaf, nodes["value"], 0.0).astype(np.float64))
        offset += len(nodes)
    arrays = {k: np.concatenate(v) for k, v in cols.items()}
    arrays["roots"] = np.asarray(roots, dtype=np.int64)
    arrays["baseline"] = np.asarray(model._baseline_prediction, dtype=np.float64).reshape(1)
    return Predictor("trees", arrays)


def _standardizer(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = np.nan_to_num(np.nanmean(np.where(np.isfinite(X), X, np.nan), axis=0))
    scale = np.nan_to_num(np.nanstd(np.where(np.isfinite(X), X, np.nan), axis=0), nan=1.0)
    return mean, np.where(scale > 1e-12, scale, 1.0)


def fit_sklearn(train: Examples, val: Examples, *, estimator, out_dir=None, logger=None) -> Predictor:
    """Fit a HistGradientBoostingClassifier (on raw features, NaN = unknown) or a LogisticRegression (on
    standardized features, unknown = the mean) on ``train`` and compile it (``val`` is for calibration, later)."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    X, y, w = train.classifier_arrays()
    if isinstance(estimator, HistGradientBoostingClassifier):
        return from_hist_gradient_boosting(estimator.fit(X, y, sample_weight=w))
    if isinstance(estimator, LogisticRegression):
        mean, scale = _standardizer(X)
        shell = Predictor("linear", {"mean": mean, "scale": scale, "coef": np.zeros(X.shape[1]),
                                     "intercept": np.zeros(1)})
        estimator.fit(shell._standardize(X), y, sample_weight=w)
        return Predictor("linear", {**shell.arrays, "coef": estimator.coef_[0].astype(np.float64),
                                    "intercept": estimator.intercept_.astype(np.float64)})
    raise PredictorError(f"cannot compile {type(estimator).__name__}; use HistGradientBoostingClassifier or "
                         "LogisticRegression (predictor=hgb or predictor=logreg), or the Lightning MLP (predictor=mlp)")


def with_calibration(pred: Predictor, val: Examples, min_rows: int = 200) -> Predictor:
    """Isotonic maps from raw score to observed acceptance, fitted on validation rows (never training rows): one
    shared map, and one per drafter with at least ``min_rows`` validation rows of both outcomes. Per-drafter maps
    correct a shift the features cannot see, such as a distilled draft that agrees more on its own training prompts
    than on new ones."""
    from sklearn.isotonic import IsotonicRegression

    from sacpolicy.runtime.predictors import DRAFTER_INDEX

    def fit(ex):
        X, y, w = ex.classifier_arrays()
        iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(pred.raw(X), y, sample_weight=w)
        return iso.X_thresholds_.astype(np.float64), iso.y_thresholds_.astype(np.float64)

    arrays = {k: v for k, v in pred.arrays.items() if not k.startswith("calib_")}
    arrays["calib_x"], arrays["calib_y"] = fit(val)
    for i in np.unique(val.X[:, DRAFTER_INDEX]):
        rows = val.take(val.X[:, DRAFTER_INDEX] == i)
        if len(rows) >= min_rows and len(set(rows.classifier_arrays()[1].tolist())) == 2:
            arrays[f"calib_x_d{int(i)}"], arrays[f"calib_y_d{int(i)}"] = fit(rows)
    return Predictor(pred.kind, arrays, dict(pred.meta))


def predictor_metrics(pred: Predictor, ex: Examples) -> dict:
    """AUC, log-loss and expected calibration error of calibrated predictions (soft labels count as weights)."""
    from sklearn.metrics import log_loss, roc_auc_score

    from sacpolicy.training.metrics import calibration_error

    if not len(ex):
        return {"n": 0}
    X, y, w = ex.classifier_arrays()
    p = pred.predict(X)
    out = {"n": int(len(ex)), "positive_rate": float(np.average(y, weights=w)),
           "log_loss": float(log_loss(y, np.clip(p, 1e-6, 1 - 1e-6), sample_weight=w, labels=[0, 1])),
           "ece": float(calibration_error(pred.predict(ex.X), ex.y))}
    out["auc"] = float(roc_auc_score(y, p, sample_weight=w)) if len(set(y.tolist())) == 2 else float("nan")
    return out


# ---------------------------------------------------------------------- Lightning MLP
def fit_mlp(train: Examples, val: Examples, *, hidden, lr: float, weight_decay: float, batch_size: int,
            max_epochs: int, patience: int, seed: int = 0, out_dir=None, trainer_kwargs: dict | None = None,
            logger=None) -> Predictor:
    """A small MLP trained with Lightning (early stopping on validation loss, best checkpoint restored). Settings:
    ``conf/predictor/mlp.yaml``."""
    import lightning as L
    import torch

    from sacpolicy.training.common import MinuteLog
    from sacpolicy.training.predictor_module import AcceptanceDataModule, AcceptanceMLP

    L.seed_everything(seed, verbose=False)
    mean, scale = _standardizer(train.X)
    dm = AcceptanceDataModule(train, val, mean, scale, batch_size=batch_size, seed=seed)
    module = AcceptanceMLP(train.X.shape[1], hidden=tuple(hidden), lr=lr, weight_decay=weight_decay)
    scratch = None
    if out_dir is None:  # no run directory (e.g. an in-sample refit): a scratch one, never the working directory
        import tempfile

        out_dir = scratch = tempfile.mkdtemp(prefix="sacpolicy-mlp-")
    ckpt_dir = Path(out_dir) / "checkpoints"
    callbacks = [L.pytorch.callbacks.EarlyStopping("val_loss", patience=patience, mode="min")]
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", mode="min", save_top_k=1,
                                               filename="mlp-{epoch}-{val_loss:.4f}")
    callbacks.append(ckpt)
    callbacks.append(MinuteLog("MLP predictor"))
    kwargs = {"accelerator": "cpu", "devices": 1, "enable_model_summary": False, "logger": logger or False,
              "enable_progress_bar": True, **(trainer_kwargs or {})}
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=callbacks, default_root_dir=out_dir, **kwargs)
    trainer.fit(module, datamodule=dm)
    if ckpt.best_model_path:
        state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state)
    if scratch is not None:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    arrays = {"mean": mean, "scale": scale}
    linears = [m for m in module.net if isinstance(m, torch.nn.Linear)]
    for i, lin in enumerate(linears):
        arrays[f"w{i}"] = lin.weight.detach().cpu().numpy().astype(np.float32)
        arrays[f"b{i}"] = lin.bias.detach().cpu().numpy().astype(np.float64)
    # A feature that never varied in training (load: traces decode one request at a time) entered every example as
    # 0 after standardizing, so its first-layer weights are their random initialisation: zeroed, the predictor holds
    # it at its training value, as the trees and the logistic regression do, instead of reading noise from it live.
    constant = _constant_features(train.X)
    if constant.any():
        arrays["w0"][:, constant] = 0.0
        names = FEATURE_NAMES if train.X.shape[1] == len(FEATURE_NAMES) else range(train.X.shape[1])
        logging.getLogger(__name__).info("MLP predictor: features constant in training, held at their training "
                                         "value: %s", [names[i] for i in np.flatnonzero(constant)])
    return Predictor("mlp", arrays)


def _constant_features(X: np.ndarray) -> np.ndarray:
    """[F] True where a column holds one finite value (or none) over all rows."""
    finite = np.where(np.isfinite(X), X, np.nan)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        spread = np.nanmax(finite, axis=0) - np.nanmin(finite, axis=0)
    return ~(spread > 0)


# ---------------------------------------------------------------------- one entry point
def fit_predictor(name: str, fit, ex: Examples, out_dir=None, logger=None) -> tuple[Predictor, dict]:
    """Fit a predictor with ``fit(train, val, out_dir=, logger=) -> Predictor`` (``fit_sklearn`` or ``fit_mlp`` with
    their settings bound: a ``conf/predictor`` option instantiated) on the train split, calibrate on val, and report
    val and test metrics; the predictor's meta records all of it."""
    train, val = ex.of("train"), ex.of("val")
    if not len(train) or not len(val):
        raise PredictorError(f"need train and val examples, got {len(train)} and {len(val)}: collect traces over more "
                             "prompts (both splits come from the prompt-id split)")
    labels = set(np.unique(train.classifier_arrays()[1]).tolist())
    if len(labels) < 2:
        raise PredictorError(f"every training example is {'accepted' if labels == {1} else 'rejected'}: there is "
                             "nothing to predict; collect traces over more prompts, with drafters that sometimes "
                             "disagree with the target (or sampled decoding)")
    if not callable(fit):
        raise PredictorError(f"predictor {name!r} is {fit!r}, not a fitting function; a conf/predictor option names "
                             "one with _target_ (sacpolicy.training.predictor.fit_sklearn or fit_mlp) and _partial_")
    pred = with_calibration(fit(train, val, out_dir=out_dir, logger=logger), val)
    metrics = {split: predictor_metrics(pred, ex.of(split)) for split in ("val", "test")}
    pred.meta.update({"name": name, "features": feature_spec(), "metrics": metrics,
                      "examples": {s: int((ex.split == s).sum()) for s in ("train", "val", "test")}})
    return pred, metrics


# ---------------------------------------------------------------------- predictor -> decision rule
OPTIMISM_GRID = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def tune_rule(pred: Predictor, cost, val_grouped: dict, static: dict, *, vocab_size: int, k_max: int, config=None,
              modes=("stop", "k"), optimism=OPTIMISM_GRID, online=None):
    """The decision rule for ``pred``: its fallback is ``static``, the best static (drafter, k) on the validation
    traces (``traces.simulate.best_static``), and its mode and stop-rule optimism are the ones the simulator finds
    fastest on them. ``online`` (``runtime.online.OnlineSettings`` or its mapping; None: never): the best rule learns
    while serving with these settings when that replays faster on the validation traces than it does fitted only
    (the learning policy's state carries from prompt to prompt, as it would serving them). Returns (rule, tuning
    table)."""
    from sacpolicy.policy.learned import LearnedPolicy
    from sacpolicy.runtime.rule import DecisionRule
    from sacpolicy.traces.simulate import simulate

    if not val_grouped:
        raise PredictorError("no validation traces to tune the decision rule on; collect traces over val prompts")
    drafters = tuple(next(iter(val_grouped.values()))["drafters"])
    table, best = [], None
    for mode in modes:
        for lam in optimism if mode == "stop" else (1.0,):
            rule = DecisionRule(pred, cost, drafters, k_max, (static["drafter"], static["k"]), mode, lam)
            tps = simulate(LearnedPolicy(rule), val_grouped, cost, vocab_size=vocab_size, config=config).tokens_per_s
            table.append({"mode": mode, "optimism": lam, "val_tokens_per_s": tps})
            if best is None or tps > best[0]:
                best = (tps, rule)
    rule = best[1]
    rule.fallbacks = 0
    if online is not None:
        learning = replace(rule, online=online)
        tps = simulate(LearnedPolicy(learning), val_grouped, cost, vocab_size=vocab_size, config=config).tokens_per_s
        table.append({"mode": rule.mode, "optimism": rule.optimism, "online": learning.online.to_dict(),
                      "val_tokens_per_s": tps})
        if tps > best[0]:
            best, rule = (tps, learning), learning
    logger.info("decision rule for %s: mode=%s optimism=%s online=%s (%.1f tokens/s simulated on val; best static "
                "%s k=%d: %.1f)", pred.meta.get("name"), rule.mode, rule.optimism, rule.online is not None, best[0],
                static["drafter"], static["k"], static["tokens_per_s"])
    return rule, {"grid": table, "best_static_val": static}
