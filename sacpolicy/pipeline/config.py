"""The pipeline's configuration: one home for every default.

The rule (``conf/`` follows it, ``tests/test_config.py`` checks it):

- A setting our code takes has its default in that code: a dataclass field or a parameter default. A config node
  that builds one of our classes or calls one of our functions starts from the node ``node_of`` makes of it,
  registered here as ``base/<dotted path>`` (``_target_``, every parameter with its default, ``???`` where the code
  has none, the parameters a stage passes itself left out); the YAML option extends it
  (``- /base/sacpolicy.policy.Static@_here_``) and writes only what differs. So ``--cfg job`` shows every value a
  run uses, ``policy.threshold=0.3`` overrides a default without ``+``, and no value is written twice.
- What no code of ours has a default for lives in YAML: which target, drafters, data, predictors and stages, the
  evaluation grid, third-party settings (Lightning, scikit-learn). One exception: a ``DrafterSpec``'s fields depend
  on its kind, so a draft option names it (``_target_``) and writes its kind's fields; DrafterSpec keeps the others'
  defaults (``max_ngram``, ``min_ngram``: ``+draft.ngram.max_ngram=4`` sets one).
- The stage settings that build no object (``collect``, ``fit``, ``run``) are the typed dataclasses below, registered
  as structured configs: an unknown key or a value of the wrong type fails when the config is composed.

Each config group is a folder of ``conf/``; ``conf/train.yaml``'s defaults list is the default run (the embedded
target on CPU), and ``conf/experiment/`` holds overlays on it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from hydra.utils import get_object
from omegaconf import MISSING


@dataclass
class ProfileSettings:
    """What stage ``collect`` times for the cost model (``sacpolicy.profiling.profile``)."""

    # every block length up to fit.k_max: a CPU's cost is not linear in it
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 7, 8])
    context_lens: list[int] = field(default_factory=lambda: [64, 256, 512])
    repeats: int = 5
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # [1, 2, 4, 8, 16]: plan for live batches


@dataclass
class CollectSettings:
    """Stage ``collect``: the cost model's profile and the teacher-forced traces."""

    max_new_tokens: int = 80
    # The longest accepted run recorded per position: a replay scores blocks up to it, so it bounds fit.k_max
    k_max: int = 16
    # prompts per split (a seeded random sample; null = all of it). 48 test prompts: what the default run's 48 live
    # prompts (eval.live_prompts) are drawn from
    num_prompts: dict[str, int | None] = field(default_factory=lambda: {"train": 40, "val": 16, "test": 48})
    # Evaluation-only held-out sets (sacpolicy.data PROMPT_SETS; here ShareGPT conversations and revisions of given
    # answers): the first eval_only_prompts test-split prompts of each (in the source's order, with the data mix's
    # settings) are collected as test traces besides num_prompts.test of the mix, and so evaluated and reported as
    # their own categories; never trained on. eval_only=[]: the data mix alone
    eval_only: list[str] = field(default_factory=lambda: ["sharegpt", "revision"])
    eval_only_prompts: int = 8  # of each eval_only source
    chunk_size: int = 8  # prompts per Parquet shard (the unit of resumption)
    shard: str | None = None  # i/n to collect one of n shards (default: torchrun's RANK/WORLD_SIZE)
    profile: ProfileSettings = field(default_factory=ProfileSettings)


@dataclass
class FitSettings:
    """Stage ``fit`` (and the policies evaluation replays)."""

    k: int = 8  # block length of the replay that generates training examples
    # The longest block of the learned rule, of the best static k searched on val traces and of the hand-made rules
    # evaluation compares (the confidence rule's cap): the policies' one k_max. At most collect.k_max (what the
    # traces record) and decoder.k_max (the largest block the decoder accepts)
    k_max: int = 8
    # Sampled traces replay in expectation (rule tuning, best static, simulated rows): seeded draws of each prompt's
    # acceptances from the recorded beta (sacpolicy.traces.draws). null: that module's DRAWS. Replays cost this many
    # times a greedy replay's; the Monte-Carlo error of a rate falls as 1 / sqrt(draws)
    draws: int | None = None
    # Learning while serving (sacpolicy.runtime.online: a calibration of the predictor from every verify step's labels
    # and a guard against the static blocks the same steps price). The fitted rule learns with these settings (its
    # artifact carries them to every host) when that replays faster on the val traces than it does fitted only.
    # {}: the defaults of OnlineSettings (lr, shrink, window, margin, hold, min_steps, guard); null: never
    online: dict | None = field(default_factory=dict)


