"""The machine's speed now against the profile that priced a cost model. A shared CPU slows down and speeds up by tens
of percent within an hour (docs/benchmarks.md, sampled decoding), and the simulated rows are priced at the speed the
machine had when it was profiled, so a simulated row can miss its live one by the machine alone. ``profile`` times a
probe (``probe_pass``: the target's one-token pass on a cache of the middle profiled context) into
``meta["speed_probe"]``; the evaluation times the same probe between live prompts (``SpeedProbe``), and the ratio of the
two says how much slower (> 1) or faster (< 1) the machine ran while the live rows were measured. A diagnostic, not a
correction: one probe is one moment, and on a shared CPU probes minutes apart differ widely (docs/benchmarks.md,
sampled decoding), so the probes' spread says how much of a simulated row's error the machine alone can make."""

from __future__ import annotations

import logging
import statistics

from sacpolicy.profiling.measure import middle_context, probe_pass
from sacpolicy.runtime.cost import CostModel

__all__ = ["DRIFT_WARN", "SpeedProbe"]

logger = logging.getLogger(__name__)

DRIFT_WARN = 0.05  # a machine this much slower or faster than when profiled is warned of


class SpeedProbe:
    """Times ``probe_pass`` on the target at each call; ``summary()`` sets the probes against the profile's.

    The reference is the profile's own probe (``cost.meta["speed_probe"]``), timed the same way; a cost model profiled
    before the probe existed is compared with its priced one-token pass instead (its ``step_base`` left out), which
    the probe's lone repeated calls can undercut by a few percent: ``summary()["reference"]`` says which."""

    def __init__(self, target, cost: CostModel, *, seed: int = 0):
        self.target, self.seed, self.seconds = target, seed, []
        probe = cost.meta.get("speed_probe")
        if probe:
            self.context, self.reference_s, self.reference = int(probe["context"]), float(probe["seconds"]), "probe"
        else:
            self.context = middle_context(cost.meta.get("context_lens") or [256])
            self.reference_s = cost.verify_time(0, self.context) - cost.step_base
            self.reference = "cost model"

    def __call__(self) -> float:
        t = probe_pass(self.target, self.context, seed=self.seed)
        self.seconds.append(t)
        return t

    def summary(self) -> dict:
        """{"context", "reference" ("probe": the profile's; "cost model": its priced pass), "reference_s",
        "probes_s" (each probe's median), "ratio" (the probes' median over the reference: 1.2 is a machine 20%
        slower than profiled)}; warns when the ratio is off 1 by more than ``DRIFT_WARN``."""
        if not self.seconds:
            raise ValueError("SpeedProbe.summary() before any probe: call the probe first")
        median = statistics.median(self.seconds)
        ratio = median / self.reference_s
        if abs(ratio - 1.0) > DRIFT_WARN:
            logger.warning("the target's one-token pass took %.1f ms during the live rows against %.1f ms when the cost "
                           "model was profiled (%+.0f%%): the simulated rows are priced at the profile's speed",
                           1e3 * median, 1e3 * self.reference_s, 100 * (ratio - 1))
        return {"context": self.context, "reference": self.reference, "reference_s": self.reference_s,
                "probes_s": list(self.seconds), "ratio": ratio}
