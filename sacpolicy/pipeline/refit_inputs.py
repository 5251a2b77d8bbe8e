"""What stage ``refit`` (``sacpolicy.pipeline.refit``) reads: the step log's provenance (``log_meta``), the production
traces built from it into the refit run (``production_traces``), their requests split by prompt into train / val /
test (``split_requests``), from_run's traces of the served drafters mixed into the fit examples (``run_traces``), and
the log's complete requests, whose prompts and served lengths the live arms and the served check run again
(``logged_requests``). Each refuses input a refit cannot use with a ``PipelineError`` naming the fix.
"""

from __future__ import annotations

from pathlib import Path

from sacpolicy.pipeline.context import SPLITS, PipelineError, RunContext

TRACES = "traces/production"  # production traces of the log, in the refit run's directory


def log_meta(logs) -> dict | None:
    """The provenance the log's first readable shard records (``traces.steplog_read.read_step_log``'s meta); None
    without one (reading the log then names the problem and the fix)."""
    import pyarrow.parquet as pq

    from sacpolicy.traces.logformat import shard_files, shard_meta

    for path in shard_files(logs):
        try:
            return shard_meta(path, pq.read_schema(path))
        except (OSError, ValueError):  # damaged (pyarrow's ArrowInvalid and StepLogError are ValueErrors)
            continue
    return None


def production_traces(ctx: RunContext) -> tuple[dict, Path]:
    """(meta, tf dir) of the production traces built from ``refit.logs`` into this run (refusing, with the fix, logs
    of another target than the run's and a k cap below ``fit.k_max``)."""
    from sacpolicy.traces.logformat import StepLogError
    from sacpolicy.traces.production import build_production_traces
    from sacpolicy.traces.schema import read_meta

    cfg, logs = ctx.cfg, Path(ctx.cfg.refit.logs)
    first = log_meta(logs)
    theirs = first["target"].get("target") if first else None
    if theirs is not None and theirs != cfg.target.spec:
        raise PipelineError(f"refit.logs={logs} was logged serving target {theirs!r}, but from_run and this run use "
                            f"{cfg.target.spec!r}: a policy refits on its own target's logs. Point refit.logs at logs "
                            f"of {cfg.target.spec!r}, or from_run at a run of {theirs!r} (and target= to match)")
    out = ctx.out_dir / TRACES
    rs = cfg.refit
    select = None if rs.select is None else dict(rs.select)
    try:
        meta = build_production_traces(logs, out, target=ctx.target if rs.target_pass else cfg.target.spec,
                                       select=select, skip_corrupt=rs.skip_corrupt)
    except StepLogError as e:
        raise PipelineError(f"refit.logs={logs}: {e}") from e
    k_cap = int(meta["log"]["k_cap"])
    if cfg.fit.k_max > k_cap:
        raise PipelineError(f"fit.k_max={cfg.fit.k_max} exceeds the k cap {k_cap} of the server that logged "
                            f"{logs} (its traces record no longer accepted run, and a deploy root refuses a policy "
                            f"above its cap); set fit.k_max={k_cap}")
    served = log_meta(logs)
    return {**read_meta(out / "tf"), "drafter": served["drafter"], "drafters": served.get("drafters")}, out / "tf"


def split_requests(ctx: RunContext, tf_dir: Path, meta: dict) -> tuple[dict, dict, dict]:
    """(grouped, {split: grouped}, {request: split}) of the production traces: each request's split from its prompt
    (``assign_split`` of ``traces.production.prompt_key``, ``refit.fractions``: the same prompt served twice lands in
    one split, and a split does not depend on the server run's log ids); refused when a split has fewer than
    ``refit.min_requests``."""
    from sacpolicy.data.splits import SplitError, assign_split
    from sacpolicy.traces.schema import load_traces
    from sacpolicy.traces.simulate import group_traces

    rs = ctx.cfg.refit
    fractions = dict(rs.fractions)
    grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=ctx.cfg.target.spec), meta)
    try:
        split_of = {rid: assign_split(meta["log"]["prompts"][rid], fractions) for rid in grouped}
    except SplitError as e:
        raise PipelineError(f"refit.fractions: {e}") from e
    by_split = {s: {rid: grouped[rid] for rid in sorted(grouped) if split_of[rid] == s} for s in SPLITS}
    sizes = {s: len(g) for s, g in by_split.items()}
    if set(fractions) != set(SPLITS) or min(sizes.values()) < rs.min_requests:
        raise PipelineError(f"the log's {len(grouped)} complete requests split into {sizes} (refit.fractions="
                            f"{fractions}); a refit needs at least refit.min_requests={rs.min_requests} in each of "
                            f"{list(SPLITS)} to fit, tune and compare on. Log more requests (serve longer, or a "
                            "higher --log-rate) or adjust refit.fractions")
    return grouped, by_split, split_of


def run_traces(ctx: RunContext, drafters: list[str], taken: set, sampling: dict) -> dict:
    """from_run's train-split traces of the served ``drafters`` (grouped, those drafters only), for the fit examples;
    refused unless they were decoded at the production traces' ``sampling`` (their labels differ otherwise)."""
    from sacpolicy.data.splits import assign_split
    from sacpolicy.traces.schema import load_traces, read_meta, trace_sampling
    from sacpolicy.traces.simulate import group_traces

    tf_dir = ctx.need("traces/tf", "refit")
    meta = read_meta(tf_dir)
    theirs, ours = trace_sampling(meta), trace_sampling({"sampling": sampling})
    if theirs != ours:
        raise PipelineError(f"{tf_dir} holds traces decoded at {theirs}, the production ones at {ours}: their labels "
                            "differ; refit without them (refit.include_run_traces=false), or on logs served at "
                            f"{theirs} (refit.select)")
    grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=ctx.cfg.target.spec), meta)
    out = {pid: {**p, "drafters": {d: p["drafters"][d] for d in drafters}} for pid, p in grouped.items()
           if assign_split(pid) == "train" and all(d in p["drafters"] for d in drafters)}
    if not out:
        raise PipelineError(f"{tf_dir} holds no train traces of the served drafters {drafters}; collect them with "
                            f"draft=[{','.join(drafters)}] or refit without them (refit.include_run_traces=false)")
    if taken & set(out):
        raise PipelineError(f"request ids {sorted(taken & set(out))[:3]} of the log are also prompt ids of {tf_dir}")
    return out



def logged_requests(ctx: RunContext) -> dict:
    """{log id: {"prompt_len", "tokens", "steps"}} of ``refit.logs``' complete requests (``requests_of``): the prompts
    and served lengths the live arms and the served check run again."""
    from sacpolicy.traces.steplog_read import read_step_log, requests_of

    rs = ctx.cfg.refit
    return requests_of(read_step_log(rs.logs, target=ctx.cfg.target.spec, skip_corrupt=rs.skip_corrupt)[0])[0]

