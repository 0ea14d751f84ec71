"""jax_flash: FlashAttention for JAX.

Exact attention computed with the FlashAttention-2 algorithm (tiled, online
softmax, never the full score matrix) in C++ and CUDA kernels called as XLA
FFI custom calls, with forward and backward primitives that work under
``jit``, ``grad``, ``vmap`` and ``checkpoint``.
"""

# jax (and with it numpy and ml_dtypes) must be imported before the
# extension: the other order crashed inside ml_dtypes on the CUDA image.
import jax  # noqa: F401

from jax_flash import _jax_flash
from jax_flash._ffi import build_info
from jax_flash.attention import dot_product_attention, flash_attention

__version__ = _jax_flash.build_info()["version"]
__all__ = ["build_info", "dot_product_attention", "flash_attention"]
