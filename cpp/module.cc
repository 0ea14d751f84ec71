// The nanobind module: handler capsules per platform, and build facts.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/kernels.h"
#include "ffi/handlers.h"
#include "jax_flash/supported.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_flash, m) {
  m.doc() = "jax_flash FFI handlers (CPU and, when compiled in, CUDA).";

  m.def("registrations", []() {
    nb::dict by_platform;
    nb::dict cpu;
    cpu["jax_flash_fwd"] = Capsule(JaxFlashFwdCpu);
    cpu["jax_flash_bwd"] = Capsule(JaxFlashBwdCpu);
    by_platform["cpu"] = cpu;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict cuda;
    cuda["jax_flash_fwd"] = Capsule(JaxFlashFwdCuda);
    cuda["jax_flash_bwd"] = Capsule(JaxFlashBwdCuda);
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "Handler capsules by XLA platform name.");

  m.def("build_info", []() {
    nb::dict info;
    info["version"] = JAX_FLASH_VERSION;
    info["jaxlib_build_version"] = JAX_FLASH_JAXLIB_BUILD_VERSION;
#ifdef JAX_FLASH_WITH_CUDA
    info["cuda"] = true;
    info["cuda_archs"] = JAX_FLASH_CUDA_ARCHS;
#else
    info["cuda"] = false;
    info["cuda_archs"] = "";
#endif
    info["max_head_dim"] = jax_flash::kMaxHeadDim;
    info["cpu_march"] = jax_flash::cpu::CompiledMarch();
    info["cpu_vector_bytes"] = jax_flash::cpu::VectorBytes();
    return info;
  }, "Facts fixed when the extension was compiled.");
}
