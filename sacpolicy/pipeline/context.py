"""The run context: one run directory, its config, and everything stages share, each loaded once (the target, the
drafters, the cost model, the traces, the best static setting on validation traces)."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from sacpolicy.build import build_drafters
from sacpolicy.decoding import SpeculativeDecoder
from sacpolicy.io import write_json
from sacpolicy.runtime.spec import DrafterSpec

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


class PipelineError(ValueError):
    pass


@dataclass(frozen=True)
class RunTraces:
    """A run's teacher-forced traces, loaded once (``RunContext.traces``)."""

    grouped: dict  # {prompt id: its traces, grouped by drafter (traces.simulate.group_traces)}
    by_split: dict  # {"train" | "val" | "test": the same, of that split's prompts}
    dir: Path  # the trace directory (traces/tf of this run or from_run)
    meta: dict  # its meta (traces.schema.read_meta)


class RunContext:
    def __init__(self, cfg: DictConfig, out_dir: Path, tracker=None):
        self.cfg, self.out_dir, self.tracker = cfg, Path(out_dir), tracker

    # ------------------------------------------------------------------ artifacts of this run or from_run
    def find(self, rel: str) -> Path | None:
        """An artifact of this run, else of ``from_run``, else of the run that one reused from (and so on)."""
        seen, base, src = set(), self.out_dir, self.cfg.get("from_run")
        while base is not None and base.resolve() not in seen:
            if (base / rel).exists():
                return base / rel
            seen.add(base.resolve())
            base = Path(src) if src else None
            cfg = base / "config.yaml" if base else None
            src = OmegaConf.load(cfg).get("from_run") if cfg is not None and cfg.is_file() else None
        return None

    def need(self, rel: str, stage: str) -> Path:
        path = self.find(rel)
        if path is None:
            raise PipelineError(f"stage {stage} needs {rel}, which neither this run nor from_run has; run the stage "
                                f"that makes it first (e.g. stages=[collect,{stage}]) or set from_run=<an earlier run "
                                "dir>")
        return path

    # ------------------------------------------------------------------ models and drafters
    @cached_property
    def target(self):
        return instantiate(self.cfg.target)

    def drafter_specs(self) -> list[DrafterSpec]:
        """The run's drafters (``cfg.draft``, a multi-select group of ``DrafterSpec``s) after the drafts this run (or
        from_run) trained: the distilled draft (``distilled``) and the EAGLE-3 head (``feature``)."""
        specs = []
        draft_dir = self.find("distill/draft")
        if draft_dir is not None:
            specs.append(DrafterSpec(kind="model", name="distilled", path=str(draft_dir.resolve())))
        head_dir = self.find("head/head")
        if head_dir is not None:
            specs.append(DrafterSpec(kind="feature", name="feature", path=str(head_dir.resolve())))
        for key, node in (self.cfg.get("draft") or {}).items():
            specs.append(instantiate(node, name=node.get("name") or key))
        return specs

    @cached_property
    def drafters(self) -> list:
        return build_drafters(self.drafter_specs(), self.target)

    def decoder(self, policy=None, drafters=None) -> SpeculativeDecoder:
        """A decoder over the run's drafters (or ``drafters``) with ``policy`` (default: the configured one)."""
        cfg = self.cfg
        if policy is None:
            policy = build_policy(cfg.policy, cost=self.cost if needs_cost(cfg.policy) else None)
        return SpeculativeDecoder(self.target.model, self.drafters if drafters is None else drafters, policy,
                                  sampling=instantiate(cfg.sampling), config=instantiate(cfg.decoder),
                                  stop_token_ids=self.target.eos_token_ids)

    # ------------------------------------------------------------------ data
    def prompts(self, split: str | None = None):
        """The run's prompts (``cfg.data``) of one split (default ``run.split``)."""
        return self._prompt_splits[split or self.cfg.run.split]

    @cached_property
    def _prompt_splits(self):
        from sacpolicy.data import split_prompts

        return split_prompts(self.load_prompts(instantiate(self.cfg.data)))

    def load_prompts(self, load, sources=None, **kwargs):
        """``load(tokenizer=..., **kwargs)`` (a ``load_prompt_mix`` partial), given the target's own first answers
        when its sources (default ``cfg.data.sources``) quote them (``mt_bench_turn2``)."""
        from sacpolicy.data import needs_answers
        from sacpolicy.training.distill_data import answer_texts

        if needs_answers(self.cfg.data.get("sources") if sources is None else sources):
            kwargs["answers"] = answer_texts(self.first_answers, self.target.tokenizer)
        return load(tokenizer=self.target.tokenizer, **kwargs)

    @cached_property
    def first_answers(self):
        """The target's greedy answers to the MT-Bench first turns, generated once per target and distillation data
        settings (``distill.data``: their length and teacher top-k) and cached: quoted by ``mt_bench_turn2`` prompts,
        reused as distillation data."""
        from sacpolicy import ranks
        from sacpolicy.training.distill_data import first_answers

        data = self.cfg.distill.data
        return ranks.rank_zero_first(lambda: first_answers(self.target, max_new_tokens=data.max_new_tokens,
                                                           topk=data.topk, batch_size=data.gen_batch_size,
                                                           chat=self.chat),
                                     "the target's first answers")

    @property
    def chat(self) -> bool:
        """Whether the run's prompts are in the target's chat template (``data.chat``, a ``load_prompt_mix``
        setting) or, False, the plain format of a base model without one: every prompt the run builds (the mix, the
        held-out sets, the distillation prompts, the first answers) follows it."""
        return bool(self.cfg.data.chat)

    @cached_property
    def eval_only_prompts(self) -> list:
        """The held-out prompts of the sources ``collect.eval_only``: the first ``collect.eval_only_prompts``
        test-split prompts of each in its order, loaded with the data mix's settings (``cfg.data``), taken in turn
        from each source (so any first few hold every source). Collected as test traces besides the mix's and
        evaluated; never in train or val."""
        from itertools import chain, zip_longest

        c = self.cfg.collect
        sources, n = list(c.get("eval_only") or []), c.get("eval_only_prompts", 0)
        if n < 0:
            raise PipelineError(f"collect.eval_only_prompts={n}: give a count >= 0 of held-out prompts per source "
                                "(0, or collect.eval_only=[], for none)")
        if not sources or not n:
            return []
        per_source = []
        for source in sources:
            entry = [{"source": source, "split": "test", "limit": n, "categories": None}]
            per_source.append(list(self.load_prompts(instantiate(self.cfg.data, sources=entry), sources=entry)))
        return [r for r in chain.from_iterable(zip_longest(*per_source)) if r is not None]

    def test_prompts(self) -> list:
        """The held-out prompts with test traces, in the order evaluation decodes them live: the run's seeded
        shuffle of the mix's test split, with the evaluation-only prompts (``eval_only_prompts``) spread evenly among
        them (``spread``), so the first ``eval.live_prompts`` hold each kind in proportion."""
        held_out = self.traces.by_split["test"]
        mix = [r for r in self.take(self.prompts("test"), None) if r["prompt_id"] in held_out]
        if len(mix) == len(held_out):  # traces of the mix alone (e.g. from a run without eval_only)
            return mix
        rest = held_out.keys() - {r["prompt_id"] for r in mix}
        return spread(mix, [r for r in self.eval_only_prompts if r["prompt_id"] in rest])

    def learned_rules(self, stage: str) -> tuple[dict, str | None]:
        """({predictor: DecisionRule} of the run's policy artifacts, the headline predictor: the lowest validation
        log-loss, ``evaluation.evaluate.headline_predictor``)."""
        from sacpolicy.evaluation.evaluate import headline_predictor
        from sacpolicy.runtime.artifact import load_artifact

        artifacts = {name: load_artifact(self.need(f"policies/{name}", stage)) for name in self.cfg.predictor}
        return ({name: a.rule for name, a in artifacts.items()},
                headline_predictor({name: a.metrics.get("predictor", {}) for name, a in artifacts.items()}))

    def take(self, rows, n) -> list:
        """n prompts drawn at random (seeded) from a split, so a sample mixes its sources and categories."""
        rows = rows.shuffle(seed=self.cfg.seed) if hasattr(rows, "shuffle") else rows
        return [rows[i] for i in range(len(rows) if n is None else min(n, len(rows)))]

    @cached_property
    def cost(self):
        from sacpolicy.runtime.cost import CostModel

        return CostModel.from_json(self.need("cost.json", "fit"))

    @cached_property
    def traces(self) -> RunTraces:
        """The run's teacher-forced traces (or from_run's)."""
        from sacpolicy.data import assign_split
        from sacpolicy.traces.schema import TraceError, load_traces, read_meta
        from sacpolicy.traces.shards import MANIFEST, SHARDS_DIR, merge_shards
        from sacpolicy.traces.simulate import group_traces

        tf_dir = self.need("traces/tf", "fit")
        if (tf_dir / SHARDS_DIR).is_dir() and not (tf_dir / MANIFEST).is_file():
            try:  # a sharded collection: every shard must be there (a missing one is named)
                merge_shards(tf_dir)
            except TraceError as exc:
                raise PipelineError(str(exc)) from exc
        meta = read_meta(tf_dir)
        grouped = group_traces(load_traces(tf_dir, kind="teacher_forced", target=self.cfg.target.spec), meta,
                               draws=self.cfg.fit.get("draws"))
        by_split = {s: {} for s in SPLITS}
        for pid, p in grouped.items():
            by_split[assign_split(pid)][pid] = p
        return RunTraces(grouped, by_split, tf_dir, meta)

    @property
    def soft_labels(self) -> bool:
        """Traces of sampled decoding label a drafted token with its acceptance probability beta, not 0/1 (and
        replay in expectation: ``traces.draws``)."""
        from sacpolicy.traces.schema import trace_temperature

        return trace_temperature(self.traces.meta) > 0.0

    @cached_property
    def vocab_size(self) -> int:
        """The target's vocabulary size (its LM head's rows), as the traces recorded it."""
        meta = self.traces.meta
        return int(meta["vocab_size"]) if "vocab_size" in meta else int(
            self.target.model.get_output_embeddings().out_features)

    def best_static(self) -> dict:
        """The best static (drafter, k) on validation traces, up to ``fit.k_max``: computed once per run
        (``best_static.json``) and shared by rule tuning and evaluation. Replayed: exactly on greedy traces, in
        expectation on sampled ones."""
        from sacpolicy.traces.simulate import best_static

        path = self.out_dir / "best_static.json"
        if path.is_file():
            return json.loads(path.read_text())
        val, k_max = self.traces.by_split["val"], self.cfg.fit.k_max
        best = best_static(val, self.cost, vocab_size=self.vocab_size, k_max=k_max)
        write_json(path, best["all"])
        return best["all"]

    # ------------------------------------------------------------------ logging
    def lightning_logger(self, stage: str):
        """The run's Lightning logger for a training stage; its keys carry the stage (``distill-val/accept_len``,
        ``head-val/accept_len``), so the curves of two drafts in one W&B run stay apart."""
        return instantiate(self.cfg.logger, prefix=stage) if self.cfg.get("logger") else None


