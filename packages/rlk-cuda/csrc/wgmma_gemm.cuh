// A warp-specialized Hopper (sm_90a) tile GEMM with a caller-given epilogue: TMA loads into a 4-stage
// mbarrier ring, one producer warpgroup, two consumer warpgroups issuing wgmma m64n256k16. Used by the
// Hopper backward of linear_logprob (linear_logprob_wgmma.cu), whose three GEMMs differ only in operand
// majorness and in what happens to the fp32 tile at the end; the Hopper forward, which walks several
// vocab tiles per block, shares its K step (consumer_step) and constants.
//
// One block computes one 128 x 256 tile of C = A B (C[m, n] = sum_k A[m, k] B[k, n], fp32 accumulation,
// K in increasing 64-wide steps, the four k16 slices of a step in order: a fixed order whatever the problem
// size, so every output element goes through the same instruction sequence wherever its tile lies), then
// hands the accumulators to `epilogue` (see kernel below). No atomics; no split-K.
//
// Operands, each through a 2-D TMA tensor map over a row-major matrix of 16-bit elements (host side:
// make_map in linear_logprob_wgmma.cu), 128-byte swizzle, out-of-bounds elements read as zero:
//   K-major (kMnMajor = false): the matrix is [rows (M for A, N for B), K]; a tile of R rows x 64 K is ONE
//     TMA box {64 (K), R}, row r at byte 128 r (the forward's layout; descriptor wgmma::desc_k_major_sw128).
//   MN-major (kMnMajor = true): the matrix is [K, cols (M or N)]; a tile is R / 64 boxes {64 (MN), 64 (K)},
//     box j (MN indices 64 j .. 64 j + 63) at byte 8192 j, K row k at byte 128 k inside it
//     (descriptor wgmma::desc_mn_major_sw128 with LBO = 8192; the wgmma transposes it, imm-trans = 1).
// A box that lies entirely past the matrix's MN extent is not loaded (its smem keeps stale values, which
// only reach output rows / columns past the extent: the epilogue never stores those).
#pragma once

#include "wgmma.cuh"

namespace rlk_cuda {
namespace wggemm {

constexpr int kBM = 128;            // rows of C per block (2 consumers x 64)
constexpr int kBN = wgmma::kAccN;   // 256 columns of C per block
constexpr int kBK = wgmma::kTileK;  // 64
constexpr int kStages = 4;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);               // 384
constexpr int kConsumerWarps = 4 * kConsumers;                 // arrivals that free a stage
constexpr int kATileBytes = kBM * kBK * 2;                     // 16384
constexpr int kBTileBytes = kBN * kBK * 2;                     // 32768
constexpr int kStageBytes = kATileBytes + kBTileBytes;         // 49152
constexpr int kRingBytes = kStages * kStageBytes;              // 196608
constexpr int kBarrierBytes = 2 * kStages * 8;                 // full[kStages], empty[kStages]
constexpr int kSmemBytes = 1024 + kRingBytes + kBarrierBytes;  // + slack to align the ring to 1024
constexpr int kMnBox = 64;                                     // MN extent of one MN-major box
constexpr int kMnBoxBytes = kMnBox * kBK * 2;                  // 8192
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

static_assert(kATileBytes / kConsumers == kMnBoxBytes, "a consumer's 64 A rows are one MN box / 64 K-major rows");
static_assert(kStageBytes % wgmma::kSwizzleAtom == 0 && kATileBytes % wgmma::kSwizzleAtom == 0 &&
                  kMnBoxBytes % wgmma::kSwizzleAtom == 0,
              "every tile and box starts 1024-aligned (128-byte swizzle)");
static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 opt-in shared memory per block");
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * 168, "register budget");

// Block -> (tile_m, tile_n): groups of `group` M tiles walk the N tiles together (L2 reuse), in 32-bit
// arithmetic (a 64-bit division is a subroutine call, around which ptxas spills in these register-tight
// kernels); the host keeps every quantity below 2^31.
__host__ __device__ __forceinline__ void grouped_tile32(int pid, int n_m, int n_n, int group, int& tile_m,
                                                        int& tile_n) {
  const int per_group = group * n_n;
  const int first = pid / per_group * group;
  const int size = n_m - first < group ? n_m - first : group;
  const int in_group = pid % per_group;
  tile_m = first + in_group % size;
  tile_n = in_group / size;
}

