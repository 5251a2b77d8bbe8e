"""Stage ``export``: per policy (``export/<predictor>``), vLLM's static speculative_config (``vllm.json``), the vLLM
serving directory of ``sacpolicy.export.vllm.export_vllm`` (``vllm/``: the learned rule as vLLM's custom proposer)
with its lookup drafters (n-gram, suffix), ``vllm_head/`` (its EAGLE-3 head as vLLM's eagle3 under the rule's
k-by-batch-size map) when the cost model priced the head inside vLLM (``scripts/profile_vllm.py --head``), and, when
the policy has a model drafter, the transformers generation_config settings for stock assisted generation."""

from __future__ import annotations

import logging
import shutil

from sacpolicy.pipeline.context import RunContext

logger = logging.getLogger(__name__)


def run(ctx: RunContext) -> dict:
    from sacpolicy.decoding.lookup import LOOKUP_KINDS
    from sacpolicy.export.hf import export_generation_config
    from sacpolicy.export.reload import lookup_drafters
    from sacpolicy.export.vllm import export_vllm, write_vllm_config
    from sacpolicy.runtime.artifact import ArtifactError, load_artifact

    out = {}
    for name in ctx.cfg.predictor:
        policy_dir = ctx.need(f"policies/{name}", "export")
        dest = ctx.out_dir / "export" / name
        dest.mkdir(parents=True, exist_ok=True)
        art = load_artifact(policy_dir)  # verified once, for every export below
        out[name] = {"runtime": str(policy_dir), "vllm": str(write_vllm_config(art, dest / "vllm.json"))}
        if any(spec.kind in LOOKUP_KINDS for spec in art.drafters.values()):
            # the learned rule in vLLM runs with its lookup drafters (vLLM's hook has token ids only, none for others)
            out[name]["vllm_dir"] = str(export_vllm(art, dest / "vllm", drafter=",".join(lookup_drafters(art))))
        head = art.rule.cost.meta.get("vllm_head")
        if head in art.drafters:  # the head's costs are vLLM's own: its k-by-batch-size map is worth serving
            out[name]["vllm_head_dir"] = str(export_vllm(art, dest / "vllm_head", drafter=head))
        draft_dir = ctx.find("distill/draft")
        if draft_dir is not None and (draft_dir / "generation_config.json").is_file():
            shutil.copyfile(draft_dir / "generation_config.json", dest / "generation_config.json")
        try:
            out[name]["transformers"] = export_generation_config(art, dest)
        except ArtifactError as exc:  # no model drafter among the policy's drafters
            logger.info("no transformers export for %s: %s", name, exc)
    return out
