// selected_logprob kernels: per-row log-prob of the target, entropy and logsumexp of
// z = logits * inv_temperature, and the gradient with respect to the logits.
//
// Spec (rlk.reference.logprob), per row with target y:
//     lse = logsumexp_v z_v,   logprob = z_y - lse,   entropy = lse - sum_v p_v z_v,   p = softmax(z)
//     d/dx_v = inv_t * ( g_lp * (onehot(y)_v - p_v) + g_ent * p_v * (lse - entropy - z_v) )
// The entropy is computed relative to the max m, entropy = log s - b / s with s = sum_v exp(z_v - m) >= 1
// and b = sum_v (z_v - m) exp(z_v - m) <= 0: two terms >= 0, so it is >= 0 and its rounding follows the
// entropy, not |z| (lse - sum_v p_v z_v would subtract two numbers of size |z|). So is the log-prob,
// logprob = (z_y - m) - log s (two terms <= 0): z_y - lse rounded lse at the magnitude of z (-1.9375 for
// -log 7 with every logit 1e6, 0 with every logit 3e38).
// Rows whose target equals ignore_index give 0 (and a zero gradient); their lse is written 0
// (the ABI leaves it unspecified) and their logits are not read.
//
// Launch structure: one block of kLogprobThreads threads per row. The row is cut into packs of
// 16 bytes (8 bf16 / fp16 values, 4 fp32 values); thread t owns packs t, t + T, t + 2T, ... and
// visits them in that order, kLogprobUnroll packs per step. The forward reads the logits once;
// the backward reads them once more and recomputes p from the saved lse, writing the gradient once.
//
// z = x * inv_t is one fp32 multiply rounded on its own (__fmul_rn: never contracted into an FMA
// with the subtraction that follows), as the ABI says: the backward's p = exp(z - lse) then sees the
// forward's z, and logprob = (z_y - m) - log s <= 0 (z_y <= m, s >= 1) holds exactly.
//
// Two kernel pairs, chosen by dtype (both batch-invariant: the block size, the pack-to-thread map and
// every summation order depend on V and the dtype only):
//
// * fp32 logits (selected_logprob_fwd_kernel / _bwd_kernel): expf (full fp32 accuracy: the fp32
//   gradient contract is tight), an online state (max m, s = sum exp(z - m), b = sum (z - m) exp(z - m))
//   rescaled once per pack (fold_pack, shared with linear_logprob), merged in a fixed tree.
//
// * 16-bit logits (selected_logprob_fwd_16_kernel / _bwd_16_kernel), built to issue few instructions
//   per element (a 16-bit element is 2 bytes: at ~20 instructions per element a forward is bound by
//   instruction issue near 40% of the H200's DRAM bandwidth; these take ~7): a pack is kept as four
//   32-bit words of two values; the max of a step's packs is taken on the raw words (max.bf16x2 / max.f16x2,
//   half an instruction per element) and scaled once: round(max x * inv_t) = max round(x * inv_t) for
//   inv_t >= 0 (the ABI's T > 0), so it is the exact max of z. exp runs in log2 units on MUFU.EX2
//   (ex2.approx.ftz: a few ulp, results below 2^-126 flushed to 0): the forward's exponent is one FMA,
//   a = z * log2(e) - round(m * log2(e)), whose constant rounding offset is removed once per row at the
//   end (the entropy sums a * 2^a, one FMA: relative to the max, like the fp32 state); the backward keeps
//   p = 2^((z - lse) * log2(e)) (the subtraction first: p <= 1 wherever z <= lse). Details at the kernels.
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

// Online softmax state of part of a row, relative to its max: m = max z, s = sum exp(z - m) (>= 1 once a
// finite z is in: the max's own term is exp(0) = 1), b = sum (z - m) exp(z - m) (<= 0; entropy only).
// Empty: {-inf, 0, 0}. The entropy of a row's state is log s - b / s (entropy_of).
struct SoftmaxState {
  float m;
  float s;
  float b;
};

