// rms_norm kernels (Llama / Qwen3 and Gemma forms, optional fused residual add).
//
// Spec (rlk.reference.norm), per row of H elements, x of dtype T, weight of dtype W, y of dtype Y:
//     s    = x + residual              rounded to T (s = x unfused)
//     rstd = rsqrt(mean_h s_h^2 + eps)  fp32; where mean_h s_h^2 + eps overflows or underflows, computed on s
//                                       scaled by a power of two (needs_rescale, below)
//     n    = s * rstd                  fp32
//     y    = w * n.to(T)               gemma = false, the fp32 product rounded once to Y
//     y    = n * (1 + w)               gemma = true, rounded once to Y
// Backward, with w' = w (1 + w for Gemma) and g = grad_y in fp32:
//     g_n    = g * w'
//     grad_s = rstd * (g_n - n * mean_h(g_n * n))  (+ grad_residual)   rounded to T
//     grad_w = sum over rows of g * m,  m = n.to(T) (gemma: m = n)       fp32, rounded to W
//
// Launch structure. A pack is 16 bytes of T (P = 8 bf16 / fp16 values, 4 fp32): pack k of a row holds its
// elements [k P, k P + P). Every layout below is a function of H and the dtypes only; the row data lives in
// registers as words of its dtype (Pack), every load of a row is issued before its first use.
// * forward, rows of up to kNormMaxThreads * kNormFwdPacks packs (16384 16-bit / 8192 fp32 values): a row
//   belongs to a team of `lanes` threads (norm_fwd_lanes), lane l holding the packs l + i * lanes,
//   i < kNormFwdPacks (consecutive lanes on consecutive 16 bytes). lanes <= 32 is a power of two and a
//   block of kNormFwdBlock threads holds kNormFwdBlock / lanes teams; lanes > 32 is whole warps and the
//   block is the team. Each team walks kNormFwdRows consecutive rows, one at a time: load x (and the
//   residual: s = x + r is rounded, stored and kept), add the squares, reduce over the team (row_sum:
//   shuffles, plus one __syncthreads when the team spans warps), write y from the same registers (the
//   weight's packs read through L1). One pass over x (and the residual), y (and s) written once.
//   bf16 H = 4096: 128 threads per row (one block), 4 packs = 32 values per thread, 4 rows per block.
// * backward, rows of up to kNormMaxThreads * kNormBwdPacks packs (8192 16-bit / 4096 fp32 values): a
//   block of norm_bwd_threads(H) threads per row, thread t holding the packs t + i * threads, i <
//   kNormBwdPacks; one block per `rows_per_block` consecutive rows (a fixed partition, never derived from
//   N), walked one row at a time: load grad_y, s (and grad_residual), reduce sum(g_n * n) over the block
//   (row_sum: one __syncthreads per row, two warp-sum buffers alternated), write grad_s. w' (fp32) and
//   the block's running sum of g * m live in shared memory, in words only their thread touches (BwdSlots),
//   which keeps the kernel within 64 registers; the sum is written as one fp32 row of a [R, H] partial
//   buffer (R = ceil(N / rows_per_block)) and rms_norm_sum_partials_kernel adds the R rows in a fixed order,
//   rounding once to W. No atomics: deterministic run to run. bf16 H = 4096: 256 threads, 16 values per
//   thread, 32 KiB of shared memory, 4 blocks (32 warps) per SM.
// * longer rows (rms_norm_*_long_kernel): norm_threads(H) threads per row, kNormLongPacks packs per
//   thread per chunk of the row; the forward reads x (and residual) twice (sum of squares, then y), the
//   backward reads grad_y and s twice (each row's coefficient first, kept in shared memory): the same
//   per-element arithmetic in a different thread map.
// The register kernels come in two instantiations, kWhole (H a multiple of P and every tensor 16-byte
// aligned: every pack one 16-byte access) and not (alignment checked per row, partial packs element-wise):
// the same arithmetic, so a row's bits do not depend on which one runs. The one product the compiler could
// contract with an add, the sum of squares, is written as __fmaf_rn (forward) and the backward writes every
// rounding explicitly: the bits do not depend on the compiler's contraction choices.
// Batch invariance: the team / block of a row and its element-to-thread map depend on H and the dtypes
// only; each thread adds its own values in pack order and the team adds the thread sums in a fixed tree
// (row_sum); a row runs the same instructions wherever it sits (rows past N only mask loads and stores).
#pragma once

#include <cmath>
#include <type_traits>

#include "common.cuh"

