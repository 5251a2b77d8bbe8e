"""Export a learned policy artifact (``save_policy``'s directory, e.g. a run's ``policies/<predictor>``) to a decoder.

    python scripts/export.py policy_dir=out/run/policies/hgb format=runtime [out=deploy/policy]
        verify every checksum and the feature spec; with out=, write a verified copy there
    python scripts/export.py policy_dir=out/run/policies/hgb format=transformers draft_dir=out/run/distill/draft
        write the rule's static k and confidence threshold into draft_dir/generation_config.json
    python scripts/export.py policy_dir=out/run/policies/hgb format=vllm [drafter=ngram,suffix] [out=deploy/vllm]
        a directory that serves the policy in vLLM (default out: <policy_dir>.vllm): speculative_config.json (the
        learned rule as vLLM's custom proposer over its lookup drafters, n-gram and suffix: all of them, or those
        ``drafter=`` names, comma-separated; a model drafter's static k as draft_model),
        static_speculative_config.json, policy/ and vllm.env; then
            env $(cat deploy/vllm/vllm.env) vllm serve <target> --speculative-config "$(cat deploy/vllm/speculative_config.json)"
        [--check]: first check that vLLM imports in this environment (a clear error if it does not)

    python scripts/export.py head_dir=out/run/head/head format=speculators out=deploy/eagle3 [policy_dir=...] \
        [target=Qwen/Qwen2.5-7B-Instruct]
        an EAGLE-3 head in vLLM's speculators format (``speculative_tokens``: the policy's static k for its feature
        drafter when policy_dir= is given, else 3), checked against and naming its target: ``target=`` any model
        spec (hub id, directory, .gguf, embedded:...; ``verifier=`` is its older name), default the target the head
        was trained for (its config's verifier: the run's target), else the embedded target
    python scripts/export.py head_dir=out/run/head/head format=sglang out=deploy/eagle3-sglang
        the same head in SGLang's EAGLE-3 layout (``LlamaForCausalLMEagle3``, ``midlayer.*``)

Optional for transformers and vllm: drafter=<name> (which of the policy's drafters to export). Arguments are
``key=value`` pairs, as with the Hydra scripts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("runtime", "transformers", "vllm", "speculators", "sglang")
HEAD_FORMATS = ("speculators", "sglang")
KEYS = ("policy_dir", "format", "draft_dir", "out", "drafter", "head_dir", "verifier", "target")


def parse(argv: list[str]) -> dict[str, str]:
    args = {}
    if "--check" in argv:
        args["check"] = "1"
        argv = [a for a in argv if a != "--check"]
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key not in KEYS:
            raise SystemExit(f"export: bad argument {a!r}; pass key=value with keys {list(KEYS)}")
        args[key] = value
    if args.get("format") not in FORMATS:
        raise SystemExit(f"export: unknown format {args.get('format')!r}; format= one of {list(FORMATS)}")
    if args["format"] in HEAD_FORMATS:
        if "head_dir" not in args or "out" not in args:
            raise SystemExit(f"export: format={args['format']} needs head_dir= (an EAGLE-3 head directory, e.g. "
                             "<run>/head/head) and out= (the directory to write)")
    elif "policy_dir" not in args:
        raise SystemExit("export: policy_dir= is required: the policy artifact directory (save_policy's output)")
    return args


def export_head(args: dict) -> None:
    from sacpolicy.export.speculators import export_head_for, export_sglang, head_target

    if args["format"] == "sglang":
        print(f"wrote {export_sglang(args['head_dir'], args['out'])}")
        return
    k = 3
    if "policy_dir" in args:
        from sacpolicy.export import static_k
        from sacpolicy.runtime import load_artifact

        art = load_artifact(args["policy_dir"])
        feature = [n for n, spec in art.drafters.items() if spec.kind == "feature"]
        if not feature:
            raise SystemExit(f"export: the policy at {args['policy_dir']} has no feature drafter; drop policy_dir= "
                             "or pass a policy trained with the head")
        k = max(1, static_k(art.rule, feature[0]))
    target = args.get("target") or args.get("verifier") or head_target(args["head_dir"])
    print(f"wrote {export_head_for(args['head_dir'], args['out'], target, num_speculative_tokens=k)} "
          f"(speculative_tokens={k}, target {target})")


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args["format"] in HEAD_FORMATS:
        try:
            export_head(args)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"export: {e}") from e
        return 0
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
            from sacpolicy.export.vllm import export_vllm

            if "check" in args:
                from sacpolicy.export.vllm_run import vllm_status

                ok, why = vllm_status()
                if not ok:
                    raise SystemExit(f"export: --check: {why}")
                print(f"vLLM {why} imports here")
            out = Path(args.get("out") or policy_dir.with_name(policy_dir.name + ".vllm"))
            export_vllm(art, out, draft_dir=args.get("draft_dir"), drafter=args.get("drafter"))
            print(f"wrote {out}: speculative_config.json {(out / 'speculative_config.json').read_text().strip()}")
    except (ValueError, FileNotFoundError) as e:  # ArtifactError, RuleError: messages that name the fix
        raise SystemExit(f"export: {e}") from e
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
