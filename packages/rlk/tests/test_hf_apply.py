"""``rlk.integrations.hf.apply`` / ``unapply`` on tiny random transformers models (llama, qwen2, qwen3, mistral,
gemma, gemma3, a tied-embedding qwen2).

Ground truth is the stock model itself: ``log_softmax(stock_logits / T)`` gathered at the targets in float64
(``test_logprob._truth``), under the numerical contract for fp32 models, and to rounding for float64 models;
parameter gradients against the stock path of a float64 copy. TRL's own fused head (``trl.trainer.utils
.add_fused_lm_head``) checks the target convention's mapping. The batch-invariant case runs the triton kernels
(``TRITON_INTERPRET=1`` on the CPU) and compares with ``torch.equal``.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_batch_invariant import padded_batch
from test_logprob import _check, _truth

from rlk.core import contract, dispatch
from rlk.integrations.batch_invariant import batch_invariant, disable_batch_invariant, is_batch_invariant_enabled
from rlk.integrations.hf import apply, unapply

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
routed = pytest.mark.triton_interpreter if DEVICE.type == "cpu" else pytest.mark.gpu

pytestmark = [  # the triton interpreter's numpy arithmetic on masked lanes
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

KINDS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "qwen2-tied"]
VOCAB = 131  # not a multiple of any tile


def _transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def tiny_model(kind: str, dtype=torch.float32, hidden=32, layers=2, heads=4, kv_heads=2, vocab=VOCAB, **extra):
    """A random ``kind`` causal LM; the head (or the tied embedding) is drawn with std 0.6 so that the
    next-token distributions are far from uniform."""
    transformers = _transformers()
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    }
    config_cls, model_cls = classes[kind.removesuffix("-tied")]
    extra.setdefault("tie_word_embeddings", kind.endswith("-tied") or kind.startswith("gemma"))
    extra.setdefault("attn_implementation", "eager" if kind == "gemma2" else "sdpa")
    config = config_cls(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.6)
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model.to(device=DEVICE, dtype=dtype).eval()


def next_token_targets(ids, mask, prompt: int = 0, ignore_index: int = -100):
    """The aligned targets: ``targets[:, t] = ids[:, t + 1]``; ``ignore_index`` at the last position, where the
    next token is padding, and at the positions predicting prompt tokens (``t + 1 < prompt``)."""
    targets = F.pad(ids[:, 1:], (0, 1), value=ignore_index)
    valid = F.pad(mask[:, 1:], (0, 1), value=0).bool()
    valid[:, : max(prompt - 1, 0)] = False
    return targets.masked_fill(~valid, ignore_index)


def batch(seed=1, rows=2, seq=9, vocab=VOCAB):
    """Token ids, a right-padded attention mask (row 1 ends with 2 pads) and the aligned targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return ids, mask, next_token_targets(ids, mask, prompt=3)


def _within_contract(name, value, ref, ref_lp, lse) -> bool:
    """``value`` (fp32, a log-prob or entropy per position) against the fp64 ``ref`` under the fp32 contract."""
    e = contract.entry("linear_logprob", torch.float32)
    scale = contract.row_scale(ref_lp, lse).reshape(-1)
    return contract.compare_outputs(e, name, value.reshape(-1), ref.reshape(-1), scale).ok


@pytest.fixture(autouse=True)
def _mode_off_after_each_test():
    yield
    disable_batch_invariant()
    assert not is_batch_invariant_enabled()


