// fused_linear_kl on Hopper (sm_90a): forward KL, reverse KL or generalized JSD between a student's and a
// teacher's softmax, from their hidden states and LM heads, never holding more than one vocab chunk of logits.
//
// Spec: rlk/reference/distill.py (the online states, the formulas, the gradients); the Triton kernels
// (rlk_triton/distill.py) have the same passes. Per vocab chunk c of kVocabChunk = 4096 columns, in order:
//   logits    zq_c = (h_s @ W_s[c].T) * inv_t and zp_c = (h_t @ W_t[c].T) * inv_t, each by one wggemm::gemm_kernel
//             (wgmma_gemm.cuh) with ScaledLogitsEpilogue into an fp32 [N, z_stride] scratch (one per model);
//   fold      (pass 1) a block per row folds the chunk into the row's online state (m_q, s_q, m_p, s_p, b) in
//             global memory; b is the KL sum weighted by p (forward) or q (reverse), none for the JSD;
//   jsd       (JSD pass 2, after the lse) a block per row adds the chunk's KL(p || m) and KL(q || m);
//   gradient  a block per row turns the chunk's zq, zp into G_c = coef * inv_t * d loss / d zq (hidden's dtype,
//             written over the first half of zq's bytes), then linear_logprob's Hopper GEMMs 2 and 3
//             (wgmma_chunk_grad_gemms): grad_hidden (+)= G_c @ W_s[c] (fp32 accumulator), grad_weight[c] = G_c.T @ h_s.
// Passes over the logits: forward / reverse KL one for the loss and one for the gradient; the JSD one more.
//
// Batch invariance: every z comes out of the same GEMM instruction sequence wherever its tile lies; a row's
// chunk reductions (16 columns per thread, then a fixed shared-memory tree) and its merge across chunks (in
// chunk order) do not depend on N or on the other rows; grad_hidden sums chunks in order; grad_weight sums
// rows in 64-row steps in order (deterministic). No atomics.
#include <cmath>
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "linear_logprob.cuh"
#include "tma_map.cuh"
#include "wgmma_gemm.cuh"

namespace rlk_cuda {

namespace distill {

constexpr int kRowThreads = 256;                                   // threads per row in the per-row kernels
constexpr int kPackCols = 4 * kRowThreads;                         // columns one float4 step of a block covers
constexpr int kPacks = static_cast<int>(kVocabChunk) / kPackCols;  // float4 steps per thread per chunk (4)
constexpr int kFinishThreads = 256;

// The divergence (the op's `divergence` argument), and the fold's weighting of b.
enum Divergence : int { kForwardKl = 0, kReverseKl = 1, kJsd = 2 };

struct KlState {
  float m_q, s_q, m_p, s_p, b;
};

// The max a state is moved to: 0 while a row has seen only -inf (no (-inf) - (-inf)).
__device__ __forceinline__ float shift(float m) { return m == -INFINITY ? 0.0f : m; }

// b (weights of distribution a, relative to the shifts of m_a, m_c) moved to the shifts shift_a, shift_c.
__device__ __forceinline__ float moved_b(float b, float s_a, float m_a, float m_c, float shift_a, float shift_c) {
  const float r_a = expf(m_a - shift_a);
  const float moved = (b + ((shift(m_a) - shift_a) - (shift(m_c) - shift_c)) * s_a) * r_a;
  return r_a > 0.0f ? moved : 0.0f;
}

// Two states merged, each moved to the common maxes (b weighted by p for kForwardKl, q for kReverseKl, unused
// for kJsd).
template <int kDiv>
__device__ __forceinline__ KlState merge(const KlState& x, const KlState& y) {
  KlState r;
  r.m_q = fmaxf(x.m_q, y.m_q);
  r.m_p = fmaxf(x.m_p, y.m_p);
  const float sh_q = shift(r.m_q);
  const float sh_p = shift(r.m_p);
  if constexpr (kDiv == kForwardKl) {
    r.b = moved_b(x.b, x.s_p, x.m_p, x.m_q, sh_p, sh_q) + moved_b(y.b, y.s_p, y.m_p, y.m_q, sh_p, sh_q);
  } else if constexpr (kDiv == kReverseKl) {
    r.b = moved_b(x.b, x.s_q, x.m_q, x.m_p, sh_q, sh_p) + moved_b(y.b, y.s_q, y.m_q, y.m_p, sh_q, sh_p);
  } else {
    r.b = 0.0f;
  }
  r.s_q = x.s_q * expf(x.m_q - sh_q) + y.s_q * expf(y.m_q - sh_q);
  r.s_p = x.s_p * expf(x.m_p - sh_p) + y.s_p * expf(y.m_p - sh_p);
  return r;
}

// This thread's 4 kPacks columns of a row's chunk: column 4 t + kPackCols k + e in z[4 k + e] (-inf at or past
// `cols`; the scratch row holds z_stride >= cols columns, a multiple of 128).
__device__ __forceinline__ void load_row(const float* z_row, int64_t z_stride, int64_t cols, float (&z)[4 * kPacks]) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t c = 4 * static_cast<int64_t>(threadIdx.x) + int64_t{kPackCols} * k;
    float4 v = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    if (c < z_stride) v = *reinterpret_cast<const float4*>(z_row + c);
    z[4 * k + 0] = c + 0 < cols ? v.x : -INFINITY;
    z[4 * k + 1] = c + 1 < cols ? v.y : -INFINITY;
    z[4 * k + 2] = c + 2 < cols ? v.z : -INFINITY;
    z[4 * k + 3] = c + 3 < cols ? v.w : -INFINITY;
  }
}