// The shift subtracted before exp: m, or 0 while m is -inf (so no exp sees (-inf) - (-inf)).
__device__ __forceinline__ float shift_of(float m) { return m == -INFINITY ? 0.0f : m; }

// b of a state with max m moved to the larger max `shift`, given its factor c = exp(m - shift):
// (b + (m - shift) s) c, as every exponent z - m becomes z - shift = (z - m) + (m - shift). 0 where c = 0
// (so an empty state, m = -inf and s = 0, gives no (-inf) * 0).
__device__ __forceinline__ float moved_b(float b, float s, float m, float shift, float c) {
  return c > 0.0f ? fmaf(m - shift, s, b) * c : 0.0f;
}

// Merge two states (accurate expf: a handful per row).
__device__ __forceinline__ SoftmaxState merge(SoftmaxState a, SoftmaxState o) {
  const float m = fmaxf(a.m, o.m);
  const float shift = shift_of(m);
  const float ca = expf(a.m - shift);
  const float co = expf(o.m - shift);
  return {m, a.s * ca + o.s * co, moved_b(a.b, a.s, a.m, shift, ca) + moved_b(o.b, o.s, o.m, shift, co)};
}

// log s - b / s: the entropy of a row's whole state (both terms >= 0). An all -inf row (s = 0) gives NaN.
__device__ __forceinline__ float entropy_of(const SoftmaxState& st) { return logf(st.s) - st.b / st.s; }