# ---------------------------------------------------------------------------
# accuracy and gradients against the stock model
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_and_entropy_equal_the_stock_log_softmax(kind):
    ids, mask, targets = batch()
    temperature = 0.7
    for dtype in (torch.float32, torch.float64):
        model = tiny_model(kind, dtype)
        with torch.no_grad():
            stock = model(ids, attention_mask=mask).logits
        assert apply(model, temperature=temperature, return_entropy=True) is model
        out = model(ids, attention_mask=mask, logprob_targets=targets)
        assert out.logits is None and out.logprobs.shape == out.entropy.shape == targets.shape
        ignored = targets == -100
        assert torch.all(out.logprobs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
        if dtype == torch.float32:
            assert out.logprobs.dtype == out.entropy.dtype == torch.float32
            _check("linear_logprob", torch.float32, out.logprobs, out.entropy, stock, targets, temperature)
        else:  # the float64 model runs the fp64 reference: the stock log-probs to rounding
            ref_lp, ref_ent, _ = _truth(stock, targets, temperature)
            torch.testing.assert_close(out.logprobs, ref_lp, rtol=0, atol=1e-12)
            torch.testing.assert_close(out.entropy, ref_ent, rtol=0, atol=1e-12)


def _stock_loss(model, ids, mask, targets, temperature, entropy_coef):
    lp, ent, lse = _truth(model(ids, attention_mask=mask).logits, targets, temperature)
    return -lp.sum() - entropy_coef * ent.sum(), lp, lse


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_gradients_equal_the_stock_path(kind):
    """Every parameter's gradient of ``-(logprobs * mask).sum() - 0.1 * (entropy * mask).sum()``."""
    ids, mask, targets = batch()
    valid = targets != -100
    model, model64 = tiny_model(kind), tiny_model(kind, torch.float64)
    loss64, ref_lp, lse = _stock_loss(model64, ids, mask, targets, 1.3, 0.1)
    loss64.backward()
    apply(model, temperature=1.3, return_entropy=True)
    out = model(ids, attention_mask=mask, logprob_targets=targets)
    (-(out.logprobs * valid).sum() - 0.1 * (out.entropy * valid).sum()).backward()
    e = contract.entry("linear_logprob", torch.float32)
    scale = float(contract.row_scale(ref_lp.detach(), lse.detach())[valid].max())
    params64 = dict(model64.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{kind}: {name} got no gradient"
        dev = contract.compare_grad(e, name, p.grad, params64[name].grad, scale)
        assert dev.ok, f"{kind}: {dev}"
    # the fp64 path against the fp64 stock path: to rounding
    stock_grads = {name: p.grad.clone() for name, p in model64.named_parameters()}
    model64.zero_grad()
    apply(model64, temperature=1.3, return_entropy=True)
    out = model64(ids, attention_mask=mask, logprob_targets=targets)
    (-(out.logprobs * valid).sum() - 0.1 * (out.entropy * valid).sum()).backward()
    for name, p in model64.named_parameters():
        torch.testing.assert_close(p.grad, stock_grads[name], rtol=1e-9, atol=1e-12)


def test_temperature_scalar_per_call_and_per_sequence():
    model = tiny_model("llama")
    ids, mask, targets = batch()
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    apply(model, temperature=0.5, return_entropy=True)
    out = model(ids, attention_mask=mask, logprob_targets=targets)
    _check("linear_logprob", torch.float32, out.logprobs, out.entropy, stock, targets, 0.5)
    out = model(ids, attention_mask=mask, logprob_targets=targets, temperature=1.7)  # per-call override
    _check("linear_logprob", torch.float32, out.logprobs, out.entropy, stock, targets, 1.7)
    per_seq = torch.tensor([[0.6], [1.4]], device=DEVICE)
    out = model(ids, attention_mask=mask, logprob_targets=targets, temperature=per_seq)
    _check("linear_logprob", torch.float32, out.logprobs, out.entropy, stock, targets, per_seq)
    out = model(ids, attention_mask=mask, logprob_targets=targets, return_entropy=False)
    assert out.entropy is None
    apply(model, temperature=per_seq)  # other options: re-applied
    out = model(ids, attention_mask=mask, logprob_targets=targets)
    ref_lp, _, lse = _truth(stock, targets, per_seq)
    assert _within_contract("logprob", out.logprobs, ref_lp, ref_lp, lse) and out.entropy is None
    with pytest.raises(ValueError, match="temperature"):
        model(ids, logprob_targets=targets, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        apply(model, temperature=-1.0)


def test_ignore_index():
    model = tiny_model("qwen3")
    ids, mask, _ = batch()
    targets = next_token_targets(ids, mask, prompt=3, ignore_index=-1)
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    apply(model, ignore_index=-1, return_entropy=True)
    out = model(ids, attention_mask=mask, logprob_targets=targets)
    ignored = targets == -1
    assert ignored.any() and torch.all(out.logprobs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
    ref_lp, ref_ent, lse = _truth(stock, targets, 1.0, ignore_index=-1)
    assert _within_contract("logprob", out.logprobs, ref_lp, ref_lp, lse)
    assert _within_contract("entropy", out.entropy, ref_ent, ref_lp, lse)
    # an ignored row gives no gradient: a loss on the ignored rows only has zero gradient everywhere
    model.zero_grad()
    out.logprobs[ignored].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    with pytest.raises(ValueError, match=r"targets: values must lie in \[0, 131\) or equal ignore_index=-1"):
        model(ids, logprob_targets=targets.masked_fill(ignored, -100))


# ---------------------------------------------------------------------------
# the stock path, unapply, conventions
# ---------------------------------------------------------------------------


def test_stock_path_is_unchanged_and_unapply_restores_it():
    model = tiny_model("llama")
    ids, mask, targets = batch()
    signature = inspect.signature(model.forward)
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    apply(model)
    assert apply(model) is model and model.__dict__["forward"] is model.__dict__["forward"]  # idempotent
    forward = model.forward
    apply(model)
    assert model.forward == forward, "a second apply with the same options changed the model"
    assert inspect.signature(model.forward) == signature  # generate() and the Trainer inspect it
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, stock)
        model(ids, logprob_targets=targets)
        assert "forward" not in model.lm_head.__dict__  # the head's own forward again after a log-prob call
        assert torch.equal(model(ids, attention_mask=mask).logits, stock)
    clone = copy.deepcopy(model)  # e.g. a reference model: its forward runs the copy
    assert clone.forward.__self__ is clone
    with torch.no_grad():
        clone.get_output_embeddings().weight.mul_(2)
        assert not torch.equal(
            clone(ids, logprob_targets=targets).logprobs, model(ids, logprob_targets=targets).logprobs
        )
    with pytest.raises(TypeError, match="return_entropy: an option of the log-prob path"):
        model(ids, return_entropy=True)
    assert unapply(model) is model and unapply(model) is model
    assert "forward" not in model.__dict__ and not hasattr(model, "_rlk_apply")
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, stock)
    assert inspect.signature(model.forward) == signature


def test_an_earlier_instance_forward_is_kept_and_restored():
    """A forward set on the instance before apply (another wrapper) serves the stock path and comes back."""
    model = tiny_model("llama")
    ids, _, targets = batch()
    calls = []
    stock_forward = model.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return stock_forward(*args, **kwargs)

    model.forward = wrapper
    apply(model)
    with torch.no_grad():
        model(ids)
        model(ids, logprob_targets=targets)
    assert len(calls) == 2
    unapply(model)
    assert model.forward is wrapper


def test_logits_to_keep_and_target_shapes():
    model = tiny_model("qwen2")
    ids, mask, targets = batch()
    apply(model)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, logprob_targets=targets).logprobs
        kept = model(ids, attention_mask=mask, logprob_targets=targets[:, -4:], logits_to_keep=4).logprobs
        stock = model(ids, attention_mask=mask).logits
    assert kept.shape == (2, 4)
    ref_lp, _, lse = _truth(stock[:, -4:], targets[:, -4:], 1.0)
    assert _within_contract("logprob", kept, ref_lp, ref_lp, lse)
    assert _within_contract("logprob", full[:, -4:], ref_lp, ref_lp, lse)
    with pytest.raises(ValueError, match=r"logprob_targets: expected shape \(2, 4\).*logits_to_keep"):
        model(ids, logprob_targets=targets, logits_to_keep=4)
    with pytest.raises(TypeError, match="logprob_targets: expected a torch.Tensor"):
        model(ids, logprob_targets=targets.tolist())
    with pytest.raises(TypeError, match="targets: expected dtype int32 or int64"):
        model(ids, logprob_targets=targets.float())
    with pytest.raises(ValueError, match="labels: not with logprob_targets"):
        model(ids, labels=ids, logprob_targets=targets)
    with pytest.raises(ValueError, match="return_dict: must not be False"):
        model(ids, logprob_targets=targets, return_dict=False)
    out = model(ids, logprob_targets=targets.to(torch.int32))
    assert out.logprobs.shape == targets.shape


def test_trl_fused_head_maps_onto_the_aligned_targets():
    """TRL's GRPO scoring (``add_fused_lm_head``: HF ``labels``, shifted inside, ``log_probs [B, S - 1]``) is
    ``logprob_targets = labels[:, 1:]`` padded with -100 and ``out.logprobs[:, :-1]``; with
    ``logits_to_keep = K + 1`` the completion's K log-probs are ``out.logprobs[:, :-1]`` of a ``[B, K + 1]`` call."""
    try:
        from trl.trainer import utils as trl_utils
    except (ImportError, RuntimeError) as err:  # trl 1.16 does not import beside 4.57's huggingface_hub (its lazy
        # modules raise RuntimeError)
        if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
            raise
        pytest.skip(f"trl cannot be imported ({err}); set RLK_REQUIRE_TRL=1 to make this an error")
    model = tiny_model("qwen3", torch.float64)
    ids, mask, _ = batch()
    completion = 4
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion] = -100  # what GRPOTrainer scores: the completion tokens
    trl_model = copy.deepcopy(model)
    trl_utils.add_fused_lm_head(trl_model, temperature=0.8, outputs=("log_probs", "entropy"))
    with torch.no_grad():
        trl_out = trl_model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    apply(model, temperature=0.8, return_entropy=True)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, logprob_targets=targets)
        kept = model(
            ids, attention_mask=mask, logprob_targets=targets[:, -completion - 1 :], logits_to_keep=completion + 1
        )
        lse = _truth(model(ids, attention_mask=mask).logits, targets, 0.8)[2]
    # TRL computes in fp32: its numbers against rlk's fp64 ones under the fp32 contract
    valid = targets[:, :-1] != -100
    ref_lp, lse = out.logprobs[:, :-1], lse[:, :-1]
    assert _within_contract("logprob", trl_out.log_probs, ref_lp, ref_lp, lse)
    assert _within_contract("entropy", trl_out.entropy, out.entropy[:, :-1] * valid, ref_lp, lse)
    assert torch.equal(trl_out.log_probs == 0, ~valid)
    torch.testing.assert_close(kept.logprobs[:, :-1], out.logprobs[:, -completion - 1 : -1], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# what is refused
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "gemma2",
            r"Gemma2ForCausalLM \(model_type 'gemma2'\) has a final logit soft-cap \(final_logit_softcapping=30",
        ),
        ("cohere", r"CohereForCausalLM \(model_type 'cohere'\) has a logit scale \(logit_scale=0.0625\)"),
        ("granite", r"GraniteForCausalLM \(model_type 'granite'\) has a logit scaling \(logits_scaling=1.0\)"),
    ],
)
def test_heads_with_a_logit_transform_are_refused(kind, message):
    model = tiny_model(kind, layers=1)
    with pytest.raises(ValueError, match=message):
        apply(model)
    assert "forward" not in model.__dict__ and not hasattr(model, "_rlk_apply")


