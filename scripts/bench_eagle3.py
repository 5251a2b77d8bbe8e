"""EAGLE-3 feature head benchmark: train a head on the pipeline's distillation data with snapshots along the way, then
measure every snapshot (and optionally a token-level draft) on held-out prompts.

    python scripts/bench_eagle3.py train --workdir runs/eagle3 --budget-minutes 90 --curve 5,15,60
    python scripts/bench_eagle3.py eval --workdir runs/eagle3 --token-draft outputs/<run>/distill/draft
    python scripts/bench_eagle3.py eval --heads shipped=shipped new=<run>/head/head --live --live-set mt_bench
    python scripts/bench_eagle3.py eval --split val --heads shipped=shipped new=<run>/head/head --out runs/gate.json
    python scripts/bench_eagle3.py ship --head <run>/head/head --out sacpolicy/heads/<name> --curve-json runs/gate.json

``train`` uses the default pipeline's data (``conf/distill``: the target's continuations of the training prompts,
cached under $SACPOLICY_CACHE/distill) and head settings (``conf/head/eagle3.yaml``); overrides after ``--`` go to
Hydra (e.g. ``-- head.steps=5 distill.data.synthetic.count=0``). Heads land in ``<workdir>/head/head`` (best on
validation) and ``<workdir>/snapshots/<minutes>min``.

Heads trained on ShareGPT's fixed answers come from the pipeline (``python scripts/train.py "stages=[head]"
head_data=sharegpt ...``); ``eval --heads name=dir ...`` measures any heads side by side.

``eval``, per draft, on held-out MT-Bench, ShareGPT and HumanEval first turns (``--split``: test, where the headline
is measured, by default; val for the shipping gate; greedy continuations of the target, teacher-forced): step-1
acceptance (the draft's first token is the target's greedy token), P(accepted run >= k), SpecForge's simulated acceptance length sum_k prod_{i<=k} acc_i for blocks of 3 and of k_max tokens, mean
beta at temperature 1 (sum_x min(p, q) of the first token), the draft step's cost over a target step (timed side by
side), and live tokens/s of our decoder at static k against autoregressive decoding on the same prompts.
Prints a Markdown table and writes bench_eagle3.json.

``ship`` copies a head into the package only when it beats the shipped head on the validation split (an ``eval
--split val`` with both heads): choosing what ships on the test prompts would make the test figures a selection
score, no longer a held-out measurement.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from sacpolicy import bench
from sacpolicy.io import write_json

ROOT = Path(__file__).resolve().parents[1]


class HeadSnapshots(L.Callback):
    """Saves the head (``save_head``) after the given minutes of training."""

    def __init__(self, minutes, out_dir: Path):
        self.marks, self.out_dir, self.t0, self.done = sorted(minutes), out_dir, None, set()

    def on_train_start(self, trainer, module):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, *args):
        from sacpolicy.training.eagle3 import save_head

        elapsed = (time.perf_counter() - self.t0) / 60
        for m in self.marks:
            if m not in self.done and elapsed >= m and trainer.is_global_zero:
                save_head(module.head, self.out_dir / f"{m:g}min", {"minutes": m, "step": trainer.global_step})
                self.done.add(m)


def compose(workdir: Path, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    import sacpolicy.pipeline  # noqa: F401  (registers the structured config nodes)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(workdir)
    return cfg


def train(args) -> None:
    from hydra.utils import instantiate

    from sacpolicy.pipeline.context import RunContext
    from sacpolicy.pipeline.distill import distill_data
    from sacpolicy.training.eagle3 import train_eagle3

    workdir = Path(args.workdir)
    cfg = compose(workdir, [f"head.budget_minutes={args.budget_minutes}", "head.patience=1000", *args.overrides])
    ctx = RunContext(cfg, workdir)
    dm = distill_data(ctx, instantiate(cfg.distill))
    dm.setup()
    snaps = HeadSnapshots([float(m) for m in args.curve.split(",") if m], workdir / "snapshots")
    factory = functools.partial(L.Trainer, accelerator="cpu", devices=1, max_epochs=1000, enable_progress_bar=True,
                                default_root_dir=str(workdir))
    metrics = train_eagle3(ctx.target, dm.train, dm.val, instantiate(cfg.head), factory, workdir / "head",
                           callbacks=[snaps])
    write_json(workdir / "train.json", {**metrics, "train_sequences": len(dm.train), "val_sequences": len(dm.val),
                                        "train_tokens": sum(len(r["input_ids"]) - r["prompt_len"] for r in dm.train),
                                        "command": " ".join(sys.argv)})
    print(metrics)


# ---------------------------------------------------------------------- evaluation
SETS = ("mt_bench", "sharegpt", "humaneval")
SHIP_SPLIT = "val"  # the split the shipping gate compares heads on; the headline tables are measured on "test"


def held_out(target, n_new: int, split: str = "test", sharegpt_prompts: int = 32,
             sharegpt_max_prompt_tokens: int = 384, names: tuple[str, ...] = SETS):
    """First turns of ``split`` (``data.split_prompts``: by prompt id) of each set in ``names`` with the target's
    greedy continuations, generated once and cached: MT-Bench and HumanEval whole, ShareGPT a fixed sample (the first
    ``sharegpt_prompts`` conversations of the split in file order whose prompt fits ``sharegpt_max_prompt_tokens``)."""
    import datasets

    from sacpolicy.data import load_prompt_mix, split_prompts
    from sacpolicy.training.distill_data import cached_dataset, generate_continuations

    sets = {}
    for name in names:
        test = split_prompts(load_prompt_mix([name], tokenizer=None if name == "sharegpt" else target.tokenizer))[split]
        # the test split's caches keep the key they had before other splits were measured
        key = f"{target.spec.replace(':', '_')}-{n_new}" + ("" if split == "test" else f"-{split}")
        if name == "sharegpt":  # file order; tokenized one by one until enough fit
            from sacpolicy.data import apply_template

            picked = []
            for row in test:
                ids = apply_template(row["messages"], target.tokenizer)
                if len(ids) <= sharegpt_max_prompt_tokens:
                    picked.append({**row, "input_ids": ids})
                if len(picked) == sharegpt_prompts:
                    break
            test = datasets.Dataset.from_list(picked)
            key += f"-{len(test)}-{sharegpt_max_prompt_tokens}"
        sets[name] = (test, cached_dataset(f"bench-eagle3-{name}", key,
                                           lambda t=test: generate_continuations(target, t, max_new_tokens=n_new,
                                                                                 batch_size=16, progress=False)))
    return sets


def acceptance(target, drafter, seqs, k_max: int) -> dict:
    """Teacher-forced over the target's greedy outputs, through the trace collector's own pass."""
    rows = bench.teacher_forced(target, [drafter], seqs, k_max)
    runs = [r["run_len"] for r in rows]
    ge = [sum(x >= k for x in runs) / len(runs) for k in range(1, k_max + 1)]  # P(run >= k) = prod_{i<=k} acc_i
    return {"positions": len(runs), "step1": ge[0], "p_run_ge": ge, "accept_len_3": sum(ge[:3]),
            f"accept_len_{k_max}": sum(ge), "mean_beta_t1": sum(r["beta"] for r in rows) / len(rows)}


@torch.inference_mode()
def step_cost(target, drafter, ids, reps: int = 20) -> float:
    """Median seconds of one drafted token (a 4-token block's average, after the context is fed) over one cached
    target step, measured alternately."""
    from sacpolicy.decoding import DraftRow, feature_layers
    from sacpolicy.decoding.aux import aux_pass

    layers = feature_layers(drafter)
    _, cap = aux_pass(target.model, ids, 1, layers)
    aux = cap.rows(layers) if layers else None
    d, t = [], []
    for _ in range(reps):
        state = drafter.new_state()
        if aux is not None:
            drafter.extend_features(state, aux[:-1])
        drafter.propose([DraftRow(state, ids, 1)])  # feeds the context
        drafter.accept(state, 1)
        t0 = time.perf_counter()
        drafter.propose([DraftRow(state, ids, 4)])
        d.append((time.perf_counter() - t0) / 4)
        t.append(bench.cached_step_s(target.model, ids))
    return statistics.median(d) / statistics.median(t)


def evaluate(args) -> None:
    from sacpolicy.build import model_drafter
    from sacpolicy.decoding.feature import load_feature_drafter
    from sacpolicy.heads import shipped_head
    from sacpolicy.models import EMBEDDED_TARGET

    target = bench.load_target()
    sets = held_out(target, args.max_new_tokens, args.split, args.sharegpt_prompts)
    drafts = []
    if args.workdir:
        workdir = Path(args.workdir)
        drafts += [(p.name, p) for p in sorted((workdir / "snapshots").glob("*min"), key=lambda p: float(p.name[:-3]))]
        if (workdir / "head" / "head").is_dir():
            drafts.append(("final (best on val)", workdir / "head" / "head"))
    for entry in args.heads or ():
        name, _, path = entry.rpartition("=")
        drafts.append((name or path, shipped_head(EMBEDDED_TARGET) if path == "shipped" else Path(path)))
    if args.token_draft:
        drafts.append(("token-level draft", Path(args.token_draft)))
    if not drafts:
        raise SystemExit("nothing to measure: give --workdir, --heads or --token-draft")
    ks = bench.int_list(args.ks)
    live_sets = sets if args.live_set == "all" else {args.live_set: sets[args.live_set]}
    live_prompts = [r["input_ids"] for name in live_sets for r in live_sets[name][0]][:: 2][: args.live_prompts]
    rows = []
    for name, path in drafts:
        is_head = (path / "config.json").is_file() and not (path / "generation_config.json").is_file()
        drafter = load_feature_drafter(target, path) if is_head else model_drafter(target, str(path), name="draft")
        row = {"name": name, "kind": "feature" if is_head else "token-level", "path": str(path)}
        for set_name, (_, seqs) in sets.items():
            row[set_name] = acceptance(target, drafter, seqs, args.k_max)
        row["draft_cost"] = step_cost(target, drafter, torch.tensor(sets["mt_bench"][1][0]["input_ids"]))
        if args.live and (name.startswith("final") or name == "token-level draft" or not args.workdir):
            row["live"] = bench.live_static_k(target, drafter, live_prompts, ks, args.max_new_tokens,
                                              allow_dropped=args.allow_dropped_drafters)
        rows.append(row)
        print(row, flush=True)
    meta = {"target": EMBEDDED_TARGET, "split": args.split, "k_max": args.k_max,
            "max_new_tokens": args.max_new_tokens,
            "prompts": {n: len(s[0]) for n, s in sets.items()}, "live_prompts": len(live_prompts), "ks": ks,
            "live_set": args.live_set, "torch_threads": torch.get_num_threads(), "workdir": args.workdir,
            "command": " ".join(sys.argv)}
    bench.write_results(args.out, {"rows": rows, "meta": meta})
    print(markdown(rows, meta))


def markdown(rows, meta) -> str:
    k = meta["k_max"]
    sets = [n for n in SETS if n in meta["prompts"]]
    names = {"mt_bench": "MT-Bench", "sharegpt": "ShareGPT", "humaneval": "HumanEval"}
    counts = ", ".join(f"{names[n]} {meta['prompts'][n]}" for n in sets)
    head = (f"held-out {meta.get('split', 'test')} first turns: {counts} prompts "
            f"({meta['max_new_tokens']} greedy tokens each, "
            f"teacher-forced); live: {meta['live_prompts']} prompts of {meta.get('live_set', 'all')}")
    header = ["draft", *(f"step-1 acc {names[n]}" for n in sets), *(f"accept len (3) {names[n]}" for n in sets),
              f"accept len ({k}) MT-Bench", "mean beta T=1 MT-Bench", "draft step / target step", "live best k vs AR"]

    def line(r):
        m, lv = r["mt_bench"], r.get("live")
        return [r["name"], *(f"{r[n]['step1']:.3f}" for n in sets), *(f"{r[n]['accept_len_3']:.2f}" for n in sets),
                f"{m[f'accept_len_{k}']:.2f}", f"{m['mean_beta_t1']:.3f}", f"{r['draft_cost']:.3f}",
                f"{lv['speedup_vs_ar']:.2f}x (k={lv['best_k']}, AR {lv['ar_tokens_per_s']:.1f} tok/s)" if lv else "-"]

    return head + "\n\n" + bench.table(header, map(line, rows))


# ---------------------------------------------------------------------- shipping a head
def check_beats_shipped(curve: dict | None, head: Path) -> None:
    """A head ships only when it beats the shipped one on the validation prompts: ``curve`` (``eval --split val`` with
    ``--heads shipped=shipped new=<head>``) must hold both, measured on ``SHIP_SPLIT``, and the new head's acceptance
    length (blocks of 3) must be higher on every set (a gain on chat bought with a loss on code is not a better head
    for the mixed default workload). A curve of the test split is refused: the test split is what the headline
    reports, and a head chosen on it would make that figure a selection score."""
    command = f"bench_eagle3.py eval --split {SHIP_SPLIT} --heads shipped=shipped new={head}"
    split = ((curve or {}).get("meta") or {}).get("split", "test")  # curves written before --split measured test
    if curve is not None and split != SHIP_SPLIT:
        raise SystemExit(f"--curve-json was measured on the {split} split; the shipping gate compares heads on the "
                         f"{SHIP_SPLIT} split, never on the prompts the headline is measured on. Run {command}; "
                         "or pass --force")
    rows = {Path(r["path"]).resolve(): r for r in (curve or {}).get("rows", [])}
    old = [r for r in (curve or {}).get("rows", []) if r["name"] == "shipped"]
    new = rows.get(head.resolve())
    if not old or new is None:
        raise SystemExit(f"--curve-json must measure the shipped head and {head} side by side ({command}); "
                         "or pass --force")
    sets = [n for n in SETS if n in new and n in old[0]]
    worse = [f"{n} {new[n]['accept_len_3']:.3f} vs {old[0][n]['accept_len_3']:.3f}" for n in sets
             if new[n]["accept_len_3"] <= old[0][n]["accept_len_3"]]
    if worse or not sets:
        raise SystemExit(f"{head} does not beat the shipped head on {SHIP_SPLIT} {', '.join(worse) or 'sets'} "
                         "(acceptance length, blocks of 3); not shipped (--force ships it anyway)")


def ship(args) -> None:
    """Write a trained head as a shipped head directory: bfloat16 weights (half the size; ``load_head`` casts them
    to the target's dtype), its config, and a provenance JSON with the training commands, settings, data recipe,
    seed, curve and the weights' SHA-256 (checked by ``sacpolicy.heads.verify`` and by the tests)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from sacpolicy.decoding.eagle3 import CONFIG_FILE, PROVENANCE_FILE, WEIGHTS_FILE
    from sacpolicy.io import write_dir
    from sacpolicy.runtime.artifact import file_sha256

    head, out = Path(args.head), Path(args.out)
    curve = json.loads(Path(args.curve_json).read_text()) if args.curve_json else None
    if not args.force:  # the gate first: nothing is read or written for a head that does not ship
        check_beats_shipped(curve, head)
    state = load_file(str(head / WEIGHTS_FILE))
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    trained = json.loads((head / PROVENANCE_FILE).read_text())
    # legs: train.json files of bench_eagle3 `train`, or the legs the pipeline's head stage recorded in the head
    legs = [json.loads(Path(p).read_text()) for p in args.train_json] if args.train_json else trained.get("legs", [])

    # the curves measured for the head this one replaces stay in the record
    old_prov = out / PROVENANCE_FILE
    old = json.loads(old_prov.read_text()) if old_prov.is_file() else {}
    earlier = {**old.get("earlier_curves", {}), **{f"{k} (head {old.get('sha256', '?')[:12]})": v
                                                    for k, v in old.items() if k.startswith("curve") and v}}

    def fill(tmp: Path) -> None:
        # what else lives beside the head (the regenerated answers it was trained on) stays
        for extra in (out.iterdir() if out.is_dir() else []):
            if extra.name not in (WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE):
                (shutil.copytree if extra.is_dir() else shutil.copy2)(extra, tmp / extra.name)
        save_file(state, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text((head / CONFIG_FILE).read_text())
        write_json(tmp / PROVENANCE_FILE, {
            "sha256": file_sha256(tmp / WEIGHTS_FILE), "dtype": "bfloat16 (trained in float32)",
            "commands": [leg.get("command") for leg in legs], "legs": legs,
            "settings": trained.get("settings"), "seed": (trained.get("settings") or {}).get("seed"),
            "metrics": trained.get("metrics"), "data": args.data, "curve": curve, "notes": args.notes,
            "earlier_curves": earlier})

    write_dir(out, fill)
    print(f"wrote {out} ({(out / WEIGHTS_FILE).stat().st_size / 2**20:.1f} MiB)")


def main(argv=None):
    ap = bench.parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--workdir", required=True)
    t.add_argument("--budget-minutes", type=float, default=20.0)
    t.add_argument("--curve", default="5,15,60", help="minutes at which to snapshot the head")
    t.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. head.steps=5")
    e = sub.add_parser("eval")
    e.add_argument("--workdir", default=None, help="a `train` workdir: its snapshots and its final head")
    e.add_argument("--heads", nargs="*", help="heads to measure as name=dir ('shipped': the head that ships)")
    e.add_argument("--split", default="test", choices=["test", SHIP_SPLIT],
                   help=f"test: the held-out headline; {SHIP_SPLIT}: the prompts `ship` compares heads on")
    e.add_argument("--sharegpt-prompts", type=int, default=32)
    e.add_argument("--live-set", default="all", choices=["all", *SETS], help="the prompts decoded live")
    e.add_argument("--token-draft", default=None, help="a distilled token-level draft dir to measure alike")
    e.add_argument("--k-max", type=int, default=8)
    e.add_argument("--max-new-tokens", type=int, default=96)
    e.add_argument("--live", action="store_true", help="also decode live (final head and token-level draft)")
    e.add_argument("--live-prompts", type=int, default=8)
    e.add_argument("--ks", default="2,3,4")
    bench.add_allow_dropped(e)
    bench.add_out(e, "bench_eagle3.json")
    s = sub.add_parser("ship", help="write a head as sacpolicy/heads/<name> with its provenance")
    s.add_argument("--head", required=True, help="the trained head directory (e.g. <workdir>/head/head)")
    s.add_argument("--out", required=True)
    s.add_argument("--train-json", nargs="+", default=None,
                   help="train.json of every leg, in order (default: the legs recorded in the head's provenance)")
    s.add_argument("--curve-json", default=None,
                   help=f"bench_eagle3.json of `eval --split {SHIP_SPLIT}` with the shipped head and this one")
    s.add_argument("--force", action="store_true", help="ship even if it does not beat the shipped head")
    s.add_argument("--data", default="", help="the data recipe, in words")
    s.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    {"train": train, "eval": evaluate, "ship": ship}[args.cmd](args)


if __name__ == "__main__":
    main()
