// The nanobind layer's part that rlk-cuda's and rlk-rocm's bindings.cpp share (single source; rlk-rocm reads
// it from here in a checkout, from csrc/shared in its sdist): the DLPack array checks, selected_logprob,
// linear_logprob (the GEMM-core launchers; rlk-cuda's Hopper ones reuse its checks) and rms_norm, and
// def_shared_ops(), which registers them. Tensors come through DLPack (no copy, no conversion:
// `.noconvert()`, the backend's device, C-contiguous); the launchers run on the stream the caller passes (an
// integer: a cudaStream_t / hipStream_t). The includer first includes its launchers header (rlk_cuda.h,
// rlk_rocm.h: both define RLK_NAMESPACE, the launchers' namespace, also the prefix of every error message, and
// declare launchers_common.h's DType, selected_logprob_*, linear_logprob_* and rms_norm_*) and defines
//   RLK_NB_DEVICE    nanobind's device tag of the arrays (nb::device::cuda, nb::device::rocm);
//   RLK_DEVICE_KIND  the device in error messages ("CUDA", "ROCm").
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#if !defined(RLK_NAMESPACE) || !defined(RLK_NB_DEVICE) || !defined(RLK_DEVICE_KIND)
#error "bindings_common.h: define RLK_NAMESPACE, RLK_NB_DEVICE and RLK_DEVICE_KIND first"
#endif

#define RLK_BINDINGS_STR2(x) #x
#define RLK_BINDINGS_STR(x) RLK_BINDINGS_STR2(x)
#define RLK_ERROR_PREFIX RLK_BINDINGS_STR(RLK_NAMESPACE) ": "

namespace nb = nanobind;
using RLK_NAMESPACE::DType;

namespace {

using Array = nb::ndarray<RLK_NB_DEVICE, nb::c_contig>;
using OptArray = std::optional<Array>;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(RLK_ERROR_PREFIX + message); }

std::string shape_of(const Array& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

DType float_dtype(const Array& a, const char* name) {
  const nb::dlpack::dtype d = a.dtype();
  if (d.lanes == 1 && d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 32) {
    return DType::kFloat32;
  }
  if (d.lanes == 1 && d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 16) {
    return DType::kFloat16;
  }
  if (d.lanes == 1 && d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) {
    return DType::kBFloat16;
  }
  fail(std::string(name) + ": expected dtype float32, float16 or bfloat16");
}

void expect_dtype(const Array& a, DType want, const char* name) {
  const DType got = float_dtype(a, name);
  if (got != want)
    fail(std::string(name) + ": expected dtype " + RLK_NAMESPACE::dtype_name(want) + ", got " +
         RLK_NAMESPACE::dtype_name(got));
}

void expect_int64(const Array& a, const char* name) {
  if (a.dtype() != nb::dtype<int64_t>()) fail(std::string(name) + ": expected dtype int64");
}

void expect_shape(const Array& a, std::initializer_list<int64_t> shape, const char* name) {
  bool ok = a.ndim() == shape.size();
  size_t i = 0;
  for (int64_t n : shape) ok = ok && i < a.ndim() && static_cast<int64_t>(a.shape(i++)) == n;
  if (!ok) {
    std::string want = "(";
    i = 0;
    for (int64_t n : shape) want += (i++ ? ", " : "") + std::to_string(n);
    fail(std::string(name) + ": expected shape " + want + (shape.size() == 1 ? ",)" : ")") + ", got " + shape_of(a));
  }
}

// Checks that `a` lives on `device`; returns its data pointer.
template <typename P = void>
P* on(const Array& a, int device, const char* name) {
  if (a.device_id() != device) {
    fail(std::string(name) + ": expected " RLK_DEVICE_KIND " device " + std::to_string(device) + ", got " +
         std::to_string(a.device_id()));
  }
  return static_cast<P*>(a.data());
}

template <typename P = void>
P* on(const OptArray& a, int device, const char* name) {
  return a ? on<P>(*a, device, name) : nullptr;
}

// ---- selected_logprob ------------------------------------------------------------------------

// logits [N, V] of a float dtype, targets int64 [N] and the fp32 [N] row vectors `rows`: the checks the
// forward and the backward share; returns (N, V, dtype, device).
struct LogitsRows {
  int64_t n, v;
  DType dtype;
  int device;
};

LogitsRows logits_rows(const Array& logits, const Array& targets,
                       std::initializer_list<std::pair<const Array*, const char*>> rows) {
  if (logits.ndim() != 2) fail("logits: expected shape [N, V], got " + shape_of(logits));
  const LogitsRows r{static_cast<int64_t>(logits.shape(0)), static_cast<int64_t>(logits.shape(1)),
                     float_dtype(logits, "logits"), logits.device_id()};
  expect_int64(targets, "targets");
  expect_shape(targets, {r.n}, "targets");
  for (auto [a, name] : rows) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {r.n}, name);
  }
  return r;
}

