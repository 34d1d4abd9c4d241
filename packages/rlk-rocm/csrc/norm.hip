// Launchers of the rms_norm kernels (rlk-cuda's norm.cuh, shared through portable.cuh): dtype dispatch, launch
// shapes and checks, as rlk-cuda's norm.cu. With 64-lane wavefronts the teams and blocks that norm.cuh derives
// from H are in whole wavefronts. One difference: a workgroup has 64 KiB of LDS, so a backward row whose
// register kernel would need more (16-bit rows of more than 7168 values) takes the chunked long-row kernel, a choice
// made from H alone.
#include <type_traits>

#include "launch.h"
#include "norm.cuh"

namespace rlk_rocm {

using namespace rlk_cuda;  // the shared kernel bodies

namespace {

// Calls f(T{}, W{}, Y{}) for the (x, weight, y) dtype triples rms_norm produces: (T, T, T) for every
// T, and for 16-bit T a fp32 weight with y in fp32 (Llama form, torch's promotion) or in T (Gemma).
template <typename F>
void dispatch_norm(DType x, DType w, DType y, F&& f) {
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    if (w == x && y == x) {
      f(T{}, T{}, T{});
      return;
    }
    if constexpr (!std::is_same_v<T, float>) {
      if (w == DType::kFloat32 && y == DType::kFloat32) {
        f(T{}, float{}, float{});
        return;
      }
      if (w == DType::kFloat32 && y == x) {
        f(T{}, float{}, T{});
        return;
      }
    }
    throw std::invalid_argument(std::string("rlk_rocm: rms_norm: unsupported dtypes x=") + dtype_name(x) +
                                ", weight=" + dtype_name(w) + ", y=" + dtype_name(y) +
                                " (weight: x's dtype or float32; y: x's dtype, or float32 for a float32 weight)");
  });
}

constexpr int kNormStaticSmemBound = 1024;  // bound on the backward kernel's static shared memory (128 bytes)

void check_sizes(const char* what, int64_t n_rows, int64_t hidden) {
  require(n_rows >= 1, std::string(what) + ": n_rows must be >= 1");
  require(hidden >= 1 && hidden <= (int64_t{1} << 31), std::string(what) + ": hidden must lie in [1, 2^31]");
}

}  // namespace

void rms_norm_fwd(DType x_dtype, DType w_dtype, DType y_dtype, const void* x, const void* weight, const void* residual,
                  int64_t n_rows, int64_t hidden, float eps, bool gemma, void* out, void* residual_out, float* rstd_out,
                  int device, std::uintptr_t stream) {
  check_sizes("rms_norm_fwd", n_rows, hidden);
  require((residual == nullptr) == (residual_out == nullptr),
          "rms_norm_fwd: residual and residual_out must be both given or both None");
  DeviceGuard guard(device);
  dispatch_norm(x_dtype, w_dtype, y_dtype, [&](auto t, auto w, auto y) {
    using T = decltype(t);
    using W = decltype(w);
    using Y = decltype(y);
    const auto* xp = static_cast<const T*>(x);
    const auto* wp = static_cast<const W*>(weight);
    const auto* rp = static_cast<const T*>(residual);
    auto* yp = static_cast<Y*>(out);
    auto* sp = static_cast<T*>(residual_out);
    const int lanes = norm_fwd_lanes(hidden, kPack<T>);
    if (lanes > 0) {
      // a team of `lanes` threads per row, the row in registers; kNormFwdRows rows per team
      const int threads = lanes > kWarpSize ? lanes : kNormFwdBlock;
      const unsigned blocks = grid_of(ceil_div(n_rows, int64_t{kNormFwdRows} * (threads / lanes)), "rms_norm_fwd");
      const bool whole = hidden % kPack<T> == 0 && host_aligned16(x) && host_aligned16(weight) &&
                         host_aligned16(residual) && host_aligned16(out) && host_aligned16(residual_out);
      const auto kernel = whole ? rms_norm_fwd_kernel<T, W, Y, true> : rms_norm_fwd_kernel<T, W, Y, false>;
      kernel<<<blocks, threads, 0, as_stream(stream)>>>(xp, wp, rp, yp, sp, rstd_out, n_rows, static_cast<int>(hidden),
                                                        eps, gemma, lanes);
    } else {
      const int threads = norm_threads(hidden, kPack<T>, kNormLongPacks);
      const int chunks = norm_chunks(hidden, kPack<T>, kNormLongPacks, threads);
      const unsigned blocks = grid_of(ceil_div(n_rows, kNormLongFwdRows), "rms_norm_fwd");
      rms_norm_fwd_long_kernel<T, W, Y>
          <<<blocks, threads, 0, as_stream(stream)>>>(xp, wp, rp, yp, sp, rstd_out, n_rows, hidden, eps, gemma, chunks);
    }
  });
  check_launch("rms_norm_fwd_kernel launch");
}

