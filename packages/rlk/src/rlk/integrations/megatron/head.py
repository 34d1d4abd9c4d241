"""Log-probs, entropies and the policy loss of a megatron-core ``GPTModel`` from its last hidden state, the LM head
sharded by vocabulary over the tensor-parallel group and the logits never built
(:func:`rlk.distributed.vocab_parallel_linear_logprob`: bitwise ``rlk.linear_logprob`` on the full head)."""

from __future__ import annotations

import contextlib

from torch import Tensor

from rlk.distributed import vocab_parallel_linear_logprob
from rlk.integrations.megatron.layers import group_size, on_invariant_backend
from rlk.ops.logprob import linear_logprob
from rlk.ops.policy_loss import policy_loss as _policy_loss


def tp_group(model):
    """The model's tensor-parallel process group (``model.pg_collection.tp``, else megatron's global one)."""
    collection = getattr(model, "pg_collection", None)
    if collection is not None and getattr(collection, "tp", None) is not None:
        return collection.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def head_weight(model) -> Tensor:
    """This rank's ``[V / P, H]`` rows of the LM head (the embedding's when the two are shared)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


@contextlib.contextmanager
def _without_head(model):
    post = model.post_process
    model.post_process = False  # GPTModel returns the decoder's output (after its final norm), not logits
    try:
        yield
    finally:
        model.post_process = post


def last_hidden_state(model, input_ids: Tensor, *, packed_seq_params=None) -> Tensor:
    """The final-norm hidden states ``[B, S, H]`` of ``input_ids [B, S]`` (packed: ``[1, T]`` with
    ``packed_seq_params``): ``model``'s own forward, stopped before its output layer. Differentiable."""
    if not getattr(model, "post_process", False):
        raise ValueError("model: a GPTModel built with post_process=True (its last stage holds the final norm)")
    with _without_head(model):
        hidden = model(input_ids, None, None, packed_seq_params=packed_seq_params)
    return hidden.transpose(0, 1)


def logprobs(
    model,
    input_ids: Tensor,
    targets: Tensor,
    *,
    packed_seq_params=None,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
):
    """fp32 ``log softmax(h W^T / T)[targets]`` ``[B, S]`` (and the entropy) of a megatron-core GPTModel, the same
    on every rank of its tensor-parallel group and bitwise the same at any tensor-parallel degree; ``targets``
    aligned with the positions (``targets[b, t]`` is the token position ``t`` predicts; ``ignore_index`` gives 0)."""
    hidden = last_hidden_state(model, input_ids, packed_seq_params=packed_seq_params)
    group = tp_group(model)
    options = dict(temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy)
    with on_invariant_backend("linear_logprob", hidden):
        if group_size(group) == 1:  # rlk's single-device op
            return linear_logprob(hidden, head_weight(model), targets, **options)
        return vocab_parallel_linear_logprob(hidden, head_weight(model), targets, group=group, **options)


def policy_loss(
    model,
    input_ids: Tensor,
    targets: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    packed_seq_params=None,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    **options,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``rlk.policy_loss`` of :func:`logprobs` (``options`` as ``rlk.policy_loss``'s: ``config=``, ``ref_logprob=``,
    ``global_tokens=``...): the loss and metrics, differentiable through the vocab-parallel head without logits.
    ``mask`` defaults to ``targets != ignore_index``; with ``entropy_coef`` in the config the entropy is computed in
    the same pass."""
    config = options.get("config")
    with_entropy = bool(config is not None and getattr(config, "entropy_coef", 0.0))
    out = logprobs(
        model,
        input_ids,
        targets,
        packed_seq_params=packed_seq_params,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=with_entropy,
    )
    if with_entropy:
        logprob, options["entropy"] = out
    else:
        logprob = out
    if mask is None and options.get("loss_spans") is None:
        mask = targets != ignore_index
    return _policy_loss(logprob, old_logprob, advantages, mask, **options)
