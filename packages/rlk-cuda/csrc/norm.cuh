// rms_norm kernels (Llama / Qwen3 and Gemma forms, optional fused residual add).
//
// Spec (rlk.reference.norm), per row of H elements, x of dtype T, weight of dtype W, y of dtype Y:
//     s    = x + residual              rounded to T (s = x unfused)
//     rstd = rsqrt(mean_h s_h^2 + eps)  fp32
//     n    = s * rstd                  fp32
//     y    = w * n.to(T)               gemma = false, the fp32 product rounded once to Y
//     y    = n * (1 + w)               gemma = true, rounded once to Y
// Backward, with w' = w (1 + w for Gemma) and g = grad_y in fp32:
//     g_n    = g * w'
//     grad_s = rstd * (g_n - n * mean_h(g_n * n))  (+ grad_residual)   rounded to T
//     grad_w = sum over rows of g * m,  m = n.to(T) (gemma: m = n)       fp32, rounded to W
//
// Launch structure:
// * forward: one block per row, norm_threads(H, T) threads (a function of H and the dtype only).
//   Thread t owns the packs t + i * threads (i < kNormFwdPacks) of each chunk of threads * kNormFwdPacks
//   packs (16-byte packs: 8 bf16 / fp16 or 4 fp32 values). A row of one chunk stays in registers: x
//   (and residual) read once, y (and s) written once. Longer rows read x (and residual) a second time.
// * backward: one block per `rows_per_block` consecutive rows (a fixed partition, never derived
//   from N), norm_threads(H, T, kNormBwdPacks) threads; each row's grad_y and s are read once and grad_s written once, and the block keeps
//   its rows' sum of g * m in registers, written as one fp32 row of a [P, H] partial buffer
//   (P = ceil(N / rows_per_block)). rms_norm_sum_partials_kernel then sums the P rows in a fixed
//   order and rounds once to W. No atomics: deterministic run to run.
// Batch invariance: the block size and the element-to-thread map depend on H and the dtype only;
// the per-row reductions (sum of s^2, sum of g_n * n) run in a fixed order; a row's instructions
// do not depend on its position in a backward block.
#pragma once

#include "common.cuh"

namespace rlk_cuda {

constexpr int kNormFwdPacks = 4;          // forward: packs per thread per chunk
constexpr int kNormBwdPacks = 2;          // backward: packs per thread per chunk (g, s and dw stay in registers)
constexpr int kNormMaxThreads = 512;
constexpr int kNormMaxRowsPerBlock = 256;  // backward: upper bound of rows_per_block

// Threads of a row block: the smallest power of two >= ceil(packs / packs_per_thread) in [32, 512].
inline int norm_threads(int64_t hidden, int pack, int packs_per_thread) {
  const int64_t want = ceil_div(ceil_div(hidden, pack), packs_per_thread);
  int threads = kWarpSize;
  while (threads < want && threads < kNormMaxThreads) threads *= 2;
  return threads;
}

// Chunks of a row: ceil(packs / (threads * packs_per_thread)).
inline int norm_chunks(int64_t hidden, int pack, int packs_per_thread, int threads) {
  return static_cast<int>(ceil_div(ceil_div(hidden, pack), int64_t{threads} * packs_per_thread));
}

// Pack index of slot i of this thread in chunk c (K packs per thread per chunk).
template <int K>
__device__ __forceinline__ int64_t pack_index(int c, int i) {
  return (int64_t{c} * K + i) * blockDim.x + threadIdx.x;
}

// Elements of pack k present in a row of `hidden` (0 past the end).
template <int P>
__device__ __forceinline__ int64_t pack_count(int64_t k, int64_t hidden) {
  const int64_t left = hidden - k * P;
  return left <= 0 ? 0 : (left < P ? left : P);
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

// The fp32 weight factor w' of one pack: w, or 1 + w for Gemma.
template <typename W, int P>
__device__ __forceinline__ void load_weight_factor(const W* weight, int64_t count, bool vector, bool gemma,
                                                   float (&w)[P]) {
  load_floats<P>(weight, count, vector, w, 0.0f);
  if (gemma) {
#pragma unroll
    for (int i = 0; i < P; ++i) w[i] = 1.0f + w[i];
  }
}

// y of one pack from s (fp32, already rounded to T) and rstd.
template <typename T, typename W, typename Y, int P>
__device__ __forceinline__ void store_y(Y* y, const W* weight, const float (&s)[P], float rstd, int64_t count,
                                        bool vector, bool gemma) {
  float w[P];
  load_weight_factor<W, P>(weight, count, vector, gemma, w);
  float out[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float n = s[i] * rstd;
    out[i] = gemma ? n * w[i] : w[i] * round_to<T>(n);
  }
  store_floats<P>(y, count, vector, out);
}

// Grid: one block per row; norm_threads(H, P, kNormFwdPacks) threads; n_chunks = norm_chunks(...).
// residual / residual_out: both null (unfused) or both set.
template <typename T, typename W, typename Y>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, const T* __restrict__ residual,
                        Y* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ rstd_out,
                        int64_t hidden, float eps, bool gemma, int n_chunks) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormFwdPacks;
  const int64_t row = blockIdx.x;
  const int64_t base = row * hidden;
  const T* xr = x + base;
  const T* rr = residual != nullptr ? residual + base : nullptr;
  T* sr = residual_out != nullptr ? residual_out + base : nullptr;
  Y* yr = out + base;
  const bool vector = aligned16(xr) && aligned16(weight) && aligned16(yr) && aligned16(rr) && aligned16(sr);