// `v` merged over the block's threads by a fixed shared-memory tree (thread t with t + stride, strides 128 .. 1);
// thread 0 returns the block's value.
template <typename V, typename Op>
__device__ __forceinline__ V block_tree(V v, Op op) {
  __shared__ V tree[kRowThreads];
  const int t = threadIdx.x;
  tree[t] = v;
  __syncthreads();
#pragma unroll
  for (int stride = kRowThreads / 2; stride > 0; stride >>= 1) {
    if (t < stride) tree[t] = op(tree[t], tree[t + stride]);
    __syncthreads();
  }
  return tree[0];
}

// ---- the logits GEMM's epilogue ----------------------------------------------------------------------------

// z[row, c] = acc * inv_temperature[row] (one rounded multiply) for the tile's rows < n_rows, columns < cols.
struct ScaledLogitsEpilogue {
  const float* inv_temperature;
  int64_t n_rows, cols;
  float* z;
  int64_t z_stride;

  __device__ __forceinline__ void operator()(const float (&acc)[wgmma::kAccRegs], int64_t row0, int64_t col0) const {
#if RLK_SM90A_DEVICE
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + 8 * h;
      if (row >= n_rows) continue;
      const float inv_t = inv_temperature[row];
      float* z_row = z + row * z_stride;
#pragma unroll
      for (int j = 0; j < wgmma::kAccN / 8; ++j) {
        const int64_t c = col0 + 8 * j;  // even, z_stride even: 8-byte aligned pairs
        const float lo = __fmul_rn(acc[4 * j + 2 * h], inv_t);
        const float hi = __fmul_rn(acc[4 * j + 2 * h + 1], inv_t);
        if (c + 1 < cols) {
          *reinterpret_cast<float2*>(z_row + c) = make_float2(lo, hi);
        } else if (c < cols) {
          z_row[c] = lo;
        }
      }
    }
#endif
  }
};

// ---- per-row kernels ---------------------------------------------------------------------------------------

