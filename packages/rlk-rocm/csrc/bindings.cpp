// The nanobind layer of rlk_rocm (module rlk_rocm._C): rlk-cuda's bindings_common.h (the DLPack array
// checks, selected_logprob, linear_logprob and rms_norm; read from ../rlk-cuda/csrc in a checkout, csrc/shared in
// the sdist)
// on ROCm devices, calling the launchers of rlk_rocm.h on the stream the caller passes (an integer: a
// hipStream_t), and the probe's build and device facts. No libtorch: one wheel serves every torch version of
// its ROCm major.
#include "rlk_rocm.h"

#define RLK_NB_DEVICE nb::device::rocm
#define RLK_DEVICE_KIND "ROCm"
#include "bindings_common.h"

#ifndef RLK_ROCM_VERSION
#define RLK_ROCM_VERSION "0+unknown"
#endif
#ifndef RLK_ROCM_DISTRIBUTION
#define RLK_ROCM_DISTRIBUTION "rlk-rocm"
#endif

NB_MODULE(_C, m) {
  m.doc() = "rlk HIP kernels (nanobind layer; tensors through DLPack, caller-allocated outputs, explicit stream)";
  m.attr("__version__") = RLK_ROCM_VERSION;
  m.attr("distribution") = RLK_ROCM_DISTRIBUTION;

  def_shared_ops(m);

  m.def("runtime_version", &rlk_rocm::runtime_version, "HIP version built with (HIP_VERSION), e.g. 50221153.");
  m.def("device_count", &rlk_rocm::device_count, "HIP devices visible; 0: none (or no usable runtime).");
  m.def("compiled_architectures", &rlk_rocm::compiled_architectures, "GPU targets compiled in, e.g. ['gfx90a'].");
  m.def("device_arch", &rlk_rocm::device_arch, nb::arg("device"),
        "The device's gcnArchName ('gfx90a:sramecc+:xnack-').");
  m.def("device_problem", &rlk_rocm::device_problem, nb::arg("device"),
        "'' if the kernels can run on the device, else why not.");
}
