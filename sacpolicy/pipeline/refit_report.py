"""What stage ``refit`` (``sacpolicy.pipeline.refit``) reports of its summary: ``refit.md`` (the ratio tables, the live
arms, the served check, the decision and the deploy; ``write_report``) and the tracker's metrics, table and bar
(``refit/...``; ``track``).
"""

from __future__ import annotations

from pathlib import Path

from sacpolicy.io import write_text
from sacpolicy.pipeline import served_check
from sacpolicy.pipeline.context import SPLITS


def write_report(path: Path, s: dict) -> Path:
    from sacpolicy.evaluation.metrics import dropped_text

    req, split, held, best = s["requests"], s["split"], s["held_out"], s["best_static"]
    lines = [
        f"# Refit: {s['decision'].split(':')[0]}", "",
        (f"- logs: `{s['logs']}` ({req['requests']} complete requests, {req['incomplete']} incomplete, "
         f"{req['dropped']} steps dropped, {req['corrupt_shards']} damaged shards skipped); from_run: "
         f"`{s['from_run']}`"),
        (f"- split by request: train {split['train']}, val {split['val']}, test {split['test']} (fractions "
         f"{split['fractions']}); run traces mixed in: {s['run_traces']['prompts']} prompts"),
        (f"- candidate: `{s['candidate']['path']}` ({s['candidate']['predictor']}); current: `{s['current']['path']}`; "
         f"best static on val requests: {best['drafter']} k={best['k']}"),
        f"- held-out requests: {held['requests']} ({held['tokens']} tokens), {held['mode']}", "",
        f"| ratio | value | {100 * s['level']:g}% interval (paired bootstrap over held-out requests) |",
        "|---|---:|---|"]
    for key, r in s["ratios"].items():
        lines.append(f"| {key.replace('_vs_', ' / ')} | {r['ratio']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
    live = s.get("live")
    if live:
        lines += ["", f"Live: {live['requests']} held-out requests, {live['mode']}; identical across arms: "
                      f"{live['identical_across_arms']}, same as the server logged: {live['same_as_logged']}", "",
                  "| ratio (live) | value | interval |", "|---|---:|---|"]
        for key, r in live["ratios"].items():
            lines.append(f"| {key.replace('_vs_', ' / ')} | {r['ratio']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
        dropped = [f"{arm}: {dropped_text(d, live['requests'])}" for arm, d in live["dropped_drafters"].items() if d]
        if dropped:
            lines += ["", ("Drafters dropped in the live arms (they raised; those requests were decoded and timed "
                           f"without them): {'; '.join(dropped)}")]
    if s.get("served_check"):
        lines += served_check.report_lines(s["served_check"])
    lines += ["", f"Decision: {s['decision']} (threshold {s['threshold']}).", ""]
    if s["deployed"]:
        d = s["deployed"]
        lines.append(f"Deployed to `{d['root']}` as {d['as']}: version `{d['version']}`.")
    write_text(path, "\n".join(lines) + "\n")
    return path


def track(tracker, s: dict) -> None:
    metrics = {f"tokens_per_s_{arm.replace('-', '_')}": v for arm, v in s["held_out"]["tokens_per_s"].items()}
    for key, r in s["ratios"].items():
        metrics.update({key: r["ratio"], f"{key}_lo": r["ci"][0], f"{key}_hi": r["ci"][1]})
    for key, r in ((s.get("live") or {}).get("ratios") or {}).items():
        metrics.update({f"live_{key}": r["ratio"], f"live_{key}_lo": r["ci"][0], f"live_{key}_hi": r["ci"][1]})
    served = s.get("served_check") or {}
    if "ratio" in served:
        metrics.update({"served_candidate_vs_current": served["ratio"], "served_candidate_vs_current_lo":
                        served["ci"][0], "served_candidate_vs_current_hi": served["ci"][1]})
    metrics.update({"accepted": int(s["accepted"]), "held_out_requests": s["held_out"]["requests"],
                    **{f"{k}_requests": s["split"][k] for k in SPLITS}})
    tracker.log(metrics, "refit")
    tracker.table("refit/ratios", [{"ratio": k, "value": r["ratio"], "lo": r["ci"][0], "hi": r["ci"][1]}
                                   for k, r in s["ratios"].items()])
    tracker.bar("refit/tokens_per_s", s["held_out"]["tokens_per_s"], value="tokens_per_s",
                title="tokens/s on held-out requests (simulated)")
