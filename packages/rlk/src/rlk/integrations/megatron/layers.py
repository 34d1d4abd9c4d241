"""megatron-core modules that run rlk's ops: tensor-parallel linears in rlk's fixed ``K`` tree, RMSNorm, attention.

Each class takes the constructor arguments megatron-core's layer specs pass to the module it replaces, so a
``ModuleSpec`` swap is all a model needs (:mod:`rlk.integrations.megatron.spec`). The linears subclass megatron's
own (same parameters, attributes and state-dict keys) and only replace ``forward``: the column-parallel GEMM is
:func:`rlk.distributed.column_parallel_linear`, the row-parallel one :func:`rlk.distributed.row_parallel_linear`
(the ranks' fp32 partial sums combined in the top of the single-device tree instead of an all-reduce), so outputs
are bitwise those of ``rlk.linear`` on the full weight at any tensor-parallel degree.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from rlk.core import dispatch
from rlk.distributed import column_parallel_linear, row_parallel_linear
from rlk.integrations.batch_invariant import _invariant_backend
from rlk.ops.attention import attention
from rlk.ops.matmul import linear
from rlk.ops.norm import rms_norm


def _refuse_unsupported(config, name: str) -> None:
    """The megatron-core features these modules do not implement, refused with the option's name."""
    if getattr(config, "sequence_parallel", False):
        raise NotImplementedError(
            f"{name}: sequence_parallel=True (activations sharded by tokens outside the tensor-parallel regions) "
            "is not supported by rlk's Megatron layers; set sequence_parallel=False"
        )
    if getattr(config, "context_parallel_size", 1) != 1:
        raise NotImplementedError(
            f"{name}: context_parallel_size={config.context_parallel_size}: rlk's Megatron attention runs whole "
            "sequences (context parallelism is not wired to rlk.distributed.context_parallel_attention yet)"
        )


def on_invariant_backend(op: str, x: Tensor, **features: int):
    """Run ``op`` on the batch-invariant backend the Hugging Face path picks for it here (``rlk.use_backend`` pins
    apply): the rollout's kernels, whatever the default dispatch would choose (on the CPU it skips the Triton
    interpreter)."""
    backend = _invariant_backend(op, x.device, x.dtype, **features)
    return dispatch.use_backend(backend.name) if backend is not None else contextlib.nullcontext()


