// Device helpers shared by the rlk CUDA kernels: dtype conversion, 16-byte packs, and block
// reductions whose order depends only on the block size (never on the data or the grid).
//
// Batch-invariance rules every kernel here follows: a fixed block size per (dtype, row length),
// a fixed assignment of row elements to threads, reductions in a fixed tree, no atomics, int64
// offsets. Whether a pack is read with one 16-byte access or element by element (that depends on
// the pointer's alignment, which can differ between a row alone and the same row inside a batch)
// changes the memory instructions only, never the arithmetic: both paths give the same bits.
//
// This header, logprob.cuh and norm.cuh are also rlk-rocm's kernels (wavefront 64): warp-level operations, the
// warp size and the bf16 type go through portable.cuh.
#pragma once

#include <cstdint>
#include <cstring>

#include "portable.cuh"

namespace rlk_cuda {

constexpr int kMaxWarps = 32;  // warps of a block of up to 1024 threads (kWarpSize, kFullMask: portable.cuh)

// ---------------------------------------------------------------------------------------------
// dtype conversion: fp32 math, round to nearest even on the way out (as torch does)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16 x) { return bf16_to_float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  return float_to_bf16_rn(x);
}

// x rounded to T and widened back to fp32 (torch's `t.to(T)` seen from fp32 math).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// ---------------------------------------------------------------------------------------------
// packs: kPack<T> consecutive elements, 16 bytes of T
// ---------------------------------------------------------------------------------------------

template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

// Whether p is 16-byte aligned (a null pointer, an absent optional tensor, counts as aligned).
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Loads `count` (<= N) elements of `src` as fp32 into out[0, count), `fill` into out[count, N).
// `vector`: the caller promises that src is 16-byte aligned; full packs then use 16-byte loads.
template <int N, typename E>
__device__ __forceinline__ void load_floats(const E* __restrict__ src, int64_t count, bool vector, float (&out)[N],
                                            float fill) {
  constexpr int kBytes = N * static_cast<int>(sizeof(E));
  if (vector && count == N && kBytes % 16 == 0) {
    E e[N];
#pragma unroll
    for (int v = 0; v < kBytes / 16; ++v) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[v];
      std::memcpy(reinterpret_cast<char*>(e) + 16 * v, &raw, 16);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = i < count ? to_float(src[i]) : fill;
  }
}

// Stores in[0, count) rounded to E into dst (16-byte stores for full packs when `vector`).
template <int N, typename E>
__device__ __forceinline__ void store_floats(E* __restrict__ dst, int64_t count, bool vector, const float (&in)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(E));
  E e[N];
#pragma unroll
  for (int i = 0; i < N; ++i) e[i] = from_float<E>(in[i]);
  if (vector && count == N && kBytes % 16 == 0) {
#pragma unroll
    for (int v = 0; v < kBytes / 16; ++v) {
      uint4 raw;
      std::memcpy(&raw, reinterpret_cast<const char*>(e) + 16 * v, 16);
      reinterpret_cast<uint4*>(dst)[v] = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < count) dst[i] = e[i];
    }
  }
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// block reductions: a shfl_down tree inside each warp, then warp 0 reduces the warp results with
// the same tree; lane 0 of warp 0 holds the result, which is broadcast through shared memory.
// The order depends only on blockDim.x (a multiple of kWarpSize, at most 1024).
// ---------------------------------------------------------------------------------------------

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static constexpr float kIdentity = 0.0f;
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float kIdentity = -INFINITY;
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = op(v, shfl_down(v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }

// `op` (SumOp, MaxOp) of `v` over the block, the same value returned to every thread. Contains
// __syncthreads(): every thread of the block must call it.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op) {
  __shared__ float partial[kMaxWarps];
  __shared__ float result;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  v = warp_reduce(v, op);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_reduce(lane < n_warps ? partial[lane] : Op::kIdentity, op);
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp{}); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp{}); }

}  // namespace rlk_cuda