int64_t rms_norm_bwd_partial_rows(int64_t n_rows, int rows_per_block) {
  require(rows_per_block >= 1 && rows_per_block <= kNormMaxRowsPerBlock,
          "rms_norm_bwd: rows_per_block must lie in [1, " + std::to_string(kNormMaxRowsPerBlock) + "]");
  return ceil_div(n_rows, rows_per_block);
}

void rms_norm_bwd(DType x_dtype, DType w_dtype, DType y_dtype, const void* grad_out, const void* s, const void* weight,
                  const float* rstd, const void* grad_residual, int64_t n_rows, int64_t hidden, bool gemma,
                  int rows_per_block, void* grad_input_out, float* partials, void* grad_weight_out, int device,
                  std::uintptr_t stream) {
  check_sizes("rms_norm_bwd", n_rows, hidden);
  const unsigned blocks = grid_of(rms_norm_bwd_partial_rows(n_rows, rows_per_block), "rms_norm_bwd");
  require(grad_weight_out == nullptr || partials != nullptr,
          "rms_norm_bwd: grad_weight_out needs the partials scratch buffer");
  DeviceGuard guard(device);
  dispatch_norm(x_dtype, w_dtype, y_dtype, [&](auto t, auto w, auto y) {
    using T = decltype(t);
    using W = decltype(w);
    using G = decltype(y);  // grad_out has y's dtype
    const auto* gp = static_cast<const G*>(grad_out);
    const auto* sp = static_cast<const T*>(s);
    const auto* wp = static_cast<const W*>(weight);
    const auto* rp = static_cast<const T*>(grad_residual);
    auto* ip = static_cast<T*>(grad_input_out);
    float* part = grad_weight_out != nullptr ? partials : nullptr;
    int threads = norm_bwd_threads(hidden, kPack<T>);
    const int smem = 2 * threads * kNormBwdPacks * kPack<T> * static_cast<int>(sizeof(float));
    if (smem + kNormStaticSmemBound > kMaxSharedBytes) threads = 0;  // beyond the LDS: the long-row kernel
    if (threads > 0) {
      // one block per rows_per_block rows, a row in registers; w' and the grad-weight sums in shared memory
      const bool whole = hidden % kPack<T> == 0 && host_aligned16(grad_out) && host_aligned16(s) &&
                         host_aligned16(grad_residual) && host_aligned16(grad_input_out) && host_aligned16(part);
      const auto kernel = whole ? rms_norm_bwd_kernel<T, W, G, true> : rms_norm_bwd_kernel<T, W, G, false>;
      kernel<<<blocks, threads, smem, as_stream(stream)>>>(gp, sp, wp, rstd, rp, ip, part, n_rows,
                                                           static_cast<int>(hidden), gemma, rows_per_block);
    } else {
      const int long_threads = norm_threads(hidden, kPack<T>, kNormLongPacks);
      const int chunks = norm_chunks(hidden, kPack<T>, kNormLongPacks, long_threads);
      rms_norm_bwd_long_kernel<T, W, G><<<blocks, long_threads, 0, as_stream(stream)>>>(
          gp, sp, wp, rstd, rp, ip, part, n_rows, hidden, gemma, rows_per_block, chunks);
    }
    check_launch("rms_norm_bwd_kernel launch");
    if (grad_weight_out != nullptr) {
      const dim3 sum_grid(static_cast<unsigned>(ceil_div(hidden, kSumColumns)));
      const dim3 sum_block(kSumColumns, kSumGroups);
      rms_norm_sum_partials_kernel<W>
          <<<sum_grid, sum_block, 0, as_stream(stream)>>>(partials, static_cast<W*>(grad_weight_out), blocks, hidden);
      check_launch("rms_norm_sum_partials_kernel launch");
    }
  });
}

}  // namespace rlk_rocm