def needs_cost(node: DictConfig) -> bool:
    """Whether the policy ``node`` builds takes the cost model without a default (vLLM's adaptive verification prices
    its budget with it; the bandit's is optional: live, it times its steps)."""
    import inspect

    from hydra.utils import get_object

    param = inspect.signature(get_object(node._target_)).parameters.get("cost")
    return param is not None and param.default is inspect.Parameter.empty


def build_policy(node: DictConfig, cost=None):
    """The policy a ``policy`` option composes (``conf/policy/``), its lists and mappings plain Python (a peer's
    settings are checked as SGLang's JSON or vLLM's lists would be), given ``cost`` where it takes one
    (``needs_cost``; None: the settings alone are checked, before the cost model is loaded). A setting the policy
    refuses is a ``PipelineError`` naming the option, what is wrong and the fix."""
    make = instantiate(node, _convert_="all", _partial_=True)  # the cost model is passed as is, not converted
    try:
        return make(**({"cost": cost} if needs_cost(node) else {}))
    except (ValueError, TypeError) as exc:
        raise PipelineError(f"policy ({node._target_}): {exc}. Fix the setting in the policy option's YAML "
                            f"(conf/policy/) or override it: policy.<setting>=<value>") from exc


def spread(rows: list, extra: list) -> list:
    """``rows`` with ``extra`` spread evenly among them, each in its order: the j-th of m extra rows goes where
    (j + 1/2) / m of ``rows`` have passed, so every prefix holds both in about their proportion."""
    keyed = [((i + 0.5) / len(rows), 0, i) for i in range(len(rows))]
    keyed += [((j + 0.5) / len(extra), 1, j) for j in range(len(extra))]
    return [(rows, extra)[kind][i] for _, kind, i in sorted(keyed)]


def eval_settings(cfg: DictConfig):
    """The ``eval`` section as ``EvalSettings``; its k_max is the policies' one, ``fit.k_max``."""
    return instantiate(cfg.eval, _convert_="all", k_max=cfg.fit.k_max)


def command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
