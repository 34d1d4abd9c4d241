"""The ABI ops the parity matrix does not run (``linear_logprob_stored``, ``ema``, ``sample``) against the fp64
reference under the numerical contract, and the batch invariance (``torch.equal``) of the ops whose invariance the
matrix does not probe: a row / pair / element / group alone versus inside batches spanning several blocks."""

from __future__ import annotations

import pytest
import torch

from rlk.core import contract, dispatch
from rlk.reference import advantages as ref_adv
from rlk.reference import ema as ref_ema
from rlk.reference import sampling as ref_sampling
from rlk_domestic.blocks import ELEMENTS, ROWS

IGNORE = -100
#: Batch sizes around the block of rows, and the probe's positions in them (first, a block boundary, last).
SIZES = (1, 7, ROWS + 6)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def dom(standin):
    return dispatch.backend_named("domestic").primitives


def _positions(n: int) -> tuple[int, ...]:
    return tuple(sorted({0, min(ROWS, n - 1), n - 1}))


def _embed(probe: torch.Tensor, others: torch.Tensor, n: int, position: int) -> torch.Tensor:
    """``n`` rows: ``others``' first ``n - 1`` with ``probe`` (one row) inserted at ``position``."""
    return torch.cat([others[:position], probe, others[position : n - 1]])


# ---------------------------------------------------------------------------
# linear_logprob_stored
# ---------------------------------------------------------------------------


def _stored_inputs(n, dtype, seed=0, v=300, h=48):
    g = _gen(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / 4).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        targets[2] = IGNORE
    inv_t = 1.0 / (0.5 + torch.rand(n, generator=g))
    return hidden, weight, targets, inv_t, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _stored(prims, hidden, weight, targets, inv_t, g_lp, g_ent, grad_dtype=None):
    n, v = hidden.shape[0], weight.shape[0]
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    lp, ent, lse = (torch.empty(n, dtype=cdt) for _ in range(3))
    logits = torch.empty(n, v, dtype=cdt)
    prims["linear_logprob_stored_fwd"](hidden, weight, targets, inv_t.to(cdt), IGNORE, lp, ent, lse, logits)
    gh = torch.empty_like(hidden)
    gw = torch.empty(weight.shape, dtype=grad_dtype or weight.dtype)
    prims["linear_logprob_stored_bwd"](
        hidden,
        weight,
        targets,
        inv_t.to(cdt),
        lse,
        ent,
        g_lp.to(cdt),
        g_ent.to(cdt),
        IGNORE,
        logits.clone(),
        gh,
        gw,
        False,
    )
    return {"logprob": lp, "entropy": ent, "lse": lse, "logits": logits, "grad_hidden": gh, "grad_weight": gw}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprob_stored_contract_and_bits(dom, dtype):
    args = _stored_inputs(33, dtype)
    got = _stored(dom, *args)
    exact = [a.double() if a.is_floating_point() else a for a in args]
    truth = _stored(_reference(), *exact)
    e = contract.entry("linear_logprob_stored", dtype)
    scale = contract.row_scale(truth["logprob"], truth["lse"])
    for name in ("logprob", "entropy"):
        assert contract.compare_outputs(e, name, got[name], truth[name], scale).ok, name
    max_scale = float(scale.max())
    for name in ("grad_hidden", "grad_weight"):
        dev = contract.compare_grad(e, name, got[name], truth[name], max_scale)
        assert dev.ok, (name, dev)
    # the forward's log-prob, entropy and lse are linear_logprob_fwd's bits on the same backend (the ABI)
    hidden, weight, targets, inv_t = args[:4]
    lp, ent, lse = (torch.empty(33) for _ in range(3))
    dom["linear_logprob_fwd"](hidden, weight, targets, inv_t, IGNORE, lp, ent, lse)
    for name, value in (("logprob", lp), ("entropy", ent), ("lse", lse)):
        assert torch.equal(value, got[name]), name
    # accumulate adds the weight gradient to what the output holds
    acc = torch.ones(weight.shape)
    n, v = hidden.shape[0], weight.shape[0]
    dom["linear_logprob_stored_bwd"](
        hidden,
        weight,
        targets,
        inv_t,
        got["lse"],
        got["entropy"],
        args[4],
        args[5],
        IGNORE,
        got["logits"].clone(),
        None,
        acc,
        True,
    )
    fresh = torch.empty(weight.shape)
    dom["linear_logprob_stored_bwd"](
        hidden,
        weight,
        targets,
        inv_t,
        got["lse"],
        got["entropy"],
        args[4],
        args[5],
        IGNORE,
        got["logits"].clone(),
        None,
        fresh,
        False,
    )
    assert torch.equal(acc, fresh + 1.0) and n and v


