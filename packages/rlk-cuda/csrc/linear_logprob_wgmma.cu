// linear_logprob on Hopper (sm_90a): TMA loads + warpgroup MMA (wgmma), warp-specialized. The forward kernel
// below, and the backward (end of file): the three GEMMs of each vocab chunk on wggemm::gemm_kernel
// (wgmma_gemm.cuh) with linear_logprob-specific epilogues.
//
// STATUS: verified on an H200 (docs/performance.md): the rlk-cuda GPU tests on both kernel pairs,
// compute-sanitizer memcheck / racecheck, the parity suite. rlk_cuda/logprob.py uses these kernels by default
// where they can run (compute capability 9.0, sm_90a built; RLK_CUDA_LINEAR_FWD / RLK_CUDA_LINEAR_BWD=mma
// select the mma.sync ones).
//
// Same math and the same split structure as linear_logprob_fwd_kernel (linear_logprob.cuh), per row n:
//     x_v = hidden[n] . weight[v] (fp32 accumulation, K = H in increasing 64-wide steps, k16 in order)
//     z_v = x_v * inv_t (one rounded fp32 multiply, __fmul_rn)
// and per (row, vocab split of kVocabSplit = 4096 columns) an online state (m = max z, s = sum exp(z - m),
// b = sum (z - m) exp(z - m)) written to part_{m,s,b}[split, row]; z_target[row] from the one thread holding the
// target column; then the existing combine kernel merges the splits of each row in split order.
//
// Block: 128 rows x one vocab split, 3 warpgroups (384 threads):
//   warpgroup 0 (producer): setmaxnreg.dec to 40 registers; one thread walks the (vocab tile, k step)
//     sequence and, per step, waits for a free ring stage (empty mbarrier), arms the stage's full mbarrier
//     with the stage's byte count and issues two TMA loads: hidden [128 rows x 64 k] and weight
//     [256 vocab rows x 64 k], both K-major with the 128-byte swizzle.
//   warpgroups 1, 2 (consumers c = 0, 1): setmaxnreg.inc to 232 registers; consumer c owns block rows
//     64 c .. 64 c + 63 and all 256 columns of a vocab tile: per k step it waits for the stage's full
//     barrier, issues 4 wgmma m64n256k16 (k16 slices in order, the first of a tile with scale-d = 0),
//     commits, waits until the previous step's group is done and releases that step's stage (one
//     arrival per warp on the empty barrier). After the tile's last k step it waits for everything and
//     folds the tile's 64 x 256 fp32 logits into its rows' online states.
// Ring: kStages = 4 stages of 48 KiB (16 KiB hidden + 32 KiB weight) = 192 KiB of dynamic shared memory.
//
// Row ownership in the accumulator (wgmma.cuh): thread (warp w, lane l) of consumer c holds block rows
// 64 c + 16 w + l / 4 and + 8, columns 8 j + 2 (l % 4) + {0, 1} for j = 0..31 of each vocab tile. A row
// is held by the 4 lanes of one quad, always with the same column assignment (l % 4), whatever its
// position; the quad's states are merged by an xor-shuffle tree (1, then 2) at the end of the split.
//
// Batch invariance: fixed tiles (128 x 256 x 64), fixed vocab split, fixed K order, fixed fold chunks of
// 8 columns and merge order, no atomics, and no instruction depends on N or on the row's position (rows
// past N are zero-filled by TMA and never written). The results are NOT bitwise equal to the mma.sync
// path's (different instruction, different fold / merge grouping): both are within the contract.
//
// Layout facts relied on (desk-checked against the PTX ISA; see wgmma.cuh for the details):
//   * TMA with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element (128-byte) inner box writes row r of the box
//     at byte 128 r, 16-byte chunk c at chunk c ^ (r % 8); out-of-bounds elements are zero and count
//     toward complete_tx (a partial box completes the full box's byte count).
//   * wgmma's shared-memory descriptor with swizzle mode 1 (128B), SBO = 1024, reads exactly that
//     layout (K-major); the k16 slice kk starts 32 kk bytes into the tile.
//   * The m64nNk16 f32 accumulator fragment: row 16 w + l / 4 + 8 ((i >> 1) & 1), col 8 (i >> 2) +
//     2 (l % 4) + (i & 1).
//   * mbarrier phase parity: a fresh barrier is in phase 0; waiting for parity 1 returns at once.
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "wgmma.cuh"
#include "tma_map.cuh"
#include "wgmma_gemm.cuh"

#include "linear_logprob.cuh"

