"""rlk's ops never synchronize the host with the GPU, and replay from a CUDA graph.

Issue 5 asks for policy-loss metrics "with no host synchronization" and for advantages and GAE "as GPU
parallel scans (no Python loop over time, no host sync)"; the batch-invariant forward chain (norm, matmul,
attention, RoPE, softmax, embedding, log-probs) is what an inference engine captures in CUDA graphs. Two checks
per op, on the backend rlk selects (forward, and the backward through ``torch.autograd.grad`` where the op is
differentiable):

* run under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call torch makes (``.item()``,
  ``nonzero``, a device-to-host copy, ...) raises. Value checks (``RLK_CHECK_VALUES``: on by default,
  documented to cost one synchronization each) stay on, except in the tests whose ops have one, which turn
  them off: ``group_advantages`` mode ``opo`` (``lengths`` finite and >= 0), the log-prob ops (targets in
  ``[0, V)``, temperature > 0), ``attention`` (``cu_seqlens``), ``prefix_attention`` (also ``prefix_index``;
  its backward builds the readers' CSR on the device), ``embedding`` (ids in ``[0, V)``) and ``scatter_rewards``
  with regions (their spans), and the span tables of the span-masked ops;
* captured in a CUDA graph (which fails on any synchronization or host read of device data), new inputs
  copied into the captured ones, the graph replayed: every output the same bits as an eager call on the new
  inputs (``torch.equal``), so nothing was baked into the graph from the first inputs.

GPU only (marker ``gpu``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import rlk

pytestmark = pytest.mark.gpu

Inputs = dict[str, torch.Tensor]


def _flat(out) -> list[torch.Tensor]:
    """The tensors of an op's result (tensors, tuples, dicts of metrics), in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _flat(x)]
    return []


def _with_grads(out, inputs: Inputs, wrt: tuple[str, ...]) -> list[torch.Tensor]:
    """The result's tensors, then the gradients w.r.t. ``wrt`` of the sum of every result that requires grad."""
    tensors = _flat(out)
    if wrt:
        total = sum(t.float().sum() for t in tensors if t.requires_grad)
        tensors += list(torch.autograd.grad(total, [inputs[k] for k in wrt]))
    return [t.detach() for t in tensors]


def check_no_sync_and_graph_replay(
    make: Callable[[int], Inputs], op: Callable[[Inputs], object], wrt: tuple[str, ...] = ()
) -> None:
    """``make(seed)`` builds the inputs (those named in ``wrt`` require grad); ``op(inputs)`` calls the op."""
    static = make(1)

    def step(inputs: Inputs) -> list[torch.Tensor]:
        return _with_grads(op(inputs), inputs, wrt)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static)  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        first = step(static)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    fresh = make(2)
    with torch.no_grad():
        for name, tensor in static.items():
            tensor.copy_(fresh[name])
    graph.replay()
    eager = step(fresh)
    torch.cuda.synchronize()
    assert len(captured) == len(eager)
    for i, (a, b) in enumerate(zip(captured, eager)):
        assert torch.equal(a, b), f"output {i} of {len(eager)}"
    assert not all(torch.equal(a, b) for a, b in zip(first, eager)), "the new inputs changed no output"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


def token_inputs(seed: int, b: int = 64, t: int = 1024, grad: tuple[str, ...] = ()) -> Inputs:
    """fp32 ``[B, T]`` log-probs / values / rewards, a ragged bool mask, per-sequence advantages."""
    g = _gen(seed)
    old = -torch.rand(b, t, generator=g, device="cuda") * 4
    lengths = torch.randint(1, t + 1, (b,), generator=g, device="cuda")
    inputs = {
        "logprob": old + 0.2 * torch.randn(b, t, generator=g, device="cuda"),
        "old_logprob": old,
        "ref_logprob": old + 0.3 * torch.randn(b, t, generator=g, device="cuda"),
        "advantages": torch.randn(b, 1, generator=g, device="cuda"),
        "mask": torch.arange(t, device="cuda")[None, :] < lengths[:, None],
        "values": torch.randn(b, t, generator=g, device="cuda"),
        "old_values": torch.randn(b, t, generator=g, device="cuda"),
        "returns": torch.randn(b, t, generator=g, device="cuda"),
        "rewards": torch.randn(b, t, generator=g, device="cuda"),
    }
    for name in grad:
        inputs[name].requires_grad_()
    return inputs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_policy_loss_gpu(loss, agg):
    def op(x):
        return rlk.policy_loss(
            x["logprob"],
            x["old_logprob"],
            x["advantages"],
            x["mask"],
            loss=loss,
            agg=agg,
            ref_logprob=x["ref_logprob"],
            kl_coef=0.05,
        )

    check_no_sync_and_graph_replay(lambda s: token_inputs(s, grad=("logprob",)), op, wrt=("logprob",))


