"""Loads the compiled extension, registers its FFI targets with XLA on import,
and holds the FFI contract.

Registering on import (not at the first lowering) is what lets a function
serialized with jax.export run in a fresh process after `import jax_flash`:
deserializing lowers nothing. Registration only records the handlers; it
initialises no backend (a platform's handlers wait until its plugin loads).

The contract (each custom call's operands, results and attributes) is written
once, in cpp/ffi/contract.h; the extension exports it (``ffi_contract()``),
and the primitives take their operand names and their attributes' names and
types from here, so Python cannot pass what the handlers do not decode.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jax_flash import _jax_flash

FWD_TARGET = "jax_flash_fwd"
BWD_TARGET = "jax_flash_bwd"
JVP_TARGET = "jax_flash_jvp"  # forward mode

CONTRACT = _jax_flash.ffi_contract()
# The optional operands every op ends with, in order.
MASK_OPERANDS = tuple(name for name, _, _ in CONTRACT["mask_operands"])
# contract.h's operand dtypes; "input" is q's, "acc" its accumulation dtype.
OPERAND_DTYPES = {name: dtype for name, dtype, _ in CONTRACT["mask_operands"]}
# Query rows and keys per cell of the block-sparse mask (mask.h).
BLOCK_MASK_BLOCK = int(CONTRACT["constants"]["block_mask_block"])
# The tile map's cell classes (mask.h CellClass): no pair of the cell is
# visible, some may be, every one is (as far as the elementwise terms go).
CELL_EMPTY, CELL_PARTIAL, CELL_FULL = (int(CONTRACT["constants"][name]) for name in (
    "cell_empty", "cell_partial", "cell_full"))
# How each C++ attribute type is written into the call (ffi_lowering types
# numpy scalars exactly: f64, i64; Python bools as i1).
_ATTRIBUTE_TYPES = {"double": np.float64, "int64_t": np.int64, "bool": bool}


def operands(target: str) -> tuple[str, ...]:
  """The operand names of a custom call, in order (its own, then MASK_OPERANDS)."""
  return tuple(name for name, _, _ in CONTRACT["ops"][target]["operands"])


def attributes(target: str, params: dict) -> dict:
  """The call's attributes from a primitive's parameters, typed as the handler decodes them.

  Exactly the target's attributes: parameters it does not take (the
  forward's ``deterministic``, carried for its backward) are left out.
  """
  attrs = {}
  for name, cpp_type, _ in CONTRACT["ops"][target]["attributes"]:
    if name not in params:
      raise TypeError(f"jax_flash: the {target} call needs the parameter {name!r} "
                      f"(cpp/ffi/contract.h); the primitive got {sorted(params)}")
    attrs[name] = _ATTRIBUTE_TYPES[cpp_type](params[name])
  return attrs


def _register_targets() -> None:
  """Registers every compiled handler with XLA, for the platform it was compiled for."""
  for platform, targets in _jax_flash.registrations().items():
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_targets()

# The documented switch that routes the CUDA kernels as on an older GPU, for
# tests and kernel comparisons (cuda/dispatch.cu reads it at every launch).
FORCE_PATH_ENV = "JAX_FLASH_FORCE_PATH"
FORCE_PATH_VALUES = ("sm80", "sm75", "exact")


def _check_force_path_env() -> None:
  value = os.environ.get(FORCE_PATH_ENV, "")
  if value and value not in FORCE_PATH_VALUES:
    raise ValueError(
        f"{FORCE_PATH_ENV}={value!r}: expected one of {', '.join(FORCE_PATH_VALUES)} (route the "
        f"CUDA kernels as on an Ampere GPU, as on a Turing GPU, or every problem on the exact "
        f"kernels), or unset to let the GPU decide")


_check_force_path_env()


def build_info() -> dict:
  """Facts fixed when jax_flash was compiled, and the jax it runs with.

  Keys: ``version``, ``jax_version`` and ``jaxlib_version`` (running now),
  ``jaxlib_build_version`` (whose FFI headers it was compiled against),
  ``cuda`` (CUDA kernels compiled in), ``cuda_archs`` (e.g. ``"90a"``),
  ``cpu_march`` and ``cpu_vector_bytes`` (how the CPU kernels were compiled),
  ``max_head_dim``.
  """
  import jaxlib

  info = dict(_jax_flash.build_info())
  info["cuda_archs"] = [a for a in info["cuda_archs"].split(",") if a]
  info["jax_version"] = jax.__version__
  info["jaxlib_version"] = jaxlib.__version__
  return info


def _require_cuda_build():
  if not hasattr(_jax_flash, "cuda_bwd_workspace_bytes"):
    raise RuntimeError(
        "jax_flash was built without CUDA kernels (jax_flash.build_info()['cuda'] is False), "
        "so it cannot run on a GPU; reinstall it where nvcc is found, or set "
        "JAX_FLASH_CUDA_ARCHS (see README.md)")


def cuda_fwd_workspace_bytes() -> int:
  """Bytes of the CUDA forward's workspace result (see primitives.py)."""
  _require_cuda_build()
  return int(_jax_flash.cuda_fwd_workspace_bytes())


def cuda_bwd_workspace_bytes(q_shape, k_shape, dtype, deterministic: bool) -> int:
  """Bytes of the CUDA backward's workspace result (see primitives.py)."""
  _require_cuda_build()
  batch, seqlen_q, num_heads_q, head_dim = q_shape
  _, seqlen_k, num_heads_kv, _ = k_shape
  return int(_jax_flash.cuda_bwd_workspace_bytes(batch, seqlen_q, seqlen_k, num_heads_q,
                                                 num_heads_kv, head_dim,
                                                 np.dtype(dtype).name, bool(deterministic)))