// Pass 1: the chunk's state of row blockIdx.x merged into state[5, N] (first chunk: written).
template <int kDiv>
__global__ void __launch_bounds__(kRowThreads)
    fold_kernel(const float* __restrict__ zq, const float* __restrict__ zp, int64_t z_stride, int64_t cols, bool first,
                float* __restrict__ state, int64_t n_rows) {
  const int64_t row = blockIdx.x;
  float q[4 * kPacks], p[4 * kPacks];
  load_row(zq + row * z_stride, z_stride, cols, q);
  load_row(zp + row * z_stride, z_stride, cols, p);
  KlState st{-INFINITY, 0.0f, -INFINITY, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 4 * kPacks; ++i) {
    st.m_q = fmaxf(st.m_q, q[i]);
    st.m_p = fmaxf(st.m_p, p[i]);
  }
  const float sh_q = shift(st.m_q);
  const float sh_p = shift(st.m_p);
#pragma unroll
  for (int i = 0; i < 4 * kPacks; ++i) {
    const float dq = q[i] - sh_q;  // <= 0
    const float dp = p[i] - sh_p;
    const float eq = expf(dq);
    const float ep = expf(dp);
    st.s_q += eq;
    st.s_p += ep;
    if constexpr (kDiv == kForwardKl) {
      if (ep > 0.0f) st.b += ep * (dp - dq);
    } else if constexpr (kDiv == kReverseKl) {
      if (eq > 0.0f) st.b += eq * (dq - dp);
    }
  }
  st = block_tree(st, [](const KlState& x, const KlState& y) { return merge<kDiv>(x, y); });
  if (threadIdx.x == 0) {
    if (!first) {
      const KlState old{state[row], state[n_rows + row], state[2 * n_rows + row], state[3 * n_rows + row],
                        state[4 * n_rows + row]};
      st = merge<kDiv>(old, st);
    }
    state[row] = st.m_q;
    state[n_rows + row] = st.s_q;
    state[2 * n_rows + row] = st.m_p;
    state[3 * n_rows + row] = st.s_p;
    state[4 * n_rows + row] = st.b;
  }
}

// log(beta p + (1 - beta) q) from log p, log q (NaN only where both are -inf; callers skip those terms).
__device__ __forceinline__ float log_mixture(float log_p, float log_q, float log_beta, float log_1m_beta) {
  const float a = log_p + log_beta;
  const float c = log_q + log_1m_beta;
  const float hi = fmaxf(a, c);
  const float lo = fminf(a, c);
  return hi + log1pf(expf(lo - hi));
}

// JSD pass 2: the chunk's KL(p || m) and KL(q || m) of row blockIdx.x added to sums[2, N] (first chunk: written),
// from lse_q = stats[row], lse_p = stats[N + row].
__global__ void __launch_bounds__(kRowThreads)
    jsd_kernel(const float* __restrict__ zq, const float* __restrict__ zp, int64_t z_stride, int64_t cols,
               const float* __restrict__ stats, float log_beta, float log_1m_beta, bool first, float* __restrict__ sums,
               int64_t n_rows) {
  const int64_t row = blockIdx.x;
  float q[4 * kPacks], p[4 * kPacks];
  load_row(zq + row * z_stride, z_stride, cols, q);
  load_row(zp + row * z_stride, z_stride, cols, p);
  const float lse_q = stats[row];
  const float lse_p = stats[n_rows + row];
  float2 kl{0.0f, 0.0f};  // (KL(p || m), KL(q || m))
#pragma unroll
  for (int i = 0; i < 4 * kPacks; ++i) {
    const float log_q = q[i] - lse_q;
    const float log_p = p[i] - lse_p;
    const float log_m = log_mixture(log_p, log_q, log_beta, log_1m_beta);
    const float pv = expf(log_p);
    const float qv = expf(log_q);
    if (pv > 0.0f) kl.x += pv * (log_p - log_m);
    if (qv > 0.0f) kl.y += qv * (log_q - log_m);
  }
  kl = block_tree(kl, [](float2 x, float2 y) { return make_float2(x.x + y.x, x.y + y.y); });
  if (threadIdx.x == 0) {
    if (!first) {
      kl.x = sums[row] + kl.x;
      kl.y = sums[n_rows + row] + kl.y;
    }
    sums[row] = kl.x;
    sums[n_rows + row] = kl.y;
  }
}