#if RLK_SM90A_DEVICE
// Number of boxes of an operand tile of kRows rows starting at MN index r0 that hold any element (MN-major:
// boxes past `extent` are skipped; K-major: always the one box).
template <bool kMnMajor, int kRows>
__device__ __forceinline__ int boxes_in_range(int r0, int extent) {
  if constexpr (!kMnMajor) {
    return 1;
  } else {
    const int left = (extent - r0 + kMnBox - 1) / kMnBox;
    return left < kRows / kMnBox ? left : kRows / kMnBox;
  }
}

// The operand tile (kRows MN indices from r0, K from k0) -> smem `dst`, on mbarrier `bar`; `boxes` from
// boxes_in_range.
template <bool kMnMajor, int kRows>
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int r0, int k0,
                                          int boxes) {
  if constexpr (!kMnMajor) {
    wgmma::tma_load_2d(dst, map, bar, k0, r0);
  } else {
    for (int j = 0; j < boxes; ++j) wgmma::tma_load_2d(dst + j * kMnBoxBytes, map, bar, r0 + j * kMnBox, k0);
  }
}

// Descriptor of the k16 slice kk of a 64-row (A: one consumer's rows) or 256-row (B) operand tile at `tile`.
template <bool kMnMajor>
__device__ __forceinline__ uint64_t slice_desc(uint32_t tile, int kk) {
  if constexpr (kMnMajor) {
    return wgmma::desc_mn_major_sw128(tile + kk * 16 * wgmma::kRowBytes, kMnBoxBytes);
  } else {
    return wgmma::desc_k_major_sw128(tile + kk * 32);  // 16 elements = 32 bytes into each 128-byte row
  }
}

// One K step of a consumer warpgroup (all 128 threads): wait for ring stage `step % kStages` to hold step
// `step`'s operands, issue its four k16 wgmmas on `acc` (the first with scale-d = 0 when `first`: a new output
// tile), commit, wait until at most this step's group is in flight, and release the previous step's stage
// `pending` (-1: none; one arrival per warp). Returns this step's stage: the caller's next `pending`.
template <typename T, bool kMnMajorA, bool kMnMajorB>
__device__ __forceinline__ int consumer_step(float (&acc)[wgmma::kAccRegs], uint32_t ring, uint32_t full_bar,
                                             uint32_t empty_bar, int step, int consumer, int lane, bool first,
                                             int pending) {
  const int s = step % kStages;
  const uint32_t round = static_cast<uint32_t>(step / kStages);
  wgmma::mbar_wait(full_bar + 8 * s, round & 1u);  // the TMA bytes of this use of stage s have landed
  const uint32_t a_tile = ring + s * kStageBytes + consumer * (kATileBytes / kConsumers);
  const uint32_t b_tile = ring + s * kStageBytes + kATileBytes;
#pragma unroll
  for (int i = 0; i < wgmma::kAccRegs; ++i) wgmma::fence_operand(acc[i]);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    wgmma::mma_m64n256k16<T, kMnMajorA ? 1 : 0, kMnMajorB ? 1 : 0>(
        acc, slice_desc<kMnMajorA>(a_tile, kk), slice_desc<kMnMajorB>(b_tile, kk), (first && kk == 0) ? 0 : 1);
  }
  wgmma::commit_group();
#pragma unroll
  for (int i = 0; i < wgmma::kAccRegs; ++i) wgmma::fence_operand(acc[i]);
  wgmma::wait_group<1>();  // the previous step's group is done: its stage can be refilled
  if (pending >= 0 && lane == 0) wgmma::mbar_arrive(empty_bar + 8 * pending);
  return s;
}

// Waits for every wgmma of this thread; `acc` may be read afterwards.
__device__ __forceinline__ void drain(float (&acc)[wgmma::kAccRegs]) {
  wgmma::wait_group<0>();
#pragma unroll
  for (int i = 0; i < wgmma::kAccRegs; ++i) wgmma::fence_operand(acc[i]);
}
#endif

