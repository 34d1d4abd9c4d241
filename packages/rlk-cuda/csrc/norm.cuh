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
// Launch structure (both directions use the same threads and element-to-thread map):
// * threads = norm_threads(H, T, kNormPacks), a function of H and the dtype only; thread t owns the
//   packs t + i * threads (i < kNormPacks) of each chunk of threads * kNormPacks packs (16-byte packs:
//   8 bf16 / fp16 or 4 fp32 values). H <= 8192 (16-bit) / 4096 (fp32) is one chunk.
// * forward: one block per kNormFwdRows consecutive rows, walked one row at a time.
// * backward: one block per `rows_per_block` consecutive rows (a fixed partition, never derived
//   from N), walked one row at a time. The block keeps its rows' sum of g * m in registers, written
//   as one fp32 row of a [P, H] partial buffer (P = ceil(N / rows_per_block));
//   rms_norm_sum_partials_kernel then sums the P rows in a fixed order and rounds once to W. No
//   atomics: deterministic run to run.
// * one-chunk rows take the pipelined path (ring_prologue / ring_rows): each thread copies its packs
//   of the next `stages - 1` rows (x and residual; grad_y, s and grad_residual) with cp.async into
//   its own words of a shared-memory ring while the block reduces the current row, so the bytes in
//   flight cost no registers. bf16 H = 4096 (256 threads, 4 stages): forward 3 rows x 8 KiB in flight
//   per block, 60 registers, 4 blocks per SM (96 KiB in flight per SM); backward 3 rows x 16 KiB per
//   block, <= 128 registers, 2 blocks per SM (96 KiB per SM). w' stays in registers for all the
//   block's rows; the backward reads the block's rstd values once. Every input element is read once
//   and every output written once.
// * the plain path (rows of several chunks, or a device without shared memory for two stages): the
//   forward reads x (and residual) twice, the backward reads grad_y and s twice (each row's
//   coefficient first, kept in shared memory): the same arithmetic in the same order.
// * per-row reductions: block_sum_once, one __syncthreads per row (the bits of common.cuh's block_sum).
// Batch invariance: the block size and the element-to-thread map depend on H and the dtype only;
// the per-row reductions (sum of s^2, sum of g_n * n) run in a fixed order; a row runs the same
// instructions (one non-unrolled loop body) whatever its position in a block: the pipelining and
// the ring depth only change when and how (cp.async or element-wise) its loads are issued.
#pragma once

#include "common.cuh"

namespace rlk_cuda {

constexpr int kNormPacks = 2;              // packs per thread per chunk (both directions)
constexpr int kNormFwdRows = 8;            // forward: rows per block (any value gives the same bits)
constexpr int kNormMaxThreads = 512;
constexpr int kNormMaxWarps = kNormMaxThreads / kWarpSize;
constexpr int kNormMaxRowsPerBlock = 256;  // backward: upper bound of rows_per_block
constexpr int kNormMaxStages = 4;          // ring stages: loads run up to 3 rows ahead
constexpr int64_t kNormRingBytes = 96 * 1024;  // ring size aimed at per block (dynamic shared memory)

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

// 16-byte ring words per thread per row: kNormPacks packs of each staged tensor (a pack of T is one
// word; a pack of an fp32 grad_y of 16-bit x is two).
__host__ __device__ constexpr int fwd_ring_words(bool residual) { return kNormPacks * (residual ? 2 : 1); }
template <typename T, typename G>
__host__ __device__ constexpr int bwd_ring_words(bool grad_residual) {
  return kNormPacks * (static_cast<int>(sizeof(G) / sizeof(T)) + 1 + (grad_residual ? 1 : 0));
}

// Ring stages for one stage of `stage_bytes`: as many as fit kNormRingBytes, in [2, kNormMaxStages].
inline int norm_stages(int64_t stage_bytes) {
  const int64_t fit = kNormRingBytes / stage_bytes;
  return static_cast<int>(fit < 2 ? 2 : (fit > kNormMaxStages ? kNormMaxStages : fit));
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

// Sum of v over the block with a single __syncthreads (common.cuh's block_sum takes two) and the
// same bits as block_sum: each warp's shfl_down tree lands in sums[warp], then every thread adds the
// warp sums with the 32-lane tree block_sum's warp 0 applies to them (warps past the block count as
// 0; with <= 16 warps its offset-16 step adds 0 to each of the first 16 values, kept as "+ 0.0f").
// Every thread must call it. `sums` may be written again only once every thread has read it:
// callers alternate two buffers on consecutive calls (the __syncthreads of the call in between
// orders the reads of one before the writes of the next).
__device__ __forceinline__ float block_sum_once(float v, float* sums) {
  static_assert(kNormMaxWarps == 16, "the tree below is written for 16 warp sums");
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) sums[warp] = v;
  __syncthreads();
  float t[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) t[i] = (i < n_warps ? sums[i] : 0.0f) + 0.0f;  // offset 16
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] += t[i + 8];
#pragma unroll
  for (int i = 0; i < 4; ++i) t[i] += t[i + 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) t[i] += t[i + 2];
  return t[0] + t[1];
}

