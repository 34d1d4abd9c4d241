// Launchers of the linear_logprob GEMM-core kernels (linear_logprob.cuh over mma.cuh on CUDA, over mma_amd.cuh on
// ROCm): the argument checks, dtype dispatch, the forward's split kernel + combine, and the backward's chunk loop.
// Scratch buffers come from the caller (rlk_cuda/logprob.py, rlk_rocm/logprob.py allocate them with torch).
//
// Single source for both backends: compiled once per backend, by rlk-cuda's linear_logprob.cu (namespace rlk_cuda,
// CUDA runtime) and rlk-rocm's linear_logprob.hip (namespace rlk_rocm, HIP runtime; read from here in a checkout,
// from csrc/shared in its sdist). The includer first includes its launch header (launch.cuh / launch.h: RLK_NAMESPACE,
// require, DeviceGuard, allow_smem...) and linear_logprob.cuh. The kernels' tile sizes are the core's (mma::kBM,
// mma::kBN, mma::kThreads, mma::kSmemBytes of dynamic shared memory); the split and chunk sizes (kVocabSplit,
// kVocabChunk = 4096) are linear_logprob.cuh's, the same on both.
#pragma once

#include <string>

#ifndef RLK_NAMESPACE
#error "linear_logprob_launchers.h: include launch.cuh / launch.h (they define RLK_NAMESPACE) first"
#endif

namespace RLK_NAMESPACE {

using namespace rlk_cuda;  // the shared kernel bodies (a no-op in rlk_cuda itself)

int64_t linear_logprob_num_splits(int64_t vocab) { return linear_num_splits(vocab); }

int64_t linear_logprob_bwd_chunk_cols(int64_t vocab) {
  const int64_t padded = ceil_div(vocab, mma::kBN) * mma::kBN;
  return padded < kVocabChunk ? padded : kVocabChunk;
}

int64_t linear_logprob_bwd_num_chunks(int64_t vocab) { return ceil_div(vocab, kVocabChunk); }

void linear_logprob_fwd(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                        const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                        int64_t ignore_index, float* logprob_out, float* entropy_out, float* lse_out, float* part_m,
                        float* part_s, float* part_b, float* z_target, int device, std::uintptr_t stream) {
  check_linear_inputs("linear_logprob_fwd", hidden, weight, n_rows, vocab, hidden_size);
  require(part_m != nullptr && part_s != nullptr && z_target != nullptr,
          "linear_logprob_fwd: part_m, part_s and z_target are required");
  require(entropy_out == nullptr || part_b != nullptr, "linear_logprob_fwd: part_b is required with entropy_out");
  DeviceGuard guard(device);
  const auto s = as_stream(stream);
  const unsigned blocks = grid_of(ceil_div(n_rows, mma::kBM) * linear_num_splits(vocab), "linear_logprob_fwd");
  dispatch_half(dtype, "linear_logprob_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* h = static_cast<const T*>(hidden);
    const T* w = static_cast<const T*>(weight);
    if (entropy_out != nullptr) {
      allow_smem(mma::kSmemBytes, linear_logprob_fwd_kernel<T, true>,
                 "cudaFuncSetAttribute(linear_logprob_fwd_kernel)");
      linear_logprob_fwd_kernel<T, true><<<blocks, mma::kThreads, mma::kSmemBytes, s>>>(
          h, w, targets, inv_temperature, n_rows, vocab, hidden_size, ignore_index, part_m, part_s, part_b, z_target);
    } else {
      allow_smem(mma::kSmemBytes, linear_logprob_fwd_kernel<T, false>,
                 "cudaFuncSetAttribute(linear_logprob_fwd_kernel)");
      linear_logprob_fwd_kernel<T, false><<<blocks, mma::kThreads, mma::kSmemBytes, s>>>(
          h, w, targets, inv_temperature, n_rows, vocab, hidden_size, ignore_index, part_m, part_s, nullptr, z_target);
    }
  });
  check_launch("linear_logprob_fwd_kernel launch");
  linear_logprob_combine_kernel<<<grid_of(ceil_div(n_rows, kCombineThreads), "linear_logprob_fwd"), kCombineThreads, 0,
                                  s>>>(part_m, part_s, entropy_out != nullptr ? part_b : nullptr, z_target, targets,
                                       n_rows, vocab, ignore_index, logprob_out, entropy_out, lse_out);
  check_launch("linear_logprob_combine_kernel launch");
}

bool check_linear_bwd_args(const char* what, const void* hidden, const void* weight, int64_t n_rows, int64_t vocab,
                           int64_t hidden_size, const float* entropy, const float* grad_entropy,
                           const void* grad_hidden_out, const void* grad_weight_out, const void* g_scratch,
                           int64_t g_stride, const float* grad_hidden_acc) {
  const std::string w(what);
  check_linear_inputs(what, hidden, weight, n_rows, vocab, hidden_size);
  require((entropy == nullptr) == (grad_entropy == nullptr),
          w + ": entropy and grad_entropy must be both given or both None");
  if (grad_hidden_out == nullptr && grad_weight_out == nullptr) return false;
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  require(g_scratch != nullptr && host_aligned16(g_scratch), w + ": g_scratch is required (16-byte aligned)");
  require(g_stride == linear_logprob_bwd_chunk_cols(vocab),
          w + ": g_scratch must have linear_logprob_bwd_chunk_cols(vocab) columns");
  require(grad_hidden_out == nullptr || host_aligned16(grad_hidden_out),
          w + ": grad_hidden_out must be 16-byte aligned");
  require(grad_weight_out == nullptr || host_aligned16(grad_weight_out),
          w + ": grad_weight_out must be 16-byte aligned");
  require(
      grad_hidden_out == nullptr || n_chunks == 1 || (grad_hidden_acc != nullptr && host_aligned16(grad_hidden_acc)),
      w + ": grad_hidden_acc (fp32 [N, H]) is required with grad_hidden_out when V > 4096");
  return true;
}

