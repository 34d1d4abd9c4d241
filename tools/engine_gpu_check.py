"""rlk inside a training engine on one GPU: the engine's training-path log-probs bitwise equal to rlk's HF rollout path,
and the cost of a training step with and without rlk.

Builds a random-weight Qwen3 from a config (no download): ``--preset 8b`` (the default: Qwen3-8B's shapes, hidden
4096, 32 query / 8 KV heads of 128, MLP 12288, vocabulary 151936, untied head, ``--layers`` layers instead of 36,
bf16) or ``--preset tiny`` (hidden 64, vocabulary 96, fp32: a CPU dry run with ``TRITON_INTERPRET=1``). Then:

* the rollout (HF, one device, ``rlk.integrations.hf.apply(model, batch_invariant=True)``): ``--seqs`` prompts
  sampled to responses by ``rlk.app.consistency.paths.rollout`` (left-padded prefill, KV-cache decode, rlk's chain),
  and every response token scored in a teacher-forced decode by ``logprobs_from_hidden`` (rlk's rollout scoring:
  the fused head's op on the hidden state the head received);
* each engine section computes the training-path log-probs of the same tokens with rlk on (packed micro-batches)
  and checks ``torch.equal`` per sequence, then times a training step (forward + backward of the summed log-probs,
  one packed row of all sequences) three ways: stock (logits, ``log_softmax``, the engine's default kernels), rlk's
  fused head only (``apply(model)``: ``rlk.linear_logprob`` without the logits, cuBLAS elsewhere) and rlk's full
  chain (``apply(model, batch_invariant=True)``), with peak memory.

Engines (``--engine``): ``fsdp2`` (``fully_shard`` over a one-rank process group, NCCL on a GPU, gloo on the CPU;
bf16 parameters, and with ``--mixed-precision`` also fp32 parameters under ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` against the rollout model cast to bf16), ``megatron`` (megatron-core TP = 1 on rlk's layer
specs, the weights converted from the rollout model and checked by checksums; its stock modes need CUDA) or
``all``. Prints a table and one JSON line (``--json PATH`` also writes it); exit code 1 when a bitwise check fails.

    python tools/engine_gpu_check.py --engine fsdp2 --layers 2
    TRITON_INTERPRET=1 python tools/engine_gpu_check.py --engine all --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time

import torch

PRESETS = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        dtype=torch.bfloat16,
        seqs=8,
        prompt=256,
        new_tokens=32,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=96,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        max_position_embeddings=128,
        dtype=torch.float32,
        seqs=4,
        prompt=6,
        new_tokens=4,
    ),
}


@dataclasses.dataclass
class Shared:
    """What every engine section compares against: the model the rollout ran (rlk applied, batch-invariant), a copy
    of it as built, the token sequences and the rollout's per-sequence fp32 log-probs of the response tokens."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    clean: torch.nn.Module  # the same weights, before rlk touched the model: what engines shard
    prompts: list[list[int]]
    responses: list[list[int]]
    rollout: list[torch.Tensor]


class Skipped(Exception):
    """An engine section that cannot run here; the message says why."""


# ---------------------------------------------------------------------------
# the model and the two paths
# ---------------------------------------------------------------------------


