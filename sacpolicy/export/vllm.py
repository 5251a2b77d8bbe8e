"""A learned policy in vLLM (tested inside a real engine: tests/test_vllm.py, scripts/bench_vllm.py).

Learned, per step and request: ``PolicyProposer`` is a vLLM custom proposer class (vLLM's experimental hook
``{"method": "custom_class", "model": "sacpolicy.export.vllm.PolicyProposer", "num_speculative_tokens": k_max}``,
the policy directory in the ``SACPOLICY_POLICY_DIR`` environment variable). For every request in the batch it runs
what sacpolicy's decoder runs: the rule's lookup drafters (n-gram, suffix) peek, ``LearnedPolicy`` plans (drafter,
block) from the same feature rows (context length, the peeked proposals, the request's acceptance history), the chosen
drafter proposes under the stop rule; none when the rule prefers autoregressive decoding. vLLM's hook gives no request
ids: ``_History`` finds a request again by its committed tokens. Greedy outputs and vLLM's own acceptance counters
equal our decoder's. The proposer itself is ``sacpolicy.export.proposer`` (re-exported here, where exports name it);
this module writes the configurations and export directories that serve it.

Static: ``speculative_config(artifact)`` is the rule's static choice (``sacpolicy.export.static_k``), as
``{"method": "draft_model", "model": <draft dir>, "num_speculative_tokens": k}`` or
``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": .., "prompt_lookup_min": ..}``; model
drafters in vLLM keep a static k (no per-step hook). ``export_vllm`` writes both with the policy and its environment.

A feature drafter (the EAGLE-3 head) is served as vLLM's ``eagle3`` method, the head written beside the policy in the
speculators format (``head/``), with the rule's k-by-batch-size map (vLLM's dynamic speculative decoding,
``num_speculative_tokens_per_batch_size``; k = 0 where drafting loses) when the policy's cost model was profiled over
batch sizes, best inside vLLM itself (``scripts/profile_vllm.py --head``): that is how the learned rule runs the head
in vLLM, which has no per-step hook for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sacpolicy.decoding.lookup import LOOKUP_KINDS
from sacpolicy.export import k_by_batch, pick_drafter, static_k

# the proposer lives in export.proposer; its names are re-exported here, where exports and servers name them
from sacpolicy.export.proposer import (  # noqa: F401
    DRAFTER_ENV,
    LOAD_ENV,
    LOG_ENV,
    POLICY_ENV,
    STATS_ENV,
    PolicyNgramProposer,
    PolicyProposer,
    Served,
    as_served,
    gc_clock,
)
from sacpolicy.export.reload import lookup_drafters
from sacpolicy.io import write_json, write_text
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact

logger = logging.getLogger(__name__)

VLLM_KINDS = ("model", "ngram")  # the kinds picked when no drafter is named; a "feature" head when named


def speculative_config(artifact, draft_dir=None, *, drafter: str | None = None) -> dict:
    """vLLM's ``speculative_config`` for the rule's static choice (``drafter``: another of its drafters; layer-skip
    drafters have no vLLM method). ``draft_dir`` overrides the model drafter's path (e.g. where the draft lives on
    the serving machine)."""
    art = artifact if isinstance(artifact, PolicyArtifact) else load_artifact(artifact)
    name = pick_drafter(art.rule, art.drafters, drafter, VLLM_KINDS if drafter is None else (*VLLM_KINDS, "feature"))
    spec, k = art.drafters[name], static_k(art.rule, name)
    if k < 1:
        logger.warning("the policy at %s expects no speedup from drafter %r at any k; exporting the minimum k=1 "
                       "(consider serving without speculative decoding)", art.path, name)
        k = 1
    if spec.kind == "ngram":
        out = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": spec.max_ngram,
               "prompt_lookup_min": spec.min_ngram}
    elif spec.kind == "feature":
        if draft_dir is None:
            raise ArtifactError(f"drafter {name!r} is an EAGLE-3 head ({spec.path}), which vLLM reads in the "
                                "speculators format: pass draft_dir=<its speculators export> (scripts/export.py "
                                "head_dir=... format=speculators), or export with export_vllm, which writes one")
        out = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    else:
        out = {"method": "draft_model", "model": str(draft_dir or spec.path), "num_speculative_tokens": k}
    schedule = k_by_batch(art.rule, name)
    if schedule is not None:  # the learned k-by-load map (cost model profiled over batch sizes)
        out["num_speculative_tokens"] = max(1, *(k for *_, k in schedule))
        out["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    return out


def write_vllm_config(artifact, out_path, draft_dir=None) -> Path:
    """``speculative_config(artifact, draft_dir)`` (an artifact directory or ``PolicyArtifact``) as JSON at
    ``out_path`` (atomically)."""
    return write_json(out_path, speculative_config(artifact, draft_dir))


VLLM_SUPPORT = ("vLLM runs lookup drafters (n-gram, suffix) per step under the learned rule (custom proposer), a "
                "model drafter as "
                "method draft_model with the rule's static k, and an EAGLE-3 feature head as method eagle3 "
                "(scripts/export.py head_dir=... format=speculators); it has nothing for layer-skip drafters")


def learned_config(artifact, *, drafter: str | None = None) -> dict:
    """vLLM's ``speculative_config`` that runs the learned rule (``PolicyProposer``, with the policy directory in
    ``SACPOLICY_POLICY_DIR``): k up to the rule's ``k_max``. Refuses a rule that chooses among drafters vLLM cannot
    run beside the lookup drafters (a custom proposer proposes from token ids alone: n-gram and suffix lookups),
    unless ``drafter=`` names the lookup drafters to serve it with ("ngram" or "ngram,suffix")."""
    art = artifact if isinstance(artifact, PolicyArtifact) else load_artifact(artifact)
    others = {n: s.kind for n, s in art.drafters.items() if s.kind not in LOOKUP_KINDS}
    if drafter is None and others:
        lookups = [n for n, s in art.drafters.items() if s.kind in LOOKUP_KINDS]
        hint = (f"pass drafter={','.join(lookups)} to serve the rule with its lookup drafters alone" if lookups else
                "train a policy with an n-gram or suffix drafter (draft=[ngram] or draft=[ngram,suffix])")
        raise ArtifactError(f"the policy at {art.path} also chooses drafters {others}, which vLLM cannot run per "
                            f"step: {VLLM_SUPPORT}; {hint}")
    lookup_drafters(art, drafter)  # the named ones are the rule's lookup drafters
    return {"method": "custom_class", "model": f"{__name__}.{PolicyProposer.__name__}",
            "num_speculative_tokens": art.rule.k_max}


def export_vllm(artifact, out_dir, *, draft_dir=None, drafter: str | None = None) -> Path:
    """A directory that serves the policy in vLLM:

    - ``speculative_config.json``: the learned rule (``learned_config``) when the drafter is an n-gram one, else the
      static setting (``speculative_config``: a model drafter as ``draft_model``);
    - ``static_speculative_config.json``: the rule's static setting, with the learned k-by-batch-size map
      (``num_speculative_tokens_per_batch_size``) when the policy's cost model was profiled over batch sizes;
    - ``policy/`` (a verified copy of the artifact) and ``vllm.env`` (``SACPOLICY_POLICY_DIR`` and the drafter it
      runs, ``SACPOLICY_POLICY_DRAFTER``) for the custom proposer::

        env $(cat out/vllm.env) vllm serve <target> --speculative-config "$(cat out/speculative_config.json)"

    ``drafter=`` a feature drafter (the EAGLE-3 head): ``_export_head``. Refuses, naming them, drafters vLLM cannot run
    (layer-skip)."""
    art = artifact if isinstance(artifact, PolicyArtifact) else load_artifact(artifact)
    kinds = {n: s.kind for n, s in art.drafters.items()}
    if drafter is not None and kinds.get(drafter) == "feature":
        return _export_head(art, drafter, Path(out_dir), draft_dir)
    if drafter is None:
        if set(kinds.values()) <= set(LOOKUP_KINDS):  # every drafter runs in the custom proposer
            drafter = ",".join(lookup_drafters(art))
        elif set(kinds.values()) - set(VLLM_KINDS) or len(kinds) > 1:
            raise ArtifactError(f"the policy at {art.path} chooses among drafters {kinds}; {VLLM_SUPPORT}. Pass "
                                "drafter=<name> to export one of them for vLLM (or its lookup drafters, "
                                "drafter=ngram,suffix)")
        else:
            drafter = next(iter(kinds))
    names = [n.strip() for n in drafter.split(",") if n.strip()]
    if len(names) > 1 or kinds.get(names[0]) == "suffix":  # lookup drafters served together by the custom proposer
        learned = learned_config(art, drafter=drafter)
        served = lookup_drafters(art, drafter)
        primary = next((n for n in served if kinds[n] == "ngram"), None)
        static = speculative_config(art, draft_dir, drafter=primary) if primary else learned  # vLLM: no suffix here
        return _write_export(art, Path(out_dir), ",".join(served), learned, static)
    if kinds.get(drafter) not in VLLM_KINDS:
        art.rule.check_drafter(drafter)
        raise ArtifactError(f"drafter {drafter!r} is a {kinds[drafter]} drafter; {VLLM_SUPPORT}")
    static = speculative_config(art, draft_dir, drafter=drafter)
    learned = learned_config(art, drafter=drafter) if kinds[drafter] == "ngram" else static
    return _write_export(art, Path(out_dir), drafter, learned, static)


def _write_export(art: PolicyArtifact, out: Path, drafter: str, learned: dict, static: dict) -> Path:
    """An export directory: ``policy/``, both speculative configs and ``vllm.env``."""
    from sacpolicy.runtime.artifact import save_policy

    out.mkdir(parents=True, exist_ok=True)
    policy = save_policy(out / "policy", art.rule, drafters=art.drafters, provenance=art.provenance,
                         metrics=art.metrics)
    write_json(out / "speculative_config.json", learned)
    write_json(out / "static_speculative_config.json", static)
    env = {POLICY_ENV: Path(policy).resolve(), DRAFTER_ENV: drafter}
    write_text(out / "vllm.env", "".join(f"{k}={v}\n" for k, v in env.items()))
    return out


def _export_head(art: PolicyArtifact, drafter: str, out: Path, draft_dir=None) -> Path:
    """The vLLM export of the rule's EAGLE-3 head: ``head/`` (the head in the speculators format, for the target the
    policy was trained for; ``draft_dir``: an existing speculators export to point at instead), and in both
    ``speculative_config.json`` and ``static_speculative_config.json`` vLLM's ``eagle3`` method with the rule's static
    k and, where its cost model has batch sizes, its k-by-batch-size map (vLLM runs the head under that map: the
    learned rule's choice by load), plus ``policy/`` and ``vllm.env`` as for the other drafters."""
    from sacpolicy.export.speculators import export_speculators
    from sacpolicy.models import EMBEDDED_TARGET, served_model

    spec = art.drafters[drafter]
    out.mkdir(parents=True, exist_ok=True)
    config = speculative_config(art, "<head>", drafter=drafter)  # checks the drafter before anything is written
    if draft_dir is None:
        target = (art.provenance or {}).get("target") or EMBEDDED_TARGET
        draft_dir = export_speculators(spec.path, out / "head", served_model(target),
                                       num_speculative_tokens=config["num_speculative_tokens"], dtype=torch.float32)
    config["model"] = str(Path(draft_dir).resolve())
    return _write_export(art, out, drafter, config, config)
