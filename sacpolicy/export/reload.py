"""Hot reload and canary for the served proposer (``PolicyNgramProposer``), from a deploy root (``deploy.py``).

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

Canary: while ``candidate`` points at a version (validated the same way), requests whose first-seen context hashes
below the fraction are planned by it for their whole life; committed tokens per step are summed per arm and
compared by the ratio of means with a normal interval on its log. The candidate is rolled back (its link removed,
``canary_rollbacks`` counted) when the interval lies below 1, or when it fails; a better one stays on trial until the
operator promotes it (``scripts/deploy.py --promote``): promotion is never automatic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from sacpolicy.decoding import RequestInfo
from sacpolicy.decoding.lookup import LOOKUP_KINDS, lookup_drafter
from sacpolicy.decoding.types import Resettable
from sacpolicy.export import pick_drafter
from sacpolicy.policy.learned import LearnedPolicy
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact

logger = logging.getLogger(__name__)

RELOAD_ENV = "SACPOLICY_RELOAD_S"  # seconds between link checks; "off": never reload
CANARY_ENV = "SACPOLICY_CANARY_FRACTION"  # overrides canary.json's fraction
CURRENT, CANDIDATE, VERSIONS, CANARY_FILE = "current", "candidate", "versions", "canary.json"
DEFAULT_RELOAD_S, DEFAULT_FRACTION, DEFAULT_MIN_STEPS = 30.0, 0.1, 200
_SMOKE = np.tile(np.arange(1, 9, dtype=np.int64), 6)  # repetitive: the n-gram drafter finds matches
_STATE = ("rule", "drafter", "lookups", "lookup_specs", "policy", "_request", "load_aware", "policy_id")  # swapped


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


def policy_state(art: PolicyArtifact, drafter: str | None, policy_id: str, load: bool = True) -> dict:
    """The proposer's per-policy attributes (``_STATE``): the rule, its lookup drafters (``lookup_drafters``, by name;
    the primary one's name as ``drafter``) and the ``LearnedPolicy`` that plans with them; ``load``: price steps at
    vLLM's live batch size where the cost model has batch curves."""
    names = lookup_drafters(art, drafter)
    specs = {n: art.drafters[n] for n in names}
    lookups = {n: lookup_drafter(spec) for n, spec in specs.items()}
    return {"rule": art.rule, "drafter": names[0], "lookups": lookups, "lookup_specs": specs,
            "policy": LearnedPolicy(art.rule),
            "_request": RequestInfo(drafters=art.rule.drafters),
            "load_aware": bool(art.rule.cost.batch) and load, "policy_id": policy_id}


def keep_running_drafters(state: dict, running) -> dict:
    """``state`` with the running proposer's drafters that keep what earlier requests taught them (a suffix drafter's
    global index; ``Resettable``) wherever the spec is the same: that index and its requests' rows outlive a policy
    swap, and a canary's two arms share it."""
    same = {n: running.lookups[n] for n, spec in state["lookup_specs"].items()
            if isinstance(running.lookups.get(n), Resettable) and running.lookup_specs.get(n) == spec}
    return {**state, "lookups": {**state["lookups"], **same}}


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


class _Trial:
    """A candidate on trial: its state, its link and committed tokens per step per arm ((n, sum, sum of squares))."""

    def __init__(self, number: int, link: str, state: dict, fraction: float, min_steps: int):
        self.number, self.link, self.state, self.fraction, self.min_steps = number, link, state, fraction, min_steps
        self.arms = {False: [0, 0.0, 0.0], True: [0, 0.0, 0.0]}  # False: current, True: candidate
        self.better_logged = False

    def credit(self, candidate: bool, tokens: int) -> None:
        arm = self.arms[candidate]
        arm[0], arm[1], arm[2] = arm[0] + 1, arm[1] + tokens, arm[2] + tokens * tokens

    def interval(self):
        return ratio_interval(tuple(self.arms[True]), tuple(self.arms[False]))

    def summary(self) -> dict:
        iv = self.interval()
        return {"candidate": self.state["policy_id"], "fraction": self.fraction,
                "steps": {"current": self.arms[False][0], "candidate": self.arms[True][0]},
                "tokens_per_step_ratio": None if iv is None else [round(x, 4) for x in iv]}


