"""rlk inside DeepSpeed ZeRO-3: a tiny Qwen3 partitioned over 2 gloo ranks on the CPU (``DS_ACCELERATOR=cpu``, Triton
kernels under the interpreter, fp32), ``rlk.integrations.hf.apply(model, batch_invariant=True)`` on the engine's module.
Runs in the environment ``ci/install_deepspeed_env.sh`` builds (deselected where deepspeed cannot be imported).

* Log-probs and per-sequence input gradients at DP = 2 (each rank its micro-batches, through ``engine(...)`` and
  ``engine.backward``) bitwise equal to the unpartitioned model scoring each sequence alone and to the HF rollout path
  (the cross-configuration check: rollout TP = 1, training ZeRO-3 DP = 2).
* The head read outside its module's forward (TRL's ``maybe_gather_lm_head_ctx`` case): the rollout scored on the
  ZeRO-3 model with ``logprobs_from_hidden`` gathers the partitioned weight and gives the same bits; with gradients
  on it is refused.
* ``rlk.integrations.trl``'s log-prob path (``RLKGRPOTrainer._get_per_token_logps_and_entropies``) on the ZeRO-3
  model: TRL's layout (left-padded prompts, right-padded completions, ``logits_to_keep``), the one-device bits (the
  rollout's for the unpadded prompt: TRL passes no position ids). ``group_logprobs`` on the ZeRO-3 model: the
  rollout's bits.
* Gradients after ZeRO-3's reduction: DP = 2 with one micro-batch per rank vs DP = 1 (one rank, a second run,
  ``gradient_accumulation_steps=2``) accumulating the two: bitwise (a sum of two is one tree; the 1/2 scalings are
  exact).
* Negative control: with stock kernels the rollout's log-probs and the ZeRO-3 training log-probs differ.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import types

import pytest
import torch.distributed as dist
from engine_support import PROMPTS, all_gather, assert_all_equal, packed, rollout_scores, tiny_qwen3, train

import rlk
import rlk.integrations.hf as hf
from rlk.distributed import testing

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.triton_interpreter,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

RESPONSES = [[11, 40, 2], [63, 5], [7, 7, 90, 31], [48, 3, 22]]


def zero3(model, rank: int, world: int, micro_batches: int = 1):
    """``deepspeed.initialize`` with ZeRO-3 (torch's Adam) on the already-initialized gloo group."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        # every parameter partitioned outside its module's forward, however small (the default keeps parameters
        # under 1e5 elements whole), and released right after use
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def _trl_logprobs(model, prompts, responses):
    """``RLKGRPOTrainer._get_per_token_logps_and_entropies`` on ``model``: TRL's batch (prompts left-padded, completions
    right-padded), ``logits_to_keep`` = the longest completion; returns per sequence its completion's log-probs."""
    import contextlib

    from rlk.integrations.trl import RLKGRPOTrainer

    n, width, k = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros((n, width + k), dtype=torch.int64)
    mask = torch.zeros((n, width + k), dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width - len(p) : width + len(r)] = torch.tensor(p + r)
        mask[i, width - len(p) : width + len(r)] = 1
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext))
    with torch.no_grad():
        lp, entropy, _ = RLKGRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, ids, mask, k, compute_entropy=True
        )
    assert entropy.shape == lp.shape
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


