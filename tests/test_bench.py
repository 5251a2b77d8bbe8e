"""sacpolicy.bench, what the benchmark scripts share: Markdown tables, ratio cells, the alternating order of timed
configurations, option lists, the JSON they write, the held-out prompts they load; and a bench script run in this
process on the tiny target (bench_decoder with the trace cost folded into it)."""

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
from toys import load_script

from sacpolicy import bench
from sacpolicy.data import assign_split, load_prompts

ROOT = Path(__file__).resolve().parents[1]


def test_table_is_markdown_with_a_rule_under_the_header():
    md = bench.table(["policy", "tokens/s", "lossless"], [["ar", "12.3", "yes"], ["static-k2", 15, None]])
    assert md.splitlines() == ["| policy | tokens/s | lossless |", "|---|---|---|", "| ar | 12.3 | yes |",
                               "| static-k2 | 15 | None |"]
    assert bench.table(["a"], []) == "| a |\n|---|"
    assert bench.table(["a", "b"], iter([(1, 2)])).endswith("| 1 | 2 |")  # any iterable of rows


def test_ratio_shows_its_interval_or_its_range_over_runs():
    assert bench.ratio(1.2345) == "1.23x"
    assert bench.ratio(1.2, [1.104, 1.311]) == "1.20x [1.10, 1.31]"
    assert bench.ratio(1.2, None) == bench.ratio(1.2, []) == "1.20x"  # no interval: none shown
    assert bench.ratio(1.0, runs=[0.9, 1.12, 1.0]) == "1.00x (0.90-1.12)"
    assert bench.ratio(1.0, runs=[1.05]) == "1.00x"  # one run has no range
    assert bench.ratio(float("nan")) == "nanx"
    assert bench.cell(None) == "-" and bench.cell(0.12345) == "0.12" and bench.cell(0.12345, ".3f") == "0.123"


def test_alternating_reverses_the_order_every_other_repeat():
    order = list(bench.alternating(["a", "b", "c"], 3))
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
    assert list(bench.alternating(["a", "b"], 0)) == []
    # over an even number of repeats every name sits at the same mean position: a linear drift cancels
    names = ["a", "b", "c", "d"]
    slots = Counter()
    for i, (_, name) in enumerate(bench.alternating(names, 4)):
        slots[name] += i % len(names)
    assert len(set(slots.values())) == 1


def test_int_list_parses_comma_separated_options():
    assert bench.int_list("1,2,4") == [1, 2, 4]
    assert bench.int_list("8") == [8] and bench.int_list("") == [] and bench.int_list("1,,3") == [1, 3]
    with pytest.raises(ValueError):
        bench.int_list("1,x")


def test_write_results_writes_args_then_payload_atomically(tmp_path):
    args = argparse.Namespace(out=str(tmp_path / "r.json"), prompts=4)
    path = bench.write_results(tmp_path / "sub" / "r.json", {"rows": [{"name": "ar"}], "where": tmp_path}, args)
    data = json.loads(path.read_text())
    assert list(data) == ["args", "rows", "where"] and data["args"] == {"out": args.out, "prompts": 4}
    assert data["where"] == str(tmp_path)  # paths and other objects as strings
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left beside it
    bench.write_results(path, {"rows": []})
    assert json.loads(path.read_text()) == {"rows": []}  # without args: the payload alone, replacing the old file


def test_parser_keeps_the_docstring_and_adds_the_shared_options():
    doc = "Title.\n\n    python scripts/bench_x.py --prompts 4     # a quick subset\n"
    ap = bench.parser(doc)
    bench.add_target(ap, device="cpu", dtype="auto")
    bench.add_prompt_set(ap, split="val", prompts=6, max_tokens=48)
    bench.add_out(ap, "bench_x.json")
    assert "    python scripts/bench_x.py --prompts 4     # a quick subset" in ap.format_help()
    assert "its validation split is used" in ap.format_help()
    args = ap.parse_args([])
    assert vars(args) == {"target": bench.EMBEDDED_TARGET, "device": "cpu", "dtype": "auto", "source": "mt_bench",
                          "prompts": 6, "max_tokens": 48, "out": "bench_x.json"}
    assert ap.parse_args(["--prompts", "2", "--out", "o.json"]).prompts == 2
    bare = bench.parser(None)
    bench.add_target(bare)  # no --device / --dtype unless given a default
    assert vars(bare.parse_args([])) == {"target": bench.EMBEDDED_TARGET}


def test_held_out_prompts_are_one_split_in_file_order(tiny_target):
    every = list(load_prompts("mt_bench", tokenizer=tiny_target.tokenizer))
    val = bench.held_out_prompts("mt_bench", tiny_target.tokenizer, split="val", n=3)
    assert [r["prompt_id"] for r in val] == [r["prompt_id"] for r in every if assign_split(r["prompt_id"]) == "val"][:3]
    test = bench.held_out_prompts("mt_bench", tiny_target.tokenizer)
    assert test and all(assign_split(r["prompt_id"]) == "test" for r in test)


