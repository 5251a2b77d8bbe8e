"""The lookup drafters: those that draft from tokens alone (prompt-lookup n-grams, the suffix tree), with no model
to load. A production proposer (``sacpolicy.export.vllm``) runs them itself on the tokens its engine hands it, and
the collector replays them over a served log; both build them here, from their spec alone."""

from __future__ import annotations

from sacpolicy.decoding.drafters import NgramDrafter
from sacpolicy.decoding.suffix import SuffixDrafter
from sacpolicy.runtime.spec import DrafterSpec

LOOKUP_KINDS = ("ngram", "suffix")


def lookup_drafter(spec: DrafterSpec):
    """The lookup drafter ``spec`` describes (an ``NgramDrafter`` or a fresh ``SuffixDrafter``)."""
    if spec.kind == "ngram":
        return NgramDrafter(spec.max_ngram, spec.min_ngram, name=spec.name)
    if spec.kind == "suffix":
        return SuffixDrafter(spec.max_depth, spec.spec_factor, spec.min_token_prob, spec.max_nodes, spec.max_requests,
                             name=spec.name)
    raise ValueError(f"drafter {spec.name!r} is of kind {spec.kind!r}, not a lookup drafter {LOOKUP_KINDS}: it needs "
                     "a model, built by sacpolicy.build.build_drafter")
