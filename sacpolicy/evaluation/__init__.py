"""Evaluation: metric rows per policy (live or simulated), Markdown/JSON reports and plots."""

from sacpolicy.evaluation.metrics import (
    add_speedups,
    calibration_error,
    reliability_bins,
    row_from_results,
)
from sacpolicy.evaluation.plots import calibration_plot, make_plots, speedup_vs_k_plot
from sacpolicy.evaluation.report import (
    category_table,
    markdown_table,
    write_eval,
    write_report,
)

__all__ = [
    "add_speedups", "calibration_error", "calibration_plot", "category_table", "make_plots", "markdown_table",
    "reliability_bins", "row_from_results", "speedup_vs_k_plot", "write_eval", "write_report",
]