@pytest.mark.parametrize("loss,agg", [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean")])
def test_policy_loss_and_grad_gpu(loss, agg):
    """At [512, 8192], the kernel chains of one call (count -> token pass -> finish; count -> partial sums -> token
    pass -> finish), chained by programmatic dependent launch on compute capability 9.0 and later."""

    def op(x):
        out = rlk.policy_loss_and_grad(
            x["logprob"],
            x["old_logprob"],
            x["advantages"],
            x["mask"],
            loss=loss,
            agg=agg,
            dual_clip=3.0 if loss == "ppo" else None,
        )
        return out.loss, out.grad_logprob, out.metrics

    check_no_sync_and_graph_replay(lambda s: token_inputs(s, b=512, t=8192), op)


def test_kl_penalty_gpu():
    def op(x):
        return rlk.kl_penalty(x["logprob"], x["ref_logprob"], "k3")

    check_no_sync_and_graph_replay(lambda s: token_inputs(s, grad=("logprob",)), op, wrt=("logprob",))


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("sequence", "mask")])
def test_rollout_correction_gpu(level, mode):
    """At [512, 8192]: the chain chunk sums (sequence level) -> token pass -> per-row merge -> merge over rows."""

    def op(x):
        return rlk.rollout_correction(
            x["old_logprob"],
            x["logprob"],
            x["mask"],
            level=level,
            mode=mode,
            upper=2.0,
            lower=None if mode == "truncate" else 0.5,
        )

    check_no_sync_and_graph_replay(lambda s: token_inputs(s, b=512, t=8192), op)


def test_value_loss_gpu():
    def op(x):
        return rlk.value_loss(x["values"], x["old_values"], x["returns"], x["mask"], clip=0.2)

    check_no_sync_and_graph_replay(lambda s: token_inputs(s, grad=("values",)), op, wrt=("values",))


def test_gae_and_discounted_returns_gpu():
    def op(x):
        return (
            rlk.gae(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=0.95),
            rlk.discounted_returns(x["rewards"], x["mask"], 0.99),
        )

    check_no_sync_and_graph_replay(token_inputs, op)


def test_masked_whiten_gpu():
    check_no_sync_and_graph_replay(token_inputs, lambda x: rlk.masked_whiten(x["rewards"], x["mask"]))


def score_inputs(seed: int, groups: int = 64, group_size: int = 8) -> Inputs:
    """``[B]`` fp32 scores (some groups all equal), a shuffled group index, lengths."""
    g = _gen(seed)
    n = groups * group_size
    scores = torch.randint(0, 3, (n,), generator=g, device="cuda").float()
    scores[:group_size] = 1.0
    return {
        "scores": scores,
        "group_index": torch.randperm(n, generator=g, device="cuda") % groups,
        "lengths": torch.randint(1, 500, (n,), generator=g, device="cuda").float(),
    }


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg"])
def test_group_advantages_gpu(mode, monkeypatch):
    if mode == "opo":  # the check that lengths are finite and >= 0 reads them (documented; off for capture)
        monkeypatch.setenv("RLK_CHECK_VALUES", "0")

    def op(x):
        lengths = x["lengths"] if mode == "opo" else None
        return (
            rlk.group_advantages(x["scores"], group_size=8, mode=mode, lengths=lengths),
            rlk.group_advantages(x["scores"], group_index=x["group_index"], mode=mode, lengths=lengths),
        )

    check_no_sync_and_graph_replay(score_inputs, op)