class PolicySlot:
    """The proposer's policy over time: hot reload of ``current`` and the canary of ``candidate`` (module doc). The
    proposer asks it to plan each step's rows (``blocks``); everything runs on the engine thread, between steps."""

    def __init__(self, proposer, art: PolicyArtifact, root: Path | None, drafter: str | None, load: bool = True):
        self.p, self.root, self.drafter, self.load = proposer, root, drafter, load
        self.target = (art.provenance or {}).get("target")
        self.every = reload_interval() if root is not None else None
        link = read_link(root, CURRENT) if root is not None else None
        self.current_link = link if link and Path(link).name == proposer.policy_id else None  # moved since: reload
        self.refused: set[tuple[str, str]] = set()  # (link name, target) found wrong: never retried
        self.next_poll, self.trial, self.trials, self.last_trial = 0.0, None, 0, None
        self.reloads = self.reload_failures = self.canary_rollbacks = 0
        self.arms: OrderedDict = OrderedDict()  # request key -> (trial number, on the candidate)
        self.key = type(proposer.history)._key  # requests are found by their committed tokens, as _History does
        self.capacity = proposer.history.capacity

    # ------------------------------------------------------------------ planning
    def blocks(self, rows: list, committed: list[int], batch: int, seen: list | None = None) -> list[list[int]]:
        """The proposer's ``blocks`` for one step's (context, history) rows (``committed``: tokens each row's last
        step committed), each request planned by its arm's policy, at ``batch`` (vLLM's live batch size) where that
        policy is load-aware. ``seen``: gets the proposer's ``seen`` entries of the rows, in their order."""
        self.poll()
        arms = [self._route(context, c) for (context, _), c in zip(rows, committed)]
        out: list[list[int]] = [[] for _ in rows]
        seen_rows: list = [None] * len(rows)
        for on_candidate in (False, True):
            idx = [j for j, a in enumerate(arms) if a == on_candidate]
            if not idx:
                continue
            trial, part = self.trial, [] if seen is not None else None
            try:
                planned = self._plan(trial.state if on_candidate else None, [rows[j] for j in idx], batch, part)
            except Exception as e:
                if not on_candidate:
                    raise  # the proposer's own failure path: this step goes without drafts
                self._end_trial(f"it failed while planning ({type(e).__name__}: {e})", rollback=True)
                part = [] if seen is not None else None
                planned = self._plan(None, [rows[j] for j in idx], batch, part)
            for n, (j, block) in enumerate(zip(idx, planned)):
                out[j] = block
                if part is not None:
                    seen_rows[j] = part[n]
        if seen is not None:
            seen.extend(seen_rows)
        if self.trial is not None:
            self._judge()
        return out

    def _plan(self, state: dict | None, rows: list, batch: int, seen: list | None = None) -> list[list[int]]:
        with self._using(state):
            return self.p.blocks(rows, batch=batch if self.p.load_aware else 1, seen=seen)

    @contextlib.contextmanager
    def _using(self, state: dict | None):
        """The proposer runs ``state``'s policy inside the block (None: its own), then its own again."""
        if state is None:
            yield
            return
        saved = {k: getattr(self.p, k) for k in state}
        self.p.__dict__.update(state)
        try:
            yield
        finally:
            self.p.__dict__.update(saved)

    def _route(self, context: np.ndarray, committed: int) -> bool:
        """Whether this step of the request with ``context`` is planned by the candidate; credits its last step's
        committed tokens to the arm that planned it. A request keeps the arm it was given when first seen."""
        prev = self.arms.pop(self.key(context[: len(context) - committed]), None)
        trial, key = self.trial, self.key(context)
        if prev is None:  # first seen: hashed on its context, stable
            arm = (trial.number, int.from_bytes(key[1][:8], "big") / 2**64 < trial.fraction) if trial else (0, False)
        elif trial and prev[0] == trial.number:
            arm = prev
            trial.credit(prev[1], committed)
        else:  # seen before this trial began (or after it ended): the current policy's
            arm = (0, False)
        self.arms[key] = arm
        while len(self.arms) > self.capacity:
            self.arms.popitem(last=False)
        return bool(trial) and arm[1]

    # ------------------------------------------------------------------ reload
    def poll(self, force: bool = False) -> None:
        """Every ``SACPOLICY_RELOAD_S`` seconds (or now, ``force``): follow ``current`` and ``candidate``."""
        if self.root is None or (self.every is None and not force):
            return
        now = time.monotonic()
        if now < self.next_poll and not force:
            return
        self.next_poll = now + (self.every or 0.0)
        changed = False
        current = read_link(self.root, CURRENT)
        if current is not None and current != self.current_link and (CURRENT, current) not in self.refused:
            if self._switch(current) and self.trial is not None:  # a trial compares against what serves now
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
                self._start_trial(candidate)
        if changed:
            self.p.write_stats()

    def _switch(self, link: str) -> bool:
        try:
            state = self._validated(link)
        except Exception as e:
            self._refuse(CURRENT, link, e)
            return False
        old = self.p.policy_id
        self.p.__dict__.update(state)
        self.current_link, self.reloads = link, self.reloads + 1
        logger.info("sacpolicy proposer: reloaded policy %s (was %s) from %s", state["policy_id"], old,
                    self.root / CURRENT)
        return True

    def _validated(self, link: str) -> dict:
        """The proposer state of the version ``link`` points at, once it loads (checksums), was fitted for the running
        target, fits the server's k cap and plans a smoke-test block; else an ``ArtifactError`` naming the fix."""
        version = self.root / link
        art = load_artifact(version / "policy")
        manifest = version / "policy" / "policy.json"
        target = (art.provenance or {}).get("target")
        if target != self.target:
            raise ArtifactError(f"{manifest} was fitted for target {target!r}, but this server runs a policy for "
                                f"{self.target!r}; deploy a policy fitted for {self.target!r} (a target of its own "
                                "gets a deploy root of its own)")
        if art.rule.k_max > self.p.k_cap:
            raise ArtifactError(f"{manifest} has k_max {art.rule.k_max}, but this server verifies at most "
                                f"{self.p.k_cap} draft tokens a step (num_speculative_tokens); refit it with k_max <= "
                                f"{self.p.k_cap}, or restart the server with {version / 'speculative_config.json'}")
        state = policy_state(art, self.drafter, version.name, self.load)
        with self._using(state):  # on the version's own drafters: the smoke test teaches the running ones nothing
            got = self.p.blocks([(_SMOKE, None), (_SMOKE[:20], (0.5, 1.0))], batch=2 if self.p.load_aware else 1)
        ok = (isinstance(got, list) and len(got) == 2 and all(isinstance(b, list) and len(b) <= self.p.k_cap
                                                              and all(isinstance(t, int) for t in b) for b in got))
        if not ok:
            raise ArtifactError(f"{version} failed the smoke test (planned {got!r} on a synthetic context, not lists "
                                f"of at most {self.p.k_cap} token ids); re-export it")
        return keep_running_drafters(state, self.p)

    def _refuse(self, name: str, link: str, e: Exception) -> None:
        self.refused.add((name, link))
        self.reload_failures += 1
        fix = (f"deploy a good version (python scripts/deploy.py --root {self.root} --policy <artifact>) or point "
               f"{name} back (python scripts/deploy.py --root {self.root} --rollback)" if name == CURRENT else
               f"deploy a good candidate (python scripts/deploy.py --root {self.root} --policy <artifact> --candidate)")
        logger.error("sacpolicy proposer: not serving %s -> %s: %s. The proposer keeps policy %s; fix: %s",
                     self.root / name, link, e, self.p.policy_id, fix)

    # ------------------------------------------------------------------ canary
    def _start_trial(self, link: str) -> None:
        try:
            state = self._validated(link)
        except Exception as e:
            self._refuse(CANDIDATE, link, e)
            self._remove_candidate(link)
            return
        fraction, min_steps = self._canary_settings()
        self.trials += 1
        self.trial = _Trial(self.trials, link, state, fraction, min_steps)
        logger.info("sacpolicy proposer: candidate %s on trial for %.0f%% of new requests", state["policy_id"],
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
        """Roll the candidate back once both arms have ``min_steps`` steps and its interval lies below 1."""
        trial = self.trial
        if min(trial.arms[False][0], trial.arms[True][0]) < trial.min_steps:
            return
        iv = trial.interval()
        if iv is not None and iv[2] < 1.0:
            self._end_trial(f"it commits fewer tokens per step: {iv[0]:.3f}x the current policy's "
                            f"[{iv[1]:.3f}, {iv[2]:.3f}]", rollback=True)
        elif iv is not None and iv[1] > 1.0 and not trial.better_logged:
            trial.better_logged = True
            logger.info("sacpolicy proposer: candidate %s commits %.3fx the tokens per step [%.3f, %.3f]; promote it "
                        "with python scripts/deploy.py --root %s --promote", trial.state["policy_id"], *iv, self.root)

    def _end_trial(self, why: str, rollback: bool) -> None:
        trial, self.trial = self.trial, None
        self.last_trial = trial.summary() | {"ended": why, "rolled_back": rollback}
        if rollback:
            self.canary_rollbacks += 1
            self.refused.add((CANDIDATE, trial.link))
            self._remove_candidate(trial.link)
            logger.warning("sacpolicy proposer: candidate %s rolled back: %s", trial.state["policy_id"], why)
        self.p.write_stats()

    def _remove_candidate(self, link: str) -> None:
        path = self.root / CANDIDATE
        if read_link(self.root, CANDIDATE) == link:  # not a newer candidate the operator put there meanwhile
            with contextlib.suppress(OSError):
                path.unlink()

    def stats(self) -> dict:
        return {"policy_id": self.p.policy_id, "reloads": self.reloads, "reload_failures": self.reload_failures,
                "canary_rollbacks": self.canary_rollbacks,
                "canary": self.trial.summary() if self.trial else self.last_trial}