namespace rlk_cuda {

constexpr int kNormMaxThreads = 512;  // the largest team / block (both directions)
constexpr int kNormMaxWarps = kNormMaxThreads / kWarpSize;
constexpr int kNormFwdPacks = 4;           // forward: pack slots per lane
constexpr int kNormFwdRows = 4;            // forward: rows per team (any value gives the same bits)
constexpr int kNormFwdBlock = 128;         // forward: block size when a row takes <= 32 lanes
constexpr int kNormBwdPacks = 2;           // backward: packs per thread (16 values of 16-bit x, 8 of fp32)
constexpr int kNormMaxRowsPerBlock = 256;  // backward: upper bound of rows_per_block
constexpr int kNormLongPacks = 2;          // long rows: packs per thread per chunk
constexpr int kNormLongFwdRows = 8;        // long rows: forward rows per block (any value gives the same bits)

// A row whose d = mean(s^2) + eps overflowed (inf: |s| of 1e20 gave rstd = 0, y = 0) or fell below kRescaleBelow
// (|s| of 1e-30 with eps = 0 gave rstd = inf) sums the squares of s * c again, c = 2^-100 or 2^100 (exact):
// rstd = rsqrt(mean((s c)^2) + eps c^2) c, as rlk.reference.norm.rstd_of. Every other row keeps its bits and its
// single pass (the long kernel reads a rescaled row once more).
constexpr float kRescaleBelow = 0x1p-100f;
__device__ __forceinline__ bool needs_rescale(float d) { return d == INFINITY || d < kRescaleBelow; }
// c of a row: 2^-100 where d overflowed, 2^100 where it underflowed, else 1.
__device__ __forceinline__ float rescale_factor(float d) {
  return d == INFINITY ? 0x1p-100f : (d < kRescaleBelow ? 0x1p100f : 1.0f);
}

// Forward lanes per row: ceil(packs / kNormFwdPacks) rounded up to a power of two when <= 32, else to whole
// warps; 0 when that exceeds kNormMaxThreads (the long kernel).
inline int norm_fwd_lanes(int64_t hidden, int pack) {
  const int64_t want = ceil_div(ceil_div(hidden, pack), kNormFwdPacks);
  if (want <= kWarpSize) {
    int lanes = 1;
    while (lanes < want) lanes *= 2;
    return lanes;
  }
  const int64_t lanes = kWarpSize * ceil_div(want, kWarpSize);
  return lanes <= kNormMaxThreads ? static_cast<int>(lanes) : 0;
}

// Backward threads per row: whole warps with kNormBwdPacks packs (or fewer, at the row's end) each; 0
// when that exceeds kNormMaxThreads (the long kernel).
inline int norm_bwd_threads(int64_t hidden, int pack) {
  const int64_t threads = kWarpSize * ceil_div(ceil_div(hidden, pack), kWarpSize * kNormBwdPacks);
  return threads <= kNormMaxThreads ? static_cast<int>(threads) : 0;
}

// Long rows: threads of a row block, the smallest power of two >= ceil(packs / packs_per_thread) in [32, 512].
inline int norm_threads(int64_t hidden, int pack, int packs_per_thread) {
  const int64_t want = ceil_div(ceil_div(hidden, pack), packs_per_thread);
  int threads = kWarpSize;
  while (threads < want && threads < kNormMaxThreads) threads *= 2;
  return threads;
}

// Long rows: chunks of a row, ceil(packs / (threads * packs_per_thread)).
inline int norm_chunks(int64_t hidden, int pack, int packs_per_thread, int threads) {
  return static_cast<int>(ceil_div(ceil_div(hidden, pack), int64_t{threads} * packs_per_thread));
}

// Elements of pack k present in a row of `hidden` (0 past the end).
template <int P, typename I>
__device__ __forceinline__ I pack_count(I k, I hidden) {
  const I left = hidden - k * P;
  return left <= 0 ? 0 : (left < P ? left : P);
}

// Sum of v over a row's team of `lanes` threads: the same bits in every thread of the team, in an order that
// depends on `lanes` only. lanes <= 32 (a power of two; the team is an aligned group of lanes of one warp): an
// xor butterfly (a + b and b + a are the same bits, so every lane ends with the same sum). lanes > 32: the
// team is the whole block (whole warps): each warp's butterfly lands in sums[warp]; one __syncthreads; then
// every warp runs the 32-lane butterfly over the warp sums (0 past the last warp). Every thread of the block
// must call it. `sums` may be written again only once every thread has read it: callers that reduce several
// rows alternate two buffers (the __syncthreads of the call in between orders the reads of one before the
// writes of the next).
__device__ __forceinline__ float row_sum(float v, int lanes, float* sums) {
  if (lanes < kWarpSize) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
      if (offset < lanes) v += shfl_xor(v, offset);
    }
    return v;
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += shfl_xor(v, offset);
  if (lanes == kWarpSize) return v;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) sums[warp] = v;
  __syncthreads();
  v = lane < lanes / kWarpSize ? sums[lane] : 0.0f;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += shfl_xor(v, offset);
  return v;
}

