// The launchers both backends implement, declared once (single source; rlk-rocm reads this file from here in
// a checkout, from csrc/shared in its sdist): the dtype tag, selected_logprob, linear_logprob and rms_norm. Included by
// rlk_cuda.h and rlk-rocm's rlk_rocm.h after they define RLK_NAMESPACE (rlk_cuda, rlk_rocm), the namespace
// these are declared in; each header's own contract (device, stream, errors) applies.
#pragma once

#include <cstdint>

#ifndef RLK_NAMESPACE
#error "launchers_common.h: define RLK_NAMESPACE (rlk_cuda, rlk_rocm) first"
#endif

namespace RLK_NAMESPACE {

enum class DType { kFloat32, kFloat16, kBFloat16 };

const char* dtype_name(DType dtype);

// ---- selected_logprob ------------------------------------------------------------------------

// logits [n_rows, vocab] (dtype), targets [n_rows] int64, inv_temperature [n_rows] fp32;
// outputs logprob, entropy (nullable), lse: [n_rows] fp32.
void selected_logprob_fwd(DType dtype, const void* logits, const int64_t* targets, const float* inv_temperature,
                          int64_t n_rows, int64_t vocab, int64_t ignore_index, float* logprob_out, float* entropy_out,
                          float* lse_out, int device, std::uintptr_t stream);

// entropy and grad_entropy: both null (no entropy term) or both set; grad_logits [n_rows, vocab] (dtype).
void selected_logprob_bwd(DType dtype, const void* logits, const int64_t* targets, const float* inv_temperature,
                          const float* lse, const float* entropy, const float* grad_logprob, const float* grad_entropy,
                          int64_t n_rows, int64_t vocab, int64_t ignore_index, void* grad_logits_out, int device,
                          std::uintptr_t stream);

// ---- linear_logprob ----------------------------------------------------------------------------

// The GEMM-core kernels (linear_logprob.cuh over mma.cuh on CUDA, mma_amd.cuh on ROCm; launchers in
// linear_logprob_launchers.h). hidden [n_rows, hidden_size] and weight [vocab, hidden_size] of dtype (float16 or
// bfloat16 only: fp32 is not implemented here), 16-byte aligned, hidden_size a positive multiple of 8; targets [n_rows]
// int64, inv_temperature [n_rows] fp32; outputs logprob, entropy (nullable), lse: [n_rows] fp32. Scratch (fp32):
// part_m, part_s, part_b [linear_logprob_num_splits(vocab), n_rows] (part_b required with entropy_out, else ignored),
// z_target [n_rows].
void linear_logprob_fwd(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                        const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                        int64_t ignore_index, float* logprob_out, float* entropy_out, float* lse_out, float* part_m,
                        float* part_s, float* part_b, float* z_target, int device, std::uintptr_t stream);

// Vocab splits of the forward (ceil(vocab / 4096)).
int64_t linear_logprob_num_splits(int64_t vocab);
// Columns of the backward's G scratch: min(4096, vocab rounded up to 128).
int64_t linear_logprob_bwd_chunk_cols(int64_t vocab);
// Vocab chunks of the backward (ceil(vocab / 4096)).
int64_t linear_logprob_bwd_num_chunks(int64_t vocab);

// Same inputs as the forward plus lse [n_rows] fp32, entropy and grad_entropy [n_rows] fp32 (both null: no
// entropy term), grad_logprob [n_rows] fp32. Outputs (nullable, 16-byte aligned): grad_hidden_out
// [n_rows, hidden_size] and grad_weight_out [vocab, hidden_size] of dtype. Scratch: g_scratch
// [n_rows, g_stride] of dtype with g_stride = linear_logprob_bwd_chunk_cols(vocab); grad_hidden_acc fp32
// [n_rows, hidden_size], required with grad_hidden_out when linear_logprob_bwd_num_chunks(vocab) > 1.
void linear_logprob_bwd(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                        const float* inv_temperature, const float* lse, const float* entropy, const float* grad_logprob,
                        const float* grad_entropy, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                        int64_t ignore_index, void* grad_hidden_out, void* grad_weight_out, void* g_scratch,
                        int64_t g_stride, float* grad_hidden_acc, int device, std::uintptr_t stream);

// ---- rms_norm ----------------------------------------------------------------------------------

// x, residual (nullable), residual_out (null iff residual is) [n_rows, hidden] of x_dtype; weight [hidden]
// of w_dtype (x_dtype or fp32); out [n_rows, hidden] of y_dtype (x_dtype, or fp32 for a fp32 weight
// without gemma); rstd_out [n_rows] fp32.
void rms_norm_fwd(DType x_dtype, DType w_dtype, DType y_dtype, const void* x, const void* weight, const void* residual,
                  int64_t n_rows, int64_t hidden, float eps, bool gemma, void* out, void* residual_out, float* rstd_out,
                  int device, std::uintptr_t stream);

// Rows of the fp32 grad-weight partial buffer rms_norm_bwd needs: ceil(n_rows / rows_per_block).
int64_t rms_norm_bwd_partial_rows(int64_t n_rows, int rows_per_block);

// grad_out [n_rows, hidden] of y_dtype; s, grad_residual (nullable), grad_input_out [n_rows, hidden] of
// x_dtype; weight [hidden] of w_dtype; rstd [n_rows] fp32; grad_weight_out [hidden] of w_dtype (nullable);
// partials: fp32 [rms_norm_bwd_partial_rows(...), hidden] scratch, required when grad_weight_out is set.
void rms_norm_bwd(DType x_dtype, DType w_dtype, DType y_dtype, const void* grad_out, const void* s, const void* weight,
                  const float* rstd, const void* grad_residual, int64_t n_rows, int64_t hidden, bool gemma,
                  int rows_per_block, void* grad_input_out, float* partials, void* grad_weight_out, int device,
                  std::uintptr_t stream);

}  // namespace RLK_NAMESPACE
