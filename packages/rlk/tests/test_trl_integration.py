"""``rlk.integrations.trl.RLKGRPOTrainer`` against the real ``trl.GRPOTrainer`` (trl 1.16.0) on a tiny random causal
LM (transformers' Qwen3 built from a config, a word-level tokenizer; CPU, no download).

The rollouts come from a deterministic ``rollout_func`` (TRL's hook: fixed completions and sampling log-probs per
prompt), so every trainer sees the same completions and TRL's own generation code computes the rest of the
inputs (rewards, advantages, the old and reference log-probs through each trainer's own log-prob path, vLLM's
importance-sampling ratios). Compared, on the same seed:

* ``compute_loss`` + ``backward`` for every ``loss_type`` x ``importance_sampling_level`` x ``beta`` (0 and 0.04, with
  TRL's default bias-corrected KL at the token level), the four vLLM importance-sampling modes, the entropy bonus
  and masks. The ground truth is TRL's trainer in float64 with its log-probs by their definition
  (:class:`ExactLogprobTrainer`: TRL's fused head accumulates in float32 whatever the dtype); its generation and
  loss code are TRL's. rlk in float64 equals it to rounding (loss, every parameter gradient, the metrics rlk
  logs under TRL's names, the old / reference log-probs and vLLM ratios TRL's generation gets from rlk's path);
  rlk in float32 and TRL's own fused head in float32 are both within the numerical contract of it (loss:
  ``policy_loss``'s scale; parameter gradients: ``linear_logprob``'s bound, the op that replaces TRL's head);
* one ``trainer.train()`` step (gradients captured before the optimizer step, the logged loss), the same way;
* a ``train()`` step with TRL's own sampling (``model.generate``) runs rlk's ops and no logits.

``RLKDPOTrainer`` against the real ``trl.DPOTrainer`` on the same model and preference pairs (prompts and
completions of several lengths), the ground truth TRL's trainer in float64 with its fused LM head replaced by the
log-probs' definition (:func:`exact_fused_lm_head`): ``compute_loss`` + ``backward`` for every served ``loss_type``
(and ``loss_weights``, ``ld_alpha``, ``label_smoothing``), one ``train()`` step with and without
``precompute_ref_log_probs``, and the configurations refused at construction.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import zlib

import pytest
import torch

from rlk.core import contract

try:
    import transformers
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlk.integrations.trl import (
        DPO_LOSS_TYPES,
        LOSS_TYPES,
        PPO_FAMILY,
        RLKDPOTrainer,
        RLKGRPOTrainer,
        check_dpo_supported,
        rollout_weights,
    )
except ImportError as err:  # pragma: no cover - depends on the environment
    if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
        raise ImportError(
            f"RLK_REQUIRE_TRL is set but trl cannot be imported ({err}); install the pins of ci/requirements-dev.txt"
        ) from err
    pytest.skip(f"trl is not installed ({err}); set RLK_REQUIRE_TRL=1 to make this an error", allow_module_level=True)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

LOSS_ENTRY = contract.entry("policy_loss", torch.float32)
GRAD_ENTRY = contract.entry("linear_logprob", torch.float32)
#: float64 against float64: the same model, the same sums in other orders.
_TIGHT = {"rtol": 1e-9, "atol": 1e-12}
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
PROMPTS = [" ".join(f"w{(7 * i + j) % 61}" for j in range(2 + i % 4)) for i in range(4)]
GROUP = 4  # completions per prompt
MAX_COMPLETION = 6


# ----------------------------------------------------------------------------------------------
# a tiny model, tokenizer, rollouts and reward
# ----------------------------------------------------------------------------------------------


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen3 of hidden size 32 over the 64-word vocabulary, saved (TRL loads the reference model from it)."""
    config = transformers.Qwen3Config(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def rollout(prompts: list[str], trainer) -> dict:
    """Deterministic completions (1 to 6 tokens, some ending in <eos>) and sampling log-probs near the tiny model's
    (about -ln 64), from the prompt and its position in the batch."""
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i, prompt in enumerate(prompts):
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()) + i % GROUP)
        n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
        ids = torch.randint(3, len(WORDS), (n,), generator=g).tolist()
        if n < MAX_COMPLETION and n % 2:
            ids[-1] = 1  # <eos>
        out["prompt_ids"].append(trainer.processing_class(prompt)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append((-math.log(len(WORDS)) + 0.2 * torch.randn(n, generator=g)).tolist())
    return out


def reward(completions, **kwargs) -> list[float]:
    """The number of distinct words with an even index: spread within each group."""
    return [float(len({w for w in c.split() if w[1:].isdigit() and int(w[1:]) % 2 == 0})) for c in completions]


def make_trainer(cls, model_dir: str, dtype: torch.dtype, tmp_path, *, rollouts: bool = True, **config):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    defaults = {
        "per_device_train_batch_size": len(PROMPTS) * GROUP,
        "num_generations": GROUP,
        "max_completion_length": MAX_COMPLETION,
        "temperature": 0.9,
        "use_cpu": True,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "max_steps": 1,
        "seed": 3,
        "beta": 0.04,
        "bf16": False,
    }
    args = trl.GRPOConfig(output_dir=str(tmp_path), **{**defaults, **config})
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
        rollout_func=rollout if rollouts else None,
    )


