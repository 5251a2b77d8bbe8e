"""Suffix drafter settings against the n-gram drafter by exact greedy replay: what tuning the suffix drafter can buy.

    python scripts/bench_suffix.py --cost outputs/suffix_pool/cost.json                  # revision, code edits
    python scripts/bench_suffix.py --split val --settings 1:0.1:24,4:0.1:48,8:0.1:48,32:0.03:64 --ks 4,8
    python scripts/bench_suffix.py --prompts 2 --max-new-tokens 16 --cost <cost.json>    # smoke run

The target's greedy output of each held-out prompt (``--split``: tune on ``val``, report on ``test``) is decoded once.
Each drafter's proposal at every position of it is then its teacher-forced block (``traces.collect.
teacher_forced_rows``, the collect stage's: what a live row proposes on the same committed tokens, the suffix
drafter's global index fed in request order as live decoding feeds it), and static-k decoding with each drafter is
replayed over those rows through the real decoder loop (``traces.simulate.simulate``). Target calls and tokens are
exact for greedy decoding, with no machine noise; seconds are the cost model's (``--cost``: a run's ``cost.json``
that prices a ``suffix`` drafter, e.g. a ``draft=[ngram,suffix]`` run; every setting is priced as that drafter,
so a deeper index's longer lookup is not). A setting is ``spec_factor:min_token_prob:max_depth``
(``SuffixDrafter``'s; the first listed is the default's). Per source, setting and k: tokens per target call and
predicted tokens/s, each against the n-gram drafter at the same k, with paired bootstrap intervals over prompts.
Prints a Markdown table and writes ``bench_suffix.json``.
"""

from __future__ import annotations

import sys

from sacpolicy import bench

DEFAULT_SETTINGS = "1:0.1:24,4:0.1:48,8:0.1:48"


