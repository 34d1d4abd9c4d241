"""Triton kernels of the policy-loss ops: ``policy_loss`` and ``kl_penalty``.

The math is the spec in :mod:`rlk.reference.policy_loss` (per-token losses, their
derivatives, the KL estimators, the metrics). Layout of the work:

* ``policy_loss_fwd`` runs one program per (row, chunk of ``BLOCK_T`` tokens), so a batch of a
  few long rows still fills the GPU. First, when needed, a count kernel (at most
  ``COUNT_PROGRAMS`` programs, plain stores) writes each row's tokens and each of its programs'
  totals of tokens and non-empty rows, which the token programs add: the counts behind the
  aggregation weights ``c_i`` of :mod:`rlk.reference.aggregation` that the normalizers given do
  not fix. For ``gspo`` and ``geo_mean`` a partial-sum kernel writes each chunk's sums of the
  per-sequence quantities (tokens, log-ratios, advantages, weights), which the main kernel's
  programs add in chunk order (the same small sum in every program of the row) to get ``log s_i``
  or ``R_i``, ``Abar_i``. The main kernel computes per token the loss terms and the gradient
  coefficient of the row's sum, and stores the loss's gradient ``coef * c_i`` (so
  ``policy_loss_and_grad`` needs no second pass over the tokens), the chunk's sums (loss,
  tokens, clipped, ratio, ...) and (chunk 0) ``c_i``. A finish kernel's program per row adds the
  row's chunk sums in chunk order into ``row_stats``; the last of them to finish (an int32 counter) adds the ``[B]``
  rows in row order (``COMBINE_BLOCK``-wide lanes, one final tree) into the loss and the metrics.
  Which program comes last changes no order, hence no bit.
* On CUDA GPUs of compute capability 9.0 and later, each kernel of a call after the first is launched by
  programmatic dependent launch (``PROGRAMMATIC_LAUNCH``): it may start while the kernel ahead of it
  finishes (the token pass loads its tokens meanwhile) and waits (``griddepcontrol.wait``) before it
  reads that kernel's output or stores anything. Nothing it computes changes, only when.
* ``policy_loss_bwd`` is ``grad * upstream``; ``kl_penalty_bwd`` the elementwise product
  ``upstream * coef``.
* ``kl_penalty_fwd`` is elementwise: value and derivative of the estimator, written by the
  same device function (:func:`kl_terms`) the policy-loss kernel uses.

Batch invariance and determinism by construction: the tile sizes are fixed constants (no
autotuning, nothing derived from ``B``), a row's coefficients and partials depend only on
that row's data (its weighted loss and its gradient on its weight ``c_i`` too), the only
atomic is the integer rows-done counter, and every floating-point reduction runs in an order that depends
only on ``T`` (within a row) or ``B`` (the sum over rows). Offsets are int64. Everything is
fp32 (the op layer upcasts 16-bit inputs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlk.core.abi import (
    AGG_MODES,
    KL_ESTIMATORS,
    LOSSES,
    POLICY_METRICS,
    ROW_STATS,
    VESPO_LOG_PHI_MAX,
    VESPO_LOG_W_MAX,
    VESPO_LOG_W_MIN,
)
from rlk_triton.common import on_device

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton built without its CUDA backend (ROCm): programmatic launch is never on there

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


#: Tokens per program of the policy-loss kernels (one chunk of one row); chunk partials per
#: step of the in-row sums; elements per program of the elementwise kernels; rows per step
#: (lanes) of the final sum over rows. Fixed: results never depend on the batch. BLOCK_T and NUM_WARPS:
#: the fastest token pass of tools/sweep_policy_loss.py on the H200 (BLOCK_T 512-4096 x 2-8 warps; again
#: under register limits of 40-64 per thread, see MAX_REGISTERS).
BLOCK_T = 1024
PARTS_BLOCK = 32
BLOCK_ELEMENTWISE = 1024
COMBINE_BLOCK = 128
NUM_WARPS = 4
#: Mask elements per program and step of the count kernel (whole rows: several rows per program when short), and
#: at most this many programs (each writes its totals; the token programs add them: a power of two). H200,
#: [512, 8192]: 3.2 us with 512 programs, 4.0 with 256, 6.2 with 128.
COUNT_ELEMENTS = 8192
COUNT_WARPS = 4
COUNT_PROGRAMS = 512
#: ptxas's register limit per thread of the token pass (``maxnreg``; None: ptxas's choice), CUDA only. H200,
#: [512, 8192]: 56 (no spills; 9 blocks per SM by register count) 19.5 us; ptxas's own choice (72 registers in an
#: offline sm_90 compile, 7 blocks) 20.2; 64: 20.1; 48 spills: 22.1.
MAX_REGISTERS = 56
#: Warps per program of the finish kernel (one program per row; the last one also sums the rows; 2-16 swept).
FINISH_WARPS = 4
#: L2 eviction policy of the token pass's streamed loads and gradient store ("" for the default; evict_first
#: took 1-3 us off the [512, 8192] token pass on the H200 at every tile size swept).
LOAD_EVICTION = "evict_first"
#: Programmatic dependent launch between the kernels of one call (CUDA, compute capability 9.0 and up; see
#: :func:`_programmatic_launch`): each kernel after the first of a call may start while the one before it
#: finishes, and waits for it (``griddepcontrol.wait``) before it reads what that one wrote. H200, [512, 8192]
#: token-mean, steps queued behind a busy GPU (the host ahead, as in training): 28.6-29.2 us per step against
#: 30.0-30.6 without (global_tokens given: 24.0-24.4 against 25.1-25.4); when the GPU waits for each launch, the
#: kernel before has ended and nothing changes.
PROGRAMMATIC_LAUNCH = True

_PPO = tl.constexpr(LOSSES.index("ppo"))
_GSPO = tl.constexpr(LOSSES.index("gspo"))
_CISPO = tl.constexpr(LOSSES.index("cispo"))
_GPG = tl.constexpr(LOSSES.index("gpg"))
_SAPO = tl.constexpr(LOSSES.index("sapo"))
_GEO = tl.constexpr(LOSSES.index("geo_mean"))
# DPPO-Binary trust-region losses
_DPPO_TV = tl.constexpr(LOSSES.index("dppo_tv"))
_DPPO_KL = tl.constexpr(LOSSES.index("dppo_kl"))
_VESPO = tl.constexpr(LOSSES.index("vespo"))
_VESPO_LOG_MIN = tl.constexpr(VESPO_LOG_W_MIN)
_VESPO_LOG_MAX = tl.constexpr(VESPO_LOG_W_MAX)
_VESPO_LOG_PHI_MAX = tl.constexpr(VESPO_LOG_PHI_MAX)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_K1 = tl.constexpr(KL_ESTIMATORS.index("k1"))
_ABS = tl.constexpr(KL_ESTIMATORS.index("abs"))
_K2 = tl.constexpr(KL_ESTIMATORS.index("k2"))
_NUM_STATS = tl.constexpr(len(ROW_STATS))
_STATS_COLS = 16  # ROW_STATS padded to a power of two
_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("token-mean"))
_TOKEN_SUM = tl.constexpr(AGG_MODES.index("token-sum"))
_SEQ_MEAN_TOKEN_SUM = tl.constexpr(AGG_MODES.index("seq-mean-token-sum"))
_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("seq-mean-token-mean"))
_NUM_METRICS = len(POLICY_METRICS)


# ----------------------------------------------------------------------------------------------
# shared device functions
# ----------------------------------------------------------------------------------------------


@triton.jit
def _clamp(x, low, high):
    return tl.minimum(tl.maximum(x, low), high)


@triton.jit
def _times(a, b):
    """``a * b``, and 0 wherever either factor is 0 (:func:`rlk.reference.policy_loss.times`: ``0 * inf`` is 0)."""
    return tl.where((a == 0.0) | (b == 0.0), 0.0, a * b)


@triton.jit
def kl_terms(delta, clamp, EST: tl.constexpr, K3_CLAMP: tl.constexpr, HAS_CLAMP: tl.constexpr, STRAIGHT: tl.constexpr):
    """Value of the KL estimator at ``delta = lp - ref`` and its derivative w.r.t. ``lp``.

    Spec: :func:`rlk.reference.policy_loss.kl_estimate` (k3 with verl's clamps when
    ``K3_CLAMP``; ``clamp`` the symmetric value clamp when ``HAS_CLAMP``; k2's derivative when
    ``STRAIGHT``). A clamp that is active zeroes the derivative.
    """
    if EST == _K1:
        value = delta
        grad = tl.full(delta.shape, 1.0, tl.float32)
    elif EST == _ABS:
        value = tl.abs(delta)
        grad = tl.where(delta > 0, 1.0, tl.where(delta < 0, -1.0, 0.0))
    elif EST == _K2:
        value = 0.5 * delta * delta
        grad = delta
    else:
        x = -delta
        if K3_CLAMP:
            inside = (x >= -20.0) & (x <= 20.0)
            x = _clamp(x, -20.0, 20.0)
        e = tl.exp(x)
        value = e - x - 1.0
        grad = 1.0 - e
        if K3_CLAMP:
            inside = inside & (value >= -10.0) & (value <= 10.0)
            value = _clamp(value, -10.0, 10.0)
            grad = tl.where(inside, grad, 0.0)
    if HAS_CLAMP:
        grad = tl.where((value >= -clamp) & (value <= clamp), grad, 0.0)
        value = _clamp(value, -clamp, clamp)
    if STRAIGHT:
        grad = delta
    return value, grad


# ----------------------------------------------------------------------------------------------
# policy_loss
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_row(ptr, base, offs, inb, m, EVICT: tl.constexpr):
    """``where(m, x, 0)`` of one chunk of a row (masked-out values never take part: -inf is fine); ``EVICT``: the
    load's L2 eviction policy ("" or e.g. "evict_first")."""
    return tl.where(m, tl.load(ptr + base + offs, mask=inb, other=0.0, eviction_policy=EVICT).to(tl.float32), 0.0)


