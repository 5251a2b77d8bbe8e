"""Evaluate every policy (AR, static k, heuristics, bandit, learned, oracle) on held-out test prompts, simulated
over test traces and live side by side; writes eval.json, eval.md, plots and report.md into the run directory.

    python scripts/evaluate.py from_run=outputs/<date>/<time>                  # traces + policies of that run
    python scripts/evaluate.py from_run=outputs/<date>/<time> eval.live_prompts=0   # simulated rows only
    python scripts/evaluate.py from_run=... eval.live_prompts=0 eval.ceilings=false  # nor the in-sample refits
    python scripts/evaluate.py experiment=smoke from_run=<a smoke run>

A run directory's own ``policies/`` come before ``from_run``'s: copy another run's there to replay them on these
traces (e.g. a policy fitted at another temperature).

Same configuration as scripts/train.py (conf/evaluate.yaml = conf/train.yaml with stages=[evaluate]).
"""

import hydra
from omegaconf import DictConfig
from train import run_and_print


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return run_and_print(cfg)


if __name__ == "__main__":
    main()
