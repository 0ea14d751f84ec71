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
    cpu["jax_flash_jvp"] = Capsule(JaxFlashJvpCpu);
    by_platform["cpu"] = cpu;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict cuda;
    cuda["jax_flash_fwd"] = Capsule(JaxFlashFwdCuda);
    cuda["jax_flash_bwd"] = Capsule(JaxFlashBwdCuda);
    cuda["jax_flash_jvp"] = Capsule(JaxFlashJvpCuda);
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "Handler capsules by XLA platform name.");

#ifdef JAX_FLASH_WITH_CUDA
  m.def("cuda_bwd_workspace_bytes",
        [](int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads_q,
           int64_t num_heads_kv, int64_t head_dim, const std::string& dtype, bool deterministic) {
          const jax_flash::AttentionShape shape{batch,       seqlen_q,     seqlen_k,
                                                num_heads_q, num_heads_kv, head_dim};
          return jax_flash::CudaBwdWorkspaceBytes(shape, dtype, deterministic);
        },
        "Bytes of the CUDA backward's workspace result for this problem.");
  m.def("cuda_captured_calls", []() {
    const jax_flash::CapturedCalls calls = jax_flash::CudaCapturedCalls();
    nb::dict counts;
    counts["fwd"] = calls.fwd;
    counts["bwd"] = calls.bwd;
    return counts;
  }, "Handler calls made while XLA recorded their stream into a CUDA graph.");
#endif

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
