// Tensor-core GEMM core of the rlk CUDA kernels (Ampere-class: sm_80 and later, the fallback on
// Hopper): mma.sync.aligned.m16n8k16 with fp32 accumulators, ldmatrix (.trans where an operand is
// stored M- or N-contiguous), and a cp.async multi-stage shared-memory pipeline.
//
// One thread block computes a kBM x kBN fp32 tile C = A * B, A: [M, K], B: [K, N], 16-bit inputs
// (bf16 or fp16), walking K in kBK steps, always in increasing k order. Each operand lives in global
// memory in one of two layouts:
//   K-major  ("row-major A", "B given as [N, K]"): element (mn, k) at ptr[mn * ld + k]
//   MN-major ("A given as [K, M]", "row-major B"):  element (mn, k) at ptr[k * ld + mn]
// The contiguous dimension's extent must be a multiple of 8 and every row 16-byte aligned (ptr and
// ld * 2 bytes multiples of 16): each cp.async moves one 16-byte chunk of 8 elements, and a chunk is
// either entirely inside the operand or entirely zero-filled (src-size 0). Rows past the operand's
// row count are zero-filled too, so tiles that overhang M, N or K contribute exact zeros.
//
// Fixed configuration (nothing depends on the problem size, which is what batch invariance needs):
// kBM = kBN = 128, kBK = 64, 8 warps as 2 (M) x 4 (N), a 64 x 32 warp tile = 4 x 4 mma tiles of
// 16 x 8; kStages = 3 pipeline stages of 32 KiB (A tile 16 KiB + B tile 16 KiB) = 96 KiB of dynamic
// shared memory (fits the 99 KiB opt-in limit of sm_86 / sm_89 / sm_120 too).
//
// Accumulator element (thread, mi, ni, e) of the warp tile: row wm0 + mi*16 + (e>>1)*8 + lane/4,
// column wn0 + ni*8 + 2*(lane%4) + (e&1) (see acc_row / acc_col): the mma D fragment layout below.
//
// Shared-memory tiles: R rows of C elements (R*C = 8192), row-major, 16-byte chunks XOR-swizzled:
// logical chunk c of row r is stored at chunk c ^ (r & 7). ldmatrix reads 8 consecutive rows (the
// first a multiple of 8) at one logical chunk; their physical chunks differ in the low 3 bits, and a
// row is 128 or 256 bytes, so the 8 addresses fall in 8 different 16-byte bank groups: conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace rlk_cuda {
namespace mma {

constexpr int kBM = 128;
constexpr int kBN = 128;
constexpr int kBK = 64;
constexpr int kStages = 3;
constexpr int kWarpsM = 2;
constexpr int kWarpsN = 4;
constexpr int kThreads = kWarpsM * kWarpsN * 32;       // 256
constexpr int kWarpM = kBM / kWarpsM;                  // 64 rows per warp
constexpr int kWarpN = kBN / kWarpsN;                  // 32 columns per warp
constexpr int kMT = kWarpM / 16;                       // 4 mma tiles along M per warp
constexpr int kNT = kWarpN / 8;                        // 4 mma tiles along N per warp
constexpr int kTileElems = kBM * kBK;                  // 8192 elements per operand tile (kBN * kBK too)
constexpr int kStageElems = 2 * kTileElems;            // A tile then B tile
constexpr int kSmemBytes = kStages * kStageElems * 2;  // 98304
static_assert(kBM * kBK == kBN * kBK, "A and B tiles have the same size");
static_assert(kTileElems / 8 % kThreads == 0, "16-byte chunks split evenly over the threads");

// A tile's accumulators: [kMT][kNT][4] fp32 per thread.
using Acc = float[kMT][kNT][4];

// One GEMM operand in global memory (see the layouts above). rows: extent of the strided dimension,
// cols: extent of the contiguous one (a multiple of 8); ld: elements between consecutive rows.
struct Operand {
  const void* ptr;
  int64_t ld;
  int64_t rows;
  int64_t cols;
};

// ---- PTX wrappers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (.cg); src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ldmatrix .x4: lanes 8j..8j+7 give the 16-byte row addresses of 8x8 matrix j; r[j] receives matrix j.
// PTX ISA (ldmatrix, m8n8 .b16): without .trans lane l holds row l/4, elements 2*(l%4) (low half) and
// 2*(l%4)+1 (high half) of each matrix; with .trans it holds column l/4, rows 2*(l%4) and 2*(l%4)+1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for one 16x8x16 tile, fp32 accumulators (d is both C and D).
// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (groupID g = lane/4,
// threadID_in_group t = lane%4):
//   A (16x16, .row): a[0] = (row g,   cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//                    a[2] = (row g,   cols 2t+8, +9)   a[3] = (row g+8, cols 2t+8, +9)
//   B (16x8,  .col): b[0] = (rows k 2t, 2t+1, col g)   b[1] = (rows k 2t+8, 2t+9, col g)
//   C/D (16x8 f32):  d[0], d[1] = (row g, cols 2t, 2t+1)   d[2], d[3] = (row g+8, cols 2t, 2t+1)
// (lower k / column index in the low 16 bits of each register).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- tiles -------------------------------------------------------------------------------------

// Element offset of (row r, logical 16-byte chunk c) in a swizzled tile with kC elements per row.
template <int kC>
__device__ __forceinline__ int swizzle(int r, int c) {
  return r * kC + ((c ^ (r & 7)) << 3);
}

// The warp's tile origin inside the block tile, and the accumulator coordinates (D fragment layout).
__device__ __forceinline__ int warp_m0() { return (threadIdx.x / 32) / kWarpsN * kWarpM; }
__device__ __forceinline__ int warp_n0() { return (threadIdx.x / 32) % kWarpsN * kWarpN; }
// Row in the block tile of accumulator acc[mi][ni][e]: D rows g (e = 0, 1) and g + 8 (e = 2, 3).
__device__ __forceinline__ int acc_row(int mi, int e) {
  return warp_m0() + mi * 16 + (e >> 1) * 8 + (threadIdx.x & 31) / 4;
}
// Column in the block tile of acc[mi][ni][e]: D columns 2t + (e & 1).
__device__ __forceinline__ int acc_col(int ni, int e) {
  return warp_n0() + ni * 8 + 2 * ((threadIdx.x & 31) % 4) + (e & 1);
}

__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
}