def build_model(preset: dict, layers: int, device: torch.device, dtype: torch.dtype):
    import transformers

    fields = {k: v for k, v in preset.items() if k not in ("dtype", "seqs", "prompt", "new_tokens")}
    config = transformers.Qwen3Config(
        **fields, num_hidden_layers=layers, tie_word_embeddings=False, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def packed(prompts, responses, seqs, device):
    """One packed row of sequences ``seqs``: ids, position ids (restarting at 0), targets (the response tokens at the
    positions predicting them, -100 elsewhere), each ``[1, T]``, and the row offsets."""
    tokens, positions, targets, starts = [], [], [], [0]
    for i in seqs:
        p, r = prompts[i], responses[i]
        tokens += p + r
        positions += list(range(len(p) + len(r)))
        targets += [-100] * (len(p) - 1) + r + [-100]
        starts.append(len(tokens))
    row = lambda x: torch.tensor([x], device=device)  # noqa: E731
    return row(tokens), row(positions), row(targets), starts


def training_logprobs(model, shared: Shared, micro_batches) -> list[torch.Tensor]:
    """The training path with rlk: each micro-batch one packed row, ``model(..., logprob_targets=...)``."""
    out = {}
    for mb in micro_batches:
        ids, pos, targets, starts = packed(shared.prompts, shared.responses, mb, shared.device)
        with torch.no_grad():
            lp = model(input_ids=ids, position_ids=pos, logprob_targets=targets, use_cache=False).logprobs[0]
        for k, i in enumerate(mb):
            p, r = len(shared.prompts[i]), len(shared.responses[i])
            out[i] = lp[starts[k] + p - 1 : starts[k] + p + r - 1].float().cpu()
    return [out[i] for i in sorted(out)]


def rollout_logprobs(model, prompts, responses, device) -> list[torch.Tensor]:
    """rlk's rollout scoring: the prompts left-padded and prefilled, then one response token per row per step through
    the KV cache, each scored by ``logprobs_from_hidden`` on the hidden state the head received."""
    import rlk.integrations.hf as hf
    from rlk.integrations.hf import compat

    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seen = {}
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.update(h=a[0]))
    cache, scores = compat.new_cache(model), [[] for _ in range(n)]
    try:
        with torch.no_grad():
            kw = dict(attention_mask=mask, position_ids=pos, logits_to_keep=1)
            compat.cached_forward(model, cache, input_ids=ids, **kw)
            for step in range(max(map(len, responses))):
                token = torch.tensor([r[min(step, len(r) - 1)] for r in responses], device=device)
                lp = hf.logprobs_from_hidden(model, seen["h"][:, -1], token).float().cpu()
                for i, r in enumerate(responses):
                    if step < len(r):
                        scores[i].append(lp[i])
                mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
                pos = pos[:, -1:] + 1
                compat.cached_forward(
                    model, cache, input_ids=token[:, None], attention_mask=mask, position_ids=pos, logits_to_keep=1
                )
    finally:
        hook.remove()
    return [torch.stack(s) for s in scores]


def compare(name: str, got, truth) -> dict:
    equal = [torch.equal(a, b) for a, b in zip(got, truth)]
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, truth))
    return {"check": name, "bitwise": all(equal), "sequences_equal": f"{sum(equal)}/{len(equal)}", "max_abs": diff}