// Fold one pack of scaled logits z[0, N) into the state (masked lanes hold -inf).
template <int N, bool kEntropy, bool kFast>
__device__ __forceinline__ void fold_pack(SoftmaxState& st, const float (&z)[N]) {
  float pack_max = z[0];
#pragma unroll
  for (int i = 1; i < N; ++i) pack_max = fmaxf(pack_max, z[i]);
  if (pack_max > st.m) {  // (then pack_max is finite or +inf: shift_of(pack_max) = pack_max)
    const float rescale = exp_of<kFast>(st.m - pack_max);
    if constexpr (kEntropy) st.b = moved_b(st.b, st.s, st.m, pack_max, rescale);
    st.s *= rescale;
    st.m = pack_max;
  }
  const float shift = shift_of(st.m);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float d = z[i] - shift;  // <= 0
    const float e = exp_of<kFast>(d);
    st.s += e;
    if constexpr (kEntropy) st.b += e > 0.0f ? d * e : 0.0f;  // 0 * -inf counts as 0
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
      SoftmaxState o{shfl_down(v.m, offset), shfl_down(v.s, offset), shfl_down(v.b, offset)};
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

// ---------------------------------------------------------------------------------------------
// pieces shared by the fp32 and the 16-bit kernels
// ---------------------------------------------------------------------------------------------

// Forward outputs of a row whose target is ignore_index (thread 0 writes them).
template <bool kEntropy>
__device__ __forceinline__ void write_ignored_row(int64_t row, float* __restrict__ logprob_out,
                                                  float* __restrict__ entropy_out, float* __restrict__ lse_out) {
  if (threadIdx.x == 0) {
    logprob_out[row] = 0.0f;
    lse_out[row] = 0.0f;
    if constexpr (kEntropy) entropy_out[row] = 0.0f;
  }
}

// The target's scaled logit z_y = x_y * inv_t; a target outside [0, V) (value checks disabled) gives NaN
// instead of an out-of-bounds read.
template <typename T>
__device__ __forceinline__ float target_z(const T* __restrict__ x, int64_t target, int64_t vocab, float inv_t) {
  return (target >= 0 && target < vocab) ? __fmul_rn(to_float(x[target]), inv_t) : NAN;
}

// Zero gradient row y[0, V) (a row whose target is ignore_index), every thread of the block.
template <typename T>
__device__ __forceinline__ void zero_row(T* __restrict__ y, int64_t vocab) {
  constexpr int P = kPack<T>;
  const bool vector = aligned16(y);
  float zero[P];
#pragma unroll
  for (int i = 0; i < P; ++i) zero[i] = 0.0f;
  for (int64_t k = threadIdx.x; k < ceil_div(vocab, P); k += kLogprobThreads) {
    store_floats<P>(y + k * P, min(int64_t{P}, vocab - k * P), vector, zero);
  }
}

// ---------------------------------------------------------------------------------------------
// fp32 logits
// ---------------------------------------------------------------------------------------------

// Grid: one block per row (blockIdx.x), kLogprobThreads threads.
template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kLogprobThreads)
    selected_logprob_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                const float* __restrict__ inv_temperature, int64_t vocab, int64_t ignore_index,
                                float* __restrict__ logprob_out, float* __restrict__ entropy_out,
                                float* __restrict__ lse_out) {
  constexpr int P = kPack<T>;
  static_assert(sizeof(T) == 4, "16-bit logits take selected_logprob_fwd_16_kernel");
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    write_ignored_row<kEntropy>(row, logprob_out, entropy_out, lse_out);
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
        fold_pack<P, kEntropy, false>(st, z[u]);
      }
    }
  }
  st = block_merge(st);
  if (threadIdx.x == 0) {
    const float log_s = logf(st.s);
    const float lse = st.m + log_s;
    logprob_out[row] = (target_z(x, target, vocab, inv_t) - st.m) - log_s;
    lse_out[row] = lse;
    if constexpr (kEntropy) entropy_out[row] = entropy_of(st);
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
  static_assert(sizeof(T) == 4, "16-bit logits take selected_logprob_bwd_16_kernel");
  constexpr int64_t kStride = int64_t{kLogprobThreads} * kLogprobUnroll;
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  const int64_t n_packs = ceil_div(vocab, P);
  T* y = grad_logits + row * vocab;

  if (target == ignore_index) {
    zero_row(y, vocab);
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
        const float p = exp_of<false>(z - row_lse);
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

// ---------------------------------------------------------------------------------------------
// 16-bit logits (bf16, fp16)
// ---------------------------------------------------------------------------------------------

constexpr float kLog2e = 1.44269504088896341f;  // log2(e), rounded to fp32
constexpr float kLn2 = 0.693147180559945309f;   // ln(2), rounded to fp32

// ex2_ftz(a) = 2^a: portable.cuh (MUFU.EX2 on CUDA).

template <typename To, typename From>
__device__ __forceinline__ To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// A 32-bit word holding two values of the 16-bit type T, element 2i in the low half (memory order).
// lo / hi: the two values widened to fp32 (exact); max2: the per-half max of two words (one
// max.bf16x2 / max.f16x2; a NaN half loses to a number, as fmaxf); pack: two fp32 values rounded to
// nearest even into a word (one cvt.rn.bf16x2.f32 / f16x2.f32). kNegInfBits: -inf.
template <typename T>
struct Word16;

template <>
struct Word16<bf16> {
  using Pair = bf16x2;
  static constexpr uint32_t kNegInfBits = 0xff80u;
  // a bf16 is the top half of the fp32 with the same value: a shift / a mask, no conversion
  __device__ static __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  __device__ static __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    return bits_as<uint32_t>(floats_to_bf16x2_rn(lo, hi));
  }
};

template <>
struct Word16<__half> {
  using Pair = __half2;
  static constexpr uint32_t kNegInfBits = 0xfc00u;
  __device__ static __forceinline__ float lo(uint32_t w) { return __low2float(bits_as<__half2>(w)); }
  __device__ static __forceinline__ float hi(uint32_t w) { return __high2float(bits_as<__half2>(w)); }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    return bits_as<uint32_t>(__floats2half2_rn(lo, hi));
  }
};

template <typename T>
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
  using Pair = typename Word16<T>::Pair;
  return bits_as<uint32_t>(hmax2(bits_as<Pair>(a), bits_as<Pair>(b)));
}

// 16 and 2 bytes of the (read-only) logits. kFresh: ld.volatile, which the compiler can neither merge with
// an earlier load of the same address nor drop (fold_step's rare second pass loads its words again rather
// than keeping them live through the first); else the read-only path.
template <bool kFresh>
__device__ __forceinline__ uint4 load_16_bytes(const void* p) {
  if constexpr (kFresh) {
    return volatile_load_16_bytes(p);
  } else {
    return __ldg(static_cast<const uint4*>(p));
  }
}

