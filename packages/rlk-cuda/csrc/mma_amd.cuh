// MFMA GEMM core of rlk-rocm's linear_logprob kernels (AMD CDNA2 gfx90a, CDNA3 gfx94x; wavefront 64), with the
// interface of the mma.sync core mma.cuh (namespace rlk_cuda::mma: kBM, kBN, kBK, kThreads, kSmemBytes, Operand,
// Acc, zero, gemm_tile, gemm_tiles, grouped_tile and the accumulator-layout names), so that the kernel bodies of
// linear_logprob.cuh are written once. HIP only (linear_logprob.cuh includes it where __HIP_PLATFORM_AMD__ is
// defined); single source in rlk-cuda's csrc/, carried into rlk-rocm's sdist as the other shared headers.
//
// One workgroup computes a kBM x kBN = 128 x 128 fp32 tile C = A * B, A: [M, K], B: [K, N], 16-bit inputs (bf16 or
// fp16), walking K in kBK = 32 steps, always in increasing k order. Operands in global memory as in mma.cuh:
//   K-major  ("row-major A", "B given as [N, K]"): element (mn, k) at ptr[mn * ld + k]
//   MN-major ("A given as [K, M]", "row-major B"):  element (mn, k) at ptr[k * ld + mn]
// The contiguous dimension's extent a multiple of 8, every row 16-byte aligned: each thread moves whole 16-byte
// chunks of 8 elements, a chunk entirely inside the operand or replaced by zeros, as are rows past the operand's row
// count; tiles that overhang M, N or K contribute exact zeros.
//
// Fixed configuration (nothing depends on the problem size, which is what batch invariance needs): 4 wavefronts
// as 2 (M) x 2 (N), a 64 x 64 wavefront tile = 2 x 2 MFMA tiles of 32 x 32; per K step of 32, each wavefront
// issues 4 x 2 x 2 v_mfma_f32_32x32x8 (bf16: the _bf16_1k form; fp16: f16), fp32 accumulation in a fixed order.
//
// Shared memory (LDS), double buffered, no asynchronous copies (AMD has no cp.async / TMA): the operands of step
// s + 1 are loaded from global memory into registers (plain 16-byte vector loads) before step s's MFMAs, and stored
// into the other LDS stage after them; one barrier per step. Two stages of an A tile and a B tile of 128 x 32
// elements = 4 x 8 KiB = 32 KiB of dynamic LDS (the 64 KiB of a workgroup keeps room for the kernels' static
// arrays). Both tiles are kept K-major, [128 rows (m or n)][32 k], whatever the operand's global layout: an
// MN-major operand is transposed on the way in (two k rows of 8 mn values per thread, stored as 8 32-bit (k, k + 1)
// pairs). A row is 64 bytes = 4 chunks of 16 bytes; logical chunk c of row r is stored at chunk
// c ^ (((r >> 1) ^ (r >> 3)) & 3) (see swizzle): the 8 rows r0 .. r0 + 7 (r0 % 8 == 0) that 8 consecutive lanes
// read at one logical chunk land in 8 different 16-byte bank groups.
//
// MFMA operands (AMD Instinct ISA, v_mfma_f32_32x32x8{bf16_1k,f16}): source A is 32 x 8 (i, k), lane l holding
// i = l % 32 and the 4 k = 4 (l / 32) .. + 3 (two 16-bit pairs, lower k in the low half); source B is 8 x 32 (k, j),
// the same with j; D[i][j] is in lane j + 32 ((i / 4) % 2), accumulator register 4 (i / 8) + i % 4. The core
// passes the B tile (block columns) as source A and the A tile (block rows) as source B, so D holds C transposed:
// lane l holds block-tile row l % 32 of the MFMA tile, register r its column 8 (r / 4) + 4 (l / 32) + r % 4. A row
// of a wavefront tile is thus in 2 lanes (l and l ^ 32), 16 columns each per MFMA tile.
// Within a K step of 32, lane half h = l / 32 supplies k = 16 h .. 16 h + 15 (two 16-byte LDS reads per tile),
// instruction t (0..3) taking k = 16 h + 4 t .. + 3 from each half: every k of the step is used once, in a fixed
// assignment, by A and B alike.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>

#include "portable.cuh"

