"""The step log against vLLM's own account of the same requests: vLLM's per-request arrays
(``--per-request-spec-decode-metrics detailed``) hold each verify step's drafted and accepted tokens, and the log
(``traces.steplog_read.requests_of``) must hold the same, step for step (``scripts/serve_logged.py`` and the slow
real-engine test check it). Pure Python over the rebuilt requests: no files, no engine.
"""

from __future__ import annotations


def compare_with_vllm(requests: dict, served: list[tuple[list[int], list[int], dict | None]],
                      k_cap: int | None = None) -> dict:
    """The log's (drafted, accepted) per verified step against vLLM's own per-request arrays
    (``--per-request-spec-decode-metrics detailed``: ``per_step_drafted`` / ``per_step_accepted``). ``requests``:
    ``requests_of``'s; ``served``: per request sent, (prompt ids, output ids, vLLM's ``speculative_decoding`` metrics
    or None). A served request is found in the log by its prompt and output (vLLM's output is a prefix of what its
    engine committed: it cuts a last block at max_tokens or EOS); identical requests pair in order.

    ``k_cap``: the server's ``num_speculative_tokens`` (the log's ``k_cap``). While a request of the batch is within it
    of the context limit, vLLM calls no proposer and verifies dummy drafts of ``k_cap`` zeros for every request
    instead, and its arrays count those steps; the log holds their tokens as a step's ``unseen``, from which the
    dummy steps are rebuilt here (each accepts the leading zeros among them, then commits one token). Without it a
    request with unseen tokens differs. A request whose last steps fell there (the one that reached the limit, or any
    that ended then) is logged up to its last step seen, and differs. -> {"served", "logged" (served requests found
    in the log), "steps" (vLLM's verify steps of those), "equal_steps", "mismatched": [served index, ...]}."""
    out = {"served": len(served), "logged": 0, "steps": 0, "equal_steps": 0, "mismatched": []}
    used: set = set()
    for i, (prompt, output, spec) in enumerate(served):
        L, prompt, output = len(prompt), list(prompt), list(output)
        # the proposer may first see a request a few tokens into its decode (vLLM drafts nothing for it until
        # then): its logged prompt is then the prompt and those tokens, and the matching request the one that starts
        # with this prompt and output, the exact prompt length preferred
        found = [rid for rid, r in requests.items() if rid not in used and r["prompt_len"] >= L
                 and r["tokens"][:L] == prompt and r["tokens"][L: L + len(output)] == output
                 and len(r["tokens"]) - L >= len(output)]
        mine = min(found, key=lambda rid: (requests[rid]["prompt_len"] - L, rid)) if found else None
        theirs = list(zip((spec or {}).get("per_step_drafted") or [], (spec or {}).get("per_step_accepted") or []))
        out["steps"] += len(theirs)
        if mine is None:
            out["mismatched"].append(i)
            continue
        used.add(mine)
        out["logged"] += 1
        logged = _verified_steps(requests[mine]["steps"], k_cap)
        out["equal_steps"] += sum(a == b for a, b in zip(logged, theirs)) if len(logged) == len(theirs) else 0
        if logged != theirs:
            out["mismatched"].append(i)
    return out


def _verified_steps(steps: list[dict], k_cap: int | None) -> list[tuple[int, int]]:
    """(drafted, accepted) of every verify step with drafts that vLLM's per-request arrays count, in order: the
    logged blocks, and after a block the dummy steps of the tokens the next record holds as ``unseen``
    (``compare_with_vllm``)."""
    out = []
    for s, nxt in zip(steps, steps[1:] + [None]):
        if s["accepted"] is not None and s["drafted"]:
            out.append((s["drafted"], s["accepted"]))
        unseen = (nxt or {}).get("unseen") or 0
        if unseen and k_cap:
            tokens, i = (nxt["committed"] or [])[-unseen:], 0
            while i < len(tokens):
                a = 0
                while a < k_cap and i + a < len(tokens) and tokens[i + a] == 0:
                    a += 1
                out.append((k_cap, a))
                i += a + 1
    return out
