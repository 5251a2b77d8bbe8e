"""The target's own greedy answers to chat prompts, generated once and kept: the "regenerated" data of the EAGLE-3
head (``head_data.sources=[regenerated]``), beside ShareGPT's fixed answers.

    python scripts/regenerate_answers.py --out sacpolicy/heads/<head>/answers --sharegpt 2000
    python scripts/regenerate_answers.py --compare 32          # our batched decoder against vLLM's engine, same prompts

Prompts, in a fixed order: the first turns of the first ``--sharegpt`` ShareGPT conversations of the train and val
splits whose prompt fits in ``--max-prompt-tokens`` (file order, so they are the first turns of the fixed-answer
cache too), then the train and val prompts of MT-Bench, HumanEval and HumanEval edits (``--mix``; the target's own
code, which ShareGPT's human answers do not show it). Answers are greedy, at most ``--max-tokens`` tokens, generated
by the faster generator here (``--engine``; ``--compare`` measures both on the same prompts).

Output directory (resumable: a part is written atomically once its prompts are answered; a rerun skips the parts
it finds and refuses a directory whose prompt list differs): ``meta.json`` (target, engine, version, settings, the
prompt list's hash, the command) and ``part-NNNNN.jsonl.gz``, one row per prompt: ``prompt_id``, ``split``,
``prompt_ids``, ``answer_ids``, ``finished`` (the answer ended with an end-of-turn token).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

from sacpolicy.io import write_bytes, write_json

ROOT = Path(__file__).resolve().parents[1]
MIX = ("mt_bench", "humaneval", "humaneval_edit")


def prompt_list(tokenizer, sharegpt: int, mix: bool, max_prompt_tokens: int) -> list[dict]:
    """[{prompt_id, split, prompt_ids}] in the fixed order described in the module's docstring."""
    from sacpolicy.data import assign_split, load_prompts
    from sacpolicy.data.prompts import apply_template
    from sacpolicy.data.sharegpt import conversation_id, conversations

    rows = []
    if sharegpt:
        for conv in conversations():
            cid = conversation_id(conv.id)
            split = assign_split(cid)
            if split == "test":
                continue
            ids = apply_template(conv.messages(1), tokenizer)
            if len(ids) <= max_prompt_tokens:
                rows.append({"prompt_id": f"{cid}/turn1", "split": split, "prompt_ids": ids})
                if len(rows) == sharegpt:
                    break
    if mix:
        for source in MIX:
            for row in load_prompts(source, tokenizer=tokenizer):
                split = assign_split(row["prompt_id"])
                if split != "test" and len(row["input_ids"]) <= max_prompt_tokens:
                    rows.append({"prompt_id": row["prompt_id"], "split": split, "prompt_ids": row["input_ids"]})
    return rows


def list_hash(rows: list[dict]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r["prompt_id"], r["prompt_ids"]]).encode())
    return h.hexdigest()[:16]


