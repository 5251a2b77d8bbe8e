"""The Python steps of ``scripts/gpu_check.sh``: one vLLM engine serving a pipeline run's export, and the JSON summary.

    python scripts/gpu_check.py vllm <run dir> <result.json>     # the run's first policy export in one engine
    python scripts/gpu_check.py summary <work dir> <out.json>    # every step's status, time, log tail and result

The engine runs where vLLM runs here (``sacpolicy.export.vllm_run.engine_defaults``: bfloat16 with CUDA graphs on a
GPU, float32 eager on CPU) on the run's target (``_served_target``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _served_target(spec: str) -> str:
    """The directory vLLM serves: the run's target's, or for the tiny target (CPU dry run) the embedded model's,
    whose tokenizer the tiny models share (vLLM's CPU attention has no kernel for the tiny model's head size 16)."""
    from sacpolicy.models import EMBEDDED_TARGET, served_model

    return served_model(EMBEDDED_TARGET if spec.startswith("tiny:") else spec)


def vllm_step(run_dir: Path, out: Path, prompts: int = 4, max_tokens: int = 32) -> dict:
    """The run's first exported vLLM directory (``export/<predictor>/vllm``: the learned rule as vLLM's custom
    proposer) served on the run's target; its tokens, timings and vLLM's speculative counters."""
    from omegaconf import OmegaConf

    from sacpolicy.data import load_prompts
    from sacpolicy.export.vllm_run import cuda_available, engine_defaults, run_engine
    from sacpolicy.models import load_tokenizer

    exports = sorted(run_dir.glob("export/*/vllm/speculative_config.json"))
    if not exports:
        raise SystemExit(f"gpu_check: {run_dir} has no export/<predictor>/vllm/ (run the export stage with an n-gram "
                         "drafter among draft=)")
    export = exports[0].parent
    spec = OmegaConf.load(run_dir / "config.yaml").target.spec
    tok = load_tokenizer("embedded:smollm2-135m-instruct" if spec.startswith("tiny:") else spec)
    ids = [list(r["input_ids"]) for r in load_prompts("mt_bench", tokenizer=tok, limit=prompts)]
    t0, served = time.perf_counter(), _served_target(spec)
    res = run_engine(served, ids, max_tokens=max_tokens,
                     speculative_config=json.loads((export / "speculative_config.json").read_text()),
                     policy_dir=export / "policy", phases=("serial",), log=Path(out).parent / "vllm-engine.log")
    spec_counts = res["spec"]["serial"]
    result = {"export": str(export), "target": spec, "served": served, "cuda": cuda_available(), **engine_defaults(),
              "vllm": res["vllm"], "startup_s": res["startup_s"], "engine_s": time.perf_counter() - t0,
              "tokens": res["tokens"]["serial"], "tokens_per_s": res["tokens"]["serial"] / res["seconds"]["serial"],
              "spec": spec_counts, "proposer": res.get("proposer")}
    Path(out).write_text(json.dumps(result, indent=2))
    return result


def summary(work: Path, out: Path) -> dict:
    """``work/steps.tsv`` (name, exit code, seconds per step) with each step's log tail and result JSON."""
    steps = {}
    for line in (work / "steps.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        log = work / f"{name}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.is_file() else []
        res = work / f"{name}.json"
        steps[name] = {"ok": rc == "0", "exit_code": int(rc), "seconds": round(float(seconds), 1), "log_tail": tail,
                       **({"result": json.loads(res.read_text())} if res.is_file() else {})}
    meta = json.loads((work / "meta.json").read_text()) if (work / "meta.json").is_file() else {}
    result = {**meta, "ok": bool(steps) and all(s["ok"] for s in steps.values()),
              "total_s": round(sum(s["seconds"] for s in steps.values()), 1), "steps": steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def env_step(out: Path) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    result = {"torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda,
              "device_name": torch.cuda.get_device_name(0) if cuda else None,
              "bf16": bool(cuda and torch.cuda.is_bf16_supported())}
    Path(out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "vllm":
        vllm_step(Path(args[0]), Path(args[1]))
    elif cmd == "summary":
        print(json.dumps({k: v for k, v in summary(Path(args[0]), Path(args[1])).items() if k != "steps"}))
    elif cmd == "env":
        print(json.dumps(env_step(Path(args[0]))))
    else:
        raise SystemExit(f"gpu_check.py: unknown command {cmd!r}; use vllm, summary or env")