void selected_logprob_fwd(const Array& logits, const Array& targets, const Array& inv_temperature, int64_t ignore_index,
                          const Array& logprob_out, const OptArray& entropy_out, const Array& lse_out,
                          std::uintptr_t stream) {
  const auto [n, v, dtype, device] = logits_rows(
      logits, targets, {{&inv_temperature, "inv_temperature"}, {&logprob_out, "logprob_out"}, {&lse_out, "lse_out"}});
  if (entropy_out) {
    expect_dtype(*entropy_out, DType::kFloat32, "entropy_out");
    expect_shape(*entropy_out, {n}, "entropy_out");
  }
  RLK_NAMESPACE::selected_logprob_fwd(
      dtype, on(logits, device, "logits"), on<const int64_t>(targets, device, "targets"),
      on<const float>(inv_temperature, device, "inv_temperature"), n, v, ignore_index,
      on<float>(logprob_out, device, "logprob_out"), on<float>(entropy_out, device, "entropy_out"),
      on<float>(lse_out, device, "lse_out"), device, stream);
}

void selected_logprob_bwd(const Array& logits, const Array& targets, const Array& inv_temperature, const Array& lse,
                          const OptArray& entropy, const Array& grad_logprob, const OptArray& grad_entropy,
                          int64_t ignore_index, const Array& grad_logits_out, std::uintptr_t stream) {
  const auto [n, v, dtype, device] = logits_rows(
      logits, targets, {{&inv_temperature, "inv_temperature"}, {&lse, "lse"}, {&grad_logprob, "grad_logprob"}});
  for (auto [a, name] : {std::pair{&entropy, "entropy"}, {&grad_entropy, "grad_entropy"}}) {
    if (*a) {
      expect_dtype(**a, DType::kFloat32, name);
      expect_shape(**a, {n}, name);
    }
  }
  expect_dtype(grad_logits_out, dtype, "grad_logits_out");
  expect_shape(grad_logits_out, {n, v}, "grad_logits_out");
  RLK_NAMESPACE::selected_logprob_bwd(
      dtype, on(logits, device, "logits"), on<const int64_t>(targets, device, "targets"),
      on<const float>(inv_temperature, device, "inv_temperature"), on<const float>(lse, device, "lse"),
      on<const float>(entropy, device, "entropy"), on<const float>(grad_logprob, device, "grad_logprob"),
      on<const float>(grad_entropy, device, "grad_entropy"), n, v, ignore_index,
      on(grad_logits_out, device, "grad_logits_out"), device, stream);
}

// ---- rms_norm ----------------------------------------------------------------------------------