template <bool kFresh>
__device__ __forceinline__ uint32_t load_2_bytes(const void* p) {
  if constexpr (kFresh) {
    return volatile_load_2_bytes(p);
  } else {
    return __ldg(static_cast<const unsigned short*>(p));
  }
}

// A full pack (8 elements) at src as four words: one 16-byte load when kVector (src 16-byte aligned),
// else eight 2-byte loads. Either way the words hold the same bits, so the arithmetic after is the same.
template <typename T, bool kVector, bool kFresh = false>
__device__ __forceinline__ void load_words(const T* __restrict__ src, uint32_t (&w)[4]) {
  if constexpr (kVector) {
    const uint4 raw = load_16_bytes<kFresh>(src);
    w[0] = raw.x;
    w[1] = raw.y;
    w[2] = raw.z;
    w[3] = raw.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = load_2_bytes<kFresh>(src + 2 * j) | (load_2_bytes<kFresh>(src + 2 * j + 1) << 16);
    }
  }
}

// The row's last pack when it holds count < 8 elements: the others read as -inf.
template <typename T, bool kFresh = false>
__device__ __forceinline__ void load_partial_words(const T* __restrict__ src, int count, uint32_t (&w)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = 2 * j < count ? load_2_bytes<kFresh>(src + 2 * j) : Word16<T>::kNegInfBits;
    const uint32_t hi = 2 * j + 1 < count ? load_2_bytes<kFresh>(src + 2 * j + 1) : Word16<T>::kNegInfBits;
    w[j] = lo | (hi << 16);
  }
}

// Stores four words as a full pack at dst (one 16-byte store when kVector), or its first count elements.
template <typename T, bool kVector>
__device__ __forceinline__ void store_words(T* __restrict__ dst, const uint32_t (&w)[4]) {
  if constexpr (kVector) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    unsigned short* h = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = static_cast<unsigned short>(w[i / 2] >> (16 * (i % 2)));
  }
}

template <typename T>
__device__ __forceinline__ void store_partial_words(T* __restrict__ dst, int count, const uint32_t (&w)[4]) {
  unsigned short* h = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < count) h[i] = static_cast<unsigned short>(w[i / 2] >> (16 * (i % 2)));
  }
}

// One step of a thread: NP packs, pack u at src + u * kLogprobThreads * 8 elements (consecutive packs of the
// thread). count: the elements of the step's pack when NP = 1 (the row's last pack may hold fewer than 8;
// the others read as -inf / are not written); 8 for a step of full packs.
template <typename T, int NP, bool kVector, bool kFresh = false>
__device__ __forceinline__ void load_step(const T* __restrict__ src, int count, uint32_t (&w)[NP][4]) {
#pragma unroll
  for (int u = 0; u < NP; ++u) {
    if (NP == 1 && count < 8) {
      load_partial_words<T, kFresh>(src, count, w[u]);
    } else {
      load_words<T, kVector, kFresh>(src + u * kLogprobThreads * 8, w[u]);
    }
  }
}

template <typename T, int NP, bool kVector>
__device__ __forceinline__ void store_step(T* __restrict__ dst, int count, const uint32_t (&w)[NP][4]) {
#pragma unroll
  for (int u = 0; u < NP; ++u) {
    if (NP == 1 && count < 8) {
      store_partial_words(dst, count, w[u]);
    } else {
      store_words<T, kVector>(dst + u * kLogprobThreads * 8, w[u]);
    }
  }
}