// ---- the shared-memory ring of the one-chunk rows ----------------------------------------------
// Thread t's word j of ring stage s is ring[(s * words + j) * blockDim.x + t] (16 bytes; consecutive
// threads, consecutive words: no bank conflicts). A thread reads only the words it wrote itself, so
// its own cp.async.wait_group orders the copies before the reads (no block barrier).

// 16 bytes global -> shared, bypassing L1 (.cg): the rows are read once.
__device__ __forceinline__ void ring_copy16(uint4* dst, const void* src) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(src) : "memory");
}
__device__ __forceinline__ void ring_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `pending` (< kNormMaxStages) of this thread's latest cp.async groups are in flight.
__device__ __forceinline__ void ring_wait(int pending) {
  static_assert(kNormMaxStages == 4, "one case per possible pending count");
  switch (pending) {
    case 1:
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      break;
    case 2:
      asm volatile("cp.async.wait_group 2;\n" ::: "memory");
      break;
    case 3:
      asm volatile("cp.async.wait_group 3;\n" ::: "memory");
      break;
    default:
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      break;
  }
}

// Starts loading one pack (`count` <= N elements of src, zeros past count) into this thread's ring
// words dst[0], dst[blockDim.x], ...: cp.async for a full pack when `vector` (16-byte aligned src),
// else an element-wise load stored at once (unaligned rows, a row's last pack): the same words.
template <typename E, int N>
__device__ __forceinline__ void ring_load(uint4* dst, const E* __restrict__ src, int64_t count, bool vector) {
  constexpr int kWords = N * static_cast<int>(sizeof(E)) / 16;
  static_assert(kWords * 16 == N * static_cast<int>(sizeof(E)), "a pack is whole 16-byte words");
  if (vector && count == N) {
#pragma unroll
    for (int v = 0; v < kWords; ++v) ring_copy16(dst + v * blockDim.x, reinterpret_cast<const uint4*>(src) + v);
  } else {
    E e[N];
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = i < count ? src[i] : from_float<E>(0.0f);
    uint4 words[kWords];
    std::memcpy(words, e, sizeof(e));
#pragma unroll
    for (int v = 0; v < kWords; ++v) dst[v * blockDim.x] = words[v];
  }
}

// One pack of this thread's ring words as fp32: load_floats' values (fill 0) bit for bit.
template <typename E, int N>
__device__ __forceinline__ void ring_read(const uint4* src, float (&out)[N]) {
  constexpr int kWords = N * static_cast<int>(sizeof(E)) / 16;
  uint4 words[kWords];
#pragma unroll
  for (int v = 0; v < kWords; ++v) words[v] = src[v * blockDim.x];
  E e[N];
  std::memcpy(e, words, sizeof(e));
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
}

