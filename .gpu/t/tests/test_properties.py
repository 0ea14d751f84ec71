"""Property-based tests: random shapes and options against the float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import Options
from test_numerics import check_against_reference, make_inputs


@st.composite
def problems(draw):
  kv_heads = draw(st.integers(1, 3))
  shape = (draw(st.integers(1, 2)), draw(st.integers(1, 150)), draw(st.integers(1, 150)),
           kv_heads * draw(st.integers(1, 3)), kv_heads, draw(st.integers(1, 96)))
  window = draw(st.none() | st.tuples(st.integers(0, 40), st.integers(0, 40)))
  opts = Options(
      scale=draw(st.none() | st.floats(0.05, 2.0)),
      is_causal=draw(st.booleans()),
      window=window,
      softcap=draw(st.none() | st.floats(0.5, 30.0)),
      with_lengths=draw(st.booleans()),
      with_segments=draw(st.booleans()),
  )
  dtype = draw(st.sampled_from([jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16]))
  return shape, opts, dtype, draw(st.integers(0, 2**31))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)  # the same examples in every run: CI is reproducible
@given(problems())
def test_random_problems_match_reference(problem):
  shape, opts, dtype, seed = problem
  inputs = make_inputs(np.random.default_rng(seed), *shape)
  check_against_reference(inputs, opts, dtype)
