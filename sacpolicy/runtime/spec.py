"""THE drafter spec: how to rebuild a drafter, as plain data. Hydra configs (``conf/draft/*``) instantiate it,
policy artifacts store it as JSON, and ``sacpolicy.build.build_drafter(spec, target)`` turns it into a drafter.
numpy-free plain Python, so production decoders read artifacts without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sacpolicy.runtime.ngram import MAX_NGRAM, MIN_NGRAM
from sacpolicy.runtime.suffix import MAX_DEPTH, MAX_NODES, MAX_REQUESTS, MIN_TOKEN_PROB, SPEC_FACTOR

# beside a "model" drafter's save_pretrained files when its vocabulary is trimmed (the draft-to-target token map, d2t)
VOCAB_MAP_FILE = "vocab_map.safetensors"
TREE_WIDTH = 4  # a feature head's token tree: nodes expanded per depth and children kept per node (EAGLE-2's top-k)

# kind -> (required fields, optional fields) besides kind and name
KINDS = {
    "model": (("path",), ()),  # a draft model sharing the target's tokenizer: a draft dir or any model spec
    "ngram": ((), ("max_ngram", "min_ngram")),  # prompt lookup
    "layer_skip": (("layers",), ()),  # the target's first `layers` layers, sharing its weights
    # an EAGLE-3 head over the target's hidden states (a head dir); ``tree`` > 0: EAGLE-2 token trees of that many
    # nodes by default (0: chains), ``tree_width`` nodes expanded per depth
    "feature": (("path",), ("tree", "tree_width")),
    # SuffixDecoding over the request and a global index of earlier outputs (sacpolicy.runtime.suffix)
    "suffix": ((), ("max_depth", "spec_factor", "min_token_prob", "max_nodes", "max_requests")),
}

# fields added after artifacts were first shipped, with the value that means "not used": written only when set, so an
# artifact that does not use them stays readable by a runtime from before them (a production engine not yet upgraded)
LATER_FIELDS = {"tree": 0, "tree_width": TREE_WIDTH}


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class DrafterSpec:
    kind: str
    name: str
    path: str | None = None
    layers: int | None = None
    max_ngram: int = MAX_NGRAM
    min_ngram: int = MIN_NGRAM
    max_depth: int = MAX_DEPTH
    spec_factor: float = SPEC_FACTOR
    min_token_prob: float = MIN_TOKEN_PROB
    max_nodes: int = MAX_NODES
    max_requests: int = MAX_REQUESTS  # 0: no global index over earlier requests
    tree: int = 0  # feature heads: the token-tree budget of decisions that name none (0: chains)
    tree_width: int = TREE_WIDTH

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(f"drafter {self.name!r} has kind {self.kind!r}; kinds are {sorted(KINDS)}")
        missing = [f for f in KINDS[self.kind][0] if getattr(self, f) is None]
        if missing:
            raise SpecError(f"{self.kind} drafter {self.name!r} needs {missing} (e.g. draft.{self.name}."
                            f"{missing[0]}=...)")
        if self.kind == "ngram" and not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecError(f"n-gram drafter {self.name!r} needs 1 <= min_ngram <= max_ngram, got "
                            f"{self.min_ngram}, {self.max_ngram}")
        if self.kind == "suffix":
            self._check_suffix()
        if self.kind == "feature" and (self.tree < 0 or self.tree_width < 1):
            raise SpecError(f"feature drafter {self.name!r} needs tree >= 0 (0 = chains) and tree_width >= 1, got "
                            f"{self.tree} and {self.tree_width}")
        if self.kind == "layer_skip" and int(self.layers) < 1:
            raise SpecError(f"layer-skip drafter {self.name!r} needs layers >= 1, got {self.layers}")

    def _check_suffix(self) -> None:
        problems = [what for what, bad in (
            (f"max_depth >= 1 (got {self.max_depth})", self.max_depth < 1),
            (f"spec_factor > 0 (got {self.spec_factor})", self.spec_factor <= 0),
            (f"0 <= min_token_prob <= 1 (got {self.min_token_prob})", not 0 <= self.min_token_prob <= 1),
            (f"max_nodes >= max_depth (got {self.max_nodes})", self.max_nodes < self.max_depth),
            (f"max_requests >= 0 (got {self.max_requests}; 0 = no global index)", self.max_requests < 0),
        ) if bad]
        if problems:
            raise SpecError(f"suffix drafter {self.name!r} needs {', '.join(problems)}")

    def to_dict(self) -> dict:
        """{"kind": ..., <the kind's fields>}: the JSON form (the name is the key it is stored under); ``LATER_FIELDS``
        only where they are set."""
        required, optional = KINDS[self.kind]
        return {"kind": self.kind, **{f: getattr(self, f) for f in required + optional
                                      if f not in LATER_FIELDS or getattr(self, f) != LATER_FIELDS[f]}}

    @classmethod
    def from_dict(cls, name: str, d: dict) -> DrafterSpec:
        kind = d.get("kind")
        if kind not in KINDS:
            raise SpecError(f"drafter {name!r} has kind {kind!r}; kinds are {sorted(KINDS)}")
        required, optional = KINDS[kind]
        keys = set(d) - {"kind", "name"}
        if not set(required) <= keys or not keys <= set(required) | set(optional):
            raise SpecError(f"{kind} drafter {name!r} has keys {sorted(keys)}; it needs {sorted(required)}"
                            + (f" and may have {sorted(optional)}" if optional else ""))
        return cls(kind=kind, name=name, **{k: d[k] for k in keys})

    def resolved(self) -> DrafterSpec:
        """Local paths made absolute (a model spec that is no local path is left as it is)."""
        if self.path is not None and Path(self.path).exists():
            return DrafterSpec(**{**vars(self), "path": str(Path(self.path).resolve())})
        return self
