"""Profiling a device into a ``CostModel``: ``measure`` times the forwards (``profile``), ``loop`` the decoder's own
work per step, ``fit`` fits the model's knots and intervals to those timings. The model itself lives in
``sacpolicy.runtime.cost`` (numpy only)."""

from sacpolicy.profiling.fit import (
    MIN_REPEATS,
    N_BOOT,
    fit_cost_model,
    fit_step_overhead,
    monotone_knots,
    pool_adjacent_violators,
)
from sacpolicy.profiling.measure import ROW_SPREAD, batch_row_lengths, prefilled_batch, profile
from sacpolicy.runtime.cost import COST_FORMAT, CostModel, PiecewiseLinear

__all__ = ["COST_FORMAT", "MIN_REPEATS", "N_BOOT", "ROW_SPREAD", "CostModel", "PiecewiseLinear", "batch_row_lengths",
           "fit_cost_model", "fit_step_overhead", "monotone_knots", "pool_adjacent_violators", "prefilled_batch",
           "profile"]