class ExactLogprobTrainer(trl.GRPOTrainer):
    """TRL's trainer with its log-probs by their definition in the model's dtype (float64: the ground truth; TRL's
    fused head accumulates in float32 whatever the dtype): the completion positions' logits, ``log_softmax``, the
    target's entry; entropy ``-sum p log p``; 0 at padding, as TRL's. Generation and loss are TRL's own."""

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        k = logits_to_keep
        logits = (
            model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=k + 1, use_cache=False).logits[
                :, :-1
            ]
            / self.temperature
        )
        logp = torch.log_softmax(logits, dim=-1)
        pad = attention_mask[:, -k:] == 0
        logprob = logp.gather(-1, input_ids[:, -k:, None]).squeeze(-1).masked_fill(pad, 0.0)
        entropy = (-(logp.exp() * logp).sum(-1)).masked_fill(pad, 0.0) if compute_entropy else None
        return logprob, entropy, None


def perturb(model) -> None:
    """Move the policy away from the reference model (same shift in every dtype), so the KL term is not 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_((0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype))


# ----------------------------------------------------------------------------------------------
# compute_loss + backward on TRL's own inputs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    loss_type: str
    level: str = "token"
    beta: float = 0.0
    bias_correction_kl: bool = True  # TRL's default
    vllm_mode: str | None = None  # one of TRL's four vllm_importance_sampling_mode values
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    accum: int = 2

    def __str__(self) -> str:
        fields = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "loss_type" and getattr(self, f.name) != f.default
        ]
        return "-".join([self.loss_type, *fields])


def configure(trainer, case: Case) -> None:
    """Set the attributes TRL's generation and loss read (what GRPOTrainer.__init__ derives from a GRPOConfig)."""
    trainer.loss_type = case.loss_type
    trainer.importance_sampling_level = case.level
    trainer.beta = case.beta
    trainer.args.use_bias_correction_kl = case.bias_correction_kl
    trainer.epsilon_low, trainer.epsilon_high = (
        (3e-4, 4e-4) if case.level == "sequence" else (0.2, 5.0 if case.loss_type == "cispo" else 0.28)
    )
    trainer.args.delta = 3.0 if case.loss_type in PPO_FAMILY and case.level == "token" else None
    trainer.entropy_coef = case.entropy_coef
    trainer._entropy_bonus_enabled = case.entropy_coef != 0.0
    trainer.top_entropy_quantile = case.top_entropy_quantile
    trainer.off_policy_mask_threshold = case.off_policy_mask_threshold
    trainer.current_gradient_accumulation_steps = case.accum
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = case.vllm_mode is not None
    if case.vllm_mode is not None:  # TRL's vLLM path without a vLLM: the rollouts come from rollout_func
        trainer.vllm_importance_sampling_mode = case.vllm_mode
        trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = 0.9, 1.15
        trainer.vllm_generation = types.SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()


def generation_inputs(trainer, case: Case) -> dict:
    """TRL's generation-side inputs of the fixed rollouts; they depend on the case through beta (reference log-probs)
    and the vLLM mode only, so each trainer computes them once per such pair."""
    cache = trainer.__dict__.setdefault("_test_inputs", {})
    key = (case.beta != 0.0, case.vllm_mode)
    if key not in cache:
        batch = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
        cache[key] = trainer._generate_and_score_completions(batch)
    return dict(cache[key])


