"""Export a learned policy artifact (``save_policy``'s directory, e.g. a run's ``policies/<predictor>``) to a decoder.

    python scripts/export.py policy_dir=out/run/policies/hgb format=runtime [out=deploy/policy]
        verify every checksum and the feature spec; with out=, write a verified copy there
    python scripts/export.py policy_dir=out/run/policies/hgb format=transformers draft_dir=out/run/distill/draft
        write the rule's static k and confidence threshold into draft_dir/generation_config.json
    python scripts/export.py policy_dir=out/run/policies/hgb format=vllm [draft_dir=/models/draft] [out=vllm.json]
        write vLLM's speculative_config (default out: <policy_dir>.vllm.json)

Optional for transformers and vllm: drafter=<name> (which of the policy's drafters to export). Arguments are
``key=value`` pairs, as with the Hydra scripts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("runtime", "transformers", "vllm")
KEYS = ("policy_dir", "format", "draft_dir", "out", "drafter")


def parse(argv: list[str]) -> dict[str, str]:
    args = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key not in KEYS:
            raise SystemExit(f"export: bad argument {a!r}; pass key=value with keys {list(KEYS)}")
        args[key] = value
    if "policy_dir" not in args:
        raise SystemExit("export: policy_dir= is required: the policy artifact directory (save_policy's output)")
    if args.get("format") not in FORMATS:
        raise SystemExit(f"export: unknown format {args.get('format')!r}; format= one of {list(FORMATS)}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    from sacpolicy.runtime import load_artifact, save_policy

    policy_dir = Path(args["policy_dir"])
    try:
        art = load_artifact(policy_dir)
        if args["format"] == "runtime":
            rule = art.rule
            print(f"{policy_dir}: verified ({rule.predictor.kind} predictor, drafters {list(rule.drafters)}, "
                  f"mode {rule.mode}, k_max {rule.k_max})")
            if "out" in args:
                save_policy(args["out"], rule, drafters=art.drafters, provenance=art.provenance, metrics=art.metrics)
                print(f"wrote {args['out']}")
        elif args["format"] == "transformers":
            from sacpolicy.export.hf import export_generation_config

            if "draft_dir" not in args:
                raise SystemExit("export: format=transformers needs draft_dir= the draft model directory")
            settings = export_generation_config(art, args["draft_dir"], drafter=args.get("drafter"))
            print(f"wrote {Path(args['draft_dir']) / 'generation_config.json'}: {json.dumps(settings)}")
        else:
            from sacpolicy.export.vllm import speculative_config
            from sacpolicy.io import write_json

            out = Path(args.get("out") or policy_dir.with_name(policy_dir.name + ".vllm.json"))
            config = speculative_config(art, args.get("draft_dir"), drafter=args.get("drafter"))
            write_json(out, config)
            print(f"wrote {out}: {json.dumps(config)}")
    except (ValueError, FileNotFoundError) as e:  # ArtifactError, RuleError: messages that name the fix
        raise SystemExit(f"export: {e}") from e
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