def _dp2_worker(rank: int, world: int, out_dir: str) -> None:
    n = len(PROMPTS)
    reference = tiny_qwen3()
    embed = reference.get_input_embeddings().weight.detach().clone()
    stock_rollout = rollout_scores(reference, PROMPTS, RESPONSES, rlk_on=False)
    hf.apply(reference, batch_invariant=True)
    alone, alone_grads = train(reference, embed, PROMPTS, RESPONSES, [[i] for i in range(n)])
    rollout = rollout_scores(reference, PROMPTS, RESPONSES)
    assert_all_equal(rollout, alone, "one device: rollout vs training")

    engine = zero3(tiny_qwen3(), rank, world)
    model = hf.apply(engine.module, batch_invariant=True)
    head = model.lm_head.weight
    assert head.ds_shape == (len(embed), 64) and head.numel() == 0  # partitioned outside the forward

    # training: each rank two micro-batches of one sequence, through the engine (forward, engine.backward); the
    # parameter gradients after ZeRO-3's reduction of the first (one micro-batch a rank), for the DP = 1 run
    lps, grads = {}, {}
    for k, i in enumerate((rank, 2 + rank)):
        lps[i], grads[i] = _engine_step(engine, embed, i)
        if k == 0:
            _save_full_grads(engine, out_dir, "dp2", rank)
    together = {}
    for part_lps, part_grads in all_gather((lps, grads), dist.group.WORLD):
        together.update({i: (part_lps[i], part_grads[i]) for i in part_lps})
    assert_all_equal([together[i][0] for i in range(n)], alone, "ZeRO-3 DP=2 vs one device")
    assert_all_equal([together[i][0] for i in range(n)], rollout, "ZeRO-3 DP=2 training vs TP=1 rollout")
    assert_all_equal([together[i][1] for i in range(n)], alone_grads, "ZeRO-3 DP=2 input gradients")

    # the head read outside its module's forward: logprobs_from_hidden gathers the partitioned weight
    assert_all_equal(rollout_scores(model, PROMPTS, RESPONSES), rollout, "rollout on the ZeRO-3 model")
    hidden, tokens = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([4, 50, 95])
    assert model.lm_head.weight.numel() == 0
    with torch.no_grad():
        gathered = hf.logprobs_from_hidden(model, hidden, tokens)
    assert torch.equal(gathered, hf.logprobs_from_hidden(reference, hidden, tokens))
    with pytest.raises(ValueError, match="partitioned DeepSpeed ZeRO-3 parameter"):
        hf.logprobs_from_hidden(model, hidden.requires_grad_(), tokens)
    assert model.lm_head.weight.numel() == 0  # partitioned again

    # rlk.integrations.trl's path on the ZeRO-3 model (every rank the whole batch: no collective is skipped) gives
    # the one-device bits. Like TRL's, it passes no position ids: a left-padded prompt's positions are shifted by
    # its padding, so only the prompt without padding (sequence 2, the longest) has the rollout's bits.
    trl = _trl_logprobs(model, PROMPTS, RESPONSES)
    assert_all_equal(trl, _trl_logprobs(reference, PROMPTS, RESPONSES), "TRL path: ZeRO-3 vs one device")
    assert max(map(len, PROMPTS)) == len(PROMPTS[2])
    assert torch.equal(trl[2], rollout[2]), "TRL path under ZeRO-3 vs the rollout, the unpadded prompt"

    # group_logprobs (the prompt computed once per group) reads the vocabulary size outside the forward (ds_shape)
    with torch.no_grad():
        groups = hf.group_logprobs(model, PROMPTS, [[r] for r in RESPONSES])
    assert_all_equal([g[0] for g in groups], rollout, "group_logprobs under ZeRO-3 vs the rollout")

    # negative control: stock kernels, the same tokens, the rollout's decode vs ZeRO-3's packed training
    hf.unapply(model)
    stock, _ = train(engine, embed, PROMPTS, RESPONSES, [[rank, 2 + rank]], rlk_on=False, backward=False)
    differs = [not torch.equal(a, b) for a, b in zip(stock, [stock_rollout[rank], stock_rollout[2 + rank]])]
    assert any(all_gather(any(differs), dist.group.WORLD)), "stock rollout and ZeRO-3 training agree: no control"


def _engine_step(engine, embed, i: int):
    """Sequence ``i`` as one micro-batch through the engine: forward with ``logprob_targets``, ``engine.backward`` of
    its summed response log-probs; returns the log-probs and the input gradient."""
    tokens, positions, targets, _ = packed(PROMPTS, RESPONSES, [i])
    x = embed[tokens][None].detach().requires_grad_(True)
    out = engine(inputs_embeds=x, position_ids=positions, logprob_targets=targets, use_cache=False)
    with rlk.batch_invariant():
        engine.backward(out.logprobs.sum())
    p, r = len(PROMPTS[i]), len(RESPONSES[i])
    return out.logprobs[0, p - 1 : p + r - 1].detach(), x.grad[0].clone()


def _save_full_grads(engine, out_dir: str, name: str, rank: int) -> None:
    from deepspeed.utils import safe_get_full_grad

    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, f"{name}.pt"))


def _dp1_worker(rank: int, world: int, out_dir: str) -> None:
    embed = tiny_qwen3().get_input_embeddings().weight.detach().clone()
    engine = zero3(tiny_qwen3(), rank, world, micro_batches=2)
    hf.apply(engine.module, batch_invariant=True)
    for i in (0, 1):
        _engine_step(engine, embed, i)
    _save_full_grads(engine, out_dir, "dp1", rank)


def test_zero3_logprobs_gradients_rollout_and_trl_path(tmp_path):
    testing.run_ranks(_dp2_worker, 2, str(tmp_path))
    testing.run_ranks(_dp1_worker, 1, str(tmp_path))
    dp2, dp1 = torch.load(tmp_path / "dp2.pt"), torch.load(tmp_path / "dp1.pt")
    assert len(dp2) == len(dp1) and all(g is not None for g in dp1 + dp2)
    assert not dp1[0].any()  # the embedding (the inputs are embeddings): zeros
    assert all(g.any() for g in dp1[1:])
    for a, b in zip(dp2, dp1):
        assert torch.equal(a, b), "ZeRO-3 gradients: DP=2 (one micro-batch a rank) vs DP=1 (two accumulated)"