namespace rlk_cuda {
namespace mma {

constexpr int kBM = 128;
constexpr int kBN = 128;
constexpr int kBK = 32;
constexpr int kStages = 2;
constexpr int kWarpsM = 2;
constexpr int kWarpsN = 2;
constexpr int kThreads = kWarpsM * kWarpsN * kWarpSize;  // 256
constexpr int kWarpM = kBM / kWarpsM;                    // 64 rows per wavefront
constexpr int kWarpN = kBN / kWarpsN;                    // 64 columns per wavefront
constexpr int kMfmaMN = 32;                              // an MFMA tile: 32 x 32 outputs, 8 k per instruction
constexpr int kMT = kWarpM / kMfmaMN;                    // 2 MFMA tiles along M per wavefront
constexpr int kNT = kWarpN / kMfmaMN;                    // 2 MFMA tiles along N per wavefront
constexpr int kTileElems = kBM * kBK;                    // 4096 elements per operand tile (kBN * kBK too)
constexpr int kStageElems = 2 * kTileElems;              // A tile then B tile
constexpr int kSmemBytes = kStages * kStageElems * 2;    // 32768
constexpr int kChunks = kTileElems / 8 / kThreads;       // 16-byte chunks per thread per operand tile: 2
static_assert(kBM == kBN, "A and B tiles have the same size");
static_assert(kChunks == 2, "a thread moves two chunks per tile (a k-row pair of an MN-major operand)");
static_assert(kWarpSize == 64, "the MFMA layouts below are for wavefront 64");

typedef float f32x16 __attribute__((ext_vector_type(16)));
typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));
typedef uint32_t u32x2 __attribute__((ext_vector_type(2)));
typedef short i16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));

// A tile's accumulators: one 32 x 32 MFMA accumulator (16 fp32 per lane) per MFMA tile of the wavefront.
using Acc = f32x16[kMT][kNT];

// One GEMM operand in global memory (see the layouts above). rows: extent of the strided dimension, cols: extent
// of the contiguous one (a multiple of 8); ld: elements between consecutive rows.
struct Operand {
  const void* ptr;
  int64_t ld;
  int64_t rows;
  int64_t cols;
};

// d = a * b + c for one 32 x 32 x 8 MFMA: a, b four 16-bit values of T each (two 32-bit words, lower k first).
template <typename T>
__device__ __forceinline__ f32x16 mfma_32x32x8(u32x2 a, u32x2 b, f32x16 c);

template <>
__device__ __forceinline__ f32x16 mfma_32x32x8<bf16>(u32x2 a, u32x2 b, f32x16 c) {
  return __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(__builtin_bit_cast(i16x4, a), __builtin_bit_cast(i16x4, b), c, 0, 0,
                                                  0);
}

template <>
__device__ __forceinline__ f32x16 mfma_32x32x8<__half>(u32x2 a, u32x2 b, f32x16 c) {
  return __builtin_amdgcn_mfma_f32_32x32x8f16(__builtin_bit_cast(f16x4, a), __builtin_bit_cast(f16x4, b), c, 0, 0, 0);
}

// ---- tiles -------------------------------------------------------------------------------------

// Element offset of (row r, logical 16-byte chunk c) in an LDS tile of kBK = 32 elements per row.
__device__ __forceinline__ int swizzle(int r, int c) { return r * kBK + ((c ^ (((r >> 1) ^ (r >> 3)) & 3)) << 3); }

__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarpSize; }
// The wavefront's tile origin inside the block tile.
__device__ __forceinline__ int warp_m0() { return (threadIdx.x / kWarpSize) / kWarpsN * kWarpM; }
__device__ __forceinline__ int warp_n0() { return (threadIdx.x / kWarpSize) % kWarpsN * kWarpN; }

__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[i][n][e] = 0.0f;
}

