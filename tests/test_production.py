"""The production loop's first half: the served proposer's step log (sacpolicy.export.steplog) and the traces rebuilt
from it (sacpolicy.traces: logformat, steplog_read, production, vllm_compare, served_replay).

Fast: a fake engine drives ``PolicyProposer.propose`` as vLLM does (rows reorder, join and leave between steps;
each step verifies the previous step's drafts against a deterministic greedy "target" and hands the proposer the
tokens it committed), and the log must equal that engine's truth: every request's token sequence, its drafted and
accepted tokens per step, the live batch size and the feature row the policy read. The engine thread never waits on
the writer (a blocked writer: steps are dropped and counted, ``propose`` returns at once). Rebuilt traces load in
``load_traces`` and the logged policy's replay over them reproduces the logged accepted counts exactly. Damaged
shards and logs of another target or tokenizer are refused with the file and the fix. Sampled serving: the log holds
each request's sampling settings (read where vLLM's runner holds them), sampled requests are refused without a target
pass, and with one (a tiny target) their traces equal the collector's for the same sequences.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from toys import LOOKUP_DRAFTERS, load_script, lookup_rule, ngram_rule

from sacpolicy.export import steplog, steplog_writer
from sacpolicy.export.vllm import LOG_ENV, PolicyProposer
from sacpolicy.runtime import save_policy
from sacpolicy.runtime.features import RowContext, accept_rate, feature_row, next_accept_history
from sacpolicy.traces.logformat import StepLogError
from sacpolicy.traces.production import build_production_traces
from sacpolicy.traces.schema import load_traces, read_meta
from sacpolicy.traces.served_replay import replay_logged
from sacpolicy.traces.steplog_read import read_step_log, requests_of
from sacpolicy.traces.vllm_compare import compare_with_vllm

VOCAB, MAX_LEN, K = 9, 256, 6
TARGET = "toy:greedy-target"


def next_token(ctx: list[int]) -> int:
    """A deterministic greedy "target": mostly periodic (the n-gram drafter's copies are accepted), now and then
    breaking the period (they are rejected)."""
    h = hashlib.blake2b(bytes(ctx[-3:]), digest_size=2).digest()
    if h[0] < 40:  # ~16%: a token the period does not predict
        return h[1] % VOCAB
    return ctx[-4] if len(ctx) >= 4 else (ctx[-1] + 1) % VOCAB


def vllm_config(tokenizer="toy-tokenizer", vocab=VOCAB):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                           model_config=SimpleNamespace(max_model_len=MAX_LEN, model="/models/toy", tokenizer=tokenizer,
                                                        get_vocab_size=lambda: vocab),
                           scheduler_config=SimpleNamespace(max_num_seqs=16))


def proposer(tmp_path, monkeypatch, mode="stop", log="log", tokenizer="toy-tokenizer", target=TARGET, vocab=VOCAB):
    monkeypatch.setenv(LOG_ENV, str(tmp_path / log))
    policy = save_policy(tmp_path / f"policy-{mode}", ngram_rule(mode), drafters={"ngram": {"kind": "ngram",
                         "max_ngram": 3}}, provenance={"target": target}, metrics={})
    return PolicyProposer(vllm_config(tokenizer, vocab), str(policy))


class FakeEngine:
    """vLLM's side of the hook: each step verifies every scheduled request's drafts against ``next_token`` (accepted
    while they match, then the target's own token), hands the proposer what each row committed, stores its new
    drafts. Rows are shuffled every step; requests join at their arrival step and leave once they have ``new``
    tokens (after the step that committed them: vLLM proposes for a request before its scheduler sees it finished).
    ``truth[i]``: (drafted, accepted) per verified block, ``seqs[i]``: the tokens the engine committed.
    ``sampling[i]``: request i's (temperature, top_p, top_k), held as vLLM's model runner holds them (``input_batch``,
    float32, rows as the hook's) for the proposer to log."""

    def __init__(self, prompts, arrivals, new, seed=0, sampling=None):
        self.prompts, self.arrivals, self.new, self.sampling = prompts, arrivals, new, sampling
        self.rng = np.random.default_rng(seed)
        self.seqs, self.drafts, self.truth, self.batches = {}, {}, {i: [] for i in range(len(prompts))}, []
        self.prompt_len = {i: len(p) for i, p in enumerate(prompts)}

    def run(self, proposer, on_step=None, unseen=()):
        """``unseen``: engine steps at which the hook is not called and nothing is drafted (vLLM's skip while a
        request of the batch is near the context limit): the drafts pending are verified, no new ones made."""
        t, done, slow = 0, set(), []
        while len(done) < len(self.prompts):
            rows = [i for i in range(len(self.prompts)) if self.arrivals[i] <= t and i not in done]
            self.rng.shuffle(rows)
            if self.sampling is not None:  # where vLLM's model runner holds each row's sampling settings
                t_, p_, k_ = (np.array([self.sampling[i][j] for i in rows], dtype) for j, dtype in
                              enumerate((np.float32, np.float32, np.int32)))
                self.input_batch = SimpleNamespace(temperature_cpu=t_, top_p_cpu=p_, top_k_cpu=k_)
            sampled = [self._verify(i) for i in rows]
            if rows and t in unseen:
                for i in rows:
                    self.drafts[i] = []
                    if len(self.seqs[i]) - self.prompt_len[i] >= self.new[i]:
                        done.add(i)
            elif rows:
                table = np.zeros((len(rows), MAX_LEN), dtype=np.int32)
                for r, i in enumerate(rows):
                    table[r, : len(self.seqs[i])] = self.seqs[i]
                t0 = time.perf_counter()
                out = proposer.propose(sampled, np.array([len(self.seqs[i]) for i in rows]), table)
                slow.append(time.perf_counter() - t0)
                self.batches.append(len(rows))
                for i, block in zip(rows, out):
                    self.drafts[i] = block
                    if len(self.seqs[i]) - self.prompt_len[i] >= self.new[i]:
                        done.add(i)
            t += 1
            if on_step is not None:
                on_step(t)
        return slow

    def _verify(self, i) -> list[int]:
        if i not in self.seqs:  # the prefill: one token
            self.seqs[i] = list(self.prompts[i])
            tok = [next_token(self.seqs[i])]
        else:
            draft, tok = self.drafts[i], []
            for d in draft:
                want = next_token(self.seqs[i] + tok)
                if d != want:
                    break
                tok.append(d)
            self.truth[i].append((len(draft), len(tok)))
            tok.append(next_token(self.seqs[i] + tok))
        self.seqs[i] += tok
        return tok


def workload(n=10, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, VOCAB, int(rng.integers(5, 30)))) for _ in range(n)]
    prompts[3] = list(prompts[1])  # two requests with the same prompt: the log tells them apart
    arrivals = [int(a) for a in rng.integers(0, 12, n)]
    arrivals[3] = arrivals[1]
    if n > 5:  # the same prompt again once every other request has finished: a request of its own
        prompts[5], arrivals[5] = list(prompts[0]), 10_000
    return FakeEngine(prompts, arrivals, [int(x) for x in rng.integers(20, 70, n)], seed)


def logged_requests(tmp_path, log="log", target=TARGET):
    records, meta = read_step_log(tmp_path / log, target=target)
    reqs, incomplete = requests_of(records)
    return reqs, incomplete, meta


def match_truth(engine, reqs):
    """Each logged request's engine index (by its sequence; the duplicate prompts by their order)."""
    out, left = {}, dict(enumerate(engine.seqs.items()))
    for rid, req in sorted(reqs.items()):
        j = next(j for j, (i, seq) in left.items() if seq == req["tokens"])
        out[rid] = left.pop(j)[0]
    return out


@pytest.mark.parametrize("mode", ["stop", "k"])
def test_the_step_log_equals_the_engines_truth_while_rows_reorder_join_and_leave(tmp_path, monkeypatch, mode):
    prop = proposer(tmp_path, monkeypatch, mode)
    engine = workload()
    engine.run(prop)
    prop.steplog.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and meta["dropped"] == 0 and len(reqs) == len(engine.prompts)
    assert meta["target"] == {"target": TARGET, "model": "/models/toy", "tokenizer": "toy-tokenizer",
                              "vocab_size": VOCAB}
    which = match_truth(engine, reqs)
    assert sorted(which.values()) == list(range(len(engine.prompts)))
    accepted = drafted = 0
    for rid, req in reqs.items():
        i = which[rid]
        steps = req["steps"]
        assert req["tokens"] == engine.seqs[i] and req["prompt_len"] == engine.prompt_len[i]
        # every verified block: what the engine drafted and accepted; the last block is never verified
        assert [(s["drafted"], s["accepted"]) for s in steps[:-1]] == engine.truth[i]
        assert steps[-1]["accepted"] is None and all(s["k"] >= s["drafted"] for s in steps)
        # the feature row the policy read: context length, the peeked match, the acceptance history so far
        history = None
        for s, (d, a) in zip(steps, engine.truth[i] + [(None, None)]):
            ctx = np.asarray(engine.seqs[i][: s["context_len"]])
            row = feature_row(RowContext(s["context_len"], 0, accept_rate(history),
                                         peek=prop.lookups[prop.drafter].peek(None, torch.as_tensor(ctx))), 0)
            np.testing.assert_allclose(s["features"], row, rtol=1e-6)
            if d is not None and d:
                history = next_accept_history(history, a, d)
        accepted += sum(a for _, a in engine.truth[i])
        drafted += sum(d for d, _ in engine.truth[i])
    assert 0 < accepted < drafted  # blocks were accepted and rejected: the test can tell them apart
    # the live batch size of every logged step is the number of rows the engine scheduled then
    steps_by_time = sorted({(s["unix_s"], s["batch_size"]) for r in reqs.values() for s in r["steps"]})
    assert [b for _, b in steps_by_time] == engine.batches
    assert {s["policy"] for r in reqs.values() for s in r["steps"]} == {prop.policy_id}
    # what the log cost is counted where it was spent: every engine step, every record written
    cost = prop.steplog.cost()
    assert cost["steps"] == len(engine.batches) and cost["written"] == sum(len(r["steps"]) for r in reqs.values())
    assert cost["engine_s"] > 0 and cost["writer_cpu_s"] > 0 and cost["dropped"] == 0


def test_steps_vllm_runs_without_the_proposer_leave_each_request_one_log_with_vllms_accepts(tmp_path, monkeypatch):
    """vLLM skips the hook for whole steps (a request of the batch near the context limit): the pending drafts are
    verified, nothing is drafted, and the rows come back several tokens on. Each request stays one log, its tokens
    the engine's, and its drafted blocks' (drafted, accepted) the engine's (what vLLM's arrays hold); the tokens of
    the skipped steps are counted as ``unseen``. A request that ends inside a skipped run of steps is logged up to
    its last step seen (its last block's verification is never seen)."""
    prop = proposer(tmp_path, monkeypatch)
    engine = workload(seed=5)
    engine.run(prop, unseen={4, 5, 6, 11, 19, 20})
    prop.steplog.close()
    reqs, incomplete, _ = logged_requests(tmp_path)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)  # not one request split in two
    left, whole_across = dict(engine.seqs), 0
    for rid, req in sorted(reqs.items(), key=lambda kv: -len(kv[1]["tokens"])):
        i = next(i for i, seq in left.items() if seq[: len(req["tokens"])] == req["tokens"]
                 and len(req["tokens"]) > engine.prompt_len[i])
        del left[i]
        logged = [(s["drafted"], s["accepted"]) for s in req["steps"][:-1] if s["drafted"]]
        assert logged == [(d, a) for d, a in engine.truth[i] if d][: len(logged)]
        if req["tokens"] == engine.seqs[i]:
            assert logged == [(d, a) for d, a in engine.truth[i] if d]
            whole_across += any(s["unseen"] for s in req["steps"])
        # the policy read the request's acceptance history across the skipped steps too (the dummy drafts vLLM
        # verified there do not count): the feature row of every step is the one of its blocks so far
        history = None
        for s in req["steps"]:
            ctx = torch.as_tensor(np.asarray(engine.seqs[i][: s["context_len"]]))
            peek = prop.lookups[prop.drafter].peek(None, ctx)
            row = feature_row(RowContext(s["context_len"], 0, accept_rate(history), peek=peek), 0)
            np.testing.assert_allclose(s["features"], row, rtol=1e-6)
            if s["drafted"] and s["accepted"] is not None:
                history = next_accept_history(history, s["accepted"], s["drafted"])
    assert whole_across >= 3  # requests whose blocks were verified across skipped steps, whole and exact


