// selected_logprob kernels: per-row log-prob of the target, entropy and logsumexp of
// z = logits * inv_temperature, and the gradient with respect to the logits.
//
// Spec (rlk.reference.logprob), per row with target y:
//     lse = logsumexp_v z_v,   logprob = z_y - lse,   entropy = lse - sum_v p_v z_v,   p = softmax(z)
//     d/dx_v = inv_t * ( g_lp * (onehot(y)_v - p_v) + g_ent * p_v * (lse - entropy - z_v) )
// Rows whose target equals ignore_index give 0 (and a zero gradient); their lse is written 0
// (the ABI leaves it unspecified) and their logits are not read.
//
// Launch structure: one block of kLogprobThreads threads per row. The row is cut into packs of
// 16 bytes (8 bf16 / fp16 values, 4 fp32 values); thread t owns packs t, t + T, t + 2T, ... and
// visits them in that order, keeping an online state (running max m, sum s = sum exp(z - m),
// b = sum z exp(z - m)) rescaled once per pack. The per-thread states are merged in a fixed
// tree (common.cuh). The forward reads the logits once; the backward reads them once more and
// recomputes p from the saved lse, writing the gradient once.
//
// z = x * inv_t is one fp32 multiply rounded on its own (__fmul_rn: never contracted into an FMA
// with the subtraction that follows), as the ABI says: the backward's p = exp(z - lse) and E_p[z] - z
// then see the forward's z, and logprob = z_y - lse <= 0 (lse >= max z) holds exactly.
//
// exp: fp32 logits use expf (full fp32 accuracy: the fp32 gradient contract is tight); 16-bit
// logits use __expf (ex2.approx, a few ulp), keeping the kernel at memory speed.
#pragma once

#include <cmath>

#include "common.cuh"

namespace rlk_cuda {

constexpr int kLogprobThreads = 256;
constexpr int kLogprobUnroll = 4;  // packs loaded before the first is used (memory-level parallelism)

template <bool kFast>
__device__ __forceinline__ float exp_of(float x) {
  if constexpr (kFast) {
    return __expf(x);
  } else {
    return expf(x);
  }
}

// Online softmax state of part of a row: m = max z, s = sum exp(z - m), b = sum z exp(z - m).
struct SoftmaxState {
  float m;
  float s;
  float b;
};

// The shift subtracted before exp: m, or 0 while m is -inf (so no exp sees (-inf) - (-inf)).
__device__ __forceinline__ float shift_of(float m) { return m == -INFINITY ? 0.0f : m; }

// Merge two states (accurate expf: a handful per row).
__device__ __forceinline__ SoftmaxState merge(SoftmaxState a, SoftmaxState o) {
  const float m = fmaxf(a.m, o.m);
  const float shift = shift_of(m);
  const float ca = expf(a.m - shift);
  const float co = expf(o.m - shift);
  return {m, a.s * ca + o.s * co, a.b * ca + o.b * co};
}

// Fold one pack of scaled logits z[0, N) into the state (masked lanes hold -inf).
template <int N, bool kEntropy, bool kFast>
__device__ __forceinline__ void fold_pack(SoftmaxState& st, const float (&z)[N]) {
  float pack_max = z[0];
#pragma unroll
  for (int i = 1; i < N; ++i) pack_max = fmaxf(pack_max, z[i]);
  if (pack_max > st.m) {
    const float rescale = exp_of<kFast>(st.m - shift_of(pack_max));
    st.s *= rescale;
    st.b *= rescale;
    st.m = pack_max;
  }
  const float shift = shift_of(st.m);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float e = exp_of<kFast>(z[i] - shift);
    st.s += e;
    if constexpr (kEntropy) st.b += e > 0.0f ? z[i] * e : 0.0f;  // 0 * -inf counts as 0
  }
}

// State of the whole row in every thread. Every thread of the block must call it.
__device__ __forceinline__ SoftmaxState block_merge(SoftmaxState st) {
  __shared__ SoftmaxState partial[kMaxWarps];
  __shared__ SoftmaxState result;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  auto warp_merge = [](SoftmaxState v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
      SoftmaxState o{__shfl_down_sync(kFullMask, v.m, offset), __shfl_down_sync(kFullMask, v.s, offset),
                     __shfl_down_sync(kFullMask, v.b, offset)};
      v = merge(v, o);
    }
    return v;
  };
  st = warp_merge(st);
  if (lane == 0) partial[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = warp_merge(lane < n_warps ? partial[lane] : SoftmaxState{-INFINITY, 0.0f, 0.0f});
    if (lane == 0) result = st;
  }
  __syncthreads();
  return result;
}

