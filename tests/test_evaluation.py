"""Evaluation rows, reports and plots on hand-built generations whose every metric can be worked out on paper."""

import json

import numpy as np
import pytest

from sacpolicy.decoding.drafters import NgramDrafter
from sacpolicy.decoding.types import GenerationResult, StepRecord
from sacpolicy.evaluation import (
    add_intervals,
    add_speedups,
    bootstrap_indices,
    calibration_error,
    calibration_plot,
    category_table,
    flag_artefacts,
    gain_captured,
    make_plots,
    markdown_table,
    nested_ratio_interval,
    paired_ratio_interval,
    row_from_results,
    speedup_vs_k_plot,
    write_eval,
    write_report,
)
from sacpolicy.evaluation.metrics import ARTEFACT, simulated_vs_live
from sacpolicy.evaluation.report import MARK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _step(drafter, k, drafted, accepted, emitted, draft_s, verify_s):
    return StepRecord(step=0, drafter=drafter, k=k, drafted=drafted, accepted=accepted, emitted=emitted,
                      context_len=10, draft_s=draft_s, verify_s=verify_s)


def _result(prefill_s, steps):
    n = 1 + sum(s.emitted for s in steps)  # the prefill pass emits the first token
    total = prefill_s + sum(s.draft_s + s.verify_s for s in steps)
    return GenerationResult(tokens=list(range(n)), steps=steps, prompt_len=10, prefill_s=prefill_s, total_s=total,
                            finish_reason="length")


def _example():
    """8 tokens in 0.49 s, 6 target calls, 7 drafted of which 3 accepted."""
    a = _result(0.1, [_step("draft", 3, 3, 2, 3, 0.03, 0.03),  # 3 tokens at 20 ms
                      _step(None, 0, 0, 0, 1, 0.0, 0.05)])  # autoregressive: 1 token at 50 ms
    b = _result(0.2, [_step("ngram", 4, 2, 0, 1, 0.01, 0.03),  # drafted fewer than decided
                      _step("draft", 2, 2, 1, 1, 0.02, 0.02)])  # EOS cut the block to one token
    return [("code", a), (None, b)]


def _row(name, mode, tokens_per_step, step_s, categories=("code", "chat")):
    """One result per category: 1 prefill token at step_s, then 4 steps emitting tokens_per_step tokens each."""
    k = tokens_per_step - 1
    steps = [_step("draft" if k else None, k, k, k, tokens_per_step, 0.0, step_s) for _ in range(4)]
    return row_from_results(name, mode, [(c, _result(step_s, steps)) for c in categories], price_per_hour=3.6)


def _rows():
    rows = [_row(name, mode, n, s) for mode, s in (("live", 0.01), ("simulated", 0.02))
            for name, n in (("ar", 1), ("static-k1", 2), ("static-k3", 4), ("learned", 3), ("heuristic", 2))]
    add_speedups(rows)
    return rows


# ---------------------------------------------------------------------- metrics
def test_row_counts_tokens_calls_and_cost():
    row = row_from_results("learned", "live", _example(), price_per_hour=3.6, policy_s=0.049, extra={"seed": 0})
    assert (row["name"], row["mode"], row["tokens"], row["seed"]) == ("learned", "live", 8, 0)
    assert row["seconds"] == pytest.approx(0.49)
    assert row["tokens_per_s"] == pytest.approx(8 / 0.49)
    assert row["tokens_per_call"] == pytest.approx(8 / 6)
    assert row["target_calls_per_token"] == pytest.approx(6 / 8)
    assert row["draft_calls_per_token"] == pytest.approx(7 / 8)
    assert row["acceptance_rate"] == pytest.approx(3 / 7)
    assert row["cost_per_1k_tokens"] == pytest.approx(0.49 / 8 * 1000 * 0.001)  # $3.6/h = $0.001/s
    assert row["policy_fraction"] == pytest.approx(0.1)
    assert row["k_hist"] == {"0": 1, "2": 1, "3": 1, "4": 1}
    assert row["accept_hist"] == {"0": 1, "1": 1, "2": 1}
    assert row["per_category"]["code"] == pytest.approx({"tokens": 5, "seconds": 0.21, "tokens_per_s": 5 / 0.21})
    assert row["per_category"]["other"]["tokens"] == 3
    assert row["per_prompt"] == {"category": ["code", "other"], "tokens": [5, 3],
                                 "seconds": [pytest.approx(0.21), pytest.approx(0.28)]}
    json.dumps(row)  # plain data