# ---------------------------------------------------------------------------
# timing a training step
# ---------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, device: torch.device, repeats: int) -> tuple[float, float | None]:
    """``(median ms of step(), peak GiB above what was allocated before it, None off CUDA)``, after a warm-up."""
    step()  # warm-up (compiles and autotunes nothing else later)
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[len(times) // 2], peak


def time_step(model, shared: Shared, mode: str, repeats: int) -> dict:
    """Forward + backward of the summed response log-probs of all sequences in one packed row, ``mode``: ``stock``
    (the logits, ``log_softmax`` in fp32), ``fused`` (``apply(model)``) or ``rlk`` (``apply(model,
    batch_invariant=True)``, the backward inside ``rlk.batch_invariant()``). Median of ``repeats`` after one warm-up;
    peak memory of one step above what was allocated before it."""
    import rlk
    import rlk.integrations.hf as hf

    device = shared.device
    ids, pos, targets, _ = packed(shared.prompts, shared.responses, list(range(len(shared.prompts))), device)
    if mode != "stock":
        hf.apply(model, batch_invariant=mode == "rlk")
    mode_ctx = rlk.batch_invariant if mode == "rlk" else contextlib.nullcontext

    def step():
        if mode == "stock":
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            lp = lp.masked_fill(targets == -100, 0.0)
        else:
            lp = model(input_ids=ids, position_ids=pos, logprob_targets=targets, use_cache=False).logprobs
        with mode_ctx():
            lp.sum().backward()
        model.zero_grad(set_to_none=True)

    try:
        step_ms, peak = measure(step, device, repeats)
    finally:
        hf.unapply(model)
    return {"mode": mode, "tokens": int(ids.numel()), "step_ms": step_ms, "peak_gib": peak}


# ---------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of this process alone (NCCL on a GPU, gloo on the CPU), unless one is initialized already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="rlk-engine-") as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        dist.init_process_group(
            backend, init_method=f"file://{tmp}/store", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def run_fsdp2(shared: Shared) -> dict:
    """FSDP2 at DP = 1: every decoder layer and the root ``fully_shard``ed, rlk applied after sharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import rlk.integrations.hf as hf

    results = {"checks": [], "timings": []}
    with one_rank_group(shared.device):
        mesh = DeviceMesh.from_group(dist.group.WORLD, shared.device.type)
        short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[shared.dtype]
        variants = [(f"{short} params", None)]
        if shared.args.mixed_precision:
            policy = MixedPrecisionPolicy(param_dtype=shared.dtype, reduce_dtype=torch.float32)
            variants.append((f"fp32 params, MixedPrecisionPolicy({short}, reduce fp32)", policy))
        n = len(shared.prompts)
        for name, policy in variants:
            model = copy.deepcopy(shared.clean)
            if policy is not None:
                model.float()  # the master weights: the rollout's bf16 weights are their cast
            kwargs = {} if policy is None else {"mp_policy": policy}
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **kwargs)
            fully_shard(model, mesh=mesh, **kwargs)
            hf.apply(model, batch_invariant=True)
            for split in ([list(range(n))], [[i] for i in reversed(range(n))]):
                got = training_logprobs(model, shared, split)
                label = "one micro-batch" if len(split) == 1 else "one sequence a micro-batch"
                results["checks"].append(compare(f"fsdp2 [{name}], {label} vs HF rollout", got, shared.rollout))
            hf.unapply(model)
            if policy is None:
                for mode in ("stock", "fused", "rlk"):
                    results["timings"].append(
                        {"engine": "fsdp2", **time_step(model, shared, mode, shared.args.repeats)}
                    )
            del model
    return results


def _megatron_config(hf_config, dtype: torch.dtype, device: torch.device):
    """The megatron-core ``TransformerConfig`` of a Hugging Face Qwen3 config (TP = 1, no fusions, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = hf_config
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # the weights are loaded: no CUDA RNG tracker
    )


def _megatron_padded(shared: Shared):
    """All sequences right-padded into ``[B, S]``: ids, targets (-100 off the response), and each row's length."""
    n = len(shared.prompts)
    rows = [shared.prompts[i] + shared.responses[i] for i in range(n)]
    width = max(map(len, rows))
    ids = torch.zeros((n, width), dtype=torch.int64)
    targets = torch.full((n, width), -100, dtype=torch.int64)
    for i, row in enumerate(rows):
        p, r = len(shared.prompts[i]), len(shared.responses[i])
        ids[i, : len(row)] = torch.tensor(row)
        targets[i, p - 1 : p + r - 1] = torch.tensor(shared.responses[i])
    return ids.to(shared.device), targets.to(shared.device)


def _megatron_logprobs(model, shared: Shared, micro_batches) -> list[torch.Tensor]:
    """rlk's Megatron path: each micro-batch one packed row (``qkv_format="thd"``), ``rm.logprobs``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlk.integrations import megatron as rm

    out = {}
    for mb in micro_batches:
        ids, _, targets, starts = packed(shared.prompts, shared.responses, mb, shared.device)
        cu = torch.tensor(starts, dtype=torch.int32, device=shared.device)
        longest = int((cu[1:] - cu[:-1]).max())
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        with torch.no_grad():
            lp = rm.logprobs(model, ids, targets, packed_seq_params=params)[0]
        for k, i in enumerate(mb):
            p, r = len(shared.prompts[i]), len(shared.responses[i])
            out[i] = lp[starts[k] + p - 1 : starts[k] + p + r - 1].float().cpu()
    return [out[i] for i in sorted(out)]


def _megatron_time_step(model, shared: Shared, mode: str, repeats: int) -> dict:
    """A training step on the right-padded ``[B, S]`` batch: forward + backward of the summed response log-probs.
    ``stock``: megatron-core's local layers, the logits from its output layer, ``log_softmax`` in fp32; ``fused``:
    the same layers, rlk's fused head (``rlk.linear_logprob`` on the last hidden state, no logits); ``rlk``: rlk's
    layer specs and ``rm.logprobs``. Median of ``repeats`` after one warm-up; peak memory above the step's start."""
    import rlk
    from rlk.integrations import megatron as rm

    device = shared.device
    ids, targets = _megatron_padded(shared)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)

    def logprobs():
        if mode == "stock":
            logits = model(ids, positions, None)  # [B, S, V]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            return lp.masked_fill(targets == -100, 0.0)
        if mode == "fused":
            hidden = rm.last_hidden_state(model, ids)
            return rlk.linear_logprob(hidden, rm.head_weight(model), targets)
        return rm.logprobs(model, ids, targets)

    def step():
        logprobs().sum().backward()
        model.zero_grad(set_to_none=True)

    step_ms, peak = measure(step, device, repeats)
    result = {"mode": mode, "tokens": int(ids.numel()), "step_ms": step_ms, "peak_gib": peak}
    with torch.no_grad():  # how far this mode's log-probs are from the rollout's (stock: not bitwise, by design)
        lp = logprobs()
    got = [
        lp[i, len(p) - 1 : len(p) + len(r) - 1].float().cpu()
        for i, (p, r) in enumerate(zip(shared.prompts, shared.responses))
    ]
    result["max_abs_vs_rollout"] = max(
        float((a.double() - b.double()).abs().max()) for a, b in zip(got, shared.rollout)
    )
    return result