namespace rlk_cuda {

namespace wgfwd {

// The tile shape, ring and warp roles are the generic GEMM's (wgmma_gemm.cuh).
using wggemm::kATileBytes;
using wggemm::kBK;
using wggemm::kBM;
using wggemm::kBN;
using wggemm::kConsumerRegs;
using wggemm::kConsumerWarps;
using wggemm::kProducerRegs;
using wggemm::kRingBytes;
using wggemm::kSmemBytes;
using wggemm::kStageBytes;
using wggemm::kStages;
using wggemm::kThreads;
constexpr int kFoldCols = 8;  // columns per fold_pack call (4 column blocks x 2)

static_assert(kVocabSplit % kBN == 0, "a vocab split holds whole vocab tiles");
static_assert(kConsumerWarps == 8 && kFoldCols % 2 == 0 && kBN / 8 % (kFoldCols / 2) == 0, "fold / release shapes");

#if RLK_SM90A_DEVICE
// The block's tile (grouped order over (row tile, vocab split), as the mma.sync forward) and loop counts.
struct BlockTile {
  int row_tile;    // rows 128 row_tile .. 128 row_tile + 127
  int split;       // vocab split index: columns 4096 split ..
  int split_cols;  // columns in the split (<= kVocabSplit; fewer in the last one)
  int n_vtiles;    // vocab tiles of kBN columns in the split (the last may overhang)
  int k_steps;     // ceil(H / kBK)
  // 32-bit fields (the host checks N, V < 2^31 and H < 2^24): fewer registers live through the main loop.
  __device__ __forceinline__ int64_t row0() const { return int64_t{row_tile} * kBM; }
  __device__ __forceinline__ int64_t v_begin() const { return int64_t{split} * kVocabSplit; }
};

__device__ __forceinline__ BlockTile block_tile(int64_t n_rows, int64_t vocab, int64_t hidden_size) {
  BlockTile t;
  wggemm::grouped_tile32(static_cast<int>(blockIdx.x), static_cast<int>((n_rows + kBM - 1) / kBM),
                         static_cast<int>(linear_num_splits(vocab)), static_cast<int>(kGroupRows), t.row_tile, t.split);
  const int64_t v_begin = t.v_begin();
  t.split_cols = static_cast<int>(min(v_begin + kVocabSplit, vocab) - v_begin);
  t.n_vtiles = (t.split_cols + kBN - 1) / kBN;
  t.k_steps = static_cast<int>((hidden_size + kBK - 1) / kBK);
  return t;
}
#endif

}  // namespace wgfwd

// Grid: ceil(N / 128) * linear_num_splits(V) blocks of wgfwd::kThreads, wgfwd::kSmemBytes dynamic smem.
// hidden_map: [N, H] (box 64 x 128), weight_map: [V, H] (box 64 x 256), both SWIZZLE_128B (host side below).
// Outputs as linear_logprob_fwd_kernel: part_{m,s}[split, row] (part_b with kEntropy), z_target[row]; with kStore
// also every z it folds, logits[row * logits_stride + v] (fp32; the one-pass mode's stored logits).
template <typename T, bool kEntropy, bool kStore>
__global__ void __launch_bounds__(wgfwd::kThreads, 1)
    linear_logprob_fwd_wgmma_kernel(const __grid_constant__ CUtensorMap hidden_map,
                                    const __grid_constant__ CUtensorMap weight_map, const int64_t* __restrict__ targets,
                                    const float* __restrict__ inv_temperature, int64_t n_rows, int64_t vocab,
                                    int64_t hidden_size, int64_t ignore_index, float* __restrict__ part_m,
                                    float* __restrict__ part_s, float* __restrict__ part_b,
                                    float* __restrict__ z_target, float* __restrict__ logits, int64_t logits_stride) {
#if RLK_SM90A_DEVICE
  using namespace wgfwd;
  extern __shared__ uint8_t smem_raw[];
  // The ring must start 1024-aligned (128-byte swizzle); the dynamic smem base is only 16-aligned for sure.
  const uint32_t ring = (wgmma::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full_bar = ring + kRingBytes;        // full[s] at full_bar + 8 s
  const uint32_t empty_bar = full_bar + kStages * 8;  // empty[s] at empty_bar + 8 s

  // The block's tile, computed once and kept in shared memory: the consumers re-read the fields they need
  // only at the end (split, row tile) from here instead of holding them in registers through the main loop.
  __shared__ BlockTile s_tile;
  if (threadIdx.x == 0) {
    s_tile = block_tile(n_rows, vocab, hidden_size);
    for (int s = 0; s < kStages; ++s) {
      wgmma::mbar_init(full_bar + 8 * s, 1);                // the producer's arrive.expect_tx (+ the bytes)
      wgmma::mbar_init(empty_bar + 8 * s, kConsumerWarps);  // one arrival per consumer warp
    }
    wgmma::mbar_fence_init();
  }
  __syncthreads();

  // setmaxnreg comes first in each branch, and the block's coordinates are read after it: ptxas spills
  // values that are live across a setmaxnreg.
  if (threadIdx.x < 128) {
    // ---- producer ----
    wgmma::setmaxnreg_dec<kProducerRegs>();

    const BlockTile tile = s_tile;
    const int n_steps = tile.n_vtiles * tile.k_steps;
    if (threadIdx.x == 0) {
      wgmma::prefetch_tensor_map(&hidden_map);
      wgmma::prefetch_tensor_map(&weight_map);
      for (int step = 0; step < n_steps; ++step) {
        const int s = static_cast<int>(step % kStages);
        const uint32_t round = static_cast<uint32_t>(step / kStages);
        // Stage s is free once the consumers released its previous use (round - 1); in round 0 the
        // wait for parity 1 on the fresh barrier returns at once.
        wgmma::mbar_wait(empty_bar + 8 * s, (round & 1u) ^ 1u);
        const uint32_t a_dst = ring + s * kStageBytes;
        const uint32_t b_dst = a_dst + kATileBytes;
        wgmma::mbar_arrive_expect_tx(full_bar + 8 * s, kStageBytes);
        const int32_t k0 = (step % tile.k_steps) * kBK;
        const int32_t vt = step / tile.k_steps;
        wgmma::tma_load_2d(a_dst, &hidden_map, full_bar + 8 * s, k0, static_cast<int32_t>(tile.row0()));
        wgmma::tma_load_2d(b_dst, &weight_map, full_bar + 8 * s, k0, static_cast<int32_t>(tile.v_begin() + vt * kBN));
      }
    }
    return;  // the consumers keep the block (and its shared memory) alive until the last stage is used
  }

  // ---- consumers ----
  wgmma::setmaxnreg_inc<kConsumerRegs>();

  const BlockTile tile = s_tile;
  const int consumer = static_cast<int>(threadIdx.x / 128) - 1;
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int quad_col = 2 * (lane % 4);  // this lane's first column inside each 8-column block

  // The thread's two rows (h = 0, 1): block rows 64 c + 16 w + l / 4 + 8 h. Only what the fold needs stays
  // in registers through the main loop (row indices are recomputed at the end: fewer live registers).
  const int local_row = consumer * 64 + warp * 16 + lane / 4;  // + 8 h
  float inv_t[2];
  int target_col[2];            // target - v_begin when the target is in this split (and the row valid), else -1
  float z_t[2] = {0.0f, 0.0f};  // the target's z, in the lane whose columns hold it
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = tile.row0() + local_row + 8 * h;
    inv_t[h] = 1.0f;
    target_col[h] = -1;
    if (row < n_rows) {
      const int64_t tgt = targets[row];
      inv_t[h] = inv_temperature[row];
      if (tgt != ignore_index && tgt >= tile.v_begin() && tgt < tile.v_begin() + tile.split_cols) {
        target_col[h] = static_cast<int>(tgt - tile.v_begin());
      }
    }
  }
  SoftmaxState st[2] = {SoftmaxState{-INFINITY, 0.0f, 0.0f}, SoftmaxState{-INFINITY, 0.0f, 0.0f}};

  float acc[wgmma::kAccRegs];
#pragma unroll
  for (int i = 0; i < wgmma::kAccRegs; ++i) acc[i] = 0.0f;

  int step = 0;
  for (int vt = 0; vt < tile.n_vtiles; ++vt) {
    int pending = -1;  // the stage whose wgmmas may still be reading it (released one step later)
    for (int ks = 0; ks < tile.k_steps; ++ks, ++step) {
      pending = wggemm::consumer_step<T, false, false>(acc, ring, full_bar, empty_bar, step, consumer, lane, ks == 0,
                                                       pending);
    }
    wggemm::drain(acc);
    if (pending >= 0 && lane == 0) wgmma::mbar_arrive(empty_bar + 8 * pending);  // later vocab tiles reuse it

    // Fold the tile's logits: register 4 j + 2 h + e holds (row h, column 8 j + quad_col + e).
    const int col0 = vt * kBN + quad_col;  // column within the split of register 4 * 0 + 2 h + 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* z_row = nullptr;  // kStore: this row's z at the split's first column (nullptr past N)
      if constexpr (kStore) {
        const int64_t row = tile.row0() + local_row + 8 * h;
        if (row < n_rows) z_row = logits + row * logits_stride + tile.v_begin();
      }
#pragma unroll
      for (int jq = 0; jq < kBN / 8 / (kFoldCols / 2); ++jq) {  // 8 groups of 4 column blocks
        float z[kFoldCols];
#pragma unroll
        for (int jj = 0; jj < kFoldCols / 2; ++jj) {
          const int j = jq * (kFoldCols / 2) + jj;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = col0 + 8 * j + e;
            const float zv = __fmul_rn(acc[4 * j + 2 * h + e], inv_t[h]);  // z = x * inv_t, rounded on its own
            if (col == target_col[h]) z_t[h] = zv;
            if constexpr (kStore) {
              if (z_row != nullptr && col < tile.split_cols) z_row[col] = zv;
            }
            z[2 * jj + e] = col < tile.split_cols ? zv : -INFINITY;
          }
        }
        fold_pack<kFoldCols, kEntropy, true>(st[h], z);
      }
    }
  }

  // Merge the quad (lanes 4g .. 4g + 3 hold the same two rows): xor 1, then xor 2; every lane ends with
  // the same state, lane 4g writes it.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
      SoftmaxState o{__shfl_xor_sync(kFullMask, st[h].m, offset), __shfl_xor_sync(kFullMask, st[h].s, offset),
                     __shfl_xor_sync(kFullMask, st[h].b, offset)};
      st[h] = merge(st[h], o);
    }
    const int64_t row = s_tile.row0() + local_row + 8 * h;  // re-read after the loop's memory clobbers
    if (row < n_rows) {
      if (lane % 4 == 0) {
        const int64_t at = int64_t{s_tile.split} * n_rows + row;
        part_m[at] = st[h].m;
        part_s[at] = st[h].s;
        if constexpr (kEntropy) part_b[at] = st[h].b;
      }
      // Column c of a tile is held by the lane with l % 4 == (c % 8) / 2 (tiles start at multiples of 8).
      if (target_col[h] >= 0 && (target_col[h] % 8) / 2 == lane % 4) z_target[row] = z_t[h];
    }
  }
