# The CUDA part of the extension: handlers, the dispatch and every kernel
# instantiation. Included by cmake/cuda_kernels.cmake once CUDA is enabled and
# CMAKE_CUDA_ARCHITECTURES is set.

# cudart is linked statically so the module imports on a machine without a
# GPU or driver (the CUDA targets are then simply never called by XLA).
find_package(CUDAToolkit REQUIRED)

# The kernel instantiations (tensor-core: direction x arch path x dtype x
# head-dim bucket; exact: direction x dtype), one per file, generated from
# jax_flash/_supported.py, the one table of what is supported.
set(JAX_FLASH_CUDA_GEN_DIR "${CMAKE_CURRENT_BINARY_DIR}/generated/cuda")
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/jax_flash/_supported.py"
          --header "${JAX_FLASH_GEN_DIR}/jax_flash/supported.h"
          --cuda-sources "${JAX_FLASH_CUDA_GEN_DIR}"
  OUTPUT_VARIABLE _cuda_generated OUTPUT_STRIP_TRAILING_WHITESPACE
  COMMAND_ERROR_IS_FATAL ANY)
string(REPLACE "\n" ";" _cuda_generated "${_cuda_generated}")

add_library(jax_flash_cuda STATIC
  cpp/ffi/cuda_handlers.cc   # host C++; CUDA headers come with CUDA::cudart_static
  cpp/cuda/dispatch.cu
  ${_cuda_generated})
target_include_directories(jax_flash_cuda PRIVATE ${JAX_FLASH_INCLUDES})
if(XLA_FFI_INCLUDE_DIR)
  # Third-party headers: their warnings (-Wreturn-type in api.h) are not ours.
  target_include_directories(jax_flash_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
endif()
target_link_libraries(jax_flash_cuda PUBLIC CUDA::cudart_static)
set_target_properties(jax_flash_cuda PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION OFF
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON)
# IEEE arithmetic: no --use_fast_math (the exact kernels rely on accurate
# exp/log/tanh, division and infinities). -lineinfo costs nothing at run time
# and makes compute-sanitizer and profiler reports point at source lines.
target_compile_options(jax_flash_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 -lineinfo>)
# handlers.h declares the CUDA handlers (and what module.cc asks of them)
# under this definition; the library that defines them sees it too.
target_compile_definitions(jax_flash_cuda PRIVATE JAX_FLASH_WITH_CUDA=1)
# The Hopper (wgmma) kernels exist only in sm_90a code; the dispatch uses
# them when the build has it.
if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
  target_compile_definitions(jax_flash_cuda PRIVATE JAX_FLASH_HAS_SM90A=1)
endif()
