"""rlk inside torch's FSDP2 (``fully_shard``): a tiny Qwen3 sharded over gloo ranks on the CPU (Triton kernels under
the interpreter, fp32), ``rlk.integrations.hf.apply(model, batch_invariant=True)`` on the sharded model.

* Log-probs and per-sequence input gradients: FSDP2 at DP = 1 and DP = 2, with different micro-batch splits (packed
  rows), bitwise equal to the unsharded model scoring each sequence alone and to the HF rollout path (left-padded
  prefill + KV-cache decode, scored by ``logprobs_from_hidden``, rlk's rollout scoring); the rollout at TP = 1 vs
  training at FSDP2 DP = 2 is the cross-configuration check. The logits path of ``rlk.app.consistency``
  (``log_softmax`` of the logits) is checked the same way against its ``rollout``.
* Negative control: with stock kernels the rollout's log-probs and the FSDP2 training log-probs differ.
* Gradients after FSDP2's reduce-scatter: DP = 2 with one micro-batch per rank equals DP = 1 accumulating the two
  (a sum of two is one tree); with two micro-batches per rank, FSDP2's own accumulation is another order than
  DP = 1's, and ``rlk.distributed.GradientTree`` over the per-micro-batch gradients gives DP = 1's tree bits
  (docs/fsdp2.md's recipe, down to the sharded parameters' ``.grad``).
* ``logprobs_from_hidden`` on the sharded model outside the forward: the head's DTensor weight gathered (no grad).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist
from engine_support import MAX_NEW, PROMPTS, VOCAB, all_gather, assert_all_equal, rollout_scores, tiny_qwen3, train

import rlk
import rlk.integrations.hf as hf
from rlk.distributed import GradientTree, testing

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def sharded(model, group, **kwargs):
    """``fully_shard`` every decoder layer, then the root (embedding, final norm, head), over ``group``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


# ---------------------------------------------------------------------------
# log-probs and input gradients at DP = 1, 2
# ---------------------------------------------------------------------------