def test_latency_percentiles_share_step_time_among_its_tokens():
    row = row_from_results("x", "live", _example(), price_per_hour=1.0)
    # per token: 100 (prefill), 20, 20, 20, 50 | 200 (prefill), 40, 40 ms
    latency = [100, 20, 20, 20, 50, 200, 40, 40]
    assert sorted(latency) == [20, 20, 20, 40, 40, 50, 100, 200]
    assert row["latency_p50_ms"] == pytest.approx(40.0)  # position 3.5 of 8: between 40 and 40
    assert row["latency_p90_ms"] == pytest.approx(100 + 0.3 * 100)  # position 6.3
    assert row["latency_p99_ms"] == pytest.approx(100 + 0.93 * 100)  # position 6.93
    assert row["latency_p99_ms"] == pytest.approx(np.percentile(latency, 99))


def test_row_rejects_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        row_from_results("x", "offline", _example(), price_per_hour=1.0)
    with pytest.raises(ValueError, match="at least one prompt"):
        row_from_results("x", "live", [], price_per_hour=1.0)
    with pytest.raises(ValueError, match=r"\['tokens'\].*rename"):
        row_from_results("x", "live", _example(), price_per_hour=1.0, extra={"tokens": 1})


def test_speedups_compare_within_a_mode():
    rows = _rows()
    by = {(r["name"], r["mode"]): r for r in rows}
    # live: AR emits 5 tokens in 5 x 10 ms; static-k3 emits 17 tokens in 5 x 10 ms. Simulated steps take 20 ms.
    for mode in ("live", "simulated"):
        assert by["ar", mode]["speedup_vs_ar"] == pytest.approx(1.0)
        assert by["static-k3", mode]["speedup_vs_ar"] == pytest.approx(17 / 5)
        assert by["static-k3", mode]["per_category"]["code"]["speedup_vs_ar"] == pytest.approx(17 / 5)
    assert by["ar", "simulated"]["tokens_per_s"] == pytest.approx(by["ar", "live"]["tokens_per_s"] / 2)


def test_speedup_of_a_category_missing_from_the_baseline_is_none():
    rows = [_row("ar", "live", 1, 0.01, ["code"]), _row("learned", "live", 2, 0.01, ["code", "math"])]
    add_speedups(rows)
    assert rows[1]["per_category"]["math"]["speedup_vs_ar"] is None
    assert "-" in category_table(rows)


def test_missing_baseline_names_the_mode_and_the_fix():
    rows = [_row("ar", "live", 1, 0.01), _row("learned", "simulated", 2, 0.01)]
    with pytest.raises(ValueError, match=r"no 'ar' row in mode 'simulated'.*evaluate 'ar' in simulated mode"):
        add_speedups(rows)


def test_calibration_error():
    probs, labels = [0.25] * 4 + [0.75] * 4, [1, 0, 0, 0, 1, 1, 1, 0]  # each bin's frequency equals its probability
    assert calibration_error(probs, labels) == pytest.approx(0.0)
    assert calibration_error([1.0, 1.0], [1, 1]) == pytest.approx(0.0)  # p = 1 lands in the last bin
    assert calibration_error([0.9] * 10, [0] * 10) == pytest.approx(0.9)
    assert calibration_error([0.9] * 10 + [0.1] * 10, [1] * 5 + [0] * 5 + [0] * 10) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="as many labels"):
        calibration_error([0.5, 0.5], [1])
    with pytest.raises(ValueError, match="not logits"):
        calibration_error([2.0], [1])


# ---------------------------------------------------------------------- reports
def test_markdown_tables_list_every_row():
    rows = _rows()
    table = markdown_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| name | mode | tokens/s | speedup vs AR [95% CI] | vs best static [95% CI] |")
    for r in rows:
        assert f"| {r['name']} | {r['mode']} |" in table
    assert "3.40x" in table
    cats = category_table(rows)
    assert cats.splitlines()[0] == "| name | mode | chat | code |"
    assert "| static-k3 | live | 3.40x | 3.40x |" in cats
    assert "| - |" in markdown_table([_row("ar", "live", 1, 0.01)])  # no speedup yet