// The end of a pass, per row. kStage kForwardKl / kReverseKl: the KL, the lse and the gradient's row constant
// (0, or the KL for reverse) from state; kJsd with from_sums == false: the lse only (JSD pass 1); with from_sums:
// the JSD from sums (= state's first two rows) and KL(q || m) as the row constant. Loss and constant 0 on ignored
// rows.
template <int kStage>
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(const float* __restrict__ state, bool from_sums, const int64_t* __restrict__ targets,
                  int64_t ignore_index, float beta, int64_t n_rows, float* __restrict__ loss_out,
                  float* __restrict__ stats) {
  const int64_t row = int64_t{blockIdx.x} * kFinishThreads + threadIdx.x;
  if (row >= n_rows) return;
  const bool valid = targets == nullptr || targets[row] != ignore_index;
  if (kStage == kJsd && from_sums) {
    const float kl_pm = state[row];
    const float kl_qm = state[n_rows + row];
    const float loss = beta * kl_pm + (1.0f - beta) * kl_qm;
    loss_out[row] = valid ? loss : 0.0f;
    stats[2 * n_rows + row] = valid ? kl_qm : 0.0f;
    return;
  }
  const float log_s_q = logf(state[n_rows + row]);
  const float log_s_p = logf(state[3 * n_rows + row]);
  stats[row] = state[row] + log_s_q;
  stats[n_rows + row] = state[2 * n_rows + row] + log_s_p;
  const float b = state[4 * n_rows + row];
  if constexpr (kStage == kForwardKl) {
    const float loss = b / state[3 * n_rows + row] - log_s_p + log_s_q;
    loss_out[row] = valid ? loss : 0.0f;
    stats[2 * n_rows + row] = 0.0f;
  } else if constexpr (kStage == kReverseKl) {
    const float loss = b / state[n_rows + row] - log_s_q + log_s_p;
    loss_out[row] = valid ? loss : 0.0f;
    stats[2 * n_rows + row] = valid ? loss : 0.0f;
  }
}

// G of row blockIdx.x for the chunk's columns c < k_cols (0 from `cols` on): coef * inv_t * d loss / d zq, 0 on
// ignored rows, as T, written over zq's row: G's row stride is 2 z_stride elements of T, the first half of the
// row's bytes. Every thread reads its z columns before a barrier and writes after it, so no z is overwritten
// before it is read.
template <typename T, int kDiv>
__global__ void __launch_bounds__(kRowThreads)
    grad_kernel(float* zq, const float* __restrict__ zp, int64_t z_stride, int64_t cols, int64_t k_cols,
                const int64_t* __restrict__ targets, int64_t ignore_index, const float* __restrict__ inv_temperature,
                const float* __restrict__ stats, const float* __restrict__ coef, float log_beta, float log_1m_beta,
                float one_m_beta, int64_t n_rows) {
  const int64_t row = blockIdx.x;
  float q[4 * kPacks], p[4 * kPacks];
  load_row(zq + row * z_stride, z_stride, cols, q);
  load_row(zp + row * z_stride, z_stride, cols, p);
  __syncthreads();
  const bool valid = targets == nullptr || targets[row] != ignore_index;
  const float scale = coef[row] * inv_temperature[row];
  const float lse_q = stats[row];
  const float lse_p = stats[n_rows + row];
  const float aux = stats[2 * n_rows + row];
  T* g_row = reinterpret_cast<T*>(zq) + row * 2 * z_stride;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t c = 4 * static_cast<int64_t>(threadIdx.x) + int64_t{kPackCols} * k;
    if (c >= k_cols) continue;  // k_cols % 8 == 0 and c % 4 == 0: the whole pack is inside
    float g[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * k + e;
      const float log_q = q[i] - lse_q;
      const float log_p = p[i] - lse_p;
      const float qv = expf(log_q);
      float d;
      if constexpr (kDiv == kForwardKl) {
        d = qv - expf(log_p);
      } else if constexpr (kDiv == kReverseKl) {
        d = qv > 0.0f ? qv * ((log_q - log_p) - aux) : 0.0f;
      } else {
        const float log_m = log_mixture(log_p, log_q, log_beta, log_1m_beta);
        d = one_m_beta * (qv > 0.0f ? qv * ((log_q - log_m) - aux) : 0.0f);
      }
      g[e] = (valid && c + e < cols) ? d * scale : 0.0f;
    }
    uint2 packed;
    packed.x = pack2<T>(g[0], g[1]);
    packed.y = pack2<T>(g[2], g[3]);
    *reinterpret_cast<uint2*>(g_row + c) = packed;
  }
}