def parse_settings(text: str) -> list[tuple[float, float, int]]:
    """``"1:0.1:24,8:0.1:48"`` -> [(spec_factor, min_token_prob, max_depth), ...]."""
    out = []
    for item in (x for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 3:
            raise SystemExit(f"bench_suffix: a setting is spec_factor:min_token_prob:max_depth, got {item!r} (e.g. "
                             "8:0.1:48)")
        out.append((float(parts[0]), float(parts[1]), int(parts[2])))
    return out


def setting_name(s: tuple[float, float, int]) -> str:
    return f"suffix sf{s[0]:g} p{s[1]:g} d{s[2]}"


def greedy_outputs(lm, rows: list[dict], max_new_tokens: int) -> list[tuple[list[int], object]]:
    """Each prompt's greedy output and the target's logits behind it (one autoregressive decode each)."""
    from sacpolicy.decoding import SpeculativeDecoder
    from sacpolicy.policy import Autoregressive

    dec = SpeculativeDecoder(lm.model, [], Autoregressive(), stop_token_ids=lm.eos_token_ids)
    outs = []
    for r in rows:
        res = dec.generate(r["input_ids"], max_new_tokens, keep_logits=True)
        outs.append((list(res.tokens), res.logits))
    return outs


def replay(lm, rows, outs, setting, ks: list[int], cost) -> dict:
    """Static k of the n-gram drafter and of the suffix drafter at ``setting``, replayed over teacher-forced rows:
    per configuration ``ngram-k<k>`` / ``suffix-k<k>`` the per-prompt tokens, target calls and predicted seconds."""
    from sacpolicy.decoding import NgramDrafter
    from sacpolicy.decoding.suffix import SuffixDrafter
    from sacpolicy.policy import Static
    from sacpolicy.traces.collect import teacher_forced_rows
    from sacpolicy.traces.simulate import group_traces, simulate

    sf, p, depth = setting
    drafters = [NgramDrafter(name="ngram"), SuffixDrafter(max_depth=depth, spec_factor=sf, min_token_prob=p,
                                                          name="suffix")]
    traces = []
    for r, (generated, logits) in zip(rows, outs):  # request order: the suffix drafter's global index grows along
        traces += teacher_forced_rows(lm.model, drafters, r, generated, max(ks), target_logits=logits)
    grouped = group_traces(traces)
    out = {}
    for k in ks:
        for name in ("ngram", "suffix"):
            sim = simulate(Static(k, name), grouped, cost, vocab_size=lm.model.config.vocab_size)
            out[f"{name}-k{k}"] = {"tokens": [len(res.tokens) for _, res in sim.results],
                                   "calls": [res.target_calls for _, res in sim.results],
                                   "seconds": [res.total_s for _, res in sim.results]}
    return out


def summarize(per: dict, ks: list[int]) -> list[dict]:
    """Per k: the setting's tokens per call and predicted tokens/s over the n-gram drafter's, paired intervals."""
    from sacpolicy.evaluation.intervals import bootstrap_indices, paired_ratio_interval

    rows = []
    for k in ks:
        s, n = per[f"suffix-k{k}"], per[f"ngram-k{k}"]
        idx = bootstrap_indices(len(s["tokens"]))
        row = {"k": k}
        for what, den in (("tokens_per_call", "calls"), ("tokens_per_s", "seconds")):
            mine, theirs = sum(s["tokens"]) / sum(s[den]), sum(n["tokens"]) / sum(n[den])
            row[what], row[f"ngram_{what}"], row[f"{what}_vs_ngram"] = mine, theirs, mine / theirs
            if len(s["tokens"]) >= 3:
                row[f"{what}_interval"] = paired_ratio_interval(s["tokens"], s[den], n["tokens"], n[den], idx=idx)
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    lines = []
    for source, by_setting in results.items():
        for name, rows in by_setting.items():
            for r in rows:
                lines.append([source, name, r["k"], bench.cell(r["tokens_per_call"]),
                              bench.cell(r["ngram_tokens_per_call"]),
                              bench.ratio(r["tokens_per_call_vs_ngram"], r.get("tokens_per_call_interval")),
                              bench.ratio(r["tokens_per_s_vs_ngram"], r.get("tokens_per_s_interval"))])
    return bench.table(["source", "suffix setting", "k", "tokens / call", "n-gram tokens / call",
                        "tokens / call vs n-gram", "predicted tokens/s vs n-gram"], lines)


def main(argv=None) -> None:
    ap = bench.parser(__doc__)
    bench.add_target(ap)
    ap.add_argument("--cost", required=True, help="a run's cost.json that prices a 'suffix' drafter")
    ap.add_argument("--sources", default="revision,humaneval_edit", help="prompt sets, comma-separated")
    ap.add_argument("--split", default="test", help="held-out split: val to tune, test to report")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", type=bench.int_list, default=[8])
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help="suffix settings spec_factor:min_token_prob:max_depth, comma-separated")
    bench.add_out(ap, "bench_suffix.json")
    args = ap.parse_args(argv)
    from sacpolicy.runtime.cost import CostModel

    cost = CostModel.from_json(args.cost)
    if "suffix" not in cost.draft or "ngram" not in cost.draft:
        raise SystemExit(f"bench_suffix: {args.cost} prices {sorted(cost.draft)}; it needs 'ngram' and 'suffix' "
                         "(the cost.json of a run with draft=[ngram,suffix])")
    settings = parse_settings(args.settings)
    lm = bench.load_target(args.target)
    results, raw = {}, {}
    for source in [s for s in args.sources.split(",") if s]:
        rows = bench.held_out_prompts(source, lm.tokenizer, split=args.split, n=args.prompts)
        outs = greedy_outputs(lm, rows, args.max_new_tokens)
        results[source], raw[source] = {}, {}
        for s in settings:
            raw[source][setting_name(s)] = per = replay(lm, rows, outs, s, args.ks, cost)
            results[source][setting_name(s)] = summarize(per, args.ks)
    md = markdown(results)
    print(md)
    print(f"\n{args.prompts} {args.split} prompts per source, {args.max_new_tokens} new tokens, greedy; wrote "
          f"{bench.write_results(args.out, {'results': results, 'per_prompt': raw, 'markdown': md}, args)}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
