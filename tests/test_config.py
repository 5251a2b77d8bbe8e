"""The Hydra configuration: every group option composes and builds its object; presets validate; bad names fail."""

import inspect
from pathlib import Path

import pytest
from conftest import tiny_head_dir
from test_traces import cost_model
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

from sacpolicy import pipeline
from sacpolicy.build import build_drafters
from sacpolicy.pipeline import config
from sacpolicy.decoding import Decision, DecoderConfig, DecodeState, PolicyRow, RequestInfo
from sacpolicy.pipeline.context import RunContext, build_policy, eval_settings, needs_cost
from sacpolicy.training.predictor import fit_mlp, fit_sklearn

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cfg_for(*overrides, tmp_path=None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path or "/tmp/sacpolicy-test")
    return cfg


def test_default_run_is_conf_train_yaml_and_embedded_cpu_names_it():
    cfg = cfg_for()
    assert cfg.target.spec == "embedded:smollm2-135m-instruct"
    assert set(cfg.draft) == {"ngram"}  # and the shipped EAGLE-3 head (stage head); no distillation in a first run
    assert "distill" not in cfg.stages and cfg.stages[0] == "head" and cfg.head.init_from == "shipped"
    assert list(cfg.data.sources) == ["mt_bench", "mt_bench_turn2", "humaneval", "humaneval_edit"]
    # the default run is train.yaml's own: no experiment hides in its defaults list, and experiment=embedded_cpu
    # (the default by name) changes nothing
    assert {"experiment": None} in OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"))["defaults"]
    assert OmegaConf.to_container(cfg_for("experiment=embedded_cpu")) == OmegaConf.to_container(cfg)


def yaml_nodes():
    """(file, base path, the file's node over that base) for every ``/base/<path>@<package>`` a config extends."""
    for path in [CONF / "train.yaml", *sorted(CONF.glob("*/*.yaml"))]:
        raw = OmegaConf.to_container(OmegaConf.load(path))
        for entry in raw.get("defaults", []):
            if isinstance(entry, str) and entry.startswith("/base/"):
                base, package = entry[len("/base/"):].split("@")
                yield path.relative_to(CONF), base, raw if package == "_here_" else raw.get(package, {})


def sacpolicy_targets(node):
    if isinstance(node, dict):
        if str(node.get("_target_", "")).startswith("sacpolicy."):
            yield node["_target_"]
        for v in node.values():
            yield from sacpolicy_targets(v)


@pytest.mark.parametrize("where", ["train.yaml", *sorted(p.name for p in CONF.iterdir() if p.is_dir()
                                                      and p.name != "experiment")])
def test_every_option_writes_only_what_differs_from_the_code_it_builds(where):
    """One home per default: an option or section that builds our code extends that code's node (its defaults) and
    writes only values that differ; a key that is none of the code's parameters fails here (unless it takes
    **kwargs)."""
    for path in [CONF / where] if where.endswith(".yaml") else (CONF / where).glob("*.yaml"):
        named = set(sacpolicy_targets(OmegaConf.to_container(OmegaConf.load(path))))
        # DrafterSpec's fields depend on the drafter's kind: a draft option writes its kind's, DrafterSpec holds the
        # rest (max_ngram, min_ngram)
        assert named <= {"sacpolicy.runtime.spec.DrafterSpec"}, f"{path}: extend /base/<path>@_here_, not _target_"
    for file, base, node in yaml_nodes():
        if file.parts[0] != where:
            continue
        run_time = config.BASES.get(base, ())
        defaults = config.defaults_of(base, run_time)
        obj = get_object(base)
        kwargs = not isinstance(obj, type) and any(p.kind is p.VAR_KEYWORD
                                                   for p in inspect.signature(obj).parameters.values())
        for key, value in node.items():
            if key in ("defaults", "_target_", "_partial_", "_convert_"):
                continue
            assert key in defaults or kwargs, f"{file}: {key} is no setting of {base}"
            assert key not in defaults or value != defaults[key], \
                f"{file}: {key}: {value!r} repeats {base}'s default; drop it from the YAML"


def test_every_base_node_is_extended_and_every_typed_section_is_a_dataclass():
    text = "\n".join(p.read_text() for p in CONF.rglob("*.yaml"))
    for name, cls in config.SECTIONS.items():
        assert f"/base/{cls.__module__}.{cls.__qualname__}@{name}" in text
    for base in config.BASES:
        assert f"/base/{base}@" in text, f"{base} is registered but no config extends it"


@pytest.mark.parametrize("section", sorted(config.SECTIONS))
def test_every_typed_section_rejects_an_unknown_key_or_a_wrong_type(section):
    cfg = cfg_for()
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{section}.nope'"):
        cfg_for(f"{section}.nope=1")  # a typo on the command line
    with pytest.raises(ConfigKeyError, match="nope"):
        OmegaConf.merge(cfg[section], {"nope": 1})  # a typo in an experiment's YAML: merged the same way
    with pytest.raises(ValidationError):
        OmegaConf.merge(cfg[section], {{"fit": "k", "refit": "threshold"}.get(section, "max_new_tokens"): "many"})
    assert OmegaConf.to_object(cfg[section]) == config.SECTIONS[section]()  # the dataclass holds the defaults


