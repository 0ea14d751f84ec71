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

# Which architectures compile which files: the exact kernels, the dispatch
# and the handlers every listed one; the sm80/sm90 tensor-core files those of
# sm_80 and later (cp.async, bf16 mma: not on sm_75); the Turing family's
# (*_sm75_*) 75 alone, when 75 is listed. Hopper's wgmma code exists only in
# the sm_90a pass (its kernels are empty elsewhere).
set(_tc_sources "")
set(_sm75_sources "")
set(_exact_sources "")
foreach(_file IN LISTS _cuda_generated)
  get_filename_component(_name "${_file}" NAME)
  if(_name MATCHES "_sm75_")
    list(APPEND _sm75_sources "${_file}")
  elseif(_name MATCHES "_sm(80|90)_")
    list(APPEND _tc_sources "${_file}")
  else()
    list(APPEND _exact_sources "${_file}")
  endif()
endforeach()
set(_tc_archs "")
foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
  string(REGEX MATCH "^[0-9]+" _number "${_arch}")
  if(_number GREATER_EQUAL 80)
    list(APPEND _tc_archs "${_arch}")
  endif()
endforeach()

add_library(jax_flash_cuda STATIC
  cpp/ffi/cuda_handlers.cc   # host C++; CUDA headers come with CUDA::cudart_static
  cpp/cuda/dispatch.cu
  ${_exact_sources})

# IEEE arithmetic: no --use_fast_math (the exact kernels rely on accurate
# exp/log/tanh, division and infinities). -lineinfo costs nothing at run time
# and makes compute-sanitizer and profiler reports point at source lines.
# handlers.h declares the CUDA handlers (and what module.cc asks of them)
# under JAX_FLASH_WITH_CUDA; the dispatch routes to the families the
# JAX_FLASH_HAS_* definitions say the build holds.
set(_cuda_definitions JAX_FLASH_WITH_CUDA=1)
if(_tc_archs)
  list(APPEND _cuda_definitions JAX_FLASH_HAS_SM80=1)
endif()
if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
  list(APPEND _cuda_definitions JAX_FLASH_HAS_SM90A=1)
endif()
if("75" IN_LIST CMAKE_CUDA_ARCHITECTURES)
  list(APPEND _cuda_definitions JAX_FLASH_HAS_SM75=1)
endif()

function(jax_flash_cuda_settings target)
  target_include_directories(${target} PRIVATE ${JAX_FLASH_INCLUDES})
  if(XLA_FFI_INCLUDE_DIR)
    # Third-party headers: their warnings (-Wreturn-type in api.h) are not ours.
    target_include_directories(${target} SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
  endif()
  set_target_properties(${target} PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    CUDA_SEPARABLE_COMPILATION OFF
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 -lineinfo>)
  target_compile_definitions(${target} PRIVATE ${_cuda_definitions})
endfunction()

jax_flash_cuda_settings(jax_flash_cuda)
target_link_libraries(jax_flash_cuda PUBLIC CUDA::cudart_static)
if(_tc_archs)
  add_library(jax_flash_cuda_tc OBJECT ${_tc_sources})
  jax_flash_cuda_settings(jax_flash_cuda_tc)
  set_target_properties(jax_flash_cuda_tc PROPERTIES CUDA_ARCHITECTURES "${_tc_archs}")
  target_sources(jax_flash_cuda PRIVATE $<TARGET_OBJECTS:jax_flash_cuda_tc>)
endif()
if("75" IN_LIST CMAKE_CUDA_ARCHITECTURES)
  add_library(jax_flash_cuda_sm75 OBJECT ${_sm75_sources})
  jax_flash_cuda_settings(jax_flash_cuda_sm75)
  set_target_properties(jax_flash_cuda_sm75 PROPERTIES CUDA_ARCHITECTURES 75)
  target_sources(jax_flash_cuda PRIVATE $<TARGET_OBJECTS:jax_flash_cuda_sm75>)
endif()