#elif defined(__CUDA_ARCH__)
  // Compiled for an architecture without wgmma / setmaxnreg (sm_80, sm_90 without `a`, sm_100, sm_120):
  // the host never launches this (linear_logprob_wgmma_problem); trap rather than return garbage.
  __trap();
#endif
}

// ---- backward: the three GEMMs of each vocab chunk on wggemm::gemm_kernel --------------------------------
//
// Per chunk c of kVocabChunk = 4096 columns (in order), as the mma.sync backward (linear_logprob.cuh), with
// the same scratch: G_c [N, k_cols] (k_cols = chunk columns rounded up to 8, zeros past the chunk) in
// hidden's dtype, and for grad_hidden with V > 4096 an fp32 [N, H] accumulator:
//   1. G_c = grad_logit(hidden @ W_c.T)      A = hidden [N, H] K-major, B = W_c [cols, H] K-major
//   2. grad_hidden (+)= G_c @ W_c              A = G_c [N, k_cols] K-major, B = W_c as [K = cols, H] N-major
//   3. grad_weight[c] = G_c.T @ hidden         A = G_c as [K = N, M = k_cols] M-major, B = hidden [K = N, H] N-major
// grad_hidden's sum runs over the chunks in order and inside a chunk over its columns in 64-wide steps: per
// row, the same sequence whatever N (batch invariant). grad_weight's sum over the N rows runs in 64-row
// steps in row order (a fixed partition, no atomics): deterministic.