// The thread's two 16-byte chunks of one operand tile, global -> registers: the 128 (M or N) x 32 (K) block at
// (mn0, k0). K-major: chunk (row r = id / 4, k chunk id % 4) for id = threadIdx.x and threadIdx.x + 256. MN-major:
// k rows 2p and 2p + 1 (p = threadIdx.x / 16) at mn chunk threadIdx.x % 16. Chunks outside the operand are zeros.
template <typename T, bool kKMajor>
__device__ __forceinline__ void fetch_tile(u32x4 (&v)[kChunks], const Operand& op, int64_t mn0, int64_t k0) {
  const T* base = static_cast<const T*>(op.ptr);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    int64_t grow, gcol;
    if constexpr (kKMajor) {
      const int id = static_cast<int>(threadIdx.x) + i * kThreads;
      grow = mn0 + id / (kBK / 8);
      gcol = k0 + int64_t{id % (kBK / 8)} * 8;
    } else {
      grow = k0 + 2 * (threadIdx.x / (kBM / 8)) + i;
      gcol = mn0 + int64_t{threadIdx.x % (kBM / 8)} * 8;
    }
    v[i] = u32x4{0u, 0u, 0u, 0u};
    if (grow < op.rows && gcol < op.cols) v[i] = *reinterpret_cast<const u32x4*>(base + grow * op.ld + gcol);
  }
}

// The chunks of fetch_tile, registers -> the K-major LDS tile: as they are (K-major: one 16-byte store each), or
// transposed (MN-major: for each of the 8 mn values, the 32-bit pair of its k rows 2p, 2p + 1).
template <typename T, bool kKMajor>
__device__ __forceinline__ void store_tile(T* tile, const u32x4 (&v)[kChunks]) {
  if constexpr (kKMajor) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int id = static_cast<int>(threadIdx.x) + i * kThreads;
      *reinterpret_cast<u32x4*>(tile + swizzle(id / (kBK / 8), id % (kBK / 8))) = v[i];
    }
  } else {
    const int k = 2 * (threadIdx.x / (kBM / 8));  // even: k and k + 1 share a 32-bit word of the row
    const int mn = (threadIdx.x % (kBM / 8)) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t lo = v[0][e / 2], hi = v[1][e / 2];  // element e: the low (e even) or high half of word e / 2
      const uint32_t pair = e % 2 == 0 ? (lo & 0xffffu) | (hi << 16) : (lo >> 16) | (hi & 0xffff0000u);
      *reinterpret_cast<uint32_t*>(tile + swizzle(mn + e, k / 8) + k % 8) = pair;
    }
  }
}

// acc += A_tile * B_tile for one K step (kBK = 32: 4 MFMA k-groups of 8). Lane l reads, for each of its MFMA
// tiles, row l % 32 of the tile at k = 16 (l / 32) .. + 15 (logical chunks 2 (l / 32) and 2 (l / 32) + 1);
// instruction t takes the words 2 (t % 2), 2 (t % 2) + 1 of chunk t / 2. B (block columns) is MFMA source A.
template <typename T>
__device__ __forceinline__ void compute_stage(const T* a_tile, const T* b_tile, Acc& acc) {
  const int lane = lane_id();
  const int r = lane % 32;
  const int c = 2 * (lane / 32);
  const int wm0 = warp_m0();
  const int wn0 = warp_n0();
  u32x4 a[kMT][2];
  u32x4 b[kNT][2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
      a[i][q] = *reinterpret_cast<const u32x4*>(a_tile + swizzle(wm0 + i * kMfmaMN + r, c + q));
#pragma unroll
    for (int n = 0; n < kNT; ++n)
      b[n][q] = *reinterpret_cast<const u32x4*>(b_tile + swizzle(wn0 + n * kMfmaMN + r, c + q));
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
#pragma unroll
    for (int i = 0; i < kMT; ++i) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const u32x4& av = a[i][t / 2];
        const u32x4& bv = b[n][t / 2];
        const u32x2 af = t % 2 == 0 ? av.xy : av.zw;
        const u32x2 bf = t % 2 == 0 ? bv.xy : bv.zw;
        acc[i][n] = mfma_32x32x8<T>(bf, af, acc[i][n]);
      }
    }
  }
}

