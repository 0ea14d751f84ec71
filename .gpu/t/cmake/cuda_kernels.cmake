# CUDA kernels: built only when a CUDA compiler is found AND target
# architectures are known (JAX_FLASH_CUDA_ARCHS, e.g. "80;90a", or the compute
# capability of a visible GPU). Otherwise the build is CPU-only and says so.
set(JAX_FLASH_WITH_CUDA OFF)

set(_archs "$ENV{JAX_FLASH_CUDA_ARCHS}")
set(_arch_source "JAX_FLASH_CUDA_ARCHS")
if(_archs STREQUAL "")
  find_program(_nvidia_smi nvidia-smi)
  if(_nvidia_smi)
    execute_process(COMMAND ${_nvidia_smi} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE _caps OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE _smi_rc ERROR_QUIET)
    if(_smi_rc EQUAL 0 AND NOT _caps STREQUAL "")
      string(REPLACE "\n" ";" _caps "${_caps}")
      foreach(_cap IN LISTS _caps)
        string(REPLACE "." "" _cap "${_cap}")
        string(STRIP "${_cap}" _cap)
        # Hopper kernels need the architecture-specific feature set (wgmma).
        if(_cap STREQUAL "90")
          set(_cap "90a")
        endif()
        list(APPEND _archs ${_cap})
      endforeach()
      list(REMOVE_DUPLICATES _archs)
      set(_arch_source "visible GPU")
    endif()
  endif()
endif()

include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER AND NOT _archs STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES "${_archs}")
  enable_language(CUDA)
  set(JAX_FLASH_WITH_CUDA ON)
  string(REPLACE ";" "," JAX_FLASH_CUDA_ARCHS_STRING "${_archs}")
  message(NOTICE "jax_flash: building CUDA kernels for sm_${JAX_FLASH_CUDA_ARCHS_STRING} (from ${_arch_source})")
  include(cmake/cuda_sources.cmake)
elseif(NOT CMAKE_CUDA_COMPILER)
  message(NOTICE "jax_flash: building CPU only (no CUDA compiler found)")
else()
  message(NOTICE "jax_flash: building CPU only (no visible GPU; set JAX_FLASH_CUDA_ARCHS, e.g. \"80;90a\", to build CUDA kernels)")
endif()
