"""rlk's import floors: imports run down the layers only (``rlk/__init__.py`` names them), backends import only
the core, and no module the ``rlk`` facade imports imports the facade back."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import rlk

SRC = pathlib.Path(rlk.__file__).parent
PACKAGES = SRC.parents[2]
LAYERS = {"core": 0, "reference": 1, "ops": 2, "distributed": 3, "integrations": 4, "app": 5}
FACADE = len(LAYERS)  # rlk itself, its re-exports and rlk.__main__


def _module(path: pathlib.Path, root: pathlib.Path, package: str) -> str:
    return ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "rlk":
        return None
    return FACADE if len(parts) == 1 else LAYERS.get(parts[1], FACADE)


def _imports(path: pathlib.Path) -> set[str]:
    """Every rlk module a file imports, at module level or inside functions (``from rlk import x`` names
    ``rlk.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"rlk.{a.name}" for a in node.names} if node.module == "rlk" else {node.module}
    return {m for m in found if m.split(".")[0] == "rlk"}


def _graph() -> dict[str, set[str]]:
    return {_module(p, SRC, "rlk"): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def _resolve(name: str, modules) -> str:
    """``rlk.ops.norm.rms_norm`` -> ``rlk.ops.norm``: the longest prefix that is a module."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def test_the_layers_are_the_packages():
    top = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == set(LAYERS)
    # beside the facade: rlk.multimodal, the public name of rlk.integrations.multimodal
    assert {p.name for p in SRC.glob("*.py")} == {"__init__.py", "__main__.py", "multimodal.py"}


def test_no_import_runs_back_up():
    upward = [
        (module, target)
        for module, targets in _graph().items()
        for target in targets
        if _layer(module) < FACADE and (_layer(target) or 0) > _layer(module)
    ]
    # What reaches up is the facade only, from modules the facade does not import (next test).
    assert all(_layer(t) == FACADE for _, t in upward), [u for u in upward if _layer(u[1]) != FACADE]
    floors_below_facade = [(m, t) for m, t in upward if _layer(m) <= LAYERS["distributed"]]
    assert floors_below_facade == []


def test_the_facade_is_imported_only_by_what_it_does_not_import():
    graph = _graph()
    # the facade imports its public names on first use: its edges are the modules of rlk._EXPORTS
    graph["rlk"] = graph["rlk"] | set(rlk._EXPORTS.values())
    seen, todo = set(), ["rlk"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [_resolve(t, graph) for t in graph.get(module, ()) if _resolve(t, graph) in graph]
    cycles = sorted(m for m in seen - {"rlk"} if any(_resolve(t, graph) == "rlk" for t in graph[m]))
    assert cycles == []
    # the import closure of the facade's names is what it re-exports: no trainer adapter, no app but info
    assert not any(m.startswith(("rlk.integrations.trl", "rlk.integrations.verl", "rlk.app.cli")) for m in seen)


def test_backends_import_only_the_core():
    """rlk_domestic imports the reference too: it runs the spec itself on fixed blocks (docs/domestic.md)."""
    for package, floors in (("rlk_triton", {0}), ("rlk_cuda", {0}), ("rlk_domestic", {0, LAYERS["reference"]})):
        root = PACKAGES / package.replace("_", "-") / "src" / package
        assert root.is_dir(), root
        for path in sorted(root.rglob("*.py")):
            wrong = sorted(t for t in _imports(path) if _layer(t) not in floors)
            assert wrong == [], (_module(path, root, package), wrong)


def test_a_negative_control_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rlk.ops import norm\n\ndef f():\n    from rlk import demo\n")
    assert _imports(bad) == {"rlk.ops", "rlk.demo"}
    assert _layer("rlk.ops") > _layer("rlk.core.dispatch")


def test_import_rlk_imports_no_op_and_no_torch():
    """``import rlk`` and ``rlk --version`` import neither torch nor an op module (each public name is imported on
    first use); the names then resolve to the objects their modules define."""
    probe = (
        "import sys, rlk; from rlk.app.cli import main; assert main(['--version']) == 0; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('rlk.ops', 'rlk.integrations.hf'))))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == [f"rlk {rlk.__version__}", "[]"]
    for name, module in rlk._EXPORTS.items():
        value = getattr(rlk, name)
        defined = sys.modules[module] if module == f"rlk.{name}" else getattr(sys.modules[module], name, None)
        assert value is defined, name
    assert set(rlk.__all__) == {"__version__", *rlk._EXPORTS} and set(rlk.__all__) <= set(dir(rlk))
    layer = subprocess.run(
        [sys.executable, "-c", "import rlk; print(rlk.ops.norm.rms_norm is rlk.rms_norm, rlk.ops.ema.__name__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert layer.stdout.split() == ["True", "rlk.ops.ema"], "a bare `import rlk` reaches the layers' modules"
    try:
        rlk.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("rlk.no_such_name did not raise AttributeError")
