"""Evaluation: metric rows per policy (live or simulated), bootstrap intervals, Markdown/JSON reports and plots.

``evaluation.evaluate`` (the rows of a run) and ``evaluation.ceilings`` (per-prompt static, in-sample ceiling) need
torch and are imported from their modules."""

from sacpolicy.evaluation.intervals import (
    add_intervals,
    bootstrap_indices,
    nested_ratio_interval,
    paired_ratio_interval,
)
from sacpolicy.evaluation.metrics import (
    add_speedups,
    flag_artefacts,
    gain_captured,
    row_from_results,
)
from sacpolicy.evaluation.plots import calibration_plot, line_plot, make_plots, speedup_vs_k_plot
from sacpolicy.evaluation.report import (
    category_table,
    markdown_table,
    write_eval,
    write_report,
)
from sacpolicy.training.metrics import calibration_error, reliability_bins

__all__ = [
    "add_intervals", "add_speedups", "bootstrap_indices", "calibration_error", "calibration_plot", "category_table",
    "flag_artefacts", "gain_captured", "line_plot", "make_plots", "markdown_table", "nested_ratio_interval",
    "paired_ratio_interval", "reliability_bins", "row_from_results", "speedup_vs_k_plot", "write_eval", "write_report",
]
