"""Triton kernels of ``scatter_rewards`` (rewards and costs of sequences and regions to ``[B, T]`` tokens).

The math is the spec in :mod:`rlk.reference.rewards`; the op is not differentiable. No atomics; every reduction
runs in a fixed order, and each kernel reads one row, one region or one group, so a sequence's outputs are the
same bits whatever the other groups and wherever its group sits:

* ``_scores_kernel``, one program per row: the row's mask in chunks of ``BLOCK_T`` (its length, an exact int32
  count, and its last masked position, an exact max), then the score: the reward columns weighted and added left to
  right (NaN entries skipped), plus the overlong penalty.
* the normalization: :func:`rlk_triton.advantages.group_advantages_fwd`, the kernel of ``group_advantages`` (one
  program per group, members in batch order), run on the scores, the costs, the region rewards and the region
  costs, each on its own (a region's group is its sequence's; a group's regions keep their index order).
* ``_region_last_kernel``, one program per region (``placement="last"``): the last masked position of its span.
* ``_place_kernel``, one program per ``(row, chunk of BLOCK_T positions)``: the sequence's value on its last masked
  position or on every masked one, then the row's regions in ascending region index (a CSR of the regions by row,
  built on the device by a stable sort: no host synchronization), each added where it lands.

The placement adds the same values in the same order as the reference, so it is exact given the normalized values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton import advantages
from rlk_triton.common import on_device

#: Fixed tile configuration (fp32; the op layer upcasts 16-bit inputs). The launchers read it at every call, so a
#: test may overwrite entries. Nothing depends on the batch.
#:
#: * ``"row"``: mask positions per chunk of the per-row score program and of the per-region span scan.
#: * ``"place"``: positions per placement program (its second grid dimension is ``cdiv(T, BLOCK_T)``).
TILE_CONFIGS: dict[str, dict[str, int]] = {
    "row": {"BLOCK_T": 1024, "num_warps": 4},
    "place": {"BLOCK_T": 1024, "num_warps": 4},
}


@triton.jit
def _scores_kernel(
    rewards_ptr,
    weights_ptr,
    mask_ptr,
    scores_ptr,
    last_ptr,
    n_cols,
    n_rewards,
    max_len,
    cache,
    penalty,
    OVERLONG: tl.constexpr,
    LAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Row ``i``: ``last[i]`` (``LAST``: its last masked position, -1 if none) and ``scores[i]`` (module docstring)."""
    i = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_T)
    count = tl.zeros((), tl.int32)
    last = tl.full((), -1, tl.int32)
    if OVERLONG or LAST:
        for t0 in range(0, n_cols, BLOCK_T):
            t = t0 + lane
            m = tl.load(mask_ptr + i * n_cols + t, mask=t < n_cols, other=0) != 0
            count += tl.sum(m.to(tl.int32))
            last = tl.maximum(last, tl.max(tl.where(m, t, -1)))
    if LAST:
        tl.store(last_ptr + i, last)
    s = 0.0
    for r in range(0, n_rewards):
        x = tl.load(rewards_ptr + i * n_rewards + r)
        w = tl.load(weights_ptr + r)
        s += tl.where(x != x, 0.0, w * x)
    if OVERLONG:
        excess = tl.minimum(tl.maximum(count - (max_len - cache), 0), cache)
        ratio = tl.where(count > max_len, 1.0, tl.div_rn(excess.to(tl.float32), tl.maximum(cache, 1).to(tl.float32)))
        s += -(penalty * ratio)
    tl.store(scores_ptr + i, s)


@triton.jit
def _region_last_kernel(spans_ptr, mask_ptr, last_ptr, n_rows, n_cols, BLOCK_T: tl.constexpr):
    """Region ``k``: the last masked position of its span ``[start, end)``, or -1 (spans clamped into the mask: the
    op layer checks them, and an unchecked one must not read outside it)."""
    k = tl.program_id(0).to(tl.int64)
    seq = tl.minimum(tl.maximum(tl.load(spans_ptr + 3 * k), 0), n_rows - 1)
    start = tl.maximum(tl.load(spans_ptr + 3 * k + 1), 0)
    end = tl.minimum(tl.load(spans_ptr + 3 * k + 2), n_cols)
    lane = tl.arange(0, BLOCK_T)
    last = tl.full((), -1, tl.int64)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + lane
        m = tl.load(mask_ptr + seq * n_cols + t, mask=t < end, other=0) != 0
        last = tl.maximum(last, tl.max(tl.where(m, t, -1)))
    tl.store(last_ptr + k, last)


