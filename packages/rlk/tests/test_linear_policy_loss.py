"""fused_linear_policy_loss equals linear_logprob followed by policy_loss, and masks ignored targets."""

from __future__ import annotations

import pytest
import torch

import rlk
from rlk.core import contract


def _inputs(seed=0, b=3, t=7, h=16, v=300):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 4
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[0, :2] = -100
    old = -torch.rand(b, t, generator=g) * 5
    advantages = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    return hidden, weight, targets, old, advantages, mask


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(loss="ppo", dual_clip=3.0, agg="token-mean"),
        dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
        dict(loss="ppo", agg="token-sum", entropy_coef=0.01),
    ],
)
def test_equals_the_composition(kwargs):
    hidden, weight, targets, old, advantages, mask = _inputs()
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            loss, metrics = rlk.fused_linear_policy_loss(
                h, w, targets, old, advantages, mask, temperature=0.8, **kwargs
            )
        else:
            lp, ent = rlk.linear_logprob(h, w, targets, temperature=0.8, return_entropy=True)
            valid = mask & (targets != -100)
            entropy = ent if kwargs.get("entropy_coef") else None
            loss, metrics = rlk.policy_loss(lp, old, advantages, valid, entropy=entropy, **kwargs)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad, metrics))
    (loss_f, gh_f, gw_f, m_f), (loss_c, gh_c, gw_c, m_c) = results
    assert torch.equal(loss_f, loss_c) and torch.equal(gh_f, gh_c) and torch.equal(gw_f, gw_c)
    assert set(m_f) == set(m_c) and all(torch.equal(m_f[k], m_c[k]) for k in m_f)


def test_ignored_targets_never_enter_the_loss_and_one_sequence_works():
    hidden, weight, targets, old, advantages, mask = _inputs(b=1)
    mask[:] = True
    loss, _, entropy = rlk.fused_linear_policy_loss(
        hidden[0], weight, targets[0], old[0], advantages[0], mask[0], agg="token-sum", return_entropy=True
    )
    keep = targets[0] != -100
    lp = rlk.linear_logprob(hidden[0], weight, targets[0])
    expected, _ = rlk.policy_loss(lp[None], old, advantages, keep[None], agg="token-sum")
    assert torch.equal(loss, expected)
    assert entropy.shape == targets[0].shape and not entropy.requires_grad