// ---- host side -----------------------------------------------------------------------------------------------

// One model's operands: hidden [N, size] (its TMA map) and the head weight [V, size].
template <typename T>
struct Head {
  CUtensorMap hidden_map;
  const T* weight;
  int64_t size;
};

template <typename T>
Head<T> head(const void* hidden, const void* weight, int64_t n_rows, int64_t size) {
  return Head<T>{make_map(tma_dtype<T>(), hidden, n_rows, size, size, wggemm::kBM), static_cast<const T*>(weight),
                 size};
}

// z[:, :cols] = (hidden @ W[v_start : v_start + cols].T) * inv_t, fp32 at row stride z_stride.
template <typename T>
void scaled_logits(const Head<T>& m, int64_t v_start, int64_t cols, int64_t n_rows, const float* inv_temperature,
                   float* z, int64_t z_stride, cudaStream_t s) {
  const CUtensorMap w_map = make_map(tma_dtype<T>(), m.weight + v_start * m.size, cols, m.size, m.size, wggemm::kBN);
  const ScaledLogitsEpilogue epi{inv_temperature, n_rows, cols, z, z_stride};
  auto kernel = wggemm::gemm_kernel<T, false, false, ScaledLogitsEpilogue>;
  const int m_tiles = static_cast<int>(ceil_div(n_rows, int64_t{wggemm::kBM}));
  const int n_tiles = static_cast<int>(ceil_div(cols, int64_t{wggemm::kBN}));
  allow_smem(wggemm::kSmemBytes, kernel, "fused_linear_kl logits (wgmma)");
  kernel<<<grid_of(int64_t{m_tiles} * n_tiles, "fused_linear_kl logits"), wggemm::kThreads, wggemm::kSmemBytes, s>>>(
      m.hidden_map, w_map, m_tiles, n_tiles, static_cast<int>(ceil_div(m.size, int64_t{wggemm::kBK})), 0, 0, epi);
  check_launch("fused_linear_kl logits (wgmma)");
}

// Both models' scaled logits of vocab chunk `chunk` into zq, zp; returns the chunk's column count.
template <typename T>
int64_t chunk_logits(const Head<T>& student, const Head<T>& teacher, int64_t chunk, int64_t vocab, int64_t n_rows,
                     const float* inv_temperature, float* zq, float* zp, int64_t z_stride, cudaStream_t s) {
  const int64_t v_start = chunk * kVocabChunk;
  const int64_t cols = vocab - v_start < kVocabChunk ? vocab - v_start : kVocabChunk;
  scaled_logits(student, v_start, cols, n_rows, inv_temperature, zq, z_stride, s);
  scaled_logits(teacher, v_start, cols, n_rows, inv_temperature, zp, z_stride, s);
  return cols;
}

// (log beta, log(1 - beta)), the JSD mixture's weights in log space; zeros for the KLs.
inline float2 log_betas(int divergence, float beta) {
  return divergence == kJsd ? make_float2(logf(beta), log1pf(-beta)) : make_float2(0.0f, 0.0f);
}

// Calls f(std::integral_constant<int, divergence>{}).
template <typename F>
void dispatch_divergence(int divergence, F&& f) {
  switch (divergence) {
    case kForwardKl:
      f(std::integral_constant<int, kForwardKl>{});
      return;
    case kReverseKl:
      f(std::integral_constant<int, kReverseKl>{});
      return;
    case kJsd:
      f(std::integral_constant<int, kJsd>{});
      return;
  }
  throw std::invalid_argument(
      "rlk_cuda: fused_linear_kl: divergence must be 0 (forward_kl), 1 (reverse_kl) or 2 "
      "(jsd), got " +
      std::to_string(divergence));
}