void rms_norm_fwd(const Array& x, const Array& weight, const OptArray& residual, double eps, bool gemma,
                  const Array& out, const OptArray& residual_out, const Array& rstd_out, std::uintptr_t stream) {
  if (x.ndim() != 2) fail("x: expected shape [N, H], got " + shape_of(x));
  const int64_t n = x.shape(0), h = x.shape(1);
  const DType x_dtype = float_dtype(x, "x");
  const int device = x.device_id();
  expect_shape(weight, {h}, "weight");
  const DType w_dtype = float_dtype(weight, "weight");
  expect_shape(out, {n, h}, "out");
  const DType y_dtype = float_dtype(out, "out");
  for (auto [a, name] : {std::pair{&residual, "residual"}, {&residual_out, "residual_out"}}) {
    if (*a) {
      expect_dtype(**a, x_dtype, name);
      expect_shape(**a, {n, h}, name);
    }
  }
  expect_dtype(rstd_out, DType::kFloat32, "rstd_out");
  expect_shape(rstd_out, {n}, "rstd_out");
  RLK_NAMESPACE::rms_norm_fwd(x_dtype, w_dtype, y_dtype, on(x, device, "x"), on(weight, device, "weight"),
                              on(residual, device, "residual"), n, h, static_cast<float>(eps), gemma,
                              on(out, device, "out"), on(residual_out, device, "residual_out"),
                              on<float>(rstd_out, device, "rstd_out"), device, stream);
}

void rms_norm_bwd(const Array& grad_out, const Array& s, const Array& weight, const Array& rstd, bool gemma,
                  const OptArray& grad_residual, const Array& grad_input_out, const OptArray& grad_weight_out,
                  const OptArray& partials, int rows_per_block, std::uintptr_t stream) {
  if (s.ndim() != 2) fail("s: expected shape [N, H], got " + shape_of(s));
  const int64_t n = s.shape(0), h = s.shape(1);
  const DType x_dtype = float_dtype(s, "s");
  const int device = s.device_id();
  expect_shape(grad_out, {n, h}, "grad_out");
  const DType y_dtype = float_dtype(grad_out, "grad_out");
  expect_shape(weight, {h}, "weight");
  const DType w_dtype = float_dtype(weight, "weight");
  expect_dtype(rstd, DType::kFloat32, "rstd");
  expect_shape(rstd, {n}, "rstd");
  if (grad_residual) {
    expect_dtype(*grad_residual, x_dtype, "grad_residual");
    expect_shape(*grad_residual, {n, h}, "grad_residual");
  }
  expect_dtype(grad_input_out, x_dtype, "grad_input_out");
  expect_shape(grad_input_out, {n, h}, "grad_input_out");
  if (grad_weight_out) {
    expect_dtype(*grad_weight_out, w_dtype, "grad_weight_out");
    expect_shape(*grad_weight_out, {h}, "grad_weight_out");
    if (!partials) fail("partials: required when grad_weight_out is given");
    expect_dtype(*partials, DType::kFloat32, "partials");
    expect_shape(*partials, {RLK_NAMESPACE::rms_norm_bwd_partial_rows(n, rows_per_block), h}, "partials");
  }
  RLK_NAMESPACE::rms_norm_bwd(
      x_dtype, w_dtype, y_dtype, on(grad_out, device, "grad_out"), on(s, device, "s"), on(weight, device, "weight"),
      on<const float>(rstd, device, "rstd"), on(grad_residual, device, "grad_residual"), n, h, gemma, rows_per_block,
      on(grad_input_out, device, "grad_input_out"), grad_weight_out ? on<float>(partials, device, "partials") : nullptr,
      on(grad_weight_out, device, "grad_weight_out"), device, stream);
}

// ---- linear_logprob --------------------------------------------------------------------------

// hidden [N, H] and weight [V, H] of one 16-bit dtype; returns (N, V, H, dtype, device) after the checks
// shared by the forward and the backward.
struct LinearShapes {
  int64_t n, v, h;
  DType dtype;
  int device;
};

LinearShapes linear_shapes(const Array& hidden, const Array& weight, const Array& targets,
                           const Array& inv_temperature) {
  if (hidden.ndim() != 2) fail("hidden: expected shape [N, H], got " + shape_of(hidden));
  if (weight.ndim() != 2) fail("weight: expected shape [V, H], got " + shape_of(weight));
  LinearShapes s{static_cast<int64_t>(hidden.shape(0)), static_cast<int64_t>(weight.shape(0)),
                 static_cast<int64_t>(hidden.shape(1)), float_dtype(hidden, "hidden"), hidden.device_id()};
  expect_dtype(weight, s.dtype, "weight");
  expect_shape(weight, {s.v, s.h}, "weight");
  expect_int64(targets, "targets");
  expect_shape(targets, {s.n}, "targets");
  expect_dtype(inv_temperature, DType::kFloat32, "inv_temperature");
  expect_shape(inv_temperature, {s.n}, "inv_temperature");
  return s;
}

