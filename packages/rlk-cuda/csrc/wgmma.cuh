// Hopper (sm_90a) building blocks of the rlk CUDA kernels: mbarriers, TMA tensor loads
// (cp.async.bulk.tensor), warpgroup MMA (wgmma.mma_async) with shared-memory matrix descriptors, and
// setmaxnreg. Used by linear_logprob_wgmma.cu and wgmma_gemm.cuh (verified on an H200).
//
// Everything device-side here exists only when compiling for sm_90a (RLK_SM90A_DEVICE): wgmma and
// setmaxnreg are arch-specific features of compute_90a (nvcc defines __CUDA_ARCH_FEAT_SM90_ALL for it,
// not for plain sm_90 nor sm_100 / sm_120). Callers guard their kernel bodies with the same macro.
//
// Shared-memory operand layout used throughout ("K-major, 128-byte swizzle", the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and the one wgmma reads with swizzle mode 1):
//   a tile of R rows (M or N) x 64 K-elements of a 16-bit type: row r occupies bytes [128 r, 128 r + 128);
//   inside each 1024-byte group of 8 rows, the 16-byte chunk c of row r is stored at chunk c ^ (r % 8).
//   The tile must start at a multiple of 1024 bytes (the swizzle pattern repeats every 8 rows = 1024 bytes;
//   PTX ISA, "Tensor-map swizzling modes" / wgmma "Shared Memory Matrix Layout": the 128B pattern's
//   repeat is 1024 bytes and its start must be 1024-aligned for a base offset of 0).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing here calls the driver API)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RLK_SM90A_DEVICE 1
#else
#define RLK_SM90A_DEVICE 0
#endif

namespace rlk_cuda {
namespace wgmma {

constexpr int kTileK = 64;                  // K elements per smem row: 64 x 2 bytes = 128 bytes = the swizzle span
constexpr int kRowBytes = 128;              // bytes per smem tile row
constexpr int kSwizzleAtom = 1024;          // bytes of one 8-row swizzle group (the descriptor's SBO)
constexpr int kAccN = 256;                  // N of the wgmma used here (m64n256k16)
constexpr int kAccRegs = 64 * kAccN / 128;  // fp32 accumulator registers per thread: 128

#if RLK_SM90A_DEVICE

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier") ----------
// A phase completes when its pending arrival count reaches 0 and its transaction count (tx) is 0. The
// barrier starts in phase 0; try_wait.parity P returns true once the phase with parity P has completed,
// and (by the same rule) at once for P = 1 on a fresh barrier: "the phase before phase 0" counts as done.

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialized barriers visible to the async proxy (TMA) and the other threads (followed by a
// __syncthreads in the caller).
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival, plus `bytes` expected transaction bytes for the current phase (the TMA loads' complete_tx
// subtract what they deliver).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` has completed (try_wait itself suspends for a while).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// ---- TMA (PTX ISA "cp.async.bulk.tensor") --------------------------------------------------------------

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The box at coordinates (c0 = innermost / contiguous, c1) of the 2-D tensor `map` -> shared memory `dst`,
// completing `bytes of the box` transactions on mbarrier `bar`. Elements outside the tensor are written as
// zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) and still count toward the delivered bytes, so a box that
// overhangs the tensor completes the same expect_tx as a full one. `map` must be the address of a
// __grid_constant__ kernel parameter (or of global / const memory).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int32_t c0,
                                            int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// ---- register reallocation (PTX ISA "setmaxnreg"; sm_90a) -----------------------------------------------
// Executed by all threads of a warpgroup (.sync.aligned); the count is a multiple of 8 in [24, 256].

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- wgmma (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions") ----------

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format", 64 bits):
//   bits  0-13  start address >> 4            bits 16-29  leading dimension byte offset (LBO) >> 4
//   bits 32-45  stride dimension byte offset (SBO) >> 4
//   bits 49-51  matrix base offset (0: the swizzle pattern starts 1024-aligned)
//   bits 62-63  swizzle mode: 0 none, 1 = 128-byte, 2 = 64-byte, 3 = 32-byte
// For a K-major operand with 128-byte swizzle whose K extent per instruction (16 elements = 32 bytes)
// lies inside one 128-byte row, the LBO (distance between core matrices along K) is not used (set to 1,
// i.e. 16 bytes, by convention) and the SBO is the distance between consecutive 8-row groups along M / N:
// 8 rows x 128 bytes = 1024 bytes.
// The k16 slice kk (0..3) of a 64-wide tile starts kk * 32 bytes into the row: its descriptor is the
// tile's with the start address advanced by 32 kk bytes. The hardware applies the 128-byte XOR swizzle
// to the final address bits (address bits [4, 7) ^= bits [7, 10)), which with a 1024-aligned tile base is
// exactly the chunk c ^ (r % 8) placement TMA wrote.
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t smem_addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4);  // start address
  desc |= static_cast<uint64_t>(1) << 16;                      // LBO (unused here)
  desc |= static_cast<uint64_t>(kSwizzleAtom >> 4) << 32;      // SBO = 1024 bytes
  desc |= static_cast<uint64_t>(1) << 62;                      // 128-byte swizzle
  return desc;
}

// The same for an MN-major operand (M-major A / N-major B: the M or N index contiguous in memory), 128-byte
// swizzle. Canonical layout (PTX ISA "Shared Memory Matrix Layout", MN-major, 128B swizzle): along MN, atoms
// of 64 contiguous 16-bit elements (one 128-byte row); along K, rows 128 bytes apart, 8 rows (1024 bytes)
// per swizzle group. SBO = the distance between 8-row K groups (1024 here), LBO = the distance between
// 64-element MN atoms (`atom_stride` bytes: the size of one TMA box of 64 MN x 64 K = 8192 bytes in the
// layout used here, see wgmma_gemm.cuh). The k16 slice kk starts 16 K-rows = 2048 kk bytes into the tile.
__device__ __forceinline__ uint64_t desc_mn_major_sw128(uint32_t smem_addr, uint32_t atom_stride) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4);          // start address
  desc |= static_cast<uint64_t>((atom_stride & 0x3FFFFu) >> 4) << 16;  // LBO: next 64-element MN atom
  desc |= static_cast<uint64_t>(kSwizzleAtom >> 4) << 32;              // SBO: next 8-row K group
  desc |= static_cast<uint64_t>(1) << 62;                              // 128-byte swizzle
  return desc;
}

// Orders this thread's register accesses before the wgmmas that follow (required before the first
// wgmma, and whenever the accumulator registers were touched by other instructions in between).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed wgmma groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// A compiler-level fence on one accumulator register: keeps the compiler from moving reads / writes of
// it across the asynchronous wgmma (whose asm statement it cannot see through), as in wait_group above.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The 128 accumulator operands %0 .. %127 of an m64n256 wgmma (generated list).
#define RLK_WGMMA_D_LIST                                                                            \
  "{"                                                                                               \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "    \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 " \
  "}"

#define RLK_WGMMA_D_OPERANDS(d)                                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),         \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),         \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),         \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),         \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),         \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),         \
      "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),         \
      "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),         \
      "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),         \
      "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),         \
      "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),    \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), \
      "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), \
      "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], fp32 accumulators, A and B from shared memory (descriptors),