// Max of the 4 * NP values held in w, widened to fp32: a fixed tree of max2 over the words (half an
// instruction per element), then the max of the last word's two halves.
template <typename T, int NP>
__device__ __forceinline__ float max_of_words(const uint32_t (&w)[NP][4]) {
  uint32_t pack_max[NP];
#pragma unroll
  for (int u = 0; u < NP; ++u) pack_max[u] = max2<T>(max2<T>(w[u][0], w[u][1]), max2<T>(w[u][2], w[u][3]));
#pragma unroll
  for (int width = 1; width < NP; width *= 2) {
#pragma unroll
    for (int u = 0; u + width < NP; u += 2 * width) pack_max[u] = max2<T>(pack_max[u], pack_max[u + width]);
  }
  return fmaxf(Word16<T>::lo(pack_max[0]), Word16<T>::hi(pack_max[0]));
}

// x where x >= 0 (or NaN), else 0: for a quantity that is >= 0 exactly but may round below.
__device__ __forceinline__ float clamp_rounding(float x) { return x < 0.0f ? 0.0f : x; }

// Online softmax state of part of a row in log2 units, relative to the shift round(m log2e):
//   m    max z seen (-inf: none yet),
//   nml  -round(m * log2e), the exponent offset (0 while m = -inf, so no exponent is (-inf) - (-inf)),
//   s    sum_v 2^a_v,      a_v = z_v log2e + nml  (the exponent, <= c = m log2e + nml),
//   b    sum_v a_v 2^a_v   (entropy only).
// The exponent a = z log2e + nml is one FMA (exact product, one rounding of a number near 0 for the
// terms that matter), and b one more FMA with the same a: b is relative to the max as the fp32 state's
// (z - m) exp(z - m), so no term of size |z| enters it. The offset's own rounding c = m log2e - round(m log2e)
// (|c| <= half an ulp of m log2e, exact in fp32) is one constant factor 2^c on s and b and a constant c
// added to every a, which the forward takes out once at the end. When the offset moves by dn (a larger m),
// every a becomes a + dn: s' = s 2^dn and b' = (b + dn s) 2^dn.
struct Exp2State {
  float m;
  float nml;
  float s;
  float b;
};

// s and b of the 4 * NP values in w for the state's offset nml, as (lo half, hi half) accumulators in
// element order. kGuard: a term whose exp is 0 adds nothing to b (a -inf logit: a * e = -inf * 0 = NaN).
template <typename T, int NP, bool kEntropy, bool kGuard>
__device__ __forceinline__ void exp_sums(const uint32_t (&w)[NP][4], float inv_t, float nml, float& s, float& b) {
  using W = Word16<T>;
  // (-0 + e = e exactly: the first add of each sum folds away)
  float s_lo = -0.0f, s_hi = -0.0f, b_lo = -0.0f, b_hi = -0.0f;
#pragma unroll
  for (int u = 0; u < NP; ++u) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float z_lo = __fmul_rn(W::lo(w[u][j]), inv_t);
      const float z_hi = __fmul_rn(W::hi(w[u][j]), inv_t);
      const float a_lo = fmaf(z_lo, kLog2e, nml);
      const float a_hi = fmaf(z_hi, kLog2e, nml);
      const float e_lo = ex2_ftz(a_lo);
      const float e_hi = ex2_ftz(a_hi);
      s_lo += e_lo;
      s_hi += e_hi;
      if constexpr (kEntropy) {
        if constexpr (kGuard) {
          b_lo = e_lo > 0.0f ? fmaf(a_lo, e_lo, b_lo) : b_lo;
          b_hi = e_hi > 0.0f ? fmaf(a_hi, e_hi, b_hi) : b_hi;
        } else {
          b_lo = fmaf(a_lo, e_lo, b_lo);
          b_hi = fmaf(a_hi, e_hi, b_hi);
        }
      }
    }
  }
  s = s_lo + s_hi;
  b = b_lo + b_hi;
}