@triton.jit
def _place_kernel(
    values_ptr,
    last_ptr,
    mask_ptr,
    out_ptr,
    offsets_ptr,
    perm_ptr,
    spans_ptr,
    region_values_ptr,
    region_last_ptr,
    n_cols,
    BROADCAST: tl.constexpr,
    REGIONS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Positions ``[c * BLOCK_T, (c + 1) * BLOCK_T)`` of row ``i``: the row's value, then its regions' in order."""
    i = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < n_cols
    m = tl.load(mask_ptr + i * n_cols + t, mask=inb, other=0) != 0
    a = tl.load(values_ptr + i)
    if BROADCAST:
        out = tl.where(m, a, 0.0)
    else:
        out = tl.where(t == tl.load(last_ptr + i), a, 0.0)
    if REGIONS:
        for j in range(tl.load(offsets_ptr + i), tl.load(offsets_ptr + i + 1)):
            r = tl.load(perm_ptr + j)
            v = tl.load(region_values_ptr + r)
            if BROADCAST:
                hit = m & (t >= tl.load(spans_ptr + 3 * r + 1)) & (t < tl.load(spans_ptr + 3 * r + 2))
            else:
                hit = t == tl.load(region_last_ptr + r)
            out = tl.where(hit, out + v, out)
    tl.store(out_ptr + i * n_cols + t, out, mask=inb)


def _normalize(values, group_index, group_size, mode, eps):
    """``values`` normalized over its groups by ``group_advantages``' kernel, or as they are for ``mode`` None."""
    if mode is None:
        return values
    out = torch.empty_like(values)
    advantages.group_advantages_fwd(values, group_index, group_size, None, mode, eps, out)
    return out


def _region_groups(seq, group_index, group_size):
    """A region's group id is its sequence's (clamped: an unchecked span must not index outside)."""
    if group_index is None:
        return seq // group_size
    return group_index[seq.clamp(0, group_index.shape[0] - 1)]


def _place(values, last, mask, regions, broadcast, out):
    """One channel (rewards or costs) into ``out``; ``regions`` is None or ``(values, spans, group values)``."""
    n_rows, n_cols = mask.shape
    cfg = TILE_CONFIGS["place"]
    if regions is None:
        offsets = perm = spans = region_values = region_last = values  # unused
    else:
        region_values, spans = regions
        sorted_seq, perm = torch.sort(spans[:, 0], stable=True)
        offsets = torch.searchsorted(sorted_seq, torch.arange(n_rows + 1, device=mask.device))
        region_last = region_values  # unused by broadcast
        if not broadcast:
            region_last = torch.empty(spans.shape[0], dtype=torch.int64, device=mask.device)
            row = TILE_CONFIGS["row"]
            _region_last_kernel[(spans.shape[0],)](
                spans, mask, region_last, n_rows, n_cols, BLOCK_T=row["BLOCK_T"], num_warps=row["num_warps"]
            )
    _place_kernel[(n_rows, triton.cdiv(n_cols, cfg["BLOCK_T"]))](
        values,
        last,
        mask,
        out,
        offsets,
        perm,
        spans,
        region_values,
        region_last,
        n_cols,
        BROADCAST=broadcast,
        REGIONS=regions is not None,
        BLOCK_T=cfg["BLOCK_T"],
        num_warps=cfg["num_warps"],
    )


def scatter_rewards_fwd(
    rewards,
    reward_weights,
    mask,
    costs,
    region_values,
    region_spans,
    cost_region_values,
    cost_region_spans,
    group_index,
    group_size,
    mode,
    eps,
    placement,
    overlong_max_len,
    overlong_cache,
    overlong_penalty,
    rewards_out,
    costs_out,
):
    """Token rewards (and costs) into ``rewards_out`` (``costs_out``) ``[B, T]`` fp32.

    Args and math: :func:`rlk.reference.rewards.scatter_rewards_fwd`. Launches the per-row score kernel, the group
    kernel per normalized list, the per-region span scan (``last``) and the placement, once per channel.
    """
    n_rows, n_cols = mask.shape
    broadcast = placement == "broadcast"
    scores = torch.empty(n_rows, dtype=torch.float32, device=mask.device)
    last = torch.empty(n_rows, dtype=torch.int32, device=mask.device)
    row = TILE_CONFIGS["row"]
    overlong = overlong_max_len is not None
    with on_device(mask.device):
        _scores_kernel[(n_rows,)](
            rewards,
            reward_weights,
            mask,
            scores,
            last,
            n_cols,
            rewards.shape[1],
            overlong_max_len if overlong else 0,
            overlong_cache,
            overlong_penalty,
            OVERLONG=overlong,
            LAST=not broadcast,
            BLOCK_T=row["BLOCK_T"],
            num_warps=row["num_warps"],
        )
        channels = [(scores, region_values, region_spans, rewards_out)]
        if costs_out is not None:
            channels.append((costs, cost_region_values, cost_region_spans, costs_out))
        for values, reg_values, spans, out in channels:
            regions = None
            if reg_values is not None:
                ids = None if mode is None else _region_groups(spans[:, 0], group_index, group_size)
                regions = (_normalize(reg_values, ids, 0, mode, eps), spans)
            _place(_normalize(values, group_index, group_size, mode, eps), last, mask, regions, broadcast, out)