def _reference():
    return dispatch.backend_named("reference").primitives


def test_linear_logprob_stored_rows_are_batch_invariant(dom):
    probe = _stored_inputs(1, torch.float32, seed=1)
    others = _stored_inputs(2 * ROWS, torch.float32, seed=2)
    weight = probe[1]
    alone = _stored(dom, probe[0], weight, *probe[2:])
    for n in SIZES:
        for pos in _positions(n):
            rows = [_embed(p, o, n, pos) for p, o in zip((probe[0], *probe[2:]), (others[0], *others[2:]))]
            got = _stored(dom, rows[0], weight, *rows[1:])
            for name in ("logprob", "entropy", "lse", "logits", "grad_hidden"):
                assert torch.equal(got[name][pos], alone[name][0]), (name, n, pos)


# ---------------------------------------------------------------------------
# ema
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ema_contract_and_independence(dom, dtype):
    g = _gen(3)
    targets = [torch.randn(n, generator=g).to(dtype) for n in (5, ELEMENTS + 3)]
    sources = [torch.randn(t.shape, generator=g).to(dtype) for t in targets]
    exact = [t.double() for t in targets]
    ref_ema.ema_fwd(exact, [s.double() for s in sources], 0.95)
    got = [t.clone() for t in targets]
    dom["ema_fwd"](got, sources, 0.95)
    e = contract.entry("ema", dtype)
    for t, s, r, x in zip(targets, sources, exact, got):
        assert contract.compare_outputs(e, "ema", x, r, t.double().abs() + s.double().abs()).ok
    alone = targets[1].clone()
    dom["ema_fwd"]([alone], [sources[1]], 0.95)
    assert torch.equal(alone, got[1])


# ---------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------


def _sample(prims, logits, seed, step, **kw):
    n = logits.shape[0]
    tokens, logprob = torch.empty(n, dtype=torch.int64), torch.empty(n)
    prims["sample_fwd"](
        logits,
        seed,
        step,
        kw.get("inv_t", 1.25),
        kw.get("top_k", 20),
        kw.get("top_p", 0.9),
        kw.get("min_p", 0.0),
        kw.get("greedy", False),
        tokens,
        logprob,
    )
    return tokens, logprob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_the_reference_and_rows_are_invariant(dom, dtype):
    g = _gen(4)
    logits = (torch.randn(2 * ROWS, 500, generator=g) * 3).to(dtype)
    seed = torch.randint(0, 2**62, (2 * ROWS,), generator=g)
    step = torch.randint(0, 1000, (2 * ROWS,), generator=g)
    tokens, logprob = _sample(dom, logits, seed, step)
    ref_tokens, ref_lp = torch.empty_like(tokens), torch.empty_like(logprob)
    ref_sampling.sample_fwd(logits, seed, step, 1.25, 20, 0.9, 0.0, False, ref_tokens, ref_lp)
    assert torch.equal(tokens, ref_tokens)
    z_max = (logits.float() * 1.25).amax(-1).double()
    e = contract.entry("sample", dtype)
    assert contract.compare_outputs(e, "logprob", logprob, ref_lp.double(), ref_lp.double().abs() + z_max.abs()).ok
    alone = _sample(dom, logits[:1], seed[:1], step[:1])
    for n in SIZES:
        for pos in _positions(n):
            rows = [_embed(x[:1], x[1:], n, pos) for x in (logits, seed, step)]
            got = _sample(dom, *rows)
            assert torch.equal(got[0][pos], alone[0][0]) and torch.equal(got[1][pos], alone[1][0]), (n, pos)


# ---------------------------------------------------------------------------
# invariance of the ops the matrix does not probe
# ---------------------------------------------------------------------------