def test_gradients_match_materialized_logits_under_the_contract():
    hidden, weight, targets, old, advantages, mask = _inputs(seed=1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = rlk.fused_linear_policy_loss(h, w, targets, old, advantages, mask, agg="token-sum")
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ w64.T, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    valid = mask & (targets != -100)
    ratio = torch.exp(logp - old.double())
    adv = advantages.double()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    ref = torch.where(valid, per_token, 0.0).sum()
    ref.backward()
    e = contract.entry("linear_logprob", torch.float32)
    assert contract.compare_grad(e, "grad_hidden", h.grad, h64.grad, 20.0).ok
    assert contract.compare_grad(e, "grad_weight", w.grad, w64.grad, 20.0).ok


def test_bad_arguments():
    hidden, weight, targets, old, advantages, mask = _inputs()
    with pytest.raises(TypeError, match="entropy: computed here"):
        rlk.fused_linear_policy_loss(hidden, weight, targets, old, advantages, mask, entropy=old)
    with pytest.raises(ValueError, match="mask: expected the shape of targets"):
        rlk.fused_linear_policy_loss(hidden, weight, targets, old, advantages, mask[:, :3])


# =============================================================================================
# the one-pass mode
# =============================================================================================

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# the triton backend: on the CPU only under the interpreter (small tiles below), else on the GPU
on_triton = pytest.mark.triton_interpreter if not ON_GPU else pytest.mark.gpu


def _batch(seed=0, b=3, t=8, h=32, v=150, ignored=True, dtype=torch.float32):
    """hidden / weight (logits ~ 2 N(0, 1)), targets (two ignored), old log-probs near the policy's, advantages,
    a mask with holes, reference log-probs, importance weights; on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (2 / h**0.5)
    targets = torch.randint(0, v, (b, t), generator=g)
    if ignored:
        targets[0, :2] = -100
    old = -torch.rand(b, t, generator=g) * 5
    x = {
        "hidden": hidden.to(dtype),
        "weight": weight.to(dtype),
        "targets": targets,
        "old": old,
        "advantages": torch.randn(b, t, generator=g),
        "mask": torch.rand(b, t, generator=g) < 0.8,
        "ref": old + 0.3 * torch.randn(b, t, generator=g),
        "iw": torch.rand(b, t, generator=g) + 0.5,
    }
    return {k: v.to(DEVICE) for k, v in x.items()}


def _run(x, mode, backend=None, chunk_tokens=5, temperature=1.0, return_entropy=True, grads=(True, True), **kw):
    """The op and its backward: (loss, metrics, entropy, grad_hidden, grad_weight)."""
    h = x["hidden"].detach().clone().requires_grad_(grads[0])
    w = x["weight"].detach().clone().requires_grad_(grads[1])
    kw = dict(kw)
    if kw.pop("with_ref", False):
        kw["ref_logprob"] = x["ref"]
    if kw.pop("with_iw", False):
        kw["importance_weights"] = x["iw"]
    with rlk.use_backend(backend):
        out = rlk.fused_linear_policy_loss(
            h,
            w,
            x["targets"],
            kw.pop("old", x["old"]),
            x["advantages"],
            x["mask"],
            temperature=temperature,
            return_entropy=return_entropy,
            mode=mode,
            chunk_tokens=chunk_tokens,
            **kw,
        )
    out[0].backward()
    entropy = out[2] if return_entropy else None
    return out[0].detach(), out[1], entropy, h.grad, w.grad


def _fp64_truth(x, temperature=1.0, **kw):
    """The lean composition on float64 copies, on the reference backend: the ground truth."""
    x64 = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double()
    kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return _run(x64, "lean", "reference", temperature=temperature, **kw)


def _max_row_scale(x, temperature=1.0) -> float:
    """The contract's largest row scale 1 + |lse| + |z_target| (fp64), over the non-ignored rows."""
    h, w, t = x["hidden"].double().flatten(0, -2), x["weight"].double(), x["targets"].flatten()
    inv_t = (
        (1.0 / temperature.double().expand(x["targets"].shape).flatten())
        if isinstance(temperature, torch.Tensor)
        else torch.full_like(t, 1.0 / temperature, dtype=torch.float64)
    )
    z = (h @ w.T) * inv_t[:, None]
    keep = t != -100
    lse = torch.logsumexp(z[keep], dim=-1)
    lp = z[keep].gather(1, t[keep][:, None])[:, 0] - lse
    return float(contract.row_scale(lp, lse).max())


def _check_against_truth(got, truth, x, dtype=torch.float32, temperature=1.0):
    """Loss, metrics and entropy close to fp64, gradients under linear_logprob's contract."""
    torch.testing.assert_close(got[0].double(), truth[0], rtol=1e-5, atol=1e-6)
    assert set(got[1]) == set(truth[1])
    for name in got[1]:
        torch.testing.assert_close(got[1][name].double(), truth[1][name], rtol=1e-5, atol=1e-6)
    if got[2] is not None:
        torch.testing.assert_close(got[2].double(), truth[2], rtol=1e-5, atol=1e-5)
    e = contract.entry("linear_logprob", dtype)
    scale = _max_row_scale(x, temperature)
    for k, name in ((3, "grad_hidden"), (4, "grad_weight")):
        dev = contract.compare_grad(e, name, got[k], truth[k], scale)
        assert dev.ok, dev


# Every loss, every aggregation (with and without global normalizers, as numbers and tensors), KL, importance
# weights, the entropy bonus, ignored targets: the one-pass mode on the reference backend (its readable spec of the
# same op-layer chunking) against the fp64 ground truth and against the lean mode.
ONE_PASS_CASES = [
    dict(loss="ppo", dual_clip=3.0, clamp_log_ratio=20.0, agg="token-mean", with_ref=True, kl_coef=0.1),
    dict(loss="ppo", clip_high=0.28, agg="token-mean", global_tokens=40.0),
    dict(loss="ppo", agg="token-sum", entropy_coef=0.01, with_iw=True),
    dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, clamp_log_ratio=(None, 10.0), agg="seq-mean-token-mean"),
    dict(loss="gspo", agg="seq-mean-token-sum", global_seqs=5.0, with_iw=True),
    dict(loss="cispo", clip_low=1.0, clip_high=4.0, agg="seq-mean-token-sum-norm", loss_scale=8.0),
    dict(loss="cispo", cispo_form="upper", clip_high=5.0, agg="token-mean", with_ref=True, kl="k3+", kl_coef=0.05),
    dict(loss="gpg", agg="token-sum", entropy_coef=-0.5),
    dict(loss="sapo", agg="token-mean", with_ref=True, kl="k2", kl_coef=0.1, kl_unbiased=True),
    dict(loss="geo_mean", agg="seq-mean-token-mean", global_seqs=torch.tensor(4.0)),
    dict(loss="dppo_tv", dual_clip=5.0, agg="token-mean", global_tokens=torch.tensor(30.0)),
    dict(loss="dppo_kl", agg="seq-mean-token-sum", entropy_coef=0.02),
    dict(loss="vespo", clamp_log_ratio=20.0, agg="token-mean", with_iw=True),
]


