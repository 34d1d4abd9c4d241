"""``rlk info`` and ``python -m rlk info`` report versions, backends and op routing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import rlk


def _check_report(text: str) -> None:
    assert f"rlk {rlk.__version__} (op ABI {rlk.ABI_VERSION})" in text
    assert "torch " in text and "device: " in text
    assert "reference" in text and "[built-in] available" in text
    assert "selected_logprob" in text and "linear_logprob" in text


def test_python_m_rlk_info():
    result = subprocess.run([sys.executable, "-m", "rlk", "info"], capture_output=True, text=True, check=True)
    _check_report(result.stdout)


def test_console_script():
    assert shutil.which("rlk"), "the rlk console script is not on PATH: is the package installed?"
    result = subprocess.run(["rlk", "info"], capture_output=True, text=True, check=True)
    _check_report(result.stdout)


def test_unknown_command_fails():
    result = subprocess.run([sys.executable, "-m", "rlk", "nope"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr
