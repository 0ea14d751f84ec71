# Tensor-core (bf16/fp16) FlashAttention-2 kernels, included by
# cmake/cuda_sources.cmake. The instantiation files (one per direction x
# dtype x head-dim bucket) and the bucket list are generated from
# jax_flash/_supported.py, the one table of what is supported.
set(JAX_FLASH_TC_GEN_DIR "${CMAKE_CURRENT_BINARY_DIR}/generated/tc")
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/jax_flash/_supported.py"
          --header "${JAX_FLASH_GEN_DIR}/jax_flash/supported.h"
          --tc-sources "${JAX_FLASH_TC_GEN_DIR}"
  OUTPUT_VARIABLE _tc_generated OUTPUT_STRIP_TRAILING_WHITESPACE
  COMMAND_ERROR_IS_FATAL ANY)
string(REPLACE "\n" ";" _tc_generated "${_tc_generated}")

set(JAX_FLASH_TC_SOURCES ${_tc_generated}
    "${CMAKE_CURRENT_SOURCE_DIR}/cpp/cuda/tc/tc_dispatch.cu")
# The kernels include "tc/..." from cpp/cuda and "tc_buckets.inc" from the
# generated folder.
list(APPEND JAX_FLASH_INCLUDES "${CMAKE_CURRENT_SOURCE_DIR}/cpp/cuda" "${JAX_FLASH_TC_GEN_DIR}")