// ---- packs as registers: N values of E in 16-byte words ------------------------------------------

template <typename E, int N>
struct Pack {
  static constexpr int kWords = N * static_cast<int>(sizeof(E)) / 16;
  static_assert(kWords * 16 == N * static_cast<int>(sizeof(E)), "a pack is whole 16-byte words");
  uint4 w[kWords];
};

// The first `count` (<= N) values at src, zeros after. kWhole (the caller knows that every pack of the row
// is whole and 16-byte aligned, so count is N or 0): 16-byte loads, predicated on count > 0. Else 16-byte
// loads when `vector` (src 16-byte aligned) and the pack is full, element-wise loads otherwise (unaligned
// rows, a row's last pack); the same bits either way. kShared: data every row reads (the weight), through
// the read-only path (ld.global.nc); else plain loads.
template <bool kWhole, typename E, int N, bool kShared = false>
__device__ __forceinline__ Pack<E, N> pack_load(const E* src, int count, bool vector) {
  Pack<E, N> p;
  if (kWhole || (vector && count == N)) {
    const uint4* words = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int v = 0; v < Pack<E, N>::kWords; ++v) {
      p.w[v] = make_uint4(0, 0, 0, 0);
      if (count > 0) p.w[v] = kShared ? __ldg(words + v) : words[v];
    }
  } else {
    E e[N];
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = i < count ? src[i] : from_float<E>(0.0f);
    std::memcpy(p.w, e, sizeof(e));
  }
  return p;
}

// Stores the first `count` (<= N) values of p at dst, with pack_load's choice of accesses.
template <bool kWhole, typename E, int N>
__device__ __forceinline__ void pack_store(E* dst, const Pack<E, N>& p, int count, bool vector) {
  if (kWhole || (vector && count == N)) {
    if (count > 0) {
#pragma unroll
      for (int v = 0; v < Pack<E, N>::kWords; ++v) reinterpret_cast<uint4*>(dst)[v] = p.w[v];
    }
  } else {
    E e[N];
    std::memcpy(e, p.w, sizeof(e));
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < count) dst[i] = e[i];
    }
  }
}

// The values of p in fp32 (exact).
template <typename E, int N>
__device__ __forceinline__ void unpack(const Pack<E, N>& p, float (&out)[N]) {
  if constexpr (std::is_same_v<E, float>) {
    std::memcpy(out, p.w, sizeof(out));
  } else {
    uint32_t u[N / 2];
    std::memcpy(u, p.w, sizeof(u));
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      if constexpr (std::is_same_v<E, bf16>) {
        out[2 * j] = __uint_as_float(u[j] << 16);  // a bf16 is the high half of its fp32
        out[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
      } else {
        __half2 h;
        std::memcpy(&h, &u[j], 4);
        const float2 f = __half22float2(h);
        out[2 * j] = f.x;
        out[2 * j + 1] = f.y;
      }
    }
  }
}

// v rounded to E (nearest even, as from_float; two values per conversion for 16-bit E).
template <typename E, int N>
__device__ __forceinline__ Pack<E, N> pack_round(const float (&v)[N]) {
  Pack<E, N> p;
  if constexpr (std::is_same_v<E, float>) {
    std::memcpy(p.w, v, sizeof(v));
  } else {
    uint32_t u[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      if constexpr (std::is_same_v<E, bf16>) {
        const bf16x2 h = floats_to_bf16x2_rn(v[2 * j], v[2 * j + 1]);
        std::memcpy(&u[j], &h, 4);
      } else {
        const __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        std::memcpy(&u[j], &h, 4);
      }
    }
    std::memcpy(p.w, u, sizeof(u));
  }
  return p;
}

// v <- v.to(E) seen from fp32 (round_to for a pack).
template <typename E, int N>
__device__ __forceinline__ void round_values(float (&v)[N]) {
  if constexpr (!std::is_same_v<E, float>) unpack<E, N>(pack_round<E, N>(v), v);
}

// ---- forward -------------------------------------------------------------------------------------

// Values of the pack at `offset` (a multiple of P) of a row of `hidden`: P, fewer for the row's last pack,
// 0 past the row. kWhole (hidden a multiple of P): P or 0.
template <bool kWhole, int P>
__device__ __forceinline__ int pack_values(int offset, int hidden) {
  return kWhole ? (offset < hidden ? P : 0) : pack_count<P>(offset / P, hidden);
}

