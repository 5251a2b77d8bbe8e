"""Hot reload and canary for the served proposer (``PolicyProposer``), from a deploy root (``deploy.py``).

    root/versions/<version>/   immutable vLLM exports (policy/, speculative_config.json, vllm.env, deploy.json)
    root/current  -> versions/<version>     what every request is served with
    root/candidate -> versions/<version>    optional: on trial for a fraction of requests (canary)
    root/canary.json                        optional: {"fraction": 0.1, "min_steps": 200}

``SACPOLICY_POLICY_DIR`` may name a deploy root: the proposer follows ``current``. ``PolicySlot`` runs on vLLM's
engine thread, inside the proposer's step: every ``SACPOLICY_RELOAD_S`` seconds (default 30; ``off``: never) it reads
the two links (a ``readlink`` each, nothing else) and, when ``current`` points somewhere new, validates the version
(checksums through ``load_artifact``, the same target provenance as the running policy, ``k_max`` within the
server's ``num_speculative_tokens``), smoke-tests it (plans a block on a short synthetic context) and only then
swaps the proposer's policy between two steps. A version that fails is refused once, logged once with the file and
the fix, and counted (``reload_failures``); the old policy keeps serving. Speculation is lossless, so a swap changes
speed, never outputs, and no request is dropped (the acceptance histories are kept).

Canary: while ``candidate`` points at a version (validated the same way), requests whose first-seen context's key
(``request_key``, the key of the proposer's request table) falls below the fraction are planned by it for their whole
life (the arm is kept in the request's memory, which the proposer's one request table finds again, also after steps
vLLM ran without the proposer). The arms are judged by served time: per request step, the seconds since the proposer
last saw the request over the tokens committed since (the proposer timestamps its calls), compared by the ratio of
means with a normal interval on its log; tokens per step are reported beside it. The candidate is rolled back (its
link removed, ``canary_rollbacks`` counted) when it serves slower (the interval lies above 1), or when it fails; a
faster one stays on trial until the operator promotes it (``scripts/deploy.py --promote``): promotion is never
automatic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sacpolicy.decoding import DecoderConfig, DecodeState, PolicyRow, RequestInfo
from sacpolicy.decoding.controller import Controller, ServedView
from sacpolicy.decoding.lookup import LOOKUP_KINDS, lookup_drafter
from sacpolicy.decoding.protocols import Resettable, fresh_drafters
from sacpolicy.export import pick_drafter
from sacpolicy.export.request_key import key_position, request_key
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact
from sacpolicy.runtime.rule import DecisionRule

logger = logging.getLogger(__name__)

RELOAD_ENV = "SACPOLICY_RELOAD_S"  # seconds between link checks; "off": never reload
CANARY_ENV = "SACPOLICY_CANARY_FRACTION"  # overrides canary.json's fraction
CURRENT, CANDIDATE, VERSIONS, CANARY_FILE = "current", "candidate", "versions", "canary.json"
DEFAULT_RELOAD_S, DEFAULT_FRACTION, DEFAULT_MIN_STEPS = 30.0, 0.1, 200
_SMOKE = np.tile(np.arange(1, 9, dtype=np.int64), 6)  # repetitive: the n-gram drafter finds matches


def read_link(root, name: str) -> str | None:
    """Where ``root/name`` points (the link's text), None when there is no such link."""
    try:
        return os.readlink(Path(root) / name)
    except OSError:
        return None


def is_deploy_root(path) -> bool:
    return isinstance(path, (str, Path)) and read_link(path, CURRENT) is not None


def live_policy_dir(path) -> Path:
    """The policy directory that serves: a deploy root's ``current`` version's ``policy/``, else ``path`` itself."""
    return Path(path) / read_link(path, CURRENT) / "policy" if is_deploy_root(path) else Path(path)


def artifact_digest(art: PolicyArtifact) -> str:
    """SHA-256 of what decides the policy's behaviour (the files' checksums, rule, cost model, drafters, feature
    spec), not of when or where it was written: the same policy exported twice has one digest."""
    m = art.manifest
    keys = ("checksums", "rule", "cost_model", "drafters", "predictor", "feature")
    return hashlib.sha256(json.dumps({k: m.get(k) for k in keys}, sort_keys=True, default=str).encode()).hexdigest()


def open_policy(policy) -> tuple[PolicyArtifact, Path | None, str]:
    """(the artifact, its deploy root or None, its policy id) of ``policy``: an artifact, an artifact directory or a
    deploy root (its ``current`` version; the id is the version's name, else the artifact digest's head)."""
    if isinstance(policy, PolicyArtifact):
        return policy, None, artifact_digest(policy)[:12]
    if is_deploy_root(policy):
        live = live_policy_dir(policy)  # the link read once: a flip meanwhile is the next poll's
        return load_artifact(live), Path(policy), live.parent.name
    art = load_artifact(policy)
    return art, None, artifact_digest(art)[:12]


def lookup_drafters(art: PolicyArtifact, drafter: str | None = None) -> tuple[str, ...]:
    """The rule's drafters the proposer serves, its primary first (the one whose feature row the step log keeps for
    steps that draft nothing): ``drafter`` names them (one name, or several comma-separated), else every n-gram and
    suffix drafter of the rule, the primary ``pick_drafter``'s n-gram one (the suffix one when it has none). The rule's
    other drafters are not on offer in vLLM's hook, as when a decoder drops them."""
    rule, specs = art.rule, art.drafters
    if drafter:
        names = tuple(dict.fromkeys(n.strip() for n in drafter.split(",") if n.strip()))
        for name in names:
            pick_drafter(rule, specs, name, LOOKUP_KINDS)  # the rule's, and of a kind the proposer runs
        return names
    kinds = ("ngram",) if any(specs[d].kind == "ngram" for d in rule.drafters) else LOOKUP_KINDS
    primary = pick_drafter(rule, specs, None, kinds)
    return (primary, *(d for d in rule.drafters if d != primary and specs[d].kind in LOOKUP_KINDS))


@dataclass(frozen=True)
class ServedPolicy:
    """One policy as the proposer serves it, frozen: the rule, its lookup drafters (by name, the primary first: the
    one whose feature row the step log keeps for steps that draft nothing), their specs, the ``LearnedPolicy`` that
    plans with them, the controller that runs it as a served engine sees requests (``decoding.controller``), whether
    it prices a step's rows at vLLM's live batch size, and its id. A reload or a canary swaps the whole value."""

    rule: DecisionRule
    lookups: dict
    specs: dict
    policy: LearnedPolicy
    controller: Controller
    load_aware: bool
    policy_id: str
    path: str  # the artifact directory it was loaded from

    @property
    def primary(self) -> str:
        return next(iter(self.lookups))

    def describe(self) -> dict:
        """What the step log records of the policy that planned a step (``export.steplog``: each shard's
        ``served_policies``, by policy id): its directory, its drafters and how it prices a step."""
        spec = self.specs[self.primary]
        return {"policy_dir": self.path,
                "drafter": {"name": self.primary, "kind": spec.kind, "max_ngram": spec.max_ngram,
                            "min_ngram": spec.min_ngram},
                # every lookup drafter served, the primary first: what production traces teacher-force
                "drafters": {n: s.to_dict() for n, s in self.specs.items()},
                "load_aware": self.load_aware, "rule_drafters": list(self.rule.drafters)}

    def request(self) -> PolicyRow:
        """A new served request's policy row: the rule's drafters, nothing else known of it (vLLM's hook passes
        token arrays only)."""
        request = RequestInfo(drafters=self.rule.drafters)
        return PolicyRow(DecodeState(request, drafters=tuple(self.lookups)), self.policy.start(request))

    def isolated(self) -> ServedPolicy:
        """This policy (its rule, ``LearnedPolicy`` and settings) over copies of its drafters that keep nothing of
        earlier requests (``fresh_drafters``: a suffix drafter's global index new and its own): what plans the reload's
        smoke test, so the value that serves is the one tested and the test teaches its drafters nothing."""
        lookups = dict(zip(self.lookups, fresh_drafters(self.lookups.values())))
        c = self.controller
        return replace(self, lookups=lookups, controller=Controller(self.policy, lookups, c.config, c.now, c.view))


def served_policy(art: PolicyArtifact, drafter: str | None, policy_id: str, *, k_cap: int, max_model_len: int,
                  load: bool = True, running: ServedPolicy | None = None, learn: bool = True) -> ServedPolicy:
    """The ``ServedPolicy`` of ``art``: its lookup drafters (``lookup_drafters``), planned under the served view of a
    server that verifies at most ``k_cap`` tokens a step before ``max_model_len``; ``load``: price steps at vLLM's
    live batch size where the cost model has batch curves. ``running``: the policy serving now, whose drafters that
    keep what earlier requests taught them (a suffix drafter's global index; ``Resettable``) are kept wherever the
    spec is the same: that index and its requests' rows outlive a policy swap, and a canary's two arms share it.
    ``learn=False``: a rule that learns while serving (``DecisionRule.online``) serves its fitted decisions alone.
    vLLM flattens a step's tokens into one pass, so the rule prices it by the tokens it feeds
    (``CostModel.verify_pass = "total"``): a load-aware plan allocates the step's draft slots across its rows jointly,
    whatever pass shape the artifact's cost model was profiled for."""
    names = lookup_drafters(art, drafter)
    rule = art.rule if art.rule.cost.verify_pass == "total" else replace(
        art.rule, cost=replace(art.rule.cost, verify_pass="total"))
    specs = {n: art.drafters[n] for n in names}
    lookups = {n: lookup_drafter(spec) for n, spec in specs.items()}
    if running is not None:
        lookups |= {n: running.lookups[n] for n, spec in specs.items()
                    if isinstance(running.lookups.get(n), Resettable) and running.specs.get(n) == spec}
    policy = LearnedPolicy(rule, online=None if learn else False)
    load_aware = bool(rule.cost.batch) and load
    view = ServedView(tuple(rule.drafters), k_cap, max_model_len, load_aware)
    config = DecoderConfig(k_max=max(rule.k_max, k_cap), view=view)
    controller = Controller(policy, lookups, config, time.perf_counter, view)
    return ServedPolicy(rule, lookups, specs, policy, controller, load_aware, policy_id, str(art.path))


def ratio_interval(a: tuple[int, float, float], b: tuple[int, float, float], z: float = 1.96):
    """(ratio, low, high): mean(a) / mean(b) from (n, sum, sum of squares) of each, with a normal interval on the
    log ratio (delta method); None while either arm has fewer than two values or a zero mean."""
    (na, sa, qa), (nb, sb, qb) = a, b
    if na < 2 or nb < 2 or sa <= 0 or sb <= 0:
        return None
    ma, mb = sa / na, sb / nb
    va, vb = max(qa / na - ma * ma, 0.0) / (na - 1), max(qb / nb - mb * mb, 0.0) / (nb - 1)
    ratio, se = ma / mb, math.sqrt(va / (ma * ma) + vb / (mb * mb))
    return ratio, ratio * math.exp(-z * se), ratio * math.exp(z * se)


def reload_interval() -> float | None:
    value = os.environ.get(RELOAD_ENV, str(DEFAULT_RELOAD_S)).strip()
    if value.lower() == "off":
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        logger.error("%s=%r is not a number of seconds (or 'off'); checking every %g s", RELOAD_ENV, value,
                     DEFAULT_RELOAD_S)
        return DEFAULT_RELOAD_S


class _Arm:
    """One arm of a trial: per request step it credits, (n, sum, sum of squares) of the tokens the step committed and
    of the served seconds per committed token (the time since the proposer last saw the request, over the tokens
    committed since: the engine's verify pass, our proposer and whatever else the step took)."""

    def __init__(self):
        self.tokens, self.seconds = [0, 0.0, 0.0], [0, 0.0, 0.0]

    def credit(self, tokens: int, seconds: float | None) -> None:
        _add(self.tokens, tokens)
        if seconds is not None and tokens > 0:
            _add(self.seconds, seconds / tokens)


def _add(acc: list, x: float) -> None:
    acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + x, acc[2] + x * x


class _Trial:
    """A candidate on trial: its served policy, its link and each arm's steps (``_Arm``)."""

    def __init__(self, number: int, link: str, state: ServedPolicy, fraction: float, min_steps: int):
        self.number, self.link, self.state, self.fraction, self.min_steps = number, link, state, fraction, min_steps
        self.arms = {False: _Arm(), True: _Arm()}  # False: current, True: candidate
        self.better_logged = False

    def interval(self, what: str = "seconds"):
        """Candidate over current of the mean ``what`` ("seconds": served seconds per output token, lower is better;
        "tokens": tokens per step), with its interval (``ratio_interval``)."""
        return ratio_interval(tuple(getattr(self.arms[True], what)), tuple(getattr(self.arms[False], what)))

    def summary(self) -> dict:
        def rounded(iv):
            return None if iv is None else [round(x, 4) for x in iv]

        return {"candidate": self.state.policy_id, "fraction": self.fraction,
                "steps": {"current": self.arms[False].tokens[0], "candidate": self.arms[True].tokens[0]},
                "seconds_per_token_ratio": rounded(self.interval("seconds")),
                "tokens_per_step_ratio": rounded(self.interval("tokens"))}


class PolicySlot:
    """The proposer's policy over time: hot reload of ``current`` and the canary of ``candidate`` (module doc). It
    holds the ``ServedPolicy`` that serves (``current``: swapped by one assignment) and the one on trial; the
    proposer asks it to plan each step's rows (``blocks``, handing it its planning function); everything runs on the
    engine thread, between steps. ``notify``: called when what the proposer reports changed (a reload, a trial's
    start or end)."""

    def __init__(self, current: ServedPolicy, art: PolicyArtifact, root: Path | None, drafter: str | None, *,
                 k_cap: int, max_model_len: int, load: bool = True, learn: bool = True, notify=lambda: None):
        self.current, self.root, self.drafter, self.load, self.notify = current, root, drafter, load, notify
        self.learn = learn
        self.k_cap, self.max_model_len = k_cap, max_model_len
        self.target = (art.provenance or {}).get("target")
        self.every = reload_interval() if root is not None else None
        link = read_link(root, CURRENT) if root is not None else None
        self.current_link = link if link and Path(link).name == current.policy_id else None  # moved since: reload
        self.refused: set[tuple[str, str]] = set()  # (link name, target) found wrong: never retried
        self.next_poll, self.trial, self.trials, self.last_trial = 0.0, None, 0, None
        self.reloads = self.reload_failures = self.canary_rollbacks = 0

    # ------------------------------------------------------------------ planning
    def blocks(self, rows: list, plan, batch: int, seen: list | None = None) -> list[list[int]]:
        """The proposer's blocks for one step's rows, (context, the request's memory, tokens its last step committed,
        seconds since the proposer last saw it or None), each request planned by its arm's policy (``plan(rows,
        batch, seen, served)``: the proposer's ``blocks``) at ``batch``, vLLM's live batch size. ``seen``: gets the
        proposer's ``seen`` entries of the rows, in their order."""
        self.poll(plan)
        arms = [self._route(memo, context, committed, seconds) for context, memo, committed, seconds in rows]
        out: list[list[int]] = [[] for _ in rows]
        seen_rows: list = [None] * len(rows)
        for on_candidate in (False, True):
            idx = [j for j, a in enumerate(arms) if a == on_candidate]
            if not idx:
                continue
            trial, part = self.trial, [] if seen is not None else None
            chosen = [rows[j][:2] for j in idx]
            dropped = [len(memo.dropped) for _, memo in chosen]
            try:
                planned = plan(chosen, batch, part, trial.state if on_candidate else self.current)
                new = sorted({name for (_, m), n in zip(chosen, dropped) for name in m.dropped[n:]})
                if on_candidate and new:
                    raise RuntimeError(f"its drafters {new} raised and were dropped")
            except Exception as e:
                if not on_candidate:
                    raise  # the proposer's own failure path: this step goes without drafts
                for (_, memo), n in zip(chosen, dropped):  # the candidate's drafters failed, not the current's
                    del memo.dropped[n:]
                self._end_trial(f"it failed while planning ({type(e).__name__}: {e})", rollback=True)
                part = [] if seen is not None else None
                planned = plan(chosen, batch, part, self.current)
            for n, (j, block) in enumerate(zip(idx, planned)):
                out[j] = block
                if part is not None:
                    seen_rows[j] = part[n]
        if seen is not None:
            seen.extend(seen_rows)
        if self.trial is not None:
            self._judge()
        return out

    def _route(self, memo, context: np.ndarray, committed: int, seconds: float | None) -> bool:
        """Whether this step of the request (``memo``: its memory, found by the proposer's one request table, which
        keeps its arm) is planned by the candidate; credits its last step's committed tokens and seconds to the arm
        that planned it. A request keeps the arm it was given when first seen."""
        trial, prev = self.trial, memo.arm
        if prev is None:  # first seen: drawn from its context's key (the request table's), stable
            arm = (trial.number, key_position(request_key(context)) < trial.fraction) if trial else (0, False)
        elif trial and prev[0] == trial.number:
            arm = prev
            trial.arms[prev[1]].credit(committed, seconds)
        else:  # seen before this trial began (or after it ended): the current policy's
            arm = (0, False)
        memo.arm = arm
        return bool(trial) and arm[1]

    # ------------------------------------------------------------------ reload
    def poll(self, plan, force: bool = False) -> None:
        """Every ``SACPOLICY_RELOAD_S`` seconds (or now, ``force``): follow ``current`` and ``candidate``, each new
        version smoke-tested with ``plan`` (the proposer's planning function, as ``blocks`` takes it)."""
        if self.root is None or (self.every is None and not force):
            return
        now = time.monotonic()
        if now < self.next_poll and not force:
            return
        self.next_poll = now + (self.every or 0.0)
        changed = False
        current = read_link(self.root, CURRENT)
        if current is not None and current != self.current_link and (CURRENT, current) not in self.refused:
            if self._switch(current, plan) and self.trial is not None:  # a trial compares against what serves now
                self._end_trial("current moved; the trial restarts against it", rollback=False)
            changed = True
        candidate = read_link(self.root, CANDIDATE)
        if candidate == self.current_link or (CANDIDATE, candidate) in self.refused:
            candidate = None  # promoted (or what already serves), or found wrong before
        if (self.trial.link if self.trial else None) != candidate:
            changed = True
            if self.trial is not None:
                self._end_trial("its link was removed or moved", rollback=False)
            if candidate is not None:
                self._start_trial(candidate, plan)
        if changed:
            self.notify()

    def _switch(self, link: str, plan) -> bool:
        try:
            served = self._validated(link, plan)
        except Exception as e:
            self._refuse(CURRENT, link, e)
            return False
        old, self.current = self.current.policy_id, served
        self.current_link, self.reloads = link, self.reloads + 1
        logger.info("sacpolicy proposer: reloaded policy %s (was %s) from %s", served.policy_id, old,
                    self.root / CURRENT)
        return True

    def _validated(self, link: str, plan) -> ServedPolicy:
        """The served policy of the version ``link`` points at, once it loads (checksums), was fitted for the running
        target, fits the server's k cap and plans a smoke-test block; else an ``ArtifactError`` naming the fix."""
        version = self.root / link
        art = load_artifact(version / "policy")
        manifest = version / "policy" / "policy.json"
        target = (art.provenance or {}).get("target")
        if target != self.target:
            raise ArtifactError(f"{manifest} was fitted for target {target!r}, but this server runs a policy for "
                                f"{self.target!r}; deploy a policy fitted for {self.target!r} (a target of its own "
                                "gets a deploy root of its own)")
        if art.rule.k_max > self.k_cap:
            raise ArtifactError(f"{manifest} has k_max {art.rule.k_max}, but this server verifies at most "
                                f"{self.k_cap} draft tokens a step (num_speculative_tokens); refit it with k_max <= "
                                f"{self.k_cap}, or restart the server with {version / 'speculative_config.json'}")
        served = served_policy(art, self.drafter, version.name, k_cap=self.k_cap, max_model_len=self.max_model_len,
                               load=self.load, running=self.current, learn=self.learn)
        # on copies of its drafters: the smoke test teaches the running ones (kept by ``served``) nothing
        got = plan([(_SMOKE, None), (_SMOKE[:20], (0.5, 1.0))], 2 if served.load_aware else 1, None,
                   served.isolated())
        ok = (isinstance(got, list) and len(got) == 2 and all(isinstance(b, list) and len(b) <= self.k_cap
                                                              and all(isinstance(t, int) for t in b) for b in got))
        if not ok:
            raise ArtifactError(f"{version} failed the smoke test (planned {got!r} on a synthetic context, not lists "
                                f"of at most {self.k_cap} token ids); re-export it")
        return served

    def _refuse(self, name: str, link: str, e: Exception) -> None:
        self.refused.add((name, link))
        self.reload_failures += 1
        fix = (f"deploy a good version (python scripts/deploy.py --root {self.root} --policy <artifact>) or point "
               f"{name} back (python scripts/deploy.py --root {self.root} --rollback)" if name == CURRENT else
               f"deploy a good candidate (python scripts/deploy.py --root {self.root} --policy <artifact> --candidate)")
        logger.error("sacpolicy proposer: not serving %s -> %s: %s. The proposer keeps policy %s; fix: %s",
                     self.root / name, link, e, self.current.policy_id, fix)

    # ------------------------------------------------------------------ canary
    def _start_trial(self, link: str, plan) -> None:
        try:
            state = self._validated(link, plan)
        except Exception as e:
            self._refuse(CANDIDATE, link, e)
            self._remove_candidate(link)
            return
        fraction, min_steps = self._canary_settings()
        self.trials += 1
        self.trial = _Trial(self.trials, link, state, fraction, min_steps)
        logger.info("sacpolicy proposer: candidate %s on trial for %.0f%% of new requests", state.policy_id,
                    100 * fraction)

    def _canary_settings(self) -> tuple[float, int]:
        settings = {}
        path = self.root / CANARY_FILE
        if path.is_file():
            try:
                settings = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                logger.error("%s is not valid JSON (%s); using fraction %g (write it with scripts/deploy.py "
                             "--candidate --fraction F)", path, e, DEFAULT_FRACTION)
        try:
            fraction = float(os.environ.get(CANARY_ENV) or settings.get("fraction", DEFAULT_FRACTION))
            min_steps = int(settings.get("min_steps", DEFAULT_MIN_STEPS))
        except (TypeError, ValueError):
            logger.error("bad canary settings (%s=%r, %s: %r); using fraction %g", CANARY_ENV,
                         os.environ.get(CANARY_ENV), path, settings, DEFAULT_FRACTION)
            fraction, min_steps = DEFAULT_FRACTION, DEFAULT_MIN_STEPS
        return min(max(fraction, 0.0), 1.0), max(min_steps, 2)

    def _judge(self) -> None:
        """Once both arms have ``min_steps`` timed steps, judge the candidate by served time: roll it back when its
        seconds per output token over the current policy's lie above 1 (interval), say so when they lie below."""
        trial = self.trial
        if min(trial.arms[False].seconds[0], trial.arms[True].seconds[0]) < trial.min_steps:
            return
        iv = trial.interval("seconds")
        if iv is not None and iv[1] > 1.0:
            self._end_trial(f"it serves slower: {iv[0]:.3f}x the current policy's seconds per output token "
                            f"[{iv[1]:.3f}, {iv[2]:.3f}]", rollback=True)
        elif iv is not None and iv[2] < 1.0 and not trial.better_logged:
            trial.better_logged = True
            logger.info("sacpolicy proposer: candidate %s takes %.3fx the seconds per output token [%.3f, %.3f]; "
                        "promote it with python scripts/deploy.py --root %s --promote", trial.state.policy_id, *iv,
                        self.root)

    def _end_trial(self, why: str, rollback: bool) -> None:
        trial, self.trial = self.trial, None
        self.last_trial = trial.summary() | {"ended": why, "rolled_back": rollback}
        if rollback:
            self.canary_rollbacks += 1
            self.refused.add((CANDIDATE, trial.link))
            self._remove_candidate(trial.link)
            logger.warning("sacpolicy proposer: candidate %s rolled back: %s", trial.state.policy_id, why)
        self.notify()

    def _remove_candidate(self, link: str) -> None:
        path = self.root / CANDIDATE
        if read_link(self.root, CANDIDATE) == link:  # not a newer candidate the operator put there meanwhile
            with contextlib.suppress(OSError):
                path.unlink()

    def stats(self) -> dict:
        return {"policy_id": self.current.policy_id, "reloads": self.reloads, "reload_failures": self.reload_failures,
                "canary_rollbacks": self.canary_rollbacks,
                "canary": self.trial.summary() if self.trial else self.last_trial}