@dataclass
class RunSettings:
    """Stage ``decode``: the configured policy live against autoregressive decoding."""

    split: str = "test"  # prompts are split by id: train / val / test
    num_prompts: int | None = 4  # decode this many prompts of the split (null = all)
    max_new_tokens: int = 64
    warmup_prompts: int = 1


@dataclass
class RefitSettings:
    """Stage ``refit`` (``sacpolicy.pipeline.refit``): a candidate fitted on a served workload's step log, compared with
    the policy that serves it on held-out requests of that log."""

    logs: str | None = None  # the step-log directory (scripts/serve.py --log-steps); stage refit needs it
    # The policy serving now, the one the candidate must beat: a policy artifact, a vLLM export or a deploy root (its
    # `current`); null: deploy_root's current version when it has one, else from_run's headline (fit.json's)
    policy: str | None = None
    # Requests split by their log id (hash, like prompts: sacpolicy.data.splits): fit, tune the rule on, compare on
    fractions: dict[str, float] = field(default_factory=lambda: {"train": 0.6, "val": 0.2, "test": 0.2})
    # Fewer requests than this in a split: refused. A paired bootstrap over a handful of held-out requests cannot
    # tell a few-percent gain from noise, so a small log must not decide what serves
    min_requests: int = 30
    include_run_traces: bool = False  # add from_run's train-split traces (the served drafter's) to the fit examples
    # Run the target over the logged sequences (one teacher-forced pass per request): the collector's own beta and
    # p_target at each request's sampling settings. Sampled logs need it; greedy ones are exact without it
    target_pass: bool = False
    # Keep only the requests served at these settings ({temperature, top_k, top_p}); a log of several needs it.
    # null: the log's one setting (requests whose log records none count as greedy)
    select: dict[str, float] | None = None
    # Leave out step-log shards that cannot be read or whose metadata is damaged (each named in a warning, counted in
    # refit.json's requests.corrupt_shards) instead of refusing the log; their requests are then incomplete
    skip_corrupt: bool = False
    # Accept when the lower end of the candidate/current interval is at least this: a clear gain, not a tie (1.0
    # would redeploy a candidate no better than what serves)
    threshold: float = 1.02
    level: float = 0.95  # the interval's confidence level
    resamples: int = 2000  # paired bootstrap resamples over held-out requests
    # Held-out requests also decoded live in our decoder by each arm (candidate, current, best static), to the length
    # the server generated, prompt by prompt with the arms in turn: measured tokens/s beside the simulated ones.
    # 0: simulated only. Reported, not decisive: the simulated comparison and the served check decide
    live_requests: int = 0
    live_repeats: int = 2  # each arm decodes each live request this often; its fastest time counts
    # Before promoting a candidate the simulated comparison accepts, serve this many held-out requests (the first by
    # id: their logged prompts) through a real vLLM engine with the candidate and with the current policy
    # (sacpolicy.pipeline.served_check); promote only if the candidate is not slower there. Needs vLLM
    # (scripts/install.sh --vllm); without it a refit refuses. 0: no served check, the simulation alone decides
    served_check_requests: int = 16
    # The served check fails when the upper end of its candidate/current tokens/s interval is below this: slower
    # beyond noise. Not refit.threshold: a handful of served requests cannot confirm a 2% gain, only catch a loss
    served_check_threshold: float = 1.0
    # Engines per arm, started candidate, current, current, candidate, ...: a machine's drift hits both arms
    served_check_rounds: int = 2
    deploy_root: str | None = None  # deploy an accepted candidate there (sacpolicy.export.deploy)
    canary_fraction: float | None = None  # with deploy_root: deploy as a candidate on trial for this share of requests


