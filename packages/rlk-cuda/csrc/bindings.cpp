// The nanobind layer of rlk_cuda (module rlk_cuda._C): takes tensors through DLPack (no copy, no
// conversion: `.noconvert()`, CUDA, C-contiguous), checks dtypes, shapes and devices, and calls the
// launchers of rlk_cuda.h on the stream the caller passes (an integer: a cudaStream_t). No libtorch:
// any framework whose tensors speak DLPack works, and one wheel serves every torch version. The array
// checks, selected_logprob, rms_norm and the GEMM-core linear_logprob are bindings_common.h's (shared with
// rlk-rocm); the Hopper linear_logprob kernels and fused_linear_kl are here.
#include "rlk_cuda.h"

#define RLK_NB_DEVICE nb::device::cuda
#define RLK_DEVICE_KIND "CUDA"
#include "bindings_common.h"

#ifndef RLK_CUDA_VERSION
#define RLK_CUDA_VERSION "0+unknown"
#endif
#ifndef RLK_CUDA_DISTRIBUTION
#define RLK_CUDA_DISTRIBUTION "rlk-cuda"
#endif

namespace {

// ---- linear_logprob: the Hopper launchers (the checks and the GEMM-core entry points: bindings_common.h) ----

void linear_logprob_fwd_wgmma(const Array& hidden, const Array& weight, const Array& targets,
                              const Array& inv_temperature, int64_t ignore_index, const Array& logprob_out,
                              const OptArray& entropy_out, const Array& lse_out, const Array& part_m,
                              const Array& part_s, const OptArray& part_b, const Array& z_target,
                              std::uintptr_t stream) {
  linear_logprob_fwd_checked(
      [](const LinearShapes& s, auto... args) { rlk_cuda::linear_logprob_fwd_wgmma(args..., nullptr, s.v); }, hidden,
      weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, part_m, part_s, part_b,
      z_target, stream);
}

void linear_logprob_stored_fwd_wgmma(const Array& hidden, const Array& weight, const Array& targets,
                                     const Array& inv_temperature, int64_t ignore_index, const Array& logprob_out,
                                     const OptArray& entropy_out, const Array& lse_out, const Array& part_m,
                                     const Array& part_s, const OptArray& part_b, const Array& z_target,
                                     const Array& logits_out, std::uintptr_t stream) {
  linear_logprob_fwd_checked(
      [&](const LinearShapes& s, auto... args) {
        rlk_cuda::linear_logprob_fwd_wgmma(args..., on<float>(logits_out, s.device, "logits_out"), s.v);
      },
      hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, part_m, part_s, part_b,
      z_target, stream, logits_out);
}

void linear_logprob_bwd_wgmma(const Array& hidden, const Array& weight, const Array& targets,
                              const Array& inv_temperature, const Array& lse, const OptArray& entropy,
                              const Array& grad_logprob, const OptArray& grad_entropy, int64_t ignore_index,
                              const OptArray& grad_hidden_out, const OptArray& grad_weight_out,
                              const OptArray& g_scratch, const OptArray& grad_hidden_acc, std::uintptr_t stream) {
  linear_logprob_bwd_checked([](auto... args) { rlk_cuda::linear_logprob_bwd_wgmma(args...); }, hidden, weight, targets,
                             inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_hidden_out,
                             grad_weight_out, g_scratch, grad_hidden_acc, stream);
}

void linear_logprob_stored_bwd_wgmma(const Array& hidden, const Array& weight, const Array& targets,
                                     const Array& inv_temperature, const Array& lse, const OptArray& entropy,
                                     const Array& grad_logprob, const OptArray& grad_entropy, int64_t ignore_index,
                                     const Array& logits, const OptArray& grad_hidden_out,
                                     const OptArray& grad_weight_out, bool accumulate, const OptArray& grad_hidden_acc,
                                     std::uintptr_t stream) {
  const LinearShapes s = linear_shapes(hidden, weight, targets, inv_temperature);
  expect_bwd_rows(s.n, lse, entropy, grad_logprob, grad_entropy);
  expect_dtype(logits, DType::kFloat32, "logits");
  if (logits.ndim() != 2 || static_cast<int64_t>(logits.shape(0)) != s.n ||
      static_cast<int64_t>(logits.shape(1)) < s.v) {
    fail("logits: expected shape [N, S] with S >= V (columns past V unused), got " + shape_of(logits));
  }
  if (grad_hidden_out) {
    expect_dtype(*grad_hidden_out, s.dtype, "grad_hidden_out");
    expect_shape(*grad_hidden_out, {s.n, s.h}, "grad_hidden_out");
  }
  bool weight_fp32 = false;
  if (grad_weight_out) {
    weight_fp32 = float_dtype(*grad_weight_out, "grad_weight_out") == DType::kFloat32;
    if (!weight_fp32) expect_dtype(*grad_weight_out, s.dtype, "grad_weight_out");
    expect_shape(*grad_weight_out, {s.v, s.h}, "grad_weight_out");
  }
  if (grad_hidden_acc) {
    expect_dtype(*grad_hidden_acc, DType::kFloat32, "grad_hidden_acc");
    expect_shape(*grad_hidden_acc, {s.n, s.h}, "grad_hidden_acc");
  }
  const int d = s.device;
  rlk_cuda::linear_logprob_stored_bwd_wgmma(
      s.dtype, on(hidden, d, "hidden"), on(weight, d, "weight"), on<const int64_t>(targets, d, "targets"),
      on<const float>(inv_temperature, d, "inv_temperature"), on<const float>(lse, d, "lse"),
      on<const float>(entropy, d, "entropy"), on<const float>(grad_logprob, d, "grad_logprob"),
      on<const float>(grad_entropy, d, "grad_entropy"), s.n, s.v, s.h, ignore_index, on<float>(logits, d, "logits"),
      static_cast<int64_t>(logits.shape(1)), on(grad_hidden_out, d, "grad_hidden_out"),
      on(grad_weight_out, d, "grad_weight_out"), weight_fp32, accumulate,
      on<float>(grad_hidden_acc, d, "grad_hidden_acc"), d, stream);
}

// ---- fused_linear_kl ---------------------------------------------------------------------------

struct KlShapes {
  int64_t n, v, hs, ht;
  DType dtype;
  int device;
};

// The checks shared by the forward and the gradient: the two models' operands, targets, inv_temperature and the
// logits scratch zq, zp (fp32 [N, linear_logprob_bwd_chunk_cols(V)]).
KlShapes kl_shapes(const Array& student_hidden, const Array& student_weight, const Array& teacher_hidden,
                   const Array& teacher_weight, const OptArray& targets, const Array& inv_temperature, const Array& zq,
                   const Array& zp) {
  if (student_hidden.ndim() != 2) fail("student_hidden: expected shape [N, Hs], got " + shape_of(student_hidden));
  if (student_weight.ndim() != 2) fail("student_weight: expected shape [V, Hs], got " + shape_of(student_weight));
  if (teacher_hidden.ndim() != 2) fail("teacher_hidden: expected shape [N, Ht], got " + shape_of(teacher_hidden));
  KlShapes s{static_cast<int64_t>(student_hidden.shape(0)), static_cast<int64_t>(student_weight.shape(0)),
             static_cast<int64_t>(student_hidden.shape(1)), static_cast<int64_t>(teacher_hidden.shape(1)),
             float_dtype(student_hidden, "student_hidden"), student_hidden.device_id()};
  expect_dtype(student_weight, s.dtype, "student_weight");
  expect_shape(student_weight, {s.v, s.hs}, "student_weight");
  expect_dtype(teacher_hidden, s.dtype, "teacher_hidden");
  expect_shape(teacher_hidden, {s.n, s.ht}, "teacher_hidden");
  expect_dtype(teacher_weight, s.dtype, "teacher_weight");
  expect_shape(teacher_weight, {s.v, s.ht}, "teacher_weight");
  if (targets) {
    expect_int64(*targets, "targets");
    expect_shape(*targets, {s.n}, "targets");
  }
  expect_dtype(inv_temperature, DType::kFloat32, "inv_temperature");
  expect_shape(inv_temperature, {s.n}, "inv_temperature");
  const int64_t cols = rlk_cuda::linear_logprob_bwd_chunk_cols(s.v);
  for (auto [a, name] : {std::pair{&zq, "zq"}, {&zp, "zp"}}) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {s.n, cols}, name);
  }
  return s;
}