@pytest.mark.parametrize("kwargs", ONE_PASS_CASES, ids=lambda kw: f"{kw['loss']}-{kw['agg']}")
def test_one_pass_on_the_reference_matches_fp64_and_lean(kwargs):
    x = _batch(seed=3)
    kwargs = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    temperature = torch.tensor([[0.7], [1.0], [1.3]], device=DEVICE)
    one = _run(x, "one_pass", "reference", temperature=temperature, **kwargs)
    lean = _run(x, "lean", "reference", temperature=temperature, **kwargs)
    truth = _fp64_truth(x, temperature=temperature, **kwargs)
    _check_against_truth(one, truth, x, temperature=temperature)
    _check_against_truth(lean, truth, x, temperature=temperature)
    # against each other under the same contract (on a GPU the reference's matmuls round differently for another
    # number of rows: the modes' chunks of rows are not the lean mode's whole batch)
    e = contract.entry("linear_logprob", torch.float32)
    for k, name in ((3, "grad_hidden"), (4, "grad_weight")):
        dev = contract.compare_grad(e, name, one[k], lean[k].double(), _max_row_scale(x, temperature))
        assert dev.ok, dev


def test_one_pass_chunks_are_a_choice_not_a_result():
    """Chunks of 1 token, of 5 (ending inside sequences), of whole sequences and one chunk of the whole batch give
    one loss; gradients within the contract of fp64 (reference backend)."""
    x = _batch(seed=4)
    kw = dict(loss="ppo", agg="seq-mean-token-mean", with_ref=True, kl_coef=0.1)
    truth = _fp64_truth(x, **kw)
    for chunk_tokens in (1, 5, 16, 1000):
        _check_against_truth(_run(x, "one_pass", "reference", chunk_tokens=chunk_tokens, **kw), truth, x)


def test_one_pass_frozen_head_or_frozen_hidden():
    """Only the gradients asked for are computed (a frozen LM head: no weight gradient, no fp32 accumulator)."""
    x = _batch(seed=5)
    both = _run(x, "one_pass", "reference")
    only_hidden = _run(x, "one_pass", "reference", grads=(True, False))
    only_weight = _run(x, "one_pass", "reference", grads=(False, True))
    assert only_hidden[4] is None and only_weight[3] is None
    assert torch.equal(only_hidden[3], both[3]) and torch.equal(only_weight[4], both[4])
    assert torch.equal(only_hidden[0], both[0])


def test_decide_mode():
    x = _batch()
    h = x["hidden"].clone().requires_grad_()
    w, t = x["weight"], x["targets"]
    lpl = rlk.ops.linear_policy_loss
    with rlk.use_backend("reference"):
        assert lpl.decide_mode(h, w, t).mode == "lean"  # auto: one pass on triton only
        assert lpl.decide_mode(h, w, t, mode="one_pass").mode == "one_pass"
        assert lpl.decide_mode(h, w, t, mode="lean").mode == "lean"
        assert lpl.decide_mode(x["hidden"], w, t, mode="one_pass").mode == "lean"  # nothing needs a gradient
        with torch.no_grad():
            assert "no gradient" in lpl.decide_mode(h, w, t, mode="one_pass").reason
        assert lpl.decide_mode(h[:, :0], w, t[:, :0], mode="one_pass").mode == "lean"
    with pytest.raises(ValueError, match="mode: expected one of 'auto', 'one_pass', 'lean'"):
        lpl.decide_mode(h, w, t, mode="fast")
    with pytest.raises(ValueError, match="mode: expected one of"):
        rlk.fused_linear_policy_loss(h, w, t, x["old"], x["advantages"], x["mask"], mode="onepass")
    with pytest.raises(ValueError, match="chunk_tokens: expected an int >= 1"):
        rlk.fused_linear_policy_loss(h, w, t, x["old"], x["advantages"], x["mask"], chunk_tokens=0)


