// Launchers of the rms_norm kernels (norm.cuh): dtype dispatch, launch shapes and checks.
#include <type_traits>

#include "launch.cuh"
#include "norm.cuh"

namespace rlk_cuda {
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
    throw std::invalid_argument(std::string("rlk_cuda: rms_norm: unsupported dtypes x=") + dtype_name(x) +
                                ", weight=" + dtype_name(w) + ", y=" + dtype_name(y) +
                                " (weight: x's dtype or float32; y: x's dtype, or float32 for a float32 weight)");
  });
}

void check_sizes(const char* what, int64_t n_rows, int64_t hidden) {
  require(n_rows >= 1, std::string(what) + ": n_rows must be >= 1");
  require(hidden >= 1 && hidden <= (int64_t{1} << 31), std::string(what) + ": hidden must lie in [1, 2^31]");
}

// The shared-memory ring of a launch: `stages` stages of `words` 16-byte words per thread for
// one-chunk rows, as many as norm_stages gives and the device's shared memory per block allows (a
// 99 KiB GPU may take fewer than an H100); stages = 0 (the plain path, the same arithmetic) for
// longer rows or where two stages do not fit. Opts the kernel into the ring's size above 48 KiB.
struct Ring {
  int stages;
  int bytes;
};

template <typename Kernel>
Ring ring_of(Kernel kernel, int chunks, int words, int threads, int device, const char* name) {
  if (chunks > 1) return {0, 0};
  int max_bytes = 0;
  DeviceGuard::check(cudaDeviceGetAttribute(&max_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                     "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  constexpr int64_t kStaticBytes = 4 * 1024;  // room left for the kernels' static shared memory (< 2 KiB)
  const int64_t stage_bytes = int64_t{words} * threads * 16;
  int stages = norm_stages(stage_bytes);
  while (stages >= 2 && stage_bytes * stages + kStaticBytes > max_bytes) --stages;
  if (stages < 2) return {0, 0};
  const int bytes = static_cast<int>(stage_bytes * stages);
  // dynamic + static shared memory above the 48 KiB default needs the opt-in (a 48 KiB ring alone is at the edge)
  if (bytes + kStaticBytes > 48 * 1024) allow_smem(bytes, kernel, name);
  return {stages, bytes};
}

}  // namespace

void rms_norm_fwd(DType x_dtype, DType w_dtype, DType y_dtype, const void* x, const void* weight, const void* residual,
                  int64_t n_rows, int64_t hidden, float eps, bool gemma, void* out, void* residual_out,
                  float* rstd_out, int device, std::uintptr_t stream) {
  check_sizes("rms_norm_fwd", n_rows, hidden);
  const int64_t blocks = ceil_div(n_rows, kNormFwdRows);
  require(blocks <= max_grid_x(), "rms_norm_fwd: too many rows for one grid");
  require((residual == nullptr) == (residual_out == nullptr),
          "rms_norm_fwd: residual and residual_out must be both given or both None");
  DeviceGuard guard(device);
  dispatch_norm(x_dtype, w_dtype, y_dtype, [&](auto t, auto w, auto y) {
    using T = decltype(t);
    using W = decltype(w);
    using Y = decltype(y);
    const int threads = norm_threads(hidden, kPack<T>, kNormPacks);
    const int chunks = norm_chunks(hidden, kPack<T>, kNormPacks, threads);
    const auto kernel = rms_norm_fwd_kernel<T, W, Y>;
    const Ring ring = ring_of(kernel, chunks, fwd_ring_words(residual != nullptr), threads, device,
                              "cudaFuncSetAttribute(rms_norm_fwd_kernel)");
    kernel<<<static_cast<unsigned>(blocks), threads, ring.bytes, as_stream(stream)>>>(
        static_cast<const T*>(x), static_cast<const W*>(weight), static_cast<const T*>(residual), static_cast<Y*>(out),
        static_cast<T*>(residual_out), rstd_out, n_rows, hidden, eps, gemma, chunks, ring.stages);
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
  const int64_t blocks = rms_norm_bwd_partial_rows(n_rows, rows_per_block);
  require(blocks <= max_grid_x(), "rms_norm_bwd: too many rows for rows_per_block");
  require(grad_weight_out == nullptr || partials != nullptr,
          "rms_norm_bwd: grad_weight_out needs the partials scratch buffer");
  DeviceGuard guard(device);
  dispatch_norm(x_dtype, w_dtype, y_dtype, [&](auto t, auto w, auto y) {
    using T = decltype(t);
    using W = decltype(w);
    using G = decltype(y);  // grad_out has y's dtype
    const int threads = norm_threads(hidden, kPack<T>, kNormPacks);
    const int chunks = norm_chunks(hidden, kPack<T>, kNormPacks, threads);
    float* part = grad_weight_out != nullptr ? partials : nullptr;
    const auto kernel = rms_norm_bwd_kernel<T, W, G>;
    const Ring ring = ring_of(kernel, chunks, bwd_ring_words<T, G>(grad_residual != nullptr), threads, device,
                              "cudaFuncSetAttribute(rms_norm_bwd_kernel)");
    kernel<<<static_cast<unsigned>(blocks), threads, ring.bytes, as_stream(stream)>>>(
        static_cast<const G*>(grad_out), static_cast<const T*>(s), static_cast<const W*>(weight), rstd,
        static_cast<const T*>(grad_residual), static_cast<T*>(grad_input_out), part, n_rows, hidden, gemma,
        rows_per_block, chunks, ring.stages);
    check_launch("rms_norm_bwd_kernel launch");
    if (grad_weight_out != nullptr) {
      const dim3 sum_grid(static_cast<unsigned>(ceil_div(hidden, kSumColumns)));
      const dim3 sum_block(kSumColumns, kSumGroups);
      rms_norm_sum_partials_kernel<W><<<sum_grid, sum_block, 0, as_stream(stream)>>>(
          partials, static_cast<W*>(grad_weight_out), blocks, hidden);
      check_launch("rms_norm_sum_partials_kernel launch");
    }
  });
}

}  // namespace rlk_cuda
