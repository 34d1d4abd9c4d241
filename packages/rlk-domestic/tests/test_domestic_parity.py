"""Every op of the parity matrix on the domestic backend (CPU stand-in): each case against the reference run in fp64
under the numerical contract, and batch invariance (``torch.equal``) of a probe row / token / sequence / group alone
versus at the first, middle and last position of batches that span several blocks of rows."""

from __future__ import annotations

import pytest
import torch

from parity import cases as cs
from parity import chain, distill, rl
from parity.run import ALL_OPS, PASS, Config, run_matrix
from rlk_domestic.blocks import ROWS

#: Batches of the invariance probes: one block, and several (the probe's block and its position in it change).
BATCHES = (7, ROWS + 6)
#: Attention-like ops batch whole sequences / groups (each runs on its own): no row blocks to cross.
SEQUENCE_BATCHES = (7,)
#: Ops whose invariance the matrix probes (the others: see test_domestic_ops.py).
PROBED = set(cs.OPS) | set(rl.INVARIANT_OPS) | set(chain.CHAIN_OPS) | set(distill.DISTILL_OPS)


@pytest.fixture
def tiny_matrix(monkeypatch, standin):
    monkeypatch.setattr(cs, "QUICK_VOCABS", (1000, 3000))
    monkeypatch.setattr(cs, "QUICK_ROWS", (1, 7))
    monkeypatch.setitem(cs.INVARIANCE_VOCAB, "cpu", {"selected_logprob": 1000, "linear_logprob": 1000})
    for module in (cs, rl, distill):
        monkeypatch.setattr(module, "QUICK_INVARIANCE_BATCHES", BATCHES)


@pytest.mark.parametrize("op", ALL_OPS)
def test_contract_and_invariance(op, tiny_matrix, monkeypatch):
    sequence_op = op in ("attention", "prefix_attention")
    monkeypatch.setattr(chain, "QUICK_INVARIANCE_BATCHES", SEQUENCE_BATCHES if sequence_op else BATCHES)
    dtypes = ["float32"] if op in rl.RL_OPS else ["float32", "bfloat16"]
    cells = run_matrix(Config(torch.device("cpu"), ["domestic"], dtypes, [op], True, 0), progress=lambda line: None)
    assert [c.dtype for c in cells] == dtypes
    for cell in cells:
        assert cell.na_reason is None and cell.results and not cell.skipped, (cell.dtype, cell.na_reason)
        failed = [(r.case.label(), r.error or str(r.worst)) for r in cell.results if not r.ok]
        assert failed == [], (cell.dtype, failed)
        if op in PROBED:
            inv = cell.invariance
            assert inv is not None and inv.claimed and inv.checks, (cell.dtype, inv)
            assert inv.bitwise, (cell.dtype, inv.details)
            wanted = SEQUENCE_BATCHES if sequence_op else BATCHES
            assert {c.batch for c in inv.checks} == set(wanted)
        assert cell.status == PASS