namespace wgbwd {

// Epilogue of GEMM 1: G_c[row, c] for the tile's columns c < k_cols (0 past the chunk's `cols`).
template <typename T, bool kEntropy>
struct GradLogitsEpilogue {
  const int64_t* targets;
  const float* inv_temperature;
  const float* lse;
  const float* entropy;
  const float* grad_logprob;
  const float* grad_entropy;
  int64_t n_rows, ignore_index, v_start, cols, k_cols;
  T* g;
  int64_t g_stride;

  __device__ __forceinline__ void operator()(const float (&acc)[wgmma::kAccRegs], int64_t row0, int64_t col0) const {
#if RLK_SM90A_DEVICE
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row >= n_rows) continue;
      const GradRow r = load_grad_row<kEntropy>(row, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy,
                                                ignore_index);
#pragma unroll
      for (int j = 0; j < wgmma::kAccN / 8; ++j) {
        const int64_t c = col0 + 8 * j;  // even; k_cols % 8 == 0, so c + 1 < k_cols when c < k_cols
        if (c >= k_cols) continue;
        const float lo = grad_logit<kEntropy>(r, acc[4 * j + 2 * h], v_start + c, c < cols);
        const float hi = grad_logit<kEntropy>(r, acc[4 * j + 2 * h + 1], v_start + c + 1, c + 1 < cols);
        *reinterpret_cast<uint32_t*>(g + row * g_stride + c) = pack2<T>(lo, hi);
      }
    }
#endif
  }
};

// Epilogue of GEMMs 2 and 3: out / acc_buf [rows, cols] (row-major, cols % 8 == 0) under `mode`.
template <typename T>
struct ChunkStoreEpilogue {
  AccumulateMode mode;
  float* acc_buf;
  T* out;
  int64_t rows, cols;

  __device__ __forceinline__ void operator()(const float (&acc)[wgmma::kAccRegs], int64_t row0, int64_t col0) const {
#if RLK_SM90A_DEVICE
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row >= rows) continue;
#pragma unroll
      for (int j = 0; j < wgmma::kAccN / 8; ++j) {
        const int64_t c = col0 + 8 * j;
        if (c >= cols) continue;
        store_pair<T>(mode, acc_buf, out, row * cols + c, float2{acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]});
      }
    }
#endif
  }
};

constexpr int kStoredGradThreads = 256;

