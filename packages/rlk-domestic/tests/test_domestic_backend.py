"""The domestic backend as rlk sees it: discovery, the probe's reasons, selection, the primitive table, the CPU
stand-in (off by default) and the device-side selfcheck; and a negative control: a plain library matmul does not
give a row the same bits in batches of other sizes on this CPU, which the fixed blocks do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import rlk_domestic
from rlk.core import abi, dispatch
from rlk_domestic import blocks, matmul, selfcheck

ROOT = Path(__file__).resolve().parents[3]


def test_unavailable_by_default_with_the_reason_of_every_device(monkeypatch):
    monkeypatch.delenv(rlk_domestic.ENV_STANDIN, raising=False)
    dispatch.refresh()
    try:
        status = dispatch.discover()["domestic"]
        assert status.backend is not None and not status.available
        for plugin in ("torch_npu", "torch_mlu", "torch_musa"):
            assert f"{plugin} is not installed" in status.reason
        assert "MetaX" in status.reason and rlk_domestic.ENV_STANDIN in status.reason
        assert status.backend.device_types() == ()
        for device_type in ("npu", "mlu", "musa"):
            assert dispatch.chain_for(SimpleNamespace(type=device_type)) == ("domestic", "reference")
        decision = dispatch.decide("softmax", torch.device("cpu"), torch.float32)
        assert decision.backend == "reference" and "domestic" not in decision.chain
    finally:
        dispatch.refresh()


def test_rlk_info_lists_it_unavailable():
    env = {k: v for k, v in os.environ.items() if k != rlk_domestic.ENV_STANDIN}
    out = subprocess.run(
        [sys.executable, "-m", "rlk", "info"], capture_output=True, text=True, env=env, check=True, cwd=ROOT
    ).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("domestic"))
    assert "[rlk_domestic:backend] unavailable: no Ascend NPU: torch_npu is not installed" in line
    assert "domestic" not in "\n".join(x for x in out.splitlines() if x.startswith("  softmax"))


def test_the_standin_serves_the_cpu_only_when_pinned(standin):
    status = dispatch.discover()["domestic"]
    assert status.available and status.backend.batch_invariant
    assert status.backend.device_types() == ("cpu",)
    assert status.backend.abi_version == abi.ABI_VERSION == rlk_domestic.ABI_VERSION
    assert dispatch.decide("softmax", torch.device("cpu"), torch.float32).backend == "reference"
    with dispatch.use_backend("domestic"):
        assert dispatch.decide("softmax", torch.device("cpu"), torch.float32).backend == "domestic"
        assert "not supported" in dispatch.decide("softmax", torch.device("cpu"), torch.float64).skipped[0][1]


def test_every_abi_primitive_is_implemented(standin):
    table = dispatch.discover()["domestic"].backend.primitives
    assert set(table) == set(abi.PRIMITIVES)


def test_the_probe_reports_a_plugin_that_does_not_import(monkeypatch, tmp_path):
    (tmp_path / "torch_npu.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = rlk_domestic._plugin_device("npu")
    assert reason.startswith("no Ascend NPU: torch_npu does not import (ImportError: libhccl.so")


def test_selfcheck_rows_agree_at_every_block_position(monkeypatch):
    assert selfcheck.positions_agree(torch.device("cpu"), sizes=(67, 33)) == []
    broken = []

    def shifted(a, b, bias, out):  # a deliberately position-dependent matmul: the check must catch it
        broken.append(1)
        out.copy_(a @ b)
        out[1:] += 1e-3

    monkeypatch.setattr(matmul, "matmul_fwd", shifted)
    problems = selfcheck.positions_agree(torch.device("cpu"), sizes=(67, 33))
    assert broken and any(p.startswith("matmul_fwd: a row's bits change at position 1") for p in problems)


def test_negative_control_a_library_matmul_is_not_batch_invariant_here():
    """torch's CPU matmul picks its kernel by M: row 0 of ``x[:n] @ w`` differs from ``x[:1] @ w`` for some n. The
    blocked matmul gives row 0 the same bits in every batch."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(200, 1003, generator=g), torch.randn(1003, 517, generator=g)
    alone = (x[:1] @ w)[0]
    assert any(not torch.equal((x[:n] @ w)[0], alone) for n in (7, 64, 65, 200))

    def blocked(n):
        out = torch.empty(n, 517)
        blocks.matmul_rows(x[:n], w, None, out)
        return out

    assert all(torch.equal(blocked(n)[0], blocked(1)[0]) for n in (7, 64, 65, 200))
    assert all(torch.equal(blocked(200)[n], blocked(n + 1)[n]) for n in (63, 64, 130))