SECTIONS = {"collect": CollectSettings, "fit": FitSettings, "run": RunSettings, "refit": RefitSettings}

# The code config nodes start from -> the parameters a stage passes itself (left out of the node).
BASES: dict[str, tuple[str, ...]] = {
    "sacpolicy.models.load_model": (),
    "sacpolicy.data.load_prompt_mix": (),
    "sacpolicy.decoding.DecoderConfig": (),
    "sacpolicy.decoding.SamplingConfig": (),
    "sacpolicy.policy.Autoregressive": (),
    "sacpolicy.policy.Static": (),
    "sacpolicy.policy.Heuristic": (),
    "sacpolicy.policy.Confidence": (),
    "sacpolicy.policy.SeedRule": (),
    "sacpolicy.policy.Bandit": ("cost",),
    # the engines' controllers (policy/peers.py); adaptive verification budgets with the run's cost model
    "sacpolicy.policy.SglangAdaptive": (),
    "sacpolicy.policy.TrtllmAdaptive": (),
    "sacpolicy.policy.VllmBatchSchedule": (),
    "sacpolicy.policy.VllmAdaptiveVerification": ("cost",),
    "sacpolicy.policy.LlamaCppPMin": (),
    "sacpolicy.policy.AdaEDL": (),
    "sacpolicy.training.predictor.fit_sklearn": ("train", "val", "out_dir", "logger"),
    "sacpolicy.training.predictor.fit_mlp": ("train", "val", "out_dir", "logger"),
    "sacpolicy.training.distill.DistillSettings": (),
    "sacpolicy.training.eagle3.Eagle3Settings": (),
    "sacpolicy.training.head_data.HeadDataSettings": (),
    "sacpolicy.evaluation.evaluate.EvalSettings": ("k_max",),  # fit.k_max, passed by the pipeline
    "sacpolicy.pipeline.tracking.Tracker": ("out_dir", "config"),
    "sacpolicy.pipeline.tracking.WandbTracker": ("out_dir", "config"),
}


def _plain(value, where: str):
    """``value`` as YAML can hold it (tuples as lists), or an error naming the fix."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value), where)
    raise TypeError(f"{where}: default {value!r} cannot be written in a config; give the parameter a plain default "
                    "(None, a number, a string, a list) or list it among the parameters a stage passes (BASES)")


def defaults_of(path: str, run_time: tuple[str, ...] = ()) -> dict:
    """{parameter: default (``???`` where it has none)} of the class or function at ``path`` (a dataclass: its init
    fields), without ``run_time``: the parameters a stage passes itself."""
    obj = get_object(path)
    if dataclasses.is_dataclass(obj):
        params = {f.name: (f.default if f.default is not dataclasses.MISSING
                           else f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
                  for f in dataclasses.fields(obj) if f.init}
    else:
        skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        params = {p.name: MISSING if p.default is p.empty else p.default
                  for p in inspect.signature(obj).parameters.values() if p.kind not in skip}
    unknown = sorted(set(run_time) - set(params))
    if unknown:
        raise ValueError(f"{path} has no parameter(s) {unknown}; fix its entry in sacpolicy.pipeline.config.BASES")
    return {k: v if v is MISSING else _plain(v, f"{path}({k})") for k, v in params.items() if k not in run_time}


def node_of(path: str, run_time: tuple[str, ...] = ()) -> dict:
    """The config node that builds ``path``: ``_target_`` and its parameters' defaults (``defaults_of``)."""
    return {"_target_": path, **defaults_of(path, run_time)}


def register() -> None:
    """Register every base node (``base/<dotted path>``) and typed section with Hydra's ConfigStore."""
    store = ConfigStore.instance()
    for path, run_time in BASES.items():
        store.store(group="base", name=path, node=node_of(path, run_time))
    for cls in SECTIONS.values():
        store.store(group="base", name=f"{cls.__module__}.{cls.__qualname__}", node=cls)


register()