def test_write_eval_and_report(tmp_path):
    rows, meta = _rows(), {"target": "tiny:llama-4l", "prompts": 2}
    path = write_eval(tmp_path, rows, meta)
    ev = json.loads(path.read_text())
    assert path.name == "eval.json" and set(ev) == {"rows", "meta"} and ev["meta"] == meta
    assert [r["name"] for r in ev["rows"]] == [r["name"] for r in rows]
    assert "learned" in (tmp_path / "eval.md").read_text()

    plots = make_plots(ev, tmp_path / "plots")
    cmd = "python scripts/evaluate.py experiment=smoke"
    md, js = write_report(tmp_path, ev, command=cmd, sections={"Distillation": "val/accept_rate 0.61"}, plots=plots)
    text = md.read_text()
    assert f"```bash\n{cmd}\n```" in text
    assert "## Distillation\n\nval/accept_rate 0.61" in text
    assert "![speedup_by_policy](plots/speedup_by_policy.png)" in text
    assert "| static-k3 | live |" in text
    report = json.loads(js.read_text())
    assert set(report) == {"eval", "command", "sections", "plots"}
    assert report["command"] == cmd and "plots/k_distribution.png" in report["plots"]
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temporaries


def test_the_evaluated_mix_holds_held_out_sharegpt_and_revisions_reported_per_category(tiny_target, tmp_path):
    from test_config import cfg_for

    from sacpolicy.data import assign_split
    from sacpolicy.pipeline.context import RunContext, RunTraces

    ctx = RunContext(cfg_for("experiment=smoke", "collect.eval_only_prompts=3"), tmp_path)
    ctx.target = tiny_target
    extra = ctx.eval_only_prompts  # collect.eval_only: ShareGPT and revisions, taken in turn
    assert [r["category"] for r in extra] == ["sharegpt", "revision"] * 3
    assert all(assign_split(r["prompt_id"]) == "test" and r["input_ids"] for r in extra)
    mix = ctx.take(ctx.prompts("test"), 6)  # what collect draws of the data mix (collect.num_prompts.test)
    assert not {r["prompt_id"] for r in mix} & {r["prompt_id"] for r in extra}

    def traced(rows):  # test traces of these prompts (stand-ins: test_prompts reads their ids)
        test = {r["prompt_id"]: {} for r in rows}
        return RunTraces(grouped=test, by_split={"train": {}, "val": {}, "test": test}, dir=tmp_path, meta={})

    ctx.traces = traced(mix)  # a run collected without eval_only: the mix alone, in its order
    assert [r["prompt_id"] for r in ctx.test_prompts()] == [r["prompt_id"] for r in mix]
    ctx.traces = traced(mix + extra)
    order = ctx.test_prompts()
    ids = [r["prompt_id"] for r in order]
    assert sorted(ids) == sorted(r["prompt_id"] for r in mix + extra)
    assert [p for p in ids if p in {r["prompt_id"] for r in mix}] == [r["prompt_id"] for r in mix]
    assert {r["category"] for r in order[:4]} >= {"sharegpt", "revision"}  # spread: any live prefix holds them

    rows = [_row(name, "live", n, 0.01, categories=[r["category"] for r in order]) for name, n in (("ar", 1),
                                                                                                    ("learned", 3))]
    add_speedups(rows)
    write_eval(tmp_path, rows, {"target": "tiny:llama-4l"})
    for r in json.loads((tmp_path / "eval.json").read_text())["rows"]:
        assert r["per_category"]["sharegpt"]["tokens"] > 0 and r["per_category"]["revision"]["tokens"] > 0
    header = category_table(rows).splitlines()[0]
    assert "| revision |" in header and "| sharegpt |" in header and header in (tmp_path / "eval.md").read_text()