// The software pipeline of the one-chunk rows [first, last), loads `stages - 1` rows ahead in a ring
// of `stages` (2..kNormMaxStages) stages. issue(stage, row) starts a row's copies into a stage;
// process(stage, row) consumes it. Each row is one cp.async group (an empty one past `last`), so that
// "the row's group landed" is always "at most stages - 1 groups pending". A stage is refilled one
// iteration after its row was processed, by the same thread that read it.
// ring_prologue issues the first stages - 1 rows; ring_rows then walks the rows in order, issuing
// row + stages - 1 before waiting for and processing `row`.
template <typename Issue>
__device__ __forceinline__ void ring_prologue(int64_t first, int64_t last, int stages, Issue&& issue) {
  for (int d = 0; d + 1 < stages; ++d) {
    if (first + d < last) issue(d, first + d);
    ring_commit();
  }
}

template <typename Issue, typename Process>
__device__ __forceinline__ void ring_rows(int64_t first, int64_t last, int stages, Issue&& issue, Process&& process) {
#pragma unroll 1
  for (int j = 0; first + j < last; ++j) {
    const int64_t ahead = first + j + stages - 1;
    if (ahead < last) issue((j + stages - 1) % stages, ahead);
    ring_commit();
    ring_wait(stages - 1);
    process(j % stages, first + j);
  }
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

// This thread's w' of chunk c (K packs), fp32.
template <typename W, int K, int P>
__device__ __forceinline__ void load_weight_factors(const W* weight, int c, int64_t hidden, bool gemma,
                                                    float (&w)[K][P]) {
  const bool vector = aligned16(weight);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const int64_t k = pack_index<K>(c, i);
    load_weight_factor<W, P>(weight + k * P, pack_count<P>(k, hidden), vector, gemma, w[i]);
  }
}

// y of one pack from s (fp32, already rounded to T), w' and rstd.
template <typename T, typename Y, int P>
__device__ __forceinline__ void store_y(Y* y, const float (&w)[P], const float (&s)[P], float rstd, int64_t count,
                                        bool vector, bool gemma) {
  float out[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float n = s[i] * rstd;
    out[i] = gemma ? n * w[i] : w[i] * round_to<T>(n);
  }
  store_floats<P>(y, count, vector, out);
}

// Pointers of one forward row, and whether 16-byte accesses are allowed on all of them.
template <typename T, typename Y>
struct FwdRow {
  const T* x;
  const T* res;
  T* s;
  Y* y;
  bool vector;
};

template <typename T, typename Y>
__device__ __forceinline__ FwdRow<T, Y> fwd_row(const T* x, const T* residual, T* residual_out, Y* out, int64_t row,
                                                int64_t hidden, bool base_vector) {
  const int64_t base = row * hidden;
  FwdRow<T, Y> r{x + base, residual ? residual + base : nullptr, residual_out ? residual_out + base : nullptr,
                 out + base, false};
  r.vector = base_vector && aligned16(r.x) && aligned16(r.res) && aligned16(r.s) && aligned16(r.y);
  return r;
}

