// Launchers of the selected_logprob kernels (logprob.cuh): dtype dispatch and launch checks.
#include "launch.cuh"
#include "logprob.cuh"

namespace rlk_cuda {

void selected_logprob_fwd(DType dtype, const void* logits, const int64_t* targets, const float* inv_temperature,
                          int64_t n_rows, int64_t vocab, int64_t ignore_index, float* logprob_out, float* entropy_out,
                          float* lse_out, int device, std::uintptr_t stream) {
  require(n_rows >= 1 && n_rows <= max_grid_x(), "selected_logprob_fwd: n_rows must lie in [1, 2^31)");
  require(vocab >= 1, "selected_logprob_fwd: vocab must be >= 1");
  DeviceGuard guard(device);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    const dim3 grid(static_cast<unsigned>(n_rows));
    if (entropy_out != nullptr) {
      selected_logprob_fwd_kernel<T, true><<<grid, kLogprobThreads, 0, as_stream(stream)>>>(
          x, targets, inv_temperature, vocab, ignore_index, logprob_out, entropy_out, lse_out);
    } else {
      selected_logprob_fwd_kernel<T, false><<<grid, kLogprobThreads, 0, as_stream(stream)>>>(
          x, targets, inv_temperature, vocab, ignore_index, logprob_out, nullptr, lse_out);
    }
  });
  check_launch("selected_logprob_fwd_kernel launch");
}

void selected_logprob_bwd(DType dtype, const void* logits, const int64_t* targets, const float* inv_temperature,
                          const float* lse, const float* entropy, const float* grad_logprob, const float* grad_entropy,
                          int64_t n_rows, int64_t vocab, int64_t ignore_index, void* grad_logits_out, int device,
                          std::uintptr_t stream) {
  require(n_rows >= 1 && n_rows <= max_grid_x(), "selected_logprob_bwd: n_rows must lie in [1, 2^31)");
  require(vocab >= 1, "selected_logprob_bwd: vocab must be >= 1");
  require((entropy == nullptr) == (grad_entropy == nullptr),
          "selected_logprob_bwd: entropy and grad_entropy must be both given or both None");
  DeviceGuard guard(device);
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    T* g = static_cast<T*>(grad_logits_out);
    const dim3 grid(static_cast<unsigned>(n_rows));
    if (grad_entropy != nullptr) {
      selected_logprob_bwd_kernel<T, true><<<grid, kLogprobThreads, 0, as_stream(stream)>>>(
          x, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, vocab, ignore_index, g);
    } else {
      selected_logprob_bwd_kernel<T, false><<<grid, kLogprobThreads, 0, as_stream(stream)>>>(
          x, targets, inv_temperature, lse, nullptr, grad_logprob, nullptr, vocab, ignore_index, g);
    }
  });
  check_launch("selected_logprob_bwd_kernel launch");
}

}  // namespace rlk_cuda
