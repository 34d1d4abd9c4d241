"""Packaging: the license file ships in every distribution, the wheels carry the metadata a registry needs, and the
versions written in the packages agree (the backend extras pin them exactly)."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import rlk

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {
    "rlk": ROOT / "packages/rlk",
    "rlk-triton": ROOT / "packages/rlk-triton",
    "rlk-cuda": ROOT / "packages/rlk-cuda",
    "rlk-rocm": ROOT / "packages/rlk-rocm",
    "rlk-domestic": ROOT / "packages/rlk-domestic",
}
#: The native backends: (package folder key, import name, ABI version literal's module).
NATIVE = {"rlk-cuda": "rlk_cuda", "rlk-rocm": "rlk_rocm"}


def _project(name: str) -> dict:
    return tomllib.loads((PACKAGES[name] / "pyproject.toml").read_text())["project"]


def test_every_distribution_ships_the_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    for name, folder in PACKAGES.items():
        assert (folder / "LICENSE").read_text() == text, name
        project = _project(name)
        assert project["authors"] and any(
            c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"]
        ), name


def test_versions_agree():
    """rlk, rlk-triton and rlk-cuda carry one version, ``VERSION``'s (``tools/set_version.py`` writes it); rlk's
    backend extras and the backends' rlk dependency pin it exactly, and so do the Python packages' ``__version__``."""
    import rlk_domestic
    import rlk_triton

    version = (ROOT / "VERSION").read_text().strip()
    assert rlk.__version__ == version
    assert {_project(name)["version"] for name in PACKAGES} == {version}
    assert rlk_triton.__version__ == version
    assert rlk_domestic.__version__ == version
    for name, module in NATIVE.items():
        init = (PACKAGES[name] / f"src/{module}/__init__.py").read_text()
        assert re.search(r'^__version__ = "([^"]+)"', init, re.M).group(1) == version, name
    for extra, pins in _project("rlk")["optional-dependencies"].items():
        for pin in pins:
            if pin.startswith("rlk-"):
                assert pin.endswith(f"=={version}"), (extra, pin)
    for name in ("rlk-triton", "rlk-domestic", *NATIVE):
        assert f"rlk=={version}" in _project(name)["dependencies"], name
    extras = _project("rlk")["optional-dependencies"]
    assert extras["rocm60"] == extras["rocm62"] == [f"{_project('rlk-rocm')['name']}=={version}"]


def test_one_torch_floor():
    """Every distribution declares the same torch floor, and the torch running the tests satisfies it."""
    floors = {dep for name in PACKAGES for dep in _project(name)["dependencies"] if dep.startswith("torch")}
    assert len(floors) == 1
    (floor,) = floors
    minimum = tuple(int(x) for x in floor.removeprefix("torch>=").split("."))
    import torch

    assert tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= minimum


@pytest.mark.parametrize("name", ["rlk", "rlk-triton", "rlk-domestic"])
def test_wheel_metadata(name, tmp_path):
    """The pure-Python wheels build offline (no build isolation; from a copy, so the checkout gets no build folder)
    and carry the SPDX license, the license file and the classifiers."""
    source = tmp_path / "source"
    shutil.copytree(PACKAGES[name], source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    assert meta["Name"] == name and meta["Version"] == rlk.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta.get_all("Classifier") == _project(name)["classifiers"]


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_backend_declares_its_abi_and_entry_point(name):
    """Each native backend states the ABI version it was written for as a literal, registers its entry point, and
    names its flavour (CUDA / ROCm major) in the distribution name."""
    module = NATIVE[name]
    init = (PACKAGES[name] / f"src/{module}/__init__.py").read_text()
    from rlk.core import abi

    assert re.search(r"^ABI_VERSION = (\d+)$", init, re.M).group(1) == str(abi.ABI_VERSION)
    project = _project(name)
    backend = name.removeprefix("rlk-")
    assert project["entry-points"]["rlk.backends"] == {backend: f"{module}:backend"}
    assert re.fullmatch(rf"{name}\d+", project["name"]), project["name"]
    assert (PACKAGES[name] / "README.md").is_file() and project["readme"] == "README.md"


def test_rocm_sdist_carries_the_shared_kernels():
    """rlk-rocm's sdist force-includes the kernel headers it shares with rlk-cuda (their single source), and its
    CMakeLists reads them from there or from the checkout."""
    sdist = tomllib.loads((PACKAGES["rlk-rocm"] / "pyproject.toml").read_text())["tool"]["scikit-build"]["sdist"]
    shared = sdist["force-include"]
    for source, dest in shared.items():
        assert (PACKAGES["rlk-rocm"] / source).resolve().is_file(), source
        assert dest == f"csrc/shared/{Path(source).name}"
    includes = set()
    for header in ("logprob.cuh", "norm.cuh", "common.cuh", "launch_common.h"):
        includes |= set(re.findall(r'#include "([^"]+)"', (PACKAGES["rlk-cuda"] / "csrc" / header).read_text()))
    # ... and every header rlk-rocm's own sources include from rlk-cuda (the nanobind layer, the launch helpers).
    own = {f for f in (PACKAGES["rlk-rocm"] / "csrc").iterdir() if f.is_file()}
    for source in own:
        includes |= set(re.findall(r'#include "([^"]+)"', source.read_text())) - {f.name for f in own}
    assert {Path(s).name for s in shared} >= includes | {"logprob.cuh", "norm.cuh"}


# ---------------------------------------------------------------------------
# optional dependencies: each has an extra that installs it
# ---------------------------------------------------------------------------


def _extras() -> dict[str, list]:
    from packaging.requirements import Requirement

    return {
        extra: [Requirement(pin) for pin in pins] for extra, pins in _project("rlk")["optional-dependencies"].items()
    }


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules outside the standard library, torch and rlk that rlk's sources import (at module level
    or inside functions, ``importlib.import_module("verl....")`` included) -> the files importing them."""
    import ast

    source = PACKAGES["rlk"] / "src/rlk"
    found: dict[str, set[str]] = {}
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("verl."):
                names = [node.value]  # verl's modules, imported by name
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("rlk", "torch"):
                    found.setdefault(top, set()).add(str(path.relative_to(source)))
    return found