void fused_linear_kl_fwd_wgmma(const Array& student_hidden, const Array& student_weight, const Array& teacher_hidden,
                               const Array& teacher_weight, const OptArray& targets, const Array& inv_temperature,
                               int64_t ignore_index, int divergence, double beta, const Array& loss_out,
                               const Array& stats_out, const Array& zq, const Array& zp, const Array& state,
                               std::uintptr_t stream) {
  const KlShapes s =
      kl_shapes(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, inv_temperature, zq, zp);
  expect_dtype(loss_out, DType::kFloat32, "loss_out");
  expect_shape(loss_out, {s.n}, "loss_out");
  expect_dtype(stats_out, DType::kFloat32, "stats_out");
  expect_shape(stats_out, {3, s.n}, "stats_out");
  expect_dtype(state, DType::kFloat32, "state");
  expect_shape(state, {5, s.n}, "state");
  const int d = s.device;
  rlk_cuda::fused_linear_kl_fwd_wgmma(
      s.dtype, on(student_hidden, d, "student_hidden"), on(student_weight, d, "student_weight"),
      on(teacher_hidden, d, "teacher_hidden"), on(teacher_weight, d, "teacher_weight"),
      on<const int64_t>(targets, d, "targets"), on<const float>(inv_temperature, d, "inv_temperature"), s.n, s.v, s.hs,
      s.ht, ignore_index, divergence, static_cast<float>(beta), on<float>(loss_out, d, "loss_out"),
      on<float>(stats_out, d, "stats_out"), on<float>(zq, d, "zq"), on<float>(zp, d, "zp"),
      static_cast<int64_t>(zq.shape(1)), on<float>(state, d, "state"), d, stream);
}

