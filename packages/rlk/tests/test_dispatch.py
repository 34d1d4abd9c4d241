"""Backend discovery, ABI checks, selection chains, pinning, fallback logging, explain."""

from __future__ import annotations

import logging
import os
import re
import types

import pytest
import torch
from fake_backend import recording_backend

import rlk
from rlk.core import abi, dispatch
from rlk.core.backend import Backend
from rlk.core.dispatch import BackendStatus


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    dispatch.refresh()
    yield
    monkeypatch.undo()
    dispatch.refresh()


def _install(monkeypatch, *backends: Backend, chain: tuple[str, ...] | None = None):
    """Make discovery return the reference plus ``backends``; optionally set the CPU chain."""
    found = {"reference": dispatch._load_reference()}
    for b in backends:
        found[b.name] = dispatch._status_of(b.name, lambda b=b: b, "test")
    monkeypatch.setattr(dispatch, "discover", lambda: found)
    if chain is not None:
        monkeypatch.setitem(dispatch._CHAINS, "cpu", chain)


def _inputs(n=5, v=11):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, v, generator=g), torch.randint(0, v, (n,), generator=g)


def test_reference_is_always_discovered_and_available():
    status = dispatch.discover()["reference"]
    assert status.available and status.source == "built-in"
    assert set(status.backend.primitives) == set(abi.PRIMITIVES)


def test_every_backend_implements_whole_ops():
    """A backend may serve a subset of the ops (the dispatcher falls back per op, ``rlk info`` shows it), but
    never half an op: an op's forward and backward run on the same backend. The triton backend serves all."""
    for name, status in dispatch.discover().items():
        if status.backend is None:
            continue
        table = set(status.backend.primitives)
        assert table <= set(abi.PRIMITIVES), f"{name}: primitives outside the ABI: {table - set(abi.PRIMITIVES)}"
        for op in abi.OPS.values():
            present = [p in table for p in op.primitives]
            assert all(present) or not any(present), f"{name} implements only part of {op.name}"
        if name == "triton":
            assert table == set(abi.PRIMITIVES)


@pytest.mark.native
def test_required_installed_backends_are_discovered():
    """Backends CI built and installed but cannot run here (rlk-cuda without a GPU) must still load, and say
    why they are unavailable (RLK_REQUIRE_INSTALLED, comma-separated)."""
    found = dispatch.discover()
    for name in [b for b in os.environ.get("RLK_REQUIRE_INSTALLED", "").split(",") if b]:
        assert name in found, f"backend {name!r} is required to be installed but is not"
        assert found[name].backend is not None, f"backend {name!r} failed to load: {found[name].reason}"
        assert found[name].available or found[name].reason, name


def test_required_backends_are_installed_and_available():
    """CI lists the backends it installed in RLK_REQUIRE_BACKENDS; a missing one fails loudly."""
    required = [b for b in os.environ.get("RLK_REQUIRE_BACKENDS", "reference").split(",") if b]
    found = dispatch.discover()
    for name in required:
        assert name in found, f"backend {name!r} is required but not installed"
        assert found[name].available, f"backend {name!r} is required but unavailable: {found[name].reason}"


def test_entry_point_backends_are_loaded(monkeypatch, tmp_path):
    (tmp_path / "rlk_fake_ep.py").write_text(
        "from rlk import reference\n"
        "def good():\n"
        "    import dataclasses\n"
        "    return dataclasses.replace(reference.backend(), name='good')\n"
        "def broken():\n"
        "    raise ImportError('libfoo.so missing')\n"
        "def old():\n"
        "    import dataclasses\n"
        "    return dataclasses.replace(reference.backend(), name='old', abi_version=0)\n"
        "def noprobe():\n"
        "    import dataclasses\n"
        "    def probe():\n"
        "        raise RuntimeError('driver exploded')\n"
        "    return dataclasses.replace(reference.backend(), name='noprobe', probe=probe)\n"
        "def notabackend():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        dispatch.metadata.EntryPoint(name=n, value=f"rlk_fake_ep:{n}", group=dispatch.ENTRY_POINT_GROUP)
        for n in ("good", "broken", "old", "noprobe", "notabackend")
    ]
    monkeypatch.setattr(
        dispatch.metadata, "entry_points", lambda group: eps if group == dispatch.ENTRY_POINT_GROUP else []
    )
    dispatch.refresh()
    found = dispatch.discover()
    assert found["good"].available
    assert "failed to load: ImportError: libfoo.so missing" in found["broken"].reason
    assert "ABI 0" in found["old"].reason and f"ABI {abi.ABI_VERSION}" in found["old"].reason
    assert "probe raised RuntimeError: driver exploded" in found["noprobe"].reason
    assert "not rlk.Backend" in found["notabackend"].reason
    report = rlk.info()
    for name in ("good", "broken", "old", "noprobe", "notabackend"):
        assert name in report
    assert "libfoo.so missing" in report