def test_bench_decoder_times_the_trace_pass_against_live_decoding(tmp_path, capsys):
    """scripts/bench_decoder.py --trace-cost in this process on the tiny target: the rows' table and the trace cost
    per position (the fold of the former bench_traces.py)."""
    script = load_script("bench_decoder")
    report = script.main(["--target", "tiny:llama-4l", "--dtype", "float32", "--prompts", "2", "--warmup", "1",
                          "--max-new-tokens", "6", "--ks", "2", "--drafters", "ngram", "--layers", "2",
                          "--trace-cost", "--out", str(tmp_path / "d.json")])
    assert json.loads((tmp_path / "d.json").read_text()) == json.loads(json.dumps(report, default=str))
    rows = {r["name"]: r for r in report["rows"]}
    assert {"ar", "hf-ar", "ngram-static-k2", "ngram-heuristic", "hf-prompt-lookup-k2"} <= set(rows)
    assert all(r["lossless"] for r in rows.values())
    tc = report["meta"]["trace_cost"]
    assert tc["drafters"] == ["ngram"] and tc["positions"] == rows["ar"]["tokens"]  # the same greedy outputs
    ours = [rows["ngram-static-k2"], rows["ngram-heuristic"]]
    assert tc["live_s_per_position"] == pytest.approx(sum(r["seconds"] for r in ours) / sum(r["tokens"] for r in ours))
    live, tf = tc["live_s_per_position"], tc["teacher_forced_s_per_position"]
    assert tc["teacher_forced_speedup"] == pytest.approx(live / tf) and tf > 0
    out = capsys.readouterr().out
    assert "| ngram-static-k2 |" in out and "Trace cost over" in out and "| ours / transformers" in out


def test_bench_decoder_races_the_suffix_drafter_on_another_prompt_sets_test_split(tmp_path):
    """--source picks the prompt set (its held-out test split) and ``suffix`` is a drafter of its rows, lossless."""
    script = load_script("bench_decoder")
    report = script.main(["--target", "tiny:llama-4l", "--dtype", "float32", "--prompts", "2", "--warmup", "1",
                          "--max-new-tokens", "6", "--ks", "2", "--drafters", "ngram,suffix", "--layers", "2",
                          "--source", "revision", "--only", "ngram-static,suffix-static",
                          "--out", str(tmp_path / "d.json")])
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "hf-ar", "ngram-static-k2", "suffix-static-k2"}
    assert all(r["lossless"] for r in rows.values()) and report["meta"]["source"] == "revision"


def test_the_head_shipping_gate_measures_validation_prompts_never_the_test_split(tiny_target, tmp_path, monkeypatch):
    """bench_eagle3 ``ship`` compares heads on the val split: ``eval --split val`` selects exactly the val prompts,
    and a curve of the test split (where the headline is measured) is refused even when the new head wins on it."""
    import sacpolicy.training.distill_data as distill_data

    script = load_script("bench_eagle3")
    assert script.SHIP_SPLIT == "val"
    cached = []
    monkeypatch.setattr(distill_data, "cached_dataset", lambda name, key, build: cached.append(key) or key)
    sets = script.held_out(tiny_target, 4, script.SHIP_SPLIT, names=("mt_bench", "humaneval"))
    for name, (rows, _) in sets.items():
        every = list(load_prompts(name, tokenizer=tiny_target.tokenizer))
        assert rows["prompt_id"] == [r["prompt_id"] for r in every if assign_split(r["prompt_id"]) == "val"], name
        assert rows["prompt_id"] and all(assign_split(p) == "val" for p in rows["prompt_id"])
    assert all(key.endswith("-val") for key in cached)  # never the test split's cached continuations

    head, out = tmp_path / "new-head", tmp_path / "shipped"

    def curve(split, new_len):
        rows = [{"name": "shipped", "path": "shipped", **{n: {"accept_len_3": 1.5} for n in script.SETS}},
                {"name": "new", "path": str(head), **{n: {"accept_len_3": new_len} for n in script.SETS}}]
        (tmp_path / f"{split}.json").write_text(json.dumps({"rows": rows, "meta": {"split": split}}))
        return ["ship", "--head", str(head), "--out", str(out), "--curve-json", str(tmp_path / f"{split}.json")]

    with pytest.raises(SystemExit, match=r"measured on the test split.*eval --split val --heads shipped=shipped"):
        script.main(curve("test", 2.0))
    with pytest.raises(SystemExit, match="does not beat the shipped head on val"):
        script.main(curve("val", 1.4))
    script.check_beats_shipped(json.loads(Path(curve("val", 2.0)[-1]).read_text()), head)  # a val win passes
    assert not out.exists()  # a refused head writes nothing