def test_rebuilt_traces_load_and_the_logged_policys_replay_reproduces_its_accepts(tmp_path, monkeypatch):
    prop = proposer(tmp_path, monkeypatch, "stop")
    engine = workload(seed=1)
    engine.run(prop)
    prop.steplog.close()
    meta = build_production_traces(tmp_path / "log", tmp_path / "traces", target=TARGET)
    assert meta["source"] == "vllm" and meta["log"]["requests"] == len(engine.prompts)
    live, tf = load_traces(tmp_path / "traces" / "live"), load_traces(tmp_path / "traces" / "tf", target=TARGET)
    assert read_meta(tmp_path / "traces" / "tf")["source"] == "vllm"
    assert len(live) == sum(len(t) for t in engine.truth.values())
    assert len(tf) == sum(len(s) - engine.prompt_len[i] for i, s in engine.seqs.items())
    assert sum(live["accepted"]) == sum(a for t in engine.truth.values() for _, a in t)
    out = replay_logged(tmp_path / "traces", tmp_path / "policy-stop")
    assert out["mismatched"] == [] and out["replayed"] == out["logged"]
    assert len(out["replayed"]) == len(engine.prompts) and any(any(a) for a in out["replayed"].values())
    # the replay is not trivially equal: another policy accepts differently on the same traces
    short = dataclasses.replace(ngram_rule("stop"), k_max=2, fallback=("ngram", 2))
    other = replay_logged(tmp_path / "traces", save_policy(tmp_path / "other", short, drafters={
        "ngram": {"kind": "ngram", "max_ngram": 3}}, provenance={"target": TARGET}, metrics={}))
    assert other["mismatched"]