def loss_and_grads(trainer, case: Case) -> dict:
    """TRL's generation-side inputs (fixed rollouts), old log-probs shifted off-policy, then compute_loss + backward."""
    configure(trainer, case)
    inputs = generation_inputs(trainer, case)
    if inputs.get("old_per_token_logps") is None:  # on-policy: old = current + a shift, the same in every dtype
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            lp, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, att, ids.size(1) - inputs["prompt_ids"].size(1)
            )
        g = torch.Generator().manual_seed(1)
        shift = 0.15 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
        shift[:, ::3] *= 4.0  # some ratios far outside the clip ranges
        inputs["old_per_token_logps"] = lp + shift.to(lp.dtype)
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return {"loss": loss.detach(), "grads": grads, "metrics": metrics, "inputs": inputs}


@pytest.fixture(scope="module")
def trainers(model_dir, tmp_path_factory):
    """The float64 truth, TRL's own trainer in float32 and rlk in float64 and float32, each built from the same
    checkpoint (with its reference model)."""
    out = {}
    for key, cls, dtype in (
        ("truth", ExactLogprobTrainer, torch.float64),
        ("trl32", trl.GRPOTrainer, torch.float32),
        ("rlk64", RLKGRPOTrainer, torch.float64),
        ("rlk32", RLKGRPOTrainer, torch.float32),
    ):
        trainer = make_trainer(cls, model_dir, dtype, tmp_path_factory.mktemp(key))
        perturb(trainer.model)
        out[key] = trainer
    return out


def check_same(got: dict, want: dict, what: str) -> None:
    """float64 against float64: loss, every parameter gradient, and every metric rlk logs under a TRL name."""
    torch.testing.assert_close(got["loss"], want["loss"], **_TIGHT, msg=lambda m: f"{what} loss: {m}")
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        torch.testing.assert_close(
            grad,
            want["grads"][name],
            rtol=1e-8,
            atol=1e-12 * float(want["grads"][name].abs().max()),
            msg=lambda m, n=name: f"{what} grad {n}: {m}",
        )
    shared = [name for name in got["metrics"] if not name.startswith("rlk/")]
    assert "entropy" in shared
    for name in shared:  # TRL counts clipped tokens in float32
        rel = 1e-6 if name.startswith("clip_ratio") else 1e-9
        assert got["metrics"][name] == pytest.approx(want["metrics"][name], rel=rel, abs=1e-12), (what, name)


def check_contract(got: dict, truth: dict, what: str) -> None:
    """float32 against the float64 truth: the loss (policy_loss's scale 1 + |truth|) and each parameter gradient
    (relative L2, linear_logprob's bound)."""
    value, ref = got["loss"].reshape(1), truth["loss"].double().reshape(1)
    dev = contract.compare_outputs(LOSS_ENTRY, f"{what} loss", value, ref, 1.0 + ref.abs())
    assert dev.ok, dev
    for name, grad in got["grads"].items():
        dev = contract.compare_grad(GRAD_ENTRY, f"{what} grad {name}", grad, truth["grads"][name], 1.0)
        assert dev.ok, dev