void fused_linear_kl_grad_wgmma(const Array& student_hidden, const Array& student_weight, const Array& teacher_hidden,
                                const Array& teacher_weight, const OptArray& targets, const Array& inv_temperature,
                                const Array& stats, const Array& coef, int64_t ignore_index, int divergence,
                                double beta, const OptArray& grad_hidden_out, const OptArray& grad_weight_out,
                                const Array& zq, const Array& zp, const OptArray& grad_hidden_acc,
                                std::uintptr_t stream) {
  const KlShapes s =
      kl_shapes(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, inv_temperature, zq, zp);
  expect_dtype(stats, DType::kFloat32, "stats");
  expect_shape(stats, {3, s.n}, "stats");
  expect_dtype(coef, DType::kFloat32, "coef");
  expect_shape(coef, {s.n}, "coef");
  if (grad_hidden_out) {
    expect_dtype(*grad_hidden_out, s.dtype, "grad_hidden_out");
    expect_shape(*grad_hidden_out, {s.n, s.hs}, "grad_hidden_out");
  }
  if (grad_weight_out) {
    expect_dtype(*grad_weight_out, s.dtype, "grad_weight_out");
    expect_shape(*grad_weight_out, {s.v, s.hs}, "grad_weight_out");
  }
  if (grad_hidden_acc) {
    expect_dtype(*grad_hidden_acc, DType::kFloat32, "grad_hidden_acc");
    expect_shape(*grad_hidden_acc, {s.n, s.hs}, "grad_hidden_acc");
  }
  const int d = s.device;
  rlk_cuda::fused_linear_kl_grad_wgmma(
      s.dtype, on(student_hidden, d, "student_hidden"), on(student_weight, d, "student_weight"),
      on(teacher_hidden, d, "teacher_hidden"), on(teacher_weight, d, "teacher_weight"),
      on<const int64_t>(targets, d, "targets"), on<const float>(inv_temperature, d, "inv_temperature"),
      on<const float>(stats, d, "stats"), on<const float>(coef, d, "coef"), s.n, s.v, s.hs, s.ht, ignore_index,
      divergence, static_cast<float>(beta), on(grad_hidden_out, d, "grad_hidden_out"),
      on(grad_weight_out, d, "grad_weight_out"), on<float>(zq, d, "zq"), on<float>(zp, d, "zp"),
      static_cast<int64_t>(zq.shape(1)), on<float>(grad_hidden_acc, d, "grad_hidden_acc"), d, stream);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "rlk CUDA kernels (nanobind layer; tensors through DLPack, caller-allocated outputs, explicit stream)";
  m.attr("__version__") = RLK_CUDA_VERSION;
  m.attr("distribution") = RLK_CUDA_DISTRIBUTION;

  def_shared_ops(m);
  m.def("linear_logprob_fwd_wgmma", &linear_logprob_fwd_wgmma, nb::arg("hidden").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(),
        nb::arg("ignore_index"), nb::arg("logprob_out").noconvert(), nb::arg("entropy_out").noconvert().none(),
        nb::arg("lse_out").noconvert(), nb::arg("part_m").noconvert(), nb::arg("part_s").noconvert(),
        nb::arg("part_b").noconvert().none(), nb::arg("z_target").noconvert(), nb::arg("stream"),
        "Hopper (sm_90a) linear_logprob forward: TMA + wgmma, warp-specialized. Same arguments and "
        "scratch as linear_logprob_fwd; raises RuntimeError where linear_logprob_wgmma_problem(device) is not ''.");
  m.def("linear_logprob_stored_fwd_wgmma", &linear_logprob_stored_fwd_wgmma, nb::arg("hidden").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(),
        nb::arg("ignore_index"), nb::arg("logprob_out").noconvert(), nb::arg("entropy_out").noconvert().none(),
        nb::arg("lse_out").noconvert(), nb::arg("part_m").noconvert(), nb::arg("part_s").noconvert(),
        nb::arg("part_b").noconvert().none(), nb::arg("z_target").noconvert(), nb::arg("logits_out").noconvert(),
        nb::arg("stream"),
        "linear_logprob_fwd_wgmma that also writes the scaled logits z it reduces into logits_out (fp32 [N, V], "
        "C-contiguous): linear_logprob_stored_fwd (rlk.abi). Its other outputs are linear_logprob_fwd_wgmma's bits.");
  m.def(
      "linear_logprob_stored_bwd_wgmma", &linear_logprob_stored_bwd_wgmma, nb::arg("hidden").noconvert(),
      nb::arg("weight").noconvert(), nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(),
      nb::arg("lse").noconvert(), nb::arg("entropy").noconvert().none(), nb::arg("grad_logprob").noconvert(),
      nb::arg("grad_entropy").noconvert().none(), nb::arg("ignore_index"), nb::arg("logits").noconvert(),
      nb::arg("grad_hidden_out").noconvert().none(), nb::arg("grad_weight_out").noconvert().none(),
      nb::arg("accumulate"), nb::arg("grad_hidden_acc").noconvert().none(), nb::arg("stream"),
      "linear_logprob_stored_bwd (rlk.abi) on Hopper: G from the stored logits (fp32 [N, S], C-contiguous, "
      "S >= V, S % 4 == 0, z in the first V columns), written over them, then the chunk GEMMs of linear_logprob_bwd_wgmma. grad_weight_out: "
      "hidden's dtype, or fp32 (with accumulate: added to its contents). grad_hidden_acc: fp32 [N, H] when "
      "grad_hidden_out is given and linear_logprob_bwd_num_chunks(V) > 1.");
  m.def("linear_logprob_wgmma_problem", &rlk_cuda::linear_logprob_wgmma_problem, nb::arg("device"),
        "'' if the wgmma forward can run on the device (sm_90a compiled in, compute capability 9.0), else why not.");
  m.def("linear_logprob_bwd_wgmma", &linear_logprob_bwd_wgmma, nb::arg("hidden").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(),
        nb::arg("lse").noconvert(), nb::arg("entropy").noconvert().none(), nb::arg("grad_logprob").noconvert(),
        nb::arg("grad_entropy").noconvert().none(), nb::arg("ignore_index"),
        nb::arg("grad_hidden_out").noconvert().none(), nb::arg("grad_weight_out").noconvert().none(),
        nb::arg("g_scratch").noconvert().none(), nb::arg("grad_hidden_acc").noconvert().none(), nb::arg("stream"),
        "Hopper (sm_90a) linear_logprob backward: the chunk GEMMs on TMA + wgmma. Same arguments and scratch as "
        "linear_logprob_bwd; raises RuntimeError where linear_logprob_wgmma_problem(device) is not ''.");
  m.def("fused_linear_kl_fwd_wgmma", &fused_linear_kl_fwd_wgmma, nb::arg("student_hidden").noconvert(),
        nb::arg("student_weight").noconvert(), nb::arg("teacher_hidden").noconvert(),
        nb::arg("teacher_weight").noconvert(), nb::arg("targets").noconvert().none(),
        nb::arg("inv_temperature").noconvert(), nb::arg("ignore_index"), nb::arg("divergence"), nb::arg("beta"),
        nb::arg("loss_out").noconvert(), nb::arg("stats_out").noconvert(), nb::arg("zq").noconvert(),
        nb::arg("zp").noconvert(), nb::arg("state").noconvert(), nb::arg("stream"),
        "fused_linear_kl forward on Hopper (sm_90a), float16 / bfloat16: per-row loss_out [N] and stats_out [3, N] "
        "(fp32). divergence: 0 forward_kl, 1 reverse_kl, 2 jsd. Scratch: zq, zp fp32 [N, "
        "linear_logprob_bwd_chunk_cols(V)], state fp32 [5, N].");
  m.def("fused_linear_kl_grad_wgmma", &fused_linear_kl_grad_wgmma, nb::arg("student_hidden").noconvert(),
        nb::arg("student_weight").noconvert(), nb::arg("teacher_hidden").noconvert(),
        nb::arg("teacher_weight").noconvert(), nb::arg("targets").noconvert().none(),
        nb::arg("inv_temperature").noconvert(), nb::arg("stats").noconvert(), nb::arg("coef").noconvert(),
        nb::arg("ignore_index"), nb::arg("divergence"), nb::arg("beta"), nb::arg("grad_hidden_out").noconvert().none(),
        nb::arg("grad_weight_out").noconvert().none(), nb::arg("zq").noconvert(), nb::arg("zp").noconvert(),
        nb::arg("grad_hidden_acc").noconvert().none(), nb::arg("stream"),
        "fused_linear_kl gradients of sum_i coef_i loss_i on Hopper from the forward's stats: grad_hidden_out "
        "[N, Hs] and grad_weight_out [V, Hs] in the inputs' dtype (each optional). Scratch: zq, zp as the forward's; "
        "grad_hidden_acc fp32 [N, Hs] when grad_hidden_out is given and linear_logprob_bwd_num_chunks(V) > 1.");

  m.def("runtime_version", &rlk_cuda::runtime_version, "CUDA runtime version built in (static), e.g. 13000.");
  m.def("driver_version", &rlk_cuda::driver_version, "Newest CUDA version the driver supports; 0: no driver.");
  m.def("device_count", &rlk_cuda::device_count);
  m.def("compiled_architectures", &rlk_cuda::compiled_architectures);
  m.def("device_problem", &rlk_cuda::device_problem, nb::arg("device"),
        "'' if the kernels can run on the device, else why not.");
}