def test_requests_are_sampled_whole_by_their_first_context(tmp_path, monkeypatch):
    monkeypatch.setenv(steplog.RATE_ENV, "0.5")
    prop = proposer(tmp_path, monkeypatch)
    engine = workload(n=16, seed=2)
    engine.run(prop)
    prop.steplog.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert incomplete == 0 and meta["rate"] == 0.5 and 0 < len(reqs) < len(engine.prompts)
    which = match_truth(engine, reqs)
    for rid, i in which.items():  # a sampled request is there from its first step to its last
        assert [(s["drafted"], s["accepted"]) for s in reqs[rid]["steps"][:-1]] == engine.truth[i]


def test_a_blocked_writer_never_blocks_the_engine_and_drops_are_counted(tmp_path, monkeypatch):
    release, entered = threading.Event(), threading.Event()
    records = steplog_writer._records

    def blocked(item):
        entered.set()
        release.wait(30)
        return records(item)

    monkeypatch.setattr(steplog_writer, "_records", blocked)
    monkeypatch.setattr(steplog, "QUEUE_SIZE", 2)
    monkeypatch.setattr(steplog_writer, "DRAIN_S", 0.001)  # the writer takes the first step at once, and gets stuck in it
    prop = proposer(tmp_path, monkeypatch)
    engine = workload(seed=3)
    times = engine.run(prop, on_step=lambda t: t == 20 and release.set())  # the writer is stuck for 20 steps
    assert entered.is_set() and prop.steplog.dropped > 0
    assert max(times) < 0.5  # the engine thread never waited for the writer
    prop.steplog.close()
    reqs, incomplete, meta = logged_requests(tmp_path)
    assert meta["dropped"] == prop.steplog.dropped and incomplete > 0  # requests with a dropped step are left out
    # the others are whole, or whole up to where their steps were dropped (then the log ends them early: a prefix)
    assert reqs and all(any(seq[: len(r["tokens"])] == r["tokens"] for seq in engine.seqs.values())
                        for r in reqs.values())