def test_options_that_build_objects_reject_an_unknown_key():
    with pytest.raises(ConfigCompositionException, match="Could not override 'policy.thresold'"):
        cfg_for("policy=confidence", "policy.thresold=0.3")
    cfg = cfg_for("policy=confidence", "policy.threshold=0.3", "+decoder.k_mx=8")  # overrides need no `+`
    assert instantiate(cfg.policy).threshold == 0.3
    with pytest.raises(InstantiationException, match="k_mx"):
        instantiate(cfg.decoder)


def test_one_k_max_for_the_policies_under_two_distinct_limits():
    cfg = cfg_for()
    assert "k_max" not in cfg.eval and eval_settings(cfg).k_max == cfg.fit.k_max == 8  # evaluation uses fit.k_max
    assert cfg.fit.k_max <= cfg.collect.k_max and cfg.fit.k_max <= cfg.decoder.k_max
    with pytest.raises(pipeline.PipelineError, match="fit.k_max=32 exceeds collect.k_max=16.*raise collect.k_max"):
        pipeline.validate(cfg_for("fit.k_max=32", "decoder.k_max=32"))
    with pytest.raises(pipeline.PipelineError, match="fit.k_max=20 exceeds decoder.k_max=16.*raise decoder.k_max"):
        pipeline.validate(cfg_for("fit.k_max=20", "collect.k_max=32"))


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_validates(experiment):
    cfg = cfg_for(f"experiment={experiment}")
    if experiment.startswith("gpu_"):
        assert cfg.target.device == "cuda" and "/" in cfg.target.spec and cfg.draft.draft.path
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except ImportError:  # pragma: no cover
            has_gpu = False
        if not has_gpu:
            with pytest.raises(pipeline.PipelineError, match="no CUDA GPU"):
                pipeline.validate(cfg)
            return
    pipeline.validate(cfg)


def test_every_policy_decoder_predictor_trainer_and_logger_option_instantiates(tmp_path):
    cfg = cfg_for("experiment=smoke", tmp_path=tmp_path)
    state = DecodeState(RequestInfo(prompt_len=8, max_new_tokens=32, drafters=("ngram", "layerskip")), context_len=8,
                        remaining=32, drafters=("ngram", "layerskip"))
    cost = cost_model(state.drafters)
    for opt in options("policy"):  # built as the decode stage builds it: the cost model where the policy needs one
        node = cfg_for(f"policy={opt}").policy
        policy = build_policy(node, cost=cost)
        assert needs_cost(node) == (opt == "vllm_adaptive") and (not needs_cost(node) or policy.cost is cost)
        policy.validate(state.drafters, 16)
        d = policy.decide([PolicyRow(state, policy.start(state.request))])[0]
        assert isinstance(d, Decision) and 0 <= d.k <= 16 and d.drafter in (None, *state.drafters)
        if opt != "bandit":  # the bandit explores, k = 0 included; every other policy drafts from its first step
            assert (d.k == 0) == (opt == "ar"), opt
    assert instantiate(cfg.decoder) == DecoderConfig()  # the dataclass is the one home of the decoder's defaults
    for opt in options("head"):
        assert instantiate(cfg_for(f"head={opt}").head).init_from == (None if opt == "eagle3" else opt)
    assert instantiate(cfg_for("head_data=sharegpt").head_data).sources
    assert instantiate(cfg_for().head).features == "cached"  # the embedded target's features fit on disk
    assert instantiate(cfg_for("head.features=online", "head.num_workers=1").head).features == "online"
    assert {cfg_for(f"experiment={x}").head.features for x in options("experiment") if x.startswith("gpu_")} == {
        "online"}  # a 7-8B target's feature cache would outgrow the disk
    assert instantiate(cfg_for().sampling).greedy and instantiate(cfg.sampling).greedy  # traces that replay exactly
    assert set(cfg.predictor) == set(options("predictor"))  # the default fits every predictor
    for opt in options("predictor"):
        spec = instantiate(cfg_for(f"predictor=[{opt}]").predictor, _convert_="all")
        assert list(spec) == [opt] and spec[opt].func in (fit_sklearn, fit_mlp)
        if spec[opt].func is fit_sklearn:
            assert hasattr(spec[opt].keywords["estimator"], "predict_proba")
    from sacpolicy.training.distill_data import DistillDataModule

    data_keys = set(inspect.signature(DistillDataModule).parameters)
    for opt in options("distill"):
        settings = instantiate(cfg_for(f"distill={opt}").distill)
        assert settings.loss == opt and set(settings.data) <= data_keys  # overrides of DistillDataModule's defaults
    for opt in options("trainer"):
        assert callable(instantiate(cfg_for(f"trainer={opt}", tmp_path=tmp_path).trainer))
    for opt in options("logger"):
        logger = instantiate(cfg_for(f"logger={opt}", tmp_path=tmp_path).logger)
        assert type(logger).__name__ in {"CSVLogger", "WandbLogger"}