  float s[K][P];
  float sum_sq = 0.0f;
  for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(c, i);
      const int64_t count = pack_count<P>(k, hidden);
      load_s<T, P>(xr + k * P, rr ? rr + k * P : nullptr, count, vector, s[i]);
      if (sr != nullptr && count > 0) store_floats<P>(sr + k * P, count, vector, s[i]);
#pragma unroll
      for (int e = 0; e < P; ++e) sum_sq += s[i][e] * s[i][e];  // lanes past the row are 0
    }
  }
  const float rstd = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);

  for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(c, i);
      const int64_t count = pack_count<P>(k, hidden);
      if (count == 0) continue;
      if (n_chunks > 1) load_s<T, P>(xr + k * P, rr ? rr + k * P : nullptr, count, vector, s[i]);
      store_y<T, W, Y, P>(yr + k * P, weight + k * P, s[i], rstd, count, vector, gemma);
    }
  }
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

// grad_s of one pack of one row from fp32 g, s, w' (loads grad_residual); adds g * m to dw.
template <typename T, int P>
__device__ __forceinline__ void pack_grad(const float (&g)[P], const float (&s)[P], const float (&w)[P],
                                          const T* grad_residual, float rstd, float coef, int64_t count, bool vector,
                                          bool gemma, bool want_dw, float (&gs)[P], float (&dw)[P]) {
  float gres[P];
  if (grad_residual != nullptr) load_floats<P>(grad_residual, count, vector, gres, 0.0f);
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const float n = s[e] * rstd;
    const float g_n = g[e] * w[e];
    float v = rstd * (g_n - n * coef);
    if (grad_residual != nullptr) v += gres[e];
    gs[e] = v;
    if (want_dw) dw[e] += g[e] * (gemma ? n : round_to<T>(n));
  }
}

// This thread's part of sum_h g_n * n over packs of fp32 g, s (w' loaded here).
template <typename W, int P>
__device__ __forceinline__ float pack_dot(const float (&g)[P], const float (&s)[P], const W* weight, float rstd,
                                          int64_t count, bool vector, bool gemma, float dot) {
  float w[P];
  load_weight_factor<W, P>(weight, count, vector, gemma, w);
#pragma unroll
  for (int e = 0; e < P; ++e) dot += (g[e] * w[e]) * (s[e] * rstd);
  return dot;
}

// Pointers of one backward row, and whether 16-byte accesses are allowed on all of them.
template <typename T, typename G>
struct BwdRow {
  const G* g;
  const T* s;
  const T* gres;
  T* gin;
  bool vector;
};

template <typename T, typename W, typename G>
__device__ __forceinline__ BwdRow<T, G> bwd_row(const G* grad_out, const T* s, const T* grad_residual, T* grad_input,
                                                int64_t row, int64_t hidden, bool base_vector) {
  const int64_t base = row * hidden;
  BwdRow<T, G> r{grad_out + base, s + base, grad_residual ? grad_residual + base : nullptr, grad_input + base, false};
  r.vector = base_vector && aligned16(r.g) && aligned16(r.s) && aligned16(r.gres) && aligned16(r.gin);
  return r;
}

