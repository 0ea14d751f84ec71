"""Runnable examples of jax_flash in models (``python -m jax_flash.examples.gpt``).

They need the ``examples`` extra (Flax and optax).
"""
