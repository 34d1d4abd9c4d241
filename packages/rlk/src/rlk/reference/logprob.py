"""Reference log-prob primitives: the readable specification and ground truth.

For a row with scaled logits ``z = x * inv_temperature`` over a vocabulary of
size ``V`` and target ``y``::

    lse      = logsumexp_v z_v
    logprob  = z_y - lse
    entropy  = lse - sum_v p_v z_v,        p = softmax(z)

computed online over vocab tiles with a running max ``m``, sum ``s`` and
weighted sum ``b``, both relative to ``m``::

    s = sum_v exp(z_v - m),    b = sum_v (z_v - m) * exp(z_v - m)   (<= 0)

    m' = max(m, max_tile z)
    s' = s * exp(m - m') + sum_tile exp(z - m')
    b' = (b + (m - m') * s) * exp(m - m') + sum_tile (z - m') * exp(z - m')
    lse = m + log(s),  entropy = log(s) - b / s

``log(s) >= 0`` (the max term is ``exp(0) = 1``) and ``-b / s >= 0``, so the
entropy is ``>= 0`` by construction and its rounding follows the entropy, not
the size of the logits (``lse - sum_v p_v z_v`` would cancel two numbers of size
``|z|``). Two partial states merge the same way: each is moved to the common max
``m' = max(m1, m2)`` by ``b + (m - m') * s`` and the factor ``exp(m - m')``.

The running max starts at ``-inf`` with ``s = b = 0``; a state or a logit whose
factor ``exp(.)`` is 0 contributes nothing (the products ``0 * -inf`` count as
0), so rows with some ``-inf`` logits give finite entropy. A row whose logits
are all ``-inf`` has no distribution and gives NaN, as ``torch.log_softmax``
does.

Gradients with respect to ``z`` (then multiplied by ``inv_temperature`` for
``x``)::

    d logprob / d z_v = onehot(y)_v - p_v
    d entropy / d z_v = p_v * (E_p[z] - z_v),      E_p[z] = lse - entropy

For ``linear_logprob`` the logits are ``x = hidden @ weight.T`` and the chain
rule gives ``grad_hidden = G @ weight`` and ``grad_weight = G.T @ hidden`` with
``G = d loss / d x``.

Math runs in fp32 (fp64 when the inputs are fp64, which is how the contract
tests build ground truth). Work is chunked over rows and vocab, so memory
beyond inputs and outputs is one ``[ROW_CHUNK, VOCAB_CHUNK]`` tile plus
per-row state (plus fp32 gradient accumulators in the linear backward).
The reference is deterministic; it does not promise batch invariance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW_CHUNK = 256
VOCAB_CHUNK = 8192

# tile(row_start, row_end, vocab_start, vocab_end) -> scaled logits z, compute dtype
ZTile = Callable[[int, int, int, int], torch.Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits_tile(logits: torch.Tensor, inv_t: torch.Tensor) -> ZTile:
    cdt = _compute_dtype(logits.dtype)

    def tile(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        return logits[r0:r1, v0:v1].to(cdt) * inv_t[r0:r1, None].to(cdt)

    return tile


def _linear_tile(hidden: torch.Tensor, weight: torch.Tensor, inv_t: torch.Tensor) -> ZTile:
    cdt = _compute_dtype(hidden.dtype)

    def tile(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        x = hidden[r0:r1].to(cdt) @ weight[v0:v1].to(cdt).T
        return x * inv_t[r0:r1, None].to(cdt)

    return tile


def _forward(
    tile: ZTile,
    n_rows: int,
    vocab: int,
    targets: torch.Tensor,
    ignore_index: int,
    logprob_out: torch.Tensor,
    entropy_out: torch.Tensor | None,
    lse_out: torch.Tensor,
) -> None:
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        t = targets[r0:r1]
        m = s = b = z_target = None
        for v0 in range(0, vocab, VOCAB_CHUNK):
            v1 = min(vocab, v0 + VOCAB_CHUNK)
            z = tile(r0, r1, v0, v1)
            if m is None:
                m = torch.full_like(z[:, 0], -torch.inf)
                s, b, z_target = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
            m_new = torch.maximum(m, z.amax(dim=1))
            # Shift by 0 while a row has seen only -inf, so no exp sees (-inf) - (-inf).
            shift = torch.where(m_new == -torch.inf, 0.0, m_new)
            # The old state moved to the new max: exp(m - m') and b + (m - m') s (0 where the factor is 0:
            # m = -inf, s = 0 at the start).
            rescale = torch.exp(m - shift)
            b = torch.where(rescale > 0, (b + (m - shift) * s) * rescale, 0.0)
            s = s * rescale
            d = z - shift[:, None]  # <= 0
            e = torch.exp(d)
            s = s + e.sum(dim=1)
            b = b + torch.where(e > 0, d * e, 0.0).sum(dim=1)
            m = m_new
            in_tile = (t >= v0) & (t < v1)
            local = (t - v0).clamp(0, v1 - v0 - 1)
            z_target = torch.where(in_tile, z.gather(1, local[:, None]).squeeze(1), z_target)
        lse = m + torch.log(s)
        valid = t != ignore_index
        logprob_out[r0:r1] = torch.where(valid, z_target - lse, 0.0)
        lse_out[r0:r1] = lse
        if entropy_out is not None:
            entropy_out[r0:r1] = torch.where(valid, torch.log(s) - b / s, 0.0)


def _grad_z(
    z: torch.Tensor,
    t: torch.Tensor,
    v0: int,
    inv_t: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
) -> torch.Tensor:
    """d loss / d x for one tile (x the unscaled logits), zero on ignored rows."""
    cdt = z.dtype
    valid = t != ignore_index
    p = torch.exp(z - lse.to(cdt)[:, None])
    g_lp = grad_logprob.to(cdt)[:, None]
    g = -g_lp * p
    local = t - v0
    hit = valid & (local >= 0) & (local < z.shape[1])
    rows = hit.nonzero().squeeze(1)
    g[rows, local[rows]] += g_lp[rows, 0]
    if grad_entropy is not None:
        mean_z = (lse - entropy).to(cdt)[:, None]
        g_ent = grad_entropy.to(cdt)[:, None] * p * (mean_z - z)
        g = g + torch.where(p > 0, g_ent, 0.0)
    g = g * inv_t.to(cdt)[:, None]
    return torch.where(valid[:, None], g, 0.0)


def selected_logprob_fwd(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    n_rows, vocab = logits.shape
    tile = _logits_tile(logits, inv_temperature)
    _forward(tile, n_rows, vocab, targets, ignore_index, logprob_out, entropy_out, lse_out)


def selected_logprob_bwd(
    logits, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_logits_out
):
    n_rows, vocab = logits.shape
    tile = _logits_tile(logits, inv_temperature)
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        rows = slice(r0, r1)
        ent = None if entropy is None else entropy[rows]
        g_ent = None if grad_entropy is None else grad_entropy[rows]
        for v0 in range(0, vocab, VOCAB_CHUNK):
            v1 = min(vocab, v0 + VOCAB_CHUNK)
            g = _grad_z(
                tile(r0, r1, v0, v1), targets[rows], v0, inv_temperature[rows], lse[rows], ent,
                grad_logprob[rows], g_ent, ignore_index,
            )
            grad_logits_out[r0:r1, v0:v1] = g


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    tile = _linear_tile(hidden, weight, inv_temperature)
    _forward(tile, hidden.shape[0], weight.shape[0], targets, ignore_index, logprob_out, entropy_out, lse_out)


def linear_logprob_bwd(
    hidden, weight, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index,
    grad_hidden_out, grad_weight_out,
):
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden.dtype)
    tile = _linear_tile(hidden, weight, inv_temperature)
    grad_hidden_acc = None
    if grad_hidden_out is not None:
        grad_hidden_acc = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device)
    for v0 in range(0, vocab, VOCAB_CHUNK):
        v1 = min(vocab, v0 + VOCAB_CHUNK)
        w = weight[v0:v1].to(cdt)
        grad_weight_acc = None
        if grad_weight_out is not None:
            grad_weight_acc = torch.zeros(w.shape, dtype=cdt, device=w.device)
        for r0 in range(0, n_rows, ROW_CHUNK):
            r1 = min(n_rows, r0 + ROW_CHUNK)
            rows = slice(r0, r1)
            ent = None if entropy is None else entropy[rows]
            g_ent = None if grad_entropy is None else grad_entropy[rows]
            g = _grad_z(
                tile(r0, r1, v0, v1), targets[rows], v0, inv_temperature[rows], lse[rows], ent,
                grad_logprob[rows], g_ent, ignore_index,
            )
            if grad_hidden_acc is not None:
                grad_hidden_acc[rows] += g @ w
            if grad_weight_acc is not None:
                grad_weight_acc += g.T @ hidden[rows].to(cdt)
        if grad_weight_acc is not None:
            grad_weight_out[v0:v1] = grad_weight_acc
    if grad_hidden_out is not None:
        grad_hidden_out.copy_(grad_hidden_acc)