def _logprob_worker(rank: int, world: int) -> None:
    from rlk.app.consistency import paths

    n = len(PROMPTS)
    reference = tiny_qwen3()
    embed = reference.get_input_embeddings().weight.detach().clone()
    # the rollout samples the responses with rlk's chain on (the consistency tool's path: logits, log_softmax)
    with paths.chain(reference, True):
        rolled = paths.rollout(reference, PROMPTS, max_new_tokens=MAX_NEW, seed=3)
    responses = rolled.responses
    assert all(len(r) >= 2 for r in responses)
    stock_rollout = rollout_scores(reference, PROMPTS, responses, rlk_on=False)

    hf.apply(reference, batch_invariant=True)
    alone, alone_grads = train(reference, embed, PROMPTS, responses, [[i] for i in range(n)])
    rollout = rollout_scores(reference, PROMPTS, responses)
    assert_all_equal(rollout, alone, "one device: rollout vs training")

    # FSDP2 at DP = 2 (the default group) and DP = 1 (a group of this rank alone), rlk applied after sharding
    dp2 = hf.apply(sharded(tiny_qwen3(), dist.group.WORLD), batch_invariant=True)
    assert type(dp2.lm_head.weight).__name__ == "DTensor"
    mine = [[rank], [2 + rank]]  # rank 0: sequences 0, 2; rank 1: 1, 3 (one sequence per micro-batch)
    lp, grads = train(dp2, embed, PROMPTS, responses, mine)
    together = [None] * n
    for r, (lps, gs) in enumerate(all_gather((lp, grads), dist.group.WORLD)):
        for j, i in enumerate([r, 2 + r]):
            together[i] = (lps[j], gs[j])
    assert_all_equal([t[0] for t in together], alone, "FSDP2 DP=2 vs one device")
    assert_all_equal([t[0] for t in together], rollout, "FSDP2 DP=2 training vs TP=1 rollout")
    assert_all_equal([t[1] for t in together], alone_grads, "FSDP2 DP=2 input gradients")
    # the rollout run on the sharded model (FSDP2 keeps the root's parameters gathered after a forward)
    assert_all_equal(rollout_scores(dp2, PROMPTS, responses), rollout, "rollout on the FSDP2 model")
    # resharded, the head's weight is a DTensor: logprobs_from_hidden gathers it for no-grad scoring
    dp2.reshard()
    assert type(dp2.lm_head.weight).__name__ == "DTensor"
    hidden, tokens = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([4, 50, 95])
    with torch.no_grad():
        assert torch.equal(
            hf.logprobs_from_hidden(dp2, hidden, tokens), hf.logprobs_from_hidden(reference, hidden, tokens)
        )
    with pytest.raises(ValueError, match="FSDP2 DTensor outside the model's forward"):
        hf.logprobs_from_hidden(dp2, hidden.requires_grad_(), tokens)
    # the same ranks, each scoring its two sequences in one packed row
    lp, grads = train(dp2, embed, PROMPTS, responses, [[rank, 2 + rank]])
    assert_all_equal(lp, [alone[rank], alone[2 + rank]], "FSDP2 DP=2, two sequences a micro-batch")
    assert_all_equal(grads, [alone_grads[rank], alone_grads[2 + rank]], "FSDP2 DP=2 input gradients, packed")

    alone_group = dist.new_group([0]), dist.new_group([1])  # every rank creates every group
    dp1 = hf.apply(sharded(tiny_qwen3(), alone_group[rank]), batch_invariant=True)
    for split in ([[0, 1, 2, 3]], [[3, 1], [0, 2]]):
        lp, grads = train(dp1, embed, PROMPTS, responses, split)
        assert_all_equal(lp, alone, f"FSDP2 DP=1, micro-batches {split}")
        assert_all_equal(grads, alone_grads, f"FSDP2 DP=1 input gradients, micro-batches {split}")

    # rlk.app.consistency's logits path (log_softmax of the logits) on the sharded model: its rollout's bits
    hf.unapply(dp2)
    with rlk.batch_invariant():
        hf.patch_model(dp2)
        lp, _ = train(dp2, embed, PROMPTS, responses, [[rank, 2 + rank]], rlk_on=False, backward=False)
        hf.unpatch_model(dp2)
    assert_all_equal(lp, [rolled.logprobs[rank], rolled.logprobs[2 + rank]], "FSDP2 logits path vs its rollout")

    # negative control: stock kernels, the same tokens, the rollout's decode vs FSDP2's packed training
    stock, _ = train(dp2, embed, PROMPTS, responses, [[rank, 2 + rank]], rlk_on=False, backward=False)
    stock_mine = [stock_rollout[rank], stock_rollout[2 + rank]]
    differs = [not torch.equal(a, b) for a, b in zip(stock, stock_mine)]
    assert any(all_gather(any(differs), dist.group.WORLD)), "stock rollout and FSDP2 training agree: no control"


@pytest.mark.triton_interpreter
def test_fsdp2_logprobs_and_input_gradients_match_one_device_and_the_rollout():
    testing.run_ranks(_logprob_worker, 2)


# ---------------------------------------------------------------------------
# parameter gradients after the reduce-scatter, across DP degrees
# ---------------------------------------------------------------------------


def _full_grads(model) -> list[torch.Tensor]:
    """The parameters' gradient sums: FSDP2 averages over the ranks (on gloo each rank's gradient is divided by the
    degree before the sum); multiplied back (a power of two: exact)."""
    degree = next(model.parameters()).device_mesh.size()
    grads = [p.grad.full_tensor() * degree for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters())) - 1  # all but the embedding (the inputs are embeddings)
    return grads