# The int32 scratch ``sync`` of one call: [row tokens (B) | per count program: tokens (COUNT_PROGRAMS), non-empty
# rows (COUNT_PROGRAMS) | the finish kernel's rows-done counter (1)]. Its regions, named once:


@triton.jit
def _program_tokens(sync_ptr, B):
    """Where the count kernel's per-program token totals start."""
    return sync_ptr + B


@triton.jit
def _program_nonempty_rows(sync_ptr, B, COUNT_PROGRAMS: tl.constexpr):
    """Where the count kernel's per-program non-empty-row totals start."""
    return sync_ptr + B + COUNT_PROGRAMS


@triton.jit
def _rows_done(sync_ptr, B, COUNT_PROGRAMS: tl.constexpr):
    """The finish kernel's rows-done counter (zeroed by the token pass)."""
    return sync_ptr + B + 2 * COUNT_PROGRAMS


@triton.jit
def _count_kernel(
    mask_ptr,
    sync_ptr,
    B,
    T,
    n_groups,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    COUNT_PROGRAMS: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """Program ``p`` of ``G <= COUNT_PROGRAMS``: the groups of ``ROWS`` rows ``p, p + G, ...``. Writes (plain stores,
    no atomics, nothing to zero first) each row's tokens at ``sync[row]``, the program's total tokens and non-empty
    rows. ``PDL_TRIGGER``: the next kernel may launch (it waits for this one before it reads the counts)."""
    if PDL_TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    lanes = tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, COLS).to(tl.int64)
    tokens = tl.zeros((ROWS,), tl.int32)
    nonempty = tl.zeros((ROWS,), tl.int32)
    for group in range(pid, n_groups, n_programs):
        rows = group * ROWS + lanes  # < B + ROWS: no int32 overflow before the int64 lanes
        row_in = rows < B
        n = tl.zeros((ROWS,), tl.int32)
        for t0 in range(0, T, COLS):
            offs = t0 + cols
            m = tl.load(
                mask_ptr + rows[:, None] * T + offs[None, :], mask=row_in[:, None] & (offs < T)[None, :], other=0
            )
            n += tl.sum((m != 0).to(tl.int32), axis=1)
        tl.store(sync_ptr + rows, n, mask=row_in)
        tokens += n
        nonempty += tl.where(n > 0, 1, 0)
    tl.store(_program_tokens(sync_ptr, B) + pid, tl.sum(tokens, axis=0))
    tl.store(_program_nonempty_rows(sync_ptr, B, COUNT_PROGRAMS) + pid, tl.sum(nonempty, axis=0))