// Grid: ceil(N / (kNormFwdRows * teams)) blocks of kNormFwdBlock threads (teams = kNormFwdBlock / lanes) when
// lanes <= 32, else of `lanes` threads (teams = 1); lanes = norm_fwd_lanes(H, P). Team j of block b (threads
// [j lanes, (j + 1) lanes)) handles rows (b * teams + j) * kNormFwdRows + r, r < kNormFwdRows, one after
// another (rows past N: loads and stores masked, the team still takes part in the reductions).
// residual / residual_out: both null (unfused) or both set. hidden <= kNormMaxThreads * kNormFwdPacks * P.
// kWhole: H is a multiple of P and every tensor 16-byte aligned (every pack one 16-byte access; checked by the
// launcher); else the alignment is checked row by row and partial packs are read element-wise: the same
// arithmetic either way. At most 64 registers (two blocks of 512 threads per SM, four of 256).
template <typename T, typename W, typename Y, bool kWhole>
__global__ void __launch_bounds__(kNormMaxThreads, 2)
    rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, const T* __restrict__ residual,
                        Y* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ rstd_out, int64_t n_rows,
                        int hidden, float eps, bool gemma, int lanes) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormFwdPacks;
  __shared__ float warp_sums[2][kNormMaxWarps];  // row_sum buffers (teams of > 32 lanes), alternated row by row
  int lane = threadIdx.x;
  int64_t team = blockIdx.x;
  if (lanes < kWarpSize) {
    const int shift = __ffs(lanes) - 1;
    lane = threadIdx.x & (lanes - 1);
    team = int64_t{blockIdx.x} * (blockDim.x >> shift) + (threadIdx.x >> shift);
  } else if (lanes == kWarpSize) {
    lane = threadIdx.x % kWarpSize;
    team = int64_t{blockIdx.x} * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  }
  const int stride = lanes * P;  // elements from one of this thread's packs to the next
  const int lane_offset = lane * P;
  const W* wl = weight + lane_offset;
  const bool w_vector = kWhole || aligned16(weight);
  int reductions = 0;  // row_sum calls so far: consecutive ones alternate the warp_sums buffers

#pragma unroll 1
  for (int r = 0; r < kNormFwdRows; ++r) {
    const int64_t row = team * kNormFwdRows + r;
    const bool valid = row < n_rows;
    const int64_t start = (valid ? row * hidden : 0) + lane_offset;  // this thread's first element
    const T* xl = x + start;
    const T* rl = residual != nullptr ? residual + start : nullptr;
    T* sl = residual_out != nullptr ? residual_out + start : nullptr;
    Y* yl = out + start;
    const bool vector = kWhole || (aligned16(xl) && aligned16(rl) && aligned16(sl) && aligned16(yl));
    int count[K];  // values of each pack (0 past the row, or for a row past N)
#pragma unroll
    for (int i = 0; i < K; ++i) count[i] = valid ? pack_values<kWhole, P>(lane_offset + i * stride, hidden) : 0;

    // s, this thread's packs, as T words: all loads issued before the first use.
    Pack<T, P> s[K];
#pragma unroll
    for (int i = 0; i < K; ++i) s[i] = pack_load<kWhole, T, P>(xl + i * stride, count[i], vector);
    if (rl != nullptr) {
      Pack<T, P> res[K];
#pragma unroll
      for (int i = 0; i < K; ++i) res[i] = pack_load<kWhole, T, P>(rl + i * stride, count[i], vector);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        float a[P], b[P];
        unpack<T, P>(s[i], a);
        unpack<T, P>(res[i], b);
#pragma unroll
        for (int e = 0; e < P; ++e) a[e] += b[e];
        s[i] = pack_round<T, P>(a);  // torch's x + residual: the fp32 sum rounded once
        pack_store<kWhole, T, P>(sl + i * stride, s[i], count[i], vector);
      }
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float v[P];
      unpack<T, P>(s[i], v);
#pragma unroll
      for (int e = 0; e < P; ++e) sum_sq = __fmaf_rn(v[e], v[e], sum_sq);  // values past the row are 0
    }
    const float d = row_sum(sum_sq, lanes, warp_sums[reductions++ & 1]) / static_cast<float>(hidden) + eps;
    float rstd = rsqrtf(d);
    // Rescaled from the same registers. Whole warps take the branch (row_sum's shuffles need every lane): the
    // teams of a warp that do not need it run it with c = 1 and keep their rstd; a team of several warps (the
    // block) has one d.
    if (warp_any(needs_rescale(d))) {
      const float c = rescale_factor(d);
      float sum_sc = 0.0f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        float v[P];
        unpack<T, P>(s[i], v);
#pragma unroll
        for (int e = 0; e < P; ++e) sum_sc = __fmaf_rn(v[e] * c, v[e] * c, sum_sc);
      }
      const float sum = row_sum(sum_sc, lanes, warp_sums[reductions++ & 1]);
      const float rescaled = rsqrtf(sum / static_cast<float>(hidden) + eps * c * c) * c;
      if (needs_rescale(d)) rstd = rescaled;
    }

    // y from the same registers; the weight's packs come through L1 (every row reads them)
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float w[P], v[P], y[P];
      unpack<W, P>(pack_load<kWhole, W, P, true>(wl + i * stride, count[i], w_vector), w);
      unpack<T, P>(s[i], v);
      if (gemma) {
#pragma unroll
        for (int e = 0; e < P; ++e) y[e] = (v[e] * rstd) * (1.0f + w[e]);
      } else {
#pragma unroll
        for (int e = 0; e < P; ++e) v[e] *= rstd;
        round_values<T, P>(v);  // n.to(T)
#pragma unroll
        for (int e = 0; e < P; ++e) y[e] = w[e] * v[e];
      }
      pack_store<kWhole, Y, P>(yl + i * stride, pack_round<Y, P>(y), count[i], vector);
    }
    if (valid && lane == 0) rstd_out[row] = rstd;
  }
}

