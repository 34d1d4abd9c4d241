"""The distributed chain test: a Qwen3-style decoder of rlk ops in Megatron's TP layout (rlk.distributed.decoder).

* TP = 2 and TP = 4 (gloo processes, Triton kernels under the CPU interpreter, fp32) against TP = 1: logits,
  log-probs, entropies and every parameter gradient bitwise; the negative control (each rank's rlk.linear
  partial added by ``torch.distributed.all_reduce``) differs.
* Cross-config: a rollout sampled at TP = 2 (sampling seeds and generator states checked equal on every rank
  first; the model has no dropout) and scored at TP = 2 has the log-probs of training at TP = 1 with DP = 2
  (each rank scoring half of the sequences), bitwise.
* Data parallelism: the gradient of a policy-loss step over 8 micro-batches summed with GradientTree is the
  same at DP = 1, 2 and 4 and for an uneven split of the micro-batches (normalizers from
  ``global_normalizers``); accumulating ``.grad`` and ``torch.distributed.all_reduce`` is not.
* Simulated ranks in one process (reference backend): TP = 2, 4 equal TP = 1 as well.
"""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist

import rlk
from rlk import distributed as rd
from rlk.distributed import decoder, testing
from rlk.reference import matmul as ref_matmul

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

#: 1 layer, 8 query / 4 kv heads of 16, hidden 128, MLP 256, vocabulary 128: every sharded dim splits into 8
#: tree segments of >= 8 (MIN_LEAF lowered to 8 below), so TP = 2 and 4 cut segments' subtrees. One layer has
#: every sharded op of the chain (column- and row-parallel linears, the sharded attention heads, the vocab-parallel
#: head) and its gradients reach the replicated embedding through the layer's input all-reduce: a second layer
#: doubled the cost (the slowest gate test) and reached no other code.
CONFIG = decoder.Config(vocab=128, hidden=128, layers=1, heads=8, kv_heads=4, head_dim=16, intermediate=256)
SEQ = 8  # tokens per sequence


@pytest.fixture(autouse=True)
def _tensor_parallel_order():
    """Every TP = 1 baseline and every simulated rank here sums K in the tensor-parallel tree."""
    with rlk.tensor_parallel_invariant():
        yield


def _small(backend: str) -> None:
    rlk.set_tensor_parallel_invariant(True)
    ref_matmul.MIN_LEAF = 8
    if backend == "triton":
        from rlk_triton import matmul as tk_matmul

        tk_matmul.MIN_LEAF = 8


def _packed(n_seqs: int):
    cu = torch.arange(0, (n_seqs + 1) * SEQ, SEQ, dtype=torch.int32)
    positions = torch.arange(SEQ).repeat(n_seqs)
    return cu, positions


def _batch(seed: int, n_seqs: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab, (n_seqs * SEQ,), generator=g)
    return ids, _targets(ids, n_seqs)


