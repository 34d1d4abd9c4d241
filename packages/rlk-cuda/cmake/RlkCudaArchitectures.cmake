# rlk_cuda_architectures(<out_var>): the CUDA architectures rlk's native packages compile for, as a
# CMake CUDA_ARCHITECTURES list. Call it after enable_language(CUDA) (it reads the compiler version).
#
# Default (wheels): every architecture the toolkit has from this list, machine code only, plus PTX
# of the newest one so that GPUs newer than the toolkit can JIT-compile the kernels:
#   80-real    A100 (and by binary compatibility every 8.x GPU: A10, L4, L40, RTX 30xx/40xx)
#   90a-real   H100 / H200 (Hopper, arch-specific target: wgmma, setmaxnreg)
#   100-real   B200 / GB200 (CUDA >= 12.8)
#   120-real   RTX 50xx / RTX PRO Blackwell (CUDA >= 12.8)
#
# Override: the CMake variable or the environment variable RLK_CUDA_ARCHS, a list such as "90a" or
# "80;90a" (entries without -real / -virtual get -real: machine code only). CI compiles "90a" alone.

function(rlk_cuda_architectures out_var)
  if(NOT CMAKE_CUDA_COMPILER_VERSION)
    message(FATAL_ERROR "rlk_cuda_architectures: call enable_language(CUDA) first")
  endif()
  set(requested "${RLK_CUDA_ARCHS}")
  if(requested STREQUAL "" AND DEFINED ENV{RLK_CUDA_ARCHS})
    set(requested "$ENV{RLK_CUDA_ARCHS}")
  endif()
  string(REPLACE "," ";" requested "${requested}")
  string(REPLACE " " ";" requested "${requested}")

  set(archs "")
  if(NOT requested STREQUAL "")
    foreach(arch IN LISTS requested)
      if(arch STREQUAL "")
        continue()
      endif()
      string(REGEX REPLACE "^sm_" "" arch "${arch}")
      if(NOT arch MATCHES "^[0-9]+[af]?(-real|-virtual)?$")
        message(FATAL_ERROR "RLK_CUDA_ARCHS: '${arch}' is not an architecture like 80, 90a or 120-virtual")
      endif()
      if(NOT arch MATCHES "-(real|virtual)$")
        set(arch "${arch}-real")
      endif()
      list(APPEND archs "${arch}")
    endforeach()
    message(STATUS "rlk: CUDA architectures from RLK_CUDA_ARCHS: ${archs}")
  else()
    set(archs "80-real" "90a-real")
    set(newest "90")
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL "12.8")
      list(APPEND archs "100-real" "120-real")
      set(newest "120")
    endif()
    list(APPEND archs "${newest}-virtual")
    message(STATUS "rlk: CUDA architectures (default for CUDA ${CMAKE_CUDA_COMPILER_VERSION}): ${archs}")
  endif()
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()