@triton.jit
def _count_total(first_ptr, n_count_programs, COUNT_PROGRAMS: tl.constexpr):
    """Sum of the ``n_count_programs`` per-program counts from ``first_ptr`` on (integers: exact), as fp32."""
    k = tl.arange(0, COUNT_PROGRAMS)
    parts = tl.load(first_ptr + k, mask=k < n_count_programs, other=0)
    return tl.sum(parts, axis=0).to(tl.float32)


# T and the advantages' row stride are not specialized: Triton picks a tensor's layout (elements per thread) from
# what it can prove of their divisibility, and the layout sets the order of tl.sum; a row padded from 16 to 17
# tokens gave geo_mean gradients 2 ulps apart on an H200 (fuzz long profile) until these two were plain integers.
@triton.jit(do_not_specialize=["T", "adv_stride_b"])
def _seq_partials_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    iw_ptr,
    parts_ptr,
    T,
    n_chunks,
    adv_stride_b,
    adv_stride_t,
    clip_low,
    clip_high,
    clamp_low,
    clamp_high,
    LOSS: tl.constexpr,
    HAS_IW: tl.constexpr,
    BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """Per-chunk partial sums of the per-sequence quantities (``gspo``, ``geo_mean``, ``vespo``).

    Program ``(row, chunk)`` writes ``parts[row, chunk, :] = (tokens, x, adv, iw)`` over its
    ``BLOCK`` tokens: gspo ``x = lp - old``; geo_mean ``x`` = the sign-aware clipped log-ratio; vespo ``x`` = the
    clamped log-ratio plus the clamped log of the importance weight (``adv`` and ``iw`` 0).
    ``PDL_WAIT``: launched programmatically after the count kernel, whose counts it does not read; it still waits
    for it before its stores, so that the kernel after this one, which waits for this one, sees the counts.
    """
    if PDL_TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    base = row * T
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < T
    m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
    d = _load_row(lp_ptr, base, offs, inb, m, EVICT) - _load_row(old_ptr, base, offs, inb, m, EVICT)
    n = tl.where(m, 1.0, 0.0)
    a = tl.zeros((BLOCK,), tl.float32)
    i = tl.zeros((BLOCK,), tl.float32)
    if LOSS == _GSPO:
        x = d
    elif LOSS == _VESPO:
        x = tl.where(m, _clamp(d, clamp_low, clamp_high), 0.0)
        if HAS_IW:
            log_iw = tl.log(_load_row(iw_ptr, base, offs, inb, m, EVICT))
            x += tl.where(m, _clamp(log_iw, _VESPO_LOG_MIN, _VESPO_LOG_MAX), 0.0)
    else:
        a = tl.where(m, tl.load(adv_ptr + row * adv_stride_b + offs * adv_stride_t, mask=inb, other=0.0), 0.0)
        dc = _clamp(d, clamp_low, clamp_high)
        x = tl.where(
            m, tl.where(a > 0, tl.minimum(dc, clip_high), tl.where(a < 0, tl.maximum(dc, -clip_low), 0.0)), 0.0
        )
        if HAS_IW:
            i = _load_row(iw_ptr, base, offs, inb, m, EVICT)
    if PDL_WAIT:
        gdc_wait()
    out = parts_ptr + (row * n_chunks + chunk) * 4
    tl.store(out + 0, tl.sum(n, axis=0))
    tl.store(out + 1, tl.sum(x, axis=0))
    tl.store(out + 2, tl.sum(a, axis=0))
    tl.store(out + 3, tl.sum(i, axis=0))


@triton.jit
def _normalizer(ptr, value, FROM_PTR: tl.constexpr):
    """A normalizer given as a one-element fp32 tensor (``FROM_PTR``) or as a number."""
    if FROM_PTR:
        value = tl.load(ptr).to(tl.float32)
    return value


@triton.jit
def _row_weight(
    sync_ptr,
    row,
    B,
    n_count_programs,
    gtok_ptr,
    gseq_ptr,
    scale_ptr,
    gtok,
    gseq,
    loss_scale,
    AGG: tl.constexpr,
    HAS_GTOK: tl.constexpr,
    GTOK_PTR: tl.constexpr,
    HAS_GSEQ: tl.constexpr,
    GSEQ_PTR: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    COUNT_PROGRAMS: tl.constexpr,
):
    """The aggregation weight ``c_i`` of row ``row`` (:func:`rlk.reference.aggregation.row_weights`): from the
    normalizers given, else from the counts of :func:`_count_kernel` (exact in fp32 up to 2^24 tokens). The
    divisions are correctly rounded (``div_rn``), as the reference's: the same bits."""
    if AGG == _TOKEN_SUM:
        c = 1.0
    elif AGG == _TOKEN_MEAN:
        if HAS_GTOK:
            n_tok = _normalizer(gtok_ptr, gtok, GTOK_PTR)
        else:
            n_tok = tl.maximum(_count_total(_program_tokens(sync_ptr, B), n_count_programs, COUNT_PROGRAMS), 1.0)
        c = tl.math.div_rn(1.0, n_tok)
    else:
        if HAS_GSEQ:
            n_seq = _normalizer(gseq_ptr, gseq, GSEQ_PTR)
        else:
            nonempty = _count_total(
                _program_nonempty_rows(sync_ptr, B, COUNT_PROGRAMS), n_count_programs, COUNT_PROGRAMS
            )
            n_seq = tl.maximum(nonempty, 1.0)
        if AGG == _SEQ_MEAN_TOKEN_SUM:
            c = tl.math.div_rn(1.0, n_seq)
        elif AGG == _SEQ_MEAN_TOKEN_MEAN:
            c = tl.math.div_rn(1.0, tl.maximum(tl.load(sync_ptr + row).to(tl.float32), 1.0) * n_seq)
        else:  # seq-mean-token-sum-norm
            c = tl.math.div_rn(1.0, n_seq * _normalizer(scale_ptr, loss_scale, SCALE_PTR))
    return c