// Issue the cp.asyncs of one operand tile: the 128 (M or N) x 64 (K) block at (mn0, k0).
// K-major: smem rows are mn (128 rows of 64 k); MN-major: smem rows are k (64 rows of 128 mn).
template <typename T, bool kKMajor>
__device__ __forceinline__ void load_tile(T* tile, const Operand& op, int64_t mn0, int64_t k0) {
  constexpr int kC = kKMajor ? kBK : kBM;  // elements per smem row
  constexpr int kChunksPerRow = kC / 8;
  const T* base = static_cast<const T*>(op.ptr);
#pragma unroll
  for (int i = 0; i < kTileElems / 8 / kThreads; ++i) {
    const int id = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = id / kChunksPerRow;
    const int c = id % kChunksPerRow;
    const int64_t grow = (kKMajor ? mn0 : k0) + r;
    const int64_t gcol = (kKMajor ? k0 : mn0) + int64_t{c} * 8;
    const bool valid = grow < op.rows && gcol < op.cols;
    const T* src = valid ? base + grow * op.ld + gcol : base;
    cp_async16(smem_addr(tile + swizzle<kC>(r, c)), src, valid ? 16 : 0);
  }
}

// acc += A_tile * B_tile for one stage (kBK = 64 = 4 mma k-steps).
//
// A fragment (16 x 16 at rows m, k-step ks) from ldmatrix x4, matrix j = lane / 8 at
// (m + (j & 1) * 8, k + (j >> 1) * 8), so that r[j] = a[j] of the mma A layout:
//   a[0] = rows 0-7 / k 0-7, a[1] = rows 8-15 / k 0-7, a[2] = rows 0-7 / k 8-15, a[3] = rows 8-15 / k 8-15.
//   K-major smem (rows m, contiguous k): the 8x8 matrix is stored with rows = m; plain ldmatrix gives
//     lane (g, t) row g, k 2t, 2t+1 = exactly a[j]'s (row g, cols 2t, 2t+1).
//   M-major smem (rows k, contiguous m): stored rows = k; .trans gives lane (g, t) stored column g (m)
//     of stored rows 2t, 2t+1 (k) = A(m g, k 2t), A(m g, k 2t+1) = a[j] again. The lane's row address is
//     the k row: k + (j >> 1) * 8 + lane % 8, at m chunk (m + (j & 1) * 8) / 8.
// B fragments for two n8 tiles (n, n + 8) at k-step ks from one ldmatrix x4, matrix j at
// (n + (j >> 1) * 8, k + (j & 1) * 8), so r[0] = b0(n), r[1] = b1(n), r[2] = b0(n + 8), r[3] = b1(n + 8):
//   K-major smem (rows n, contiguous k): plain ldmatrix gives lane (g, t) row n g, k 2t, 2t+1 =
//     B(k 2t, n g), B(k 2t+1, n g) = the mma B layout's b0 (b1 for the k + 8 matrix).
//   N-major smem (rows k, contiguous n): .trans gives lane (g, t) column g (n) of stored rows 2t, 2t+1 (k)
//     = b0 / b1 again. Row address: k + (j & 1) * 8 + lane % 8, at n chunk (n + (j >> 1) * 8) / 8.
template <typename T, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void compute_stage(const T* a_tile, const T* b_tile, Acc& acc) {
  const int lane = threadIdx.x & 31;
  const int j = lane >> 3;  // which 8x8 matrix this lane addresses
  const int rr = lane & 7;  // which row of it
  const int wm0 = warp_m0();
  const int wn0 = warp_n0();
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
      const int m = wm0 + mi * 16;
      if constexpr (kAKMajor) {
        ldmatrix_x4(a[mi], smem_addr(a_tile + swizzle<kBK>(m + (j & 1) * 8 + rr, ks * 2 + (j >> 1))));
      } else {
        ldmatrix_x4_trans(a[mi], smem_addr(a_tile + swizzle<kBM>(ks * 16 + (j >> 1) * 8 + rr, m / 8 + (j & 1))));
      }
    }
    uint32_t b[kNT / 2][4];