def test_damaged_shards_and_logs_of_another_target_are_refused_with_the_fix(tmp_path, monkeypatch):
    prop = proposer(tmp_path, monkeypatch)
    workload(n=4, seed=4).run(prop)
    prop.steplog.close()
    with pytest.raises(StepLogError, match="logged serving target 'toy:greedy-target'.*pass target="):
        build_production_traces(tmp_path / "log", tmp_path / "t", target="hf:other/model")
    with pytest.raises(StepLogError, match="tokenizer 'toy-tokenizer', not 'other-tok'"):
        read_step_log(tmp_path / "log", tokenizer="other-tok")
    # a second server of another tokenizer writing into the same directory
    other = proposer(tmp_path, monkeypatch, tokenizer="other-tok")
    workload(n=4, seed=5).run(other)
    other.steplog.close()
    with pytest.raises(StepLogError, match="one target's logs"):
        read_step_log(tmp_path / "log")
    shard = sorted((tmp_path / "log").glob("steps-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(StepLogError, match=f"corrupt step-log shard {shard}.*Delete it"):
        read_step_log(tmp_path / "log")
    with pytest.raises(StepLogError, match="no step-log shards.*--log-steps"):
        read_step_log(tmp_path / "empty")


def test_serve_turns_the_step_log_on_for_the_learned_proposer_only(tmp_path, monkeypatch):
    from toys import load_script

    from sacpolicy.export.vllm import export_vllm
    from sacpolicy.export.vllm_serve import serve_config
    from sacpolicy.models import EMBEDDED_TARGET

    serve = load_script("serve")
    monkeypatch.delenv(LOG_ENV, raising=False)  # logging off: the proposer holds no log
    assert PolicyProposer(vllm_config(), str(save_policy(tmp_path / "q", ngram_rule("k"), drafters={
        "ngram": {"kind": "ngram", "max_ngram": 3}}, provenance={}, metrics={}))).steplog is None
    policy = save_policy(tmp_path / "p", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram", "max_ngram": 3}},
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    export = export_vllm(policy, tmp_path / "deploy")
    learned = serve_config("learned", export=export, target=EMBEDDED_TARGET, served_model="m")
    args = SimpleNamespace(log_steps=str(tmp_path / "logs"), log_rate=0.25)
    assert serve.step_log_env(args, learned) == {LOG_ENV: str((tmp_path / "logs").resolve()),
                                                 steplog.RATE_ENV: "0.25"}
    assert serve.step_log_env(SimpleNamespace(log_steps=None, log_rate=1.0), learned) == {}
    with pytest.raises(SystemExit, match="--config static does not run it"):
        serve.step_log_env(args, serve_config("static", export=export, target=EMBEDDED_TARGET, served_model="m"))
    with pytest.raises(SystemExit, match=r"rate must be in \(0, 1\].*--log-rate"):
        serve.step_log_env(SimpleNamespace(log_steps=str(tmp_path / "logs"), log_rate=1.5), learned)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_step_log_of_a_real_vllm_engine_equals_vllms_own_per_request_arrays(embedded, tmp_path, monkeypatch):
    """The learned proposer serving both lookup drafters (n-gram, suffix) and logging inside a real vLLM engine (4
    prompts at once, greedy): per request, the logged (drafted, accepted) of every step that drafted equals vLLM's
    ``per_request_spec_decode_metrics="detailed"`` arrays, the totals equal its spec-decode counters, the rebuilt
    sequences continue the prompts with vLLM's outputs, and the logged policy's replay over the rebuilt traces (the
    suffix drafter teacher-forced in the order the engine ran the requests) reproduces the logged accepted counts."""
    import os

    from sacpolicy.data import assign_split, load_prompt_mix
    from sacpolicy.export.vllm import learned_config
    from sacpolicy.export.vllm_run import run_engine, vllm_status
    from sacpolicy.models import EMBEDDED_TARGET, model_dir

    ok, why = vllm_status()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM tests, but {why}")
        pytest.skip(why)
    ds = load_prompt_mix(["mt_bench", "humaneval_edit"], tokenizer=embedded.tokenizer)
    test = [r for r in ds if assign_split(r["prompt_id"]) == "test"]
    prompts = ([r["input_ids"] for r in test if r["category"] != "code_edit"][:2]
               + [r["input_ids"] for r in test if r["category"] == "code_edit"][:2])
    policy = save_policy(tmp_path / "policy", lookup_rule("stop"), drafters=LOOKUP_DRAFTERS,
                         provenance={"target": EMBEDDED_TARGET}, metrics={})
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log"))
    monkeypatch.setenv(steplog.FLUSH_ENV, "1")
    res = run_engine(model_dir(), prompts, max_tokens=40, speculative_config=learned_config(policy),
                     policy_dir=policy, phases=("concurrent",),
                     engine_args={"per_request_spec_decode_metrics": "detailed"})
    outputs, theirs = res["outputs"]["concurrent"], res["spec_per_request"]["concurrent"]
    reqs, incomplete, meta = logged_requests(tmp_path, target=EMBEDDED_TARGET)
    assert incomplete == 0 and meta["dropped"] == 0
    # each request's sampling settings, read from the engine's input batch: greedy, top_k off (the vocabulary size)
    assert {(r["steps"][0]["temperature"], r["steps"][0]["top_k"]) for r in reqs.values()} == {
        (0.0, meta["target"]["vocab_size"])}
    check = compare_with_vllm(reqs, list(zip(prompts, outputs, theirs)), k_cap=meta["k_cap"])
    assert check["logged"] == check["served"] == len(prompts) and check["mismatched"] == []
    assert check["equal_steps"] == check["steps"] > 0
    steps = [(s["drafted"], s["accepted"]) for r in reqs.values() for s in r["steps"]
             if s["accepted"] is not None and s["drafted"]]
    drafted, accepted = sum(d for d, _ in steps), sum(a for _, a in steps)
    assert (drafted, accepted) == (res["spec"]["concurrent"]["num_draft_tokens"],
                                   res["spec"]["concurrent"]["num_accepted_tokens"]) and accepted > 0
    assert {s["drafter"] for r in reqs.values() for s in r["steps"] if s["drafted"]} == {"ngram", "suffix"}
    # lossless: vLLM's outputs are the target's own greedy continuations (our decoder's, autoregressive)
    from sacpolicy.decoding import SpeculativeDecoder
    from sacpolicy.policy import Autoregressive

    ar = SpeculativeDecoder(embedded.model, [], Autoregressive(), stop_token_ids=embedded.eos_token_ids)
    assert [ar.generate(p, 40).tokens for p in prompts] == [list(o) for o in outputs]
    build_production_traces(tmp_path / "log", tmp_path / "traces", target=EMBEDDED_TARGET)
    replay = replay_logged(tmp_path / "traces", policy)
    assert replay["mismatched"] == [] and len(replay["replayed"]) == len(reqs)


def test_compare_with_vllm_pairs_requests_by_tokens_and_finds_a_differing_step():
    """Served requests are found in the log by prompt and output (identical ones in order); a step whose counts
    differ from vLLM's arrays, or a request the log lacks, is named."""
    step = lambda d, a: {"drafted": d, "accepted": a}
    reqs = {"r1": {"prompt_len": 2, "tokens": [1, 2, 7, 8, 9, 4], "steps": [step(3, 2), step(0, None)]},
            "r2": {"prompt_len": 2, "tokens": [1, 2, 7, 8, 9, 5], "steps": [step(3, 1), step(2, 1), step(2, None)]},
            "r3": {"prompt_len": 1, "tokens": [6, 3, 3], "steps": [step(2, 1), step(1, None)]}}
    spec = lambda d, a: {"per_step_drafted": d, "per_step_accepted": a}
    served = [([1, 2], [7, 8, 9], spec([3], [2])), ([1, 2], [7, 8], spec([3, 2], [1, 1])),
              ([6], [3, 3], spec([2], [0])), ([5], [1], None)]
    out = compare_with_vllm(reqs, served)
    assert out == {"served": 4, "logged": 3, "steps": 4, "equal_steps": 3, "mismatched": [2, 3]}
    # a request the proposer first saw two tokens into its decode: its logged prompt is longer than the one sent
    late = {"r4": {"prompt_len": 3, "tokens": [5, 6, 7, 8, 9], "steps": [step(2, 1), step(0, None)]}}
    out = compare_with_vllm(late, [([5, 6], [7, 8, 9], spec([2], [1]))])
    assert out == {"served": 1, "logged": 1, "steps": 1, "equal_steps": 1, "mismatched": []}
    # steps vLLM ran without the proposer (a request of the batch near the context limit): its arrays count dummy
    # drafts of k_cap zeros there; the log's unseen tokens [4, 0, 5] are two of them, (8, 0) then (8, 1)
    gap = {"r5": {"prompt_len": 1, "tokens": [6, 7, 4, 0, 5, 2, 2], "steps": [
        step(3, 0), {**step(2, 1), "committed": [7, 4, 0, 5], "unseen": 3}, {**step(0, None), "unseen": 0}]}}
    vllm = [([6], [7, 4, 0, 5, 2, 2], spec([3, 8, 8, 2], [0, 0, 1, 1]))]
    assert compare_with_vllm(gap, vllm, k_cap=8)["mismatched"] == []
    assert compare_with_vllm(gap, vllm)["mismatched"] == [0]  # without the cap the dummy steps cannot be rebuilt


# ---------------------------------------------------------------------- sampled serving
class SequenceEngine(FakeEngine):
    """Serves known sequences (``sequences[i]``: prompt + what the target sampled): a drafted token is accepted while it
    is the sequence's next one, the engine's own token is the sequence's; a request ends at its sequence's end (a
    match past it is cut, as ``max_tokens`` cuts a block in vLLM)."""

    def __init__(self, prompts, sequences, sampling, seed=0):
        n = len(prompts)
        super().__init__(prompts, [0] * n, [len(s) - len(p) for s, p in zip(sequences, prompts)], seed, sampling)
        self.sequences = sequences

    def _verify(self, i) -> list[int]:
        full = self.sequences[i]
        if i not in self.seqs:
            self.seqs[i] = list(self.prompts[i])
            tok = [full[len(self.prompts[i])]]
        else:
            n, tok = len(self.seqs[i]), []
            for d in self.drafts[i]:
                if n + len(tok) + 1 >= len(full) or d != full[n + len(tok)]:
                    break
                tok.append(d)
            self.truth[i].append((len(self.drafts[i]), len(tok)))
            tok.append(full[n + len(tok)])
        self.seqs[i] += tok
        return tok


def test_the_step_log_records_each_requests_sampling_and_sampled_requests_need_a_target_pass(tmp_path, monkeypatch,
                                                                                              caplog):
    hot, greedy = (0.7, 0.9, VOCAB), (0.0, 1.0, VOCAB)
    prop = proposer(tmp_path, monkeypatch)
    engine = workload(n=6, seed=6)
    engine.sampling = [hot if i % 2 else greedy for i in range(6)]
    engine.run(prop)
    prop.steplog.close()
    reqs, _, _ = logged_requests(tmp_path)
    which = match_truth(engine, reqs)
    for rid, req in reqs.items():
        first, rest = req["steps"][0], req["steps"][1:]
        t, p, k = engine.sampling[which[rid]]
        assert (first["temperature"], first["top_p"], first["top_k"]) == (t, p, k)  # float32 0.7 logged as 0.7
        assert all(s["temperature"] is None for s in rest)
    with pytest.raises(StepLogError, match=r"several sampling settings \(3 at temperature 0.0, top_k 0, top_p 1.0, 3 "
                                           r"at temperature 0.7, top_k 0, top_p 0.9\).*select="):
        build_production_traces(tmp_path / "log", tmp_path / "t")
    with pytest.raises(StepLogError, match=r"3 requests were served sampled \(temperature 0.7.*need a target pass.*"
                                           r"pass target=<the loaded target>.*refit.target_pass=true"):
        build_production_traces(tmp_path / "log", tmp_path / "t", select={"temperature": 0.7, "top_p": 0.9})
    meta = build_production_traces(tmp_path / "log", tmp_path / "t", select={"temperature": 0})
    assert meta["log"]["requests"] == 3 and meta["log"]["sampling"] == {"logged": 6, "assumed": 0, "left_out": 3}
    assert meta["sampling"]["temperature"] == 0.0 and meta["teacher_forcing"] == "tokens"
    # a log that records no sampling (no input batch to read it from, or an older proposer): the declared settings
    plain = proposer(tmp_path, monkeypatch, log="plain")
    workload(n=4, seed=7).run(plain)
    plain.steplog.close()
    assert "cannot read the requests' sampling settings" in caplog.text
    with pytest.raises(StepLogError, match="4 requests were served sampled.*target pass"):
        build_production_traces(tmp_path / "plain", tmp_path / "p", sampling={"temperature": 0.7})
    assert build_production_traces(tmp_path / "plain", tmp_path / "p")["log"]["sampling"]["assumed"] == 4
    assert "record no sampling settings" in caplog.text
    # shards written before the sampling columns existed read as before
    import pyarrow.parquet as pq

    for shard in (tmp_path / "plain").glob("steps-*.parquet"):
        pq.write_table(pq.read_table(shard).drop_columns(["temperature", "top_p", "top_k"]), shard)
    old = build_production_traces(tmp_path / "plain", tmp_path / "old")
    assert old["log"]["requests"] == 4 and old["log"]["sampling"]["assumed"] == 4


@pytest.mark.parametrize("served", [(0.8, 0.9), (0.0, 1.0)], ids=["sampled", "greedy"])
def test_production_traces_with_a_target_pass_equal_the_collectors_for_the_same_sequences(tiny_target, tmp_path,
                                                                                          monkeypatch, served):
    from sacpolicy.decoding import NgramDrafter, SamplingConfig
    from sacpolicy.runtime.spec import DrafterSpec
    from sacpolicy.traces.collect import collect_teacher_forced
    from sacpolicy.traces.simulate import group_traces

    temperature, top_p = served
    vocab = tiny_target.model.config.vocab_size
    prompts = [{"prompt_id": f"p{i}", "category": "writing", "input_ids": ([5, 6, 7, 8] * 5)[i:]}
               for i in range(3)]
    ngram = DrafterSpec(kind="ngram", name="ngram", max_ngram=3)
    collected = collect_teacher_forced(tiny_target, [NgramDrafter(ngram.max_ngram, ngram.min_ngram, name="ngram")],
                                       prompts, tmp_path / "collected", max_new_tokens=24, k_max=K,
                                       meta={"target": tiny_target.spec}, progress=False,
                                       sampling=SamplingConfig(temperature=temperature, top_p=top_p, seed=3))
    theirs = load_traces(collected, target=tiny_target.spec)
    gen = {p["prompt_id"]: [int(r["target_token"]) for r in sorted(
        (r for r in theirs if r["prompt_id"] == p["prompt_id"]), key=lambda r: r["position"])] for p in prompts}
    sequences = [p["input_ids"] + gen[p["prompt_id"]] for p in prompts]
    prop = proposer(tmp_path, monkeypatch, target=tiny_target.spec, vocab=vocab)
    engine = SequenceEngine([p["input_ids"] for p in prompts], sequences, [(temperature, top_p, vocab)] * 3)
    engine.run(prop)
    prop.steplog.close()
    meta = build_production_traces(tmp_path / "log", tmp_path / "prod", target=tiny_target, progress=False)
    assert meta["teacher_forcing"] == "target" and meta["log"]["requests"] == 3
    assert meta["sampling"] == {"temperature": temperature, "top_k": 0, "top_p": top_p}
    tf_meta = read_meta(tmp_path / "prod" / "tf")
    assert group_traces(load_traces(tmp_path / "prod" / "tf"), tf_meta)[sorted(meta["log"]["prompts"])[0]][
        "temperature"] == temperature
    assert (tf_meta.get("beta") == "processed") == (temperature > 0)
    mine = load_traces(tmp_path / "prod" / "tf", target=tiny_target.spec)
    reqs, _, _ = logged_requests(tmp_path, target=tiny_target.spec)
    exact = ("prompt_len", "position", "target_token", "draft_token", "match", "run_len", "proposal_len", "proposal")
    close = ("p_target", "q_target", "beta", "top1", "entropy", "margin")
    compared = 0
    for rid, req in reqs.items():
        pid = prompts[sequences.index(req["tokens"])]["prompt_id"]
        a = sorted((r for r in mine if r["prompt_id"] == rid), key=lambda r: r["position"])
        b = sorted((r for r in theirs if r["prompt_id"] == pid), key=lambda r: r["position"])
        assert len(a) == len(b) == len(gen[pid])
        for x, y in zip(a, b):
            assert {c: x[c] for c in exact} == {c: y[c] for c in exact}
            for c in close:
                assert x[c] == pytest.approx(y[c], rel=1e-4, abs=1e-9), (c, x["position"])
            compared += 1
    rows = list(mine)
    assert compared == sum(len(g) for g in gen.values())
    assert any(r["draft_token"] >= 0 for r in rows)  # the n-gram drafter proposed: beta was computed, not defaulted
    assert not any(math.isnan(r["p_target"]) for r in rows)
    if temperature > 0:
        assert any(0 < r["beta"] < 1 for r in rows)  # expected acceptances, not 0/1 matches


def test_foreign_files_and_shards_of_another_server_setting_are_refused_with_the_file_and_the_fix(tmp_path,
                                                                                                   monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prop = proposer(tmp_path, monkeypatch)
    workload(n=4, seed=8).run(prop)
    prop.steplog.close()
    # a server with another k cap logging into the same directory
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log"))
    cfg = vllm_config()
    cfg.speculative_config.num_speculative_tokens = K - 2
    narrow = PolicyProposer(cfg, str(tmp_path / "policy-stop"))
    workload(n=4, seed=9).run(narrow)
    narrow.steplog.close()
    with pytest.raises(StepLogError, match=f"steps-.*parquet was logged by a server of drafter .* with k cap "
                                           f"({K - 2}|{K}), .*steps-.*parquet by one of drafter .* with k cap "
                                           f"({K}|{K - 2}): keep one server setting per log directory; move"):
        read_step_log(tmp_path / "log")
    with pytest.raises(StepLogError, match="keep one server setting per log directory"):
        build_production_traces(tmp_path / "log", tmp_path / "t")
    # a Parquet file that is not a step-log shard (another tool's table under the shards' name)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    path = foreign / "steps-00000000T000000-other-00000.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), path)
    with pytest.raises(StepLogError, match=f"{path} is not a step-log shard.*move it out of {foreign} or log again"):
        read_step_log(foreign)


def test_the_reload_drill_swaps_the_served_policy_mid_run_and_counts_each_ids_steps(tmp_path, monkeypatch):
    """bench_serve's hot-reload drill under a fake engine: the proposer follows the drill's deploy root, the drill
    deploys the other policy mid-run, and its report shows the swap (reloads, the final id) and steps planned under
    both ids, the old id's before the new one's; the next swap deploys the first policy again."""
    from sacpolicy.export.reload import RELOAD_ENV
    from sacpolicy.export.vllm import STATS_ENV

    cli = load_script("bench_serve")
    drafters = {"ngram": {"kind": "ngram", "max_ngram": 3}}
    a, b = (save_policy(tmp_path / m, ngram_rule(m), drafters=drafters, provenance={"target": TARGET}, metrics={})
            for m in ("stop", "k"))
    drill = cli.ReloadDrill(a, b, tmp_path / "work")
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(RELOAD_ENV, "3600")  # the drill's own 1 s is what a server gets; here the test polls
    for key, value in drill.server_env(0).items():  # the drill's step log, as its server gets it
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(STATS_ENV, str(stats))
    config = vllm_config()
    config.speculative_config.num_speculative_tokens = 8  # the deploy root's k cap (the policies' k_max)
    prop = PolicyProposer(config, str(drill.root))  # what a version's vllm.env names
    first = prop.policy_id

    def on_step(t):
        if t == 20:
            drill.swap_after(0.0).join()
            prop.slot.next_poll = 0.0  # the reload interval has passed

    workload().run(prop, on_step)
    prop.steplog.close()
    prop.write_stats()  # a server writes them every 20 steps
    report = drill.report(0, stats)
    second = report["deploys"][0]["version"]
    assert "error" not in report["deploys"][0] and second != first
    assert report["reloads"] == 1 and report["reload_failures"] == 0
    assert set(report["policy_steps"]) == {first, second} and min(report["policy_steps"].values()) > 10
    assert report["policy_unix_s"][first][0] <= report["policy_unix_s"][second][0]
    drill.swap_after(0.0).join()
    assert drill.swaps[-1]["deploy"] == str(a) and "version" in drill.swaps[-1]


def _log_and_end(policy, log, how):
    """A multiprocessing child (as vLLM's engine core is): it logs a few requests with a flush interval longer than
    its life, then ends by returning or by SystemExit (how vLLM's engine core answers SIGTERM)."""
    import os
    import sys

    from sacpolicy.export.steplog import FLUSH_ENV

    os.environ.update({LOG_ENV: str(log), FLUSH_ENV: "3600"})
    workload(n=4).run(PolicyProposer(vllm_config(), str(policy)))
    if how == "exit":
        sys.exit(0)


@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_multiprocessing_child_writes_its_step_log_when_it_ends(tmp_path, how):
    """A multiprocessing child ends through os._exit, which skips atexit: the log is written by multiprocessing's
    finalizers instead (without them this child's records, queued but not yet flushed, were lost)."""
    import multiprocessing

    policy = save_policy(tmp_path / "policy", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram",
                         "max_ngram": 3}}, provenance={"target": TARGET}, metrics={})
    child = multiprocessing.get_context("fork").Process(target=_log_and_end, args=(policy, tmp_path / "log", how))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    records, meta = read_step_log(tmp_path / "log", target=TARGET)
    reqs, incomplete = requests_of(records)
    assert len(reqs) == 4 and not incomplete and meta["shards"] == 1


def lookup_proposer(tmp_path, monkeypatch, log="log"):
    """A proposer serving the rule's two lookup drafters (n-gram and suffix), its step log on."""
    monkeypatch.setenv(LOG_ENV, str(tmp_path / log))
    policy = save_policy(tmp_path / "policy-lookup", lookup_rule("stop"), drafters=LOOKUP_DRAFTERS,
                         provenance={"target": TARGET}, metrics={})
    return PolicyProposer(vllm_config(), str(policy)), policy


def test_both_lookup_drafters_are_served_and_their_log_replays_in_the_order_the_server_saw_it(tmp_path, monkeypatch):
    """The proposer serves the rule's n-gram and suffix drafters, the rule choosing per request and step; the suffix
    drafter's global index learns from every request in flight. The log holds which drafter drafted each block and
    equals the engine's truth; production traces teacher-force the suffix drafter in the order the server indexed
    the requests (``served_teacher_forcing``): its proposal at every step the proposer saw equals the one the
    proposer peeked then, where teacher forcing each request whole in turn (as collection does) differs, and the
    logged policy's replay reproduces every accepted count."""
    from sacpolicy.decoding import SuffixDrafter
    from sacpolicy.decoding.teacher import teacher_force
    from sacpolicy.traces.production import served_teacher_forcing

    prop, policy = lookup_proposer(tmp_path, monkeypatch)
    assert list(prop.lookups) == ["ngram", "suffix"] and prop.drafter == "ngram"
    suffix = prop.lookups["suffix"]
    peeked = []  # (context, the whole draft) of every suffix peek, in the order the proposer made them
    real_peek = suffix.peek

    def peek(state, context):
        got = real_peek(state, context)
        peeked.append((context.tolist(), state.peeked[1].tokens if state is not None else None))
        return got

    suffix.peek = peek
    engine = workload(n=12, seed=3)
    engine.run(prop)
    prop.steplog.close()
    records, meta = read_step_log(tmp_path / "log", target=TARGET)
    assert list(meta["drafters"]) == ["ngram", "suffix"]
    reqs, incomplete = requests_of(records)
    assert incomplete == 0 and len(reqs) == len(engine.prompts)
    which = match_truth(engine, reqs)
    for rid, req in reqs.items():  # what each block drafted and accepted is the engine's, whoever drafted it
        assert [(s["drafted"], s["accepted"]) for s in req["steps"][:-1]] == engine.truth[which[rid]]
        assert all((s["drafter"] is None) == (s["drafted"] == 0) for s in req["steps"])
    used = {s["drafter"] for r in reqs.values() for s in r["steps"] if s["drafted"]}
    assert used == {"ngram", "suffix"}  # the rule chose each drafter at some steps
    # the suffix drafter's teacher forcing in served order: every visited position as the proposer peeked it
    served = served_teacher_forcing(lambda: SuffixDrafter(24, 2.0, 0.1, name="suffix"), records, reqs, K)
    ordered = [(r["request"], r["context_len"]) for r in records]
    assert len(ordered) == len(peeked)
    request_order, alone = SuffixDrafter(24, 2.0, 0.1, name="suffix"), 0
    whole = {rid: teacher_force(request_order, torch.tensor(reqs[rid]["tokens"]), reqs[rid]["prompt_len"], K)
             for rid in sorted(reqs)}
    for (rid, n), (context, tokens) in zip(ordered, peeked):
        req = reqs[rid]
        assert context == req["tokens"][:n]
        g = n - req["prompt_len"]
        if g >= len(req["tokens"]) - req["prompt_len"]:
            continue  # the last context seen: its block is never verified, no trace row
        want = tokens[:K]
        assert [t for t in served[rid].tokens[g].tolist() if t >= 0] == want
        alone += [t for t in whole[rid].tokens[g].tolist() if t >= 0] != want
    assert alone > 0  # the order matters here: requests in flight teach each other
    build_production_traces(tmp_path / "log", tmp_path / "traces", target=TARGET)
    tf = load_traces(tmp_path / "traces" / "tf", target=TARGET)
    assert set(tf["drafter"]) == {"ngram", "suffix"}
    assert set(load_traces(tmp_path / "traces" / "live")["drafter"]) - {None} == {"ngram", "suffix"}
    out = replay_logged(tmp_path / "traces", policy)
    assert out["mismatched"] == [] and len(out["replayed"]) == len(engine.prompts)


def test_a_rule_of_lookup_drafters_is_exported_for_vllm_with_all_of_them(tmp_path):
    """``export_vllm`` serves a rule over n-gram and suffix drafters with both (``SACPOLICY_POLICY_DRAFTER``), its
    static config the n-gram drafter's (vLLM's suffix method needs arctic-inference and CUDA); naming one serves it
    alone; a drafter that is not the rule's is refused by name."""
    import json

    from sacpolicy.export.vllm import DRAFTER_ENV, export_vllm, learned_config

    policy = save_policy(tmp_path / "policy", lookup_rule("stop"), drafters=LOOKUP_DRAFTERS,
                         provenance={"target": TARGET}, metrics={})
    out = export_vllm(policy, tmp_path / "both")
    assert f"{DRAFTER_ENV}=ngram,suffix\n" in (out / "vllm.env").read_text()
    assert json.loads((out / "speculative_config.json").read_text())["method"] == "custom_class"
    assert json.loads((out / "static_speculative_config.json").read_text())["method"] == "ngram"
    one = export_vllm(policy, tmp_path / "one", drafter="suffix")
    assert f"{DRAFTER_ENV}=suffix\n" in (one / "vllm.env").read_text()
    # bench_serve's learned-ngram: the same export served with its n-gram drafter alone
    from sacpolicy.export.vllm_serve import ServeError, serve_config

    assert serve_config("learned", export=out, target=TARGET).env[DRAFTER_ENV] == "ngram,suffix"
    assert serve_config("learned-ngram", export=out, target=TARGET).env[DRAFTER_ENV] == "ngram"
    with pytest.raises(ServeError, match="learned-ngram.*serves none"):
        serve_config("learned-ngram", export=one, target=TARGET)
    # bench_serve's candidate: another export (a refit's) served as learned serves --export
    candidate = serve_config("candidate", export=out, candidate=one, target=TARGET)
    assert candidate.env[DRAFTER_ENV] == "suffix" and candidate.speculative_config["method"] == "custom_class"
    with pytest.raises(ServeError, match="needs --candidate"):
        serve_config("candidate", export=out, target=TARGET)
    with pytest.raises(ValueError, match="'head'"):  # the rule's RuleError
        learned_config(policy, drafter="ngram,head")
