// linear_logprob kernels: per-row log-prob of the target, entropy and logsumexp of the scaled logits
// z = (hidden @ weight.T) * inv_temperature, and the gradients of hidden and weight, without ever
// materializing the [N, V] logits. bf16 / fp16 inputs. The GEMMs run on a GEMM core of a fixed interface
// (namespace mma: tile sizes, Operand, gemm_tile / gemm_tiles, and the accumulator layout the epilogues
// read): the mma.sync core mma.cuh on CUDA (rlk-cuda), the MFMA core mma_amd.cuh on HIP (rlk-rocm,
// wavefront 64). Numbers below are mma.cuh's, with mma_amd.cuh's in brackets.
//
// Spec (rlk.reference.logprob), per row n with target y:
//     x = hidden[n] . weight[v]  (fp32 accumulation),   z_v = x_v * inv_t   (one rounded fp32 multiply)
//     lse = logsumexp_v z_v,  logprob = z_y - lse,  entropy = lse - sum_v p_v z_v,  p = softmax(z)
//     G[n, v] = d loss / d x = inv_t * (g_lp * (onehot(y)_v - p_v) + g_ent * p_v * (lse - entropy - z_v))
//     grad_hidden = G @ weight,   grad_weight = G.T @ hidden
// Rows whose target equals ignore_index give 0 for logprob, entropy, lse and a zero G row.
//
// Forward: block (row tile of kBM = 128 rows, vocab split of kVocabSplit = 4096 columns) walks its
// split in 32 vocab tiles of kBN = 128 columns; each tile's logits come from a K loop over H in kBK
// steps. Each thread keeps an online softmax state (m, s, b) for each of the kRowTiles x kTileRows = 8 [2]
// rows it holds in the accumulator layout (s and b relative to the max m: SoftmaxState of logprob.cuh, so
// entropy = log s - b / s has no |z|-sized cancellation), folding its kColTiles x kTileCols = 8 [32]
// columns of each vocab tile (fold_pack of logprob.cuh). At the end of the split the kRowLanes = 4 [2]
// lanes of a row (xor-shuffle merge) and then the kWarpsN = 4 [2] warps along N (fixed order, through
// shared memory) are merged; the split's state goes to
// part_{m,s,b}[split, row] (merge of logprob.cuh: each state moved to the common max). The target
// logit is written to z_target[row] by the one thread that computes it. A combine kernel then merges
// the splits of a row in split order. Every row goes through the same instruction sequence whatever
// its position and the batch size (fixed tiles, fixed split size, fixed merge order): batch invariant.
//
// Backward, per vocab chunk of kVocabChunk = 4096 columns in order: a grad-logits kernel recomputes
// the logits tile by tile (the forward's GEMM and the same z) and writes G_c [N, cols] in the input
// dtype into a scratch buffer; grad_hidden (+)= G_c @ W_c through an fp32 [N, H] scratch accumulator
// (first chunk writes it, later chunks add, the last one stores hidden's dtype); grad_weight[c] =
// G_c.T @ hidden, its K loop over all N rows in kBK steps (a fixed row partition, fixed order).
//
// The epilogues loop over a thread's accumulators as (i < kRowTiles, h < kTileRows, n < kColTiles,
// e < kTileCols), the nesting the CUDA kernels were first written in: rlk-cuda's generated code is the
// same as before the GEMM core was abstracted (byte-identical cubins; a flat loop changed the PTX).
#pragma once

#include <cmath>

#include "common.cuh"
#include "logprob.cuh"
#if defined(__HIP_PLATFORM_AMD__)
#include "mma_amd.cuh"  // the MFMA core (gfx9, wavefront 64): rlk-rocm
#else
#include "mma.cuh"  // the mma.sync core
#endif