def test_every_optional_import_has_an_extra_that_installs_it():
    """Every module rlk's sources import beyond torch is in ``rlk.integrations.extras.OPTIONAL``, and the extra
    named there lists its distribution in packages/rlk/pyproject.toml (a backend extra: the backend wheel, which
    brings it). Pillow too, which the multimodal commands need through transformers' image processor."""
    from packaging.utils import canonicalize_name

    from rlk.app import cli
    from rlk.integrations.extras import OPTIONAL

    extras = _extras()
    imported = _third_party_imports()
    assert {"transformers", "tokenizers", "trl", "accelerate", "verl", "numpy"} <= set(imported)
    missing = sorted(set(imported) - set(OPTIONAL))
    assert not missing, f"imported, but no extra of rlk is named for them: {missing}"
    for module, (distribution, extra) in OPTIONAL.items():
        names = {canonicalize_name(r.name) for r in extras[extra]}
        assert canonicalize_name(distribution) in names or names == {f"rlk-{extra}"}, (module, extra, names)
    assert set(cli.MULTIMODAL_REQUIREMENTS) <= {m for m, (_, extra) in OPTIONAL.items() if extra == "hf"}
    assert {"transformers", "tokenizers", "pillow"} <= {canonicalize_name(r.name) for r in extras["hf"]}


def test_the_integration_extras_pin_the_tested_releases():
    """``rlk[trl]``: trl 1.16 (what rlk.integrations.trl was written and tested for), ``rlk[verl]``: verl 0.9.1
    (``rlk.integrations.verl.VERL_VERSION``); both with what their module imports."""
    source = PACKAGES["rlk"] / "src/rlk/integrations"
    trl_tested = re.search(r"written for trl (\d+\.\d+\.\d+)", (source / "trl.py").read_text()).group(1)
    verl_tested = re.search(r'^VERL_VERSION = "([^"]+)"', (source / "verl.py").read_text(), re.M).group(1)
    extras = _extras()
    trl = {r.name: r.specifier for r in extras["trl"]}
    assert trl_tested in trl["trl"] and "1.16.9" in trl["trl"]
    assert "1.17.0" not in trl["trl"] and "1.15.2" not in trl["trl"]
    assert {"accelerate", "transformers"} <= set(trl)
    verl = {r.name: r.specifier for r in extras["verl"]}
    assert verl_tested in verl["verl"] and "numpy" in verl
    assert [v for v in ("0.9.0", "0.9.2", "0.10.0") if v in verl["verl"]] == []


@pytest.mark.parametrize("module", ["trl", "accelerate"])
def test_the_trl_integration_without_trl_names_the_extra(module, tmp_path):
    """``import rlk.integrations.trl`` where trl (or accelerate, which it imports) does not import: an ImportError
    naming the package and ``pip install 'rlk[trl]'`` (it used to fail on accelerate's import)."""
    from test_cli import without_modules

    code = (
        "try:\n    import rlk.integrations.trl\nexcept ImportError as exc:\n    print(exc)\n    raise SystemExit(2)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=without_modules(tmp_path, module)
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == (
        f"rlk.integrations.trl needs the optional dependency {module} (pip install 'rlk[trl]')"
    )
