"""The README's examples run as written: every ```python block, in order and in one namespace (a block may use what an
earlier one defined), on the tiny target instead of the embedded one. Two substitutions only: ``load_model()``
returns the tiny target, and the run's policy path (``outputs/<date>/<time>/policies/mlp``) names a real policy
artifact saved here. The scripts the README's commands name exist, its train.py commands compose the Hydra config
and its export.py commands pass the script's argument check, and the README stays a guide (<= 250 lines)."""

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


def commands(script: str) -> list[list[str]]:
    """The arguments of every ``python scripts/<script>`` command in the README's bash blocks (continuation lines
    joined, comments dropped, a placeholder such as ``<run>`` filled in as the reader would)."""
    import shlex

    lines = re.sub(r"<[\w ]+>", "run1", "\n".join(blocks("bash")).replace("\\\n", " ")).splitlines()
    return [shlex.split(line, comments=True)[2:] for line in lines if line.startswith(f"python scripts/{script}")]


def test_the_readmes_pipeline_and_export_commands_parse():
    """Every train.py command composes the Hydra config (options and keys that exist); every export.py command passes
    the script's own argument check. Sweeps (``-m``) and Hydra's own settings are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from toys import load_script

    import sacpolicy.pipeline  # noqa: F401  (registers the structured config nodes)

    train = commands("train.py")
    assert len(train) >= 8
    for args in train:
        if "-m" in args or "--cfg" in args:
            continue
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            compose("train", overrides=[a for a in args if not a.startswith("hydra.")])
    export = commands("export.py")
    assert len(export) >= 5
    for args in export:
        load_script("export").parse(args)
