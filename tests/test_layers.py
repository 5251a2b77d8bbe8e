"""The layering is a rule, not a habit: ``decoding`` imports no higher layer, ``runtime`` imports nothing but numpy
(and safetensors for artifacts), and no module grows past the size at which it holds two ideas."""

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "sacpolicy"
HIGHER = ("policy", "training", "traces", "evaluation", "export", "pipeline", "build", "profiling", "tracking")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_decoding_imports_no_higher_layer():
    for path in (PKG / "decoding").glob("*.py"):
        bad = [m for m in imports(path) if m.startswith("sacpolicy.") and m.split(".")[1] in HIGHER]
        assert not bad, f"{path.name} imports {bad}: decoding is the lowest layer above models"


def test_runtime_needs_numpy_only():
    for path in (PKG / "runtime").glob("*.py"):
        for m in imports(path):
            top = m.split(".")[0]
            # sacpolicy.io (atomic writes) is standard library only; "sacpolicy" gives the version for provenance
            ok = (top in sys.stdlib_module_names or top in ("numpy", "safetensors", "onnx")  # onnx: optional export
                  or m.startswith("sacpolicy.runtime") or m in ("sacpolicy", "sacpolicy.io"))
            assert ok, f"runtime/{path.name} imports {m}: production engines load runtime with numpy alone"


def test_the_decoder_leaf_module_imports_nothing_of_sacpolicy_but_the_sampling_math():
    mods = {m for m in imports(PKG / "decoding" / "types.py") if m.startswith("sacpolicy")}
    assert mods <= {"sacpolicy.decoding.sampling"}, mods


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these modules: {long}"
