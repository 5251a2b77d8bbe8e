"""Evaluate every policy (AR, static k, heuristics, bandit, learned, oracle) on held-out test prompts, simulated
over test traces and live side by side; writes eval.json, eval.md, plots and report.md into the run directory.

    python scripts/evaluate.py from_run=outputs/<date>/<time>                  # traces + policies of that run
    python scripts/evaluate.py from_run=outputs/<date>/<time> eval.live_prompts=0   # simulated rows only
    python scripts/evaluate.py experiment=smoke from_run=<a smoke run>

Same configuration as scripts/train.py (conf/evaluate.yaml = conf/train.yaml with stages=[evaluate]).
"""

import logging

import hydra
from omegaconf import DictConfig

from sacpolicy import pipeline
from train import print_eval_table


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float:
    logging.getLogger("sacpolicy").setLevel(logging.INFO)
    try:
        outputs = pipeline.run(cfg)
    except pipeline.PipelineError as exc:
        raise SystemExit(f"error: {exc}") from None
    print_eval_table(outputs["evaluate"]["eval"])
    print(f"report: {outputs['report']}")
    return outputs["metric"]


if __name__ == "__main__":
    main()