CASES = [
    Case(loss_type, level, beta, bias_correction_kl=level == "token")
    for loss_type in LOSS_TYPES
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
    if not (level == "sequence" and loss_type in ("cispo", "sapo"))
]
CASES += [
    Case("grpo", beta=0.04, bias_correction_kl=False),
    Case("dapo", vllm_mode="token_truncate"),
    Case("dapo", vllm_mode="token_mask", beta=0.04),
    Case("grpo", vllm_mode="sequence_truncate"),
    Case("bnpo", vllm_mode="sequence_mask", off_policy_mask_threshold=0.01),
    Case("vespo", vllm_mode="token_truncate"),
    Case("vespo", vllm_mode="token_mask", top_entropy_quantile=0.3),
    Case("bnpo", entropy_coef=0.05, top_entropy_quantile=0.3, beta=0.04),
    Case("dr_grpo", entropy_coef=0.05, accum=1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_compute_loss_matches_trl(trainers, case):
    """rlk's loss and every parameter gradient equal TRL's (float64: to rounding; float32: within the contract, as
    TRL's own float32 path)."""
    truth = loss_and_grads(trainers["truth"], case)
    got64 = loss_and_grads(trainers["rlk64"], case)
    check_same(got64, truth, str(case))
    got32 = loss_and_grads(trainers["rlk32"], case)
    check_contract(got32, truth, f"rlk {case}")
    check_contract(loss_and_grads(trainers["trl32"], case), truth, f"trl {case}")
    assert float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in truth["grads"].values()]))) > 0
    if case.vllm_mode is not None:
        # TRL's generation gets the same IS ratios from rlk's old log-probs; rlk.rollout_correction's weights (what
        # the loss uses) are TRL's ratios on the mask
        torch.testing.assert_close(
            got64["inputs"]["importance_sampling_ratio"], truth["inputs"]["importance_sampling_ratio"], **_TIGHT
        )
        ratio = truth["inputs"]["importance_sampling_ratio"]
        assert bool((ratio != 1.0).any()) and (case.vllm_mode.endswith("truncate") or bool((ratio == 0).any()))
        for key in ("rlk64", "rlk32"):
            trainer, inputs = trainers[key], (got64 if key == "rlk64" else got32)["inputs"]
            mask = inputs["completion_mask"].bool()
            weights = rollout_weights(trainer, inputs, inputs["completion_mask"])
            want = inputs["importance_sampling_ratio"].expand_as(weights)
            assert torch.equal(weights[~mask], torch.zeros_like(weights[~mask]))
            torch.testing.assert_close(weights[mask], want[mask], rtol=1e-6 if key == "rlk32" else 1e-12, atol=0)
    if case.beta != 0.0:
        assert got64["metrics"]["kl"] > 1e-4  # the policy is off the reference model
        torch.testing.assert_close(
            got64["inputs"]["ref_per_token_logps"], truth["inputs"]["ref_per_token_logps"], **_TIGHT
        )


def test_the_clip_ranges_are_exercised(trainers):
    """The off-policy shift puts tokens on both sides of the clip range: TRL's clip ratio is neither 0 nor 1."""
    out = loss_and_grads(trainers["truth"], Case("dapo"))
    assert 0.0 < out["metrics"]["clip_ratio/region_mean"] < 1.0


# ----------------------------------------------------------------------------------------------
# trainer.train()
# ----------------------------------------------------------------------------------------------


class GradientRecorder(transformers.TrainerCallback):
    """The gradients right before the optimizer step (after accumulation)."""

    def __init__(self):
        self.trainer = None
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {
            name: p.grad.detach().clone() for name, p in self.trainer.model.named_parameters() if p.grad is not None
        }


def train_one_step(cls, model_dir, dtype, tmp_path, **config) -> dict:
    trainer = make_trainer(
        cls,
        model_dir,
        dtype,
        tmp_path,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=len(PROMPTS) * GROUP // 2,
        max_grad_norm=1e9,
        **config,
    )
    recorder = GradientRecorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    trainer.train()
    log = trainer.state.log_history[0]
    return {"loss": torch.tensor(log["loss"], dtype=torch.float64), "grads": recorder.grads, "log": log}