def test_eval_only_sets_are_on_by_default_off_with_an_empty_list_and_refuse_a_negative_count(tmp_path):
    from test_config import cfg_for

    from sacpolicy.pipeline.context import PipelineError, RunContext

    default = cfg_for().collect
    assert list(default.eval_only) == ["sharegpt", "revision"] and default.eval_only_prompts == 8
    assert RunContext(cfg_for("collect.eval_only=[]"), tmp_path).eval_only_prompts == []  # nothing loaded
    with pytest.raises(PipelineError, match=r"collect.eval_only_prompts=-1: give a count >= 0"):
        RunContext(cfg_for("collect.eval_only_prompts=-1"), tmp_path).eval_only_prompts


# ---------------------------------------------------------------------- intervals and flags
def _prompts_row(name, mode, rate, categories, seed):
    """A row over len(categories) prompts of 8-40 tokens at about ``rate`` tokens/s (noisy per prompt), AR steps."""
    rng = np.random.default_rng(seed)
    results = []
    for c in categories:
        n = int(rng.integers(8, 40))
        step_s = 1 / (rate * rng.uniform(0.8, 1.25))
        results.append((c, _result(step_s, [_step(None, 0, 0, 0, 1, 0.0, step_s) for _ in range(n - 1)])))
    return row_from_results(name, mode, results, price_per_hour=1.0)


def _interval(n, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(10, 200, n).astype(float)
    seconds_b = tokens / 20 * rng.uniform(0.7, 1.4, n)  # baseline about 20 tokens/s
    seconds_a = seconds_b / (1.5 * rng.uniform(0.8, 1.25, n))  # about 1.5x faster, varying by prompt
    point = (tokens.sum() / seconds_a.sum()) / (tokens.sum() / seconds_b.sum())
    lo, hi = paired_ratio_interval(tokens, seconds_a, tokens, seconds_b, idx=bootstrap_indices(n, seed=1))
    return point, lo, hi


def test_bootstrap_interval_contains_the_estimate_and_narrows_with_more_prompts():
    point, lo, hi = _interval(10)
    assert lo < point < hi and 1.0 < lo
    point_l, lo_l, hi_l = _interval(400)
    assert lo_l < point_l < hi_l
    assert hi_l - lo_l < (hi - lo) / 3  # width ~ 1/sqrt(n)
    assert _interval(10) == (point, lo, hi)  # seeded
    # paired: a constant speedup on every prompt has no width, however different the prompts are
    tokens, seconds = np.array([10.0, 300.0, 40.0]), np.array([1.0, 2.0, 9.0])
    assert paired_ratio_interval(tokens, seconds / 2, tokens, seconds, idx=bootstrap_indices(3)) == \
        pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="one value per prompt"):
        paired_ratio_interval(tokens, seconds, tokens[:2], seconds[:2], idx=bootstrap_indices(3))


def test_nested_interval_pairs_repeats_and_requests_and_takes_the_best_other_per_resample():
    """The load benchmark's interval: repeats, then requests, drawn with replacement, the same draw for every
    configuration; the best other chosen afresh in each resample; failed requests (NaN) left out."""
    rng = np.random.default_rng(0)
    base = rng.uniform(1.0, 5.0, size=(3, 40))  # [repeats, requests], each repeat its own server run
    p99 = lambda v: np.nanpercentile(v, 99, axis=-1)  # noqa: E731
    mean = lambda v: np.nanmean(v, axis=-1)  # noqa: E731
    # paired: a constant factor on every request has no width, however the requests vary; best other per resample
    for stat in (p99, mean):
        lo, hi = nested_ratio_interval(1.3 * base, {"a": base, "b": 2 * base}, stat)
        assert (lo, hi) == pytest.approx((1.3, 1.3))
    # the same server twice, each run with noise of its own per request: the interval holds 1 and is seeded
    a, b = (base * rng.uniform(0.8, 1.25, size=base.shape) for _ in range(2))
    lo, hi = nested_ratio_interval(a, {"b": b}, p99)
    assert lo < 1.0 < hi and (lo, hi) == nested_ratio_interval(a, {"b": b}, p99)
    # a configuration slower on every request by 1.5-2x: the interval excludes 1
    lo, hi = nested_ratio_interval(base * rng.uniform(1.5, 2.0, size=base.shape), {"a": base}, mean)
    assert 1.5 < lo < hi < 2.0
    # a failed request is left out of its configuration's figure, not counted as zero
    holed = base.copy()
    holed[0, 0] = np.nan
    assert np.isfinite(nested_ratio_interval(holed, {"a": base}, mean)).all()
    with pytest.raises(ValueError, match="same \\[repeats, requests\\]"):
        nested_ratio_interval(base, {"a": base[:2]}, mean)


