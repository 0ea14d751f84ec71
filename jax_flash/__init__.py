"""jax_flash: FlashAttention for JAX.

Exact attention computed with the FlashAttention-2 algorithm (tiled, online
softmax, never the full score matrix) in C++ and CUDA kernels called as XLA
FFI custom calls, with forward, JVP and backward primitives that work under
every JAX transformation (``jit``, ``grad``, ``jvp``, ``vmap``,
``checkpoint``, ``hessian``, ...), to any order.
"""

import importlib.machinery
import importlib.util
import os
import sys

# jax (and with it numpy and ml_dtypes) must be imported before the
# extension: the other order crashed inside ml_dtypes on the CUDA image.
import jax  # noqa: F401


def _use_installed_copy() -> None:
  """Replaces this module, imported from a source checkout, with the installed jax_flash.

  `pip install .` builds the extension into site-packages, never into the
  checkout; but `python -m`, `python -c`, a REPL or a notebook started at the
  repository root put the root first on sys.path, so `import jax_flash` finds
  this folder. The installed copy, looked up on the rest of sys.path, then
  takes this module's place in sys.modules whole (its own __init__ and every
  submodule, the extension included), so nothing mixes the checkout's Python
  with an extension built from another version of it. An editable install
  (`pip install -e .`) never gets here: its finder supplies the extension.
  """
  here = os.path.dirname(os.path.realpath(__file__))
  checkout = os.path.dirname(here)
  elsewhere = [p for p in sys.path
               if isinstance(p, str) and os.path.realpath(p or os.curdir) != checkout]
  spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
  found = ""
  if spec is not None and spec.submodule_search_locations:
    locations = list(spec.submodule_search_locations)
    if os.path.realpath(locations[0]) != here:
      if importlib.machinery.PathFinder.find_spec(f"{__name__}._jax_flash", locations):
        module = importlib.util.module_from_spec(spec)
        sys.modules[__name__] = module  # The import system returns what is here.
        spec.loader.exec_module(module)
        return
      found = f"; the jax_flash installed at {locations[0]} has no compiled extension either"
  raise ImportError(
      f"jax_flash was imported from the source folder {here}, which has no compiled extension "
      f"(`pip install .` builds it into site-packages, and Python looks in the current "
      f"directory first), and no installed jax_flash was found elsewhere on the sys.path of "
      f"{sys.executable}{found}. Build and install it: run `pip install .` in {checkout} "
      f"(README.md, \"Install\"), or `pip install -e .` for an editable install.")


if importlib.util.find_spec(f"{__name__}._jax_flash") is None:
  _use_installed_copy()
else:
  from jax_flash import _jax_flash
  from jax_flash._ffi import build_info
  from jax_flash.attention import BLOCK_MASK_BLOCK, flash_attention
  from jax_flash.nn import dot_product_attention
  from jax_flash.sharding.ring import from_zigzag, ring_attention, to_zigzag

  __version__ = _jax_flash.build_info()["version"]
__all__ = ["BLOCK_MASK_BLOCK", "build_info", "dot_product_attention", "flash_attention", "from_zigzag",
           "ring_attention", "to_zigzag"]