AccumulateMode grad_hidden_mode(int64_t chunk, int64_t n_chunks) {
  if (n_chunks == 1) return AccumulateMode::kStore;
  if (chunk == 0) return AccumulateMode::kWrite;
  return chunk == n_chunks - 1 ? AccumulateMode::kAddStore : AccumulateMode::kAdd;
}

void linear_logprob_bwd(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                        const float* inv_temperature, const float* lse, const float* entropy, const float* grad_logprob,
                        const float* grad_entropy, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                        int64_t ignore_index, void* grad_hidden_out, void* grad_weight_out, void* g_scratch,
                        int64_t g_stride, float* grad_hidden_acc, int device, std::uintptr_t stream) {
  if (!check_linear_bwd_args("linear_logprob_bwd", hidden, weight, n_rows, vocab, hidden_size, entropy, grad_entropy,
                             grad_hidden_out, grad_weight_out, g_scratch, g_stride, grad_hidden_acc)) {
    return;
  }
  const int64_t n_chunks = linear_logprob_bwd_num_chunks(vocab);
  DeviceGuard guard(device);
  const auto s = as_stream(stream);
  const int64_t row_tiles = ceil_div(n_rows, mma::kBM);
  const int64_t h_tiles = ceil_div(hidden_size, mma::kBN);
  dispatch_half(dtype, "linear_logprob_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* h = static_cast<const T*>(hidden);
    const T* w = static_cast<const T*>(weight);
    T* g = static_cast<T*>(g_scratch);
    const bool has_ent = grad_entropy != nullptr;
    if (has_ent) {
      allow_smem(mma::kSmemBytes, linear_logprob_grad_logits_kernel<T, true>, "cudaFuncSetAttribute(grad_logits)");
    } else {
      allow_smem(mma::kSmemBytes, linear_logprob_grad_logits_kernel<T, false>, "cudaFuncSetAttribute(grad_logits)");
    }
    allow_smem(mma::kSmemBytes, linear_logprob_grad_hidden_kernel<T>, "cudaFuncSetAttribute(grad_hidden)");
    allow_smem(mma::kSmemBytes, linear_logprob_grad_weight_kernel<T>, "cudaFuncSetAttribute(grad_weight)");
    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
      const int64_t v_start = chunk * kVocabChunk;
      const int64_t cols = vocab - v_start < kVocabChunk ? vocab - v_start : kVocabChunk;
      const int64_t k_cols = ceil_div(cols, 8) * 8;  // G columns read by the GEMMs (zeros past cols)
      const unsigned gl_blocks = grid_of(row_tiles * ceil_div(cols, mma::kBN), "linear_logprob_bwd");
      if (has_ent) {
        linear_logprob_grad_logits_kernel<T, true><<<gl_blocks, mma::kThreads, mma::kSmemBytes, s>>>(
            h, w, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, n_rows, hidden_size, ignore_index,
            v_start, cols, g, g_stride);
      } else {
        linear_logprob_grad_logits_kernel<T, false><<<gl_blocks, mma::kThreads, mma::kSmemBytes, s>>>(
            h, w, targets, inv_temperature, lse, nullptr, grad_logprob, nullptr, n_rows, hidden_size, ignore_index,
            v_start, cols, g, g_stride);
      }
      check_launch("linear_logprob_grad_logits_kernel launch");
      if (grad_hidden_out != nullptr) {
        const AccumulateMode mode = grad_hidden_mode(chunk, n_chunks);
        linear_logprob_grad_hidden_kernel<T>
            <<<grid_of(row_tiles * h_tiles, "linear_logprob_bwd"), mma::kThreads, mma::kSmemBytes, s>>>(
                g, g_stride, w + v_start * hidden_size, cols, k_cols, n_rows, hidden_size, mode, grad_hidden_acc,
                static_cast<T*>(grad_hidden_out));
        check_launch("linear_logprob_grad_hidden_kernel launch");
      }
      if (grad_weight_out != nullptr) {
        linear_logprob_grad_weight_kernel<T>
            <<<grid_of(ceil_div(cols, mma::kBM) * h_tiles, "linear_logprob_bwd"), mma::kThreads, mma::kSmemBytes, s>>>(
                g, g_stride, h, cols, k_cols, n_rows, hidden_size,
                static_cast<T*>(grad_weight_out) + v_start * hidden_size);
        check_launch("linear_logprob_grad_weight_kernel launch");
      }
    }
  });
}

}  // namespace RLK_NAMESPACE