// Grid: ceil(N / kNormFwdRows) blocks; norm_threads(H, P, kNormPacks) threads; n_chunks = norm_chunks(...).
// Block b handles rows [b * kNormFwdRows, min(N, (b + 1) * kNormFwdRows)), one after another.
// residual / residual_out: both null (unfused) or both set. stages > 0 (one-chunk rows only): the
// pipelined path, `stages` ring stages of fwd_ring_words(residual) words per thread in dynamic shared
// memory; stages = 0: the plain path (any number of chunks, no dynamic shared memory; the same arithmetic).
// At most 64 registers (two blocks of 512 threads per SM, four of 256).
template <typename T, typename W, typename Y>
__global__ void __launch_bounds__(kNormMaxThreads, 2)
    rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, const T* __restrict__ residual,
                        Y* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ rstd_out,
                        int64_t n_rows, int64_t hidden, float eps, bool gemma, int n_chunks, int stages) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormPacks;
  const int64_t first = int64_t{blockIdx.x} * kNormFwdRows;
  const int64_t last = min(n_rows, first + kNormFwdRows);
  const bool base_vector = aligned16(weight);
  __shared__ float warp_sums[2][kNormMaxWarps];  // block_sum_once buffers, alternated row by row

  if (stages == 0) {
    // Plain path: the sum of squares over all chunks, then y chunk by chunk (x and residual read again).
    for (int64_t row = first; row < last; ++row) {
      const FwdRow<T, Y> r = fwd_row<T, Y>(x, residual, residual_out, out, row, hidden, base_vector);
      float sum_sq = 0.0f;
      for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          const int64_t count = pack_count<P>(k, hidden);
          float s[P];
          load_s<T, P>(r.x + k * P, r.res ? r.res + k * P : nullptr, count, r.vector, s);
          if (r.s != nullptr && count > 0) store_floats<P>(r.s + k * P, count, r.vector, s);
#pragma unroll
          for (int e = 0; e < P; ++e) sum_sq += s[e] * s[e];  // lanes past the row are 0
        }
      }
      const float rstd =
          rsqrtf(block_sum_once(sum_sq, warp_sums[(row - first) & 1]) / static_cast<float>(hidden) + eps);
      for (int c = 0; c < n_chunks; ++c) {
        float w[K][P];
        load_weight_factors<W, K, P>(weight, c, hidden, gemma, w);
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          const int64_t count = pack_count<P>(k, hidden);
          if (count == 0) continue;
          float s[P];
          load_s<T, P>(r.x + k * P, r.res ? r.res + k * P : nullptr, count, r.vector, s);
          store_y<T, Y, P>(r.y + k * P, w[i], s, rstd, count, r.vector, gemma);
        }
      }
      if (threadIdx.x == 0) rstd_out[row] = rstd;
    }
    return;
  }

  // Pipelined one-chunk rows: ring words [0, K) hold x's packs, [K, 2K) residual's.
  extern __shared__ uint4 norm_ring[];
  const int words = fwd_ring_words(residual != nullptr);
  const int stride = blockDim.x;
  float w[K][P];
  load_weight_factors<W, K, P>(weight, 0, hidden, gemma, w);
  const auto issue = [&](int stage, int64_t row) {
    const FwdRow<T, Y> r = fwd_row<T, Y>(x, residual, residual_out, out, row, hidden, base_vector);
    uint4* slot = norm_ring + int64_t{stage} * words * stride + threadIdx.x;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      ring_load<T, P>(slot + i * stride, r.x + k * P, count, r.vector);
      if (r.res != nullptr) ring_load<T, P>(slot + (K + i) * stride, r.res + k * P, count, r.vector);
    }
  };
  const auto process = [&](int stage, int64_t row) {
    const FwdRow<T, Y> r = fwd_row<T, Y>(x, residual, residual_out, out, row, hidden, base_vector);
    const uint4* slot = norm_ring + int64_t{stage} * words * stride + threadIdx.x;
    float s[K][P];
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      ring_read<T, P>(slot + i * stride, s[i]);
      if (r.res != nullptr) {
        float res[P];
        ring_read<T, P>(slot + (K + i) * stride, res);
#pragma unroll
        for (int e = 0; e < P; ++e) s[i][e] = round_to<T>(s[i][e] + res[e]);
        if (count > 0) store_floats<P>(r.s + k * P, count, r.vector, s[i]);
      }
#pragma unroll
      for (int e = 0; e < P; ++e) sum_sq += s[i][e] * s[i][e];  // lanes past the row are 0
    }
    const float rstd =
        rsqrtf(block_sum_once(sum_sq, warp_sums[(row - first) & 1]) / static_cast<float>(hidden) + eps);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      if (count > 0) store_y<T, Y, P>(r.y + k * P, w[i], s[i], rstd, count, r.vector, gemma);
    }
    if (threadIdx.x == 0) rstd_out[row] = rstd;
  };
  ring_prologue(first, last, stages, issue);
  ring_rows(first, last, stages, issue, process);
}

// This thread's part of sum_h g_n * n over one pack of fp32 g, s and w'.
template <int P>
__device__ __forceinline__ float pack_dot(const float (&g)[P], const float (&s)[P], const float (&w)[P], float rstd,
                                          float dot) {
#pragma unroll
  for (int e = 0; e < P; ++e) dot += (g[e] * w[e]) * (s[e] * rstd);
  return dot;
}