def test_rows_get_intervals_against_ar_and_best_static_overall_and_per_category():
    cats = ["code"] * 5 + ["chat"] * 2
    rows = [_prompts_row("ar", "live", 10, cats, 0), _prompts_row("best-static", "live", 20, cats, 1),
            _prompts_row("learned", "live", 25, cats, 2)]
    add_speedups(rows)
    add_intervals(rows, resamples=500)
    ar, _, learned = rows
    assert ar["speedup_vs_ar"] == 1.0 and ar["speedup_vs_ar_ci"] == pytest.approx([1.0, 1.0])
    lo, hi = learned["speedup_vs_ar_ci"]
    assert lo < learned["speedup_vs_ar"] < hi and lo > 1.5
    assert learned["speedup_vs_best_static"] == pytest.approx(learned["tokens_per_s"] / rows[1]["tokens_per_s"])
    code, chat = learned["per_category"]["code"], learned["per_category"]["chat"]
    assert code["n_prompts"] == 5 and code["speedup_vs_ar_ci"][0] < code["speedup_vs_ar"] < code["speedup_vs_ar_ci"][1]
    assert chat["n_prompts"] == 2 and chat["speedup_vs_ar_ci"] is None and chat["speedup_vs_best_static"] > 0
    by_ar, by_static = category_table(rows), category_table(rows, "speedup_vs_best_static")
    learned_line = next(line for line in by_ar.splitlines() if line.startswith("| learned |"))
    assert f"{chat['speedup_vs_ar']:.2f}x (not enough prompts: 2)" in learned_line
    assert f"{code['speedup_vs_ar']:.2f}x [{code['speedup_vs_ar_ci'][0]:.2f}, " in learned_line
    assert "not enough prompts" in by_static and "not enough prompts" not in markdown_table(rows)
    assert f"{lo:.2f}, {hi:.2f}]" in markdown_table(rows)
    json.dumps(rows)
    rows.append(_prompts_row("other", "live", 10, cats[::-1], 3))  # the same prompts in another order
    with pytest.raises(ValueError, match="cannot be paired"):
        add_intervals(rows)


def test_learned_against_each_peer_row_gets_its_paired_interval_and_eval_md_a_line(tmp_path):
    """paired_ratios: the learned row over each peer row of the same mode, the interval add_intervals would give;
    a pair with a row missing in that mode is left out. eval.md lists each peer's tuned setting, best-peer marked,
    and "learned / best-peer" first."""
    from sacpolicy.evaluation.intervals import paired_ratios

    cats = ["code"] * 6
    rows = [_prompts_row("learned-hgb", "live", 25, cats, 2), _prompts_row("best-peer", "live", 20, cats, 1),
            _prompts_row("learned-hgb", "simulated", 25, cats, 2), _prompts_row("best-peer", "simulated", 20, cats, 1),
            _prompts_row("peer-a", "simulated", 10, cats, 3)]
    pairs = paired_ratios(rows, ["learned-hgb"], ["peer-a", "best-peer"], resamples=500)
    assert [(p["mode"], p["ref"]) for p in pairs] == [("live", "best-peer"), ("simulated", "peer-a"),
                                                       ("simulated", "best-peer")]  # no live peer-a row
    live = pairs[0]
    assert live["ratio"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]) and live["n_prompts"] == 6
    as_static = [dict(rows[0]), rows[1] | {"name": "best-static"}]  # the peer as add_intervals' baseline: the same
    add_intervals(as_static, resamples=500)
    assert as_static[0]["speedup_vs_best_static_ci"] == live["ci"]
    assert live["ci"][0] < live["ratio"] < live["ci"][1]
    meta = {"peers": {"a": {"settings": {"k": 3}, "val_tokens_per_s": 9.5},
                      "b": {"settings": {"p_min": 0.75}, "val_tokens_per_s": 19.5}},
            "best_peer": "b", "learned_vs_peers": pairs}
    write_eval(tmp_path, rows, meta)
    md = (tmp_path / "eval.md").read_text()
    assert "| peer-a | 9.5 | `{\"k\":3}` |" in md and "| peer-b (best-peer) | 19.5 | `{\"p_min\":0.75}` |" in md
    lines = [line for line in md.splitlines() if line.startswith("- learned / ")]
    assert lines[0] == (f"- learned / best-peer (live, learned-hgb vs peer-b, 6 prompts): {live['ratio']:.2f}x "
                        f"[{live['ci'][0]:.2f}, {live['ci'][1]:.2f}]") and len(lines) == 3
    assert "- peers:" not in md and json.loads((tmp_path / "eval.json").read_text())["meta"]["peers"]["b"]