void check_inputs(const char* what, const void* student_hidden, const void* student_weight, const void* teacher_hidden,
                  const void* teacher_weight, int64_t n_rows, int64_t vocab, int64_t student_size, int64_t teacher_size,
                  const float* zq, const float* zp, int64_t z_stride, int device) {
  const std::string w(what);
  check_linear_inputs(what, student_hidden, student_weight, n_rows, vocab, student_size);
  check_linear_inputs(what, teacher_hidden, teacher_weight, n_rows, vocab, teacher_size);
  require(z_stride == linear_logprob_bwd_chunk_cols(vocab),
          w + ": the logits scratch must have linear_logprob_bwd_chunk_cols(vocab) columns");
  require(zq != nullptr && zp != nullptr && host_aligned16(zq) && host_aligned16(zp),
          w + ": the logits scratch zq, zp must be given, 16-byte aligned");
  require(n_rows < (int64_t{1} << 31) - wggemm::kBN && vocab < (int64_t{1} << 31) &&
              student_size < (int64_t{1} << 24) && teacher_size < (int64_t{1} << 24),
          w + ": N and V must be < 2^31 and H < 2^24 (int32 TMA coordinates)");
  require(n_rows <= max_grid_x(), w + ": too many rows for one grid");
  const std::string problem = linear_logprob_wgmma_problem(device);
  if (!problem.empty()) throw std::runtime_error("rlk_cuda: " + w + ": " + problem);
}

}  // namespace distill

void fused_linear_kl_fwd_wgmma(DType dtype, const void* student_hidden, const void* student_weight,
                               const void* teacher_hidden, const void* teacher_weight, const int64_t* targets,
                               const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t student_size,
                               int64_t teacher_size, int64_t ignore_index, int divergence, float beta, float* loss_out,
                               float* stats_out, float* zq, float* zp, int64_t z_stride, float* state, int device,
                               std::uintptr_t stream) {
  using namespace distill;
  const char* what = "fused_linear_kl_fwd_wgmma";
  DeviceGuard guard(device);
  check_inputs(what, student_hidden, student_weight, teacher_hidden, teacher_weight, n_rows, vocab, student_size,
               teacher_size, zq, zp, z_stride, device);
  require(loss_out != nullptr && stats_out != nullptr && state != nullptr,
          std::string(what) + ": loss_out, stats_out and state are required");
  const cudaStream_t s = as_stream(stream);
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  const unsigned rows = static_cast<unsigned>(n_rows);
  const unsigned finish_blocks = grid_of(ceil_div(n_rows, int64_t{kFinishThreads}), what);
  const float2 lb = log_betas(divergence, beta);
  dispatch_half(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    const Head<T> student = head<T>(student_hidden, student_weight, n_rows, student_size);
    const Head<T> teacher = head<T>(teacher_hidden, teacher_weight, n_rows, teacher_size);
    auto logits = [&](int64_t chunk) {
      return chunk_logits(student, teacher, chunk, vocab, n_rows, inv_temperature, zq, zp, z_stride, s);
    };
    dispatch_divergence(divergence, [&](auto div) {
      constexpr int kDiv = decltype(div)::value;
      for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
        const int64_t cols = logits(chunk);
        fold_kernel<kDiv><<<rows, kRowThreads, 0, s>>>(zq, zp, z_stride, cols, chunk == 0, state, n_rows);
        check_launch("fused_linear_kl fold_kernel");
      }
      finish_kernel<kDiv><<<finish_blocks, kFinishThreads, 0, s>>>(state, false, targets, ignore_index, beta, n_rows,
                                                                   loss_out, stats_out);
      check_launch("fused_linear_kl finish_kernel");
      if constexpr (kDiv == kJsd) {
        for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
          const int64_t cols = logits(chunk);
          jsd_kernel<<<rows, kRowThreads, 0, s>>>(zq, zp, z_stride, cols, stats_out, lb.x, lb.y, chunk == 0, state,
                                                  n_rows);
          check_launch("fused_linear_kl jsd_kernel");
        }
        finish_kernel<kJsd><<<finish_blocks, kFinishThreads, 0, s>>>(state, true, targets, ignore_index, beta, n_rows,
                                                                     loss_out, stats_out);
        check_launch("fused_linear_kl finish_kernel");
      }
    });
  });
}

