// The portability layer of the kernel bodies shared by rlk-cuda and rlk-rocm (common.cuh, logprob.cuh,
// norm.cuh): the warp size, warp shuffles and votes, the 16-bit float types and the few instructions written as
// inline PTX. On CUDA every name maps to what the kernels called before (the same instructions, the same
// bits); on HIP (__HIP_PLATFORM_AMD__, gfx9 CDNA) to the wavefront-64 equivalents.
//
// This file lives in rlk-cuda's csrc/ (the single source); rlk-rocm's CMake includes this folder from a
// checkout, and its sdist carries a copy (pyproject.toml: sdist.force-include) so it builds standalone.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace rlk_cuda {

#if defined(__HIP_PLATFORM_AMD__)

// gfx9 (CDNA: MI200 gfx90a, MI300 gfx94x) runs wavefronts of 64 lanes; RDNA (wave32) is not a target.
constexpr int kWarpSize = 64;
constexpr unsigned long long kFullMask = ~0ull;
#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == kWarpSize, "rlk-rocm kernels are written for wavefront-64 targets");
#endif

__device__ __forceinline__ float shfl_down(float v, int offset) { return __shfl_down(v, offset, kWarpSize); }
__device__ __forceinline__ float shfl_xor(float v, int offset) { return __shfl_xor(v, offset, kWarpSize); }
// Whether p holds in any lane of the wavefront (every lane must call it).
__device__ __forceinline__ bool warp_any(bool p) { return __any(p) != 0; }

// bf16: a 16-bit word, the top half of the fp32 of the same value (ROCm 5.x has no CUDA-like bf16 API;
// only the conversions below are needed). bf16x2: two of them, element 0 in the low half.
struct bf16 {
  uint16_t bits;
};
struct bf16x2 {
  uint32_t bits;
};

__device__ __forceinline__ float bf16_to_float(bf16 x) { return __uint_as_float(uint32_t{x.bits} << 16); }

// Round to nearest even (NaN stays a quiet NaN), as __float2bfloat16_rn.
__device__ __forceinline__ bf16 float_to_bf16_rn(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  return bf16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

__device__ __forceinline__ bf16x2 floats_to_bf16x2_rn(float lo, float hi) {
  return bf16x2{uint32_t{float_to_bf16_rn(lo).bits} | (uint32_t{float_to_bf16_rn(hi).bits} << 16)};
}

// Per-half max of two pairs (a NaN half loses to a number, as fmaxf): through fp32, exact.
__device__ __forceinline__ bf16x2 hmax2(bf16x2 a, bf16x2 b) {
  const float lo = fmaxf(__uint_as_float(a.bits << 16), __uint_as_float(b.bits << 16));
  const float hi = fmaxf(__uint_as_float(a.bits & 0xffff0000u), __uint_as_float(b.bits & 0xffff0000u));
  return bf16x2{(__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u)};
}
__device__ __forceinline__ __half2 hmax2(__half2 a, __half2 b) {
  return __floats2half2_rn(fmaxf(__low2float(a), __low2float(b)), fmaxf(__high2float(a), __high2float(b)));
}

// 2^a (the forward's and backward's exponent of the 16-bit selected_logprob kernels).
__device__ __forceinline__ float ex2_ftz(float a) { return exp2f(a); }

// Loads the compiler may neither merge with an earlier load of the same address nor drop.
__device__ __forceinline__ uint4 volatile_load_16_bytes(const void* p) {
  const volatile uint32_t* w = static_cast<const volatile uint32_t*>(p);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint32_t volatile_load_2_bytes(const void* p) {
  return *static_cast<const volatile unsigned short*>(p);
}

// CUDA's explicitly rounded fp32 operations: never contracted with a neighbour (the pragma marks the IR
// operation non-contractable, which inlining keeps).
__device__ __forceinline__ float __fmul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ __forceinline__ float __fadd_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
__device__ __forceinline__ float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

#else  // CUDA

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

__device__ __forceinline__ float shfl_down(float v, int offset) { return __shfl_down_sync(kFullMask, v, offset); }
__device__ __forceinline__ float shfl_xor(float v, int offset) { return __shfl_xor_sync(kFullMask, v, offset); }
// Whether p holds in any lane of the warp (every lane must call it).
__device__ __forceinline__ bool warp_any(bool p) { return __any_sync(kFullMask, p) != 0; }

using bf16 = __nv_bfloat16;
using bf16x2 = __nv_bfloat162;

__device__ __forceinline__ float bf16_to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 float_to_bf16_rn(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ bf16x2 floats_to_bf16x2_rn(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }

__device__ __forceinline__ bf16x2 hmax2(bf16x2 a, bf16x2 b) { return __hmax2(a, b); }
__device__ __forceinline__ __half2 hmax2(__half2 a, __half2 b) { return __hmax2(a, b); }

// 2^a on MUFU.EX2, one instruction (a few ulp; results below 2^-126 flush to 0; 2^-inf = 0). The
// non-ftz form (and __expf) wraps it in a denormal-range fix-up of three more instructions.
__device__ __forceinline__ float ex2_ftz(float a) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// ld.volatile: a load the compiler can neither merge with an earlier load of the same address nor drop.
__device__ __forceinline__ uint4 volatile_load_16_bytes(const void* p) {
  uint4 r;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t volatile_load_2_bytes(const void* p) {
  unsigned short r;
  asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

#endif

}  // namespace rlk_cuda