def test_flag_fires_only_for_beating_ar_with_nothing_accepted():
    rows = [_row("ar", "simulated", 1, 0.02), _row("cheap-k0", "simulated", 1, 0.01),  # 1 token/call, 2x AR
            _row("slow-k0", "simulated", 1, 0.03), _row("static-k3", "simulated", 4, 0.02)]
    add_speedups(rows)
    flag_artefacts(rows)
    assert rows[1]["tokens_per_call"] == 1.0 and rows[1]["speedup_vs_ar"] > 1
    assert [r["beats_ar_nothing_accepted"] for r in rows] == [False, True, False, False]
    assert f"| cheap-k0 {MARK} |" in markdown_table(rows) and f"| static-k3 {MARK}" not in markdown_table(rows)


def test_eval_markdown_explains_intervals_ceilings_flags_and_skipped_simulation(tmp_path):
    rows = [_row("ar", "simulated", 1, 0.02), _row("best-static", "simulated", 2, 0.02),
            _row("learned-hgb", "simulated", 3, 0.02), _row("learned-hgb-in-sample", "simulated", 4, 0.02),
            _row("per-prompt-static", "simulated", 3, 0.02), _row("oracle", "simulated", 6, 0.02),
            _row("cheap", "simulated", 1, 0.01)]
    add_speedups(rows)
    add_intervals(rows)
    flag_artefacts(rows)
    share = gain_captured(rows, "learned-hgb", "learned-hgb-in-sample")
    assert share == pytest.approx((13 - 9) / (17 - 9))  # tokens over the same seconds: 13 vs 9 and 17
    assert gain_captured(rows, "learned-hgb", "ar") is None  # AR gains nothing over best static
    write_eval(tmp_path, rows, {"bootstrap_resamples": 2000, "in_sample_skipped": {"mlp": "one label only"}})
    md = (tmp_path / "eval.md").read_text()
    assert "- learned-mlp-in-sample: none, one label only" in md
    assert "## Ceilings (simulated on the test traces)" in md
    assert "- learned-hgb captures 50% of learned-hgb-in-sample's gain over best-static (target: >= 75%)" in md
    assert "- per-prompt-static: the best static" in md and "- oracle:" in md
    assert f"- {MARK} {ARTEFACT}." in md and "95% paired bootstrap interval over prompts (2000 resamples)" in md
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ev["rows"][2]["speedup_vs_best_static_ci"] == pytest.approx([13 / 9, 13 / 9])  # same per prompt

    note = "No simulated rows: these traces were recorded with sampling (temperature > 0), which ..."
    write_eval(tmp_path, [_row("ar", "live", 1, 0.01)], {"simulated_skipped": note})
    md = (tmp_path / "eval.md").read_text()
    assert f"- {note}" in md and "| simulated |" not in md and "Ceilings" not in md and MARK not in md