// Folds one step of a thread (load_step's packs at src, raw logits) into st: one max for them all, at most
// one rescale, then per element an unpack, z = x * inv_t, one FMA, one MUFU.EX2, one add (and one FMA for b).
template <typename T, int NP, bool kEntropy, bool kVector>
__device__ __forceinline__ void fold_step(Exp2State& st, const T* __restrict__ src, int count, float inv_t) {
  uint32_t w[NP][4];
  load_step<T, NP, kVector>(src, count, w);
  // round(max x * inv_t) = max_v round(x_v * inv_t) as rounding is monotonic and inv_t >= 0
  const float z_max = __fmul_rn(max_of_words<T, NP>(w), inv_t);
  if (z_max > st.m) {
    const float nml = -__fmul_rn(z_max, kLog2e);
    if (st.m != -INFINITY) {          // (s and b are 0 while m = -inf)
      const float dn = nml - st.nml;  // <= 0: every exponent a becomes a + dn
      const float rescale = exp2f(dn);
      if constexpr (kEntropy) st.b = rescale > 0.0f ? fmaf(dn, st.s, st.b) * rescale : 0.0f;
      st.s *= rescale;
    }
    st.m = z_max;
    st.nml = nml;
  }
  float s, b;
  exp_sums<T, NP, kEntropy, false>(w, inv_t, st.nml, s, b);
  st.s += s;
  if constexpr (kEntropy) {
    if (isnan(b)) {  // a -inf logit among them (or a NaN one, which makes s NaN anyway): again, guarded,
      // on the words loaded again (keeping them live through the first pass for this rare case would cost
      // registers, so occupancy, in every step)
      load_step<T, NP, kVector, true>(src, count, w);
      float s_again;
      exp_sums<T, NP, kEntropy, true>(w, inv_t, st.nml, s_again, b);
    }
    st.b += b;
  }
}

// This thread's state of row x: its full packs kLogprobUnroll at a time (thread t: packs t, t + T, ...),
// then its remaining packs (the row's partial last pack among them) one at a time. Where the main loop
// stops depends on V and t only.
template <typename T, bool kEntropy, bool kVector>
__device__ __forceinline__ Exp2State fold_row_16(const T* __restrict__ x, int64_t vocab, float inv_t) {
  constexpr int P = 8;
  constexpr int64_t kThreads = kLogprobThreads;
  const int64_t n_full = vocab / P;
  const int64_t n_packs = ceil_div(vocab, P);
  Exp2State st{-INFINITY, 0.0f, 0.0f, 0.0f};
  int64_t k = threadIdx.x;
  for (; k + (kLogprobUnroll - 1) * kThreads < n_full; k += kLogprobUnroll * kThreads) {
    fold_step<T, kLogprobUnroll, kEntropy, kVector>(st, x + k * P, P, inv_t);
  }
  for (; k < n_packs; k += kThreads) {
    fold_step<T, 1, kEntropy, kVector>(st, x + k * P, static_cast<int>(min(int64_t{P}, vocab - k * P)), inv_t);
  }
  return st;
}