// grad_s of one pack of one row from fp32 g, s, w' (and grad_residual when has_gres); adds g * m to dw.
template <typename T, int P>
__device__ __forceinline__ void pack_grad(const float (&g)[P], const float (&s)[P], const float (&w)[P],
                                          const float (&gres)[P], bool has_gres, float rstd, float coef, bool gemma,
                                          bool want_dw, float (&gs)[P], float (&dw)[P]) {
#pragma unroll
  for (int e = 0; e < P; ++e) {
    const float n = s[e] * rstd;
    const float g_n = g[e] * w[e];
    float v = rstd * (g_n - n * coef);
    if (has_gres) v += gres[e];
    gs[e] = v;
    if (want_dw) dw[e] += g[e] * (gemma ? n : round_to<T>(n));
  }
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

template <typename T, typename G>
__device__ __forceinline__ BwdRow<T, G> bwd_row(const G* grad_out, const T* s, const T* grad_residual, T* grad_input,
                                                int64_t row, int64_t hidden, bool base_vector) {
  const int64_t base = row * hidden;
  BwdRow<T, G> r{grad_out + base, s + base, grad_residual ? grad_residual + base : nullptr, grad_input + base, false};
  r.vector = base_vector && aligned16(r.g) && aligned16(r.s) && aligned16(r.gres) && aligned16(r.gin);
  return r;
}

// Grid: ceil(N / rows_per_block) blocks; norm_threads(H, P, kNormPacks) threads; n_chunks = norm_chunks(...).
// Block b handles rows [b * rows_per_block, min(N, (b + 1) * rows_per_block)), one after another.
// grad_residual may be null; partials ([gridDim.x, H] fp32) is null when grad_weight is not wanted.
// stages > 0 (one-chunk rows only): the pipelined path, `stages` ring stages of
// bwd_ring_words<T, G>(grad_residual) words per thread in dynamic shared memory; stages = 0: the
// plain path (any number of chunks, no dynamic shared memory; the same arithmetic).
template <typename T, typename W, typename G>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_bwd_kernel(const G* __restrict__ grad_out, const T* __restrict__ s, const W* __restrict__ weight,
                        const float* __restrict__ rstd, const T* __restrict__ grad_residual,
                        T* __restrict__ grad_input, float* __restrict__ partials, int64_t n_rows, int64_t hidden,
                        bool gemma, int rows_per_block, int n_chunks, int stages) {
  constexpr int P = kPack<T>;
  constexpr int K = kNormPacks;
  const int64_t first = int64_t{blockIdx.x} * rows_per_block;
  const int64_t last = min(n_rows, first + rows_per_block);
  const bool want_dw = partials != nullptr;
  const bool has_gres = grad_residual != nullptr;
  float* part = want_dw ? partials + int64_t{blockIdx.x} * hidden : nullptr;
  const bool part_vector = aligned16(part);
  const bool base_vector = aligned16(weight);
  __shared__ float warp_sums[2][kNormMaxWarps];  // block_sum_once buffers, alternated row by row
  __shared__ float row_values[kNormMaxRowsPerBlock];  // per row of the block: coef (plain) or rstd

  if (stages == 0) {
    // Plain path: first each row's coefficient mean(g_n * n) over all chunks, then chunk by chunk the
    // gradients and that chunk's grad-weight partial (grad_y and s read twice).
    for (int64_t row = first; row < last; ++row) {
      const BwdRow<T, G> r = bwd_row<T, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
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
          load_floats<P>(r.g + k * P, count, r.vector, g, 0.0f);
          load_floats<P>(r.s + k * P, count, r.vector, sv, 0.0f);
          dot = pack_dot<P>(g, sv, w[i], rs, dot);
        }
      }
      const float coef = block_sum_once(dot, warp_sums[(row - first) & 1]) / static_cast<float>(hidden);
      if (threadIdx.x == 0) row_values[row - first] = coef;
    }
    __syncthreads();
    for (int c = 0; c < n_chunks; ++c) {
      float w[K][P];
      load_weight_factors<W, K, P>(weight, c, hidden, gemma, w);
      float dw[K][P] = {};
      for (int64_t row = first; row < last; ++row) {
        const BwdRow<T, G> r = bwd_row<T, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
        const float rs = rstd[row];
        const float coef = row_values[row - first];
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const int64_t k = pack_index<K>(c, i);
          const int64_t count = pack_count<P>(k, hidden);
          if (count == 0) continue;
          float g[P], sv[P], gres[P] = {}, gs[P];
          load_floats<P>(r.g + k * P, count, r.vector, g, 0.0f);
          load_floats<P>(r.s + k * P, count, r.vector, sv, 0.0f);
          if (has_gres) load_floats<P>(r.gres + k * P, count, r.vector, gres, 0.0f);
          pack_grad<T, P>(g, sv, w[i], gres, has_gres, rs, coef, gemma, want_dw, gs, dw[i]);
          store_floats<P>(r.gin + k * P, count, r.vector, gs);
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
    return;
  }

  // Pipelined one-chunk rows: ring words [0, K * GW) hold grad_y's packs (GW words each), then K of
  // s, then K of grad_residual. The block's rstd values are read once, while the first rows load.
  constexpr int GW = static_cast<int>(sizeof(G) / sizeof(T));
  extern __shared__ uint4 norm_ring[];
  const int words = bwd_ring_words<T, G>(has_gres);
  const int stride = blockDim.x;
  float w[K][P];
  load_weight_factors<W, K, P>(weight, 0, hidden, gemma, w);
  float dw[K][P] = {};
  const auto issue = [&](int stage, int64_t row) {
    const BwdRow<T, G> r = bwd_row<T, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
    uint4* slot = norm_ring + int64_t{stage} * words * stride + threadIdx.x;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      ring_load<G, P>(slot + i * GW * stride, r.g + k * P, count, r.vector);
      ring_load<T, P>(slot + (K * GW + i) * stride, r.s + k * P, count, r.vector);
      if (has_gres) ring_load<T, P>(slot + (K * GW + K + i) * stride, r.gres + k * P, count, r.vector);
    }
  };
  const auto process = [&](int stage, int64_t row) {
    const BwdRow<T, G> r = bwd_row<T, G>(grad_out, s, grad_residual, grad_input, row, hidden, base_vector);
    const uint4* slot = norm_ring + int64_t{stage} * words * stride + threadIdx.x;
    const float rs = row_values[row - first];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      float g[P], sv[P];
      ring_read<G, P>(slot + i * GW * stride, g);
      ring_read<T, P>(slot + (K * GW + i) * stride, sv);
      dot = pack_dot<P>(g, sv, w[i], rs, dot);
    }
    const float coef = block_sum_once(dot, warp_sums[(row - first) & 1]) / static_cast<float>(hidden);
    // g and s are read from the ring again (the same words) rather than kept across the reduction.
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      if (count == 0) continue;
      float g[P], sv[P], gres[P] = {}, gs[P];
      ring_read<G, P>(slot + i * GW * stride, g);
      ring_read<T, P>(slot + (K * GW + i) * stride, sv);
      if (has_gres) ring_read<T, P>(slot + (K * GW + K + i) * stride, gres);
      pack_grad<T, P>(g, sv, w[i], gres, has_gres, rs, coef, gemma, want_dw, gs, dw[i]);
      store_floats<P>(r.gin + k * P, count, r.vector, gs);
    }
  };
  ring_prologue(first, last, stages, issue);
  for (int64_t i = threadIdx.x; i < last - first; i += blockDim.x) row_values[i] = rstd[first + i];
  __syncthreads();
  ring_rows(first, last, stages, issue, process);
  if (want_dw) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int64_t k = pack_index<K>(0, i);
      const int64_t count = pack_count<P>(k, hidden);
      if (count > 0) store_floats<P>(part + k * P, count, part_vector, dw[i]);
    }
  }
}

constexpr int kSumColumns = 32;  // columns of one sum block (threadIdx.x)
constexpr int kSumGroups = 32;   // row groups of one sum block (threadIdx.y)

// grad_w[h] = sum_p partials[p, h], rounded once to W. Block (kSumColumns, kSumGroups); grid
// ceil(H / kSumColumns). Thread (x, y) adds rows p = y, y + 32, y + 64, ... in order; then the
// 32 group sums are added in order 0..31. The order depends on P only. 32 groups of 32 columns
// (1024 threads per block, each with up to 8 independent loads in flight: the loop is unrolled,
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