def test_bench_suffix_replays_exactly_what_live_decoding_does(tiny_target):
    """The replay's target calls per prompt equal a live greedy decode's with the same drafter setting, the suffix
    drafter's global index grown over the prompts in the same order; ratios pair prompts."""
    from toys import mixed_prompts

    from sacpolicy.decoding import NgramDrafter, SpeculativeDecoder
    from sacpolicy.decoding.suffix import SuffixDrafter
    from sacpolicy.policy import Static
    from sacpolicy.runtime.cost import CostModel
    from sacpolicy.runtime.curve import PiecewiseLinear

    cli = load_script("bench_suffix")
    assert cli.parse_settings("1:0.1:24,8:0.05:48") == [(1.0, 0.1, 24), (8.0, 0.05, 48)]
    with pytest.raises(SystemExit, match="spec_factor:min_token_prob:max_depth"):
        cli.parse_settings("8:0.1")
    prompts = mixed_prompts((9, 14), seed=4, repeats=6) + [[9, 10, 11, 12, 13] * 4]
    rows = [{"input_ids": p, "prompt_id": f"p{i}", "category": "other"} for i, p in enumerate(prompts)]
    outs = cli.greedy_outputs(tiny_target, rows, 24)
    line = PiecewiseLinear([0.0, 1000.0], [1e-4, 1e-4])
    cost = CostModel("cpu", {"tokens": PiecewiseLinear([1, 9], [0.01, 0.012]), "per_context": 0.0},
                     {"ngram": line, "suffix": line}, {"ngram": False, "suffix": False})
    setting = (4.0, 0.1, 32)
    per = cli.replay(tiny_target, rows, outs, setting, [2, 6], cost)
    for k in (2, 6):
        for name, make in (("ngram", lambda: NgramDrafter(name="ngram")),
                           ("suffix", lambda: SuffixDrafter(max_depth=32, spec_factor=4.0, name="suffix"))):
            dec = SpeculativeDecoder(tiny_target.model, [make()], Static(k, name),
                                     stop_token_ids=tiny_target.eos_token_ids)
            live = [dec.generate(p, 24) for p in prompts]  # one drafter object: its global index grows along
            assert [r.tokens for r in live] == [o for o, _ in outs]
            assert per[f"{name}-k{k}"]["calls"] == [r.target_calls for r in live], (name, k)
    assert sum(per["suffix-k6"]["calls"]) < sum(len(o) for o, _ in outs)  # it drafted and was accepted
    rows_k = cli.summarize(per, [2, 6])
    r6 = rows_k[1]
    assert r6["tokens_per_call"] == pytest.approx(sum(per["suffix-k6"]["tokens"]) / sum(per["suffix-k6"]["calls"]))
    assert r6["tokens_per_call_vs_ngram"] == pytest.approx(r6["tokens_per_call"] / r6["ngram_tokens_per_call"])
    lo, hi = r6["tokens_per_call_interval"]
    assert lo <= r6["tokens_per_call_vs_ngram"] <= hi
    assert "suffix sf4 p0.1 d32" in cli.markdown({"revision": {cli.setting_name(setting): rows_k}})


def test_a_timed_run_where_a_request_dropped_its_drafter_is_refused_unless_allowed(tiny_target, caplog):
    """A drafter that raises is dropped for its request and decoding goes on: a benchmark timing that request would
    time the configuration without it. live_static_k (which bench_distill and bench_eagle3 share) refuses, naming
    the configuration, the request, the drafter and the option that allows it; allowed, it warns."""
    import logging

    from toys import FlakyNgram, mixed_prompts

    prompts = mixed_prompts([6], seed=0, repeats=4)  # the random prompt (also the warm-up), then the repetitive one
    fix = r"1 of 1 timed requests dropped a drafter that raised \(request 1: flaky\).*--allow-dropped-drafters"
    with pytest.raises(bench.DroppedDrafterError, match="k2: " + fix):
        bench.live_static_k(tiny_target, FlakyNgram(name="flaky"), prompts, [2], 8)
    with caplog.at_level(logging.WARNING, logger="sacpolicy.bench"):
        out = bench.live_static_k(tiny_target, FlakyNgram(name="flaky"), prompts, [2], 8, allow_dropped=True)
    assert out["best_k"] == 2 and "k2: " in caplog.text and "request 1: flaky" in caplog.text
    assert bench.check_drafters_kept("x", [[], ["a", "b"], ["a"]], allow=True) == {"a": 2, "b": 1}
    assert bench.check_drafters_kept("x", [[], []]) == {}
    ap = bench.parser("doc")
    bench.add_allow_dropped(ap)
    assert ap.parse_args(["--allow-dropped-drafters"]).allow_dropped_drafters
    assert not ap.parse_args([]).allow_dropped_drafters