#pragma unroll
    for (int p = 0; p < kNT / 2; ++p) {
      const int n = wn0 + p * 16;
      if constexpr (kBKMajor) {
        ldmatrix_x4(b[p], smem_addr(b_tile + swizzle<kBK>(n + (j >> 1) * 8 + rr, ks * 2 + (j & 1))));
      } else {
        ldmatrix_x4_trans(b[p], smem_addr(b_tile + swizzle<kBN>(ks * 16 + (j & 1) * 8 + rr, n / 8 + (j >> 1))));
      }
    }
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
        mma16816<T>(acc[mi][ni], a[mi], b[ni / 2][(ni % 2) * 2], b[ni / 2][(ni % 2) * 2 + 1]);
  }
}

// The pipeline over a sequence of "steps", each one kBK slice of a tile product. The caller's
// `load(stage_a, stage_b, step)` issues the cp.asyncs of a step; `compute(stage_a, stage_b, step)`
// consumes it. Steps are consumed in order 0, 1, ..., n_steps - 1; loads run kStages - 1 steps ahead.
// On return every cp.async has completed and every thread has passed a barrier, so the caller may
// reuse the shared memory.
template <typename T, typename Load, typename Compute>
__device__ __forceinline__ void pipeline(T* smem, int64_t n_steps, Load&& load, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_steps) load(smem + s * kStageElems, smem + s * kStageElems + kTileElems, int64_t{s});
    cp_async_commit();  // always commit (possibly empty) so that group counts stay uniform
  }
  for (int64_t step = 0; step < n_steps; ++step) {
    // Groups committed so far: kStages - 1 + step; at most kStages - 2 pending => group `step` landed.
    cp_async_wait<kStages - 2>();
    // Makes every thread's copies of `step` visible, and guarantees all warps finished computing
    // step - 1, whose stage the load below overwrites.
    __syncthreads();
    const int64_t next = step + kStages - 1;
    if (next < n_steps) {
      const int s = static_cast<int>(next % kStages);
      load(smem + s * kStageElems, smem + s * kStageElems + kTileElems, next);
    }
    cp_async_commit();
    const int s = static_cast<int>(step % kStages);
    compute(smem + s * kStageElems, smem + s * kStageElems + kTileElems, step);
  }
  cp_async_wait<0>();
  __syncthreads();
}