def run_megatron(shared: Shared) -> dict:
    """megatron-core at TP = 1 with rlk's chain (``rlk.integrations.megatron``): a ``GPTModel`` on rlk's layer specs
    with the weights of ``shared.clean`` converted (``rm.hf_to_megatron``, checked by ``rm.checksum`` on the way back)
    and the rollout model's rotary table; its log-probs of the rollout's tokens, one packed row of all sequences and
    one sequence a micro-batch, compared with ``shared.rollout``. Then a training step timed with megatron-core's
    stock local layers (``stock``: logits + ``log_softmax``; ``fused``: rlk's fused head on them) and with rlk's
    specs (``rlk``), with peak memory (``stock`` / ``fused`` need CUDA: megatron's rope and causal mask call it)."""
    try:
        import megatron.core  # noqa: F401
    except Exception as err:  # a CUDA-only build fails with other errors than ImportError on the CPU
        raise Skipped(f"megatron-core cannot be imported ({type(err).__name__}: {err})") from err
    import importlib.metadata

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rlk.integrations import megatron as rm

    hf, device, dtype = shared.clean, shared.device, shared.dtype
    c = hf.config
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    results = {"checks": [], "timings": []}
    with one_rank_group(device):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            config = _megatron_config(c, dtype, device)
            layout = rm.Layout.from_hf_config(c)
            state = rm.hf_to_megatron(hf.state_dict(), layout)
            round_trip = rm.checksum(rm.megatron_to_hf([state], layout)) == rm.checksum(hf.state_dict())
            results["checks"].append(
                {
                    "check": "megatron weights: HF -> Megatron -> HF checksum",
                    "bitwise": round_trip,
                    "sequences_equal": "-",
                    "max_abs": 0.0,
                }
            )
            model = rm.gpt_model(
                config,
                vocab_size=c.vocab_size,
                max_sequence_length=c.max_position_embeddings,
                rope_theta=theta,
                qk_layernorm=True,
            )
            model.load_state_dict(state, strict=True)
            rm.use_rotary_table(model, hf.model.rotary_emb.inv_freq)
            n = len(shared.prompts)
            version = importlib.metadata.version("megatron-core")
            for split, label in (([list(range(n))], "one packed row"), ([[i] for i in range(n)], "one sequence a row")):
                got = _megatron_logprobs(model, shared, split)
                results["checks"].append(
                    compare(f"megatron-core {version} TP=1 (rlk specs), {label} vs HF rollout", got, shared.rollout)
                )
            results["timings"].append(
                {"engine": "megatron", **_megatron_time_step(model, shared, "rlk", shared.args.repeats)}
            )
            del model
            if device.type == "cuda":
                from megatron.core import tensor_parallel

                tensor_parallel.model_parallel_cuda_manual_seed(0)  # its attention forks the CUDA RNG tracker
                stock = GPTModel(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                    vocab_size=c.vocab_size,
                    max_sequence_length=c.max_position_embeddings,
                    position_embedding_type="rope",
                    rotary_base=theta,
                )
                stock.to(device)  # torch.nn.RMSNorm of megatron's local spec is built on the default device
                for m in stock.modules():
                    if isinstance(m, torch.nn.RMSNorm):
                        m.to(dtype)
                stock.load_state_dict(state, strict=True)
                for mode in ("stock", "fused"):
                    results["timings"].append(
                        {"engine": "megatron", **_megatron_time_step(stock, shared, mode, shared.args.repeats)}
                    )
                del stock
        finally:
            parallel_state.destroy_model_parallel()
    return results