def test_one_pass_needs_the_backend_of_linear_logprob(monkeypatch):
    """Where linear_logprob runs on a backend without the stored-logits primitives (rlk-cuda), auto is lean and an
    explicit one_pass refuses: another backend's log-probs would not be linear_logprob's bits."""
    x = _batch()
    h = x["hidden"].clone().requires_grad_()
    real = rlk.core.dispatch.decide

    def decide(op, device, dtype, features=None):
        d = real(op, device, dtype, features)
        if op == "linear_logprob":
            return rlk.core.dispatch.Decision(op, device, dtype, "cuda", None, ("cuda",))
        return d

    monkeypatch.setattr(rlk.ops.linear_policy_loss.dispatch, "decide", decide)
    auto = rlk.ops.linear_policy_loss.decide_mode(h, x["weight"], x["targets"])
    assert auto.mode == "lean" and auto.backend == "cuda" and "does not implement linear_logprob_stored" in auto.reason
    with pytest.raises(rlk.BackendError, match="mode='one_pass': linear_logprob runs on 'cuda'"):
        rlk.ops.linear_policy_loss.decide_mode(h, x["weight"], x["targets"], mode="one_pass")


def test_one_pass_one_sequence_and_fp64():
    """A ``[T, H]`` sequence; float64 inputs (reference only) match the lean mode closely."""
    x = _batch(seed=6, b=1)
    one = {k: v[0] if k != "weight" else v for k, v in x.items()}
    a = _run(one, "one_pass", "reference", chunk_tokens=3, agg="token-sum")
    b = _run(one, "lean", "reference", chunk_tokens=3, agg="token-sum")
    assert a[2].shape == one["targets"].shape and a[3].shape == one["hidden"].shape
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-7)
    x64 = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    c, d = _run(x64, "one_pass", "reference"), _run(x64, "lean", "reference")
    assert c[0].dtype == torch.float64 and c[3].dtype == torch.float64
    torch.testing.assert_close(c[0], d[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c[4], d[4], rtol=1e-10, atol=1e-14)


def test_one_pass_16bit_weight_gradient_summed_in_fp32_over_chunks():
    """fp16 inputs in four chunks: the weight gradient is summed in fp32 and rounded once (within the fp16 contract
    of fp64, in fp16), as with one chunk."""
    x = _batch(seed=11, dtype=torch.float16)
    truth = _fp64_truth(x, agg="token-sum")
    for chunk_tokens in (6, 1000):
        got = _run(x, "one_pass", "reference", chunk_tokens=chunk_tokens, agg="token-sum")
        assert got[3].dtype == torch.float16 and got[4].dtype == torch.float16
        _check_against_truth(got, truth, x, dtype=torch.float16)


def test_one_pass_under_torch_compile():
    """``torch.compile(fullgraph=True)`` traces the one-pass custom op: the eager results, bit for bit."""
    x = _batch(seed=7, b=2, t=4, h=16, v=40)

    def step(h, w):
        loss, metrics = rlk.fused_linear_policy_loss(
            h, w, x["targets"], x["old"], x["advantages"], x["mask"], mode="one_pass", chunk_tokens=3, agg="token-sum"
        )
        return loss, metrics["clip_fraction"]

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        with rlk.use_backend("reference"):
            loss, clip = fn(h, w)
        (2.0 * loss).backward()
        results.append((loss.detach(), clip, h.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# the one-pass mode on the Triton kernels (the interpreter on the CPU: small tiles)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles that cut V = 150 into 2 leaves of 3 splits and the policy-loss rows into 8-token blocks, so that the
    interpreter runs a few programs per kernel."""
    from rlk_triton import logprob as tk
    from rlk_triton import matmul as tm
    from rlk_triton import policy_loss as tp

    tiles = {
        "linear_fwd": {
            "BLOCK_N": 16,
            "BLOCK_V": 16,
            "BLOCK_K": 32,
            "VOCAB_SPLIT": 32,
            "GROUP_N": 2,
            "num_warps": 4,
            "num_stages": 1,
        },
        "linear_bwd": {
            "BLOCK_N": 16,
            "BLOCK_V": 32,
            "BLOCK_K": 32,
            "VOCAB_CHUNK": 48,
            "GROUP_N": 2,
            "num_warps": 4,
            "num_stages": 1,
        },
        "stored_grad": {"BLOCK_V": 64, "num_warps": 4},
    }
    for family, cfg in tiles.items():
        for dtype in list(tk.TILE_CONFIGS[family]):
            monkeypatch.setitem(tk.TILE_CONFIGS[family], dtype, dict(cfg))
    gemm = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    for dtype in list(tm.BACKWARD_TILE_CONFIGS):
        monkeypatch.setitem(tm.BACKWARD_TILE_CONFIGS, dtype, dict(gemm))
    for name, value in (
        ("BLOCK_T", 8),
        ("COUNT_ELEMENTS", 16),
        ("COUNT_PROGRAMS", 2),
        ("COMBINE_BLOCK", 4),
        ("PARTS_BLOCK", 2),
    ):
        monkeypatch.setattr(tp, name, value)


TRITON_CASES = [
    # counts of the batch as the normalizer, KL, a per-sequence temperature, token chunks ending inside sequences
    dict(loss="ppo", dual_clip=3.0, agg="token-mean", with_ref=True, kl_coef=0.1),
    # a sequence ratio: chunks of whole sequences (chunk_tokens 10 -> one row of 8)
    dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    # the entropy bonus and importance weights
    dict(loss="cispo", clip_low=1.0, clip_high=4.0, agg="token-sum", entropy_coef=0.01, with_iw=True),
]
TRITON_CASES = [pytest.param(kw, torch.float32, id=kw["loss"]) for kw in TRITON_CASES] + [
    # 16-bit: G packed into the logits buffer, the weight gradient summed in fp32 over three chunks
    pytest.param(TRITON_CASES[0], torch.float16, id="ppo-float16"),
]


@on_triton
@pytest.mark.parametrize(("kwargs", "dtype"), TRITON_CASES)
def test_one_pass_on_triton_is_lean_bit_for_bit_with_gradients_under_the_contract(
    small_tiles, kwargs, dtype, monkeypatch
):
    """``auto`` picks one pass on a backend of ONE_PASS_BACKENDS (triton, as shipped; lean on a backend not in it).
    Loss, every metric and the entropy are the lean mode's bits; gradients within the contract of fp64 and of the
    lean mode's."""
    x = _batch(seed=8, dtype=dtype)
    temperature = torch.tensor([[0.7], [1.0], [1.3]], device=DEVICE)
    h = x["hidden"].clone().requires_grad_()
    assert rlk.ops.linear_policy_loss.ONE_PASS_BACKENDS == ("triton",)
    with rlk.use_backend("triton"):
        assert (
            rlk.ops.linear_policy_loss.decide_mode(
                h, x["weight"], x["targets"], loss=kwargs["loss"], chunk_tokens=10
            ).mode
            == "one_pass"
        )
        with monkeypatch.context() as patched:
            patched.setattr(rlk.ops.linear_policy_loss, "ONE_PASS_BACKENDS", ())
            assert (
                rlk.ops.linear_policy_loss.decide_mode(
                    h, x["weight"], x["targets"], loss=kwargs["loss"], chunk_tokens=10
                ).mode
                == "lean"
            )
    one = _run(x, "auto", "triton", chunk_tokens=10, temperature=temperature, **kwargs)
    lean = _run(x, "lean", "triton", temperature=temperature, **kwargs)
    assert torch.equal(one[0], lean[0])
    assert set(one[1]) == set(lean[1]) and all(torch.equal(one[1][k], lean[1][k]) for k in one[1])
    assert torch.equal(one[2], lean[2])
    truth = _fp64_truth(x, temperature=temperature, **kwargs)
    _check_against_truth(one, truth, x, dtype=dtype, temperature=temperature)
    e = contract.entry("linear_logprob", dtype)
    scale = 2 * _max_row_scale(x, temperature)
    for k, name in ((3, "grad_hidden"), (4, "grad_weight")):
        dev = contract.compare_grad(e, name, one[k], lean[k].double(), scale)
        assert dev.ok, dev


@on_triton
def test_one_pass_on_triton_rollout_log_probs_give_a_ratio_of_exactly_one(small_tiles):
    """With old log-probs from ``rlk.linear_logprob`` (the rollout's), the first micro-step's ratio is exactly 1 on
    every token: the one-pass log-probs are linear_logprob's bits."""
    x = _batch(seed=9)
    with rlk.use_backend("triton"):
        old = rlk.linear_logprob(x["hidden"], x["weight"], x["targets"], temperature=0.9)
    loss, metrics, *_ = _run(
        x,
        "one_pass",
        "triton",
        chunk_tokens=7,
        temperature=0.9,
        old=old,
        return_entropy=False,
        loss="ppo",
        clamp_log_ratio=20.0,
        agg="token-mean",
    )
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["approx_kl"]) == 0.0 and float(metrics["clip_fraction"]) == 0.0
    valid = x["mask"] & (x["targets"] != -100)
    torch.testing.assert_close(loss, -(x["advantages"] * valid).sum() / valid.sum(), rtol=1e-6, atol=0)  # -A r, r = 1


@on_triton
def test_one_pass_on_triton_grad_hidden_is_batch_invariant_and_grad_weight_deterministic(small_tiles):
    """A sequence alone and in the middle of a batch (other chunk boundaries around it, token-sum): its
    grad_hidden rows bitwise equal; the batch's grad_weight the same bits run to run."""
    x = _batch(seed=10, ignored=False)
    probe = {k: (v[1:2] if k != "weight" else v) for k, v in x.items()}
    kw = dict(chunk_tokens=5, loss="ppo", agg="token-sum", entropy_coef=0.01, with_ref=True, kl_coef=0.1)
    alone = _run(probe, "one_pass", "triton", **kw)
    first = _run(x, "one_pass", "triton", **kw)
    second = _run(x, "one_pass", "triton", **kw)
    assert torch.equal(first[3][1:2], alone[3])
    assert torch.equal(first[2][1:2], alone[2])
    assert torch.equal(first[4], second[4]) and torch.equal(first[3], second[3])


# ---------------------------------------------------------------------------------------------
# masked positions are absent: NaN / inf hidden states there (padding) never reach a gradient
# ---------------------------------------------------------------------------------------------

# 16-bit inputs: GPU-only checks (the interpreter does not run bf16 dots; fp16 on the CPU adds nothing here)
MASKED_DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.float16, marks=pytest.mark.gpu, id="float16"),
    pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16"),
]


