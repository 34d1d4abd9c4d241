// The host interface of the rlk CUDA kernels: plain C++ (raw device pointers, sizes, a stream
// handle), no Python and no CUDA headers, so the nanobind layer (bindings.cpp) compiles with the
// host compiler alone. Every launcher:
// * runs on CUDA device `device` (made current for the call, then restored) and on `stream`
//   (a cudaStream_t passed as an integer: torch.cuda.current_stream().cuda_stream);
// * writes caller-allocated outputs only (destination passing) and allocates nothing;
// * throws std::invalid_argument for bad sizes and std::runtime_error when a launch fails.
// Pointers marked "nullable" may be null (an absent optional tensor). Math, shapes and dtypes:
// the ABI text in rlk/abi.py and the specs in rlk/reference/{logprob,norm,distill}.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// DType, selected_logprob_*, rms_norm_* and linear_logprob_* (the GEMM-core launchers): launchers_common.h
// (shared with rlk-rocm).
#define RLK_NAMESPACE rlk_cuda
#include "launchers_common.h"

namespace rlk_cuda {

// ---- linear_logprob (the mma.sync launchers: launchers_common.h) -------------------------------

// Hopper forward (csrc/linear_logprob_wgmma.cu: TMA + wgmma, warp-specialized), chosen by rlk_cuda/logprob.py:
// the same arguments, scratch and results contract as linear_logprob_fwd (not the same bits). Throws
// std::runtime_error when linear_logprob_wgmma_problem(device) is not empty. With logits_out (fp32, row stride
// logits_stride >= vocab) it also stores the scaled logits z it reduces (linear_logprob_stored_fwd; its other
// outputs are the same bits as without).
void linear_logprob_fwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                              const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t hidden_size,
                              int64_t ignore_index, float* logprob_out, float* entropy_out, float* lse_out,
                              float* part_m, float* part_s, float* part_b, float* z_target, int device,
                              std::uintptr_t stream, float* logits_out = nullptr, int64_t logits_stride = 0);

// Hopper backward from the stored logits (linear_logprob_stored_bwd): G = d loss / d z from logits [n_rows,
// logits_stride] fp32 (the forward's z), written in place as dtype with row stride 2 logits_stride (the first half
// of each row's bytes; logits_stride % 4 == 0, 16-byte aligned), then linear_logprob_bwd_wgmma's GEMMs 2 and 3 per
// vocab chunk. grad_weight_out: dtype (stored) or fp32 (grad_weight_fp32; with accumulate, added to its contents).
void linear_logprob_stored_bwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                                     const float* inv_temperature, const float* lse, const float* entropy,
                                     const float* grad_logprob, const float* grad_entropy, int64_t n_rows,
                                     int64_t vocab, int64_t hidden_size, int64_t ignore_index, float* logits,
                                     int64_t logits_stride, void* grad_hidden_out, void* grad_weight_out,
                                     bool grad_weight_fp32, bool accumulate, float* grad_hidden_acc, int device,
                                     std::uintptr_t stream);
// Hopper backward (csrc/linear_logprob_wgmma.cu: the three GEMMs of each vocab chunk on a TMA + wgmma tile
// GEMM): the same arguments, scratch and results contract as linear_logprob_bwd (not the same bits). Throws
// std::runtime_error when linear_logprob_wgmma_problem(device) is not empty.
void linear_logprob_bwd_wgmma(DType dtype, const void* hidden, const void* weight, const int64_t* targets,
                              const float* inv_temperature, const float* lse, const float* entropy,
                              const float* grad_logprob, const float* grad_entropy, int64_t n_rows, int64_t vocab,
                              int64_t hidden_size, int64_t ignore_index, void* grad_hidden_out, void* grad_weight_out,
                              void* g_scratch, int64_t g_stride, float* grad_hidden_acc, int device,
                              std::uintptr_t stream);
// "" if the wgmma kernels can run on `device` (sm_90a compiled in and a compute capability 9.0 GPU), else why not.
std::string linear_logprob_wgmma_problem(int device);

// ---- fused_linear_kl (csrc/distill.cu; Hopper kernels only) ----------------------------------------

// Student hidden [n_rows, student_size] and head [vocab, student_size], teacher hidden [n_rows, teacher_size] and
// head [vocab, teacher_size], all of dtype (float16 / bfloat16), 16-byte aligned, sizes multiples of 8; targets
// [n_rows] int64 (nullable: every row counts), inv_temperature [n_rows] fp32; divergence 0 forward_kl, 1
// reverse_kl, 2 jsd (0 < beta < 1). Outputs: loss_out [n_rows] fp32 (0 on ignored rows), stats_out [3, n_rows] fp32
// (lse of the student, lse of the teacher, the gradient's row constant). Scratch: zq, zp [n_rows, z_stride] fp32
// with z_stride = linear_logprob_bwd_chunk_cols(vocab), state [5, n_rows] fp32. Throws std::runtime_error when
// linear_logprob_wgmma_problem(device) is not empty.
void fused_linear_kl_fwd_wgmma(DType dtype, const void* student_hidden, const void* student_weight,
                               const void* teacher_hidden, const void* teacher_weight, const int64_t* targets,
                               const float* inv_temperature, int64_t n_rows, int64_t vocab, int64_t student_size,
                               int64_t teacher_size, int64_t ignore_index, int divergence, float beta, float* loss_out,
                               float* stats_out, float* zq, float* zp, int64_t z_stride, float* state, int device,
                               std::uintptr_t stream);

// The gradients of sum_i coef_i loss_i (coef [n_rows] fp32) from the forward's stats: grad_hidden_out [n_rows,
// student_size] and grad_weight_out [vocab, student_size] of dtype (each nullable, 16-byte aligned). Same inputs
// and logits scratch as the forward (zq also holds each chunk's G); grad_hidden_acc fp32 [n_rows, student_size],
// required with grad_hidden_out when linear_logprob_bwd_num_chunks(vocab) > 1.
void fused_linear_kl_grad_wgmma(DType dtype, const void* student_hidden, const void* student_weight,
                                const void* teacher_hidden, const void* teacher_weight, const int64_t* targets,
                                const float* inv_temperature, const float* stats, const float* coef, int64_t n_rows,
                                int64_t vocab, int64_t student_size, int64_t teacher_size, int64_t ignore_index,
                                int divergence, float beta, void* grad_hidden_out, void* grad_weight_out, float* zq,
                                float* zp, int64_t z_stride, float* grad_hidden_acc, int device, std::uintptr_t stream);

// ---- build and device facts (for the backend's probe) -------------------------------------------

// CUDA runtime version this module was built with (statically linked), e.g. 13000.
int runtime_version();
// Newest CUDA version the installed driver supports (0: no usable driver, e.g. libcuda.so.1 absent).
int driver_version();
// Number of CUDA devices (0 when there is no driver or no device).
int device_count();
// Architectures compiled into this module, as CMake wrote them ("80-real", "90a-real", ...).
std::vector<std::string> compiled_architectures();
// "" if the kernels can run on `device`, else why not (no kernel image for its architecture, ...).
std::string device_problem(int device);

}  // namespace rlk_cuda