// Grid: ceil(N / rows_per_block) blocks; norm_threads(H, P, kNormBwdPacks) threads; n_chunks = norm_chunks(...).
// grad_residual may be null; partials ([gridDim.x, H] fp32) is null when grad_weight is not wanted.
template <typename T, typename W, typename G>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_bwd_kernel(const G* __restrict__ grad_out, const T* __restrict__ s, const W* __restrict__ weight,
                        const float* __restrict__ rstd, const T* __restrict__ grad_residual,
                        T* __restrict__ grad_input, float* __restrict__ partials, int64_t n_rows, int64_t hidden,
                        bool gemma, int rows_per_block, int n_chunks) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormBwdPacks;
  const int64_t first = int64_t{blockIdx.x} * rows_per_block;
  const int64_t last = min(n_rows, first + rows_per_block);
  const bool want_dw = partials != nullptr;
  float* part = want_dw ? partials + int64_t{blockIdx.x} * hidden : nullptr;
  const bool base_vector = aligned16(weight) && aligned16(part);
  __shared__ float coefs[kNormMaxRowsPerBlock];

  // Long rows (more than one chunk) first compute each row's coefficient mean(g_n * n) over all
  // chunks; one-chunk rows compute it on the values they keep in registers.
  if (n_chunks > 1) {
    for (int64_t row = first; row < last; ++row) {
      const BwdRow<T, G> r = bwd_row<T, W, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
      const float rs = rstd[row];
      float dot = 0.0f;
      for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          const int64_t count = pack_count<P>(k, hidden);
          float g[P], sv[P];
          load_floats<P>(r.g + k * P, count, r.vector, g, 0.0f);
          load_floats<P>(r.s + k * P, count, r.vector, sv, 0.0f);
          dot = pack_dot<W, P>(g, sv, weight + k * P, rs, count, r.vector, gemma, dot);
        }
      }
      const float coef = block_sum(dot) / static_cast<float>(hidden);
      if (threadIdx.x == 0) coefs[row - first] = coef;
    }
    __syncthreads();
  }

  for (int c = 0; c < n_chunks; ++c) {
    float dw[K][P];
#pragma unroll
    for (int i = 0; i < K; ++i) {
#pragma unroll
      for (int e = 0; e < P; ++e) dw[i][e] = 0.0f;
    }
    for (int64_t row = first; row < last; ++row) {
      const BwdRow<T, G> r = bwd_row<T, W, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
      const float rs = rstd[row];
      float g[K][P], sv[K][P];
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        load_floats<P>(r.g + k * P, count, r.vector, g[i], 0.0f);
        load_floats<P>(r.s + k * P, count, r.vector, sv[i], 0.0f);
      }
      float coef;
      if (n_chunks == 1) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          dot = pack_dot<W, P>(g[i], sv[i], weight + k * P, rs, pack_count<P>(k, hidden), r.vector, gemma, dot);
        }
        coef = block_sum(dot) / static_cast<float>(hidden);
      } else {
        coef = coefs[row - first];
      }
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        if (count == 0) continue;
        float w[P], gs[P];
        load_weight_factor<W, P>(weight + k * P, count, r.vector, gemma, w);
        pack_grad<T, P>(g[i], sv[i], w, r.gres ? r.gres + k * P : nullptr, rs, coef, count, r.vector, gemma,
                        want_dw, gs, dw[i]);
        store_floats<P>(r.gin + k * P, count, r.vector, gs);
      }
    }
    if (want_dw) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int64_t k = pack_index<K>(c, i);
        const int64_t count = pack_count<P>(k, hidden);
        if (count > 0) store_floats<P>(part + k * P, count, base_vector, dw[i]);
      }
    }
  }
}

constexpr int kSumColumns = 32;  // columns of one sum block (threadIdx.x)
constexpr int kSumGroups = 8;    // row groups of one sum block (threadIdx.y)

// grad_w[h] = sum_p partials[p, h], rounded once to W. Block (kSumColumns, kSumGroups); grid
// ceil(H / kSumColumns). Thread (x, y) adds rows p = y, y + 8, y + 16, ... in order; then the
// 8 group sums are added in order 0..7. The order depends on P only.
template <typename W>
__global__ void __launch_bounds__(kSumColumns* kSumGroups)
    rms_norm_sum_partials_kernel(const float* __restrict__ partials, W* __restrict__ grad_weight, int64_t n_partials,
                                 int64_t hidden) {
  __shared__ float group_sums[kSumGroups][kSumColumns];
  const int64_t col = int64_t{blockIdx.x} * kSumColumns + threadIdx.x;
  float acc = 0.0f;
  if (col < hidden) {
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