// 16-bit logits (T = bf16 or __half). Grid: one block per row, kLogprobThreads threads.
// kAligned: the launcher promises that every row starts 16-byte aligned (rows_aligned16), so the kernel
// holds only the 16-byte load path (the element-wise path, for rows that may not be, needs more registers
// and would lower the occupancy of every row). Both give the same bits.
// After the threads' loops, the row max M; each thread scales its s and b to the common offset
// round(M log2e) (a factor 1 for the threads that hold M), and the block sums them (block_sum's fixed
// tree). Then with c = M log2e - round(M log2e), s = 2^c S and b = 2^c (log2e B + c S), where
// S = sum_v exp(z_v - M) and B = sum_v (z_v - M) exp(z_v - M):
//     lse = M + ln2 * (log2 s - c),    entropy = log S - B / S = ln2 * ((log2 s - c) + (c - b / s)),
// two terms >= 0 (each clamped at 0 against rounding), so entropy >= 0.
// lse is raised to M where rounding puts it below (lse >= max z exactly, so logprob <= 0).
template <typename T, bool kEntropy, bool kAligned>
__global__ void __launch_bounds__(kLogprobThreads)
    selected_logprob_fwd_16_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                   const float* __restrict__ inv_temperature, int64_t vocab, int64_t ignore_index,
                                   float* __restrict__ logprob_out, float* __restrict__ entropy_out,
                                   float* __restrict__ lse_out) {
  static_assert(sizeof(T) == 2, "fp32 logits take selected_logprob_fwd_kernel");
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    write_ignored_row<kEntropy>(row, logprob_out, entropy_out, lse_out);
    return;
  }
  const T* x = logits + row * vocab;
  const float inv_t = inv_temperature[row];
  const Exp2State st = (kAligned || aligned16(x)) ? fold_row_16<T, kEntropy, true>(x, vocab, inv_t)
                                                  : fold_row_16<T, kEntropy, false>(x, vocab, inv_t);
  const float m = block_max(st.m);
  const float nml = m == -INFINITY ? 0.0f : -__fmul_rn(m, kLog2e);
  const float dn = nml - st.nml;  // the thread's exponents move by dn to the common offset
  const float to_common = st.m == -INFINITY ? 0.0f : exp2f(dn);
  const float s = block_sum(st.s * to_common);
  const float b = kEntropy ? block_sum(to_common > 0.0f ? fmaf(dn, st.s, st.b) * to_common : 0.0f) : 0.0f;
  if (threadIdx.x == 0) {
    float lse = m + logf(s);  // m = -inf: -inf (or NaN), as the fp32 kernel
    float log_s = logf(s);    // log s relative to m: logprob = (z_y - m) - log s
    if (m != -INFINITY) {
      const float log2_s = log2f(s) - fmaf(m, kLog2e, nml);
      lse = m + kLn2 * log2_s;
      if (lse < m) lse = m;  // (a NaN lse stays NaN)
      log_s = __fmul_rn(kLn2, log2_s);
      if (log_s < 0.0f) log_s = 0.0f;  // as lse >= m (a NaN stays NaN)
    }
    logprob_out[row] = (target_z(x, target, vocab, inv_t) - m) - log_s;
    lse_out[row] = lse;
    if constexpr (kEntropy) {
      float entropy = logf(s) - b / s;  // m = -inf (s = 0): NaN, as the fp32 kernel
      if (m != -INFINITY) {
        const float c = fmaf(m, kLog2e, nml);  // exact
        entropy = kLn2 * (clamp_rounding(log2f(s) - c) + clamp_rounding(c - b / s));
      }
      entropy_out[row] = entropy;
    }
  }
}

// Per-row constants of the backward: with d = z - lse and p = exp(d),
//     d/dx_v = inv_t * (g_lp * (onehot_v - p_v) + g_ent * p_v * (lse - entropy - z_v))
//            = p_v * (c - g_ent inv_t * d_v) + onehot_v * g_lp inv_t,   c = -(g_lp inv_t + g_ent inv_t * entropy)
// (lse - entropy - z = -(entropy + d): no |lse|-sized cancellation).
struct GradRow16 {
  float inv_t;
  float lse;
  float c;           // -(g_lp inv_t + g_ent inv_t entropy)
  float neg_bent;    // -g_ent inv_t (0 without the entropy term)
  float target_add;  // g_lp inv_t
};

// Below d = -128, p = 2^(d log2e) is 0 (flushed below 2^-126): clamping d there leaves every product
// p * (c - g_ent inv_t d) unchanged but keeps a -inf logit from making it 0 * inf = NaN.
constexpr float kGradMinD = -128.0f;

// p and the factor w of d/dx = p * w (+ the one-hot term) for one logit x.
template <bool kEntropy>
__device__ __forceinline__ void grad_parts(float x, const GradRow16& g, float& p, float& w) {
  const float z = __fmul_rn(x, g.inv_t);
  const float d = z - g.lse;  // rounded on its own: d <= 0 wherever z <= lse, so p <= 1 there
  p = ex2_ftz(d * kLog2e);
  w = kEntropy ? fmaf(g.neg_bent, fmaxf(d, kGradMinD), g.c) : g.c;
}

// Gradient words of the 4 * NP logits in w (in place).
template <typename T, int NP, bool kEntropy>
__device__ __forceinline__ void grad_words(uint32_t (&w)[NP][4], const GradRow16& g) {
  using W = Word16<T>;
#pragma unroll
  for (int u = 0; u < NP; ++u) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float p_lo, w_lo, p_hi, w_hi;
      grad_parts<kEntropy>(W::lo(w[u][j]), g, p_lo, w_lo);
      grad_parts<kEntropy>(W::hi(w[u][j]), g, p_hi, w_hi);
      w[u][j] = W::pack(p_lo * w_lo, p_hi * w_hi);
    }
  }
}