@pytest.mark.parametrize(
    "config",
    [
        {"loss_type": "dapo", "beta": 0.0},
        {"loss_type": "grpo", "beta": 0.04},
        {"loss_type": "vespo", "beta": 0.04, "num_iterations": 2},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_train_step_matches_trl(model_dir, tmp_path, config):
    """One optimizer step of two accumulated micro-batches: the gradients the optimizer gets and the logged loss
    and metrics, rlk against TRL (float64 to rounding, float32 within the contract)."""
    truth = train_one_step(ExactLogprobTrainer, model_dir, torch.float64, tmp_path / "truth", **config)
    got64 = train_one_step(RLKGRPOTrainer, model_dir, torch.float64, tmp_path / "rlk64", **config)
    got32 = train_one_step(RLKGRPOTrainer, model_dir, torch.float32, tmp_path / "rlk32", **config)
    assert truth["grads"] and got64["grads"].keys() == truth["grads"].keys()
    for name, grad in got64["grads"].items():
        torch.testing.assert_close(
            grad, truth["grads"][name], rtol=1e-8, atol=1e-12 * float(truth["grads"][name].abs().max())
        )
    # the logged loss is rounded to float32 by the Trainer's logging, and so are the metrics
    torch.testing.assert_close(got64["loss"], truth["loss"], rtol=1e-6, atol=1e-9)
    for name in ("entropy", "reward", "reward_std", "kl", "clip_ratio/region_mean"):
        if name in truth["log"] and name in got64["log"]:
            assert got64["log"][name] == pytest.approx(truth["log"][name], rel=1e-6, abs=1e-9), name
    assert "entropy" in got64["log"] and ("kl" in got64["log"]) == (config["beta"] != 0.0)
    for name, grad in got32["grads"].items():
        dev = contract.compare_grad(GRAD_ENTRY, name, grad, truth["grads"][name], 1.0)
        assert dev.ok, dev


def test_train_with_trl_sampling_runs_rlk_and_no_logits(model_dir, tmp_path, monkeypatch):
    """TRL's defaults (bf16 autocast) and its own generation (model.generate), one training step: the log-probs of
    the policy (with entropy) and of the reference model come from rlk.linear_logprob, the LM heads return no
    logits during them (the fused op's [..., 1 | 2] instead of [..., V]), and training moves the weights."""
    import rlk.integrations.hf.training

    trainer = make_trainer(
        RLKGRPOTrainer,
        model_dir,
        torch.float32,
        tmp_path,
        rollouts=False,
        loss_type="dapo",
        learning_rate=1e-2,
        bf16=True,
    )
    calls = []
    original = rlk.integrations.hf.training.linear_logprob

    def counting(hidden, weight, targets, **kwargs):
        calls.append((hidden.dtype, kwargs.get("return_entropy")))
        return original(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(rlk.integrations.hf.training, "linear_logprob", counting)
    widths = {"policy": [], "ref": []}
    hooks = [
        model.get_output_embeddings().register_forward_hook(
            lambda module, args, output, who=who: widths[who].append(output.shape[-1])
        )
        for who, model in (("policy", trainer.model), ("ref", trainer.ref_model))
    ]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        for hook in hooks:
            hook.remove()
    log = trainer.state.log_history[0]
    assert math.isfinite(log["loss"]) and "entropy" in log and "kl" in log
    assert (torch.bfloat16, True) in calls and (torch.bfloat16, False) in calls  # the loss's; the reference's
    fused = {who: sum(w in (1, 2) for w in ws) for who, ws in widths.items()}
    assert fused["policy"] >= 1 and fused["ref"] >= 1 and fused["policy"] + fused["ref"] == len(calls)
    assert len(WORDS) in widths["policy"]  # generation: the stock head, [..., V] logits
    assert any(not torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


# ----------------------------------------------------------------------------------------------
# DPO: RLKDPOTrainer against trl.DPOTrainer
# ----------------------------------------------------------------------------------------------

#: TRL's metrics that need the mean logit or the argmax over the vocabulary (not computed by rlk's log-prob op).
TRL_ONLY_DPO_METRICS = {"logits/chosen", "logits/rejected", "mean_token_accuracy"}
PAIRS = 6


def preference_dataset() -> Dataset:
    """Pairs with prompts of 1 to 4 words and completions of 1 to 6 (then <eos>: TRL appends it unless present), so
    the batch's completions start at different columns and the chosen and rejected lengths differ."""
    g = torch.Generator().manual_seed(5)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 61, (n,), generator=g))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(PAIRS):
        rows["prompt"].append(words(1 + i % 4))
        rows["chosen"].append(f" {words(1 + 3 * i % 5)} <eos>")
        rows["rejected"].append(f" {words(1 + (2 * i + 1) % 6)} <eos>")
    return Dataset.from_dict(rows)


def exact_fused_lm_head(
    model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, outputs: tuple[str, ...] = ()
) -> None:
    """A stand-in for TRL's ``add_fused_lm_head`` with its outputs by their definition in the model's dtype (float64:
    the ground truth; TRL's fused head accumulates in float32): ``model(..., labels=, fused_lm_head=True)`` gives the
    next-token labels' ``log_softmax`` entries, the entropy, the mean logit and whether the label is the argmax, 0
    where the label is -100; without ``fused_lm_head`` the stock forward."""
    stock = type(model).forward

    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return stock(self, *args, labels=labels, **kwargs)
        logits = stock(self, *args, **kwargs).logits[:, :-1] / temperature
        labels = labels[:, 1:]
        off = labels == -100
        logp = torch.log_softmax(logits, dim=-1)
        return types.SimpleNamespace(
            log_probs=logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(off, 0.0),
            entropy=(-(logp.exp() * logp).sum(-1)).masked_fill(off, 0.0),
            mean_logits=logits.detach().mean(-1).masked_fill(off, 0.0),
            is_top1=(logits.argmax(-1) == labels) & ~off,
            aux_loss=None,
        )

    model.forward = types.MethodType(forward, model)


def make_dpo_trainer(cls, model_dir: str, dtype: torch.dtype, tmp_path, *, exact: bool = False, **config):
    """``cls`` on the tiny checkpoint (TRL loads the reference model from it); ``exact``: the ground-truth head."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    defaults = {
        "per_device_train_batch_size": PAIRS,
        "use_cpu": True,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "max_steps": 1,
        "seed": 3,
        "bf16": False,
        "beta": 0.1,
    }
    args = trl.DPOConfig(output_dir=str(tmp_path), **{**defaults, **config})
    with pytest.MonkeyPatch.context() as patch:
        if exact:
            patch.setattr(trl.trainer.dpo_trainer, "add_fused_lm_head", exact_fused_lm_head)
        return cls(model=model, args=args, train_dataset=preference_dataset(), processing_class=tiny_tokenizer())


@dataclasses.dataclass(frozen=True)
class DPOCase:
    loss_type: tuple[str, ...]
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5

    def __str__(self) -> str:
        fields = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "loss_type" and getattr(self, f.name) != f.default
        ]
        return "-".join(["+".join(self.loss_type), *fields])


def configure_dpo(trainer, case: DPOCase) -> None:
    """Set the attributes DPOTrainer.__init__ derives from a DPOConfig (TRL's loss and rlk's read the same ones)."""
    trainer.loss_types = list(case.loss_type)
    trainer.loss_weights = list(case.loss_weights or [1.0] * len(case.loss_type))
    trainer.beta, trainer.label_smoothing, trainer.ld_alpha = case.beta, case.label_smoothing, case.ld_alpha
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef = case.f_divergence_type, case.f_alpha_divergence_coef
    trainer.model.train()


@pytest.fixture(scope="module")
def dpo_trainers(model_dir, tmp_path_factory):
    """The float64 truth (TRL's DPOTrainer, exact head), TRL's own in float32, rlk in float64 and float32; each
    policy moved off its reference model the same way, and one collated batch of every pair."""
    out = {}
    for key, cls, dtype in (
        ("truth", trl.DPOTrainer, torch.float64),
        ("trl32", trl.DPOTrainer, torch.float32),
        ("rlk64", RLKDPOTrainer, torch.float64),
        ("rlk32", RLKDPOTrainer, torch.float32),
    ):
        trainer = make_dpo_trainer(cls, model_dir, dtype, tmp_path_factory.mktemp(f"dpo-{key}"), exact=key == "truth")
        perturb(trainer.model)  # twice the GRPO tests' shift: log-ratios large enough to cross the hinge at beta 8
        perturb(trainer.model)
        out[key] = trainer
    dataset = out["truth"].train_dataset
    out["batch"] = out["truth"].data_collator([dataset[i] for i in range(PAIRS)])
    return out


def dpo_loss_and_grads(trainer, case: DPOCase, batch: dict) -> dict:
    configure_dpo(trainer, case)
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(dict(batch)))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return {
        "loss": loss.detach(),
        "grads": grads,
        "metrics": {name: values[-1] for name, values in trainer._metrics["train"].items()},
    }


DPO_CASES = [
    DPOCase(("sigmoid",)),
    # TRL 1.16's sigmoid has no label smoothing, and computes the alpha divergence of coefficient 1 as reverse_kl
    DPOCase(("sigmoid",), label_smoothing=0.2, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0),
    DPOCase(("hinge",), beta=8.0),  # pairs on both sides of the hinge
    DPOCase(("ipo",)),
    DPOCase(("robust",), label_smoothing=0.1),
    DPOCase(("sigmoid_norm",), beta=2.0),
    DPOCase(("sigmoid", "ipo", "hinge"), loss_weights=(0.7, 0.3, 1.5), ld_alpha=0.0),
    DPOCase(("sigmoid",), ld_alpha=0.5),
]


@pytest.mark.parametrize("case", DPO_CASES, ids=str)
def test_dpo_compute_loss_matches_trl(dpo_trainers, case):
    """rlk's DPO loss, every parameter gradient and TRL's metrics rlk logs equal TRL's (float64: to rounding;
    float32: within the contract, as TRL's own float32 head)."""
    assert set(case.loss_type) <= set(DPO_LOSS_TYPES)
    batch = dpo_trainers["batch"]
    truth = dpo_loss_and_grads(dpo_trainers["truth"], case, batch)
    got64 = dpo_loss_and_grads(dpo_trainers["rlk64"], case, batch)
    torch.testing.assert_close(got64["loss"], truth["loss"], **_TIGHT)
    assert truth["grads"] and got64["grads"].keys() == truth["grads"].keys()
    for name, grad in got64["grads"].items():
        torch.testing.assert_close(
            grad,
            truth["grads"][name],
            rtol=1e-8,
            atol=1e-12 * float(truth["grads"][name].abs().max()),
            msg=lambda m, n=name: f"{case} grad {n}: {m}",
        )
    assert set(truth["metrics"]) - set(got64["metrics"]) == TRL_ONLY_DPO_METRICS
    assert set(got64["metrics"]) <= set(truth["metrics"])
    for name, value in got64["metrics"].items():
        assert value == pytest.approx(truth["metrics"][name], rel=1e-9, abs=1e-12), name
    for key in ("rlk32", "trl32"):
        got = dpo_loss_and_grads(dpo_trainers[key], case, batch)
        ref = truth["loss"].reshape(1)
        # the sequence log-probs' error dominates and reaches the loss times |dl/dx| (~ beta): linear_logprob's bound
        dev = contract.compare_outputs(GRAD_ENTRY, f"{key} {case} loss", got["loss"].reshape(1), ref, 1.0 + ref.abs())
        assert dev.ok, dev
        for name, grad in got["grads"].items():
            dev = contract.compare_grad(GRAD_ENTRY, f"{key} {case} grad {name}", grad, truth["grads"][name], 1.0)
            assert dev.ok, dev
    assert float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in truth["grads"].values()]))) > 0
    assert truth["metrics"]["rewards/margins"] != 0.0  # the policy is off the reference model
    if case.loss_type == ("hinge",):  # some pairs past the hinge (loss above its linear part's 1 - mean margin)
        assert 1e-3 < truth["loss"] - (1.0 - truth["metrics"]["rewards/margins"])