// Grid: one block per row (blockIdx.x), kLogprobThreads threads.
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kLogprobThreads)
    selected_logprob_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                const float* __restrict__ inv_temperature, int64_t vocab, int64_t ignore_index,
                                float* __restrict__ logprob_out, float* __restrict__ entropy_out,
                                float* __restrict__ lse_out) {
  constexpr int P = kPack<T>;
  constexpr bool kFast = sizeof(T) < 4;
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    if (threadIdx.x == 0) {
      logprob_out[row] = 0.0f;
      lse_out[row] = 0.0f;
      if constexpr (kEntropy) entropy_out[row] = 0.0f;
    }
    return;
  }
  const T* x = logits + row * vocab;
  const float inv_t = inv_temperature[row];
  const bool vector = aligned16(x);
  const int64_t n_packs = ceil_div(vocab, P);

  SoftmaxState st{-INFINITY, 0.0f, 0.0f};
  for (int64_t k0 = threadIdx.x; k0 < n_packs; k0 += int64_t{kLogprobThreads} * kLogprobUnroll) {
    float z[kLogprobUnroll][P];
#pragma unroll
    for (int u = 0; u < kLogprobUnroll; ++u) {
      const int64_t k = k0 + int64_t{u} * kLogprobThreads;
      const int64_t count = k < n_packs ? min(int64_t{P}, vocab - k * P) : 0;
      load_floats<P>(x + k * P, count, vector, z[u], -INFINITY);
    }
#pragma unroll
    for (int u = 0; u < kLogprobUnroll; ++u) {
      if (k0 + int64_t{u} * kLogprobThreads < n_packs) {
#pragma unroll
        for (int i = 0; i < P; ++i) z[u][i] = __fmul_rn(z[u][i], inv_t);
        fold_pack<P, kEntropy, kFast>(st, z[u]);
      }
    }
  }
  st = block_merge(st);
  if (threadIdx.x == 0) {
    const float lse = st.m + logf(st.s);
    // A target outside [0, V) (value checks disabled) gives NaN instead of an out-of-bounds read.
    const float z_target = (target >= 0 && target < vocab) ? __fmul_rn(to_float(x[target]), inv_t) : NAN;
    logprob_out[row] = z_target - lse;
    lse_out[row] = lse;
    if constexpr (kEntropy) entropy_out[row] = lse - st.b / st.s;
  }
}

// Grid: one block per row, kLogprobThreads threads. kEntropy: the entropy term is present
// (grad_entropy and entropy given).
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kLogprobThreads)
    selected_logprob_bwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                const float* __restrict__ inv_temperature, const float* __restrict__ lse,
                                const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                                const float* __restrict__ grad_entropy, int64_t vocab, int64_t ignore_index,
                                T* __restrict__ grad_logits) {
  constexpr int P = kPack<T>;
  constexpr bool kFast = sizeof(T) < 4;
  constexpr int64_t kStride = int64_t{kLogprobThreads} * kLogprobUnroll;
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  const int64_t n_packs = ceil_div(vocab, P);
  T* y = grad_logits + row * vocab;

  if (target == ignore_index) {
    const bool vector = aligned16(y);
    float zero[P];
#pragma unroll
    for (int i = 0; i < P; ++i) zero[i] = 0.0f;
    for (int64_t k = threadIdx.x; k < n_packs; k += kLogprobThreads) {
      store_floats<P>(y + k * P, min(int64_t{P}, vocab - k * P), vector, zero);
    }
    return;
  }

  const T* x = logits + row * vocab;
  const bool vector = aligned16(x) && aligned16(y);
  const float inv_t = inv_temperature[row];
  const float row_lse = lse[row];
  const float g_lp = grad_logprob[row];
  float g_ent = 0.0f;
  float mean_z = 0.0f;
  if constexpr (kEntropy) {
    g_ent = grad_entropy[row];
    mean_z = row_lse - entropy[row];  // E_p[z]
  }
  for (int64_t k0 = threadIdx.x; k0 < n_packs; k0 += kStride) {
    float v[kLogprobUnroll][P];
#pragma unroll
    for (int u = 0; u < kLogprobUnroll; ++u) {
      const int64_t k = k0 + int64_t{u} * kLogprobThreads;
      const int64_t count = k < n_packs ? min(int64_t{P}, vocab - k * P) : 0;
      load_floats<P>(x + k * P, count, vector, v[u], 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kLogprobUnroll; ++u) {
      const int64_t k = k0 + int64_t{u} * kLogprobThreads;
      if (k >= n_packs) continue;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const float z = __fmul_rn(v[u][i], inv_t);
        const float p = exp_of<kFast>(z - row_lse);
        float g = -g_lp * p;
        if (k * P + i == target) g += g_lp;
        if constexpr (kEntropy) {
          if (p > 0.0f) g += g_ent * p * (mean_z - z);
        }
        v[u][i] = g * inv_t;
      }
      store_floats<P>(y + k * P, min(int64_t{P}, vocab - k * P), vector, v[u]);
    }
  }
}

}  // namespace rlk_cuda