// This thread's packs of the gradient row (the forward's steps), without the one-hot term.
template <typename T, bool kEntropy, bool kVector>
__device__ __forceinline__ void grad_row_16(const T* __restrict__ x, T* __restrict__ y, int64_t vocab,
                                            const GradRow16& g) {
  constexpr int P = 8;
  constexpr int64_t kThreads = kLogprobThreads;
  const int64_t n_full = vocab / P;
  const int64_t n_packs = ceil_div(vocab, P);
  int64_t k = threadIdx.x;
  for (; k + (kLogprobUnroll - 1) * kThreads < n_full; k += kLogprobUnroll * kThreads) {
    uint32_t w[kLogprobUnroll][4];
    load_step<T, kLogprobUnroll, kVector>(x + k * P, P, w);
    grad_words<T, kLogprobUnroll, kEntropy>(w, g);
    store_step<T, kLogprobUnroll, kVector>(y + k * P, P, w);
  }
  for (; k < n_packs; k += kThreads) {
    uint32_t w[1][4];
    const int count = static_cast<int>(min(int64_t{P}, vocab - k * P));
    load_step<T, 1, kVector>(x + k * P, count, w);
    grad_words<T, 1, kEntropy>(w, g);
    store_step<T, 1, kVector>(y + k * P, count, w);
  }
}

// 16-bit logits. Grid: one block per row, kLogprobThreads threads; kAligned: every row of the logits and
// of the gradient starts 16-byte aligned (as the forward). The one-hot term is added afterwards
// by the thread that stored the target's pack (same thread, so its store comes after the pack's):
// d/dx_y = p_y * w_y + g_lp inv_t in one FMA, >= 0 for g_lp >= 0 without the entropy term as p_y <= 1.
template <typename T, bool kEntropy, bool kAligned>
__global__ void __launch_bounds__(kLogprobThreads)
    selected_logprob_bwd_16_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                   const float* __restrict__ inv_temperature, const float* __restrict__ lse,
                                   const float* __restrict__ entropy, const float* __restrict__ grad_logprob,
                                   const float* __restrict__ grad_entropy, int64_t vocab, int64_t ignore_index,
                                   T* __restrict__ grad_logits) {
  static_assert(sizeof(T) == 2, "fp32 logits take selected_logprob_bwd_kernel");
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  T* y = grad_logits + row * vocab;
  if (target == ignore_index) {
    zero_row(y, vocab);
    return;
  }
  const T* x = logits + row * vocab;
  GradRow16 g;
  g.inv_t = inv_temperature[row];
  g.lse = lse[row];
  g.target_add = __fmul_rn(grad_logprob[row], g.inv_t);
  g.neg_bent = 0.0f;
  g.c = -g.target_add;
  if constexpr (kEntropy) {
    const float bent = __fmul_rn(grad_entropy[row], g.inv_t);
    g.neg_bent = -bent;
    g.c = -fmaf(bent, entropy[row], g.target_add);
  }
  if (kAligned || (aligned16(x) && aligned16(y))) {
    grad_row_16<T, kEntropy, true>(x, y, vocab, g);
  } else {
    grad_row_16<T, kEntropy, false>(x, y, vocab, g);
  }
  if (target >= 0 && target < vocab && threadIdx.x == (target / kPack<T>) % kLogprobThreads) {
    // (the pack's store was a uint4 or 2-byte store: no compiler reordering across this point, whatever it
    // assumes about aliasing; the hardware keeps one thread's stores to one address in order)
    asm volatile("" ::: "memory");
    float p, w;
    grad_parts<kEntropy>(to_float(x[target]), g, p, w);
    y[target] = from_float<T>(fmaf(p, w, g.target_add));
  }
}

}  // namespace rlk_cuda
