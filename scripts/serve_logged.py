"""Serve a workload through the learned rule in vLLM's OpenAI server with the proposer's step log on, and check the
log against vLLM's own per-request arrays: the first leg of the production feedback loop.

    python scripts/serve_logged.py --export <run>/export/hgb/vllm --source sharegpt --split train --prompts 120 \
        --logs runs/loop/logs --out runs/loop/served.json
    python scripts/refit.py ...                      # then: a candidate fitted on what was served (see the README)

Starts ``python -m vllm.entrypoints.openai.api_server`` with the export's learned rule (``serve_config("learned")``),
its step log in ``--logs`` (every request: ``SACPOLICY_PROPOSER_LOG_RATE=1``) and
``--per-request-spec-decode-metrics detailed``, sends the prompts (the chat template applied, as token ids) greedily,
``--concurrency`` at a time, waits for the log's writer and stops the server. Then it reads the log back
(``traces.steplog_read``), finds every served request in it by its tokens and compares the logged (drafted,
accepted) of every verified step with vLLM's ``per_step_drafted`` / ``per_step_accepted``
(``traces.vllm_compare.compare_with_vllm``). Prints the agreement and writes ``--out`` (JSON: the prompts' ids, the
responses' tokens and vLLM's arrays, the check). Exits 1, saying why on stderr, when a request failed, a served
request differs from vLLM's arrays (or is missing from the log), or nothing was served (``problems``): a check that
did not check out never reads as a pass.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sacpolicy import bench


def problems(check: dict) -> list[str]:
    """Why a run does not check out, one sentence each with what to look at; none when every prompt sent was served
    and its logged steps equal vLLM's arrays. ``check``: ``compare_with_vllm``'s, with ``failed`` (the indices of the
    requests that got an error instead of a response) added."""
    served, out = check["served"], []
    if not served:
        out.append("no request was served: nothing was compared; send prompts that fit --max-model-len")
    if check["failed"]:
        out.append(f"{len(check['failed'])} of {served} requests failed (indices {_some(check['failed'])}): their "
                   "errors are in the --out JSON's responses, the server's in its .server.log")
    if check["mismatched"]:
        out.append(f"{len(check['mismatched'])} of {served} served requests differ from vLLM's per-step arrays or "
                   f"are missing from the step log (indices {_some(check['mismatched'])}): compare their steps in the "
                   "log with the responses' arrays in the --out JSON")
    return out


def _some(indices: list[int], n: int = 10) -> str:
    return ", ".join(map(str, indices[:n])) + (f", ... ({len(indices) - n} more)" if len(indices) > n else "")


def exit_status(check: dict, err=None) -> int:
    """The process's exit status for a run's ``check``: 0 when it checks out, else 1 after writing each of
    ``problems(check)`` to ``err`` (stderr)."""
    found = problems(check)
    for line in found:
        print(f"[serve_logged] FAILED: {line}", file=err or sys.stderr, flush=True)
    return 1 if found else 0


def main(argv=None) -> dict:
    ap = bench.parser(__doc__)
    ap.add_argument("--export", required=True, help="a vLLM export (scripts/export.py format=vllm) of a learned rule")
    ap.add_argument("--source", default="sharegpt", help="the prompt set served (sacpolicy.data PROMPT_SETS)")
    ap.add_argument("--split", default="train", help="which of its splits (by prompt id): train, val or test")
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--logs", required=True, help="the step log's directory (created)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048, help="the server's context limit")
    bench.add_out(ap, None, required=True, help="where the responses and the check are written (JSON)")
    args = ap.parse_args(argv)

    from sacpolicy.export.steplog import FLUSH_ENV, RATE_ENV
    from sacpolicy.export.vllm import LOG_ENV
    from sacpolicy.export.vllm_serve import ServeError, VllmServer, completions, serve_config
    from sacpolicy.models import EMBEDDED_TARGET, load_tokenizer, served_model
    from sacpolicy.traces.steplog_read import read_step_log, requests_of
    from sacpolicy.traces.vllm_compare import compare_with_vllm

    logs = Path(args.logs).resolve()
    if logs.exists() and any(logs.iterdir()):
        raise SystemExit(f"serve_logged: {logs} already holds a log; give a new --logs directory so the check reads "
                         "this run's steps alone")
    logs.mkdir(parents=True, exist_ok=True)
    try:
        config = serve_config("learned", export=args.export)
    except ServeError as e:
        raise SystemExit(f"serve_logged: {e}") from None
    rows = bench.held_out_prompts(args.source, load_tokenizer(EMBEDDED_TARGET), split=args.split, n=args.prompts)
    if not rows:
        raise SystemExit(f"serve_logged: no {args.source} prompts in split {args.split!r}")
    fits = [r for r in rows if len(r["input_ids"]) + args.max_tokens <= args.max_model_len]
    if len(fits) < len(rows):  # the server refuses them (HTTP 400): nothing to log or compare
        print(f"[serve_logged] {len(rows) - len(fits)} prompts longer than --max-model-len {args.max_model_len} - "
              f"--max-tokens {args.max_tokens} left out", flush=True)
    rows = fits
    prompts = [list(r["input_ids"]) for r in rows]
    env = {LOG_ENV: str(logs), RATE_ENV: "1", FLUSH_ENV: "2"}
    server = VllmServer(served_model(), config, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        env=env, extra_args=("--per-request-spec-decode-metrics", "detailed"),
                        log=Path(args.out).with_suffix(".server.log"))
    print(f"[serve_logged] {len(prompts)} {args.source}/{args.split} prompts, {args.max_tokens} tokens each, "
          f"{args.concurrency} at a time; step log in {logs}", flush=True)
    t0 = time.perf_counter()
    with server:
        responses = completions(server.url, prompts, max_tokens=args.max_tokens, concurrency=args.concurrency)
        seconds = time.perf_counter() - t0
        time.sleep(6)  # the log's writer flushes every 2 s
    failed = [i for i, r in enumerate(responses) if r["error"]]
    records, meta = read_step_log(logs, target=EMBEDDED_TARGET)
    requests, incomplete = requests_of(records)
    check = compare_with_vllm(requests, [(p, r["token_ids"] or [], r["spec"]) for p, r in zip(prompts, responses)],
                              k_cap=meta.get("k_cap"))
    check.update(incomplete=incomplete, dropped=meta.get("dropped", 0), failed=failed, seconds=seconds,
                 logged_requests=len(requests))
    share = check["equal_steps"] / check["steps"] if check["steps"] else float("nan")
    print(f"[serve_logged] {check['logged']}/{check['served']} served requests found in the log; "
          f"{check['equal_steps']}/{check['steps']} verify steps equal to vLLM's arrays ({share:.1%}); "
          f"{len(check['mismatched'])} requests differ; {len(failed)} failed; {seconds:.0f} s", flush=True)
    check["problems"] = problems(check)
    bench.write_results(args.out, {"source": args.source, "split": args.split, "prompt_ids":
                                   [r["prompt_id"] for r in rows], "responses": responses, "check": check}, args)
    return check


if __name__ == "__main__":
    sys.exit(exit_status(main()))
