// The nanobind module: handler capsules per platform, the FFI contract, and
// build facts.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/kernels.h"
#include "ffi/contract.h"
#include "ffi/handlers.h"
#include "jax_flash/mask.h"
#include "jax_flash/supported.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// contract.h's lists as Python values: operands and results as (name, dtype,
// shape) tuples, attributes as (name, C++ type, meaning).
#define JAX_FLASH_BUFFER_ENTRY(name, dtype, shape) \
  list.append(nb::make_tuple(#name, dtype, shape));
#define JAX_FLASH_ATTR_ENTRY(type, name, meaning) \
  list.append(nb::make_tuple(#name, #type, meaning));

template <typename Fill>
nb::list List(Fill&& fill) {
  nb::list list;
  fill(list);
  return list;
}

nb::dict Contract() {
  nb::dict ops;
#define JAX_FLASH_OP_ENTRY(target, OPERANDS, RESULTS, ATTRS)                                 \
  {                                                                                        \
    nb::dict op;                                                                           \
    op["operands"] = List([](nb::list& list) {                                             \
      OPERANDS(JAX_FLASH_BUFFER_ENTRY) JAX_FLASH_MASK_OPERANDS(JAX_FLASH_BUFFER_ENTRY)     \
    });                                                                                    \
    op["results"] = List([](nb::list& list) { RESULTS(JAX_FLASH_BUFFER_ENTRY) });          \
    op["attributes"] = List([](nb::list& list) { ATTRS(JAX_FLASH_ATTR_ENTRY) });           \
    ops[target] = op;                                                                      \
  }
  JAX_FLASH_FFI_OPS(JAX_FLASH_OP_ENTRY)
#undef JAX_FLASH_OP_ENTRY
  nb::dict contract;
  contract["ops"] = ops;
  contract["mask_operands"] =
      List([](nb::list& list) { JAX_FLASH_MASK_OPERANDS(JAX_FLASH_BUFFER_ENTRY) });
  // Results a platform's handler has beyond the op's (sized at lowering).
  nb::dict cuda_extra;
  cuda_extra[JAX_FLASH_FWD_TARGET] =
      List([](nb::list& list) { JAX_FLASH_CUDA_FWD_EXTRA_RESULTS(JAX_FLASH_BUFFER_ENTRY) });
  cuda_extra[JAX_FLASH_BWD_TARGET] =
      List([](nb::list& list) { JAX_FLASH_CUDA_BWD_EXTRA_RESULTS(JAX_FLASH_BUFFER_ENTRY) });
  nb::dict extra;
  extra["cuda"] = cuda_extra;
  contract["extra_results"] = extra;
  // Query rows and keys per block_mask cell (mask.h).
  nb::dict constants;
  constants["block_mask_block"] = jax_flash::kBlockMaskBlock;
  // The tile map's cell classes (mask.h CellClass).
  constants["cell_empty"] = static_cast<int>(jax_flash::kCellEmpty);
  constants["cell_partial"] = static_cast<int>(jax_flash::kCellPartial);
  constants["cell_full"] = static_cast<int>(jax_flash::kCellFull);
  contract["constants"] = constants;
  return contract;
}

#undef JAX_FLASH_BUFFER_ENTRY
#undef JAX_FLASH_ATTR_ENTRY

}  // namespace

NB_MODULE(_jax_flash, m) {
  m.doc() = "jax_flash FFI handlers (CPU and, when compiled in, CUDA).";

  m.def("registrations", []() {
    nb::dict by_platform;
    nb::dict cpu;
    cpu[JAX_FLASH_FWD_TARGET] = Capsule(JaxFlashFwdCpu);
    cpu[JAX_FLASH_BWD_TARGET] = Capsule(JaxFlashBwdCpu);
    cpu[JAX_FLASH_JVP_TARGET] = Capsule(JaxFlashJvpCpu);
    by_platform["cpu"] = cpu;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict cuda;
    cuda[JAX_FLASH_FWD_TARGET] = Capsule(JaxFlashFwdCuda);
    cuda[JAX_FLASH_BWD_TARGET] = Capsule(JaxFlashBwdCuda);
    cuda[JAX_FLASH_JVP_TARGET] = Capsule(JaxFlashJvpCuda);
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "Handler capsules by XLA platform name.");

  m.def("ffi_contract", &Contract,
        "The custom calls' operands, results and attributes (cpp/ffi/contract.h): {'ops': "
        "{target: {'operands', 'results': [(name, dtype, shape)], 'attributes': [(name, "
        "C++ type, meaning)]}}, 'mask_operands': [...], 'extra_results': {platform: "
        "{target: [...]}}, 'constants': {'block_mask_block', 'cell_empty', 'cell_partial', "
        "'cell_full': ...}}.");

#ifdef JAX_FLASH_WITH_CUDA
  m.def("cuda_fwd_workspace_bytes", []() { return jax_flash::CudaFwdWorkspaceBytes(); },
        "Bytes of the CUDA forward's workspace result (any problem).");
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