// K-major or MN-major (kTransA / kTransB below), scale-a = scale-b = 1; scale_d = 0 gives D = A * B
// (the accumulator's previous values ignored), 1 gives D += A * B. Issued by all 128 threads of a warpgroup.
//
// Accumulator fragment (PTX ISA "Register Fragments and Shared Memory Matrix Layouts", wgmma .m64nNk16,
// matrix D, f32): thread t = 32 w + l of the warpgroup (warp w, lane l) holds N / 2 = 128 registers d[i]:
//   row(i) = 16 w + l / 4 + 8 * ((i >> 1) & 1)
//   col(i) = 8 * (i >> 2) + 2 * (l % 4) + (i & 1)
// i.e. for each 8-column block j = i / 4: d[4j] = (row g, col 8j + 2q), d[4j+1] = (g, 8j + 2q + 1),
// d[4j+2] = (g + 8, 8j + 2q), d[4j+3] = (g + 8, 8j + 2q + 1), g = 16 w + l / 4, q = l % 4 (the same
// per-8x8 arrangement as mma.sync m16n8's C/D fragment, repeated over 32 column blocks).

// kTransA / kTransB: the instruction's imm-trans-a / imm-trans-b (0: K-major, 1: MN-major operand, i.e.
// A[m, k] with m contiguous / B[k, n] with n contiguous; allowed for 16-bit types).
template <typename T, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[kAccRegs], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert((kTransA == 0 || kTransA == 1) && (kTransB == 0 || kTransB == 1), "transpose flags are 0 or 1");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " RLK_WGMMA_D_LIST
        ", %128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : RLK_WGMMA_D_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  } else {
    static_assert(std::is_same_v<T, __half>, "wgmma operands: bfloat16 or float16");
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " RLK_WGMMA_D_LIST
        ", %128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : RLK_WGMMA_D_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
}

#undef RLK_WGMMA_D_LIST
#undef RLK_WGMMA_D_OPERANDS

#endif  // RLK_SM90A_DEVICE

}  // namespace wgmma
}  // namespace rlk_cuda