@pytest.mark.parametrize("overrides, match", [
    (["policy=adaedl", "policy.threshold=1.5"], r"AdaEDL: threshold must be a number in \[0, 1\], got 1.5"),
    (["policy=sglang", "policy.config={1:{candidate_steps:[]}}"], r"\(batch 1\): candidate_steps must be a non-empty"),
    (["policy=trtllm", "policy.acceptance_rate_window_size=0", "policy.acceptance_rate_threshold=0.5"],
     r"acceptance_rate_window_size must be an integer >= 1, got 0"),
    (["policy=trtllm", "policy.acceptance_rate_window_size=16"], "set acceptance_rate_window_size and "
                                                                  "acceptance_rate_threshold together"),
    (["policy=vllm_schedule", "policy.num_speculative_tokens_per_batch_size=[[1,4,2],[3,8,1]]"], "ranges overlap"),
    (["policy=vllm_adaptive", "policy.num_speculative_tokens=0"], "num_speculative_tokens must be an integer >= 1"),
    (["policy=llamacpp", "policy.draft_min=20"], r"draft_min \(--draft-min\) must be an integer in \[0, draft_max"),
])
def test_a_bad_peer_setting_is_refused_before_any_stage_naming_the_option_and_the_fix(overrides, match):
    """peers.py refuses the setting; the config path (pipeline.validate, before any stage) hands its message on."""
    with pytest.raises(pipeline.PipelineError, match=match) as err:
        pipeline.validate(cfg_for("experiment=smoke", *overrides))
    assert "Fix the setting in the policy option's YAML (conf/policy/) or override it" in str(err.value)


@pytest.mark.slow  # every data option: generates the first answers its second turns quote
def test_every_draft_and_data_option_builds_on_the_tiny_target(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    for opt in options("draft"):
        cfg = cfg_for("experiment=smoke", f"draft=[{opt}]")
        if opt == "model":
            cfg.draft.draft.path = "tiny:llama-1l"
        if opt == "feature":
            cfg.draft.feature.path = str(tiny_head_dir(tiny_target, tmp_path))
        drafters = build_drafters(RunContext(cfg, tmp_path).drafter_specs(), tiny_target)
        assert [d.name for d in drafters] == list(cfg.draft or {})
    for opt in options("data"):
        ctx = RunContext(cfg_for("experiment=smoke", f"data={opt}"), tmp_path)
        ctx.target = tiny_target  # the run's prompts quote the target's own first answers where a source needs them
        splits = [ctx.prompts(s) for s in ("train", "val", "test")]
        assert sum(map(len, splits)) in (80, 164, 244, 488) and len(splits[0][0]["input_ids"]) > 0
        if opt == "mixed":
            second = next(r for r in splits[2] if r["category"] == "second_turn")
            answer = ctx.first_answers.filter(lambda r: r["prompt_id"] == second["prompt_id"].rsplit("/", 1)[0])[0]
            assert tiny_target.tokenizer.decode(answer["input_ids"][answer["prompt_len"]:],
                                                skip_special_tokens=True).strip() == second["messages"][1]["content"]


def test_unknown_option_fails_with_the_available_choices():
    with pytest.raises(ConfigCompositionException, match="Could not find 'policy/nope'"):
        cfg_for("policy=nope")
    with pytest.raises(ConfigCompositionException, match="experiment"):
        cfg_for("experiment=nope")


def test_every_stage_runs_the_function_its_registry_names():
    assert pipeline.STAGES == tuple(pipeline.STAGE_RUNNERS)
    for stage in pipeline.STAGES:
        fn = pipeline.stage_runner(stage)
        assert callable(fn) and fn.__module__ == f"sacpolicy.pipeline.{stage}" and fn.__name__ == "run"
    with pytest.raises(pipeline.PipelineError, match="unknown stage 'fly'; stages are"):
        pipeline.stage_runner("fly")


def test_unknown_stage_fails_before_any_work():
    cfg = cfg_for("experiment=smoke", "stages=[decode,fly]")
    with pytest.raises(pipeline.PipelineError, match="unknown stage.*fly"):
        pipeline.validate(cfg)


def test_live_policy_that_matches_no_row_fails_before_any_work():
    cfg = cfg_for("experiment=smoke", "eval.live_policies=[ar,learned-svm]", "predictor=[hgb]")
    with pytest.raises(pipeline.PipelineError, match=r"\['learned-svm'\] match no policy row"):
        pipeline.validate(cfg)
    pipeline.validate(cfg_for("experiment=smoke", "eval.live_policies=[ar,learned-*]"))