ENGINES = {"fsdp2": run_fsdp2, "megatron": run_megatron}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=[*ENGINES, "all"], default="all")
    parser.add_argument("--preset", choices=list(PRESETS), default="8b")
    parser.add_argument("--tiny", action="store_const", const="tiny", dest="preset", help="--preset tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqs", type=int, help="sequences (default: the preset's)")
    parser.add_argument("--prompt-len", type=int, help="longest prompt (default: the preset's)")
    parser.add_argument("--new-tokens", type=int, help="longest response (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed training steps per mode")
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false")
    parser.add_argument("--json", help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    import transformers

    import rlk
    import rlk.integrations.hf as hf
    from rlk.app.consistency import paths

    preset = PRESETS[args.preset]
    device, dtype = torch.device(args.device), preset["dtype"]
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("note: on the CPU rlk's batch-invariant kernels need TRITON_INTERPRET=1 (else stock code runs)")
    seqs = args.seqs or preset["seqs"]
    longest, new_tokens = args.prompt_len or preset["prompt"], args.new_tokens or preset["new_tokens"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, longest // 2), longest + 1, (seqs,), generator=g).tolist()
    vocab = preset["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    start = time.perf_counter()
    model = build_model(preset, args.layers, device, dtype)
    clean = copy.deepcopy(model)
    with paths.chain(model, True):
        rolled = paths.rollout(model, prompts, max_new_tokens=new_tokens, seed=3)
    hf.apply(model, batch_invariant=True)
    rollout = rollout_logprobs(model, prompts, rolled.responses, device)
    shared = Shared(args, device, dtype, model, clean, prompts, rolled.responses, rollout)
    report = {
        "tool": "engine_gpu_check",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rlk": rlk.__version__,
        "preset": args.preset,
        "layers": args.layers,
        "dtype": str(dtype).removeprefix("torch."),
        "sequences": seqs,
        "response_tokens": sum(map(len, rolled.responses)),
        "checks": [],
        "timings": [],
        "skipped": {},
    }
    # the HF training path on one device, the baseline every engine must equal
    baseline = training_logprobs(model, shared, [list(range(seqs))])
    report["checks"].append(compare("HF training (one device) vs HF rollout", baseline, rollout))

    for name in ENGINES if args.engine == "all" else [args.engine]:
        try:
            part = ENGINES[name](shared)
        except Skipped as why:
            report["skipped"][name] = str(why)
            print(f"{name}: skipped: {why}")
            continue
        report["checks"] += part["checks"]
        report["timings"] += part["timings"]
    report["seconds"] = round(time.perf_counter() - start, 1)

    width = max(len(c["check"]) for c in report["checks"])
    print(f"\n{'check':<{width}} {'bitwise':>7} {'seqs':>6} {'max |diff|':>10}")
    for c in report["checks"]:
        equal = "yes" if c["bitwise"] else "NO"
        print(f"{c['check']:<{width}} {equal:>7} {c['sequences_equal']:>6} {c['max_abs']:>10.3g}")
    if report["timings"]:
        print(f"\n{'engine':<8} {'mode':<6} {'tokens':>7} {'step ms':>9} {'peak GiB':>9}")
        for t in report["timings"]:
            peak = "-" if t["peak_gib"] is None else f"{t['peak_gib']:.2f}"
            print(f"{t['engine']:<8} {t['mode']:<6} {t['tokens']:>7} {t['step_ms']:>9.1f} {peak:>9}")
    line = json.dumps(report)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0 if all(c["bitwise"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
