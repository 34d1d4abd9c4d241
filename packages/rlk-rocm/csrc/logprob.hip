// Launchers of the selected_logprob kernels (rlk-cuda's logprob.cuh, shared through portable.cuh): dtype
// dispatch and launch checks, as rlk-cuda's logprob.cu. One workgroup of kLogprobThreads (256, four
// wavefronts of 64) per row; the block reductions run over 64-lane wavefronts in a fixed tree.
#include "launch.h"
#include "logprob.cuh"

namespace rlk_rocm {

using namespace rlk_cuda;  // the shared kernel bodies

namespace {

// Whether every row of a contiguous [N, vocab] matrix at p starts 16-byte aligned (the 16-bit kernels' kAligned).
template <typename T>
bool rows_aligned16(const T* p, int64_t vocab) {
  return host_aligned16(p) && (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

}  // namespace

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
    auto launch = [&](auto kernel, float* entropy) {
      kernel<<<grid, kLogprobThreads, 0, as_stream(stream)>>>(x, targets, inv_temperature, vocab, ignore_index,
                                                              logprob_out, entropy, lse_out);
    };
    if constexpr (sizeof(T) == 2) {
      const bool aligned = rows_aligned16(x, vocab);
      if (entropy_out != nullptr) {
        aligned ? launch(selected_logprob_fwd_16_kernel<T, true, true>, entropy_out)
                : launch(selected_logprob_fwd_16_kernel<T, true, false>, entropy_out);
      } else {
        aligned ? launch(selected_logprob_fwd_16_kernel<T, false, true>, nullptr)
                : launch(selected_logprob_fwd_16_kernel<T, false, false>, nullptr);
      }
    } else {
      if (entropy_out != nullptr) {
        launch(selected_logprob_fwd_kernel<T, true>, entropy_out);
      } else {
        launch(selected_logprob_fwd_kernel<T, false>, nullptr);
      }
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
    auto launch = [&](auto kernel, const float* ent, const float* grad_ent) {
      kernel<<<grid, kLogprobThreads, 0, as_stream(stream)>>>(x, targets, inv_temperature, lse, ent, grad_logprob,
                                                              grad_ent, vocab, ignore_index, g);
    };
    if constexpr (sizeof(T) == 2) {
      const bool aligned = rows_aligned16(x, vocab) && rows_aligned16(g, vocab);
      if (grad_entropy != nullptr) {
        aligned ? launch(selected_logprob_bwd_16_kernel<T, true, true>, entropy, grad_entropy)
                : launch(selected_logprob_bwd_16_kernel<T, true, false>, entropy, grad_entropy);
      } else {
        aligned ? launch(selected_logprob_bwd_16_kernel<T, false, true>, nullptr, nullptr)
                : launch(selected_logprob_bwd_16_kernel<T, false, false>, nullptr, nullptr);
      }
    } else {
      if (grad_entropy != nullptr) {
        launch(selected_logprob_bwd_kernel<T, true>, entropy, grad_entropy);
      } else {
        launch(selected_logprob_bwd_kernel<T, false>, nullptr, nullptr);
      }
    }
  });
  check_launch("selected_logprob_bwd_kernel launch");
}

}  // namespace rlk_rocm
