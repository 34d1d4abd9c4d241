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
    lse = m + log(s),  logprob = (z_y - m) - log(s),  entropy = log(s) - b / s

``log(s) >= 0`` (the max term is ``exp(0) = 1``) and ``-b / s >= 0``, so the
entropy is ``>= 0`` by construction and its rounding follows the entropy, not
the size of the logits (``lse - sum_v p_v z_v`` would cancel two numbers of size
``|z|``). The log-prob is computed the same way, relative to the max:
``logprob = (z_y - m) - log(s)``, two terms ``<= 0`` (``z_y - m`` is one rounding of
a number of the log-prob's size, exact when ``z_y`` lies within a factor 2 of
``m``), so it is ``<= 0`` by construction and, given ``z``, accurate to its own
size for logits of any magnitude (all equal at 1e6 or 3e38, offset by 1e5), where
``z_y - lse`` would carry the rounding of ``lse`` at the magnitude of ``z``
(``ulp(1e6) = 0.0625``; ``3e38 + log V`` rounds to ``3e38``). The gradient's
``p = exp(z - lse)`` still carries that rounding: a relative error of about
``|lse| 2^-24`` in ``p``, which the contract's row scale ``1 + |lse| + |z_y|``
allows. Two partial states merge the same way: each is moved to the common max
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

Vocab-parallel alignment (``linear_logprob``): the vocabulary is cut into
``L = tree_leaves(V)`` equal *leaves* (``L`` the largest power of two <= 8
dividing ``V``: :func:`rlk.reference.matmul.tree_leaves`); each leaf is walked
in ``VOCAB_CHUNK`` tiles from its own start, and the leaves' states are merged (``_merge``) in the fixed binary tree
of :func:`rlk.reference.matmul.tree_reduce`. A vocab shard of ``P`` ranks (``P`` in 1, 2, 4, 8;
rank ``r`` holds rows ``[r V / P, (r + 1) V / P)``) is then ``L / P`` whole
leaves, a subtree: :func:`linear_logprob_shard_fwd` computes its state and
:func:`linear_logprob_combine_fwd` merges the ranks' states in the same tree,
so the result has the single-device bits. The backward's ``grad_hidden`` is a
sum over leaves in the same tree (``linear_logprob_shard_bwd`` /
``linear_logprob_combine_bwd``); ``selected_logprob`` walks the vocab as one
leaf.

Math runs in fp32 (fp64 when the inputs are fp64, which is how the contract
tests build ground truth). Work is chunked over rows and vocab, so memory
beyond inputs and outputs is one ``[ROW_CHUNK, VOCAB_CHUNK]`` tile plus
per-row state (plus fp32 gradient accumulators in the linear backward: one
per level of the leaf tree, at most 4).
The reference is deterministic; it does not promise batch invariance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlk.core.checks import compute_dtype
from rlk.reference.matmul import tree_leaves, tree_reduce

ROW_CHUNK = 256
VOCAB_CHUNK = 8192

# tile(row_start, row_end, vocab_start, vocab_end) -> scaled logits z, compute dtype
ZTile = Callable[[int, int, int, int], torch.Tensor]


