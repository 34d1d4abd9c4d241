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
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import zlib

import pytest
import torch

from rlk import contract

try:
    import transformers
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlk.integrations.trl import LOSS_TYPES, PPO_FAMILY, RLKGRPOTrainer, rollout_weights
except ImportError as err:  # pragma: no cover - depends on the environment
    if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
        raise ImportError(f"RLK_REQUIRE_TRL is set but trl cannot be imported ({err}); "
                          "install the pins of ci/requirements-dev.txt") from err
    pytest.skip(f"trl is not installed ({err}); set RLK_REQUIRE_TRL=1 to make this an error",
                allow_module_level=True)

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
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A 2-layer Qwen3 of hidden size 32 over the 64-word vocabulary, saved (TRL loads the reference model from it)."""
    config = transformers.Qwen3Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None)
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
    defaults = {"per_device_train_batch_size": len(PROMPTS) * GROUP, "num_generations": GROUP,
                "max_completion_length": MAX_COMPLETION, "temperature": 0.9, "use_cpu": True, "report_to": [],
                "logging_steps": 1, "save_strategy": "no", "max_steps": 1, "seed": 3, "beta": 0.04, "bf16": False}
    args = trl.GRPOConfig(output_dir=str(tmp_path), **{**defaults, **config})
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tiny_tokenizer(),
               rollout_func=rollout if rollouts else None)


class ExactLogprobTrainer(trl.GRPOTrainer):
    """TRL's trainer with its log-probs by their definition in the model's dtype (float64: the ground truth; TRL's
    fused head accumulates in float32 whatever the dtype): the completion positions' logits, ``log_softmax``, the
    target's entry; entropy ``-sum p log p``; 0 at padding, as TRL's. Generation and loss are TRL's own."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        k = logits_to_keep
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=k + 1,
                       use_cache=False).logits[:, :-1] / self.temperature
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
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name != "loss_type" and getattr(self, f.name) != f.default]
        return "-".join([self.loss_type, *fields])


def configure(trainer, case: Case) -> None:
    """Set the attributes TRL's generation and loss read (what GRPOTrainer.__init__ derives from a GRPOConfig)."""
    trainer.loss_type = case.loss_type
    trainer.importance_sampling_level = case.level
    trainer.beta = case.beta
    trainer.args.use_bias_correction_kl = case.bias_correction_kl
    trainer.epsilon_low, trainer.epsilon_high = (3e-4, 4e-4) if case.level == "sequence" else (
        0.2, 5.0 if case.loss_type == "cispo" else 0.28)
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
            lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, ids.size(1) - inputs[
                "prompt_ids"].size(1))
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
    for key, cls, dtype in (("truth", ExactLogprobTrainer, torch.float64), ("trl32", trl.GRPOTrainer, torch.float32),
                            ("rlk64", RLKGRPOTrainer, torch.float64), ("rlk32", RLKGRPOTrainer, torch.float32)):
        trainer = make_trainer(cls, model_dir, dtype, tmp_path_factory.mktemp(key))
        perturb(trainer.model)
        out[key] = trainer
    return out


def check_same(got: dict, want: dict, what: str) -> None:
    """float64 against float64: loss, every parameter gradient, and every metric rlk logs under a TRL name."""
    torch.testing.assert_close(got["loss"], want["loss"], **_TIGHT, msg=lambda m: f"{what} loss: {m}")
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-8, atol=1e-12 * float(
            want["grads"][name].abs().max()), msg=lambda m, n=name: f"{what} grad {n}: {m}")
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


CASES = [Case(loss_type, level, beta, bias_correction_kl=level == "token")
         for loss_type in LOSS_TYPES for level in ("token", "sequence") for beta in (0.0, 0.04)
         if not (level == "sequence" and loss_type in ("cispo", "sapo"))]
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
        torch.testing.assert_close(got64["inputs"]["importance_sampling_ratio"],
                                   truth["inputs"]["importance_sampling_ratio"], **_TIGHT)
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
        torch.testing.assert_close(got64["inputs"]["ref_per_token_logps"], truth["inputs"]["ref_per_token_logps"],
                                   **_TIGHT)


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
        self.grads = {name: p.grad.detach().clone() for name, p in self.trainer.model.named_parameters()
                      if p.grad is not None}


def train_one_step(cls, model_dir, dtype, tmp_path, **config) -> dict:
    trainer = make_trainer(cls, model_dir, dtype, tmp_path, gradient_accumulation_steps=2,
                           per_device_train_batch_size=len(PROMPTS) * GROUP // 2, max_grad_norm=1e9, **config)
    recorder = GradientRecorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    trainer.train()
    log = trainer.state.log_history[0]
    return {"loss": torch.tensor(log["loss"], dtype=torch.float64), "grads": recorder.grads, "log": log}


@pytest.mark.parametrize("config", [{"loss_type": "dapo", "beta": 0.0}, {"loss_type": "grpo", "beta": 0.04},
                                    {"loss_type": "vespo", "beta": 0.04, "num_iterations": 2}],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_train_step_matches_trl(model_dir, tmp_path, config):
    """One optimizer step of two accumulated micro-batches: the gradients the optimizer gets and the logged loss
    and metrics, rlk against TRL (float64 to rounding, float32 within the contract)."""
    truth = train_one_step(ExactLogprobTrainer, model_dir, torch.float64, tmp_path / "truth", **config)
    got64 = train_one_step(RLKGRPOTrainer, model_dir, torch.float64, tmp_path / "rlk64", **config)
    got32 = train_one_step(RLKGRPOTrainer, model_dir, torch.float32, tmp_path / "rlk32", **config)
    assert truth["grads"] and got64["grads"].keys() == truth["grads"].keys()
    for name, grad in got64["grads"].items():
        torch.testing.assert_close(grad, truth["grads"][name], rtol=1e-8,
                                   atol=1e-12 * float(truth["grads"][name].abs().max()))
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
    import rlk.hf.training

    trainer = make_trainer(RLKGRPOTrainer, model_dir, torch.float32, tmp_path, rollouts=False, loss_type="dapo",
                           learning_rate=1e-2, bf16=True)
    calls = []
    original = rlk.hf.training.linear_logprob

    def counting(hidden, weight, targets, **kwargs):
        calls.append((hidden.dtype, kwargs.get("return_entropy")))
        return original(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(rlk.hf.training, "linear_logprob", counting)
    widths = {"policy": [], "ref": []}
    hooks = [model.get_output_embeddings().register_forward_hook(
        lambda module, args, output, who=who: widths[who].append(output.shape[-1]))
        for who, model in (("policy", trainer.model), ("ref", trainer.ref_model))]
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