// ---- backward ------------------------------------------------------------------------------------

// The backward's fp32 per-thread arrays in shared memory (w' and the grad-weight sums), kNormBwdPacks * P
// values per thread: 16-byte word j of thread t at word j * threads + t (consecutive threads on consecutive
// words: no bank conflicts). A thread reads and writes only its own words.
template <int P>
struct BwdSlots {
  static constexpr int kWords = kNormBwdPacks * P / 4;  // words per thread
  float4* base;
  int threads;
  __device__ __forceinline__ float4& at(int j) const { return base[j * threads + static_cast<int>(threadIdx.x)]; }
  // This thread's values of pack i (P floats).
  __device__ __forceinline__ void read(int i, float (&v)[P]) const {
#pragma unroll
    for (int q = 0; q < P / 4; ++q) {
      const float4 f = at(i * (P / 4) + q);
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
  }
  __device__ __forceinline__ void write(int i, const float (&v)[P]) const {
#pragma unroll
    for (int q = 0; q < P / 4; ++q) {
      at(i * (P / 4) + q) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  }
};

// Grid: ceil(N / rows_per_block) blocks of norm_bwd_threads(H, P) threads; dynamic shared memory:
// 2 * blockDim.x * kNormBwdPacks * P floats (w', 0 past the row, and the block's grad-weight sums). Block b
// handles rows [b * rows_per_block, min(N, (b + 1) * rows_per_block)), one after another. grad_residual may
// be null; partials ([gridDim.x, H] fp32) is null when grad_weight is not wanted. hidden <= kNormMaxThreads *
// kNormBwdPacks * P. kWhole as in the forward. At most 64 registers (two blocks of 512 threads per SM, four
// of 256). Every rounding of the per-element math is explicit (__fmul_rn / __fmaf_rn / __fadd_rn): the
// compiler contracted the kWhole and element-wise instantiations differently for fp32 (H200: different
// grad_input bits for aligned and shifted rows), and the intrinsics leave it no choice.
template <typename T, typename W, typename G, bool kWhole>
__global__ void __launch_bounds__(kNormMaxThreads, 2)
    rms_norm_bwd_kernel(const G* __restrict__ grad_out, const T* __restrict__ s, const W* __restrict__ weight,
                        const float* __restrict__ rstd, const T* __restrict__ grad_residual, T* __restrict__ grad_input,
                        float* __restrict__ partials, int64_t n_rows, int hidden, bool gemma, int rows_per_block) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormBwdPacks;
  const int threads = blockDim.x;
  const int tid = threadIdx.x;
  extern __shared__ float4 norm_smem[];
  const BwdSlots<P> w_factor{norm_smem, threads};                            // w'
  const BwdSlots<P> dw{norm_smem + threads * BwdSlots<P>::kWords, threads};  // sum of g * m
  __shared__ float warp_sums[2][kNormMaxWarps];                              // row_sum buffers, alternated row by row
  const bool want_dw = partials != nullptr;
  const bool has_gres = grad_residual != nullptr;
  int offset[K], count[K];  // this thread's packs: element offset in the row, values (0 past the row)
#pragma unroll
  for (int i = 0; i < K; ++i) {
    offset[i] = (i * threads + tid) * P;
    count[i] = pack_values<kWhole, P>(offset[i], hidden);
    float w[P], zero[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
      w[e] = offset[i] + e < hidden ? to_float(weight[offset[i] + e]) : 0.0f;
      if (gemma && offset[i] + e < hidden) w[e] += 1.0f;
      zero[e] = 0.0f;
    }
    w_factor.write(i, w);
    dw.write(i, zero);
  }

  const int64_t first = int64_t{blockIdx.x} * rows_per_block;
  const int64_t last = min(n_rows, first + rows_per_block);
  // this block's rows (pointers advanced row by row)
  const G* gr = grad_out + first * hidden;
  const T* sr = s + first * hidden;
  const T* rr = has_gres ? grad_residual + first * hidden : nullptr;
  T* ir = grad_input + first * hidden;
#pragma unroll 1
  for (int64_t row = first; row < last;
       ++row, gr += hidden, sr += hidden, ir += hidden, rr = has_gres ? rr + hidden : nullptr) {
    const bool vector = kWhole || (aligned16(gr) && aligned16(sr) && aligned16(rr) && aligned16(ir));
    const float rs = __ldg(rstd + row);
    Pack<G, P> g[K];
    Pack<T, P> sv[K], gres[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      g[i] = pack_load<kWhole, G, P>(gr + offset[i], count[i], vector);
      sv[i] = pack_load<kWhole, T, P>(sr + offset[i], count[i], vector);
      if (has_gres) gres[i] = pack_load<kWhole, T, P>(rr + offset[i], count[i], vector);  // used after the sum
    }
    // sum of g_n * n over the row (packs past the row add 0: zero g, s and w')
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float gv[P], sf[P], w[P];
      unpack<G, P>(g[i], gv);
      unpack<T, P>(sv[i], sf);
      w_factor.read(i, w);
#pragma unroll
      for (int e = 0; e < P; ++e) dot = __fmaf_rn(__fmul_rn(gv[e], w[e]), __fmul_rn(sf[e], rs), dot);
    }
    const float coef = row_sum(dot, threads, warp_sums[(row - first) & 1]) / static_cast<float>(hidden);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float gv[P], n[P], w[P], gs[P];
      unpack<G, P>(g[i], gv);
      unpack<T, P>(sv[i], n);
      w_factor.read(i, w);
#pragma unroll
      for (int e = 0; e < P; ++e) {
        n[e] = __fmul_rn(n[e], rs);
        gs[e] = __fmul_rn(rs, __fmaf_rn(-n[e], coef, __fmul_rn(gv[e], w[e])));
      }
      if (has_gres) {
        float r[P];
        unpack<T, P>(gres[i], r);
#pragma unroll
        for (int e = 0; e < P; ++e) gs[e] = __fadd_rn(gs[e], r[e]);
      }
      pack_store<kWhole, T, P>(ir + offset[i], pack_round<T, P>(gs), count[i], vector);
      if (want_dw) {
        if (!gemma) round_values<T, P>(n);  // m = n.to(T); Gemma: m = n
        float acc[P];
        dw.read(i, acc);
#pragma unroll
        for (int e = 0; e < P; ++e) acc[e] = __fmaf_rn(gv[e], n[e], acc[e]);
        dw.write(i, acc);
      }
    }
  }
  if (want_dw) {
    float* part = partials + int64_t{blockIdx.x} * hidden;
    const bool part_vector = kWhole || aligned16(part);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float acc[P];
      dw.read(i, acc);
      pack_store<kWhole, float, P>(part + offset[i], pack_round<float, P>(acc), count[i], part_vector);
    }
  }
}