// G from the forward's stored z, in place: row `blockIdx.x` of logits (fp32, row stride logits_stride) becomes
// G[row, c] = grad_logit_of_z(z[row, c]) as T at g = (T*) logits with row stride 2 logits_stride, for c < padded
// (= V rounded up to 8; zeros from V on, the GEMMs' padding). A step reads z columns [c0, c0 + 2 B) and, after a
// barrier, writes G columns [c0, c0 + 2 B), i.e. the bytes of z columns [c0 / 2, c0 / 2 + B): those were read in
// this step or an earlier one, never in a later one, so no z is overwritten before it is read.
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kStoredGradThreads)
    stored_grad_logits_kernel(float* logits, int64_t logits_stride, const int64_t* __restrict__ targets,
                              const float* __restrict__ inv_temperature, const float* __restrict__ lse,
                              const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                              const float* __restrict__ grad_entropy, int64_t vocab, int64_t padded,
                              int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const GradRow r =
      load_grad_row<kEntropy>(row, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index);
  const float* z = logits + row * logits_stride;
  T* g = reinterpret_cast<T*>(logits) + row * 2 * logits_stride;
  for (int64_t c0 = 0; c0 < padded; c0 += 2 * kStoredGradThreads) {
    const int64_t c = c0 + 2 * static_cast<int64_t>(threadIdx.x);
    const float z0 = c < vocab ? z[c] : 0.0f;
    const float z1 = c + 1 < vocab ? z[c + 1] : 0.0f;
    __syncthreads();
    if (c < padded) {
      const float lo = grad_logit_of_z<kEntropy>(r, z0, c, c < vocab);
      const float hi = grad_logit_of_z<kEntropy>(r, z1, c + 1, c + 1 < vocab);
      *reinterpret_cast<uint32_t*>(g + c) = pack2<T>(lo, hi);
    }
  }
}

}  // namespace wgbwd

namespace {

bool sm90a_compiled() {
  for (const std::string& arch : compiled_architectures()) {
    if (arch.rfind("90a", 0) == 0) return true;
  }
  return false;
}

}  // namespace

std::string linear_logprob_wgmma_problem(int device) {
  if (!sm90a_compiled()) {
    return "the wgmma forward is not compiled in: this build has no sm_90a kernels (rebuild with RLK_CUDA_ARCHS "
           "including 90a)";
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return "cannot query CUDA device " + std::to_string(device);
  }
  if (major != 9 || minor != 0) {
    return "the wgmma forward needs a compute capability 9.0 GPU (sm_90a: H100 / H200), device " +
           std::to_string(device) + " is " + std::to_string(major) + "." + std::to_string(minor);
  }
  return "";
}

void linear_logprob_fwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                              const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                              int64_t ignore_index, float* logprob_out, float* entropy_out, float* lse_out,
                              float* part_m, float* part_s, float* part_b, float* z_target, int device,
                              std::uintptr_t stream, float* logits_out, int64_t logits_stride) {
  const std::string what = logits_out != nullptr ? "linear_logprob_stored_fwd_wgmma" : "linear_logprob_fwd_wgmma";
  require(n_rows >= 1, what + ": n_rows must be >= 1");
  require(vocab >= 1, what + ": vocab must be >= 1");
  require(hidden_size >= 8 && hidden_size % 8 == 0,
          what + ": hidden size must be a positive multiple of 8 (the Python layer pads other sizes), got " +
              std::to_string(hidden_size));
  require(
      (reinterpret_cast<std::uintptr_t>(hidden) & 15u) == 0 && (reinterpret_cast<std::uintptr_t>(weight) & 15u) == 0,
      what + ": hidden and weight must be 16-byte aligned");
  // TMA coordinates are int32: the row coordinates row0 and v_begin + 256 vt must fit.
  require(n_rows < (int64_t{1} << 31) && vocab < (int64_t{1} << 31) - wgfwd::kBN && hidden_size < (int64_t{1} << 24),
          what + ": N and V must be < 2^31 and H < 2^24 (int32 TMA coordinates and step counters)");
  require(part_m != nullptr && part_s != nullptr && z_target != nullptr,
          what + ": part_m, part_s and z_target are required");
  require(entropy_out == nullptr || part_b != nullptr, what + ": part_b is required with entropy_out");
  require(logits_out == nullptr || logits_stride >= vocab, what + ": logits_out needs a row stride >= V");
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw std::invalid_argument("rlk_cuda: " + what + ": only float16 and bfloat16 are implemented");
  }
  DeviceGuard guard(device);
  const std::string problem = linear_logprob_wgmma_problem(device);
  if (!problem.empty()) throw std::runtime_error("rlk_cuda: " + what + ": " + problem);
  const cudaStream_t s = as_stream(stream);
  const int64_t blocks = ceil_div(n_rows, int64_t{wgfwd::kBM}) * linear_num_splits(vocab);
  require(blocks <= max_grid_x(), what + ": problem too large for one grid");

  const CUtensorMapDataType tdt =
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUtensorMap hidden_map = make_map(tdt, hidden, n_rows, hidden_size, hidden_size, wgfwd::kBM);
  const CUtensorMap weight_map = make_map(tdt, weight, vocab, hidden_size, hidden_size, wgfwd::kBN);

  auto launch = [&](auto kernel, float* pb) {
    DeviceGuard::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, wgfwd::kSmemBytes),
                       "cudaFuncSetAttribute(linear_logprob_fwd_wgmma_kernel)");
    kernel<<<static_cast<unsigned>(blocks), wgfwd::kThreads, wgfwd::kSmemBytes, s>>>(
        hidden_map, weight_map, targets, inv_temperature, n_rows, vocab, hidden_size, ignore_index, part_m, part_s, pb,
        z_target, logits_out, logits_stride);
  };
  // (dtype, entropy, store) -> one of the eight instantiations
  auto by_store = [&](auto tag, auto entropy) {
    using T = decltype(tag);
    constexpr bool kEntropy = decltype(entropy)::value;
    float* pb = kEntropy ? part_b : nullptr;
    if (logits_out != nullptr) {
      launch(linear_logprob_fwd_wgmma_kernel<T, kEntropy, true>, pb);
    } else {
      launch(linear_logprob_fwd_wgmma_kernel<T, kEntropy, false>, pb);
    }
  };
  auto by_entropy = [&](auto tag) {
    if (entropy_out != nullptr) {
      by_store(tag, std::true_type{});
    } else {
      by_store(tag, std::false_type{});
    }
  };
  if (dtype == DType::kBFloat16) {
    by_entropy(__nv_bfloat16{});
  } else {
    by_entropy(__half{});
  }
  check_launch("linear_logprob_fwd_wgmma_kernel launch");
  const int64_t combine_blocks = ceil_div(n_rows, int64_t{kCombineThreads});
  require(combine_blocks <= max_grid_x(), what + ": problem too large for one grid");
  linear_logprob_combine_kernel<<<static_cast<unsigned>(combine_blocks), kCombineThreads, 0, s>>>(
      part_m, part_s, entropy_out != nullptr ? part_b : nullptr, z_target, targets, n_rows, vocab, ignore_index,
      logprob_out, entropy_out, lse_out);
  check_launch("linear_logprob_combine_kernel launch (wgmma forward)");
}