def test_other_unsupported_models_are_refused():
    transformers = _transformers()
    model = tiny_model("llama", layers=1)
    head = model.lm_head
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match=r"the LM head of LlamaForCausalLM \(model_type 'llama'\) has a bias"):
        apply(model)
    model.lm_head = torch.nn.Sequential(head)
    with pytest.raises(ValueError, match="is a Sequential, not a plain torch.nn.Linear"):
        apply(model)
    with pytest.raises(ValueError, match=r"LlamaModel \(model_type 'llama'\) has no LM head"):
        apply(model.model)
    with pytest.raises(TypeError, match="model: expected a transformers causal LM"):
        apply(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        apply("llama")
    text = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    llava = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(text_config=text, vision_config=vision))
    with pytest.raises(ValueError, match=r"\(model_type 'llava'\) is a multimodal model"):
        apply(llava)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50)
    )
    with pytest.raises(ValueError, match=r"\(model_type 't5'\) is an encoder-decoder model"):
        apply(t5)


def test_a_head_replaced_after_apply_is_checked_at_each_call():
    model = apply(tiny_model("llama", layers=1))
    ids, _, targets = batch()
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match="has a bias"):
        model(ids, logprob_targets=targets)


def test_a_forward_that_changes_the_logits_is_caught_at_call_time():
    """A transform the config does not announce (here: logits * 2 in a subclass, or in place) is an error,
    never a silent different answer."""
    transformers = _transformers()
    base = tiny_model("llama", layers=1)
    ids, _, targets = batch()

    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    class InPlace(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits.mul_(2)
            return out

    class Twice(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            self.lm_head(out.hidden_states[-1])
            return out

    for cls, error in (
        (Scaled, "changes the LM head's output"),
        (InPlace, "changes the LM head's output"),
        (Twice, "called its LM head more than once"),
    ):
        model = cls(base.config).to(DEVICE)
        model.load_state_dict(base.state_dict())
        apply(model)
        with torch.no_grad(), pytest.raises(RuntimeError, match=error):
            model(ids, logprob_targets=targets, output_hidden_states=True)
        assert "forward" not in model.lm_head.__dict__  # the head is restored after the failed call
    model = apply(base)
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    with pytest.raises(ValueError, match="the LM head's weight is on the meta device"):
        model(ids, logprob_targets=targets)


def test_a_tensor_parallel_head_is_refused(tmp_path):
    """A head whose weight is a DTensor (tensor parallel) needs its shards combined: refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = apply(tiny_model("llama", layers=1))
    ids, _, targets = batch()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="the LM head's weight is a DTensor"):
            model(ids, logprob_targets=targets)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# training: weights read at each call, checkpointing, no_grad, autocast
# ---------------------------------------------------------------------------


def test_a_new_head_weight_or_head_is_used_at_the_next_call():
    """FSDP / ZeRO-3 swap parameters around the forward, resize_token_embeddings replaces the head: the next
    call uses what the model holds then, and the gradient goes to it."""
    model = apply(tiny_model("llama"))
    ids, mask, targets = batch()
    old = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(old.detach() * -1.5)
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    out = model(ids, attention_mask=mask, logprob_targets=targets)
    ref_lp, _, lse = _truth(stock, targets, 1.0)
    assert _within_contract("logprob", out.logprobs, ref_lp, ref_lp, lse)
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and old.grad is None
    model.lm_head = torch.nn.Linear(32, VOCAB + 5, bias=False).to(DEVICE)  # a new, larger vocabulary
    out = model(ids, attention_mask=mask, logprob_targets=torch.full_like(targets, VOCAB + 4))
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out.logprobs, stock.log_softmax(-1)[..., VOCAB + 4], rtol=0, atol=5e-5)


def test_gradient_checkpointing_and_no_grad_scoring():
    ids, mask, targets = batch()
    valid = targets != -100
    grads, runs = [], []
    for checkpointing in (False, True):
        model = tiny_model("qwen3").train()
        if checkpointing:  # transformers 5.x renames it; 4.57 has only the old name
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        runs.clear()
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: runs.append(1))
        apply(model, return_entropy=True)
        out = model(ids, attention_mask=mask, logprob_targets=targets)
        (-(out.logprobs * valid).sum() - 0.1 * out.entropy.sum()).backward()
        assert len(runs) == (2 if checkpointing else 1)  # the checkpointed layer ran again in the backward
        grads.append({name: p.grad for name, p in model.named_parameters()})
        with torch.no_grad():
            scored = model(ids, attention_mask=mask, logprob_targets=targets)
        assert scored.logprobs.grad_fn is None and torch.equal(scored.logprobs, out.logprobs.detach())
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), f"{name}: the checkpointed gradient differs"


def test_under_autocast_the_head_runs_in_the_autocast_dtype():
    """Like nn.Linear under autocast: hidden states and weight cast to the autocast dtype; the fused op itself
    accumulates in fp32 (it runs outside autocast)."""
    import rlk

    model = apply(tiny_model("llama"))
    ids, mask, targets = batch()
    seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask, logprob_targets=targets)
    hook.remove()
    expect = rlk.linear_logprob(seen[0].bfloat16(), model.lm_head.weight.bfloat16(), targets)
    assert torch.equal(out.logprobs, expect)


def test_no_logits_sized_tensor_is_allocated():
    """The log-prob path, forward and backward, never allocates a tensor of the logits' size [N, V] (the stock
    path does: the check can fail). V is larger than the reference backend's vocab chunk, H < N so that the
    [V, H] weight and its gradient are smaller than [N, V]."""
    from torch.profiler import ProfilerActivity, profile

    vocab, hidden = 16500, 16
    model = tiny_model("llama", hidden=hidden, heads=2, kv_heads=1, vocab=vocab)
    ids, mask, _ = batch(rows=2, seq=24, vocab=vocab)
    targets = next_token_targets(ids, mask)
    logits_bytes = ids.numel() * vocab * 4

    def largest_allocation(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return max(event.self_cpu_memory_usage for event in prof.events())

    def stock():
        logits = model(ids, attention_mask=mask).logits
        (logits.log_softmax(-1)[..., 0]).sum().backward()

    assert largest_allocation(stock) >= logits_bytes
    apply(model, return_entropy=True)

    def fused():
        out = model(ids, attention_mask=mask, logprob_targets=targets)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    assert largest_allocation(fused) < logits_bytes / 2


# ---------------------------------------------------------------------------
# batch_invariant=True
# ---------------------------------------------------------------------------


@routed
@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_batch_invariant_logprobs_alone_and_in_a_padded_batch(kind, monkeypatch):
    model = tiny_model(kind, hidden=64)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (9,), generator=g).to(DEVICE)
    others = [torch.randint(0, VOCAB, (n,), generator=g).to(DEVICE) for n in (13, 6)]
    triton = dispatch.backend_named("triton").primitives
    served = []
    real = triton["linear_logprob_fwd"]
    monkeypatch.setitem(triton, "linear_logprob_fwd", lambda *args: (served.append(1), real(*args))[1])
    apply(model, return_entropy=True, batch_invariant=True)
    assert model._rlk_patch is not None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")  # any fallback to a non-invariant path fails the test
        alone = model(seq[None], logprob_targets=next_token_targets(seq[None], torch.ones_like(seq[None])))
        stock_alone = model(seq[None]).logits
        for side in ("right", "left"):
            ids, mask, pos, real_tokens = padded_batch(seq, others, side)
            targets = next_token_targets(ids, mask)
            out = model(ids, attention_mask=mask, position_ids=pos, logprob_targets=targets)
            assert torch.equal(out.logprobs[0, real_tokens], alone.logprobs[0]), f"{kind}: {side} padding"
            assert torch.equal(out.entropy[0, real_tokens], alone.entropy[0]), f"{kind}: {side} padding"
            stock = model(ids, attention_mask=mask, position_ids=pos).logits  # the stock path runs in the mode
            assert torch.equal(stock[0, real_tokens], stock_alone[0])
    assert len(served) == 3, "linear_logprob did not run on the batch-invariant backend"
    assert not is_batch_invariant_enabled()  # the mode was on for the forwards only
    unapply(model)
    assert not hasattr(model, "_rlk_patch") and not hasattr(model, "_rlk_apply")


@routed
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16] if DEVICE.type == "cpu" else [torch.float64])
def test_batch_invariant_without_invariant_kernels_runs_the_stock_model(dtype, monkeypatch):
    """``batch_invariant=True`` where no batch-invariant kernel serves the dtype (float64; bfloat16 on the CPU, even
    under the interpreter): the forward warns and runs the stock code, bitwise the logits of an unapplied copy run in
    the same mode (whose aten overrides still serve the float32 statistics of the stock RMSNorm) for right- and
    left-padded batches (the patched attention used to hand rlk's 2-D padding mask to SDPA)."""
    import rlk.integrations.hf.patch as hf_patch

    model = tiny_model("qwen3", dtype, layers=1)
    stock = copy.deepcopy(model)
    ids, right, _ = batch()
    apply(model, batch_invariant=True)
    monkeypatch.setattr(hf_patch, "_warned", set())
    masks = (right, right.flip(-1))
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="running the stock transformers code"):
            outs = [model(ids, attention_mask=mask).logits for mask in masks]
        with batch_invariant():
            for out, mask in zip(outs, masks):
                assert torch.equal(out, stock(ids, attention_mask=mask).logits)
    unapply(model)
