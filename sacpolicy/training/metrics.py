"""Held-out metrics of a predictor's probabilities, numpy only: reliability bins and the expected calibration error.
Training reports them for each fitted predictor; evaluation plots them (``evaluation.plots``)."""

from __future__ import annotations

import numpy as np


def reliability_bins(probs, labels, n_bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean predicted probability, observed frequency and count per equal-width bin of [0, 1] (NaN when empty).
    Labels may be soft (beta, the acceptance probability of sampled traces): the frequency is then their mean."""
    probs, labels = np.asarray(probs, dtype=float).ravel(), np.asarray(labels, dtype=float).ravel()
    if probs.size == 0 or probs.shape != labels.shape:
        raise ValueError(f"need as many labels as probabilities, at least one; got {probs.size} probabilities "
                         f"and {labels.size} labels")
    if probs.min() < 0 or probs.max() > 1:
        raise ValueError("probabilities must lie in [0, 1]; pass probabilities, not logits")
    idx = np.minimum((probs * n_bins).astype(int), n_bins - 1)  # p = 1 belongs to the last bin
    count = np.bincount(idx, minlength=n_bins)
    with np.errstate(invalid="ignore"):
        conf = np.bincount(idx, probs, n_bins) / count
        freq = np.bincount(idx, labels, n_bins) / count
    return conf, freq, count


def calibration_error(probs, labels, n_bins: int = 10) -> float:
    """Expected calibration error: the count-weighted mean |observed frequency - mean probability| over bins."""
    conf, freq, count = reliability_bins(probs, labels, n_bins)
    full = count > 0
    return float(np.sum(count[full] * np.abs(freq[full] - conf[full])) / count.sum())
