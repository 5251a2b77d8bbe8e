"""The layering is a rule, not a habit: every room (a package or top-level module of sacpolicy) imports only rooms of
a lower layer, no module imports itself back through others, ``decoding`` imports no higher layer, ``runtime``
imports nothing but numpy (and safetensors for artifacts). Modules that moved answer their old path with an error
naming the new one. How large a module may grow is a review question, not a test: modules split by concept (the review
rule in docs/architecture.md)."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

import sacpolicy

PKG = Path(__file__).resolve().parents[1] / "sacpolicy"
HIGHER = ("policy", "training", "traces", "evaluation", "export", "pipeline", "build", "profiling", "models", "data",
          "heads")

# The layer of each room, lowest first; a room imports only rooms of a lower layer (and itself). ``data`` sits below
# ``models`` because the embedded model's GGUF is found by ``data.assets``.
LAYERS: dict[str, int] = {
    "sacpolicy": 0, "io": 0, "progress": 0,  # the package root (its version) and standard-library-only helpers
    "ranks": 0,  # where a process stands in a distributed run (standard library and torch only)
    "runtime": 1,
    "decoding": 2,
    "data": 3,
    "policy": 4, "models": 4, "heads": 4,
    "build": 5, "traces": 5, "profiling": 5,
    "training": 6,
    "evaluation": 7,
    "export": 8,
    "pipeline": 9,
    "bench": 10,  # what the scripts/bench_*.py share: it may import any room, none imports it
}


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
        assert not bad, f"{path.name} imports {bad}: decoding imports only runtime, the layer below it"


def test_runtime_needs_numpy_only():
    for path in (PKG / "runtime").glob("*.py"):
        for m in imports(path):
            top = m.split(".")[0]
            # sacpolicy.io (atomic writes) is standard library only; "sacpolicy" gives the version for provenance
            ok = (top in sys.stdlib_module_names or top in ("numpy", "safetensors", "onnx")  # onnx: optional export
                  or m.startswith("sacpolicy.runtime") or m in ("sacpolicy", "sacpolicy.io"))
            assert ok, f"runtime/{path.name} imports {m}: production engines load runtime with numpy alone"


def test_the_decoder_leaf_modules_import_nothing_of_sacpolicy_but_the_sampling_math_and_each_other():
    """The decoder's data (types), its token trees and its two protocols are the leaves every layer reads."""
    leaves = {"types": {"sacpolicy.decoding.sampling", "sacpolicy.decoding.tree"}, "tree": set(),
              "protocols": {"sacpolicy.decoding.types"}}
    for name, allowed in leaves.items():
        mods = {m for m in imports(PKG / "decoding" / f"{name}.py") if m.startswith("sacpolicy")}
        assert mods <= allowed, (name, mods)


# ---------------------------------------------------------------------- the module graph


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def room(module: str) -> str:
    """``sacpolicy.data.splits`` -> ``data``; the package root is its own room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _known(module: str) -> str:
    """The innermost module of sacpolicy that ``module`` names (a name inside a module resolves to that module)."""
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def module_imports(module: str) -> set[str]:
    """The sacpolicy modules ``module`` imports, at any depth (function-level and TYPE_CHECKING imports included);
    ``from p import m`` counts as importing ``p.m`` when that is a module, else ``p``."""
    path, out = MODULES[module], set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {_known(n) for n in names if n == "sacpolicy" or n.startswith("sacpolicy.")}
    return out - {module}


GRAPH = {m: module_imports(m) for m in MODULES}


def test_every_room_has_a_layer():
    rooms = {room(m) for m in MODULES}
    assert rooms <= set(LAYERS), f"place {sorted(rooms - set(LAYERS))} in LAYERS"


def test_no_room_imports_a_room_of_its_own_layer_or_above():
    bad = [f"{m} -> {i}" for m, imported in GRAPH.items() for i in imported
           if room(i) != room(m) and LAYERS[room(i)] >= LAYERS[room(m)]]
    assert not bad, "imports that reach sideways or up (move the shared code down instead):\n" + "\n".join(sorted(bad))


def test_no_import_circle_among_modules():
    """Acyclic at the module level, inside packages too (a package's ``__init__`` re-exports its modules, so a module
    that imports its own package's ``__init__`` closes a circle)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str):
        state[m] = 1
        path.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_graph_sees_function_level_imports():
    # models.loading once imported gguf inside a function; such imports are edges like any other
    assert "sacpolicy.models.gguf" in GRAPH["sacpolicy.models.loading"]
    assert "sacpolicy.data.hf" in GRAPH["sacpolicy.data.sources"]
    assert "sacpolicy.data.sources" not in GRAPH["sacpolicy.data.hf"]
    assert "sacpolicy.models.loading" not in GRAPH["sacpolicy.models.gguf"]


# ---------------------------------------------------------------------- moved modules


@pytest.mark.parametrize("old, new", sorted(sacpolicy.MOVED_MODULES.items()))
def test_a_moved_module_names_its_new_path(old, new):
    assert (PKG.parent / (new.replace(".", "/") + ".py")).is_file(), f"{new} does not exist"
    assert not (PKG.parent / (old.replace(".", "/") + ".py")).exists(), f"{old} is back: drop it from MOVED_MODULES"
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {new}; import it from there"):
        importlib.import_module(old)
    parent, _, leaf = old.rpartition(".")
    with pytest.raises(ModuleNotFoundError, match=f"moved to {new}"):  # ``from sacpolicy import gguf`` says it too
        exec(f"from {parent} import {leaf}", {})


def test_the_moved_module_finder_leaves_other_imports_alone():
    with pytest.raises(ModuleNotFoundError, match="No module named 'sacpolicy.no_such_module'"):
        importlib.import_module("sacpolicy.no_such_module")
    assert importlib.import_module("sacpolicy.io").__name__ == "sacpolicy.io"