def group_size(group) -> int:
    """The size of a tensor-parallel group (1 without ``torch.distributed``)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _device(config) -> torch.device:
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` computing ``rlk.distributed.column_parallel_linear``: this rank's
    output columns, bitwise the single-device ``rlk.linear`` columns; ``grad_input`` summed over the ranks in the
    fixed tree (megatron-core's all-reduce of it is not used). Arguments as megatron-core's; expert layers and
    sequence parallelism are refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.config, type(self).__name__)
        if self.is_expert:
            raise NotImplementedError(f"{type(self).__name__}: expert (MoE) layers are not supported")

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError(f"{type(self).__name__}: no weight (skip_weight_param_allocation=True and none given)")
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        bias = None if self.skip_bias_add else self.bias
        with on_invariant_backend("matmul", input_):
            if group_size(self.tp_group) == 1:  # rlk's single-device op (no tensor-parallel order needed)
                out = linear(input_, weight, bias)
            else:
                out = column_parallel_linear(input_, weight, bias, group=self.tp_group, gather_output=bool(gather))
        return out, (self.bias if self.skip_bias_add else None)


class GatedColumnParallelLinear(ColumnParallelLinear):
    """The gated MLP's ``linear_fc1``: rank ``r`` holds ``[gate_r; up_r]`` (megatron's layout); the two halves run as
    two column-parallel linears whose outputs are concatenated (``[..., gate_r | up_r]``, as megatron's). One linear
    on the fused weight would sum ``grad_input`` over ``N`` in a tree whose leaves mix gate and up rows differently
    at each tensor-parallel degree; apart, each half's shards are subtrees (and the backward has the structure of
    Hugging Face's separate ``gate_proj`` / ``up_proj``)."""

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        weight = self.weight if weight is None else weight
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            raise NotImplementedError(f"{type(self).__name__}: gather_output=True (megatron's MLP never asks for it)")
        bias = None if self.skip_bias_add else self.bias
        halves = weight.chunk(2, dim=0)
        biases = bias.chunk(2) if bias is not None else (None, None)
        outs = []
        with on_invariant_backend("matmul", input_):
            for w, b in zip(halves, biases):
                if group_size(self.tp_group) == 1:
                    outs.append(linear(input_, w, b))
                else:
                    outs.append(column_parallel_linear(input_, w, b, group=self.tp_group))
        return torch.cat(outs, dim=-1), (self.bias if self.skip_bias_add else None)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` computing ``rlk.distributed.row_parallel_linear``: the output (bias
    added once, after the ranks' partials are combined) is bitwise the single-device ``rlk.linear`` at any
    tensor-parallel degree whose ``K`` tree the ranks can split (``docs/distributed.md``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.config, type(self).__name__)
        if self.is_expert:
            raise NotImplementedError(f"{type(self).__name__}: expert (MoE) layers are not supported")

    def forward(self, input_: Tensor):
        x = input_
        size = group_size(self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        with on_invariant_backend("matmul", x):
            if size == 1:  # rlk's single-device op (no tensor-parallel order needed)
                out = linear(x, self.weight, bias)
            else:
                if not self.input_is_parallel:
                    x = x.chunk(size, dim=-1)[dist.get_rank(self.tp_group)]
                out = row_parallel_linear(x, self.weight, bias, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RMSNorm(torch.nn.Module):
    """``rlk.rms_norm`` over the last dim (Hugging Face's RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))`` with
    the normalized value rounded to x's dtype before the weight): megatron-core's norm slot (``input_layernorm``,
    ``pre_mlp_layernorm``, ``q_layernorm`` / ``k_layernorm``, the block's final norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"config.normalization: rlk's Megatron norm is RMSNorm, got {config.normalization!r}")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("config.layernorm_zero_centered_gamma=True is not supported")
        _refuse_unsupported(config, type(self).__name__)
        self.config = config
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=_device(config)))

    def forward(self, x: Tensor) -> Tensor:
        with on_invariant_backend("rms_norm", x):
            return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CoreAttention(MegatronModule):
    """megatron-core's ``core_attention`` slot (causal self-attention on this rank's heads) through ``rlk.attention``,
    with the rotary embedding applied here, as the Hugging Face Llama / Qwen models apply it (build the model with
    ``position_embedding_type="none"``: :func:`rlk.integrations.megatron.gpt_model` does).

    Rotary: ``inv_freq = 1 / theta ** (2i / d)`` (fp32, computed on the CPU), ``cos, sin`` of ``pos * inv_freq``
    repeated over both halves in fp32 and rounded to the activations' dtype, ``x * cos + rotate_half(x) * sin`` in
    that dtype: Hugging Face's formula and roundings, so the result is the rollout path's bits. Positions restart at
    0 in every sequence: ``[s, b, ...]`` inputs are ``b`` sequences of ``s`` tokens; with ``packed_seq_params``
    (``qkv_format="thd"``) the sequences of ``cu_seqlens_q``. Scale ``head_dim ** -0.5`` unless
    ``config.softmax_scale``. An explicit ``attention_mask`` or ``attention_bias``, dropout, context parallelism
    and non-causal masks are refused.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        rope_theta: float,
    ):
        super().__init__(config=config)
        _refuse_unsupported(config, type(self).__name__)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"attn_mask_type: rlk's Megatron attention is causal, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(f"attention_dropout={dropout}: rlk's Megatron attention has no dropout")
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.rope_theta = float(rope_theta)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32) / self.head_dim
        # a plain attribute, not a buffer: Megatron's Float16Module casts buffers to bf16 / fp16
        self.inv_freq = 1.0 / (self.rope_theta**exponents)

    def set_inv_freq(self, inv_freq: Tensor) -> None:
        """Use these rotary frequencies ``[head_dim / 2]`` (converted to fp32) instead of the computed ones: e.g. the
        rollout model's own table (a Hugging Face model cast with ``.to(torch.bfloat16)`` holds a bf16 copy)."""
        if inv_freq.shape != self.inv_freq.shape:
            raise ValueError(f"inv_freq: expected shape {tuple(self.inv_freq.shape)}, got {tuple(inv_freq.shape)}")
        self.inv_freq = inv_freq.detach().to(torch.float32).clone()

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        return (x * cos) + (_rotate_half(x) * sin)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError(
                "attention_mask / attention_bias: rlk's Megatron attention is causal within each sequence; pass "
                "attention_mask=None and packed_seq_params for several sequences in a row"
            )
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"attn_mask_type: rlk's Megatron attention is causal, got {attn_mask_type}")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: use 'thd'")
            cu = packed_seq_params.cu_seqlens_q.to(torch.int32)
            padded = packed_seq_params.cu_seqlens_q_padded
            if padded is not None and not torch.equal(padded.to(cu.device, torch.int32), cu):
                raise NotImplementedError("packed_seq_params.cu_seqlens_q_padded differs from cu_seqlens_q")
            q, k, v = (t.reshape(t.shape[0], t.shape[-2], t.shape[-1]) for t in (query, key, value))
            lengths = cu[1:] - cu[:-1]
            starts = torch.repeat_interleave(cu[:-1], lengths)
            positions = torch.arange(q.shape[0], device=q.device) - starts.to(q.device)
            max_len = int(packed_seq_params.max_seqlen_q or int(lengths.max()))
            out_shape = (q.shape[0], 1, -1)
        else:
            s, b = query.shape[:2]
            q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], t.shape[3]) for t in (query, key, value))
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
            positions = torch.arange(s, device=q.device).repeat(b)
            max_len = s
            out_shape = None
        q, k = self._rope(q, positions), self._rope(k, positions)
        with on_invariant_backend("attention", q, head_dim=q.shape[-1]):
            out = attention(
                q,
                k,
                v.contiguous(),
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                causal=True,
                softmax_scale=self.softmax_scale,
            )
        if out_shape is not None:
            return out.reshape(out_shape)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()
