"""Deploy a policy to a deploy root that running vLLM servers follow (hot reload, canary), and roll it back.

    python scripts/deploy.py --root deploy/prod --policy out/run/policies/hgb          # a new version, made current
    python scripts/serve.py --config learned --export deploy/prod/current              # serve it (follows current)
    python scripts/deploy.py --root deploy/prod --policy out/refit/policies/hgb --candidate --fraction 0.1
    python scripts/deploy.py --root deploy/prod --promote        # the candidate becomes current (never automatic)
    python scripts/deploy.py --root deploy/prod --withdraw       # end the candidate's trial
    python scripts/deploy.py --root deploy/prod --rollback       # current back to the version before
    python scripts/deploy.py --root deploy/prod --to <version>   # current at a listed version
    python scripts/deploy.py --root deploy/prod --list

``--policy``: a policy artifact (a run's ``policies/<predictor>``) or a ``scripts/export.py format=vllm`` export.
Versions (``root/versions/<time>-<digest>``) are immutable; ``current`` and ``candidate`` are symlinks flipped
atomically. Servers check the links every ``SACPOLICY_RELOAD_S`` seconds (default 30), validate and smoke-test a new
version before they swap to it, and keep their policy when it is wrong (``reload_failures`` in the proposer's stats
file). A candidate serves ``--fraction`` of new requests (hashed, stable per request) and is rolled back by the
servers when it commits fewer tokens per step than current with an interval below 1, or fails.
"""

from __future__ import annotations

import argparse
import sys

from sacpolicy.export.deploy import (
    current_version,
    deploy,
    history,
    point,
    promote,
    rollback,
    version_info,
    versions,
    withdraw,
)
from sacpolicy.export.reload import CANDIDATE, CURRENT
from sacpolicy.runtime.artifact import ArtifactError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="the deploy root (created on the first deploy)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--policy", help="a policy artifact directory or a vLLM export to deploy")
    what.add_argument("--rollback", action="store_true", help="point current at the version it served before")
    what.add_argument("--promote", action="store_true", help="make the candidate current")
    what.add_argument("--withdraw", action="store_true", help="end the candidate's trial")
    what.add_argument("--to", metavar="VERSION", help="point current at this existing version")
    what.add_argument("--list", action="store_true", help="list the versions and what the links point at")
    ap.add_argument("--drafter", default=None, help="which of the policy's n-gram drafters to serve")
    ap.add_argument("--candidate", action="store_true", help="deploy on trial (canary) instead of as current")
    ap.add_argument("--fraction", type=float, default=None, help="the candidate's share of new requests (0.1)")
    ap.add_argument("--min-steps", type=int, default=None, help="steps per arm before the canary judges (200)")
    args = ap.parse_args(argv)
    if (args.candidate or args.fraction is not None or args.min_steps is not None) and not args.policy:
        ap.error("--candidate, --fraction and --min-steps go with --policy")
    if args.fraction is not None and not 0 < args.fraction <= 1:
        ap.error(f"--fraction {args.fraction} must lie in (0, 1]")
    try:
        if args.policy:
            out = deploy(args.policy, args.root, drafter=args.drafter, candidate=args.candidate,
                         fraction=args.fraction, min_steps=args.min_steps)
            print(f"deploy: {out.name} is {CANDIDATE if args.candidate else CURRENT} at {args.root}")
        elif args.rollback:
            print(f"deploy: rolled back; current is {rollback(args.root)}")
        elif args.promote:
            print(f"deploy: promoted; current is {promote(args.root)}")
        elif args.withdraw:
            gone = withdraw(args.root)
            print(f"deploy: candidate {gone} withdrawn" if gone else "deploy: there was no candidate")
        elif args.to:
            print(f"deploy: current is {point(args.root, args.to)}")
        else:
            live, cand = current_version(args.root), current_version(args.root, CANDIDATE)
            for v in versions(args.root):
                info = version_info(args.root, v)
                mark = " <- current" if v == live else " <- candidate" if v == cand else ""
                print(f"{v}  k_max {info['k_max']}  target {info['target']}  from {info['source']}{mark}")
            print(f"{len(history(args.root))} flips in the history")
    except (ArtifactError, OSError) as e:
        raise SystemExit(f"deploy: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