void expect_f32_vector(const OptArray& a, int64_t n, const char* name) {
  if (a) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {n}, name);
  }
}

// The forward's checks (logits_out: the stored forward's fp32 [N, V] logits, optional), then
// launch(shapes, <the launchers' arguments>): the GEMM-core launcher linear_logprob_fwd, or rlk-cuda's Hopper ones.
template <typename Launch>
void linear_logprob_fwd_checked(Launch&& launch, const Array& hidden, const Array& weight, const Array& targets,
                                const Array& inv_temperature, int64_t ignore_index, const Array& logprob_out,
                                const OptArray& entropy_out, const Array& lse_out, const Array& part_m,
                                const Array& part_s, const OptArray& part_b, const Array& z_target,
                                std::uintptr_t stream, const OptArray& logits_out = std::nullopt) {
  const LinearShapes s = linear_shapes(hidden, weight, targets, inv_temperature);
  for (auto [a, name] : {std::pair{&logprob_out, "logprob_out"}, {&lse_out, "lse_out"}, {&z_target, "z_target"}}) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {s.n}, name);
  }
  expect_f32_vector(entropy_out, s.n, "entropy_out");
  const int64_t splits = RLK_NAMESPACE::linear_logprob_num_splits(s.v);
  for (auto [a, name] : {std::pair{&part_m, "part_m"}, {&part_s, "part_s"}}) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {splits, s.n}, name);
  }
  if (entropy_out && !part_b) fail("part_b: required when entropy_out is given");
  if (part_b) {
    expect_dtype(*part_b, DType::kFloat32, "part_b");
    expect_shape(*part_b, {splits, s.n}, "part_b");
  }
  if (logits_out) {
    expect_dtype(*logits_out, DType::kFloat32, "logits_out");
    expect_shape(*logits_out, {s.n, s.v}, "logits_out");
  }
  const int d = s.device;
  launch(s, s.dtype, on(hidden, d, "hidden"), on(weight, d, "weight"), on<const int64_t>(targets, d, "targets"),
         on<const float>(inv_temperature, d, "inv_temperature"), s.n, s.v, s.h, ignore_index,
         on<float>(logprob_out, d, "logprob_out"), on<float>(entropy_out, d, "entropy_out"),
         on<float>(lse_out, d, "lse_out"), on<float>(part_m, d, "part_m"), on<float>(part_s, d, "part_s"),
         on<float>(part_b, d, "part_b"), on<float>(z_target, d, "z_target"), d, stream);
}

void linear_logprob_fwd(const Array& hidden, const Array& weight, const Array& targets, const Array& inv_temperature,
                        int64_t ignore_index, const Array& logprob_out, const OptArray& entropy_out,
                        const Array& lse_out, const Array& part_m, const Array& part_s, const OptArray& part_b,
                        const Array& z_target, std::uintptr_t stream) {
  linear_logprob_fwd_checked([](const LinearShapes&, auto... args) { RLK_NAMESPACE::linear_logprob_fwd(args...); },
                             hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out,
                             part_m, part_s, part_b, z_target, stream);
}

// The backward's per-row inputs: lse, grad_logprob (and entropy, grad_entropy when given) fp32 [N].
void expect_bwd_rows(int64_t n, const Array& lse, const OptArray& entropy, const Array& grad_logprob,
                     const OptArray& grad_entropy) {
  for (auto [a, name] : {std::pair{&lse, "lse"}, {&grad_logprob, "grad_logprob"}}) {
    expect_dtype(*a, DType::kFloat32, name);
    expect_shape(*a, {n}, name);
  }
  expect_f32_vector(entropy, n, "entropy");
  expect_f32_vector(grad_entropy, n, "grad_entropy");
}