// acc = A[m0 : m0 + 128, 0 : K] * B[0 : K, n0 : n0 + 128] (acc is zeroed first), K in kBK steps.
template <typename T, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void gemm_tile(T* smem, const Operand& a, int64_t m0, const Operand& b, int64_t n0,
                                          int64_t k, Acc& acc) {
  zero(acc);
  const int64_t n_steps = (k + kBK - 1) / kBK;
  pipeline(
      smem, n_steps,
      [&](T* sa, T* sb, int64_t step) {
        load_tile<T, kAKMajor>(sa, a, m0, step * kBK);
        load_tile<T, kBKMajor>(sb, b, n0, step * kBK);
      },
      [&](const T* sa, const T* sb, int64_t) { compute_stage<T, kAKMajor, kBKMajor>(sa, sb, acc); });
}

// acc = A[m0 : m0 + 128, 0 : K] * B[0 : K, n0 + t * 128 : n0 + (t + 1) * 128] for t = 0 .. n_tiles - 1, K in
// k_steps = ceil(K / kBK) steps, one flat pipeline over (tile t, k step), so that the loads of tile t + 1
// overlap tile t's last steps and done(t). done(t) runs once tile t's product is complete in acc (every
// thread calls it, in tile order); acc is zeroed after it. (The linear_logprob forward: one N tile per
// vocab tile of a split.)
template <typename T, bool kAKMajor, bool kBKMajor, typename Done>
__device__ __forceinline__ void gemm_tiles(T* smem, const Operand& a, int64_t m0, const Operand& b, int64_t n0,
                                           int64_t n_tiles, int64_t k_steps, Acc& acc, Done&& done) {
  zero(acc);
  pipeline(
      smem, n_tiles * k_steps,
      [&](T* sa, T* sb, int64_t step) {
        const int64_t t = step / k_steps;
        const int64_t k0 = (step % k_steps) * kBK;
        load_tile<T, kAKMajor>(sa, a, m0, k0);
        load_tile<T, kBKMajor>(sb, b, n0 + t * kBN, k0);
      },
      [&](const T* sa, const T* sb, int64_t step) {
        compute_stage<T, kAKMajor, kBKMajor>(sa, sb, acc);
        if (step % k_steps != k_steps - 1) return;
        done(step / k_steps);
        zero(acc);
      });
}

// ---- the accumulator layout, as the epilogues see it (linear_logprob.cuh) -----------------------
// The same names exist in the MFMA core (mma_amd.cuh), so one epilogue serves both. A thread's
// accumulators cover kRowTiles x kTileRows rows of the block tile, row (i, h) at slot_row(i, h), and in
// each row kColTiles x kTileCols values, value (n, e) at column slot_col(n, e), read by
// acc_value(acc, i, h, n, e); values (n, 2q) and (n, 2q + 1) are adjacent columns, the first even. The
// other columns of a row are held by kRowLanes lanes of the same warp, lane ^ (kRowLaneStride << b), and by
// the kWarpsN warps along N (warp_n). (Epilogues loop over i, h, n, e in this nesting, the one the CUDA
// kernels were written in, which keeps their generated code as it was.)
//   mma.sync: row (i, h) = warp_m0 + 16 i + 8 h + lane / 4, value (n, e) at column warp_n0 + 8 n +
//   2 (lane % 4) + e, acc[i][n][2 h + e] (the D fragment layout); lanes 4g .. 4g + 3 share a row.
constexpr int kRowTiles = kMT;  // 4
constexpr int kTileRows = 2;
constexpr int kColTiles = kNT;  // 4
constexpr int kTileCols = 2;
constexpr int kRowLanes = 4;
constexpr int kRowLaneStride = 1;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_n() { return (threadIdx.x / 32) % kWarpsN; }
__device__ __forceinline__ int slot_row(int i, int h) { return acc_row(i, 2 * h); }
__device__ __forceinline__ int slot_col(int n, int e) { return acc_col(n, e); }
__device__ __forceinline__ float acc_value(const Acc& acc, int i, int h, int n, int e) { return acc[i][n][2 * h + e]; }

// Block index -> (tile_m, tile_n), with `group` consecutive M tiles scheduled together so that
// concurrent blocks share B tiles in L2. Changes the schedule only, never the arithmetic.
__device__ __forceinline__ void grouped_tile(int64_t pid, int64_t n_m, int64_t n_n, int64_t group, int64_t& tile_m,
                                             int64_t& tile_n) {
  const int64_t per_group = group * n_n;
  const int64_t first = pid / per_group * group;
  const int64_t size = n_m - first < group ? n_m - first : group;
  const int64_t in_group = pid % per_group;
  tile_m = first + in_group % size;
  tile_n = in_group / size;
}

}  // namespace mma
}  // namespace rlk_cuda