def test_simulated_vs_live_sets_every_live_row_against_its_simulated_one(tmp_path):
    """Simulated rows at 20 ms a step against live ones at 10: simulated is half the live tokens/s (-50%); the
    report says how far the probes of the machine's speed moved while the live rows ran."""
    rows = _rows()
    errors = simulated_vs_live(rows)
    assert set(errors) == {"ar", "static-k1", "static-k3", "learned", "heuristic"}
    for e in errors.values():
        assert e["error"] == pytest.approx(-0.5) and e["simulated"] == pytest.approx(e["live"] / 2)
    assert simulated_vs_live([r for r in rows if r["mode"] == "live"]) == {}  # no simulated row: nothing to set against

    speed = {"context": 256, "reference": "probe", "reference_s": 0.05, "probes_s": [0.024, 0.026, 0.025],
             "ratio": 0.5}
    write_eval(tmp_path, rows, {"machine_speed": speed, "simulated_vs_live": errors})
    md = (tmp_path / "eval.md").read_text()
    assert "## Simulated vs live" in md and "| learned | 130.0 | 260.0 | -50% |" in md
    assert ("took 24.0-26.0 ms over 3 probes (median 25.0 ms, 0.50x the profile's own probe, 50.0 ms)" in md)
    assert "simulated_vs_live:" not in md  # the table, not a dict in the setup list
    write_eval(tmp_path, rows, {"simulated_vs_live": errors})
    assert "No probe of the machine's speed" in (tmp_path / "eval.md").read_text()


def test_speed_probe_times_the_pass_against_the_profiles_probe(tiny_target, tiny_draft, caplog):
    """The profile records its probe of the one-token pass; a probe timed again on the same idle machine lands near
    it (the ratio is a timing, so only bounded loosely); a cost model without a probe is set against its priced
    pass; a ratio far off 1 is warned of."""
    from dataclasses import replace

    from sacpolicy.profiling import profile
    from sacpolicy.profiling.drift import SpeedProbe

    cost = profile(tiny_target.model, [NgramDrafter()], ks=(0, 2), context_lens=(16, 32), repeats=2, warmup=1)
    assert cost.meta["speed_probe"]["context"] == 32 and cost.meta["speed_probe"]["seconds"] > 0
    probe = SpeedProbe(tiny_target.model, cost)
    with pytest.raises(ValueError, match="before any probe"):
        probe.summary()
    assert probe() > 0 and probe() > 0
    summary = probe.summary()
    assert summary["reference"] == "probe" and len(summary["probes_s"]) == 2 and 0.1 < summary["ratio"] < 10

    old = SpeedProbe(tiny_target.model, replace(cost, meta={"context_lens": [16, 32]}))
    assert old.reference == "cost model" and old.context == 32
    assert old.reference_s == pytest.approx(cost.verify_time(0, 32) - cost.step_base)
    slow = SpeedProbe(tiny_target.model, replace(cost, meta={"speed_probe": {"context": 32, "seconds": 1e-9}}))
    slow()
    with caplog.at_level("WARNING"):
        assert slow.summary()["ratio"] > 1.05
    assert "priced at the profile's speed" in caplog.text


# ---------------------------------------------------------------------- plots
def test_make_plots_writes_pngs(tmp_path):
    plots = make_plots({"rows": _rows()}, tmp_path)
    assert {p.name for p in plots} == {"speedup_by_policy.png", "speedup_by_category.png", "acceptance_hist.png",
                                       "k_distribution.png", "cost_per_1k.png", "speedup_vs_k.png"}
    for p in plots:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


def test_make_plots_skips_empty_data(tmp_path):
    assert make_plots({"rows": []}, tmp_path) == []
    rows = [_row("ar", "live", 1, 0.01), _row("oracle", "live", 1, 0.01)]  # a key row that never drafted
    add_speedups(rows)
    names = {p.name for p in make_plots({"rows": rows}, tmp_path)}
    assert names == {"speedup_by_policy.png", "speedup_by_category.png", "k_distribution.png", "cost_per_1k.png"}
    assert speedup_vs_k_plot(rows, tmp_path / "k.png") is None and not (tmp_path / "k.png").exists()


