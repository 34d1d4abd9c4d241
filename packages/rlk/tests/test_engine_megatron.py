"""rlk inside megatron-core (``rlk.integrations.megatron``): a ``GPTModel`` built on rlk's layer specs.

* The weight converter: Hugging Face Qwen3 / Llama -> Megatron shards at TP = 1, 2, 4 -> back, equal SHA-256 checksums.
* gloo processes on the CPU, Triton kernels under the interpreter, fp32: the GPTModel's log-probs, entropies and
  policy loss at TP = 1 and TP = 2 (batched and packed) are bitwise those of the Hugging Face path
  (``rlk.integrations.hf.apply(batch_invariant=True)``) with the same weights, hence bitwise equal across TP
  degrees; the negative control, megatron-core's stock ``RowParallelLinear`` at TP = 2 (rlk's aten overrides on),
  differs. Every gradient at TP = 2 equals TP = 1 (Qwen3's q / k norm weights excepted: each rank's covers its
  heads, megatron sums them later).
* Cross-configuration: the rollout side at TP = 1 (the Hugging Face path, the whole batch at once) and training on
  Megatron at TP = 2 x DP = 2 (each data-parallel rank scoring its half of the batch): bitwise log-probs.

Environment: ``ci/install_megatron_env.sh`` (megatron-core 0.16.1 on the CPU torch); megatron-core runs here with no
CPU shim (rlk's attention applies the rotary embedding and builds no mask; weights are loaded, not initialized).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings

import pytest
import torch.distributed as dist

import rlk
from rlk.distributed import testing
from rlk.reference import matmul as ref_matmul

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 128, 128, 2, 8, 4, 16, 256
SEQ, N_SEQS = 8, 4
THETA = 10000.0


def hf_model(kind: str = "qwen3", seed: int = 0):
    """A tiny random transformers causal LM (fp32, eval mode, eager)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_theta=THETA,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
    cls["llama"] = (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    config_cls, model_cls = cls[kind]
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1 so that a wrong mapping of their weights shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def megatron_config(tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=MLP,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (N_SEQS, SEQ), generator=g)
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    return ids, targets


def _small() -> None:
    """Tree segments of >= 8 so that K = 128 and 256 split into 8 segments (TP = 2 cuts subtrees)."""
    from rlk_triton import matmul as tk_matmul

    rlk.set_tensor_parallel_invariant(True)
    ref_matmul.MIN_LEAF = 8
    tk_matmul.MIN_LEAF = 8


def hf_logprobs(model, ids, targets):
    """The rollout side: the Hugging Face path with rlk (batch-invariant, fused head), no fallback allowed."""
    from rlk.integrations.hf import apply

    apply(model, return_entropy=True, batch_invariant=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")
        out = model(ids, logprob_targets=targets)
    return out.logprobs, out.entropy


def build_megatron(kind: str, hf, tp: int, rank: int, *, stock_row_parallel: bool = False):
    from megatron.core.tensor_parallel import RowParallelLinear as StockRow

    from rlk.integrations import megatron as rm

    config = megatron_config(tp)
    model = rm.gpt_model(
        config, vocab_size=VOCAB, max_sequence_length=64, rope_theta=THETA, qk_layernorm=kind == "qwen3"
    )
    if stock_row_parallel:  # the negative control: megatron-core's own row-parallel layers (K split + all-reduce)
        spec = rm.block_spec(config, rope_theta=THETA, qk_layernorm=kind == "qwen3")
        layer = spec.layer_specs[0].submodules
        layer.self_attention.submodules.linear_proj = StockRow
        layer.mlp.submodules.linear_fc2 = StockRow
        from megatron.core.models.gpt import GPTModel

        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=64,
            position_embedding_type="none",
        )
    layout = rm.Layout.from_hf_config(hf.config)
    model.load_state_dict(rm.hf_to_megatron(hf.state_dict(), layout, tp_size=tp, tp_rank=rank), strict=True)
    return model.eval()


def _thd():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.arange(0, (N_SEQS + 1) * SEQ, SEQ, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ, max_seqlen_kv=SEQ)


def _tp_worker(rank: int, world: int, kind: str) -> None:
    from megatron.core import parallel_state

    from rlk.integrations import megatron as rm

    _small()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        with rlk.use_backend("triton"):
            hf = hf_model(kind)
            ids, targets = batch()
            model = build_megatron(kind, hf, world, rank)
            with torch.no_grad():
                lp, ent = rm.logprobs(model, ids, targets, return_entropy=True)
            want_lp, want_ent = hf_logprobs(hf, ids, targets)
            assert torch.equal(lp, want_lp), f"{kind} TP={world}: log-probs vs the HF path"
            assert torch.equal(ent, want_ent), f"{kind} TP={world}: entropies vs the HF path"
            g = torch.Generator().manual_seed(2)
            old, adv = want_lp + 0.01 * torch.randn(want_lp.shape, generator=g), torch.randn(want_lp.shape, generator=g)
            with torch.no_grad():
                loss, _ = rm.policy_loss(model, ids, targets, old, adv)
            assert torch.equal(loss, rlk.policy_loss(want_lp, old, adv, targets != -100)[0]), "policy loss"
            with torch.no_grad():  # the same sequences packed in one row (qkv_format="thd")
                packed = rm.logprobs(model, ids.reshape(1, -1), targets.reshape(1, -1), packed_seq_params=_thd())
            assert torch.equal(packed.view(N_SEQS, SEQ), want_lp), f"{kind} TP={world}: packed log-probs"
            if world > 1:
                stock = build_megatron(kind, hf, world, rank, stock_row_parallel=True)
                with torch.no_grad(), rlk.batch_invariant():
                    stock_lp = rm.logprobs(stock, ids, targets)
                diff = float((stock_lp - want_lp).abs().max())
                print(f"stock RowParallelLinear at TP={world}: max |delta log-prob| {diff:.3g}")
                assert not torch.equal(stock_lp, want_lp), "megatron's stock RowParallelLinear should differ"
                assert diff < 1e-4  # the control is not broken: a reduction order, not a bug
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("world", [1, 2])
def test_gpt_model_logprobs_equal_the_hf_path_at_tp(world, kind):
    testing.run_ranks(_tp_worker, world, kind)


_HEAD_NORMS = ("q_layernorm.weight", "k_layernorm.weight")


def _grad_worker(rank: int, world: int, kind: str, out: str) -> None:
    """Forward + backward of a weighted sum of log-probs and entropies; every rank's gradients in HF names."""
    from megatron.core import parallel_state

    from rlk.integrations import megatron as rm

    _small()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        with rlk.use_backend("triton"):
            hf = hf_model(kind)
            ids, targets = batch(3)
            model = build_megatron(kind, hf, world, rank)
            lp, ent = rm.logprobs(model, ids, targets, return_entropy=True)
            up = torch.randn(2, *lp.shape, generator=torch.Generator().manual_seed(4))
            ((lp * up[0]).sum() + (ent * up[1]).sum()).backward()
            # q / k norm weights: each rank's gradient covers its heads (megatron's finalize_model_grads sums them)
            grads = {name: p.grad for name, p in model.named_parameters() if not name.endswith(_HEAD_NORMS)}
            per_rank: list = [None] * world
            dist.all_gather_object(per_rank, grads)
            if rank == 0:
                layout = rm.Layout.from_hf_config(hf.config)
                torch.save((lp.detach(), rm.megatron_to_hf(per_rank, layout)), out)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gpt_model_gradients_equal_across_tp_degrees(kind, tmp_path):
    """Every parameter's gradient at TP = 2 (shards joined; replicated weights checked equal on both ranks) equals
    TP = 1 bitwise; Qwen3's q / k norm weights left out (each rank's gradient covers its heads only)."""
    runs = {}
    for world in (1, 2):
        testing.run_ranks(_grad_worker, world, kind, str(tmp_path / f"tp{world}.pt"))
        runs[world] = torch.load(tmp_path / f"tp{world}.pt")
    assert torch.equal(runs[1][0], runs[2][0])
    one, two = runs[1][1], runs[2][1]
    assert one.keys() == two.keys() and len(one) > 10
    differ = {n: float((one[n] - two[n]).abs().max()) for n in one if not torch.equal(one[n], two[n])}
    assert not differ, f"gradients at TP = 2 vs TP = 1: {differ}"


def _cross_worker(rank: int, world: int) -> None:
    from megatron.core import parallel_state

    from rlk.integrations import megatron as rm

    _small()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        assert dp_size == 2
        with rlk.use_backend("triton"):
            hf = hf_model("qwen3")
            ids, targets = batch(7)
            model = build_megatron("qwen3", hf, 2, tp_rank)
            mine = slice(dp * N_SEQS // 2, (dp + 1) * N_SEQS // 2)
            with torch.no_grad():
                lp = rm.logprobs(model, ids[mine], targets[mine])
            parts: list = [None] * world
            dist.all_gather_object(parts, (dp, tp_rank, lp))
            train = torch.cat([p[2] for p in sorted(parts, key=lambda p: p[:2]) if p[1] == 0])
            rollout, _ = hf_logprobs(hf, ids, targets)  # TP = 1, the whole batch in one forward
            assert torch.equal(train, rollout), "rollout HF TP=1 vs training Megatron TP=2 x DP=2"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.triton_interpreter
def test_rollout_tp1_equals_training_megatron_tp2_dp2():
    testing.run_ranks(_cross_worker, 4)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_weight_converter_round_trip_checksums(kind):
    from rlk.integrations import megatron as rm

    hf = hf_model(kind)
    state = hf.state_dict()
    layout = rm.Layout.from_hf_config(hf.config)
    want = rm.checksum(state)
    for tp in (1, 2, 4):
        shards = [rm.hf_to_megatron(state, layout, tp_size=tp, tp_rank=r) for r in range(tp)]
        assert rm.checksum(rm.megatron_to_hf(shards, layout)) == want, f"{kind}: round trip at TP={tp}"
    one = rm.hf_to_megatron(state, layout)
    two = [rm.hf_to_megatron(state, layout, tp_size=2, tp_rank=r) for r in range(2)]
    # the fused layouts: rank r's qkv rows are query groups [2r, 2r + 2) of the TP = 1 fused weight
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([s[qkv] for s in two]), one[qkv])
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(torch.cat([s[fc1] for s in two]), one[fc1])  # [gate_r; up_r] per rank, not a chunk
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(one[qkv][: 2 * HEAD_DIM], q[: 2 * HEAD_DIM])  # group 0 starts with its 2 query heads
    bad = dict(state)
    bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][0, 0] += 1
    assert rm.checksum(bad) != want