// The backward's checks, then launch(<the launchers' arguments>): linear_logprob_bwd, or rlk-cuda's Hopper one.
template <typename Launch>
void linear_logprob_bwd_checked(Launch&& launch, const Array& hidden, const Array& weight, const Array& targets,
                                const Array& inv_temperature, const Array& lse, const OptArray& entropy,
                                const Array& grad_logprob, const OptArray& grad_entropy, int64_t ignore_index,
                                const OptArray& grad_hidden_out, const OptArray& grad_weight_out,
                                const OptArray& g_scratch, const OptArray& grad_hidden_acc, std::uintptr_t stream) {
  const LinearShapes s = linear_shapes(hidden, weight, targets, inv_temperature);
  expect_bwd_rows(s.n, lse, entropy, grad_logprob, grad_entropy);
  if (grad_hidden_out) {
    expect_dtype(*grad_hidden_out, s.dtype, "grad_hidden_out");
    expect_shape(*grad_hidden_out, {s.n, s.h}, "grad_hidden_out");
  }
  if (grad_weight_out) {
    expect_dtype(*grad_weight_out, s.dtype, "grad_weight_out");
    expect_shape(*grad_weight_out, {s.v, s.h}, "grad_weight_out");
  }
  const int64_t g_cols = RLK_NAMESPACE::linear_logprob_bwd_chunk_cols(s.v);
  if (g_scratch) {
    expect_dtype(*g_scratch, s.dtype, "g_scratch");
    expect_shape(*g_scratch, {s.n, g_cols}, "g_scratch");
  } else if (grad_hidden_out || grad_weight_out) {
    fail("g_scratch: required when a gradient is requested");
  }
  if (grad_hidden_acc) {
    expect_dtype(*grad_hidden_acc, DType::kFloat32, "grad_hidden_acc");
    expect_shape(*grad_hidden_acc, {s.n, s.h}, "grad_hidden_acc");
  }
  const int d = s.device;
  launch(s.dtype, on(hidden, d, "hidden"), on(weight, d, "weight"), on<const int64_t>(targets, d, "targets"),
         on<const float>(inv_temperature, d, "inv_temperature"), on<const float>(lse, d, "lse"),
         on<const float>(entropy, d, "entropy"), on<const float>(grad_logprob, d, "grad_logprob"),
         on<const float>(grad_entropy, d, "grad_entropy"), s.n, s.v, s.h, ignore_index,
         on(grad_hidden_out, d, "grad_hidden_out"), on(grad_weight_out, d, "grad_weight_out"),
         on(g_scratch, d, "g_scratch"), g_cols, on<float>(grad_hidden_acc, d, "grad_hidden_acc"), d, stream);
}

void linear_logprob_bwd(const Array& hidden, const Array& weight, const Array& targets, const Array& inv_temperature,
                        const Array& lse, const OptArray& entropy, const Array& grad_logprob,
                        const OptArray& grad_entropy, int64_t ignore_index, const OptArray& grad_hidden_out,
                        const OptArray& grad_weight_out, const OptArray& g_scratch, const OptArray& grad_hidden_acc,
                        std::uintptr_t stream) {
  linear_logprob_bwd_checked([](auto... args) { RLK_NAMESPACE::linear_logprob_bwd(args...); }, hidden, weight, targets,
                             inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_hidden_out,
                             grad_weight_out, g_scratch, grad_hidden_acc, stream);
}

