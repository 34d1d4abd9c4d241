# rlk_rocm_architectures(<out_var> <hip_version>): the AMD GPU targets (--offload-arch) rlk-rocm compiles for.
#
# Default: the CDNA data-centre GPUs, all wavefront-64 (the kernels' warp size, portable.cuh):
#   gfx90a   MI200 (MI210, MI250, MI250X)
#   gfx942   MI300 (MI300X, MI300A, MI325X); ROCm >= 5.7. Older ROCm (Debian's 5.2) knows only gfx940,
#            the pre-production MI300 target, which is compiled instead there.
#
# Override: the CMake variable or the environment variable RLK_ROCM_ARCHS, a list such as "gfx90a" or
# "gfx90a;gfx942" (commas and spaces also separate). Only gfx9 (wavefront-64) targets are accepted: RDNA
# (gfx10xx / gfx11xx) runs wavefronts of 32, for which these kernels are not built.

function(rlk_rocm_architectures out_var hip_version)
  set(requested "${RLK_ROCM_ARCHS}")
  if(requested STREQUAL "" AND DEFINED ENV{RLK_ROCM_ARCHS})
    set(requested "$ENV{RLK_ROCM_ARCHS}")
  endif()
  string(REPLACE "," ";" requested "${requested}")
  string(REPLACE " " ";" requested "${requested}")
  set(archs "")
  if(NOT requested STREQUAL "")
    foreach(arch IN LISTS requested)
      if(arch STREQUAL "")
        continue()
      endif()
      if(NOT arch MATCHES "^gfx9[0-9a-f]+$")
        message(FATAL_ERROR "RLK_ROCM_ARCHS: '${arch}' is not a wavefront-64 gfx9 target like gfx90a or gfx942")
      endif()
      list(APPEND archs "${arch}")
    endforeach()
    message(STATUS "rlk: AMD GPU targets from RLK_ROCM_ARCHS: ${archs}")
  else()
    if(hip_version VERSION_GREATER_EQUAL "5.7")
      set(archs "gfx90a" "gfx942")
    else()
      set(archs "gfx90a" "gfx940")
    endif()
    message(STATUS "rlk: AMD GPU targets (default for HIP ${hip_version}): ${archs}")
  endif()
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()
