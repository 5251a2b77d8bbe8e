"""What the benchmark scripts (``scripts/bench_*.py``, ``scripts/profile_vllm.py``) share: their common options, the
target and held-out prompts they load, the order in which they alternate the configurations they time, the check that
a timed request kept every drafter (``check_drafters_kept``), live tokens/s of static k against autoregressive
decoding, teacher-forced acceptance rows, Markdown tables and the JSON they write.
``bench.serve``: the tables of ``scripts/bench_serve.py`` (vLLM's server under load); ``bench.capacity``: its
search for the highest rate that meets a latency target.

The top layer of the package: it may import any other room, and nothing in the package imports it. What only some
scripts need (decoders, prompt sets, traces) is imported inside the functions that use it. Nothing here prints; the
scripts do.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from sacpolicy.io import write_json
from sacpolicy.models import EMBEDDED_TARGET, load_model

logger = logging.getLogger(__name__)
ALLOW_DROPPED = "--allow-dropped-drafters"


class DroppedDrafterError(RuntimeError):
    """A timed request decoded without a drafter its configuration has (it raised and the decoder dropped it)."""


# ---------------------------------------------------------------------- command line
def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: its module docstring is the help text, line breaks kept (the docstring shows how to run
    it)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out(ap: argparse.ArgumentParser, default: str | None, **kwargs) -> None:
    """``--out``: where the script writes its JSON (``default``, or ``required=True`` and a ``help`` in kwargs)."""
    ap.add_argument("--out", default=default, **kwargs)


def add_target(ap: argparse.ArgumentParser, *, device: str | None = None, dtype: str | None = None) -> None:
    """``--target`` (a model spec, default the embedded target) and, when given a default, ``--device`` and
    ``--dtype``."""
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    if device is not None:
        ap.add_argument("--device", default=device)
    if dtype is not None:
        ap.add_argument("--dtype", default=dtype)


def add_prompt_set(ap: argparse.ArgumentParser, *, split: str, prompts: int, max_tokens: int,
                   source_help: str | None = None, prompts_help: str | None = None) -> None:
    """``--source`` (a prompt set, default MT-Bench, of which ``split`` is used), ``--prompts`` (how many of them)
    and ``--max-tokens`` (new tokens per prompt): the held-out prompts of ``held_out_prompts``."""
    which = {"test": "held-out test", "val": "validation"}.get(split, split)
    ap.add_argument("--source", default="mt_bench", help=source_help or f"prompt set; its {which} split is used")
    ap.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)


def add_allow_dropped(ap: argparse.ArgumentParser) -> None:
    """``--allow-dropped-drafters``: time a configuration even when a request dropped one of its drafters
    (``check_drafters_kept``)."""
    ap.add_argument(ALLOW_DROPPED, action="store_true",
                    help="time a run even where a request dropped a drafter that raised (off: such a run is refused)")


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; empty items are skipped (``""`` -> ``[]``)."""
    return [int(x) for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------------- what the scripts load
def load_target(spec: str = EMBEDDED_TARGET, *, device: str = "cpu", dtype: str = "float32"):
    """The target (``models.load_model``), by default on the CPU in float32, as the benchmarks measure it."""
    return load_model(spec, device=device, dtype=dtype)


def held_out_prompts(source: str, tokenizer, *, split: str = "test", n: int | None = None,
                     chat: bool = True) -> list[dict]:
    """The first ``n`` prompts of ``source`` in the ``split`` (``data.assign_split``: by prompt id), in file order.
    ``chat``: False for the plain format (a base model without a chat template)."""
    from sacpolicy.data import load_prompts

    return [] if n == 0 else list(load_prompts(source, tokenizer=tokenizer, split=split, limit=n, chat=chat))


# ---------------------------------------------------------------------- timing
def check_drafters_kept(config: str, dropped: Sequence[Sequence[str]], *, requests: Sequence | None = None,
                        allow: bool = False) -> dict[str, int]:
    """{drafter: requests that dropped it} of a timed configuration, from each timed request's dropped drafters
    (``GenerationResult.dropped_drafters``) and the requests' names (``requests``, their indices by default). The
    decoder drops a drafter that raises for the rest of its request and decodes on, so the time measured is not the
    configuration's (a learned row timed without its head): refused with ``DroppedDrafterError`` naming the drafter,
    the request and the fix, unless ``allow`` (then a warning)."""
    from sacpolicy.evaluation.metrics import dropped_counts

    requests = range(len(dropped)) if requests is None else requests
    lost = [(req, names) for req, names in zip(requests, dropped) if names]
    if lost:
        names = "; ".join(f"request {req}: {', '.join(d)}" for req, d in lost)
        msg = (f"{config}: {len(lost)} of {len(dropped)} timed requests dropped a drafter that raised ({names}); "
               "they were decoded without it, so this timing is not the configuration's. Fix: see the decoder's "
               f"warning for the drafter's error and fix the drafter, or pass {ALLOW_DROPPED} to time it anyway")
        if not allow:
            raise DroppedDrafterError(msg)
        logger.warning(msg)
    return dropped_counts(d for _, d in lost)


def alternating(names: Sequence, repeats: int) -> Iterator[tuple[int, object]]:
    """(repeat, name) for every name in every repeat, the order reversed every other repeat (ABC CBA ABC ...): a
    machine that drifts during the runs moves every configuration alike, not the last one most."""
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            yield rep, name


def live_static_k(target, drafter, prompts: list, ks: Sequence[int], n_new: int, *,
                  allow_dropped: bool = False) -> dict:
    """tokens/s of autoregressive decoding and of static k for each k with ``drafter``, the configurations
    interleaved prompt by prompt after one warm-up generation each: AR's tokens/s, the fastest k, its tokens/s and
    speedup over AR, and every k's speedup (``per_k``, keyed ``k<k>``). A prompt whose decoding dropped the drafter
    is refused (``check_drafters_kept``) unless ``allow_dropped``."""
    from sacpolicy.decoding import SpeculativeDecoder
    from sacpolicy.policy import Autoregressive, Static

    eos = target.eos_token_ids
    decs = {"ar": SpeculativeDecoder(target.model, [], Autoregressive(), stop_token_ids=eos)}
    decs |= {f"k{k}": SpeculativeDecoder(target.model, [drafter], Static(k), stop_token_ids=eos) for k in ks}
    tokens, secs = dict.fromkeys(decs, 0), dict.fromkeys(decs, 0.0)
    for dec in decs.values():
        dec.generate(prompts[0], 8)  # warm-up
    for i, ids in enumerate(prompts):
        for name, dec in decs.items():
            r = dec.generate(ids, n_new)
            check_drafters_kept(name, [r.dropped_drafters], requests=[i], allow=allow_dropped)
            tokens[name], secs[name] = tokens[name] + len(r.tokens), secs[name] + r.total_s
    tps = {n: tokens[n] / secs[n] for n in decs}
    best = max((n for n in tps if n != "ar"), key=tps.get)
    return {"ar_tokens_per_s": tps["ar"], "best_k": int(best[1:]), "tokens_per_s": tps[best],
            "speedup_vs_ar": tps[best] / tps["ar"], "per_k": {n: tps[n] / tps["ar"] for n in tps if n != "ar"}}


def cached_step_s(model, ids) -> float:
    """Seconds of one cached forward of the last token of ``ids`` ([n] or [1, n]) after the rest is prefilled into a
    fresh ``DynamicCache`` (untimed): what one decoding step of ``model`` costs at that context."""
    import torch
    from transformers import DynamicCache

    ids = ids.view(1, -1)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        model(input_ids=ids[:, -1:], cache=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def teacher_forced(target, drafters: list, seqs, k_max: int) -> list[dict]:
    """Trace rows (``traces.collect.teacher_forced_rows``, the collect stage's own pass) of every drafter along each
    sequence of ``seqs`` (rows with ``prompt_id``, ``input_ids``: prompt then the target's continuation, and
    ``prompt_len``)."""
    from sacpolicy.traces.collect import teacher_forced_rows

    rows = []
    for r in seqs:
        n = r["prompt_len"]
        prompt = {"prompt_id": r["prompt_id"], "category": "", "input_ids": r["input_ids"][:n]}
        rows += teacher_forced_rows(target, drafters, prompt, r["input_ids"][n:], k_max=k_max)
    return rows


# ---------------------------------------------------------------------- tables and files
def table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table: ``| a | b |`` lines under the header and a ``|---|---|`` rule, cells as ``str``."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def cell(value, spec: str = ".2f") -> str:
    """``value`` formatted with ``spec``, or ``-`` where it is None."""
    return "-" if value is None else format(value, spec)


def ratio(value: float, interval: Sequence[float] | None = None, runs: Sequence[float] | None = None) -> str:
    """A ratio as ``1.23x``, with its interval (``1.23x [1.10, 1.31]``: e.g. ``evaluation.intervals``' paired
    bootstrap) or its range over repeated runs (``1.23x (1.10-1.31)``, shown from two runs on)."""
    out = f"{value:.2f}x"
    if interval:
        out += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
    if runs is not None and len(runs) > 1:
        out += f" ({min(runs):.2f}-{max(runs):.2f})"
    return out


def write_results(path: str | Path, payload: dict, args: argparse.Namespace | None = None) -> Path:
    """Write a benchmark's results as JSON, atomically (``io.write_json``): ``{"args": vars(args), **payload}`` when
    given the parsed options, else ``payload``."""
    return write_json(path, payload if args is None else {"args": vars(args), **payload})