namespace {

template <typename K, typename E>
void launch_gemm(K kernel, const CUtensorMap& a, const CUtensorMap& b, int m_tiles, int n_tiles, int k_steps,
                 int a_extent, int b_extent, const E& epilogue, const char* name, cudaStream_t s) {
  allow_smem(wggemm::kSmemBytes, kernel, name);
  kernel<<<grid_of(int64_t{m_tiles} * n_tiles, name), wggemm::kThreads, wggemm::kSmemBytes, s>>>(
      a, b, m_tiles, n_tiles, k_steps, a_extent, b_extent, epilogue);
  check_launch(name);
}

// The chunk GEMMs of the Hopper backward. stored == false: per chunk GEMM 1 writes G_c into g [N, g_stride] (the
// chunk scratch); stored == true: g [N, g_stride] already holds G of the whole vocabulary (chunk c at column
// v_start). grad_weight_out: T (stored per chunk) or fp32 (grad_weight_fp32: stored, or added with accumulate).
void bwd_wgmma_chunks(const char* what, DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                      const float* inv_temperature, const float* lse, const float* entropy, const float* grad_logprob,
                      const float* grad_entropy, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                      int64_t ignore_index, void* grad_hidden_out, void* grad_weight_out, bool grad_weight_fp32,
                      bool accumulate, void* g_scratch, int64_t g_stride, bool stored, float* grad_hidden_acc,
                      cudaStream_t s) {
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  const int m_row_tiles = static_cast<int>(ceil_div(n_rows, int64_t{wggemm::kBM}));
  const int h_steps = static_cast<int>(ceil_div(hidden_size, int64_t{wggemm::kBK}));

  dispatch_half(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    const CUtensorMapDataType tdt = tma_dtype<T>();
    const T* h = static_cast<const T*>(hidden);
    const T* w = static_cast<const T*>(weight);
    const CUtensorMap hidden_k = make_map(tdt, h, n_rows, hidden_size, hidden_size, wggemm::kBM);
    const int64_t elem = grad_weight_fp32 ? 4 : 2;

    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
      const int64_t v_start = chunk * kVocabChunk;
      const int64_t cols = vocab - v_start < kVocabChunk ? vocab - v_start : kVocabChunk;
      const int64_t k_cols = ceil_div(cols, int64_t{8}) * 8;
      const T* w_chunk = w + v_start * hidden_size;
      const int col_tiles = static_cast<int>(ceil_div(k_cols, int64_t{wggemm::kBN}));
      T* g = static_cast<T*>(g_scratch) + (stored ? v_start : 0);

      // 1. G_c
      if (!stored) {
        const CUtensorMap w_k = make_map(tdt, w_chunk, cols, hidden_size, hidden_size, wggemm::kBN);
        if (grad_entropy != nullptr) {
          const wgbwd::GradLogitsEpilogue<T, true> epi{
              targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, n_rows, ignore_index, v_start,
              cols,    k_cols,          g,   g_stride};
          launch_gemm(wggemm::gemm_kernel<T, false, false, decltype(epi)>, hidden_k, w_k, m_row_tiles, col_tiles,
                      h_steps, 0, 0, epi, "linear_logprob grad_logits (wgmma)", s);
        } else {
          const wgbwd::GradLogitsEpilogue<T, false> epi{
              targets, inv_temperature, lse, nullptr, grad_logprob, nullptr, n_rows, ignore_index, v_start,
              cols,    k_cols,          g,   g_stride};
          launch_gemm(wggemm::gemm_kernel<T, false, false, decltype(epi)>, hidden_k, w_k, m_row_tiles, col_tiles,
                      h_steps, 0, 0, epi, "linear_logprob grad_logits (wgmma)", s);
        }
      }
      // 2. and 3.
      void* gw = grad_weight_out == nullptr
                     ? nullptr
                     : static_cast<void*>(static_cast<char*>(grad_weight_out) + v_start * hidden_size * elem);
      wgmma_chunk_grad_gemms(dtype, hidden, w_chunk, g, g_stride, n_rows, cols, hidden_size, chunk, n_chunks,
                             grad_hidden_out, grad_hidden_acc, gw, grad_weight_fp32, accumulate, s);
    }
  });
}

