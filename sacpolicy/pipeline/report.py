"""The run's report: the evaluation table with the distillation and predictor summaries (``report.md``)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from sacpolicy.pipeline.context import command


def write_run_report(cfg: DictConfig, out_dir: Path, outputs: dict) -> Path:
    from sacpolicy.evaluation.report import write_report

    ev = json.loads(Path(outputs["evaluate"]["eval"]).read_text())
    sections = {}
    if "distill" in outputs:
        d = outputs["distill"]
        sections["Distilled draft"] = "\n".join(f"- {k}: {v}" for k, v in d.items() if not isinstance(v, dict))
    if "fit" in outputs:
        lines = []
        for name, p in outputs["fit"]["predictors"].items():
            for split in ("val", "test"):
                m = p["metrics"][split]
                lines.append(f"- {name} ({split}): AUC {m.get('auc', float('nan')):.3f}, log-loss "
                             f"{m.get('log_loss', float('nan')):.3f}, ECE {m.get('ece', float('nan')):.3f}, n={m['n']}")
            lines.append(f"- {name}: decision mode {p['mode']}, optimism {p['optimism']}, fallback {p['fallback']}")
        if outputs["fit"].get("headline"):
            lines.append(f"- the learned policy reported first (`learned` in eval.live_policies): "
                         f"learned-{outputs['fit']['headline']}, the lowest validation log-loss")
        sections["Predictors"] = "\n".join(lines)
    plots = sorted((out_dir / "plots").glob("*.png"))
    md, _ = write_report(out_dir, ev, command=command(), sections=sections, plots=plots)
    return md