def _poisoned_hidden(x, where, seed):
    """``x`` with its hidden rows at ``where`` ([B, T]) set to NaN, +inf or -inf (drawn per element), and the same
    with zeros there."""
    hidden = x["hidden"]
    pick = torch.randint(0, 3, hidden.shape, generator=torch.Generator().manual_seed(seed)).to(hidden.device)
    bad = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=hidden.dtype, device=hidden.device)[pick]
    rows = where[..., None].expand(hidden.shape)
    return {**x, "hidden": torch.where(rows, bad, hidden)}, {**x, "hidden": hidden.masked_fill(rows, 0.0)}


def _same_results(a, b):
    """Loss, metrics, entropy and both gradients of two ``_run`` results: bitwise equal and finite."""
    assert torch.equal(a[0], b[0]) and set(a[1]) == set(b[1])
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    for k in (2, 3, 4):
        assert torch.equal(a[k], b[k]) and bool(torch.isfinite(a[k]).all()), k


@pytest.mark.parametrize("dtype", MASKED_DTYPES)
@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        ("reference", "lean"),
        ("reference", "one_pass"),
        ("reference", "auto"),
        pytest.param("triton", "lean", marks=on_triton),
        pytest.param("triton", "one_pass", marks=on_triton),
        # auto is one pass on Triton: the one_pass case's kernels, ~10 s under the interpreter
        pytest.param("triton", "auto", marks=[on_triton, pytest.mark.slow]),
    ],
)
def test_masked_hidden_rows_never_reach_the_gradients(backend, mode, dtype):
    """NaN / +-inf hidden states at positions with mask 0 and a valid target (padding behind a fully masked
    attention row) gave a NaN grad_weight (0 * NaN in G.T @ hidden) and NaN grad_hidden rows in the lean and one-pass
    modes; a masked position now counts as an ignored target: every result is finite and bitwise that of zeros
    there, in every mode (``one_pass`` in chunks of one sequence; ``auto``, one chunk on Triton, lean on the
    reference)."""
    x = _batch(seed=12, b=2, t=4, h=16, v=40, dtype=dtype)
    masked = ~x["mask"] & (x["targets"] != -100)
    assert bool(masked.any())
    bad, clean = _poisoned_hidden(x, masked, seed=12)
    kw = dict(loss="ppo", agg="token-mean", entropy_coef=0.01, chunk_tokens=4 if mode == "one_pass" else 2048)
    a, b = _run(bad, mode, backend, **kw), _run(clean, mode, backend, **kw)
    _same_results(a, b)
    assert bool((a[3][~x["mask"]] == 0).all()) and bool((a[2][~x["mask"]] == 0).all())


