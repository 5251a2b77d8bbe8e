"""Run the sacpolicy pipeline under Hydra: distill a draft, collect traces, fit policies, evaluate, export.

    python scripts/train.py                       # embedded SmolLM2-135M on CPU (conf/train.yaml: the default run)
    python scripts/train.py experiment=smoke      # tiny random models, under a minute
    python scripts/train.py stages=[decode] policy=heuristic run.max_new_tokens=128
    python scripts/train.py stages=[fit,evaluate] from_run=outputs/<date>/<time>   # reuse traces of an earlier run
    python scripts/train.py hydra.run.dir=outputs/<date>/<time>                    # resume an interrupted run
    python scripts/train.py -m experiment=smoke predictor=[hgb],[logreg]          # a sweep; returns the metric
    python scripts/train.py logger=wandb          # W&B, offline by default (`wandb sync` later)
    python scripts/train.py stages=[refit] from_run=outputs/<run> refit.logs=<step-log dir>   # refit on served logs
    python scripts/train.py experiment=gpu_llama31_8b trainer=gpu trainer.devices=4 trainer.strategy=ddp
        # the training stages on 4 GPUs (Lightning starts ranks 1-3), the other stages on rank 0
    torchrun --nproc-per-node 4 scripts/train.py experiment=gpu_llama31_8b trainer=gpu trainer.devices=4 \
        trainer.strategy=ddp   # the same under torchrun (one run directory for every rank: sacpolicy.ranks)
"""

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from sacpolicy import pipeline, ranks


def print_eval_table(eval_path: str) -> None:
    ev = json.loads(Path(eval_path).read_text())
    m = ev["meta"]
    table = Table(title=f"{m['target']} on {m['device']}: {m['test_prompts_simulated']} test prompts simulated, "
                        f"{m['live_prompts']} live x {m['max_new_tokens']} tokens")
    for col in ("policy", "mode", "tokens/s", "speedup vs AR", "tokens/target call", "p50 ms", "policy %"):
        table.add_column(col, justify="left" if col in ("policy", "mode") else "right", no_wrap=True)
    for r in sorted(ev["rows"], key=lambda r: (r["mode"], -r["tokens_per_s"])):
        table.add_row(r["name"], r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_ar']:.2f}x",
                      f"{r['tokens_per_call']:.2f}", f"{r['latency_p50_ms']:.1f}", f"{100 * r['policy_fraction']:.2f}")
    Console().print(table)


def print_decode_table(summary: dict) -> None:
    table = Table(title=f"{summary['target']} on {summary['device']}: {summary['prompts']} prompts, "
                        f"{summary['max_new_tokens']} new tokens")
    for col in ("row", "policy", "tokens/s", "speedup vs AR", "tokens per target call"):
        table.add_column(col)
    for name, r in summary["rows"].items():
        table.add_row(name, r["policy"], f"{r['tokens_per_s']:.1f}", f"{r.get('speedup_vs_ar', 1.0):.2f}x",
                      f"{r['tokens_per_call']:.2f}")
    Console().print(table)


def run_and_print(cfg: DictConfig) -> float:
    """Run the configured stages, print the summary tables, return the metric a sweep optimizes."""
    logging.getLogger("sacpolicy").setLevel(logging.INFO)
    try:
        outputs = pipeline.run(cfg)
    except pipeline.PipelineError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not ranks.current().zero:  # rank 0 prints (and alone ran the stages after training)
        return outputs["metric"]
    if "decode" in outputs:
        print_decode_table(outputs["decode"])
    if "evaluate" in outputs:
        print_eval_table(outputs["evaluate"]["eval"])
        print(f"report: {outputs['report']}")
    if "refit" in outputs:
        r = outputs["refit"]
        ratio = r["ratios"]["candidate_vs_current"]
        print(f"refit: candidate/current {ratio['ratio']:.3f} [{ratio['ci'][0]:.3f}, {ratio['ci'][1]:.3f}] on "
              f"{r['held_out']['requests']} held-out requests; {r['decision']}")
        print(f"report: {r['report_md']}")
    return outputs["metric"]


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return run_and_print(cfg)


if __name__ == "__main__":
    sys.argv = ranks.share_run_dir(sys.argv)  # torchrun: every rank in rank 0's run directory
    main()