namespace rlk_cuda {

constexpr int64_t kVocabSplit = 4096;  // forward: columns per vocab split (a multiple of mma::kBN)
constexpr int64_t kVocabChunk = 4096;  // backward: columns per vocab chunk (a multiple of mma::kBN)
constexpr int64_t kGroupRows = 8;      // row tiles scheduled together (L2 reuse of weight tiles)
constexpr int kCombineThreads = 256;
static_assert(kVocabSplit % mma::kBN == 0 && kVocabChunk % mma::kBN == 0, "splits hold whole vocab tiles");

// Number of vocab splits of the forward: ceil(V / kVocabSplit).
__host__ __device__ constexpr int64_t linear_num_splits(int64_t vocab) {
  return (vocab + kVocabSplit - 1) / kVocabSplit;
}

// 16-bit pair -> packed register (low half: the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  const bf16x2 v = floats_to_bf16x2_rn(lo, hi);  // lo in the low 16 bits, hi in the high ones
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- forward ---------------------------------------------------------------------------------------

// Grid: ceil(N / kBM) * linear_num_splits(V) blocks of mma::kThreads; mma::kSmemBytes dynamic smem.
// part_b is written only with kEntropy. z_target[row] is written by the block whose split holds the
// row's target (exactly one thread in the grid), for non-ignored rows with a target in [0, V).
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(mma::kThreads, 1)
    linear_logprob_fwd_kernel(const T* __restrict__ hidden, const T* __restrict__ weight,
                              const int64_t* __restrict__ targets, const float* __restrict__ inv_temperature,
                              int64_t n_rows, int64_t vocab, int64_t hidden_size, int64_t ignore_index,
                              float* __restrict__ part_m, float* __restrict__ part_s, float* __restrict__ part_b,
                              float* __restrict__ z_target) {
  using mma::kBM;
  using mma::kBN;
  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  __shared__ float row_inv_t[kBM];
  __shared__ int row_target_col[kBM];  // target - split start when in this split (and not ignored), else -1

  const int64_t n_splits = linear_num_splits(vocab);
  int64_t row_tile, split;
  mma::grouped_tile(blockIdx.x, (n_rows + kBM - 1) / kBM, n_splits, kGroupRows, row_tile, split);
  const int64_t row0 = row_tile * kBM;
  const int64_t v_begin = split * kVocabSplit;
  const int64_t v_end = min(v_begin + kVocabSplit, vocab);
  const int64_t n_vtiles = (v_end - v_begin + kBN - 1) / kBN;
  const int64_t k_steps = (hidden_size + mma::kBK - 1) / mma::kBK;

  if (threadIdx.x < kBM) {
    const int64_t row = row0 + threadIdx.x;
    float inv_t = 1.0f;
    int col = -1;
    if (row < n_rows) {
      const int64_t t = targets[row];
      inv_t = inv_temperature[row];
      if (t != ignore_index && t >= v_begin && t < v_end) col = static_cast<int>(t - v_begin);
    }
    row_inv_t[threadIdx.x] = inv_t;
    row_target_col[threadIdx.x] = col;
  }
  // (the pipeline's first barrier publishes these before the first fold reads them)

  const mma::Operand a{hidden, hidden_size, n_rows, hidden_size};
  // The split's weight rows: vocab rows v_begin .. v_end - 1.
  const mma::Operand b{weight + v_begin * hidden_size, hidden_size, v_end - v_begin, hidden_size};

  // State of the thread's accumulator row (i, h): block row mma::slot_row(i, h).
  SoftmaxState st[mma::kRowTiles][mma::kTileRows];
#pragma unroll
  for (int i = 0; i < mma::kRowTiles; ++i)
#pragma unroll
    for (int h = 0; h < mma::kTileRows; ++h) st[i][h] = SoftmaxState{-INFINITY, 0.0f, 0.0f};

  mma::Acc acc;
  // One flat pipeline over (vocab tile, k step): loads of the next vocab tile overlap this one's fold.
  mma::gemm_tiles<T, true, true>(smem, a, row0, b, 0, n_vtiles, k_steps, acc, [&](int64_t vt) {
  // Vocab tile vt's logits are in acc: fold each of the thread's rows' values into its state.
#pragma unroll
    for (int i = 0; i < mma::kRowTiles; ++i) {
#pragma unroll
      for (int h = 0; h < mma::kTileRows; ++h) {
        const int r = mma::slot_row(i, h);
        const float inv_t = row_inv_t[r];
        const int target_col = row_target_col[r];
        float z[mma::kColTiles * mma::kTileCols];
#pragma unroll
        for (int n = 0; n < mma::kColTiles; ++n) {
#pragma unroll
          for (int e = 0; e < mma::kTileCols; ++e) {
            const int col = static_cast<int>(vt * kBN) + mma::slot_col(n, e);  // column within the split
            float zv = __fmul_rn(mma::acc_value(acc, i, h, n, e), inv_t);      // z = x * inv_t, rounded on its own
            if (col == target_col) z_target[row0 + r] = zv;
            z[mma::kTileCols * n + e] = v_begin + col < v_end ? zv : -INFINITY;
          }
        }
        fold_pack<mma::kColTiles * mma::kTileCols, kEntropy, true>(st[i][h], z);
      }
    }
  });

  // Merge the kRowLanes lanes holding a row (xor-shuffle tree); the row's first lane's result is used.
  const int lane = mma::lane_id();
#pragma unroll
  for (int i = 0; i < mma::kRowTiles; ++i) {
#pragma unroll
    for (int h = 0; h < mma::kTileRows; ++h) {
#pragma unroll
      for (int offset = mma::kRowLaneStride; offset < mma::kRowLaneStride * mma::kRowLanes; offset <<= 1) {
        SoftmaxState o{shfl_xor(st[i][h].m, offset), shfl_xor(st[i][h].s, offset), shfl_xor(st[i][h].b, offset)};
        st[i][h] = merge(st[i][h], o);
      }
    }
  }
  // Then the kWarpsN warps sharing a row, in warp order, through the (now idle) pipeline smem.
  float* red = reinterpret_cast<float*>(smem_raw);  // [kWarpsN][kBM][3]
  const int warp_n = mma::warp_n();
  if (lane / mma::kRowLaneStride % mma::kRowLanes == 0) {
#pragma unroll
    for (int i = 0; i < mma::kRowTiles; ++i) {
#pragma unroll
      for (int h = 0; h < mma::kTileRows; ++h) {
        float* slot = red + (warp_n * kBM + mma::slot_row(i, h)) * 3;
        slot[0] = st[i][h].m;
        slot[1] = st[i][h].s;
        slot[2] = st[i][h].b;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < kBM) {
    const int r = threadIdx.x;
    SoftmaxState total{red[r * 3], red[r * 3 + 1], red[r * 3 + 2]};
#pragma unroll
    for (int w = 1; w < mma::kWarpsN; ++w) {
      const float* slot = red + (w * kBM + r) * 3;
      total = merge(total, SoftmaxState{slot[0], slot[1], slot[2]});
    }
    const int64_t row = row0 + r;
    if (row < n_rows) {
      const int64_t at = split * n_rows + row;
      part_m[at] = total.m;
      part_s[at] = total.s;
      if constexpr (kEntropy) part_b[at] = total.b;
    }
  }
}

// Grid: ceil(N / kCombineThreads) blocks, one thread per row: merges the splits in split order.
// part_b and entropy_out: both null or both set. `static`: every translation unit that includes this header
// (the mma.sync and the wgmma forward) gets its own copy, no duplicate symbol at link time.
static __global__ void __launch_bounds__(kCombineThreads)
    linear_logprob_combine_kernel(const float* __restrict__ part_m, const float* __restrict__ part_s,
                                  const float* __restrict__ part_b, const float* __restrict__ z_target,
                                  const int64_t* __restrict__ targets, int64_t n_rows, int64_t vocab,
                                  int64_t ignore_index, float* __restrict__ logprob_out,
                                  float* __restrict__ entropy_out, float* __restrict__ lse_out) {
  const int64_t row = int64_t{blockIdx.x} * kCombineThreads + threadIdx.x;
  if (row >= n_rows) return;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    logprob_out[row] = 0.0f;
    lse_out[row] = 0.0f;
    if (entropy_out != nullptr) entropy_out[row] = 0.0f;
    return;
  }
  const int64_t n_splits = linear_num_splits(vocab);
  const bool entropy = entropy_out != nullptr;
  SoftmaxState st{part_m[row], part_s[row], entropy ? part_b[row] : 0.0f};
  for (int64_t s = 1; s < n_splits; ++s) {
    const int64_t at = s * n_rows + row;
    st = merge(st, SoftmaxState{part_m[at], part_s[at], entropy ? part_b[at] : 0.0f});
  }
  const float log_s = logf(st.s);
  const float lse = st.m + log_s;
  // A target outside [0, V) (value checks disabled) gives NaN: no thread wrote its z_target.
  const float z_t = (target >= 0 && target < vocab) ? z_target[row] : NAN;
  logprob_out[row] = (z_t - st.m) - log_s;  // relative to the max, as the entropy (logprob.cuh)
  lse_out[row] = lse;
  if (entropy) entropy_out[row] = entropy_of(st);
}

// ---- backward ----------------------------------------------------------------------------------

// Per-row values the backward's G needs (rows with a valid target; kEntropy: with the entropy term).
struct GradRow {
  int64_t target;
  bool valid;                             // target != ignore_index
  float inv_t, lse, g_lp, g_ent, mean_z;  // mean_z = E_p[z] = lse - entropy (0 / unused without entropy)
};

template <bool kEntropy>
__device__ __forceinline__ GradRow load_grad_row(int64_t row, const int64_t* targets, const float* inv_temperature,
                                                 const float* lse, const float* entropy, const float* grad_logprob,
                                                 const float* grad_entropy, int64_t ignore_index) {
  GradRow r;
  r.target = targets[row];
  r.valid = r.target != ignore_index;
  r.inv_t = inv_temperature[row];
  r.lse = lse[row];
  r.g_lp = grad_logprob[row];
  r.g_ent = 0.0f;
  r.mean_z = 0.0f;
  if constexpr (kEntropy) {
    r.g_ent = grad_entropy[row];
    r.mean_z = r.lse - entropy[row];
  }
  return r;
}

// G[row, v] from the scaled logit z of a column `in_range` (v < V): inv_t * (g_lp * (onehot - p) + g_ent * p *
// (E_p[z] - z)), p = exp(z - lse), 0 for an ignored row or a padding column. grad_logit_of_z takes the forward's
// stored z (the one-pass backward), grad_logit the recomputed logit x = hidden[row] . weight[v] (fp32 GEMM
// result), from which it forms z as the forward did (the same rounded multiply).
template <bool kEntropy>
__device__ __forceinline__ float grad_logit_of_z(const GradRow& r, float z, int64_t v, bool in_range) {
  const float p = __expf(z - r.lse);
  float grad = -r.g_lp * p;
  if (v == r.target) grad += r.g_lp;
  if constexpr (kEntropy) {
    if (p > 0.0f) grad += r.g_ent * p * (r.mean_z - z);
  }
  return (r.valid && in_range) ? grad * r.inv_t : 0.0f;
}

template <bool kEntropy>
__device__ __forceinline__ float grad_logit(const GradRow& r, float x, int64_t v, bool in_range) {
  return grad_logit_of_z<kEntropy>(r, __fmul_rn(x, r.inv_t), v, in_range);
}

// G for vocab columns [v_start, v_start + cols) of all rows: g[row * g_stride + c], c < g_stride (columns
// c >= cols, up to the end of the last vocab tile, are written 0, so the GEMMs may read them as padding).
// Grid: ceil(N / kBM) * ceil(cols / kBN) blocks of mma::kThreads; mma::kSmemBytes dynamic smem.
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(mma::kThreads, 1)
    linear_logprob_grad_logits_kernel(const T* __restrict__ hidden, const T* __restrict__ weight,
                                      const int64_t* __restrict__ targets, const float* __restrict__ inv_temperature,
                                      const float* __restrict__ lse, const float* __restrict__ entropy,
                                      const float* __restrict__ grad_logprob, const float* __restrict__ grad_entropy,
                                      int64_t n_rows, int64_t hidden_size, int64_t ignore_index, int64_t v_start,
                                      int64_t cols, T* __restrict__ g, int64_t g_stride) {
  using mma::kBM;
  using mma::kBN;
  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int64_t row_tile, col_tile;
  mma::grouped_tile(blockIdx.x, (n_rows + kBM - 1) / kBM, (cols + kBN - 1) / kBN, kGroupRows, row_tile, col_tile);
  const int64_t row0 = row_tile * kBM;
  const int64_t col0 = col_tile * kBN;

  const mma::Operand a{hidden, hidden_size, n_rows, hidden_size};
  const mma::Operand b{weight + v_start * hidden_size, hidden_size, cols, hidden_size};
  mma::Acc acc;
  mma::gemm_tile<T, true, true>(smem, a, row0, b, col0, hidden_size, acc);

#pragma unroll
  for (int i = 0; i < mma::kRowTiles; ++i) {
#pragma unroll
    for (int h = 0; h < mma::kTileRows; ++h) {
      const int64_t row = row0 + mma::slot_row(i, h);
      if (row >= n_rows) continue;
      const GradRow r = load_grad_row<kEntropy>(row, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy,
                                                ignore_index);
#pragma unroll
      for (int n = 0; n < mma::kColTiles; ++n) {
#pragma unroll
        for (int e = 0; e < mma::kTileCols; e += 2) {
          const int64_t c = col0 + mma::slot_col(n, e);  // even; c + 1 < g_stride too (g_stride % 8 == 0)
          if (c >= g_stride) continue;
          const float lo = grad_logit<kEntropy>(r, mma::acc_value(acc, i, h, n, e), v_start + c, c < cols);
          const float hi = grad_logit<kEntropy>(r, mma::acc_value(acc, i, h, n, e + 1), v_start + c + 1, c + 1 < cols);
          *reinterpret_cast<uint32_t*>(g + row * g_stride + c) = pack2<T>(lo, hi);
        }
      }
    }
  }
}

// What the grad_hidden kernel does with a chunk's product r = G_c @ W_c.
enum class AccumulateMode : int {
  kWrite = 0,     // acc = r           (first of several chunks)
  kAdd = 1,       // acc = acc + r     (a middle chunk)
  kAddStore = 2,  // out = T(acc + r)  (the last of several chunks)
  kStore = 3,     // out = T(r)        (the only chunk)
};

// Applies `mode` to the pair (r.x, r.y) of columns (c, c + 1) at flat index `at` (= row * H + c).
template <typename T>
__device__ __forceinline__ void store_pair(AccumulateMode mode, float* acc_buf, T* out, int64_t at, float2 r) {
  if (mode == AccumulateMode::kAdd || mode == AccumulateMode::kAddStore) {
    const float2 prev = *reinterpret_cast<const float2*>(acc_buf + at);
    r.x = prev.x + r.x;
    r.y = prev.y + r.y;
  }
  if (mode == AccumulateMode::kWrite || mode == AccumulateMode::kAdd) {
    *reinterpret_cast<float2*>(acc_buf + at) = r;
  } else {
    *reinterpret_cast<uint32_t*>(out + at) = pack2<T>(r.x, r.y);
  }
}

// The mma.sync tile's accumulators -> out / acc_buf [rows, cols] (row-major, cols % 8 == 0) under `mode`,
// for the tile at (row0, col0); rows / columns past the matrix are not stored. (The wgmma kernels' equivalent
// is wgbwd::ChunkStoreEpilogue, on the other accumulator layout.)
template <typename T>
__device__ __forceinline__ void store_tile(const mma::Acc& acc, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
                                           AccumulateMode mode, float* acc_buf, T* out) {
#pragma unroll
  for (int i = 0; i < mma::kRowTiles; ++i) {
#pragma unroll
    for (int h = 0; h < mma::kTileRows; ++h) {
      const int64_t row = row0 + mma::slot_row(i, h);
      if (row >= rows) continue;
#pragma unroll
      for (int n = 0; n < mma::kColTiles; ++n) {
#pragma unroll
        for (int e = 0; e < mma::kTileCols; e += 2) {
          const int64_t c = col0 + mma::slot_col(n, e);  // even, and cols % 8 == 0: c + 1 < cols when c < cols
          if (c >= cols) continue;
          store_pair<T>(mode, acc_buf, out, row * cols + c,
                        float2{mma::acc_value(acc, i, h, n, e), mma::acc_value(acc, i, h, n, e + 1)});
        }
      }
    }
  }
}

#if !defined(__HIP_PLATFORM_AMD__)
// GEMMs 2 and 3 of one vocab chunk of the Hopper backward (linear_logprob_wgmma.cu, sm_90a only), from the
// chunk's G (g: [n_rows, k_cols] at row stride g_stride, k_cols = cols rounded up to 8, zeros past cols; 16-byte
// aligned; w_chunk: the chunk's `cols` weight rows): grad_hidden_out (+)= G_c @ W_c under grad_hidden_mode(chunk,
// n_chunks) with the fp32 [n_rows, hidden_size] accumulator grad_hidden_acc, and grad_weight_chunk = G_c.T @ hidden,
// [cols, hidden_size] of the 16-bit dtype, or fp32 with grad_weight_fp32 (written, or added to with accumulate).
// Either output may be null. Shared with distill.cu.
void wgmma_chunk_grad_gemms(DType dtype, const void* hidden, const void* w_chunk, const void* g, int64_t g_stride,
                            int64_t n_rows, int64_t cols, int64_t hidden_size, int64_t chunk, int64_t n_chunks,
                            void* grad_hidden_out, float* grad_hidden_acc, void* grad_weight_chunk,
                            bool grad_weight_fp32, bool accumulate, cudaStream_t s);

// Host side (linear_logprob_launchers.h, compiled in linear_logprob.cu), shared by the mma.sync and the wgmma
// backward: the argument checks (false: nothing to compute) and the grad_hidden mode of chunk `chunk` of
// `n_chunks`. (rlk-rocm defines them in its own namespace, from the same header.)
bool check_linear_bwd_args(const char* what, const void* hidden, const void* weight, int64_t n_rows, int64_t vocab,
                           int64_t hidden_size, const float* entropy, const float* grad_entropy,
                           const void* grad_hidden_out, const void* grad_weight_out, const void* g_scratch,
                           int64_t g_stride, const float* grad_hidden_acc);
AccumulateMode grad_hidden_mode(int64_t chunk, int64_t n_chunks);
#endif

// grad_hidden contribution of one chunk: r[N, H] = G_c[N, k_cols] @ W_c[k_rows, H], where G_c has k_cols
// columns (k_rows rounded up to 8, zeros past k_rows) and W_c is weight rows v_start .. v_start + k_rows.
// Grid: ceil(N / kBM) * ceil(H / kBN) blocks; mma::kSmemBytes dynamic smem.
template <typename T>
__global__ void __launch_bounds__(mma::kThreads, 1)
    linear_logprob_grad_hidden_kernel(const T* __restrict__ g, int64_t g_stride, const T* __restrict__ weight_chunk,
                                      int64_t k_rows, int64_t k_cols, int64_t n_rows, int64_t hidden_size,
                                      AccumulateMode mode, float* __restrict__ acc_buf, T* __restrict__ out) {
  using mma::kBM;
  using mma::kBN;
  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int64_t row_tile, col_tile;
  mma::grouped_tile(blockIdx.x, (n_rows + kBM - 1) / kBM, (hidden_size + kBN - 1) / kBN, kGroupRows, row_tile,
                    col_tile);
  const int64_t row0 = row_tile * kBM;
  const int64_t col0 = col_tile * kBN;
  const mma::Operand a{g, g_stride, n_rows, k_cols};                     // K-major: [N, k] row-major
  const mma::Operand b{weight_chunk, hidden_size, k_rows, hidden_size};  // N-major: [k, H] row-major
  mma::Acc acc;
  mma::gemm_tile<T, true, false>(smem, a, row0, b, col0, k_cols, acc);
  store_tile<T>(acc, row0, col0, n_rows, hidden_size, mode, acc_buf, out);
}

// grad_weight of one chunk: out[v_start + m, :] = sum_n G_c[n, m] * hidden[n, :] for m < k_rows, the sum over
// all N rows in kBK steps, in row order. G_c: [N, g_stride] row-major, read as the M-major A operand
// (m extent m_cols = k_rows rounded up to 8); hidden: [N, H] row-major, the N-major B operand.
// Grid: ceil(k_rows / kBM) * ceil(H / kBN) blocks; mma::kSmemBytes dynamic smem.
template <typename T>
__global__ void __launch_bounds__(mma::kThreads, 1)
    linear_logprob_grad_weight_kernel(const T* __restrict__ g, int64_t g_stride, const T* __restrict__ hidden,
                                      int64_t k_rows, int64_t m_cols, int64_t n_rows, int64_t hidden_size,
                                      T* __restrict__ grad_weight_chunk) {
  using mma::kBM;
  using mma::kBN;
  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int64_t row_tile, col_tile;
  mma::grouped_tile(blockIdx.x, (k_rows + kBM - 1) / kBM, (hidden_size + kBN - 1) / kBN, kGroupRows, row_tile,
                    col_tile);
  const int64_t m0 = row_tile * kBM;
  const int64_t col0 = col_tile * kBN;
  const mma::Operand a{g, g_stride, n_rows, m_cols};               // M-major: A(m, n) at g[n * g_stride + m]
  const mma::Operand b{hidden, hidden_size, n_rows, hidden_size};  // N-major: B(n, h) at hidden[n * H + h]
  mma::Acc acc;
  mma::gemm_tile<T, false, false>(smem, a, m0, b, col0, n_rows, acc);
  store_tile<T>(acc, m0, col0, k_rows, hidden_size, AccumulateMode::kStore, nullptr, grad_weight_chunk);
}

}  // namespace rlk_cuda