def _targets(ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    targets = ids.view(n_seqs, SEQ).roll(-1, dims=1).clone()
    targets[:, -1] = -100
    return targets.reshape(-1)


def _trainable(params):
    return {
        k: (
            [t.detach().clone().requires_grad_() for t in v]
            if isinstance(v, list)
            else v.detach().clone().requires_grad_()
        )
        for k, v in params.items()
    }


def _grads(params) -> dict[str, torch.Tensor]:
    return {k: (v[0].grad if isinstance(v, list) else v.grad) for k, v in params.items()}


def _loss(out, coef):
    return (out["logprob"] * coef[0]).sum() + (out["entropy"] * coef[1]).sum()


def _forward(params, ids, targets, n_seqs, mode, group=None, with_logits=True):
    cu, positions = _packed(n_seqs)
    return decoder.forward(
        CONFIG, params, ids, cu, SEQ, positions, targets, mode=mode, group=group, with_logits=with_logits
    )


def _gather_shards(grads: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """Every rank's shard gradients, unsharded (replicated ones checked equal on every rank)."""
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, grads)
    for name, dim in decoder.shard_dims(CONFIG).items():
        if dim is None:
            assert all(torch.equal(p[name], per_rank[0][name]) for p in per_rank), name
    return decoder.unshard(CONFIG, per_rank)


def _assert_equal(got: dict, truth: dict, what: str) -> None:
    for name in truth:
        assert torch.equal(got[name], truth[name]), f"{what}: {name}"


# ----------------------------------------------------------------------------------------------
# tensor parallelism on gloo ranks, Triton kernels
# ----------------------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int) -> None:
    _small("triton")
    params = decoder.init_params(CONFIG, torch.float32, "cpu", seed=0)
    coef = torch.randn(2, 4 * SEQ, generator=torch.Generator().manual_seed(5))
    with rlk.use_backend("triton"):
        if world == 2:
            ids, targets, rollout_logprob = _rollout(rank, world, params)
        else:
            ids, targets = _batch(1, 4)
        shards = _trainable(decoder.shard(CONFIG, params, world, [rank]))
        out = _forward(shards, ids, targets, 4, "tp")
        _loss(out, coef).backward()
        tp_grads = _gather_shards({k: g.detach() for k, g in _grads(shards).items()}, world)
        with torch.no_grad():
            stock = _forward(decoder.shard(CONFIG, params, world, [rank]), ids, targets, 4, "stock")
        if world == 2:  # training at TP = 1, DP = 2: each rank scores half of the rollout's sequences
            half = slice(rank * 2 * SEQ, (rank + 1) * 2 * SEQ)
            with torch.no_grad():
                train = _forward(params, ids[half], targets[half], 2, "single", with_logits=False)
            parts: list = [None] * world
            dist.all_gather_object(parts, train["logprob"])
            assert torch.equal(torch.cat(parts), rollout_logprob), "rollout TP=2 vs training TP=1 DP=2"
        truth = [None]
        if rank == 0:  # TP = 1 on the whole batch
            full = _trainable(params)
            single = _forward(full, ids, targets, 4, "single")
            _loss(single, coef).backward()
            truth = [
                (
                    {k: single[k].detach() for k in ("logits", "logprob", "entropy")},
                    {k: g.detach() for k, g in _grads(full).items()},
                )
            ]
        dist.broadcast_object_list(truth, src=0)
        single, single_grads = truth[0]
    _assert_equal({k: out[k].detach() for k in single}, single, f"TP={world} vs TP=1")
    _assert_equal(tp_grads, single_grads, f"TP={world} vs TP=1 gradients")
    assert not torch.equal(stock["logits"], single["logits"]), "the stock all_reduce control should differ"
    assert not torch.equal(stock["logprob"], single["logprob"])


def _rollout(rank: int, world: int, params):
    """Sample 2 tokens after 6-token prompts at TP = 2 (logits gathered), plus 2 given sequences; score at TP = 2.

    Preconditions checked before any comparison: the model has no dropout, and every rank holds the same
    sampling generator state before each draw and draws the same tokens."""
    assert CONFIG.dropout == 0.0
    prompts, given = _batch(2, 2)[0].view(2, SEQ)[:, :6], _batch(3, 2)[0]
    sampler = torch.Generator().manual_seed(1234)
    seqs = prompts.clone()
    shards = decoder.shard(CONFIG, params, world, [rank])
    with torch.no_grad():
        for _ in range(2):
            n = seqs.shape[1]
            cu = torch.arange(0, 3 * n, n, dtype=torch.int32)
            logits = decoder.forward(
                CONFIG, shards, seqs.reshape(-1), cu, n, torch.arange(n).repeat(2), mode="tp", with_logits=True
            )["logits"]
            probs = torch.softmax(logits.view(2, n, -1)[:, -1], dim=-1)
            states: list = [None] * world
            dist.all_gather_object(states, sampler.get_state())
            assert all(torch.equal(s, states[0]) for s in states), "sampling generators differ across ranks"
            token = torch.multinomial(probs, 1, generator=sampler)
            tokens: list = [None] * world
            dist.all_gather_object(tokens, token)
            assert all(torch.equal(t, tokens[0]) for t in tokens), "sampled tokens differ across ranks"
            seqs = torch.cat([seqs, token], dim=1)
        ids = torch.cat([seqs.reshape(-1), given])
        targets = _targets(ids, 4)
        rollout = _forward(shards, ids, targets, 4, "tp", with_logits=False)["logprob"]
    return ids, targets, rollout


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_chain_on_gloo_ranks(world):
    testing.run_ranks(_tp_worker, world)


# ----------------------------------------------------------------------------------------------
# data parallelism: the gradient tree over the global micro-batch index (reference backend)
# ----------------------------------------------------------------------------------------------

N_MICRO = 8


def _micro_batch(i: int):
    ids, targets = _batch(100 + i, 1)
    g = torch.Generator().manual_seed(200 + i)
    mask = (targets != -100).view(1, SEQ) & (torch.rand(1, SEQ, generator=g) > 0.2)
    return ids, targets, mask, torch.randn(1, SEQ, generator=g), torch.randn(1, 1, generator=g)


def _micro_grads(params, i: int, norms):
    """``d loss_i / d params`` of micro-batch ``i``: PPO on its log-probs, token-mean over the step's tokens."""
    ids, targets, mask, old_noise, adv = _micro_batch(i)
    out = _forward(params, ids, targets, 1, "single", with_logits=False)
    lp = out["logprob"].view(1, SEQ)
    loss, _ = rlk.policy_loss(
        lp,
        lp.detach() + 0.05 * old_noise,
        adv,
        mask,
        loss="ppo",
        agg="token-mean",
        global_tokens=norms["global_tokens"],
    )
    return list(torch.autograd.grad(loss, list(params.values())))


def _dp_step(params, indices, group):
    masks = [_micro_batch(i)[2] for i in indices]
    norms = rd.global_normalizers(masks, group=group)
    tree = rd.GradientTree(N_MICRO, group)
    for i in reversed(indices):  # any order
        tree.add(i, _micro_grads(params, i, norms))
    return tree.reduce(), norms


def _dp_worker(rank: int, world: int) -> None:
    _small("reference")
    params = _trainable(decoder.init_params(CONFIG, torch.float32, "cpu", seed=0))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with rlk.use_backend("reference"):
        dp4, norms4 = _dp_step(params, [2 * rank, 2 * rank + 1], None)
        dp2, norms2 = _dp_step(params, list(range(4 * (rank % 2), 4 * (rank % 2) + 4)), pairs[rank // 2])
        bounds = [0, 1, 4, 6, 8]
        uneven, _ = _dp_step(params, list(range(bounds[rank], bounds[rank + 1])), None)
        # the stock way: autograd accumulates .grad in micro-batch order, then torch.distributed.all_reduce
        stock = None
        for i in (2 * rank, 2 * rank + 1):
            g = _micro_grads(params, i, norms4)
            stock = g if stock is None else [a + b for a, b in zip(stock, g)]
        for g in stock:
            dist.all_reduce(g)
        truth = [None]
        if rank == 0:
            dp1, norms1 = _dp_step(params, list(range(N_MICRO)), dist.new_group([0]))
            truth = [(dp1, norms1)]
        else:
            dist.new_group([0])  # every rank takes part in creating a group
        dist.broadcast_object_list(truth, src=0)
    dp1, norms1 = truth[0]
    for norms in (norms2, norms4):
        assert torch.equal(norms["global_tokens"], norms1["global_tokens"])
    for name, a, b, c, d in zip(params, dp1, dp2, dp4, uneven):
        assert torch.equal(b, a), f"DP=2 vs DP=1: {name}"
        assert torch.equal(c, a), f"DP=4 vs DP=1: {name}"
        assert torch.equal(d, a), f"uneven split vs DP=1: {name}"
    assert any(not torch.equal(s, a) for a, s in zip(dp1, stock)), "the stock accumulation should differ"


@pytest.mark.triton_interpreter
def test_data_parallel_gradient_tree_on_gloo_ranks():
    """DP = 1, 2, 4 and an uneven split on 4 gloo ranks (reference backend: deterministic micro-batches)."""
    testing.run_ranks(_dp_worker, 4)


# ----------------------------------------------------------------------------------------------
# simulated ranks, in this process
# ----------------------------------------------------------------------------------------------


def test_tensor_parallel_chain_simulated(monkeypatch):
    monkeypatch.setattr(ref_matmul, "MIN_LEAF", 8)
    params = decoder.init_params(CONFIG, torch.float32, "cpu", seed=0)
    ids, targets = _batch(1, 4)
    coef = torch.randn(2, 4 * SEQ, generator=torch.Generator().manual_seed(5))
    with rlk.use_backend("reference"):
        full = _trainable(params)
        single = _forward(full, ids, targets, 4, "single")
        _loss(single, coef).backward()
        for world in (2, 4):
            shards = _trainable(decoder.shard(CONFIG, params, world, list(range(world))))
            out = _forward(shards, ids, targets, 4, "tp", group=rd.SimulatedGroup(world))
            _loss(out, coef).backward()
            for k in ("logits", "logprob", "entropy"):
                assert torch.equal(out[k], single[k]), (world, k)
            per_rank = [
                {k: (v[r].grad if isinstance(v, list) else v.grad) for k, v in shards.items()} for r in range(world)
            ]
            _assert_equal(decoder.unshard(CONFIG, per_rank), _grads(full), f"simulated TP={world}")


def test_drift_report_in_the_consistency_schema(monkeypatch, tmp_path):
    """rlk.distributed.drift builds a report the consistency tool's writers render: rollout at TP = 2 vs training at
    TP = 1 / DP = 2, rlk's combine ('on', bitwise) vs the stock one ('off', drifting), the configurations recorded."""
    from rlk.app.consistency import report as rep
    from rlk.distributed import drift

    monkeypatch.setattr(ref_matmul, "MIN_LEAF", 8)
    params = decoder.init_params(CONFIG, torch.float32, "cpu", seed=0)
    ids, targets = _batch(1, 4)
    coef = torch.randn(2, 4 * SEQ, generator=torch.Generator().manual_seed(5))
    runs = {}
    with rlk.use_backend("reference"):
        for name, mode, world in (("single", "single", 1), ("on", "tp", 2), ("off", "stock", 2)):
            p = _trainable(params if mode == "single" else decoder.shard(CONFIG, params, world, [0, 1]))
            trace: list = []
            cu, positions = _packed(4)
            out = decoder.forward(
                CONFIG,
                p,
                ids,
                cu,
                SEQ,
                positions,
                targets,
                mode=mode,
                group=None if mode == "single" else rd.SimulatedGroup(world),
                trace=trace,
            )
            _loss(out, coef).backward()
            grads = (
                {k: v.grad for k, v in p.items()}
                if mode == "single"
                else decoder.unshard(
                    CONFIG, [{k: (v[r].grad if isinstance(v, list) else v.grad) for k, v in p.items()} for r in (0, 1)]
                )
            )
            runs[name] = (list(out["logprob"].detach().view(4, SEQ)), grads, trace)
        halves = [
            _forward(
                params,
                ids[r * 2 * SEQ : (r + 1) * 2 * SEQ],
                targets[r * 2 * SEQ : (r + 1) * 2 * SEQ],
                2,
                "single",
                with_logits=False,
            )["logprob"].detach()
            for r in (0, 1)
        ]
    training = list(torch.cat(halves).view(4, SEQ))
    single_lp, single_grads, single_trace = runs["single"]
    chains = {
        k: drift.chain_entry(runs[k][0], training, single_lp, runs[k][1], single_grads, runs[k][2], single_trace)
        for k in ("on", "off")
    }
    parallel = {
        "rollout": {"name": "TP=2", "tp": 2},
        "training_a": {"name": "TP=1 DP=2", "tp": 1, "dp": 2},
        "training_b": {"name": "TP=1 DP=1", "tp": 1, "dp": 1},
    }
    report = drift.parallel_report(
        model="tiny",
        config=CONFIG,
        device=torch.device("cpu"),
        dtype=torch.float32,
        parallel=parallel,
        chains=chains,
        seeds={"weights": 0, "prompts": 1, "sampling": 0},
        lengths=[SEQ] * 4,
        histograms={k: drift.histogram(runs[k][0], training) for k in ("on", "off")},
        notes=[],
        seconds=0.0,
    )
    assert report["passed"], report["failed"]
    assert chains["on"]["rollout_vs_training"]["bitwise"] and chains["on"]["gradients"]["bitwise"]
    assert chains["on"]["probe"]["first_divergent"] is None
    assert chains["off"]["rollout_vs_training"]["max_abs"] > 0
    assert chains["off"]["probe"]["first_divergent"] == [0, "attention"]
    assert "TP=2" in rep.format_table(report)
    files = rep.write_all(report, str(tmp_path))
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["parallel"]["rollout"]["tp"] == 2 and written["schema"] == 1 and files["html"]


@pytest.mark.gpu
def test_tensor_parallel_chain_simulated_gpu():
    """bf16 on the GPU (Triton), default tiles and K segments of >= 128: hidden 1024, 16 / 8 heads of 128, MLP 2816
    (8 x 352), V = 32000: simulated TP = 2, 4, 8 give the TP = 1 bits, logits and every gradient."""
    config = decoder.Config(vocab=32000, hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, intermediate=2816)
    device = torch.device("cuda")
    params = decoder.init_params(config, torch.bfloat16, device, seed=0)
    g = torch.Generator().manual_seed(1)
    n_seqs, seq = 4, 128
    ids = torch.randint(0, config.vocab, (n_seqs * seq,), generator=g).to(device)
    targets = ids.view(n_seqs, seq).roll(-1, dims=1).clone()
    targets[:, -1] = -100
    targets = targets.reshape(-1)
    cu = torch.arange(0, (n_seqs + 1) * seq, seq, dtype=torch.int32, device=device)
    positions = torch.arange(seq, device=device).repeat(n_seqs)
    coef = torch.randn(2, n_seqs * seq, generator=g).to(device)
    with rlk.use_backend("triton"):
        full = _trainable(params)
        single = decoder.forward(config, full, ids, cu, seq, positions, targets, mode="single", with_logits=True)
        _loss(single, coef).backward()
        for world in (2, 4, 8):
            shards = _trainable(decoder.shard(config, params, world, list(range(world))))
            out = decoder.forward(
                config,
                shards,
                ids,
                cu,
                seq,
                positions,
                targets,
                mode="tp",
                group=rd.SimulatedGroup(world),
                with_logits=True,
            )
            _loss(out, coef).backward()
            for k in ("logits", "logprob", "entropy"):
                assert torch.equal(out[k], single[k]), (world, k)
            per_rank = [
                {k: (v[r].grad if isinstance(v, list) else v.grad) for k, v in shards.items()} for r in range(world)
            ]
            got = decoder.unshard(config, per_rank)
            for name, grad in {k: v.grad for k, v in full.items()}.items():
                assert torch.equal(got[name], grad), (world, name)