// The Hopper backward's checks shared by both entries: int32 TMA coordinates, a compute capability 9.0 GPU.
void require_wgmma_bwd(const char* what, int64_t n_rows, int64_t vocab, int64_t hidden_size, int device) {
  require(n_rows < (int64_t{1} << 31) - wggemm::kBN && vocab < (int64_t{1} << 31) && hidden_size < (int64_t{1} << 24),
          std::string(what) + ": N and V must be < 2^31 and H < 2^24 (int32 TMA coordinates)");
  const std::string problem = linear_logprob_wgmma_problem(device);
  if (!problem.empty()) throw std::runtime_error(std::string("rlk_cuda: ") + what + ": " + problem);
}

}  // namespace

void wgmma_chunk_grad_gemms(DType dtype, const void* hidden, const void* w_chunk, const void* g, int64_t g_stride,
                            int64_t n_rows, int64_t cols, int64_t hidden_size, int64_t chunk, int64_t n_chunks,
                            void* grad_hidden_out, float* grad_hidden_acc, void* grad_weight_chunk,
                            bool grad_weight_fp32, bool accumulate, cudaStream_t s) {
  const int64_t k_cols = ceil_div(cols, int64_t{8}) * 8;
  const int m_row_tiles = static_cast<int>(ceil_div(n_rows, int64_t{wggemm::kBM}));
  const int h_tiles = static_cast<int>(ceil_div(hidden_size, int64_t{wggemm::kBN}));
  const int n_steps = static_cast<int>(ceil_div(n_rows, int64_t{wggemm::kBK}));
  dispatch_half(dtype, "wgmma_chunk_grad_gemms", [&](auto tag) {
    using T = decltype(tag);
    const CUtensorMapDataType tdt = tma_dtype<T>();
    const T* gc = static_cast<const T*>(g);
    // 2. grad_hidden (+)= G_c @ W_c
    if (grad_hidden_out != nullptr) {
      const CUtensorMap g_k = make_map(tdt, gc, n_rows, k_cols, g_stride, wggemm::kBM);
      const CUtensorMap w_mn = make_map(tdt, w_chunk, cols, hidden_size, hidden_size, wggemm::kMnBox);
      const wgbwd::ChunkStoreEpilogue<T> epi{grad_hidden_mode(chunk, n_chunks), grad_hidden_acc,
                                             static_cast<T*>(grad_hidden_out), n_rows, hidden_size};
      launch_gemm(wggemm::gemm_kernel<T, false, true, decltype(epi)>, g_k, w_mn, m_row_tiles, h_tiles,
                  static_cast<int>(ceil_div(k_cols, int64_t{wggemm::kBK})), 0, static_cast<int>(hidden_size), epi,
                  "linear_logprob grad_hidden (wgmma)", s);
    }
    // 3. grad_weight[chunk] (+)= G_c.T @ hidden
    if (grad_weight_chunk != nullptr) {
      const CUtensorMap g_mn = make_map(tdt, gc, n_rows, k_cols, g_stride, wggemm::kMnBox);
      const CUtensorMap hidden_mn = make_map(tdt, hidden, n_rows, hidden_size, hidden_size, wggemm::kMnBox);
      // fp32: written (kWrite) or added to (kAdd) as an fp32 "accumulator"; else rounded to T (kStore)
      const wgbwd::ChunkStoreEpilogue<T> epi =
          grad_weight_fp32
              ? wgbwd::ChunkStoreEpilogue<T>{accumulate ? AccumulateMode::kAdd : AccumulateMode::kWrite,
                                             static_cast<float*>(grad_weight_chunk), nullptr, cols, hidden_size}
              : wgbwd::ChunkStoreEpilogue<T>{AccumulateMode::kStore, nullptr, static_cast<T*>(grad_weight_chunk), cols,
                                             hidden_size};
      launch_gemm(wggemm::gemm_kernel<T, true, true, decltype(epi)>, g_mn, hidden_mn,
                  static_cast<int>(ceil_div(cols, int64_t{wggemm::kBM})), h_tiles, n_steps, static_cast<int>(k_cols),
                  static_cast<int>(hidden_size), epi, "linear_logprob grad_weight (wgmma)", s);
    }
  });
}

