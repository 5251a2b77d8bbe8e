"""Serve an export with vLLM's OpenAI-compatible server: check it, start ``vllm serve``, wait for health, print the
URL, and stop the server cleanly on Ctrl-C or SIGTERM.

    python scripts/export.py policy_dir=<run>/policies/hgb format=vllm out=deploy/vllm
    python scripts/serve.py --config learned --export deploy/vllm                 # the learned rule (custom proposer)
    python scripts/serve.py --config static --export deploy/vllm                  # its static k (k-by-batch-size map)
    python scripts/serve.py --config head --head deploy/eagle3                    # an EAGLE-3 head (speculators format)
    python scripts/export.py policy_dir=<run>/policies/hgb format=vllm drafter=feature out=deploy/head
    python scripts/serve.py --config learned-head --head-export deploy/head       # the rule's head, k by batch size
    python scripts/serve.py --config none                                         # no speculation
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "<printed model>", "prompt": "Hello", "max_tokens": 32, "temperature": 0}'

Step log (``--config learned``): ``--log-steps DIR`` has the proposer log every step of a share (``--log-rate``) of
the requests it serves to Parquet shards in DIR, prompts' token ids included (retention and the format:
``sacpolicy.export.steplog``); ``sacpolicy.traces.production`` turns the log into traces.

A broken or mismatched export (a missing file, a failed checksum, a policy trained for another target, a head made
for another verifier) is refused before the server starts, naming the file and the fix. ``--target``: the sacpolicy
model spec served (default: the embedded SmolLM2-135M-Instruct). Extra arguments after ``--`` go to vLLM's server.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from sacpolicy.export.vllm_serve import CONFIGS, ServeError, VllmServer, serve_config


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=CONFIGS, default="learned")
    ap.add_argument("--export", help="a vLLM export directory (scripts/export.py format=vllm): learned, static")
    ap.add_argument("--head", help="an EAGLE-3 head in the speculators format (scripts/export.py format=speculators)")
    ap.add_argument("--head-export", help="the rule's EAGLE-3 head for vLLM (scripts/export.py format=vllm "
                    "drafter=feature): learned-head")
    ap.add_argument("--target", default=None, help="sacpolicy model spec of the target (default: the embedded one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="requests the engine runs at once (more queue)")
    ap.add_argument("--log", default=None, help="the server's log file (default: the terminal)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server's health")
    ap.add_argument("--log-steps", default=None, metavar="DIR", help="the learned proposer's step log directory "
                    "(stores prompts' and outputs' token ids; see sacpolicy.export.steplog)")
    ap.add_argument("--log-rate", type=float, default=1.0, help="share of requests the step log keeps, in (0, 1]")
    args = ap.parse_args(argv)

    from sacpolicy.export.vllm_run import vllm_status
    from sacpolicy.models import EMBEDDED_TARGET, served_model

    target = args.target or EMBEDDED_TARGET
    try:
        served = served_model(target) if not target.startswith("hf:") else target.removeprefix("hf:")
        config = serve_config(args.config, export=args.export, head=args.head, head_export=args.head_export,
                              target=target, served_model=served)
    except ServeError as e:
        raise SystemExit(f"serve: {e}") from None
    if config.policy_dir is not None:  # the sampling the policy was fitted for: vLLM's hook does not see a request's
        from sacpolicy.runtime import load_artifact

        fitted = load_artifact(config.policy_dir).fitted_sampling
        if fitted:
            t = fitted["temperature"]
            words = "greedy decoding" if t == 0 else f"temperature {t:g}, top_p {fitted['top_p']:g}"
            print(f"serve: the policy was fitted for {words}; requests at other settings get decisions priced for "
                  "those (fit one with sampling.temperature=... for them)", flush=True)
    env = step_log_env(args, config)
    ok, why = vllm_status()
    if not ok:
        raise SystemExit(f"serve: {why}")
    server = VllmServer(served, config, host=args.host, port=args.port, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, log=args.log, extra_args=extra, env=env)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"serve: starting vLLM {why} on {served} ({config.describe()})", flush=True)
    try:
        server.start(timeout=args.timeout)
        print(f"serve: ready at {server.url} (model {served!r}; OpenAI API under {server.url}/v1, counters at "
              f"{server.url}/metrics) after {server.started_s:.0f} s; Ctrl-C stops it", flush=True)
        while server.alive():
            try:
                server.proc.wait(1)
            except subprocess.TimeoutExpired:
                pass
        print(f"serve: the server exited with code {server.proc.returncode}", flush=True)
        return server.proc.returncode or 1
    except ServeError as e:
        raise SystemExit(f"serve: {e}") from None
    except KeyboardInterrupt:
        print("serve: stopping", flush=True)
        return 0
    finally:
        server.stop()


def step_log_env(args, config) -> dict:
    """The server environment that turns the proposer's step log on (``--log-steps``), checked before it starts."""
    if args.log_steps is None:
        return {}
    from pathlib import Path

    from sacpolicy.export.steplog import RATE_ENV
    from sacpolicy.export.vllm import LOG_ENV
    from sacpolicy.traces.logformat import StepLogError, check_rate

    if config.policy_dir is None or config.name != "learned":
        raise SystemExit(f"serve: --log-steps logs the learned rule's proposer; --config {config.name} does not run "
                         "it (use --config learned)")
    try:
        rate = check_rate(args.log_rate, "--log-rate")
    except StepLogError as e:
        raise SystemExit(f"serve: {e}") from None
    out = Path(args.log_steps).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"serve: logging {rate:.0%} of requests' steps to {out} (prompt and output token ids included)", flush=True)
    return {LOG_ENV: str(out), RATE_ENV: str(rate)}


if __name__ == "__main__":
    sys.exit(main())
