// The launchers both backends implement, declared once (single source; rlk-rocm reads this file from here in
// a checkout, from csrc/shared in its sdist): the dtype tag, selected_logprob and rms_norm. Included by
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