void linear_logprob_bwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                              const float* inv_temperature, const float* lse, const float* entropy,
                              const float* grad_logprob, const float* grad_entropy, int64_t n_rows, int64_t vocab,
                              int64_t hidden_size, int64_t ignore_index, void* grad_hidden_out, void* grad_weight_out,
                              void* g_scratch, int64_t g_stride, float* grad_hidden_acc, int device,
                              std::uintptr_t stream) {
  const char* what = "linear_logprob_bwd_wgmma";
  if (!check_linear_bwd_args(what, hidden, weight, n_rows, vocab, hidden_size, entropy, grad_entropy, grad_hidden_out,
                             grad_weight_out, g_scratch, g_stride, grad_hidden_acc)) {
    return;
  }
  DeviceGuard guard(device);
  require_wgmma_bwd(what, n_rows, vocab, hidden_size, device);
  bwd_wgmma_chunks(what, dtype, hidden, weight, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy,
                   n_rows, vocab, hidden_size, ignore_index, grad_hidden_out, grad_weight_out, false, false, g_scratch,
                   g_stride, false, grad_hidden_acc, as_stream(stream));
}

void linear_logprob_stored_bwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                                     const float* inv_temperature, const float* lse, const float* entropy,
                                     const float* grad_logprob, const float* grad_entropy, int64_t n_rows,
                                     int64_t vocab, int64_t hidden_size, int64_t ignore_index, float* logits,
                                     int64_t logits_stride, void* grad_hidden_out, void* grad_weight_out,
                                     bool grad_weight_fp32, bool accumulate, float* grad_hidden_acc, int device,
                                     std::uintptr_t stream) {
  const char* what = "linear_logprob_stored_bwd_wgmma";
  const std::string w(what);
  check_linear_inputs(what, hidden, weight, n_rows, vocab, hidden_size);
  require((entropy == nullptr) == (grad_entropy == nullptr), w + ": entropy and grad_entropy must be both given or "
                                                                 "both None");
  require(logits != nullptr && host_aligned16(logits) && logits_stride >= vocab && logits_stride % 4 == 0,
          w + ": logits must be 16-byte aligned with a row stride >= V and a multiple of 4 (G is written over it "
              "with a row stride of 2 logits_stride elements)");
  const int64_t padded = ceil_div(vocab, int64_t{8}) * 8;
  require(padded <= 2 * logits_stride, w + ": V rounded up to 8 must fit in 2 logits_stride");
  require(!accumulate || grad_weight_fp32, w + ": accumulate needs an fp32 grad_weight_out");
  require(grad_hidden_out == nullptr || host_aligned16(grad_hidden_out),
          w + ": grad_hidden_out must be 16-byte aligned");
  require(grad_weight_out == nullptr || host_aligned16(grad_weight_out),
          w + ": grad_weight_out must be 16-byte aligned");
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  require(
      grad_hidden_out == nullptr || n_chunks == 1 || (grad_hidden_acc != nullptr && host_aligned16(grad_hidden_acc)),
      w + ": grad_hidden_acc (fp32 [N, H]) is required with grad_hidden_out when V > 4096");
  if (grad_hidden_out == nullptr && grad_weight_out == nullptr) return;
  DeviceGuard guard(device);
  require_wgmma_bwd(what, n_rows, vocab, hidden_size, device);
  const cudaStream_t s = as_stream(stream);
  require(n_rows <= max_grid_x(), w + ": too many rows for one grid");
  dispatch_half(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    if (grad_entropy != nullptr) {
      wgbwd::stored_grad_logits_kernel<T, true><<<static_cast<unsigned>(n_rows), wgbwd::kStoredGradThreads, 0, s>>>(
          logits, logits_stride, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, vocab, padded,
          ignore_index);
    } else {
      wgbwd::stored_grad_logits_kernel<T, false><<<static_cast<unsigned>(n_rows), wgbwd::kStoredGradThreads, 0, s>>>(
          logits, logits_stride, targets, inv_temperature, lse, nullptr, grad_logprob, nullptr, vocab, padded,
          ignore_index);
    }
    check_launch("linear_logprob stored_grad_logits");
  });
  bwd_wgmma_chunks(what, dtype, hidden, weight, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy,
                   n_rows, vocab, hidden_size, ignore_index, grad_hidden_out, grad_weight_out, grad_weight_fp32,
                   accumulate, logits, 2 * logits_stride, true, grad_hidden_acc, s);
}

}  // namespace rlk_cuda