@triton.jit
def _dppo_region(lp, old, adv, ratio, clip_low, clip_high, cap, LOSS: tl.constexpr, HAS_CAP: tl.constexpr):
    """DPPO's trust region (``valid``) and truncated ratio ``w = min(r, cap)`` per token (spec:
    :func:`rlk.reference.policy_loss._dppo_token_losses`); ``p = exp(lp)``, ``q = exp(old)`` unclamped."""
    p = tl.exp(lp)
    q = tl.exp(old)
    if LOSS == _DPPO_TV:
        valid = tl.where(adv > 0, p - q <= clip_high, p - q >= -clip_low)
    else:
        b = q * (old - lp) + (1.0 - q) * tl.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        valid = tl.where(adv > 0, (b <= clip_high) | (p <= q), (b <= clip_low) | (p >= q))
    w = ratio
    if HAS_CAP:
        w = tl.minimum(ratio, cap)
    return valid, w


@triton.jit
def _add_stat_tuples(a0, a1, a2, a3, a4, a5, a6, a7, a8, b0, b1, b2, b3, b4, b5, b6, b7, b8):
    """Combine of the ``ROW_STATS`` columns reduced in one ``tl.reduce``: sums, the max for ``ratio_max``."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, tl.maximum(a6, b6), a7 + b7, a8 + b8


@triton.jit(do_not_specialize=["T", "adv_stride_b"])
def _policy_loss_chunk_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    iw_ptr,
    ref_ptr,
    ent_ptr,
    parts_ptr,
    sync_ptr,
    gtok_ptr,
    gseq_ptr,
    scale_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    chunk_stats_ptr,
    row_weight_ptr,
    B,
    T,
    n_chunks,
    n_count_programs,
    adv_stride_b,
    adv_stride_t,
    gtok,
    gseq,
    loss_scale,
    clip_low,
    clip_high,
    dual_clip,
    clamp_low,
    clamp_high,
    tau_pos,
    tau_neg,
    kl_coef,
    kl_clamp,
    entropy_coef,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    AGG: tl.constexpr,
    HAS_GTOK: tl.constexpr,
    GTOK_PTR: tl.constexpr,
    HAS_GSEQ: tl.constexpr,
    GSEQ_PTR: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    LOSS: tl.constexpr,
    CISPO_UPPER: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_IW: tl.constexpr,
    HAS_REF: tl.constexpr,
    KL_TERM: tl.constexpr,
    KL_EST: tl.constexpr,
    KL_K3_CLAMP: tl.constexpr,
    KL_HAS_CLAMP: tl.constexpr,
    KL_STRAIGHT: tl.constexpr,
    KL_UNBIASED: tl.constexpr,
    HAS_ENT: tl.constexpr,
    ENT_TERM: tl.constexpr,
    ENT_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    COUNT_PROGRAMS: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """Program ``(row, chunk)``: per-token terms and gradients of ``BLOCK`` tokens, and their sums; chunk 0 also
    stores the row's weight ``c_i``.

    ``PDL_WAIT``: launched programmatically after the count or partial-sum kernel: the program loads its tokens
    (inputs of the call, ready before the call's first kernel started), then waits for that kernel before it reads
    the counts or partials and before any store. ``PDL_TRIGGER``: the finish kernel may launch (it waits too)."""
    if PDL_TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    base = row * T
    adv_base = row * adv_stride_b
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < T
    zeros = tl.zeros((BLOCK,), tl.float32)
    m = tl.load(mask_ptr + base + offs, mask=inb, other=0, eviction_policy=EVICT) != 0
    lp = _load_row(lp_ptr, base, offs, inb, m, EVICT)
    old = _load_row(old_ptr, base, offs, inb, m, EVICT)
    adv = tl.where(
        m, tl.load(adv_ptr + adv_base + offs * adv_stride_t, mask=inb, other=0.0, eviction_policy=EVICT), 0.0
    )
    if PDL_WAIT:
        gdc_wait()
    c = _row_weight(
        sync_ptr,
        row,
        B,
        n_count_programs,
        gtok_ptr,
        gseq_ptr,
        scale_ptr,
        gtok,
        gseq,
        loss_scale,
        AGG,
        HAS_GTOK,
        GTOK_PTR,
        HAS_GSEQ,
        GSEQ_PTR,
        SCALE_PTR,
        COUNT_PROGRAMS,
    )
    tl.store(row_weight_ptr + row, c, mask=chunk == 0)
    tl.store(_rows_done(sync_ptr, B, COUNT_PROGRAMS), 0, mask=(row == 0) & (chunk == 0))

    # ---- per-sequence quantities: the row's chunk partials, summed in chunk order ----------
    # (every chunk program of the row redoes this small sum: same inputs, same order, same bits)
    seq_a = 0.0  # gspo: log s_i (clamped);  geo_mean: the sequence loss l_i
    seq_b = 0.0  # gspo: 1 if log s_i is inside the clamp;  geo_mean: R_i
    seq_w = 0.0  # geo_mean: SI_i / n1_i (the weight of d l_i / d lp_t, without p_t)
    if LOSS == _GSPO or LOSS == _GEO:
        acc_n = tl.zeros((PARTS_BLOCK,), tl.float32)
        acc_x = tl.zeros((PARTS_BLOCK,), tl.float32)
        acc_a = tl.zeros((PARTS_BLOCK,), tl.float32)
        acc_i = tl.zeros((PARTS_BLOCK,), tl.float32)
        for c0 in range(0, n_chunks, PARTS_BLOCK):
            ks = c0 + tl.arange(0, PARTS_BLOCK).to(tl.int64)
            kin = ks < n_chunks
            src = parts_ptr + (row * n_chunks + ks) * 4
            acc_n += tl.load(src + 0, mask=kin, other=0.0)
            acc_x += tl.load(src + 1, mask=kin, other=0.0)
            acc_a += tl.load(src + 2, mask=kin, other=0.0)
            acc_i += tl.load(src + 3, mask=kin, other=0.0)
        n_row = tl.sum(acc_n, axis=0)
        n1 = tl.maximum(n_row, 1.0)
        if LOSS == _GSPO:
            log_s = tl.sum(acc_x, axis=0) / n1
            seq_b = tl.where((log_s >= clamp_low) & (log_s <= clamp_high), 1.0, 0.0)
            seq_a = _clamp(log_s, clamp_low, clamp_high)
        else:
            seq_b = tl.exp(tl.sum(acc_x, axis=0) / n1)
            seq_a = _times(-(tl.sum(acc_a, axis=0) / n1), seq_b)
            if HAS_IW:
                seq_w = _times(seq_a / n1, tl.sum(acc_i, axis=0))
            else:
                seq_w = (seq_a / n1) * n_row
    if LOSS == _VESPO:  # log w_i (clamped) and w_i from the row's chunk sums, in chunk order
        acc_x = tl.zeros((PARTS_BLOCK,), tl.float32)
        for c0 in range(0, n_chunks, PARTS_BLOCK):
            ks = c0 + tl.arange(0, PARTS_BLOCK).to(tl.int64)
            acc_x += tl.load(parts_ptr + (row * n_chunks + ks) * 4 + 1, mask=ks < n_chunks, other=0.0)
        seq_a = _clamp(tl.sum(acc_x, axis=0), _VESPO_LOG_MIN, _VESPO_LOG_MAX)
        seq_b = tl.exp(seq_a)

    # ---- per-token terms ------------------------------------------------------------------
    d = lp - old
    clipped = zeros
    lower = zeros
    if LOSS == _GSPO:
        log_ratio = d
        ratio = zeros + tl.exp(seq_a)
        passes = (zeros + seq_b) > 0
    else:
        log_ratio = _clamp(d, clamp_low, clamp_high)
        passes = (d >= clamp_low) & (d <= clamp_high)
        ratio = tl.exp(log_ratio)
    if LOSS == _PPO or LOSS == _GSPO:
        l1 = _times(-adv, ratio)
        l2 = -adv * _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        value = tl.maximum(l1, l2)
        grad = tl.where((l1 >= l2) & passes, l1, 0.0)
        clipped = tl.where(l2 > l1, 1.0, 0.0)
        if HAS_DUAL:
            dual = -adv * dual_clip
            is_lower = (adv < 0) & (value > dual)
            value = tl.where(is_lower, dual, value)
            grad = tl.where(is_lower, 0.0, grad)
            lower = tl.where(is_lower, 1.0, 0.0)
    elif LOSS == _CISPO:
        if CISPO_UPPER:
            w = tl.minimum(ratio, clip_high)
        else:
            w = _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        value = -w * adv * lp
        grad = -w * adv
        clipped = tl.where(w != ratio, 1.0, 0.0)
    elif LOSS == _GPG:
        value = -adv * lp
        grad = -adv
    elif LOSS == _SAPO:
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        f = tl.sigmoid(tau * (ratio - 1.0))
        value = -adv * f * (4.0 / tau)
        grad = tl.where(passes, -4.0 * adv * _times(f * (1.0 - f), ratio), 0.0)
    elif LOSS == _DPPO_TV or LOSS == _DPPO_KL:
        valid, w = _dppo_region(lp, old, adv, ratio, clip_low, clip_high, dual_clip, LOSS, HAS_DUAL)
        grad = tl.where(valid, _times(-adv, w), 0.0)
        value = _times(grad, lp)
        clipped = tl.where(m & ~valid, 1.0, 0.0)
        if HAS_DUAL:
            lower = tl.where(valid & (ratio > dual_clip), 1.0, 0.0)
    elif LOSS == _VESPO:
        nonneg = adv >= 0
        k = tl.where(nonneg, vespo_k_pos, vespo_k_neg)
        lam = tl.where(nonneg, vespo_lambda_pos, vespo_lambda_neg)
        log_phi = lam + k * seq_a - lam * seq_b
        phi = tl.exp(tl.minimum(log_phi, _VESPO_LOG_PHI_MAX))
        phi = tl.where((log_phi <= _VESPO_LOG_PHI_MAX) & (phi <= _FP32_MAX), phi, 0.0)  # 0 past fp32 (and NaN)
        value = -phi * adv * lp
        grad = -phi * adv
        ratio = zeros + seq_b
    else:  # geo_mean
        pos = adv > 0
        neg = adv < 0
        follows = (pos & (log_ratio <= clip_high)) | (neg & (log_ratio >= -clip_low))
        value = zeros + seq_a
        grad = tl.where(follows & passes, seq_w, 0.0)
        clipped = tl.where((pos & (log_ratio > clip_high)) | (neg & (log_ratio < -clip_low)), 1.0, 0.0)
        ratio = zeros + seq_b
    if HAS_IW:
        iw = _load_row(iw_ptr, base, offs, inb, m, EVICT)
        value = _times(iw, value)
        if LOSS != _GEO:
            grad = _times(iw, grad)
    objective = value
    coef = grad
    kl_value = zeros
    entropy = zeros
    if HAS_REF:
        ref = _load_row(ref_ptr, base, offs, inb, m, EVICT)
        k, dk = kl_terms(lp - ref, kl_clamp, KL_EST, KL_K3_CLAMP, KL_HAS_CLAMP, KL_STRAIGHT)
        if KL_UNBIASED:
            wk = tl.exp(lp - old)
            k = _times(k, wk)
            dk = _times(dk, wk)
        kl_value = tl.where(m, k, 0.0)
        if KL_TERM:
            objective = objective + kl_coef * k
            coef = coef + kl_coef * dk
    if HAS_ENT:
        entropy = _load_row(ent_ptr, base, offs, inb, m, EVICT)
        if ENT_TERM:
            objective = objective - entropy_coef * entropy
    tl.store(grad_lp_ptr + base + offs, tl.where(m, coef * c, 0.0), mask=inb, eviction_policy=EVICT)
    if ENT_GRAD:
        tl.store(grad_ent_ptr + base + offs, tl.where(m, -entropy_coef * c, 0.0), mask=inb)
    ratio = tl.where(m, ratio, 0.0)

    # ---- this chunk's sums (columns of ROW_STATS), one reduction ----------------------------
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = tl.reduce(
        (
            tl.where(m, objective, 0.0),
            tl.where(m, 1.0, 0.0),
            tl.where(m, clipped, 0.0),
            tl.where(m, lower, 0.0),
            tl.where(m, -log_ratio, 0.0),
            ratio,
            ratio,
            entropy,
            kl_value,
        ),
        0,
        _add_stat_tuples,
    )
    out = chunk_stats_ptr + (row * n_chunks + chunk) * _NUM_STATS
    tl.store(out + 0, s0)
    tl.store(out + 1, s1)
    tl.store(out + 2, s2)
    tl.store(out + 3, s3)
    tl.store(out + 4, s4)
    tl.store(out + 5, s5)
    tl.store(out + 6, s6)
    tl.store(out + 7, s7)
    tl.store(out + 8, s8)


@triton.jit
def _add_stats(acc, tile, cols):
    """Lane-wise running sums of ``ROW_STATS`` tiles ``[lanes, COLS]`` (the max for ``ratio_max``)."""
    return tl.where((cols == 6)[None, :], tl.maximum(acc, tile), acc + tile)


@triton.jit
def _total_stats(acc, cols):
    """The lanes of :func:`_add_stats` reduced to ``[COLS]`` (one tree, fixed for a lane count)."""
    return tl.where(cols == 6, tl.max(acc, axis=0), tl.sum(acc, axis=0))


@triton.jit
def _row_stats_tile(stats_ptr, rows, B, cols, col_in):
    """``row_stats[rows]`` as a ``[lanes, COLS]`` tile (0 past ``B`` and past the columns), loaded past L1."""
    return tl.load(
        stats_ptr + rows[:, None] * _NUM_STATS + cols[None, :],
        mask=(rows < B)[:, None] & col_in[None, :],
        other=0.0,
        cache_modifier=".cg",
    )


@triton.jit
def _finish_kernel(
    chunk_stats_ptr,
    stats_ptr,
    row_weight_ptr,
    loss_ptr,
    metrics_ptr,
    sync_ptr,
    B,
    n_chunks,
    COUNT_PROGRAMS: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
    COMBINE_BLOCK: tl.constexpr,
    COLS: tl.constexpr,
    PDL_WAIT: tl.constexpr,
):
    """Program ``row``: the row's statistics; the last program to finish its row: the loss and the metrics.

    ``row_stats[row]`` = the row's chunk sums added in chunk order (lanes ``PARTS_BLOCK`` wide, one tree; the max
    for ``ratio_max``), its loss column times ``c_i`` (``row_weight[row]``, stored by the token pass). Then each
    program adds 1 to the rows-done counter (zeroed by the token pass); the one that brings it to ``B`` adds the
    ``[B]`` rows in row order (lane ``j`` takes rows ``j, j + COMBINE_BLOCK, ...``; one tree at the end) into the
    loss and the metrics. Every order depends on ``n_chunks`` or ``B`` only, never on which program came last.

    Visibility: the CTA barrier orders every thread's row-statistics stores before the one thread's
    release-acquire atomic (the pattern of a grid-wide semaphore); the last program's threads follow the
    atomic's acquire through the barrier Triton puts behind a scalar atomic, and load with ``.cg`` (not L1).
    ``PDL_WAIT``: launched programmatically after the token pass; waits for it before anything else.
    """
    if PDL_WAIT:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    c = tl.load(row_weight_ptr + row)
    cols = tl.arange(0, COLS)
    col_in = cols < _NUM_STATS
    acc = tl.zeros((PARTS_BLOCK, COLS), tl.float32)
    for c0 in range(0, n_chunks, PARTS_BLOCK):
        ks = c0 + tl.arange(0, PARTS_BLOCK).to(tl.int64)
        tile = tl.load(
            chunk_stats_ptr + (row * n_chunks + ks)[:, None] * _NUM_STATS + cols[None, :],
            mask=(ks < n_chunks)[:, None] & col_in[None, :],
            other=0.0,
        )
        acc = _add_stats(acc, tile, cols)
    total = _total_stats(acc, cols)
    total = tl.where(cols == 0, c * total, total)
    tl.store(stats_ptr + row * _NUM_STATS + cols, total, mask=col_in)
    tl.debug_barrier()
    if tl.atomic_add(_rows_done(sync_ptr, B, COUNT_PROGRAMS), 1, sem="acq_rel", scope="gpu") == B - 1:
        lanes = tl.arange(0, COMBINE_BLOCK).to(tl.int64)
        acc_rows = tl.zeros((COMBINE_BLOCK, COLS), tl.float32)
        for b0 in range(0, B, 4 * COMBINE_BLOCK):  # four tiles loaded at once (one wait), added in row order
            t0 = _row_stats_tile(stats_ptr, b0 + lanes, B, cols, col_in)
            t1 = _row_stats_tile(stats_ptr, b0 + COMBINE_BLOCK + lanes, B, cols, col_in)
            t2 = _row_stats_tile(stats_ptr, b0 + 2 * COMBINE_BLOCK + lanes, B, cols, col_in)
            t3 = _row_stats_tile(stats_ptr, b0 + 3 * COMBINE_BLOCK + lanes, B, cols, col_in)
            acc_rows = _add_stats(_add_stats(_add_stats(_add_stats(acc_rows, t0, cols), t1, cols), t2, cols), t3, cols)
        sums = _total_stats(acc_rows, cols)
        loss = tl.sum(tl.where(cols == 0, sums, 0.0), axis=0)
        tokens = tl.sum(tl.where(cols == 1, sums, 0.0), axis=0)
        inv = tl.where(tokens > 0, 1.0 / tl.maximum(tokens, 1.0), 0.0)
        tl.store(loss_ptr, loss)
        # metrics_out: clip, lower clip, approx KL, ratio mean <- stats 2..5 (means); ratio max <- 6;
        # entropy, kl <- 7, 8 (means); tokens <- 1
        mean = sums * inv
        tl.store(metrics_ptr + cols - 2, mean, mask=(cols >= 2) & (cols <= 5))
        tl.store(metrics_ptr + cols - 2, sums, mask=cols == 6)
        tl.store(metrics_ptr + cols - 2, mean, mask=(cols >= 7) & col_in)
        tl.store(metrics_ptr + 7, tokens)


def _normalizer_args(value) -> tuple[object, float, bool, bool]:
    """(pointer argument, number argument, given, given as a tensor) of one aggregation normalizer."""
    if value is None:
        return None, 0.0, False, False
    if isinstance(value, torch.Tensor):
        return value.reshape(1).to(torch.float32), 0.0, True, True
    return None, float(value), True, False


def _register_limit() -> dict:
    """``maxnreg=MAX_REGISTERS`` on CUDA when set (a launch option of Triton's NVIDIA backend only)."""
    return {"maxnreg": MAX_REGISTERS} if MAX_REGISTERS and torch.version.hip is None else {}


@functools.cache
def _programmatic_launch(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` can chain kernels by programmatic dependent launch: CUDA (not HIP),
    compute capability 9.0 or later (``griddepcontrol``). The caller also requires ``PROGRAMMATIC_LAUNCH``."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def _needs_counts(agg: str, has_gtok: bool, has_gseq: bool) -> bool:
    """Whether ``c_i`` needs a mask count the normalizers given do not fix."""
    if agg == "token-sum":
        return False
    if agg == "token-mean":
        return not has_gtok
    return agg == "seq-mean-token-mean" or not has_gseq


def policy_loss_fwd(
    logprob,
    old_logprob,
    advantages,
    mask,
    importance_weights,
    ref_logprob,
    entropy,
    global_tokens,
    global_seqs,
    loss_scale,
    loss_out,
    grad_logprob_out,
    grad_entropy_out,
    row_weight_out,
    row_stats_out,
    metrics_out,
    *,
    agg,
    loss,
    cispo_upper,
    clip_low,
    clip_high,
    dual_clip,
    clamp_low,
    clamp_high,
    tau_pos,
    tau_neg,
    kl,
    kl_coef,
    kl_k3_clamp,
    kl_clamp,
    kl_straight_through,
    kl_unbiased,
    entropy_coef,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
):
    """The fused policy loss and its gradient (spec and arguments: :func:`rlk.reference.policy_loss.policy_loss_fwd`).

    Shapes: ``[B, T]`` fp32 inputs (``advantages`` ``[B, T]`` or ``[B, 1]``), bool ``mask``, the
    normalizers numbers, one-element tensors or None; outputs ``loss_out[]``, ``grad_logprob_out[B, T]``,
    ``grad_entropy_out[B, T] | None``, ``row_weight_out[B]``, ``row_stats_out[B, 9]``, ``metrics_out[8]``.
    Programs ``(row, chunk of BLOCK_T tokens)`` (after a counting / partial-sum pass when the aggregation
    or the loss needs one), then one program per row for its statistics, the last of which to finish also
    sums the rows.
    """
    n_rows, t = logprob.shape
    n_chunks = triton.cdiv(t, BLOCK_T)
    has_ref = ref_logprob is not None
    has_ent = entropy is not None
    has_iw = importance_weights is not None
    ent_grad = grad_entropy_out is not None
    code = LOSSES.index(loss)
    gtok_ptr, gtok, has_gtok, gtok_is_ptr = _normalizer_args(global_tokens)
    gseq_ptr, gseq, has_gseq, gseq_is_ptr = _normalizer_args(global_seqs)
    scale_ptr, scale, _, scale_is_ptr = _normalizer_args(loss_scale)
    count = _needs_counts(agg, has_gtok, has_gseq)
    sequence_level = loss in ("gspo", "geo_mean", "vespo")
    adv_stride_b, adv_stride_t = advantages.shape[1], 0 if advantages.shape[1] == 1 else 1
    device = logprob.device
    chunk_stats = torch.empty((n_rows, n_chunks, len(ROW_STATS)), dtype=torch.float32, device=device)
    # int32 scratch (layout: above _program_tokens): the count kernel writes the counts it is run for, the token
    # pass zeroes the finish kernel's counter (no fill)
    sync = torch.empty(n_rows + 2 * COUNT_PROGRAMS + 1, dtype=torch.int32, device=device)
    parts = torch.empty((n_rows, n_chunks, 4), dtype=torch.float32, device=device) if sequence_level else None
    mask_bytes = mask.view(torch.uint8)
    dummy = logprob
    grid = (n_rows, n_chunks)
    normalizers = dict(
        AGG=AGG_MODES.index(agg),
        HAS_GTOK=has_gtok,
        GTOK_PTR=gtok_is_ptr,
        HAS_GSEQ=has_gseq,
        GSEQ_PTR=gseq_is_ptr,
        SCALE_PTR=scale_is_ptr,
        COUNT_PROGRAMS=COUNT_PROGRAMS,
    )
    normalizer_ptrs = (
        gtok_ptr if gtok_is_ptr else dummy,
        gseq_ptr if gseq_is_ptr else dummy,
        scale_ptr if scale_is_ptr else dummy,
    )
    # programmatic dependent launch: every kernel but the call's first launches early and waits for the one before
    pdl = bool(PROGRAMMATIC_LAUNCH) and device.type == "cuda" and _programmatic_launch(device.index)
    early = {"launch_pdl": True} if pdl else {}
    n_count_programs = 0
    with on_device(device):
        if count:
            cols = min(triton.next_power_of_2(t), COUNT_ELEMENTS)
            rows = COUNT_ELEMENTS // cols
            n_groups = triton.cdiv(n_rows, rows)
            n_count_programs = min(n_groups, COUNT_PROGRAMS)
            _count_kernel[(n_count_programs,)](
                mask_bytes,
                sync,
                n_rows,
                t,
                n_groups,
                ROWS=rows,
                COLS=cols,
                COUNT_PROGRAMS=COUNT_PROGRAMS,
                PDL_TRIGGER=pdl,
                num_warps=COUNT_WARPS,
            )
        if sequence_level:
            _seq_partials_kernel[grid](
                logprob,
                old_logprob,
                advantages,
                mask_bytes,
                importance_weights if has_iw else dummy,
                parts,
                t,
                n_chunks,
                adv_stride_b,
                adv_stride_t,
                float(clip_low),
                float(clip_high),
                float(clamp_low),
                float(clamp_high),
                LOSS=code,
                HAS_IW=has_iw,
                BLOCK=BLOCK_T,
                EVICT=LOAD_EVICTION,
                PDL_WAIT=pdl and count,
                PDL_TRIGGER=pdl,
                num_warps=NUM_WARPS,
                **(early if count else {}),
            )
        after_another = count or sequence_level
        _policy_loss_chunk_kernel[grid](
            logprob,
            old_logprob,
            advantages,
            mask_bytes,
            importance_weights if has_iw else dummy,
            ref_logprob if has_ref else dummy,
            entropy if has_ent else dummy,
            parts if sequence_level else dummy,
            sync,
            *normalizer_ptrs,
            grad_logprob_out,
            grad_entropy_out if ent_grad else grad_logprob_out,
            chunk_stats,
            row_weight_out,
            n_rows,
            t,
            n_chunks,
            n_count_programs,
            adv_stride_b,
            adv_stride_t,
            gtok,
            gseq,
            scale,
            float(clip_low),
            float(clip_high),
            float(dual_clip),
            float(clamp_low),
            float(clamp_high),
            float(tau_pos),
            float(tau_neg),
            float(kl_coef),
            float(kl_clamp) if kl_clamp != float("inf") else 0.0,
            float(entropy_coef),
            float(vespo_k_pos),
            float(vespo_lambda_pos),
            float(vespo_k_neg),
            float(vespo_lambda_neg),
            LOSS=code,
            CISPO_UPPER=bool(cispo_upper),
            HAS_DUAL=dual_clip > 0,
            HAS_IW=has_iw and loss != "vespo",  # vespo: the weights are in the sequence partials
            HAS_REF=has_ref,
            KL_TERM=has_ref and kl_coef != 0,
            KL_EST=KL_ESTIMATORS.index(kl),
            KL_K3_CLAMP=bool(kl_k3_clamp),
            KL_HAS_CLAMP=kl_clamp != float("inf"),
            KL_STRAIGHT=bool(kl_straight_through),
            KL_UNBIASED=bool(kl_unbiased),
            HAS_ENT=has_ent,
            ENT_TERM=has_ent and entropy_coef != 0,
            ENT_GRAD=ent_grad,
            BLOCK=BLOCK_T,
            PARTS_BLOCK=PARTS_BLOCK,
            EVICT=LOAD_EVICTION,
            PDL_WAIT=pdl and after_another,
            PDL_TRIGGER=pdl,
            num_warps=NUM_WARPS,
            **normalizers,
            **_register_limit(),
            **(early if after_another else {}),
        )
        _finish_kernel[(n_rows,)](
            chunk_stats,
            row_stats_out,
            row_weight_out,
            loss_out,
            metrics_out,
            sync,
            n_rows,
            n_chunks,
            COUNT_PROGRAMS=COUNT_PROGRAMS,
            PARTS_BLOCK=PARTS_BLOCK,
            COMBINE_BLOCK=COMBINE_BLOCK,
            COLS=_STATS_COLS,
            PDL_WAIT=pdl,
            num_warps=FINISH_WARPS,
            **early,
        )


# ----------------------------------------------------------------------------------------------
# elementwise kernels: kl_penalty forward, the backward products
# ----------------------------------------------------------------------------------------------


@triton.jit
def _product_kernel(x_ptr, y_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """``out = x * y`` elementwise."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < N
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    tl.store(out_ptr + offs, x * tl.load(y_ptr + offs, mask=inb, other=0.0), mask=inb)


@triton.jit
def _scale_kernel(x_ptr, g_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """``out = x * g[0]`` elementwise."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < N
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=inb, other=0.0) * tl.load(g_ptr), mask=inb)


def policy_loss_bwd(grad_loss, grad_logprob, grad_entropy, grad_logprob_out, grad_entropy_out):
    """``grad_logprob_out = grad_logprob * grad_loss`` (``grad_loss`` ``[]``; ``[B, T]`` contiguous tensors), the same
    for the entropy."""
    n = grad_logprob.numel()
    grid = (triton.cdiv(n, BLOCK_ELEMENTWISE),)
    with on_device(grad_logprob.device):
        for x, out in ((grad_logprob, grad_logprob_out), (grad_entropy, grad_entropy_out)):
            if out is not None:
                _scale_kernel[grid](x, grad_loss, out, n, BLOCK=BLOCK_ELEMENTWISE, num_warps=NUM_WARPS)


@triton.jit
def _kl_penalty_kernel(
    lp_ptr,
    ref_ptr,
    old_ptr,
    kl_ptr,
    coef_ptr,
    N,
    clamp,
    EST: tl.constexpr,
    K3_CLAMP: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    STRAIGHT: tl.constexpr,
    HAS_OLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < N
    lp = tl.load(lp_ptr + offs, mask=inb, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
    value, grad = kl_terms(lp - ref, clamp, EST, K3_CLAMP, HAS_CLAMP, STRAIGHT)
    if HAS_OLD:
        w = tl.exp(lp - tl.load(old_ptr + offs, mask=inb, other=0.0))
        value = _times(value, w)
        grad = _times(grad, w)
    tl.store(kl_ptr + offs, value, mask=inb)
    tl.store(coef_ptr + offs, grad, mask=inb)


def kl_penalty_fwd(
    logprob, ref_logprob, old_logprob, kl_out, coef_out, *, estimator, straight_through, k3_clamp, clamp
):
    """Elementwise KL estimate and its derivative (spec: :func:`rlk.reference.policy_loss.kl_penalty_fwd`).

    All tensors ``[N]`` fp32, contiguous; ``old_logprob`` may be None.
    """
    n = logprob.numel()
    has_clamp = clamp != float("inf")
    with on_device(logprob.device):
        _kl_penalty_kernel[(triton.cdiv(n, BLOCK_ELEMENTWISE),)](
            logprob,
            ref_logprob,
            old_logprob if old_logprob is not None else logprob,
            kl_out,
            coef_out,
            n,
            float(clamp) if has_clamp else 0.0,
            EST=KL_ESTIMATORS.index(estimator),
            K3_CLAMP=bool(k3_clamp),
            HAS_CLAMP=has_clamp,
            STRAIGHT=bool(straight_through),
            HAS_OLD=old_logprob is not None,
            BLOCK=BLOCK_ELEMENTWISE,
            num_warps=NUM_WARPS,
        )


def kl_penalty_bwd(grad_kl, coef, grad_logprob_out):
    """``grad_logprob = grad_kl * coef`` (elementwise, ``[N]`` fp32)."""
    n = coef.numel()
    with on_device(coef.device):
        _product_kernel[(triton.cdiv(n, BLOCK_ELEMENTWISE),)](
            grad_kl, coef, grad_logprob_out, n, BLOCK=BLOCK_ELEMENTWISE, num_warps=NUM_WARPS
        )