def test_calibration_plot(tmp_path):
    rng = np.random.default_rng(0)
    probs = rng.uniform(size=500)
    path = calibration_plot(probs, rng.uniform(size=500) < probs, tmp_path / "sub" / "cal.png", title="Acceptance")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_live_policies_pick_rows_by_pattern_and_refuse_unknown_ones():
    from sacpolicy.evaluation.evaluate import EvalSettings, check_live_policies, live_factories, policy_factories

    def settings(live):
        return EvalSettings(ks=(1, 4), k_max=8, live_prompts=2, max_new_tokens=8, price_per_hour=1.0,
                            confidence_grid=(0.5,), live_policies=live)

    chosen = {"best_static": {"drafter": "ngram", "k": 4}, "confidence_threshold": 0.3}
    make = policy_factories(settings(None), chosen, None, {"hgb": None, "mlp": None}, live=True)
    assert list(live_factories(settings(None), make)) == list(make) and "static-k4" in make
    picked = live_factories(settings(("learned-*", "ar", "best-static")), make)
    # the rows' order, not the patterns'; each predictor's row the other way (learning while serving or not) too
    assert list(picked) == ["ar", "best-static", "learned-hgb", "learned-hgb-online", "learned-mlp",
                            "learned-mlp-online"]
    assert picked["best-static"]().k == 4
    with pytest.raises(ValueError, match=r"\['learned-logreg'\] match no policy row; rows are \['ar'"):
        check_live_policies(settings(("ar", "learned-logreg")), ["hgb", "mlp"])
    check_live_policies(settings(("ar", "learned-mlp")), ["hgb", "mlp"])
    # `learned` alone is the headline predictor's row, and nothing without predictors
    assert list(live_factories(settings(("ar", "learned")), make, headline="mlp")) == ["ar", "learned-mlp"]
    check_live_policies(settings(("ar", "learned")), ["hgb"])
    with pytest.raises(ValueError, match=r"\['learned'\] match no policy row"):
        check_live_policies(settings(("ar", "learned")), [])


def test_headline_predictor_is_the_lowest_validation_log_loss():
    from sacpolicy.evaluation.evaluate import headline_predictor

    def val(loss):
        return {"val": {"log_loss": loss}, "test": {"log_loss": 0.1}}  # the test split never counts

    assert headline_predictor({"hgb": val(0.555), "logreg": val(0.565), "mlp": val(0.539)}) == "mlp"
    assert headline_predictor({"hgb": val(float("nan")), "mlp": val(None), "svm": {}, "logreg": val(0.9)}) == \
        "logreg"  # a missing or NaN loss ranks last
    assert headline_predictor({}) is None


def test_live_rows_count_the_requests_that_dropped_a_drafter_and_the_report_says_so(tiny_target, tmp_path):
    """A drafter the decoder drops for a request (it raised) is counted in the live rows that ran it, per drafter,
    marked and footnoted in eval.md: a row timed without its drafter does not pass for the policy as configured."""
    from types import SimpleNamespace

    from toys import FlakyNgram, mixed_prompts

    from sacpolicy.evaluation.evaluate import EvalSettings, live_rows

    rows = [{"input_ids": p, "category": "c"} for p in mixed_prompts([6, 9], seed=0, repeats=4)]  # flaky one last
    settings = EvalSettings(ks=(3,), k_max=4, live_prompts=None, max_new_tokens=12, price_per_hour=1.0,
                            confidence_grid=(0.5,), live_policies=("ar", "static-k3"), speed_probe_every=0)
    chosen = {"best_static": {"drafter": "flaky", "k": 3}, "confidence_threshold": 0.5}
    live = live_rows(settings, chosen, None, {}, SimpleNamespace(model=tiny_target.model, eos_token_ids=[]),
                     [FlakyNgram(name="flaky")], rows, progress=False)
    by = {r["name"]: r for r in live}
    assert by["static-k3"]["dropped_drafters"] == {"flaky": 1} and by["ar"]["dropped_drafters"] == {}
    assert _row("ar", "simulated", 1, 0.01)["dropped_drafters"] == {}  # every row has the count
    add_speedups(live)
    write_eval(tmp_path, live, {})
    assert json.loads((tmp_path / "eval.json").read_text())["rows"][1]["dropped_drafters"] == {"flaky": 1}
    md = (tmp_path / "eval.md").read_text()
    assert "| static-k3 † | live |" in md and "| ar | live |" in md
    assert "† drafters dropped (they raised; those requests were decoded and timed without them" in md
    assert "static-k3 (live): flaky in 1 of 3 requests" in md