def _logits_tile(logits: torch.Tensor, inv_t: torch.Tensor) -> ZTile:
    cdt = compute_dtype(logits.dtype)

    def tile(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        return logits[r0:r1, v0:v1].to(cdt) * inv_t[r0:r1, None].to(cdt)

    return tile


def _linear_tile(hidden: torch.Tensor, weight: torch.Tensor, inv_t: torch.Tensor) -> ZTile:
    cdt = compute_dtype(hidden.dtype)

    def tile(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        x = hidden[r0:r1].to(cdt) @ weight[v0:v1].to(cdt).T
        return x * inv_t[r0:r1, None].to(cdt)

    return tile


#: At most this many vocab leaves: the vocab-parallel degrees the reduction is aligned with are 1, 2, 4 and 8.
#: Read at every call (1: one leaf, the plain split order of the kernels before the tree).
MAX_TREE_LEAVES = 8


# ---------------------------------------------------------------------------
# online (m, s, b) states
# ---------------------------------------------------------------------------

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _moved(m: torch.Tensor, s: torch.Tensor, b: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, b)`` of a state moved to the max ``shift >= m``: ``s r`` and ``(b + (m - shift) s) r``, ``r = exp(m -
    shift)``; 0 where the factor is 0 (``m = -inf``, ``s = 0``: no ``0 * -inf``)."""
    r = torch.exp(m - shift)
    return s * r, torch.where(r > 0, (b + (m - shift) * s) * r, 0.0)


def _shift(m: torch.Tensor) -> torch.Tensor:
    """The max a state is moved to: 0 while a row has seen only -inf, so no exp sees (-inf) - (-inf)."""
    return torch.where(m == -torch.inf, 0.0, m)


def _online(state: State, z: torch.Tensor) -> State:
    """One tile ``z [R, C]`` of the online update."""
    m, s, b = state
    m_new = torch.maximum(m, z.amax(dim=1))
    shift = _shift(m_new)
    s, b = _moved(m, s, b, shift)
    d = z - shift[:, None]  # <= 0
    e = torch.exp(d)
    return m_new, s + e.sum(dim=1), b + torch.where(e > 0, d * e, 0.0).sum(dim=1)


def _merge(x: State, y: State) -> State:
    """Two states merged, each moved to the common max."""
    m_new = torch.maximum(x[0], y[0])
    shift = _shift(m_new)
    s1, b1 = _moved(*x, shift)
    s2, b2 = _moved(*y, shift)
    return m_new, s1 + s2, b1 + b2


def _tree_states(
    tile: ZTile, r0: int, r1: int, v0: int, v1: int, leaves: int, t: torch.Tensor
) -> tuple[State, torch.Tensor]:
    """The state of rows ``[r0, r1)`` over vocab ``[v0, v1)`` cut into ``leaves`` equal leaves (each walked in
    ``VOCAB_CHUNK`` tiles from its start, the leaves merged by :func:`tree_reduce`), and the target logit of
    targets ``t`` (relative to ``v0``'s numbering) that fall in the range (0 elsewhere)."""
    leaf_size = (v1 - v0) // leaves
    z_target = [None]

    def leaf(j: int) -> State:
        lo = v0 + j * leaf_size
        state = None
        for c0 in range(lo, lo + leaf_size, VOCAB_CHUNK):
            c1 = min(lo + leaf_size, c0 + VOCAB_CHUNK)
            z = tile(r0, r1, c0, c1)
            if state is None:
                state = (torch.full_like(z[:, 0], -torch.inf), torch.zeros_like(z[:, 0]), torch.zeros_like(z[:, 0]))
                if z_target[0] is None:
                    z_target[0] = torch.zeros_like(z[:, 0])
            state = _online(state, z)
            in_tile = (t >= c0) & (t < c1)
            local = (t - c0).clamp(0, c1 - c0 - 1)
            z_target[0] = torch.where(in_tile, z.gather(1, local[:, None]).squeeze(1), z_target[0])
        return state

    state = tree_reduce(leaf, leaves, _merge)
    return state, z_target[0]


def _finish(
    state: State,
    z_target: torch.Tensor,
    t: torch.Tensor,
    ignore_index: int,
    rows: slice,
    logprob_out: torch.Tensor,
    entropy_out: torch.Tensor | None,
    lse_out: torch.Tensor,
) -> None:
    m, s, b = state
    log_s = torch.log(s)
    lse = m + log_s
    valid = t != ignore_index
    logprob_out[rows] = torch.where(valid, (z_target - m) - log_s, 0.0)
    lse_out[rows] = lse
    if entropy_out is not None:
        entropy_out[rows] = torch.where(valid, torch.log(s) - b / s, 0.0)


def _forward(
    tile: ZTile,
    n_rows: int,
    vocab: int,
    leaves: int,
    targets: torch.Tensor,
    ignore_index: int,
    logprob_out: torch.Tensor,
    entropy_out: torch.Tensor | None,
    lse_out: torch.Tensor,
) -> None:
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        t = targets[r0:r1]
        state, z_target = _tree_states(tile, r0, r1, 0, vocab, leaves, t)
        _finish(state, z_target, t, ignore_index, slice(r0, r1), logprob_out, entropy_out, lse_out)


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
    _forward(tile, n_rows, vocab, 1, targets, ignore_index, logprob_out, entropy_out, lse_out)


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
                tile(r0, r1, v0, v1),
                targets[rows],
                v0,
                inv_temperature[rows],
                lse[rows],
                ent,
                grad_logprob[rows],
                g_ent,
                ignore_index,
            )
            grad_logits_out[r0:r1, v0:v1] = g


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the partial results a vocab shard hands to the combine (fp32; fp64 for fp64 inputs)."""
    return compute_dtype(dtype)


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    vocab = weight.shape[0]
    tile = _linear_tile(hidden, weight, inv_temperature)
    leaves = tree_leaves(vocab, MAX_TREE_LEAVES)
    _forward(tile, hidden.shape[0], vocab, leaves, targets, ignore_index, logprob_out, entropy_out, lse_out)


def linear_logprob_stored_fwd(
    hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, logits_out
):
    """:func:`linear_logprob_fwd`, and every tile of scaled logits ``z`` it reduces is also written to
    ``logits_out`` ``[N, V]`` (compute dtype): the same tiles in the same order, so the log-prob, entropy and lse
    are ``linear_logprob_fwd``'s bits."""
    vocab = weight.shape[0]
    tile = _linear_tile(hidden, weight, inv_temperature)

    def storing(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        z = tile(r0, r1, v0, v1)
        logits_out[r0:r1, v0:v1] = z
        return z

    leaves = tree_leaves(vocab, MAX_TREE_LEAVES)
    _forward(storing, hidden.shape[0], vocab, leaves, targets, ignore_index, logprob_out, entropy_out, lse_out)


def linear_logprob_shard_fwd(hidden, weight, targets, inv_temperature, leaves, state_out, z_target_out):
    """The partial forward of one vocab shard of ``leaves`` whole leaves of the full vocabulary's tree.

    ``weight`` ``[V_s, H]`` is the shard, ``targets`` ``[N]`` are relative to its first row (values outside
    ``[0, V_s)`` are not in the shard). Writes the shard's merged state ``state_out [3, N]`` (``m``, ``s``,
    ``b``, in :func:`partial_dtype`) and ``z_target_out [N]``, the target's scaled logit where the target is in
    the shard (0 elsewhere).
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    tile = _linear_tile(hidden, weight, inv_temperature)
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        (m, s, b), z_target = _tree_states(tile, r0, r1, 0, vocab, leaves, targets[r0:r1])
        state_out[0, r0:r1], state_out[1, r0:r1], state_out[2, r0:r1] = m, s, b
        z_target_out[r0:r1] = z_target


def linear_logprob_combine_fwd(states, z_target, targets, ignore_index, logprob_out, entropy_out, lse_out):
    """Merge the shards' states ``states [P, 3, N]`` (``P`` a power of two, shard order) in the tree of
    :func:`tree_reduce` and finish as :func:`linear_logprob_fwd` does; ``z_target [N]`` is the target logit
    taken from the shard that holds the target, ``targets`` the global ones (for ``ignore_index``)."""
    n_rows = states.shape[2]
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        rows = slice(r0, r1)
        state = tree_reduce(lambda j, rows=rows: tuple(states[j, :, rows]), states.shape[0], _merge)
        _finish(state, z_target[r0:r1], targets[r0:r1], ignore_index, slice(r0, r1), logprob_out, entropy_out, lse_out)


def _linear_bwd_leaves(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    leaves,
    grad_weight_out,
    need_grad_hidden,
    tile: ZTile | None = None,
    accumulate: bool = False,
):
    """``grad_weight_out`` (if given) and the leaf tree's sum of ``G @ weight`` (if ``need_grad_hidden``), in the
    compute dtype: each leaf sums its ``VOCAB_CHUNK`` chunks in order, the leaves are summed by :func:`tree_reduce`.
    ``tile`` gives the scaled logits (default: recomputed from hidden and weight); ``accumulate`` adds the weight
    gradient to ``grad_weight_out`` instead of writing it."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    if tile is None:
        tile = _linear_tile(hidden, weight, inv_temperature)
    leaf_size = vocab // leaves

    def leaf(j: int):
        acc = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_grad_hidden else None
        lo = j * leaf_size
        for v0 in range(lo, lo + leaf_size, VOCAB_CHUNK):
            v1 = min(lo + leaf_size, v0 + VOCAB_CHUNK)
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
                    tile(r0, r1, v0, v1),
                    targets[rows],
                    v0,
                    inv_temperature[rows],
                    lse[rows],
                    ent,
                    grad_logprob[rows],
                    g_ent,
                    ignore_index,
                )
                if acc is not None:
                    acc[rows] += g @ w
                if grad_weight_acc is not None:
                    grad_weight_acc += g.T @ hidden[rows].to(cdt)
            if grad_weight_acc is not None:
                if accumulate:
                    grad_weight_out[v0:v1] += grad_weight_acc
                else:
                    grad_weight_out[v0:v1] = grad_weight_acc
        return acc

    return tree_reduce(leaf, leaves, lambda a, b: None if a is None else a + b)


def linear_logprob_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    grad_hidden_out,
    grad_weight_out,
):
    acc = _linear_bwd_leaves(
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        ignore_index,
        tree_leaves(weight.shape[0], MAX_TREE_LEAVES),
        grad_weight_out,
        grad_hidden_out is not None,
    )
    if grad_hidden_out is not None:
        grad_hidden_out.copy_(acc)


def linear_logprob_stored_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    logits,
    grad_hidden_out,
    grad_weight_out,
    accumulate,
):
    """:func:`linear_logprob_bwd` with the scaled logits read from ``logits`` ``[N, V]`` (the forward's
    ``logits_out``) instead of recomputed: the same tiles, sums and tree. ``grad_weight_out`` (compute dtype, or
    ``weight.dtype`` when not accumulating) gets ``G.T @ hidden``, added to it with ``accumulate``; ``logits`` is
    left as it is (the ABI lets a backend overwrite it)."""

    def stored(r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        return logits[r0:r1, v0:v1]

    acc = _linear_bwd_leaves(
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        ignore_index,
        tree_leaves(weight.shape[0], MAX_TREE_LEAVES),
        grad_weight_out,
        grad_hidden_out is not None,
        tile=stored,
        accumulate=accumulate,
    )
    if grad_hidden_out is not None:
        grad_hidden_out.copy_(acc)


def linear_logprob_shard_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    leaves,
    grad_hidden_partial_out,
    grad_weight_out,
):
    """The backward of one vocab shard (``leaves`` whole leaves; ``targets`` relative to the shard, ``lse`` and
    ``entropy`` the combined ones): ``grad_weight_out`` ``[V_s, H]`` (the shard's rows of the full gradient) and
    ``grad_hidden_partial_out`` ``[N, H]`` in :func:`partial_dtype`, the shard's subtree of the ``grad_hidden``
    sum (either may be None)."""
    acc = _linear_bwd_leaves(
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        ignore_index,
        leaves,
        grad_weight_out,
        grad_hidden_partial_out is not None,
    )
    if grad_hidden_partial_out is not None:
        grad_hidden_partial_out.copy_(acc)


def linear_logprob_combine_bwd(partials, grad_hidden_out):
    """``grad_hidden_out`` = the shards' partials ``[P, N, H]`` summed in the tree of :func:`tree_reduce`, rounded
    once to its dtype (as :func:`linear_logprob_bwd` does)."""
    grad_hidden_out.copy_(tree_reduce(lambda j: partials[j], partials.shape[0], lambda a, b: a + b))
