"""Run the sacpolicy pipeline under Hydra.

    python scripts/train.py                       # embedded SmolLM2-135M target on CPU (the default experiment)
    python scripts/train.py experiment=smoke      # tiny random models, seconds
    python scripts/train.py policy=heuristic run.max_new_tokens=128
    python scripts/train.py -m policy=static,heuristic,confidence   # a sweep; returns tokens/s per job
"""

import logging

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from sacpolicy import pipeline


def print_decode_table(summary: dict) -> None:
    table = Table(title=f"{summary['target']} on {summary['device']}: {summary['prompts']} prompts, "
                        f"{summary['max_new_tokens']} new tokens")
    for col in ("row", "policy", "tokens/s", "speedup vs AR", "tokens per target call"):
        table.add_column(col)
    for name, r in summary["rows"].items():
        table.add_row(name, r["policy"], f"{r['tokens_per_s']:.1f}", f"{r.get('speedup_vs_ar', 1.0):.2f}x",
                      f"{r['mean_accepted']:.2f}")
    Console().print(table)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    logging.getLogger("sacpolicy").setLevel(logging.INFO)
    try:
        outputs = pipeline.run(cfg)
    except pipeline.PipelineError as exc:
        raise SystemExit(f"error: {exc}") from None
    if "decode" in outputs:
        print_decode_table(outputs["decode"])
    return outputs["metric"]


if __name__ == "__main__":
    main()
