"""The README's examples run as written: every ```python block, in order and in one namespace (a block may use what an
earlier one defined), on the tiny target instead of the embedded one. Two substitutions only: ``load_model()``
returns the tiny target, and the run's policy path (``outputs/<date>/<time>/policies/mlp``) names a real policy
artifact saved here. The scripts the README's commands name exist, every Hydra command it shows (in a code block or in
its prose) composes the config, its export.py commands pass the script's argument check, and the README stays a
guide (<= 250 lines)."""

import re
from pathlib import Path

import pytest
from toys import ngram_rule

import sacpolicy.models
from sacpolicy.runtime import save_policy

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
POLICY_PATH = "outputs/<date>/<time>/policies/mlp"  # the run directory `make train` writes (README, "Your first run")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_every_python_block_of_the_readme_runs_on_the_tiny_target(tiny_target, tmp_path, monkeypatch):
    code = blocks("python")
    assert len(code) >= 3, "the README's Python examples were not found (```python fences)"
    assert any(POLICY_PATH in b for b in code), f"the learned-policy example no longer loads {POLICY_PATH}"
    policy = save_policy(tmp_path / "policies" / "mlp", ngram_rule("stop"), drafters={"ngram": {"kind": "ngram"}},
                         provenance={"target": tiny_target.spec}, metrics={})
    loads = []
    monkeypatch.setattr(sacpolicy.models, "load_model", lambda *a, **kw: loads.append((a, kw)) or tiny_target)
    namespace = {"__name__": "readme"}
    for i, block in enumerate(code):
        try:
            exec(compile(block.replace(POLICY_PATH, str(policy)), f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"README.md python block {i + 1} fails as written: {type(e).__name__}: {e}\n{block}")
    assert loads == [((), {})]  # the README loads the embedded default: load_model() with no arguments
    assert namespace["result"].tokens and len(namespace["results"]) == 4
    assert namespace["learned"].policy.rule.drafters == ("ngram",)


def test_the_scripts_the_readme_names_exist_and_it_stays_a_guide():
    named = set(re.findall(r"scripts/([\w.]+\.(?:py|sh))", README))
    assert named and not [s for s in named if not (ROOT / "scripts" / s).is_file()]
    mentioned = set(re.findall(r"\b(\w+\.py)\b", README))
    missing = {p.name for p in (ROOT / "scripts").glob("*.py")} - mentioned
    assert not missing, f"document {sorted(missing)} in the README"
    bash = "\n".join(blocks("bash"))
    assert all("--run " in line for line in bash.splitlines() if "profile_vllm.py" in line)  # --run is required
    assert len(README.splitlines()) <= 250, "README.md is a user guide of at most 250 lines; figures go to docs/"


def hydra_scripts() -> dict[str, str]:
    """{script: config name} of every ``scripts/*.py`` that is a Hydra app (``@hydra.main(..., config_name=...)``)."""
    apps = {p.name: re.search(r"@hydra\.main\([^)]*config_name=\"(\w+)\"", p.read_text())
            for p in (ROOT / "scripts").glob("*.py")}
    return {name: m.group(1) for name, m in apps.items() if m}


def readme_commands() -> list[str]:
    """Every ``python scripts/...`` command the README shows: the lines of its bash blocks (continuation lines joined)
    and the inline code spans of its prose (a span may wrap across lines), a placeholder such as ``<run>`` filled in
    as the reader would."""
    bash = "\n".join(blocks("bash")).replace("\\\n", " ")
    lines = [line.strip() for line in bash.splitlines() if line.strip().startswith("python scripts/")]
    prose = re.sub(r"^```.*?^```", "", README, flags=re.DOTALL | re.MULTILINE)
    spans = [" ".join(span.split()) for span in re.findall(r"`(python scripts/[^`]+)`", prose)]
    return [re.sub(r"<[\w ]+>", "run1", c) for c in lines + spans]


def commands(script: str) -> list[list[str]]:
    """The arguments of every ``python scripts/<script>`` command of the README (``readme_commands``), comments
    dropped."""
    import shlex

    return [shlex.split(c, comments=True)[2:] for c in readme_commands() if c.startswith(f"python scripts/{script} ")]


def hydra_runs(args: list[str]) -> list[list[str]]:
    """The override lists Hydra runs for a command's arguments: Hydra's own flags (``--cfg job``) dropped, a sweep
    (``-m``) expanded into its runs as Hydra's basic sweeper expands it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    flags = {"--cfg", "-c", "--package", "-p"}  # each takes a value
    overrides = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in flags)]
    if "-m" not in args and "--multirun" not in args:
        return [overrides]
    return [run for batch in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
            for run in batch]


def test_every_hydra_command_of_the_readme_composes():
    """Every command of a Hydra script (train.py, evaluate.py) the README shows, in a code block or in its prose,
    composes that script's config with ``hydra.compose`` (options, keys and values that exist; each run of a sweep),
    as the script would before it runs anything."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import sacpolicy.pipeline  # noqa: F401  (registers the structured config nodes)

    apps = hydra_scripts()
    assert {"train.py", "evaluate.py"} <= set(apps)
    found = {script: commands(script) for script in apps}
    for script in apps:  # the extraction misses none: a command in a new shape fails here, not silently
        assert len(found[script]) == README.count(f"python scripts/{script} "), script
    assert len(found["train.py"]) >= 10
    assert any("trainer.strategy=ddp" in args for args in found["train.py"])  # the multi-GPU line, in prose
    for script, config in apps.items():
        for args in found[script]:
            for overrides in hydra_runs(args):
                GlobalHydra.instance().clear()
                with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                    try:
                        compose(config, overrides=overrides, return_hydra_config=True)
                    except (HydraException, OmegaConfBaseException) as e:
                        pytest.fail(f"README: python scripts/{script} {' '.join(args)} does not compose "
                                    f"({type(e).__name__}: {e})")


def test_the_readmes_export_commands_parse():
    """Every export.py command passes the script's own argument check."""
    from toys import load_script

    export = commands("export.py")
    assert len(export) >= 5
    for args in export:
        load_script("export").parse(args)
