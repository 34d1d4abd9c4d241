"""Public op ``sample``: batch-invariant fused sampling of one token per row from logits (temperature, top-k,
top-p, min-p, Gumbel-max with a counter-based Philox4x32-10 RNG keyed by each row's seed and step).

Not a ``custom_op.declare`` op: it has no gradient and its outputs are integer tokens; like ``ema_`` the public
function checks its arguments, allocates the outputs and calls the ``sample_fwd`` primitive of the backend
``rlk.core.dispatch.select("sample", device, dtype)`` chooses. ``torch.compile`` runs it eagerly (a graph break).
The definition (filters, RNG, tie rules) is the spec in :mod:`rlk.reference.sampling`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, dispatch
from rlk.reference.sampling import MAX_VOCAB

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _row_ids(name: str, value, rows: int, device: torch.device) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected an int64 tensor of shape [{rows}], got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype int64, got {value.dtype}")
    if value.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},) (one per row of logits), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of logits), got {value.device}")
    return value.contiguous()


@torch.compiler.disable
def sample(
    logits: Tensor,
    seed: Tensor,
    step: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row, batch-invariantly: ``(tokens int64 [B], logprobs fp32 [B])``.

    Gumbel-max over the tokens the filters keep: ``token = argmax_v (z_v + g_v)``, ``z = (x - max x) * fp32(1 /
    temperature)`` in fp32 (``x = fp32(logits)``; ``z = 0`` at the max logits, so ``z`` lies in ``[-inf, 0]`` and
    never overflows, whatever the temperature), ``g_v = -log(-log(u_v))`` with ``u_v`` from Philox4x32-10 keyed by
    the row's ``seed``, counter ``(v // 4, 0, step lo32, step hi32)``, lane ``v % 4``; ties go to the lowest index.
    A row's token and logprob depend only on its own logits, seed and step: bitwise the same whatever the batch,
    the row's position in it, and the backend (reference or Triton). No host synchronization.

    Non-finite logits have a defined result (no error: checking them would synchronize), the same on every
    backend: a NaN logit counts as ``-inf`` (never drawn from a row with a logit above ``-inf``); ``+inf`` logits
    share the row's probability equally (each has ``z = 0``, the other tokens ``z = -inf``); a row of ``-inf`` /
    NaN logits only is uniform. The logprob is always finite and ``<= 0``.

    Filters (all on the scaled logits ``z``, thresholds in the total order of their fp32 bits):

    * ``top_k`` (0: off; ``>= V``: off): keep ``z_v >=`` the k-th largest value (counted with multiplicity):
      every token tied with the k-th value is kept, so more than k tokens may remain;
    * ``top_p`` (1: off): among the top-k survivors, keep the smallest set of largest-probability tokens whose
      mass reaches ``p`` (masses as exact integers ``floor(e_v 2^36)``, ``e_v = exp(z_v - max z)`` rounded to fp32;
      ``p`` rounded to fp32); tokens tied with the threshold value are kept;
    * ``min_p`` (0: off): keep tokens with ``prob >= min_p * max prob`` (``e_v >= fp32(min_p)``), on the full
      distribution.

    Args:
        logits: ``[B, V]`` bfloat16, float16 or float32 (rows may be strided; the last dim is made contiguous).
            Any values (non-finite ones: above).
        seed: int64 ``[B]``, each row's RNG key (all 64 bits used).
        step: int64 ``[B]``, each row's step counter (all 64 bits used): a new step gives a new draw.
        temperature: ``>= 0`` with ``1 / temperature`` finite in fp32 (``>= 2.9e-39``); 0 means greedy (argmax
            of the logits, lowest index; filters ignored; the logprob is then under temperature 1). A tiny
            temperature puts the mass on the max logits (the others' ``z`` overflows to ``-inf``: probability 0).
        top_k: int ``>= 0``.
        top_p: in ``(0, 1]``.
        min_p: in ``[0, 1]``.

    Returns:
        ``tokens`` int64 ``[B]`` and ``logprobs`` fp32 ``[B]``: the sampled token's log-prob under the
        temperature-scaled distribution BEFORE filtering (``log_softmax(z)[token]``, what a training forward
        recomputes), computed in fp64 and rounded once; finite and ``<= 0``.
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D tensor [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits: expected dtype bfloat16, float16 or float32, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits: expected V >= 1 (an empty vocabulary)")
    if vocab >= MAX_VOCAB:
        raise ValueError(f"logits: expected V < {MAX_VOCAB}, got {vocab}")
    seed = _row_ids("seed", seed, rows, logits.device)
    step = _row_ids("step", step, rows, logits.device)
    temperature = checks.number("temperature", temperature, minimum=0.0)
    top_k = checks.integer("top_k", top_k, minimum=0)
    top_p = checks.number("top_p", top_p, above=0.0, maximum=1.0)
    min_p = checks.number("min_p", min_p, minimum=0.0, maximum=1.0)
    greedy = temperature == 0.0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    checks.number("temperature", inv_temperature, dtype=torch.float32)  # 1 / T finite and nonzero in fp32
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dispatch.select("sample", logits.device, logits.dtype).primitives["sample_fwd"](
        logits.detach(), seed, step, inv_temperature, top_k, top_p, min_p, greedy, tokens, logprobs
    )
    return tokens, logprobs
