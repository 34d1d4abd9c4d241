"""verl's Megatron path through rlk: ``rlk.integrations.verl.linear_cross_entropy`` with a ``dist_process_group``
(the LM head sharded by vocabulary, as verl's Megatron forward calls it), on a tensor-parallel group of 2 gloo
processes on the CPU.

verl's own vocab-parallel kernel runs on CUDA only, so its contract is checked here: log-probs and entropies the
same on every rank and bitwise those of ``rlk.linear_logprob`` on the full head (and close to verl's unfused
``logprobs_from_logits`` / ``entropy_from_logits``); the ranks' ``grad_hidden`` sum (the caller's all-reduce) to
the single-device gradient bitwise, each rank's ``grad_weight`` its rows of it; ``register(override=True)`` routes
verl's name there. Run in the verl environment (``ci/install_verl_env.sh``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rlk
from rlk.core import contract
from rlk.distributed import testing

pytestmark = pytest.mark.verl

N, H, V = 24, 64, 64  # V: 8 vocab leaves, 4 per rank at TP = 2
TEMPERATURE = 0.8


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    up = torch.randn(2, N, generator=g)
    return hidden, weight, labels, up


def _worker(rank: int, world: int) -> None:
    import verl.utils.kernel.linear_cross_entropy as verl_lce
    from verl.utils import torch_functional as verl_F

    import rlk.integrations.verl as rv

    group = dist.new_group(list(range(world)))
    hidden, weight, labels, up = _inputs()
    shard = weight.chunk(world)[rank].clone()

    # the single-device truth, in this process
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp1, ent1 = rlk.linear_logprob(h1, w1, labels, temperature=TEMPERATURE, return_entropy=True)
    ((lp1 * up[0]).sum() + (ent1 * up[1]).sum()).backward()

    h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
    lp, ent = rv.linear_cross_entropy(h, w, labels, TEMPERATURE, "none", group)
    assert lp.shape == (N,) and ent.shape == (N,) and lp.dtype == ent.dtype == torch.float32
    assert torch.equal(lp, lp1.detach()) and torch.equal(ent, ent1.detach()), f"rank {rank}: vs TP = 1"
    ((lp * up[0]).sum() + (ent * up[1]).sum()).backward()
    grads: list = [None] * world
    dist.all_gather_object(grads, h.grad)
    assert torch.equal(sum(grads[1:], grads[0]), h1.grad), "the ranks' grad_hidden sum to the TP = 1 gradient"
    assert torch.equal(w.grad, w1.grad.chunk(world)[rank]), "grad_weight: this rank's rows"

    # verl's unfused path on the gathered logits (float64): within the contract's tolerance
    logits = (hidden.double() @ weight.double().t()) / TEMPERATURE
    entry = contract.entry("linear_logprob", torch.float32)
    for name, got, want in (
        ("logprob", lp, verl_F.logprobs_from_logits(logits, labels)),
        ("entropy", ent, verl_F.entropy_from_logits(logits)),
    ):
        dev = contract.compare_outputs(entry, name, got.detach().double(), want, 1.0 + want.abs())
        assert dev.ok, dev

    for reduction, expect in (("sum", lp1.detach().sum()), ("mean", lp1.detach().mean())):
        got, _ = rv.linear_cross_entropy(hidden, shard, labels, TEMPERATURE, reduction, group)
        assert got.dim() == 0 and torch.equal(got, expect), reduction

    # verl's name, swapped by register(override=True): its Megatron forward calls it with the TP group
    rv.register(override=True)
    try:
        again, _ = verl_lce.linear_cross_entropy(
            hidden.view(4, 6, H), shard, labels.view(4, 6), TEMPERATURE, "none", group
        )
        assert torch.equal(again, lp1.detach())
    finally:
        rv.unregister()
    assert verl_lce.linear_cross_entropy is not rv.linear_cross_entropy


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_linear_cross_entropy_on_a_gloo_tp_group(world):
    testing.run_ranks(_worker, world)