def test_kl_penalty_elements_are_invariant(dom):
    g = _gen(5)
    n_all = ELEMENTS + 9
    lp, ref, old = (torch.randn(n_all, generator=g) for _ in range(3))

    def run(idx):
        kl, coef = torch.empty(len(idx)), torch.empty(len(idx))
        dom["kl_penalty_fwd"](
            lp[idx],
            ref[idx],
            old[idx],
            kl,
            coef,
            estimator="k3",
            straight_through=False,
            k3_clamp=True,
            clamp=float("inf"),
        )
        return kl, coef

    alone = run(torch.tensor([0]))
    for n in (7, ELEMENTS + 9):
        for pos in (0, n // 2, n - 1):
            idx = torch.cat([torch.arange(1, pos + 1), torch.tensor([0]), torch.arange(pos + 1, n)])
            kl, coef = run(idx)
            assert torch.equal(kl[pos], alone[0][0]) and torch.equal(coef[pos], alone[1][0]), (n, pos)


def test_dpo_pairs_and_value_loss_tokens_are_invariant(dom):
    g = _gen(6)
    p_all = ELEMENTS + 5
    c, r, rc, rr = (torch.randn(p_all, generator=g) * 5 for _ in range(4))
    grad_losses = torch.randn(p_all, generator=g)

    def dpo(idx):
        n = len(idx)
        losses, loss, metrics = torch.empty(n), torch.empty(()), torch.empty(4)
        args = (c[idx], r[idx], rc[idx], rr[idx], None, None, 0.1, "sigmoid", 0.1, True)
        dom["dpo_loss_fwd"](*args, losses, loss, metrics)
        gc, gr = torch.empty(n), torch.empty(n)
        dom["dpo_loss_bwd"](*args, grad_losses[idx], None, gc, gr)
        return losses, gc, gr

    alone = dpo(torch.tensor([0]))
    for n in (7, p_all):
        for pos in (0, n // 2, n - 1):
            idx = torch.cat([torch.arange(1, pos + 1), torch.tensor([0]), torch.arange(pos + 1, n)])
            got = dpo(idx)
            assert all(torch.equal(x[pos], a[0]) for x, a in zip(got, alone)), (n, pos)

    t = 50
    values, old, returns = (torch.randn(2 * ROWS, t, generator=g) for _ in range(3))
    mask = torch.rand(2 * ROWS, t, generator=g) > 0.3
    weight = torch.rand(2 * ROWS, generator=g)

    def value_grad(rows):
        out = torch.empty(len(rows), t)
        dom["value_loss_bwd"](
            values[rows], old[rows], returns[rows], mask[rows], weight[rows], 0.2, torch.tensor(0.7), out
        )
        return out

    alone = value_grad(torch.tensor([0]))[0]
    for n in SIZES:
        for pos in _positions(n):
            rows = torch.cat([torch.arange(1, pos + 1), torch.tensor([0]), torch.arange(pos + 1, n)])
            assert torch.equal(value_grad(rows)[pos], alone), (n, pos)


@pytest.mark.parametrize("mode", ["grpo", "rloo", "opo", "grpo_passk"])
def test_a_groups_advantages_do_not_depend_on_the_other_groups(dom, mode):
    g = _gen(7)
    probe = torch.randn(5, generator=g) * 3
    probe_len = torch.rand(5, generator=g) * 100
    sizes = [3, 8, 1, 5, 6, 2] * 3
    others = [torch.randn(k, generator=g) for k in sizes]
    lens = [torch.rand(k, generator=g) * 100 for k in sizes]
    opo = mode == "opo"

    def run(scores, index, lengths):
        out = torch.empty_like(scores)
        dom["group_advantages_fwd"](scores, index, 0, lengths if opo else None, mode, 1e-6, out)
        return out

    alone = run(probe, torch.zeros(5, dtype=torch.int64), probe_len)
    truth = torch.empty_like(probe)
    ref_adv.group_advantages_fwd(
        probe, torch.zeros(5, dtype=torch.int64), 0, probe_len if opo else None, mode, 1e-6, truth
    )
    e = contract.entry("group_advantages", torch.float32)
    assert contract.compare_outputs(e, "adv", alone, truth.double(), 1 + truth.double().abs().max().expand(5)).ok
    for n_groups in (1, 7, len(sizes)):
        scores = torch.cat([probe, *others[:n_groups]])
        lengths = torch.cat([probe_len, *lens[:n_groups]])
        ids = torch.cat(
            [torch.full((5,), 100, dtype=torch.int64)]
            + [torch.full((k,), i, dtype=torch.int64) for i, k in enumerate(sizes[:n_groups])]
        )
        # the probe group's members scattered in the batch, in their order (the group order fixes the pivot)
        where = torch.randperm(len(scores), generator=g)[:5].sort().values
        rest = torch.ones(len(scores), dtype=torch.bool)
        rest[where] = False
        perm = torch.empty(len(scores), dtype=torch.int64)
        perm[where], perm[rest] = torch.arange(5), torch.arange(5, len(scores))
        inv = torch.argsort(perm)
        got = run(scores[perm], ids[perm], lengths[perm])[inv]
        assert torch.equal(got[:5], alone), n_groups


def test_masked_whiten_is_deterministic(dom):
    g = _gen(8)
    x = torch.randn(ELEMENTS + 11, generator=g) * 4
    mask = torch.rand(x.shape, generator=g) > 0.2
    outs = []
    for _ in range(2):
        out = torch.empty_like(x)
        dom["masked_whiten_fwd"](x, mask, True, 1e-8, "add", True, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