// Grid: m_tiles * n_tiles blocks (m_tiles = ceil(M / 128), n_tiles = ceil(N / 256)), kThreads threads,
// kSmemBytes of dynamic shared memory. k_steps = ceil(K / 64) >= 1. a_extent / b_extent: M / N (used to skip
// MN-major boxes entirely past the matrix).
//
// Epilogue: a trivially copyable functor with
//     __device__ void operator()(const float (&acc)[128], int64_t row, int64_t col) const
// called once by every consumer thread after the K loop: register 4 j + 2 h + e of `acc` holds
// C[row + 8 h, col + 8 j + e] (j = 0..31, h, e = 0..1; the wgmma m64nNk16 fragment, wgmma.cuh). Rows and
// columns may lie past M / N: the epilogue must not store those.
template <typename T, bool kMnMajorA, bool kMnMajorB, typename Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, int m_tiles,
                int n_tiles, int k_steps, int a_extent, int b_extent, const Epilogue epilogue) {
#if RLK_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring = (wgmma::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full_bar = ring + kRingBytes;
  const uint32_t empty_bar = full_bar + kStages * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wgmma::mbar_init(full_bar + 8 * s, 1);
      wgmma::mbar_init(empty_bar + 8 * s, kConsumerWarps);
    }
    wgmma::mbar_fence_init();
  }
  __syncthreads();

  // setmaxnreg first in each branch, the tile coordinates after it (values live across it get spilled).
  if (threadIdx.x < 128) {
    // ---- producer: one thread issues every load ----
    wgmma::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      int tile_m, tile_n;
      grouped_tile32(static_cast<int>(blockIdx.x), m_tiles, n_tiles, 8, tile_m, tile_n);
      const int m0 = tile_m * kBM;
      const int n0 = tile_n * kBN;
      const int a_boxes = boxes_in_range<kMnMajorA, kBM>(m0, a_extent);
      const int b_boxes = boxes_in_range<kMnMajorB, kBN>(n0, b_extent);
      const uint32_t bytes =
          (kMnMajorA ? a_boxes * kMnBoxBytes : kATileBytes) + (kMnMajorB ? b_boxes * kMnBoxBytes : kBTileBytes);
      wgmma::prefetch_tensor_map(&a_map);
      wgmma::prefetch_tensor_map(&b_map);
      for (int step = 0; step < k_steps; ++step) {
        const int s = step % kStages;
        const uint32_t round = static_cast<uint32_t>(step / kStages);
        wgmma::mbar_wait(empty_bar + 8 * s, (round & 1u) ^ 1u);  // round 0: returns at once (fresh barrier)
        const uint32_t a_dst = ring + s * kStageBytes;
        wgmma::mbar_arrive_expect_tx(full_bar + 8 * s, bytes);
        load_tile<kMnMajorA, kBM>(a_dst, &a_map, full_bar + 8 * s, m0, step * kBK, a_boxes);
        load_tile<kMnMajorB, kBN>(a_dst + kATileBytes, &b_map, full_bar + 8 * s, n0, step * kBK, b_boxes);
      }
    }
    return;  // the consumers keep the block (and its shared memory) alive until the last stage is used
  }

  // ---- consumers: consumer c computes rows 64 c .. 64 c + 63 of the tile, all 256 columns ----
  wgmma::setmaxnreg_inc<kConsumerRegs>();
  const int consumer = static_cast<int>(threadIdx.x / 128) - 1;
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;

  float acc[wgmma::kAccRegs];
#pragma unroll
  for (int i = 0; i < wgmma::kAccRegs; ++i) acc[i] = 0.0f;

  int pending = -1;  // the stage the previous step's wgmmas read (released once they are done)
  for (int step = 0; step < k_steps; ++step) {
    pending = consumer_step<T, kMnMajorA, kMnMajorB>(acc, ring, full_bar, empty_bar, step, consumer, lane, step == 0,
                                                     pending);
  }
  drain(acc);
  // (the last stage needs no release: nothing waits for it any more)

  int tile_m, tile_n;
  grouped_tile32(static_cast<int>(blockIdx.x), m_tiles, n_tiles, 8, tile_m, tile_n);
  const int64_t row = int64_t{tile_m} * kBM + consumer * 64 + warp * 16 + lane / 4;
  const int64_t col = int64_t{tile_n} * kBN + 2 * (lane % 4);
  epilogue(acc, row, col);
#elif defined(__CUDA_ARCH__)
  __trap();  // never launched where wgmma does not exist (linear_logprob_wgmma_problem)
#endif
}

}  // namespace wggemm
}  // namespace rlk_cuda