def _coef(targets):
    """Per-token loss weights, a function of the targets only (the same for a token on any rank)."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(VOCAB, generator=g)
    return torch.where(targets == -100, 0.0, table[targets.clamp(min=0)])


def _tree_step(model, embed, responses, micro_batches, tree):
    """Each micro-batch's gradients, FSDP2's gradient sync and resharding off, into ``tree`` (global indices)."""
    from torch.distributed.fsdp import FSDPModule

    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    for index, mb in micro_batches:
        train(model, embed, PROMPTS, responses, [mb], coef=_coef)
        params = list(model.parameters())  # unsharded while resharding is off: plain tensors with their .grad
        tree.add(index, [p.grad for p in params])
        for p in params:
            p.grad = None
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    for module in model.modules():  # reshard() acts on one module's parameter group
        if isinstance(module, FSDPModule):
            module.reshard()
    return tree.reduce()


def _gradient_worker(rank: int, world: int) -> None:
    responses = [[11, 40, 2], [63, 5], [7, 7, 90, 31], [48, 3, 22]]
    embed = tiny_qwen3().get_input_embeddings().weight.detach().clone()
    groups = dist.new_group([0]), dist.new_group([1])
    dp1 = sharded(tiny_qwen3(), groups[rank])
    dp2 = sharded(tiny_qwen3(), dist.group.WORLD)
    for m in (dp1, dp2):
        hf.apply(m)

    # one micro-batch per rank: FSDP2's reduce-scatter adds two gradients, DP = 1 accumulates the same two
    train(dp1, embed, PROMPTS, responses, [[0], [1]], coef=_coef)
    train(dp2, embed, PROMPTS, responses, [[rank]], coef=_coef)
    for a, b in zip(_full_grads(dp2), _full_grads(dp1)):
        assert torch.equal(a, b), "FSDP2 DP=2 (one micro-batch a rank) vs DP=1 (two accumulated)"
    for m in (dp1, dp2):
        m.zero_grad(set_to_none=True)

    # two micro-batches per rank: FSDP2 accumulates ((g0 + g1) + (g2 + g3)), DP = 1 (((g0 + g1) + g2) + g3)
    train(dp1, embed, PROMPTS, responses, [[0], [1], [2], [3]], coef=_coef)
    train(dp2, embed, PROMPTS, responses, [[2 * rank], [2 * rank + 1]], coef=_coef)
    native1, native2 = _full_grads(dp1), _full_grads(dp2)
    assert any(not torch.equal(a, b) for a, b in zip(native1, native2)), "no control: accumulation orders agree"
    for m in (dp1, dp2):
        m.zero_grad(set_to_none=True)

    # GradientTree over the global micro-batch index: DP = 1 and DP = 2 (and another assignment) the same bits
    tree1 = _tree_step(dp1, embed, responses, list(enumerate([[0], [1], [2], [3]])), GradientTree(4, groups[rank]))
    blocks = [(2 * rank, [2 * rank]), (2 * rank + 1, [2 * rank + 1])]  # rank 0: micro-batches 0, 1; rank 1: 2, 3
    tree2 = _tree_step(dp2, embed, responses, blocks, GradientTree(4))
    mixed = _tree_step(dp2, embed, responses, [(rank, [rank]), (3 - rank, [3 - rank])], GradientTree(4))
    assert tree1[0] is None and all(g is not None for g in tree1[1:])  # the embedding, then every other parameter
    for a, b, c in zip(tree1[1:], tree2[1:], mixed[1:]):
        assert torch.equal(a, b) and torch.equal(a, c), "GradientTree: DP=1 vs DP=2"
    # each sharded parameter takes its shard of the sums (docs/fsdp2.md's recipe), ready for the optimizer
    from torch.distributed.tensor import distribute_tensor

    params = list(dp2.parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)  # resharded
    for p, g in zip(params[1:], tree2[1:]):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
    for p, g in zip(params[1:], tree1[1:]):
        assert torch.equal(p.grad.full_tensor(), g)


def test_fsdp2_gradients_across_dp_degrees():
    testing.run_ranks(_gradient_worker, 2)