class HeadWidths:
    """The LM heads' output shapes (rlk's fused head returns ``[..., 1 | 2]``; logits are ``[..., V]``)."""

    def __init__(self, trainer):
        self.shapes = {"policy": [], "ref": []}
        self.lengths = []  # the policy's input lengths
        self.hooks = [
            trainer.model.register_forward_pre_hook(
                lambda module, args, kwargs: self.lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
            )
        ]
        models = [("policy", trainer.model)] + ([("ref", trainer.ref_model)] if trainer.ref_model is not None else [])
        self.hooks += [
            model.get_output_embeddings().register_forward_hook(
                lambda module, args, output, who=who: self.shapes[who].append(tuple(output.shape))
            )
            for who, model in models
        ]

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def dpo_train_one_step(cls, model_dir, dtype, tmp_path, **config) -> dict:
    """Two accumulated micro-batches of 3 pairs, one optimizer step (TRL's defaults: gradient checkpointing on)."""
    trainer = make_dpo_trainer(
        cls,
        model_dir,
        dtype,
        tmp_path,
        exact=cls is trl.DPOTrainer,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=PAIRS // 2,
        max_grad_norm=1e9,
        **config,
    )
    perturb(trainer.model)
    perturb(trainer.model)
    recorder = GradientRecorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    widths = HeadWidths(trainer)
    try:
        trainer.train()
    finally:
        widths.remove()
    log = trainer.state.log_history[0]
    return {
        "loss": torch.tensor(log["loss"], dtype=torch.float64),
        "grads": recorder.grads,
        "log": log,
        "widths": widths.shapes,
        "lengths": widths.lengths,
        "trainer": trainer,
    }


