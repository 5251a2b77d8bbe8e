"""The Hydra configuration: every group option composes and builds its object; presets validate; bad names fail."""

from pathlib import Path

import pytest
from conftest import tiny_head_dir
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import open_dict

from sacpolicy import pipeline
from sacpolicy.decoding import Decision, DecoderConfig, DecodeState, RequestInfo
from sacpolicy.pipeline.context import RunContext
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


def test_default_is_the_embedded_cpu_experiment():
    cfg = cfg_for()
    assert cfg.target.spec == "embedded:smollm2-135m-instruct"
    assert set(cfg.draft) == {"ngram"}  # and the shipped EAGLE-3 head (stage head); no distillation in a first run
    assert "distill" not in cfg.stages and cfg.stages[0] == "head" and cfg.head.init_from == "shipped"
    assert list(cfg.data.sources) == ["mt_bench", "mt_bench_turn2", "humaneval", "humaneval_edit"]


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
    for opt in options("policy"):
        policy = instantiate(cfg_for(f"policy={opt}").policy)
        policy.validate(state.drafters, 16)
        policy.reset(state.request)
        d = policy.decide(state)
        assert isinstance(d, Decision) and 0 <= d.k <= 16 and d.drafter in (None, *state.drafters)
        if opt in ("ar", "static", "heuristic", "seed_rule", "confidence"):  # the bandit explores, k = 0 included
            assert (d.k == 0) == (opt == "ar"), opt
    assert instantiate(cfg.decoder) == DecoderConfig()  # the dataclass is the one home of the decoder's defaults
    assert instantiate(cfg_for().sampling).greedy and instantiate(cfg.sampling).greedy  # traces that replay exactly
    assert set(cfg.predictor) == set(options("predictor"))  # the default fits every predictor
    for opt in options("predictor"):
        spec = instantiate(cfg_for(f"predictor=[{opt}]").predictor, _convert_="all")
        assert list(spec) == [opt] and spec[opt].func in (fit_sklearn, fit_mlp)
        if spec[opt].func is fit_sklearn:
            assert hasattr(spec[opt].keywords["estimator"], "predict_proba")
    import inspect

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


@pytest.mark.slow  # every data option: generates the first answers its second turns quote
def test_every_draft_and_data_option_builds_on_the_tiny_target(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SACPOLICY_CACHE", str(tmp_path / "cache"))
    for opt in options("draft"):
        cfg = cfg_for("experiment=smoke", f"draft=[{opt}]")
        if opt == "model":
            cfg.draft.draft.path = "tiny:llama-1l"
        if opt == "feature":
            cfg.draft.feature.path = str(tiny_head_dir(tiny_target, tmp_path))
        drafters = pipeline.build_drafters(cfg, tiny_target, tmp_path)
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


def test_unknown_stage_fails_before_any_work():
    cfg = cfg_for("experiment=smoke", "stages=[decode,fly]")
    with pytest.raises(pipeline.PipelineError, match="unknown stage.*fly"):
        pipeline.validate(cfg)


def test_live_policy_that_matches_no_row_fails_before_any_work():
    cfg = cfg_for("experiment=smoke", "eval.live_policies=[ar,learned-svm]", "predictor=[hgb]")
    with pytest.raises(pipeline.PipelineError, match=r"\['learned-svm'\] match no policy row"):
        pipeline.validate(cfg)
    pipeline.validate(cfg_for("experiment=smoke", "eval.live_policies=[ar,learned-*]"))