// ---- long rows -----------------------------------------------------------------------------------

// Pack index of slot i of this thread in chunk c (K packs per thread per chunk).
template <int K>
__device__ __forceinline__ int64_t pack_index(int c, int i) {
  return (int64_t{c} * K + i) * blockDim.x + threadIdx.x;
}

// s = x + residual rounded to T (or x), one pack.
template <typename T, int P>
__device__ __forceinline__ void load_s(const T* x, const T* residual, int64_t count, bool vector, float (&s)[P]) {
  load_floats<P>(x, count, vector, s, 0.0f);
  if (residual != nullptr) {
    float r[P];
    load_floats<P>(residual, count, vector, r, 0.0f);
#pragma unroll
    for (int i = 0; i < P; ++i) s[i] = round_to<T>(s[i] + r[i]);
  }
}

// This thread's w' of chunk c (K packs), fp32: w, or 1 + w for Gemma (0 past the row).
template <typename W, int K, int P>
__device__ __forceinline__ void load_weight_factors(const W* weight, int c, int64_t hidden, bool gemma,
                                                    float (&w)[K][P]) {
  const bool vector = aligned16(weight);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const int64_t k = pack_index<K>(c, i);
    load_floats<P>(weight + k * P, pack_count<P>(k, hidden), vector, w[i], 0.0f);
    if (gemma) {
#pragma unroll
      for (int e = 0; e < P; ++e) w[i][e] = 1.0f + w[i][e];
    }
  }
}

