# CPU kernels.
#
# They are written with portable GCC/Clang vector types and compiled for one
# instruction set: the building machine's by default (pip builds from source
# where the package runs), or the -march given in JAX_FLASH_CPU_MARCH (for
# example "x86-64-v3" when building a wheel for other machines).
set(JAX_FLASH_CPU_MARCH "$ENV{JAX_FLASH_CPU_MARCH}")
if(JAX_FLASH_CPU_MARCH STREQUAL "")
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag("-march=native" JAX_FLASH_HAS_MARCH_NATIVE)
  if(JAX_FLASH_HAS_MARCH_NATIVE)
    set(JAX_FLASH_CPU_MARCH "native")
  endif()
endif()

add_library(jax_flash_cpu_kernels STATIC cpp/cpu/flash_fwd.cc cpp/cpu/flash_bwd.cc
            cpp/cpu/flash_jvp.cc)
target_include_directories(jax_flash_cpu_kernels PUBLIC ${JAX_FLASH_INCLUDES})
set_target_properties(jax_flash_cpu_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON)
# -fno-math-errno lets std:: math vectorise; no -ffast-math: the kernels rely
# on IEEE infinities for masked rows.
target_compile_options(jax_flash_cpu_kernels PRIVATE -O3 -fno-math-errno)
if(NOT JAX_FLASH_CPU_MARCH STREQUAL "")
  target_compile_options(jax_flash_cpu_kernels PRIVATE -march=${JAX_FLASH_CPU_MARCH})
endif()
target_compile_definitions(jax_flash_cpu_kernels PRIVATE
  JAX_FLASH_CPU_MARCH="${JAX_FLASH_CPU_MARCH}")
message(STATUS "jax_flash: CPU kernels for -march=${JAX_FLASH_CPU_MARCH}")