void fused_linear_kl_grad_wgmma(DType dtype, const void* student_hidden, const void* student_weight,
                                const void* teacher_hidden, const void* teacher_weight, const int64_t* targets,
                                const float* inv_temperature, const float* stats, const float* coef, int64_t n_rows,
                                int64_t vocab, int64_t student_size, int64_t teacher_size, int64_t ignore_index,
                                int divergence, float beta, void* grad_hidden_out, void* grad_weight_out, float* zq,
                                float* zp, int64_t z_stride, float* grad_hidden_acc, int device,
                                std::uintptr_t stream) {
  using namespace distill;
  const char* what = "fused_linear_kl_grad_wgmma";
  const std::string w(what);
  DeviceGuard guard(device);
  check_inputs(what, student_hidden, student_weight, teacher_hidden, teacher_weight, n_rows, vocab, student_size,
               teacher_size, zq, zp, z_stride, device);
  require(stats != nullptr && coef != nullptr, w + ": stats and coef are required");
  require(grad_hidden_out == nullptr || host_aligned16(grad_hidden_out),
          w + ": grad_hidden_out must be 16-byte aligned");
  require(grad_weight_out == nullptr || host_aligned16(grad_weight_out),
          w + ": grad_weight_out must be 16-byte aligned");
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  require(
      grad_hidden_out == nullptr || n_chunks == 1 || (grad_hidden_acc != nullptr && host_aligned16(grad_hidden_acc)),
      w + ": grad_hidden_acc (fp32 [N, Hs]) is required with grad_hidden_out when V > 4096");
  if (grad_hidden_out == nullptr && grad_weight_out == nullptr) return;
  const cudaStream_t s = as_stream(stream);
  const unsigned rows = static_cast<unsigned>(n_rows);
  const float2 lb = log_betas(divergence, beta);
  dispatch_half(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    const Head<T> student = head<T>(student_hidden, student_weight, n_rows, student_size);
    const Head<T> teacher = head<T>(teacher_hidden, teacher_weight, n_rows, teacher_size);
    dispatch_divergence(divergence, [&](auto div) {
      constexpr int kDiv = decltype(div)::value;
      for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
        const int64_t v_start = chunk * kVocabChunk;
        const int64_t cols = chunk_logits(student, teacher, chunk, vocab, n_rows, inv_temperature, zq, zp, z_stride, s);
        const int64_t k_cols = ceil_div(cols, int64_t{8}) * 8;
        grad_kernel<T, kDiv><<<rows, kRowThreads, 0, s>>>(zq, zp, z_stride, cols, k_cols, targets, ignore_index,
                                                          inv_temperature, stats, coef, lb.x, lb.y, 1.0f - beta,
                                                          n_rows);
        check_launch("fused_linear_kl grad_kernel");
        const int64_t elem = 2;  // grad_weight_out in the inputs' 16-bit dtype
        void* gw = grad_weight_out == nullptr
                       ? nullptr
                       : static_cast<void*>(static_cast<char*>(grad_weight_out) + v_start * student_size * elem);
        wgmma_chunk_grad_gemms(dtype, student_hidden, student.weight + v_start * student_size, zq, 2 * z_stride, n_rows,
                               cols, student_size, chunk, n_chunks, grad_hidden_out, grad_hidden_acc, gw, false, false,
                               s);
      }
    });
  });
}

}  // namespace rlk_cuda
