"""The target's own greedy answers to chat prompts, generated once and kept: the "regenerated" data of the EAGLE-3
head (``head_data.sources=[regenerated]``), beside ShareGPT's fixed answers.

    python scripts/regenerate_answers.py --out sacpolicy/heads/<head>/answers --sharegpt 2000
    python scripts/regenerate_answers.py --compare 32          # our batched decoder against vLLM's engine, same prompts

Prompts, in a fixed order: the first turns of the first ``--sharegpt`` ShareGPT conversations of the train and val
splits whose prompt fits in ``--max-prompt-tokens`` (file order, so they are the first turns of the fixed-answer
cache too), then the train and val prompts of MT-Bench, HumanEval and HumanEval edits (``--mix``; the target's own
code, which ShareGPT's human answers do not show it). Answers are greedy, at most ``--max-tokens`` tokens, generated
by the faster generator here (``--engine``; ``--compare`` measures both on the same prompts).

``--engine vllm`` (the default) answers every part still missing in one engine, which loads the target itself: no
copy of the target is loaded here (only its tokenizer and end-of-turn ids), and ``--compare`` frees ours before the
engine starts. Its parts are written when the engine returns.

Output directory (resumable: a part is written atomically once its prompts are answered; a rerun skips the parts
it finds and refuses a directory whose prompt list differs): ``meta.json`` (target, engine, version, settings, the
prompt list's hash, the command) and ``part-NNNNN.jsonl.gz``, one row per prompt: ``prompt_id``, ``split``,
``prompt_ids``, ``answer_ids``, ``finished`` (the answer ended with an end-of-turn token).
"""

from __future__ import annotations

import argparse
import gc
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


def tokens_of(spec: str) -> tuple[object, list[int]]:
    """(tokenizer, end-of-turn ids) of the target ``spec`` without loading its weights (the vLLM engine loads its own):
    the ids ``LoadedModel.eos_token_ids`` gives, from the generation config beside the weights."""
    from transformers import GenerationConfig

    from sacpolicy.models import eos_token_ids, load_tokenizer, served_model

    tokenizer = load_tokenizer(spec)
    try:
        generation = GenerationConfig.from_pretrained(served_model(spec))
    except OSError:  # no generation_config.json: the tokenizer's eos alone, as for a model without one
        generation = None
    return tokenizer, eos_token_ids(generation, tokenizer)


def generate_vllm(spec: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    """One engine (a child process) answering every prompt, 64 at once; no time limit (it answers every part left)."""
    from sacpolicy.export.vllm_run import run_engine
    from sacpolicy.models import served_model

    r = run_engine(served_model(spec), prompts, max_tokens=max_tokens, phases=("concurrent",), concurrency=64,
                   timeout=None)
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


def compare(args) -> None:
    """Both generators on the same prompts: tokens/s and how many answers agree token for token."""
    import torch

    from sacpolicy.models import load_model

    target = load_model(args.target, dtype="float32")
    rows = prompt_list(target.tokenizer, args.compare, False, args.max_prompt_tokens)
    prompts = [r["prompt_ids"] for r in rows]
    ours, t_ours = generate_ours(target, prompts, args.max_tokens, args.max_batch)
    del target  # ours is done: free its copy (CUDA's cached blocks too) before vLLM loads its own
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
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


def regenerate(args, tokenizer, eos_ids: list[int], target=None) -> None:
    """Answer the prompts of every part not yet in ``args.out``: in one vLLM engine (``args.engine == "vllm"``), or
    part by part with our decoder on ``target`` (a ``LoadedModel``)."""
    out = Path(args.out)
    rows = prompt_list(tokenizer, args.sharegpt, args.mix, args.max_prompt_tokens)
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
    eos = set(eos_ids)
    n_parts = -(-len(rows) // args.part_size)
    todo = {k: rows[k * args.part_size : (k + 1) * args.part_size] for k in range(n_parts)
            if not (out / f"part-{k:05d}.jsonl.gz").is_file()}
    t0, done_tokens = time.perf_counter(), 0
    if args.engine == "vllm" and todo:  # one engine for every part left: one model load (and CUDA graph capture)
        flat, info = generate_vllm(args.target, [r["prompt_ids"] for chunk in todo.values() for r in chunk],
                                   args.max_tokens)
        print(f"vLLM {info['vllm']}: {len(flat)} prompts in {info['seconds']:.0f} s generating (start-up "
              f"{info['startup_s']:.0f} s)", flush=True)
        left = iter(flat)
        answered = {k: [next(left) for _ in chunk] for k, chunk in todo.items()}
    for k, chunk in todo.items():
        if args.engine == "vllm":
            answers = answered[k]
        else:
            answers, info = generate_ours(target, [r["prompt_ids"] for r in chunk], args.max_tokens, args.max_batch)
        lines = [json.dumps({**r, "answer_ids": a, "finished": bool(a) and a[-1] in eos})
                 for r, a in zip(chunk, answers)]
        write_bytes(out / f"part-{k:05d}.jsonl.gz", gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
        done_tokens += sum(map(len, answers))
        rate = done_tokens / (time.perf_counter() - t0)
        print(f"part {k + 1}/{n_parts}: {len(chunk)} prompts, {sum(map(len, answers))} tokens "
              f"({rate:.0f} tokens/s so far, start-up included)", flush=True)
    info = json.loads(meta_file.read_text())
    write_json(meta_file, {**info, "finished": time.strftime("%Y-%m-%d")})


def main(argv=None) -> None:
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
    args = ap.parse_args(argv)
    if args.compare:
        compare(args)
    elif not args.out:
        ap.error("give --out (regenerate) or --compare N (measure the generators)")
    elif args.engine == "vllm":
        regenerate(args, *tokens_of(args.target))
    else:
        from sacpolicy.models import load_model

        target = load_model(args.target, dtype="float32")
        regenerate(args, target.tokenizer, target.eos_token_ids, target)


if __name__ == "__main__":
    main()