// acc = A[m0 : m0 + 128, 0 : K] * B[0 : K, n0 + t * 128 : n0 + (t + 1) * 128] for t = 0 .. n_tiles - 1
// (n_tiles >= 1), K in k_steps = ceil(K / kBK) >= 1 steps, one flat loop over (tile t, k step) so that the loads
// of tile t + 1 overlap tile t's last step and done(t). done(t) runs once tile t's product is complete in acc
// (every thread calls it, in tile order); acc is zeroed when the next tile starts. On return every thread has
// passed a barrier after its last LDS read, so the caller may reuse the LDS.
template <typename T, bool kAKMajor, bool kBKMajor, typename Done>
__device__ __forceinline__ void gemm_tiles(T* smem, const Operand& a, int64_t m0, const Operand& b, int64_t n0,
                                           int64_t n_tiles, int64_t k_steps, Acc& acc, Done&& done) {
  const int64_t n_steps = n_tiles * k_steps;
  u32x4 ra[kChunks];
  u32x4 rb[kChunks];
  fetch_tile<T, kAKMajor>(ra, a, m0, 0);
  fetch_tile<T, kBKMajor>(rb, b, n0, 0);
  store_tile<T, kAKMajor>(smem, ra);
  store_tile<T, kBKMajor>(smem + kTileElems, rb);
  __syncthreads();
  for (int64_t step = 0; step < n_steps; ++step) {
    const int64_t next = step + 1;
    if (next < n_steps) {  // global -> registers now; the loads complete under this step's MFMAs
      const int64_t k0 = (next % k_steps) * kBK;
      fetch_tile<T, kAKMajor>(ra, a, m0, k0);
      fetch_tile<T, kBKMajor>(rb, b, n0 + next / k_steps * kBN, k0);
    }
    const int64_t k_step = step % k_steps;
    if (k_step == 0) zero(acc);
    const T* stage = smem + (step % kStages) * kStageElems;
    compute_stage<T>(stage, stage + kTileElems, acc);
    if (k_step == k_steps - 1) done(step / k_steps);
    if (next < n_steps) {
      // The other stage was last read in step - 1, before the barrier that ended it.
      T* other = smem + (next % kStages) * kStageElems;
      store_tile<T, kAKMajor>(other, ra);
      store_tile<T, kBKMajor>(other + kTileElems, rb);
    }
    // Makes the stores of step + 1 visible, and keeps them from overwriting a stage still being read.
    __syncthreads();
  }
}

// acc = A[m0 : m0 + 128, 0 : K] * B[0 : K, n0 : n0 + 128], K >= 1, in kBK steps.
template <typename T, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void gemm_tile(T* smem, const Operand& a, int64_t m0, const Operand& b, int64_t n0,
                                          int64_t k, Acc& acc) {
  gemm_tiles<T, kAKMajor, kBKMajor>(smem, a, m0, b, n0, 1, (k + kBK - 1) / kBK, acc, [](int64_t) {});
}

// Block index -> (tile_m, tile_n), with `group` consecutive M tiles scheduled together so that concurrent
// workgroups share B tiles in the L2 cache (mma.cuh's schedule). Changes the schedule only, never the arithmetic.
__device__ __forceinline__ void grouped_tile(int64_t pid, int64_t n_m, int64_t n_n, int64_t group, int64_t& tile_m,
                                             int64_t& tile_n) {
  const int64_t per_group = group * n_n;
  const int64_t first = pid / per_group * group;
  const int64_t size = n_m - first < group ? n_m - first : group;
  const int64_t in_group = pid % per_group;
  tile_m = first + in_group % size;
  tile_n = in_group / size;
}

// ---- the accumulator layout, as the epilogues see it (the names of mma.cuh) ------------------------
// Row (i, h) (h = 0 only: one row per MFMA tile per lane) is block row warp_m0 + 32 i + lane % 32; value (n, e),
// e < 16, is acc[i][n][e] at column warp_n0 + 32 n + 8 (e / 4) + 4 (lane / 32) + e % 4 (e, e + 1 adjacent for even
// e). The other 16 columns of the row in MFMA tile n are in lane ^ 32; the other 64 of the block tile in the other
// wavefront along N.
constexpr int kRowTiles = kMT;  // 2
constexpr int kTileRows = 1;
constexpr int kColTiles = kNT;  // 2
constexpr int kTileCols = 16;
constexpr int kRowLanes = 2;
constexpr int kRowLaneStride = 32;

__device__ __forceinline__ int warp_n() { return (threadIdx.x / kWarpSize) % kWarpsN; }
__device__ __forceinline__ int slot_row(int i, int /*h*/) { return warp_m0() + i * kMfmaMN + lane_id() % 32; }
__device__ __forceinline__ int slot_col(int n, int e) {
  return warp_n0() + n * kMfmaMN + 8 * (e / 4) + 4 * (lane_id() / 32) + e % 4;
}
__device__ __forceinline__ float acc_value(const Acc& acc, int i, int /*h*/, int n, int e) { return acc[i][n][e]; }

}  // namespace mma
}  // namespace rlk_cuda