@pytest.mark.parametrize(
    "config",
    [
        {"loss_type": ["sigmoid"]},
        {"loss_type": ["ipo", "sigmoid"], "loss_weights": [0.5, 1.0], "precompute_ref_log_probs": True},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_dpo_train_step_matches_trl(model_dir, tmp_path, monkeypatch, config):
    """One optimizer step: the gradients the optimizer gets and the logged loss and metrics equal TRL's (float64);
    every LM head call (the policy's with the entropy, the reference's or the precompute's without) is rlk's fused
    op, from the first position that predicts a completion token, never [..., V] logits."""
    import rlk.integrations.hf.training

    truth = dpo_train_one_step(trl.DPOTrainer, model_dir, torch.float64, tmp_path / "truth", **config)
    calls = []
    original = rlk.integrations.hf.training.linear_logprob

    def counting(hidden, weight, targets, **kwargs):
        calls.append(tuple(targets.shape))
        return original(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(rlk.integrations.hf.training, "linear_logprob", counting)
    got = dpo_train_one_step(RLKDPOTrainer, model_dir, torch.float64, tmp_path / "rlk64", **config)
    assert truth["grads"] and got["grads"].keys() == truth["grads"].keys()
    for name, grad in got["grads"].items():
        torch.testing.assert_close(
            grad, truth["grads"][name], rtol=1e-8, atol=1e-12 * float(truth["grads"][name].abs().max())
        )
    torch.testing.assert_close(got["loss"], truth["loss"], rtol=1e-6, atol=1e-9)  # logged in float32
    assert abs(float(truth["loss"]) - math.log(2.0)) > 1e-4  # not the loss of a policy equal to its reference
    assert set(truth["log"]) - set(got["log"]) == TRL_ONLY_DPO_METRICS
    for name in set(got["log"]) - {"train_runtime", "train_samples_per_second", "train_steps_per_second"}:
        assert got["log"][name] == pytest.approx(truth["log"][name], rel=1e-6, abs=1e-9), name
    precompute = config.get("precompute_ref_log_probs", False)
    trainer, shapes = got["trainer"], got["widths"]
    assert (trainer.ref_model is None) == precompute
    assert [s[-1] for s in shapes["policy"]] == [2, 2]  # log-prob and entropy
    assert [s[-1] for s in shapes["ref"]] == ([] if precompute else [1, 1])
    assert len(calls) == 4  # the policy's 2 and the reference's 2, or the precompute's 2 (the dataset's 2 batches)
    positions = [s[1] for s in shapes["policy"]]
    assert all(k <= n for k, n in zip(positions, got["lengths"], strict=True))
    assert any(k < n for k, n in zip(positions, got["lengths"], strict=True))  # a batch whose prompts are all >= 2
    if precompute:  # rlk's reference log-probs of the dataset, TRL's to rounding
        assert trainer.train_dataset["ref_chosen_logps"] == pytest.approx(
            truth["trainer"].train_dataset["ref_chosen_logps"], rel=1e-12
        )


DPO_REFUSED = [
    ({"loss_type": ["bco_pair"]}, "loss_type: 'bco_pair'"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}, "loss_type: 'sft'"),
    ({"f_divergence_type": "js_divergence"}, "f_divergence_type='js_divergence'"),
    ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5}, "f_divergence_type='alpha_divergence'"),
    ({"use_weighting": True}, "use_weighting=True"),
    ({"loss_type": ["robust"], "label_smoothing": 0.5}, "label_smoothing=0.5"),
    ({"beta": 0.0}, "beta: rlk.dpo_loss needs beta > 0"),
]


