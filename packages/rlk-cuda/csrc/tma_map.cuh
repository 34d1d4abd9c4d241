// Host side of the Hopper kernels' TMA operands: cuTensorMapEncodeTiled, fetched from the driver at run time,
// and the one tensor-map shape every wgmma kernel here uses (a row-major 16-bit matrix, 64-column boxes, 128-byte
// swizzle). Shared by linear_logprob_wgmma.cu and distill.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "wgmma_gemm.cuh"

namespace rlk_cuda {

// cuTensorMapEncodeTiled (driver API, CUDA >= 12.0), fetched at run time through the runtime's entry
// point query: the module links only the static cudart, never libcuda (the driver's libcuda.so.1 is
// loaded by cudart itself).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
      cudaGetLastError();
      throw std::runtime_error(std::string("rlk_cuda: cuTensorMapEncodeTiled not available from the driver (") +
                               cudaGetErrorName(err) + ")");
    }
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// A 2-D tensor map over a row-major [rows, cols] 16-bit matrix (cols contiguous, `row_stride` >= cols
// elements between rows), box [box_rows, 64 columns], 128-byte swizzle, out-of-bounds elements (columns
// >= cols, rows >= rows) read as zero.
// cuTensorMapEncodeTiled's requirements (CUDA driver API reference): global address 16-byte aligned, the
// row stride a multiple of 16 bytes (row_stride % 8 == 0), every box dimension <= 256, the inner box extent
// in bytes (64 x 2 = 128) a multiple of 16 and, with SWIZZLE_128B, <= 128.
inline CUtensorMap make_map(CUtensorMapDataType dtype, const void* ptr, int64_t rows, int64_t cols, int64_t row_stride,
                            uint32_t box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};  // bytes between rows (dimension 1)
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(wggemm::kBK), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult res = encode_tiled()(&map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, element_strides,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("rlk_cuda: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(res) + ") for a [" +
                             std::to_string(rows) + ", " + std::to_string(cols) + "] tensor");
  }
  return map;
}

// The tensor-map element type of the 16-bit T (__nv_bfloat16 or __half).
template <typename T>
CUtensorMapDataType tma_dtype() {
  return std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

}  // namespace rlk_cuda