@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        ("reference", "lean"),
        ("reference", "one_pass"),
        # the op layer's mask of the spans, then the kernels of the mask case above (~10 s under the interpreter)
        pytest.param("triton", "one_pass", marks=[on_triton, pytest.mark.slow]),
    ],
)
def test_hidden_rows_off_the_loss_spans_never_reach_the_gradients(backend, mode):
    """The same off ``loss_spans`` (the mask of the spans): NaN / +-inf there versus 0, bitwise equal and finite."""
    x = _batch(seed=13, b=2, t=4, h=16, v=40)
    table = torch.tensor([[0, 1, 3, 0], [1, 0, 1, 1], [1, 2, 4, 0]], dtype=torch.int32)
    on_spans = rlk.ops.spans.mask(table, tuple(x["targets"].shape)).to(DEVICE)
    bad, clean = _poisoned_hidden(x, ~on_spans, seed=13)
    results = []
    for inputs in (bad, clean):
        h = inputs["hidden"].clone().requires_grad_()
        w = inputs["weight"].clone().requires_grad_()
        with rlk.use_backend(backend):
            loss, metrics, entropy = rlk.fused_linear_policy_loss(
                h,
                w,
                x["targets"],
                x["old"],
                x["advantages"],
                loss_spans=table.to(DEVICE),
                mode=mode,
                chunk_tokens=4,
                return_entropy=True,
                agg="token-sum",
            )
        loss.backward()
        results.append((loss.detach(), metrics, entropy, h.grad, w.grad))
    _same_results(*results)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at the shape of the one-pass target (16 x 1024 tokens, H = 4096, V = 151936)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_one_pass_headline_shape_gpu():
    """GRPO loss with a k3 KL term, bf16, on triton: one pass gives the lean mode's loss, metrics and entropy bit for
    bit, gradients within the bf16 contract of the lean ones, ratio exactly 1 against linear_logprob's log-probs,
    and a peak extra memory (gradients included) of at most 4 GiB."""
    b, t, h, v = 16, 1024, 4096, 151936
    g = torch.Generator(DEVICE).manual_seed(0)
    hidden = (torch.randn(b, t, h, generator=g, device=DEVICE) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g, device=DEVICE) * h**-0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (b, t), generator=g, device=DEVICE)
    mask = torch.rand(b, t, generator=g, device=DEVICE) < 0.9
    advantages = torch.randn(b, 1, generator=g, device=DEVICE)
    with rlk.use_backend("triton"):
        old = rlk.linear_logprob(hidden, weight, targets)
    ref = old + 0.05 * torch.randn(b, t, generator=g, device=DEVICE)
    kw = dict(loss="ppo", clip_low=0.2, clip_high=0.28, agg="token-mean", ref_logprob=ref, kl="k3", kl_coef=0.001)
    results = {}
    for mode in ("one_pass", "lean"):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with rlk.use_backend("triton"):
            loss, metrics, entropy = rlk.fused_linear_policy_loss(
                hh, ww, targets, old, advantages, mask, mode=mode, return_entropy=True, **kw
            )
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        results[mode] = (loss.detach(), metrics, entropy, hh.grad, ww.grad, peak)
        del hh, ww
    one, lean = results["one_pass"], results["lean"]
    assert torch.equal(one[0], lean[0]) and torch.equal(one[2], lean[2])
    assert all(torch.equal(one[1][k], lean[1][k]) for k in one[1])
    assert float(one[1]["ratio_mean"]) == 1.0 and float(one[1]["approx_kl"]) == 0.0
    e = contract.entry("linear_logprob", torch.bfloat16)
    for k, name in ((3, "grad_hidden"), (4, "grad_weight")):
        dev = contract.compare_grad(e, name, one[k], lean[k].double(), 1.0)
        assert dev.ok, dev
    assert one[5] <= 4 * 2**30, f"one pass: peak extra {one[5] / 2**30:.2f} GiB"