def generate_vllm(spec: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    from sacpolicy.export.vllm_run import run_engine
    from sacpolicy.models.loading import model_dir

    r = run_engine(model_dir(spec), prompts, max_tokens=max_tokens, phases=("concurrent",), concurrency=64)
    return r["outputs"]["concurrent"], {"seconds": r["seconds"]["concurrent"], "startup_s": r["startup_s"],
                                        "vllm": r["vllm"]}


def generate_ours(target, prompts: list[list[int]], max_tokens: int, max_batch: int) -> tuple[list[list[int]], dict]:
    import torch

    from sacpolicy.decoding import SpeculativeDecoder

    dec = SpeculativeDecoder(target.model, stop_token_ids=target.eos_token_ids)
    dec.generate_batch(prompts[:2], 4, max_batch=2)  # warm-up
    t = time.perf_counter()
    with torch.inference_mode():
        out = dec.generate_batch(prompts, max_tokens, max_batch=max_batch)
    return [list(map(int, r.tokens)) for r in out], {"seconds": time.perf_counter() - t}


def compare(args, target) -> None:
    """Both generators on the same prompts: tokens/s and how many answers agree token for token."""
    rows = prompt_list(target.tokenizer, args.compare, False, args.max_prompt_tokens)
    prompts = [r["prompt_ids"] for r in rows]
    ours, t_ours = generate_ours(target, prompts, args.max_tokens, args.max_batch)
    theirs, t_vllm = generate_vllm(args.target, prompts, args.max_tokens)
    n_ours, n_vllm = sum(map(len, ours)), sum(map(len, theirs))
    same = sum(a == b for a, b in zip(ours, theirs))
    table = [
        "| generator | prompts | tokens | seconds | tokens/s |", "|---|---:|---:|---:|---:|",
        f"| sacpolicy batched AR (max_batch {args.max_batch}) | {len(prompts)} | {n_ours} | {t_ours['seconds']:.1f} | "
        f"{n_ours / t_ours['seconds']:.0f} |",
        f"| vLLM {t_vllm['vllm']} engine (64 at once; start-up {t_vllm['startup_s']:.0f} s not counted) | "
        f"{len(prompts)} | {n_vllm} | {t_vllm['seconds']:.1f} | {n_vllm / t_vllm['seconds']:.0f} |",
    ]
    print("\n".join(table))
    print(f"\nanswers identical token for token: {same}/{len(prompts)}")
    write_json(Path(args.json), {"ours": {**t_ours, "tokens": n_ours}, "vllm": {**t_vllm, "tokens": n_vllm},
                                 "identical": same, "prompts": len(prompts), "max_tokens": args.max_tokens,
                                 "command": " ".join(sys.argv)})


def regenerate(args, target) -> None:
    out = Path(args.out)
    rows = prompt_list(target.tokenizer, args.sharegpt, args.mix, args.max_prompt_tokens)
    digest = list_hash(rows)
    meta = {"format": 1, "target": args.target, "engine": args.engine, "temperature": 0.0,
            "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens, "sharegpt": args.sharegpt,
            "mix": list(MIX) if args.mix else [], "prompts": len(rows), "prompt_list_sha": digest,
            "part_size": args.part_size}
    meta_file = out / "meta.json"
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        clash = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if clash:
            raise SystemExit(f"{meta_file} was made with other settings {clash}; use another --out or delete it")
        meta = old
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json(meta_file, {**meta, "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d")})
    eos = set(target.eos_token_ids)
    parts = range(0, len(rows), args.part_size)
    t0, done_tokens = time.perf_counter(), 0
    for k, start in enumerate(parts):
        path = out / f"part-{k:05d}.jsonl.gz"
        if path.is_file():
            continue
        chunk = rows[start : start + args.part_size]
        prompts = [r["prompt_ids"] for r in chunk]
        if args.engine == "vllm":
            answers, info = generate_vllm(args.target, prompts, args.max_tokens)
        else:
            answers, info = generate_ours(target, prompts, args.max_tokens, args.max_batch)
        lines = [json.dumps({**r, "answer_ids": a, "finished": bool(a) and a[-1] in eos})
                 for r, a in zip(chunk, answers)]
        write_bytes(path, gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
        done_tokens += sum(map(len, answers))
        rate = done_tokens / (time.perf_counter() - t0)
        print(f"part {k + 1}/{len(parts)}: {len(chunk)} prompts, {sum(map(len, answers))} tokens in "
              f"{info['seconds']:.0f} s generating ({rate:.0f} tokens/s with start-ups)", flush=True)
    info = json.loads(meta_file.read_text())
    write_json(meta_file, {**info, "finished": time.strftime("%Y-%m-%d")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--out", help="output directory (resumable)")
    ap.add_argument("--sharegpt", type=int, default=2000, help="ShareGPT first turns (train and val splits)")
    ap.add_argument("--no-mix", dest="mix", action="store_false", help="leave out MT-Bench / HumanEval prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--engine", choices=("vllm", "sacpolicy"), default="vllm")
    ap.add_argument("--max-batch", type=int, default=16, help="rows at once for our decoder")
    ap.add_argument("--part-size", type=int, default=512)
    ap.add_argument("--compare", type=int, default=0, help="measure both generators on this many prompts instead")
    ap.add_argument("--json", default="regenerate_compare.json")
    args = ap.parse_args()
    from sacpolicy.models import load_model

    target = load_model(args.target, dtype="float32")
    if args.compare:
        compare(args, target)
    elif args.out:
        regenerate(args, target)
    else:
        ap.error("give --out (regenerate) or --compare N (measure the generators)")


if __name__ == "__main__":
    main()