// Grid: ceil(N / kNormLongFwdRows) blocks; norm_threads(H, P, kNormLongPacks) threads; n_chunks = norm_chunks(...).
// Block b handles rows [b * kNormLongFwdRows, min(N, (b + 1) * kNormLongFwdRows)), one after another: the sum
// of squares over all chunks, then y chunk by chunk (x and residual read again).
template <typename T, typename W, typename Y>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_fwd_long_kernel(const T* __restrict__ x, const W* __restrict__ weight, const T* __restrict__ residual,
                             Y* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ rstd_out,
                             int64_t n_rows, int64_t hidden, float eps, bool gemma, int n_chunks) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormLongPacks;
  const int64_t first = int64_t{blockIdx.x} * kNormLongFwdRows;
  const int64_t last = min(n_rows, first + kNormLongFwdRows);
  __shared__ float warp_sums[2][kNormMaxWarps];  // row_sum buffers, alternated call by call
  int reductions = 0;                            // row_sum calls so far
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * hidden;
    const T* xr = x + base;
    const T* rr = residual != nullptr ? residual + base : nullptr;
    T* sr = residual_out != nullptr ? residual_out + base : nullptr;
    Y* yr = out + base;
    const bool vector = aligned16(weight) && aligned16(xr) && aligned16(rr) && aligned16(sr) && aligned16(yr);
    float sum_sq = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        float v[P];
        load_s<T, P>(xr + k * P, rr ? rr + k * P : nullptr, count, vector, v);
        if (sr != nullptr && count > 0) store_floats<P>(sr + k * P, count, vector, v);
#pragma unroll
        for (int e = 0; e < P; ++e) sum_sq = __fmaf_rn(v[e], v[e], sum_sq);  // values past the row are 0
      }
    }
    const float d = row_sum(sum_sq, blockDim.x, warp_sums[reductions++ & 1]) / static_cast<float>(hidden) + eps;
    float rstd = rsqrtf(d);
    if (needs_rescale(d)) {  // the block's row (every thread takes the branch): read once more, scaled
      const float scale = rescale_factor(d);
      float sum_sc = 0.0f;
      for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          float v[P];
          load_s<T, P>(xr + k * P, rr ? rr + k * P : nullptr, pack_count<P>(k, hidden), vector, v);
#pragma unroll
          for (int e = 0; e < P; ++e) sum_sc = __fmaf_rn(v[e] * scale, v[e] * scale, sum_sc);
        }
      }
      const float sum = row_sum(sum_sc, blockDim.x, warp_sums[reductions++ & 1]);
      rstd = rsqrtf(sum / static_cast<float>(hidden) + eps * scale * scale) * scale;
    }
    for (int c = 0; c < n_chunks; ++c) {
      float w[K][P];
      load_weight_factors<W, K, P>(weight, c, hidden, gemma, w);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        if (count == 0) continue;
        float v[P], y[P];
        load_s<T, P>(xr + k * P, rr ? rr + k * P : nullptr, count, vector, v);
#pragma unroll
        for (int e = 0; e < P; ++e) {
          const float n = v[e] * rstd;
          y[e] = gemma ? n * w[i][e] : w[i][e] * round_to<T>(n);
        }
        store_floats<P>(yr + k * P, count, vector, y);
      }
    }
    if (threadIdx.x == 0) rstd_out[row] = rstd;
  }
}