def scatter_inputs(seed: int, b: int = 64, t: int = 1024) -> Inputs:
    """``scatter_rewards``: two reward columns and their weights on the device, a ragged mask, costs, a shuffled
    group index and two regions per sequence."""
    g = _gen(seed)
    x = token_inputs(seed, b, t)
    start = torch.randint(0, t, (2 * b,), generator=g, device="cuda")
    return {
        "rewards": torch.randint(0, 2, (b, 2), generator=g, device="cuda").float(),
        "weights": torch.tensor([1.0, 0.5], device="cuda"),
        "mask": x["mask"],
        "costs": torch.rand(b, generator=g, device="cuda"),
        "group_index": torch.randperm(b, generator=g, device="cuda") % (b // 8),
        "values": torch.randn(2 * b, generator=g, device="cuda"),
        "spans": torch.stack([torch.arange(b, device="cuda").repeat_interleave(2), start, start + (t - start) // 2], 1),
    }


@pytest.mark.parametrize("placement", ["last", "broadcast"])
def test_scatter_rewards_gpu(placement, monkeypatch):
    def op(x):
        kw = {"reward_weights": x["weights"], "overlong": (1024, 256, 1.0), "placement": placement}
        return (
            rlk.scatter_rewards(x["rewards"], x["mask"], costs=x["costs"], group_mode="grpo", group_size=8, **kw),
            rlk.scatter_rewards(x["rewards"], x["mask"], group_mode="rloo", group_index=x["group_index"], **kw),
        )

    check_no_sync_and_graph_replay(scatter_inputs, op)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the spans' check reads them (documented; off for capture)

    def with_regions(x):
        regions = (x["values"], x["spans"])
        return rlk.scatter_rewards(
            x["rewards"][:, 0],
            x["mask"],
            region_rewards=regions,
            region_costs=regions,
            placement=placement,
            group_mode="dr_grpo",
            group_index=x["group_index"],
        )

    check_no_sync_and_graph_replay(scatter_inputs, with_regions)


def test_dpo_loss_gpu():
    def make(seed):
        g = _gen(seed)
        names = ("chosen", "rejected", "ref_chosen", "ref_rejected")
        x = {k: -torch.rand(256, generator=g, device="cuda") * 50 for k in names}
        for k in ("chosen", "rejected"):
            x[k].requires_grad_()
        return x

    def op(x):
        return rlk.dpo_loss(x["chosen"], x["rejected"], x["ref_chosen"], x["ref_rejected"], beta=0.1)

    check_no_sync_and_graph_replay(make, op, wrt=("chosen", "rejected"))


def test_fused_linear_policy_loss_gpu(monkeypatch):
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # linear_logprob reads the targets and temperature to check them
    b, t, h, v = 4, 256, 512, 4096

    def make(seed):
        g = _gen(seed)
        x = token_inputs(seed, b=b, t=t)
        x["hidden"] = (torch.randn(b, t, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
        x["weight"] = (torch.randn(v, h, generator=g, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
        x["targets"] = torch.randint(0, v, (b, t), generator=g, device="cuda")
        return x

    def op(x):
        return rlk.fused_linear_policy_loss(
            x["hidden"], x["weight"], x["targets"], x["old_logprob"], x["advantages"], x["mask"]
        )

    check_no_sync_and_graph_replay(make, op, wrt=("hidden", "weight"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_kl_gpu(reduction):
    """Value checks on: with a float temperature the op has nothing to check (labels are only compared with
    ignore_index). 'mean': the gradient made in the forward, scaled in the backward; 'none': recomputed."""
    n, hs, ht, v = 1024, 512, 768, 4096

    def make(seed):
        g = _gen(seed)
        targets = torch.randint(0, v, (n,), generator=g, device="cuda")
        targets[::7] = -100
        return {
            "student_hidden": torch.randn(n, hs, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(),
            "student_weight": (torch.randn(v, hs, generator=g, device="cuda") * 0.08)
            .to(torch.bfloat16)
            .requires_grad_(),
            "teacher_hidden": torch.randn(n, ht, generator=g, device="cuda").to(torch.bfloat16),
            "teacher_weight": (torch.randn(v, ht, generator=g, device="cuda") * 0.07).to(torch.bfloat16),
            "targets": targets,
        }

    def op(x):
        return rlk.fused_linear_kl(
            x["student_hidden"],
            x["student_weight"],
            x["teacher_hidden"],
            x["teacher_weight"],
            x["targets"],
            divergence="jsd",
            temperature=0.7,
            reduction=reduction,
        )

    check_no_sync_and_graph_replay(make, op, wrt=("student_hidden", "student_weight"))


# ----------------------------------------------------------------------------------------------
# the batch-invariant forward chain
# ----------------------------------------------------------------------------------------------


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.bfloat16, grad: bool = False):
    x = (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)
    return x.requires_grad_() if grad else x


def test_rms_norm_gpu():
    def make(seed):
        g = _gen(seed)
        return {
            "x": _randn(g, 64, 1024, grad=True),
            "residual": _randn(g, 64, 1024, grad=True),
            "weight": _randn(g, 1024, scale=0.1, grad=True),
        }

    def op(x):
        return (rlk.rms_norm(x["x"], x["weight"]), rlk.rms_norm(x["x"], x["weight"], residual=x["residual"]))

    check_no_sync_and_graph_replay(make, op, wrt=("x", "weight"))


def test_linear_and_matmul_gpu():
    def make(seed):
        g = _gen(seed)
        return {
            "x": _randn(g, 96, 512, grad=True),
            "weight": _randn(g, 384, 512, scale=0.05, grad=True),
            "bias": _randn(g, 384, grad=True),
        }

    def op(x):
        return rlk.linear(x["x"], x["weight"], x["bias"]), rlk.matmul(x["x"], x["weight"].t())

    check_no_sync_and_graph_replay(make, op, wrt=("x", "weight", "bias"))


def test_attention_gpu(monkeypatch):
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the cu_seqlens checks read them
    lengths = [37, 128, 5, 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)

    def make(seed):
        g = _gen(seed)
        return {
            "q": _randn(g, total, 8, 64, grad=True),
            "k": _randn(g, total, 2, 64, grad=True),
            "v": _randn(g, total, 2, 64, grad=True),
        }

    def op(x):
        return rlk.attention(
            x["q"],
            x["k"],
            x["v"],
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
            return_lse=True,
        )

    check_no_sync_and_graph_replay(make, op, wrt=("q", "k", "v"))


def test_prefix_attention_gpu(monkeypatch):
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the cu_seqlens and prefix_index checks read them
    lengths = [37, 128, 5, 0, 200, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    prefix_index = torch.tensor([-1, 0, 0, 0, -1, 4], dtype=torch.int32, device="cuda")
    total = sum(lengths)

    def make(seed):
        g = _gen(seed)
        return {
            "q": _randn(g, total, 8, 64, grad=True),
            "k": _randn(g, total, 2, 64, grad=True),
            "v": _randn(g, total, 2, 64, grad=True),
        }

    def op(x):
        return rlk.prefix_attention(
            x["q"],
            x["k"],
            x["v"],
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
            prefix_index=prefix_index,
            return_lse=True,
        )

    check_no_sync_and_graph_replay(make, op, wrt=("q", "k", "v"))


def test_apply_rope_gpu():
    def make(seed):
        g = _gen(seed)
        angles = torch.rand(2, 96, 32, generator=g, device="cuda") * 6
        angles = torch.cat([angles, angles], dim=-1)
        return {
            "q": _randn(g, 2, 8, 96, 64, grad=True),
            "k": _randn(g, 2, 2, 96, 64, grad=True),
            "cos": angles.cos().to(torch.bfloat16),
            "sin": angles.sin().to(torch.bfloat16),
        }

    def op(x):
        return rlk.apply_rope(x["q"], x["k"], x["cos"], x["sin"])

    check_no_sync_and_graph_replay(make, op, wrt=("q", "k"))


def test_softmax_and_log_softmax_gpu():
    def make(seed):
        return {"x": _randn(_gen(seed), 64, 1000, scale=3.0, grad=True)}

    check_no_sync_and_graph_replay(make, lambda x: (rlk.softmax(x["x"]), rlk.log_softmax(x["x"])), wrt=("x",))


def test_embedding_gpu(monkeypatch):
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the range check reads the ids

    def make(seed):
        g = _gen(seed)
        return {
            "ids": torch.randint(0, 1000, (4, 64), generator=g, device="cuda"),
            "weight": _randn(g, 1000, 256, grad=True),
        }

    check_no_sync_and_graph_replay(make, lambda x: rlk.embedding(x["ids"], x["weight"]), wrt=("weight",))


def test_logprob_ops_gpu(monkeypatch):
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the checks read the targets and the temperature
    n, h, v = 256, 512, 4096

    def make(seed):
        g = _gen(seed)
        targets = torch.randint(0, v, (n,), generator=g, device="cuda")
        targets[::17] = -100
        return {
            "logits": _randn(g, n, v, scale=2.0, grad=True),
            "hidden": _randn(g, n, h, grad=True),
            "weight": _randn(g, v, h, scale=0.05, grad=True),
            "targets": targets,
        }

    def op(x):
        return (
            rlk.selected_logprob(x["logits"], x["targets"], return_entropy=True),
            rlk.linear_logprob(x["hidden"], x["weight"], x["targets"], return_entropy=True),
        )

    check_no_sync_and_graph_replay(make, op, wrt=("logits", "hidden", "weight"))


def test_span_masked_ops_gpu(monkeypatch):
    """``loss_spans`` instead of masks: the span table becomes the mask on the device; new spans (another loss
    region per row) replay correctly from the graph."""
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # the checks read the targets and the spans
    b, t, h, v = 4, 256, 512, 4096

    def make(seed):
        g = _gen(seed)
        x = token_inputs(seed, b=b, t=t, grad=("logprob",))
        x["logits"] = _randn(g, b, t, v, scale=2.0, grad=True)
        x["hidden"] = _randn(g, b, t, h, grad=True)
        x["weight"] = _randn(g, v, h, scale=0.05, grad=True)
        x["targets"] = torch.randint(0, v, (b, t), generator=g, device="cuda")
        start = torch.randint(0, t // 2, (b,), generator=g, device="cuda")
        rows = torch.arange(b, device="cuda")
        x["spans"] = torch.stack([rows, start, start + t // 3, rows % 2], 1).to(torch.int32)
        return x

    def op(x):
        spans = {"loss_spans": x["spans"]}
        return (
            rlk.selected_logprob(x["logits"], x["targets"], return_entropy=True, **spans),
            rlk.linear_logprob(x["hidden"], x["weight"], x["targets"], span_tags=(1,), **spans),
            rlk.kl_penalty(x["logprob"], x["ref_logprob"], "k3", **spans),
            rlk.policy_loss(x["logprob"], x["old_logprob"], x["advantages"], **spans),
        )

    check_no_sync_and_graph_replay(make, op, wrt=("logits", "hidden", "weight", "logprob"))


def test_patched_attention_with_a_padding_mask_gpu(monkeypatch):
    """``rlk.patch_model``'s attention on a left-padded decode step (one query per row against a padded KV): its
    layout comes from the mask on the device, so a new padding replays correctly from the graph."""
    import types

    import rlk.integrations.hf.patch as hf

    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # also skips the one check that the mask has no holes
    module = types.SimpleNamespace(is_causal=True, training=False)
    batch, seq_k = 16, 300

    def make(seed):
        g = _gen(seed)
        lengths = torch.randint(1, seq_k + 1, (batch,), generator=g, device="cuda")
        mask = (torch.arange(seq_k, device="cuda")[None, :] >= seq_k - lengths[:, None]).long()
        return {
            "q": _randn(g, batch, 8, 1, 64),
            "k": _randn(g, batch, 2, seq_k, 64),
            "v": _randn(g, batch, 2, seq_k, 64),
            "mask": mask,
        }

    def op(x):
        hf._last_layout.clear()  # the layout is computed (and captured) on every call
        return hf.rlk_attention_forward(module, x["q"], x["k"], x["v"], x["mask"])[0]

    check_no_sync_and_graph_replay(make, op)