@pytest.mark.parametrize(("config", "option"), DPO_REFUSED, ids=[option for _, option in DPO_REFUSED])
def test_dpo_refuses_what_rlk_cannot_compute(model_dir, tmp_path, config, option):
    """A configuration rlk's loss cannot compute exactly raises ValueError naming the option, at construction and
    before TRL's own __init__ runs (no dataset preparation, no reference precompute)."""
    args = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, **config)
    with pytest.raises(ValueError, match=option.replace("[", r"\[")) as err:
        check_dpo_supported(args)
    prepared = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl.DPOTrainer, "_prepare_dataset", lambda *a, **k: prepared.append(1))
        with pytest.raises(ValueError, match=re.escape(option)) as err2:
            make_dpo_trainer(RLKDPOTrainer, model_dir, torch.float32, tmp_path, **config)
    assert str(err2.value) == str(err.value) and not prepared
    check_dpo_supported(
        trl.DPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to=[],
            bf16=False,
            loss_type=list(DPO_LOSS_TYPES),
            label_smoothing=0.3,
            ld_alpha=0.5,
            f_divergence_type="alpha_divergence",
            f_alpha_divergence_coef=1.0,
        )
    )


def test_dpo_refuses_the_router_auxiliary_loss(tmp_path):
    """A MoE model with its router's load-balancing loss on (TRL's default for it): refused, naming the option."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    assert config.router_aux_loss_coef > 0
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=re.escape("router_aux_loss_coef: the MoE router auxiliary loss")):
        make_dpo_trainer(RLKDPOTrainer, str(tmp_path / "moe"), torch.float32, tmp_path / "out")