// Grid: ceil(N / rows_per_block) blocks; norm_threads(H, P, kNormLongPacks) threads; n_chunks = norm_chunks(...).
// Block b handles rows [b * rows_per_block, min(N, (b + 1) * rows_per_block)): first each row's coefficient
// mean(g_n * n) over all chunks, then chunk by chunk the gradients and that chunk's grad-weight partial
// (grad_y and s read twice). grad_residual and partials as in rms_norm_bwd_kernel.
template <typename T, typename W, typename G>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_bwd_long_kernel(const G* __restrict__ grad_out, const T* __restrict__ s, const W* __restrict__ weight,
                             const float* __restrict__ rstd, const T* __restrict__ grad_residual,
                             T* __restrict__ grad_input, float* __restrict__ partials, int64_t n_rows, int64_t hidden,
                             bool gemma, int rows_per_block, int n_chunks) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormLongPacks;
  const int64_t first = int64_t{blockIdx.x} * rows_per_block;
  const int64_t last = min(n_rows, first + rows_per_block);
  const bool want_dw = partials != nullptr;
  const bool has_gres = grad_residual != nullptr;
  float* part = want_dw ? partials + int64_t{blockIdx.x} * hidden : nullptr;
  const bool part_vector = aligned16(part);
  __shared__ float warp_sums[2][kNormMaxWarps];  // row_sum buffers, alternated row by row
  __shared__ float coefs[kNormMaxRowsPerBlock];  // per row of the block: mean(g_n * n)

  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * hidden;
    const G* gr = grad_out + base;
    const T* sr = s + base;
    const bool vector = aligned16(weight) && aligned16(gr) && aligned16(sr);
    const float rs = rstd[row];
    float dot = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
      float w[K][P];
      load_weight_factors<W, K, P>(weight, c, hidden, gemma, w);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        float g[P], sv[P];
        load_floats<P>(gr + k * P, count, vector, g, 0.0f);
        load_floats<P>(sr + k * P, count, vector, sv, 0.0f);
#pragma unroll
        for (int e = 0; e < P; ++e) dot += (g[e] * w[i][e]) * (sv[e] * rs);
      }
    }
    const float coef = row_sum(dot, blockDim.x, warp_sums[(row - first) & 1]) / static_cast<float>(hidden);
    if (threadIdx.x == 0) coefs[row - first] = coef;
  }
  __syncthreads();
  for (int c = 0; c < n_chunks; ++c) {
    float w[K][P];
    load_weight_factors<W, K, P>(weight, c, hidden, gemma, w);
    float dw[K][P] = {};
    for (int64_t row = first; row < last; ++row) {
      const int64_t base = row * hidden;
      const G* gr = grad_out + base;
      const T* sr = s + base;
      const T* rr = has_gres ? grad_residual + base : nullptr;
      T* ir = grad_input + base;
      const bool vector = aligned16(gr) && aligned16(sr) && aligned16(rr) && aligned16(ir);
      const float rs = rstd[row];
      const float coef = coefs[row - first];
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        if (count == 0) continue;
        float g[P], n[P], r[P] = {}, gs[P];
        load_floats<P>(gr + k * P, count, vector, g, 0.0f);
        load_floats<P>(sr + k * P, count, vector, n, 0.0f);
        if (has_gres) load_floats<P>(rr + k * P, count, vector, r, 0.0f);
#pragma unroll
        for (int e = 0; e < P; ++e) {
          n[e] *= rs;
          gs[e] = rs * (g[e] * w[i][e] - n[e] * coef);
          if (has_gres) gs[e] += r[e];
          if (want_dw) dw[i][e] += g[e] * (gemma ? n[e] : round_to<T>(n[e]));
        }
        store_floats<P>(ir + k * P, count, vector, gs);
      }
    }
    if (want_dw) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        if (count > 0) store_floats<P>(part + k * P, count, part_vector, dw[i]);
      }
    }
  }
}

// ---- grad-weight partial sum ---------------------------------------------------------------------

constexpr int kSumColumns = 32;  // columns of one sum block (threadIdx.x)
constexpr int kSumGroups = 32;   // row groups of one sum block (threadIdx.y)

// grad_w[h] = sum_p partials[p, h], rounded once to W. Block (kSumColumns, kSumGroups); grid
// ceil(H / kSumColumns). Thread (x, y) adds rows p = y, y + 32, y + 64, ... in order; then the
// 32 group sums are added in order 0..31. The order depends on the partial count only. 32 groups of 32
// columns (1024 threads per block, each with up to 8 independent loads in flight: the loop is unrolled,
// the additions stay in order) read the partials near bandwidth; H = 4096 gives 128 blocks.
template <typename W>
__global__ void __launch_bounds__(kSumColumns* kSumGroups)
    rms_norm_sum_partials_kernel(const float* __restrict__ partials, W* __restrict__ grad_weight, int64_t n_partials,
                                 int64_t hidden) {
  __shared__ float group_sums[kSumGroups][kSumColumns];
  const int64_t col = int64_t{blockIdx.x} * kSumColumns + threadIdx.x;
  float acc = 0.0f;
  if (col < hidden) {
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < n_partials; p += kSumGroups) acc += partials[p * hidden + col];
  }
  group_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float total = group_sums[0][threadIdx.x];
#pragma unroll
    for (int y = 1; y < kSumGroups; ++y) total += group_sums[y][threadIdx.x];
    grad_weight[col] = from_float<W>(total);
  }
}

}  // namespace rlk_cuda