def test_default_chains():
    assert dispatch.chain_for(torch.device("cpu")) == ("reference",)
    if torch.version.hip is None:
        assert dispatch.chain_for(torch.device("cuda")) == ("cuda", "triton", "reference")
    assert dispatch.chain_for(types.SimpleNamespace(type="npu")) == ("domestic", "reference")


def test_chain_picks_first_backend_that_serves(monkeypatch):
    calls = []
    _install(monkeypatch, recording_backend("fast", calls), chain=("fast", "reference"))
    logits, targets = _inputs()
    logits.requires_grad_(True)
    rlk.selected_logprob(logits, targets).sum().backward()
    assert calls == [("fast", "selected_logprob_fwd"), ("fast", "selected_logprob_bwd")]
    assert rlk.explain("selected_logprob", logits, targets).backend == "fast"


def test_fallback_is_logged_once_and_correct(monkeypatch, caplog):
    calls = []
    slow = recording_backend(
        "slow", calls, supports=lambda p, d, t: "float32 declined for the test" if t == torch.float32 else None
    )
    _install(monkeypatch, slow, chain=("slow", "reference"))
    logits, targets = _inputs()
    with caplog.at_level(logging.WARNING, logger="rlk"):
        first = rlk.selected_logprob(logits, targets)
        second = rlk.selected_logprob(logits, targets)
    assert calls == []
    warnings = [r for r in caplog.records if "falls back from 'slow' to 'reference'" in r.getMessage()]
    assert len(warnings) == 1 and "float32 declined for the test" in warnings[0].getMessage()
    expected = torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(first, expected.float())
    assert torch.equal(first, second)


def test_missing_primitive_falls_back(monkeypatch):
    calls = []
    partial = recording_backend("partial", calls)
    partial = Backend(
        **{**partial.__dict__, "primitives": {"selected_logprob_fwd": partial.primitives["selected_logprob_fwd"]}}
    )
    _install(monkeypatch, partial, chain=("partial", "reference"))
    decision = rlk.explain("selected_logprob", *_inputs())
    assert decision.backend == "reference"
    assert ("partial", "does not implement selected_logprob_bwd") in decision.skipped


def test_pinned_backend_runs_forward_and_backward(monkeypatch):
    calls = []
    _install(monkeypatch, recording_backend("pinme", calls))
    logits, targets = _inputs()
    logits.requires_grad_(True)
    with rlk.use_backend("pinme"):
        loss = rlk.selected_logprob(logits, targets).sum()
    loss.backward()  # outside the pin: the backward still runs where the forward ran
    assert calls == [("pinme", "selected_logprob_fwd"), ("pinme", "selected_logprob_bwd")]


@pytest.mark.parametrize(
    "backend, expected",
    [
        ("nosuch", "not installed"),
        ("down", "unavailable: no GPU for the test"),
        ("gpuonly", "does not serve device type 'cpu' (serves: cuda)"),
    ],
)
def test_pin_that_cannot_be_honoured_is_an_error(monkeypatch, backend, expected):
    _install(
        monkeypatch,
        recording_backend("down", [], probe=lambda: "no GPU for the test"),
        recording_backend("gpuonly", [], device_types=lambda: ("cuda",)),
    )
    monkeypatch.setenv("RLK_BACKEND", backend)
    with pytest.raises(rlk.BackendError, match=re.escape(expected)):
        rlk.selected_logprob(*_inputs())
    assert "pinned by RLK_BACKEND" in str(rlk.explain("selected_logprob", *_inputs()))


def test_use_backend_overrides_env_and_restores(monkeypatch):
    monkeypatch.setenv("RLK_BACKEND", "nosuch")
    with rlk.use_backend("reference"):
        assert rlk.explain("selected_logprob", *_inputs()).backend == "reference"
    assert rlk.explain("selected_logprob", *_inputs()).backend is None


def test_explain_is_readable_and_checks_its_arguments():
    text = str(rlk.explain("linear_logprob", torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long)))
    assert "linear_logprob on cpu (float32)" in text and "runs on 'reference'" in text
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        rlk.explain("nope", torch.randn(1))
    with pytest.raises(TypeError, match="at least one tensor"):
        rlk.explain("selected_logprob")


def test_backend_status_available_property():
    assert BackendStatus("x", None, None, "test").available
    assert not BackendStatus("x", None, "why", "test").available


def test_collect_primitives_maps_abi_names_and_refuses_duplicates():
    first = types.SimpleNamespace(selected_logprob_fwd=len, helper=max)
    second = types.SimpleNamespace(selected_logprob_bwd=min)
    assert abi.collect_primitives(first, second) == {"selected_logprob_fwd": len, "selected_logprob_bwd": min}
    with pytest.raises(ValueError, match="selected_logprob_fwd is defined in two modules"):
        abi.collect_primitives(first, first)