// Registers selected_logprob_*, linear_logprob_* (the GEMM-core kernels) and rms_norm_* on the module (both
// backends' entry points of rlk.abi).
void def_shared_ops(nb::module_& m) {
  m.def("selected_logprob_fwd", &selected_logprob_fwd, nb::arg("logits").noconvert(), nb::arg("targets").noconvert(),
        nb::arg("inv_temperature").noconvert(), nb::arg("ignore_index"), nb::arg("logprob_out").noconvert(),
        nb::arg("entropy_out").noconvert().none(), nb::arg("lse_out").noconvert(), nb::arg("stream"),
        "selected_logprob forward (rlk.abi): logprob, entropy (optional) and lse of each row.");
  m.def("selected_logprob_bwd", &selected_logprob_bwd, nb::arg("logits").noconvert(), nb::arg("targets").noconvert(),
        nb::arg("inv_temperature").noconvert(), nb::arg("lse").noconvert(), nb::arg("entropy").noconvert().none(),
        nb::arg("grad_logprob").noconvert(), nb::arg("grad_entropy").noconvert().none(), nb::arg("ignore_index"),
        nb::arg("grad_logits_out").noconvert(), nb::arg("stream"),
        "selected_logprob backward (rlk.abi): the gradient of the logits.");
  m.def("rms_norm_fwd", &rms_norm_fwd, nb::arg("x").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("residual").noconvert().none(), nb::arg("eps"), nb::arg("gemma"), nb::arg("out").noconvert(),
        nb::arg("residual_out").noconvert().none(), nb::arg("rstd_out").noconvert(), nb::arg("stream"),
        "rms_norm forward (rlk.abi): y, the new residual s (when fused) and rstd.");
  m.def("rms_norm_bwd", &rms_norm_bwd, nb::arg("grad_out").noconvert(), nb::arg("s").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("rstd").noconvert(), nb::arg("gemma"),
        nb::arg("grad_residual").noconvert().none(), nb::arg("grad_input_out").noconvert(),
        nb::arg("grad_weight_out").noconvert().none(), nb::arg("partials").noconvert().none(),
        nb::arg("rows_per_block"), nb::arg("stream"),
        "rms_norm backward (rlk.abi): the gradient of s and (optionally) of the weight; partials: fp32 "
        "[rms_norm_bwd_partial_rows(N, rows_per_block), H] scratch.");
  m.def("rms_norm_bwd_partial_rows", &RLK_NAMESPACE::rms_norm_bwd_partial_rows, nb::arg("n_rows"),
        nb::arg("rows_per_block"));
  m.def("linear_logprob_fwd", &linear_logprob_fwd, nb::arg("hidden").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(), nb::arg("ignore_index"),
        nb::arg("logprob_out").noconvert(), nb::arg("entropy_out").noconvert().none(), nb::arg("lse_out").noconvert(),
        nb::arg("part_m").noconvert(), nb::arg("part_s").noconvert(), nb::arg("part_b").noconvert().none(),
        nb::arg("z_target").noconvert(), nb::arg("stream"),
        "linear_logprob forward (rlk.abi), float16 / bfloat16: logprob, entropy (optional) and lse of each row of "
        "hidden @ weight.T. Scratch: part_m, part_s, part_b fp32 [linear_logprob_num_splits(V), N] (part_b only "
        "with entropy), z_target fp32 [N].");
  m.def("linear_logprob_bwd", &linear_logprob_bwd, nb::arg("hidden").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("targets").noconvert(), nb::arg("inv_temperature").noconvert(), nb::arg("lse").noconvert(),
        nb::arg("entropy").noconvert().none(), nb::arg("grad_logprob").noconvert(),
        nb::arg("grad_entropy").noconvert().none(), nb::arg("ignore_index"),
        nb::arg("grad_hidden_out").noconvert().none(), nb::arg("grad_weight_out").noconvert().none(),
        nb::arg("g_scratch").noconvert().none(), nb::arg("grad_hidden_acc").noconvert().none(), nb::arg("stream"),
        "linear_logprob backward (rlk.abi), float16 / bfloat16: the gradients of hidden and weight (each optional). "
        "Scratch: g_scratch [N, linear_logprob_bwd_chunk_cols(V)] of hidden's dtype; grad_hidden_acc fp32 [N, H] "
        "when grad_hidden_out is given and linear_logprob_bwd_num_chunks(V) > 1.");
  m.def("linear_logprob_num_splits", &RLK_NAMESPACE::linear_logprob_num_splits, nb::arg("vocab"));
  m.def("linear_logprob_bwd_chunk_cols", &RLK_NAMESPACE::linear_logprob_bwd_chunk_cols, nb::arg("vocab"));
  m.def("linear_logprob_bwd_num_chunks", &RLK_NAMESPACE::linear_logprob_bwd_num_chunks, nb::arg("vocab"));
}

}  // namespace
