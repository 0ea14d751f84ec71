"""Every derivative: jvp, linearize, jacfwd, hessian, grad of grad, check_grads with default modes.

First order runs the kernels (forward mode the JVP kernel, reverse mode the
backward kernel); second order runs the blockwise JAX rules (blockwise.py),
whose JVP is also tested at first order here, through a CPU lowering of the
JVP primitive to it. On a GPU the 'gpu' half of each test runs the CUDA
kernels: float32/float64 (and bf16/fp16 with a bias, dense mask or dropout)
the exact JVP kernel, bf16/fp16 otherwise the tensor-core one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir
from jax.test_util import check_grads

import jax_flash
from conftest import assert_flash_close
from jax_flash import _ffi, blockwise, dropout, primitives
from jax_flash.primitives import absent_operand, flash_fwd_p, flash_jvp_p
from reference import Options, attention, make_inputs, visible_mask

RATE = 0.3
# The kernels draw 8-bit numbers: the rate they apply is RATE rounded to a
# multiple of 2^-8 (77/256), kept values are scaled by 1 / (1 - that rate).
REALISED = dropout.realised_dropout_rate(RATE)
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim): small, odd, GQA.
SMALL = (2, 5, 6, 2, 1, 3)
# Each option as a function of the problem's (batch, heads, seqlen_q, seqlen_k).
OPTIONS = {
    "plain": lambda b, n, t, s: (Options(), 0.0),
    "causal": lambda b, n, t, s: (Options(is_causal=True), 0.0),
    "window": lambda b, n, t, s: (Options(window=(2, 1)), 0.0),
    "lengths": lambda b, n, t, s: (Options(with_lengths=True), 0.0),
    "segments": lambda b, n, t, s: (Options(with_segments=True), 0.0),
    "softcap": lambda b, n, t, s: (Options(softcap=1.5, scale=0.8), 0.0),
    "bias": lambda b, n, t, s: (Options(bias_shape=(b, n, t, s)), 0.0),
    "bias_broadcast": lambda b, n, t, s: (Options(bias_shape=(1, n, 1, s)), 0.0),
    "mask": lambda b, n, t, s: (Options(mask_shape=(b, 1, t, s)), 0.0),
    "dropout": lambda b, n, t, s: (Options(), RATE),
    "everything": lambda b, n, t, s: (
        Options(is_causal=True, window=(3, 1), softcap=2.0, with_lengths=True,
                with_segments=True, bias_shape=(1, n, t, s), mask_shape=(b, n, t, s)), RATE),
}


# Options the tensor-core JVP kernel takes itself (everything but a bias; a
# dense mask and dropout through its kTerms kernels); the low-precision tests
# run them on the GPU's sm80 path (and the Turing family's, forced).
TENSOR_CORE_OPTIONS = {
    "band_cap_segments": lambda b, n, t, s: (
        Options(is_causal=True, window=(40, 7), softcap=2.0, with_lengths=True,
                with_segments=True), 0.0),
    "band_mask_dropout": lambda b, n, t, s: (
        Options(is_causal=True, window=(40, 7), with_lengths=True, with_segments=True,
                mask_shape=(b, n, t, s)), RATE),
}


def seed_of(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def dropout_rng(inputs):
  return jax.random.key(inputs.q.size)


def kernel_keep(inputs, rate, broadcast=False):
  """The kernels' dropout mask (B, N, T, S), recovered from jax_flash itself.

  The mask is a function of the key and (b, h, i, j) alone, so a problem of
  the same sizes with q = k = 0 (every probability 1/S) and one-hot values
  (V[j] = e_j) shows it: output row i is row i of the dropped probabilities.
  """
  batch, seqlen_q, heads = inputs.q.shape[:3]
  seqlen_k = inputs.k.shape[1]
  q = jnp.zeros((batch, seqlen_q, heads, seqlen_k))
  k = jnp.zeros((batch, seqlen_k, heads, seqlen_k))
  v = jnp.broadcast_to(jnp.eye(seqlen_k)[None, :, None], k.shape)
  out = jax_flash.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=dropout_rng(inputs),
                                  broadcast_dropout=broadcast)
  return np.transpose(np.asarray(out) != 0, (0, 2, 1, 3))


class Problem:
  """One option's flash and dense functions of (q, k, v[, bias])."""

  def __init__(self, option, shape=SMALL, seed=0):
    batch, seqlen_q, seqlen_k, heads = shape[:4]
    self.opts, self.rate = {**OPTIONS, **TENSOR_CORE_OPTIONS}[option](batch, heads, seqlen_q,
                                                                      seqlen_k)
    self.inputs = make_inputs(np.random.default_rng(seed_of(option, shape, seed)), *shape)
    self.inputs.kv_lengths[0] = max(self.inputs.kv_lengths[0], 2)  # not all rows empty
    kwargs = self.opts.kwargs(self.inputs)
    if self.rate:
      kwargs.update(dropout_rate=self.rate, dropout_rng=dropout_rng(self.inputs))
    self.kwargs = kwargs
    self.visible = visible_mask(self.opts, self.inputs)
    self.keep = kernel_keep(self.inputs, self.rate) if self.rate else None
    self.bias = self.opts.bias(self.inputs)

  def args(self, dtype=jnp.float64):
    x = self.inputs
    args = [jnp.asarray(a, dtype) for a in (x.q, x.k, x.v)]
    if self.bias is not None:
      args.append(jnp.asarray(self.bias, jnp.float64 if dtype == jnp.float64 else jnp.float32))
    return tuple(args)

  def tangents(self, dtype=jnp.float64):
    rng = np.random.default_rng(seed_of("tangents", self.inputs.q.size))
    return tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in self.args(dtype))

  def flash(self, *args):
    q, k, v, *bias = args
    return jax_flash.flash_attention(q, k, v, bias=bias[0] if bias else None, **self.kwargs)

  def dense(self, *args):
    q, k, v, *bias = args
    return attention(q, k, v, self.visible, self.opts, bias=bias[0] if bias else None,
                     keep=self.keep, dropout_rate=REALISED if self.rate else 0.0)[0]


def absent_mask_operands(bias_dtype):
  """Every MASK_OPERANDS entry absent, as the primitives take them."""
  return [jnp.asarray(x) for x in primitives.mask_operands(bias_dtype)]


def loss_of(f):
  return lambda *args: jnp.sum(jnp.sin(f(*args)))


def assert_trees_close(got, want, rtol=1e-9, atol=1e-11):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def check_transform(transform, pb, *args):
  """transform(f)(*args) for jax_flash and for the dense reference, both jitted."""
  assert_trees_close(jax.jit(transform(pb.flash))(*args), jax.jit(transform(pb.dense))(*args))


@contextlib.contextmanager
def blockwise_jvp_on_cpu():
  """Lowers the JVP on the CPU to the blockwise JAX formulation (blockwise.jvp).

  Swaps the rule of the per-device kernel primitive under the sharding rule,
  so that sharded calls reach the JAX code with their offsets as they reach
  the kernel.
  """
  jax_code = mlir.lower_fun(lambda *args, **params: blockwise.jvp(*args, **params),
                            multiple_results=True)
  mlir.register_lowering(primitives._jvp_kernel, jax_code, platform="cpu")
  try:
    yield
  finally:
    mlir.register_lowering(primitives._jvp_kernel,
                           primitives._cpu_lowering(_ffi.JVP_TARGET)(primitives._jvp_kernel),
                           platform="cpu")


# -- check_grads with its default modes (fwd and rev), to second order --------


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_check_grads_order_2(backend, option):
  pb = Problem(option)
  check_grads(jax.jit(pb.flash), pb.args(), order=2)


def test_check_grads_order_2_public_drop_in(backend):
  pb = Problem("causal")
  f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True)
  check_grads(jax.jit(f), pb.args(), order=2)


# -- forward mode against the float64 reference -------------------------------


def check_jvp(pb, dtype, flash_jvp=None):
  primals, tangents = pb.args(dtype), pb.tangents(dtype)
  got_out, got = (flash_jvp or jax.jit(lambda p, t: jax.jvp(pb.flash, p, t)))(primals, tangents)
  f64 = [jnp.asarray(x, jnp.float64) for x in primals]
  t64 = [jnp.asarray(x, jnp.float64) for x in tangents]
  dense_jvp = jax.jit(lambda p, t: jax.jvp(pb.dense, p, t))
  ref_out, ref = dense_jvp(f64, t64)
  plain_out, plain = dense_jvp(primals, tangents)
  assert got.dtype == primals[0].dtype
  assert_flash_close("out", got_out, ref_out, plain_out, dtype)
  assert_flash_close("out_dot", got, ref, plain, dtype)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_jvp_every_option_float64(backend, option):
  check_jvp(Problem(option, shape=(2, 70, 77, 4, 2, 16)), jnp.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
# On a GPU, bfloat16/float16 take the tensor cores (mask, dropout and
# band_mask_dropout their kTerms kernels); everything has a bias: exact.
@pytest.mark.parametrize("option", ["plain", "everything", "band_cap_segments", "mask", "dropout",
                                    "band_mask_dropout"])
def test_jvp_low_precision(backend, dtype, option):
  check_jvp(Problem(option, shape=(2, 100, 150, 4, 2, 40)), dtype)


@pytest.mark.parametrize("option", ["plain", "mask", "dropout", "band_mask_dropout"])
def test_jvp_turing_family(backend, monkeypatch, option):
  """JAX_FLASH_FORCE_PATH=sm75: float16 on the Turing family's JVP kernels (any newer GPU)."""
  if backend != "gpu":
    pytest.skip("the switch chooses among CUDA kernels")
  monkeypatch.setenv("JAX_FLASH_FORCE_PATH", "sm75")
  check_jvp(Problem(option, shape=(2, 90, 130, 4, 2, 64)), jnp.float16)


@pytest.mark.parametrize("option,dtype", [("everything", jnp.float32), ("bias", jnp.float64)],
                         ids=["everything-float32", "bias-float64"])
def test_blockwise_jvp_at_first_order(backend, option, dtype):
  """The blockwise JVP (whose jax.jvp is the second-order rule) matches the reference too."""
  pb = Problem(option, shape=(2, 70, 150, 4, 2, 16))  # two key blocks, the second partial
  with blockwise_jvp_on_cpu():
    run = jax.jit(lambda p, t: jax.jvp(pb.flash, p, t))  # traced and lowered in here
    check_jvp(pb, dtype, flash_jvp=run)


def test_jvp_of_one_argument_skips_the_rest(backend):
  """Zero tangents reach the kernel as absent operands (no zeros are made)."""
  pb = Problem("causal", shape=(1, 40, 50, 2, 1, 8))
  q, k, v = pb.args()
  f = lambda q: pb.flash(q, k, v)
  jaxpr = jax.make_jaxpr(lambda q, t: jax.jvp(f, (q,), (t,)))(q, q)
  eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive is flash_jvp_p)
  tangent_shapes = [tuple(v.aval.shape) for v in eqn.invars[5:9]]  # after q, k, v, out, lse
  assert tangent_shapes == [q.shape, (), (), ()]  # absent: 0-d (primitives.absent_operand)
  got = jax.jit(lambda q, t: jax.jvp(f, (q,), (t,))[1])(q, 2 * q + 1)
  want = jax.jit(lambda q, t: jax.jvp(lambda q: pb.dense(q, k, v), (q,), (t,))[1])(q, 2 * q + 1)
  assert_trees_close(got, want, 1e-10)


@pytest.mark.parametrize("where", ["q", "k", "bias"])
def test_jvp_nan_reaches_exactly_the_rows_it_touches(backend, where):
  """As the forward (tests/test_nan.py): a NaN makes its rows' tangents NaN, no others."""
  from test_nan import poisoned_inputs
  opts = Options(is_causal=True)
  inputs, bias, touched = poisoned_inputs(where, 40, opts, seed=3)
  args = [jnp.asarray(x) for x in (inputs.q, inputs.k, inputs.v)]
  args.append(jnp.asarray(np.zeros((1, 1, 1, 1)) if bias is None else bias))
  rng = np.random.default_rng(4)
  tangents = [jnp.asarray(rng.standard_normal(x.shape)) for x in args]
  mask = visible_mask(opts, inputs)
  flash = lambda q, k, v, b: jax_flash.flash_attention(q, k, v, bias=b, is_causal=True)
  dense = lambda q, k, v, b: attention(q, k, v, mask, opts, bias=b)[0]
  got = np.asarray(jax.jit(lambda p, t: jax.jvp(flash, p, t)[1])(args, tangents))
  want = np.asarray(jax.jvp(dense, args, tangents)[1])
  rows = np.transpose(touched, (0, 2, 1))  # (B, T, N)
  assert rows.any() and not rows.all()
  assert np.isnan(got[rows]).all()
  np.testing.assert_allclose(got[~rows], want[~rows], rtol=1e-10, atol=1e-11)


# -- the logsumexp: its tangent, and its cotangent (second order sends one) ---


def test_lse_tangent_and_cotangent(backend):
  """(out, lse) of the primitive, differentiated in both modes, against the dense (out, lse).

  The public API returns lse under stop_gradient, but second order uses its
  tangent (in the JVP of the backward) and so sends a cotangent back to it.
  """
  inputs = make_inputs(np.random.default_rng(3), 2, 33, 70, 4, 2, 8)
  opts = Options(is_causal=True, softcap=2.0, scale=0.35)
  params = dict(scale=0.35, softcap=2.0, is_causal=True, window_left=-1, window_right=-1,
                dropout_rate=0.0, broadcast_dropout=False, deterministic=False)
  absent = absent_mask_operands(jnp.float64)
  flash = lambda q, k, v: tuple(flash_fwd_p.bind(q, k, v, *absent, **params))
  mask = visible_mask(opts, inputs)

  def dense(q, k, v):
    out, lse = attention(q, k, v, mask, opts)
    return out, jnp.swapaxes(lse, 1, 2)

  primals = [jnp.asarray(x) for x in (inputs.q, inputs.k, inputs.v)]
  rng = np.random.default_rng(4)
  tangents = [jnp.asarray(rng.standard_normal(x.shape)) for x in primals]
  cotangents = (jnp.asarray(rng.standard_normal(inputs.q.shape)),
                jnp.asarray(rng.standard_normal((2, 4, 33))))
  jvp = lambda f: jax.jit(lambda p, t: jax.jvp(f, p, t)[1])
  vjp = lambda f: jax.jit(lambda p, c: jax.vjp(f, *p)[1](c))
  want = jvp(dense)(primals, tangents)
  assert_trees_close(jvp(flash)(primals, tangents), want, 1e-10)
  with blockwise_jvp_on_cpu():
    assert_trees_close(jvp(flash)(primals, tangents), want, 1e-10)
  assert_trees_close(vjp(flash)(primals, cotangents), vjp(dense)(primals, cotangents), 1e-10)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_jvp_handler_rejects_a_bad_tangent(bad):
  """The CPU handler checks its operands again (on CUDA the JVP is JAX code for now)."""
  with jax.default_device(jax.devices("cpu")[0]):
    _bind_jvp_with_a_bad_tangent(bad)


def _bind_jvp_with_a_bad_tangent(bad):
  q = jnp.zeros((1, 4, 2, 8), jnp.float32)
  k = jnp.zeros((1, 5, 1, 8), jnp.float32)
  absent = absent_mask_operands(jnp.float32)
  params = dict(scale=0.5, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                dropout_rate=0.0, broadcast_dropout=False)
  out, lse = flash_fwd_p.bind(q, k, k, *absent, **params)
  k_dot = jnp.zeros((1, 4, 1, 8), jnp.float32) if bad == "shape" else k.astype(jnp.float64)
  with pytest.raises(Exception, match="jax_flash: k_dot must be"):
    no_tangent = absent_operand(jnp.float32)
    jax.block_until_ready(flash_jvp_p.bind(q, k, k, out, lse, no_tangent, k_dot, no_tangent,
                                           no_tangent, *absent, **params))


# -- second order and the other transforms -------------------------------------


@pytest.mark.parametrize("option", ["plain", "everything"])
def test_hessian_and_jacfwd(backend, option):
  pb = Problem(option, shape=(1, 3, 5, 2, 1, 2))
  args = pb.args()
  everything = tuple(range(len(args)))
  check_transform(lambda f: jax.hessian(loss_of(f), argnums=everything), pb, *args)
  check_transform(lambda f: jax.jacfwd(f, argnums=everything), pb, *args)


@pytest.mark.parametrize("option", ["causal", "everything"])
def test_grad_of_grad_and_linearize(backend, option):
  pb = Problem(option, shape=(2, 20, 30, 4, 2, 8))
  args, tangents = pb.args(), pb.tangents()
  inner = lambda f: jax.grad(loss_of(f), argnums=(0, 1, 2))
  outer = lambda f: jax.grad(lambda *a: jnp.sum(inner(f)(*a)[0] ** 2), argnums=(0, 1, 2))
  check_transform(outer, pb, *args)
  check_transform(lambda f: lambda *t: jax.linearize(f, *args)[1](*t), pb, *tangents)


def test_jvp_under_vmap(backend):
  pb = Problem("everything", shape=(2, 9, 12, 4, 2, 8))
  args = pb.args()
  directions = [jnp.stack([t, 2 * t + 1, -t]) for t in pb.tangents()]
  # over tangents (jacfwd's case), over primals and tangents, and jvp of vmap
  check_transform(lambda f: jax.vmap(lambda *t: jax.jvp(f, args, t)[1]), pb, *directions)
  qs = jnp.stack([args[0], 0.5 * args[0]])
  at_q = lambda f: lambda q: f(q, *args[1:])
  check_transform(lambda f: jax.vmap(lambda q, t: jax.jvp(at_q(f), (q,), (t,))[1]), pb, qs,
                  directions[0][:2])
  check_transform(lambda f: lambda q, t: jax.jvp(jax.vmap(at_q(f)), (q,), (t,))[1], pb, qs,
                  directions[0][:2])


def test_checkpoint_of_forward_and_second_order(backend):
  pb = Problem("causal", shape=(1, 16, 16, 2, 2, 8))
  args, tangents = pb.args(), pb.tangents()
  check_transform(lambda f: lambda *a: jax.jvp(jax.checkpoint(f), a, tangents)[1], pb, *args)
  hvp = lambda f: lambda q: jax.jvp(jax.grad(lambda q: loss_of(f)(q, *args[1:])), (q,),
                                    (tangents[0],))[1]
  check_transform(lambda f: hvp(jax.checkpoint(f)), pb, args[0])


# -- reverse mode is exactly the forward and backward kernels -----------------


def test_jit_grad_runs_no_jvp(backend):
  pb = Problem("everything", shape=(2, 20, 30, 4, 2, 8))
  grad = jax.jit(jax.grad(loss_of(pb.flash), argnums=(0, 1, 2, 3)))
  hlo = grad.lower(*pb.args(jnp.float32)).compile().as_text()
  targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
  assert {t for t in targets if "jax_flash" in t} == {"jax_flash_fwd", "jax_flash_bwd"}, targets
  # Nor the blockwise formulation's products (an XLA dot, or a cuBLAS call on GPUs).
  assert not re.search(r"\bdot\(", hlo) and "cublas" not in hlo
  jaxpr = str(jax.make_jaxpr(jax.grad(loss_of(pb.flash)))(*pb.args()))
  assert "flash_jvp" not in jaxpr and jaxpr.count("flash_bwd") == 1


def test_cuda_lowers_the_jvp_to_its_kernel():
  """On CUDA, forward mode is the forward kernel and then the fused JVP kernel."""
  spec = jax.ShapeDtypeStruct((1, 40, 2, 16), jnp.bfloat16)
  f = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True)
  jvp = jax.jit(lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v)))
  text = jvp.trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @jax_flash_fwd(") == 1
  assert text.count("custom_call @jax_flash_jvp(") == 1
  assert "stablehlo.while" not in text and "dot_general" not in text


def test_bench_autodiff_runs(capsys):
  from jax_flash import bench_autodiff
  rows = bench_autodiff.main(["--seqlens", "64", "--heads", "2", "--head-dim", "16", "--causal",
                              "yes", "--modes", "jvp,hvp", "--repeats", "2"])
  assert {(r["mode"], r["impl"]) for r in rows} == {(m, i) for m in ("jvp", "hvp")
                                                    for i in ("jax_flash", "xla")}
  for r in rows:
    assert r["status"] == "ok" and r["ms"] > 0 and r["vs_xla"] > 0, r
  assert "causal=yes" in capsys.readouterr().out


# -- a chunk of a problem (offsets), sharded jit, shard_map -----------------------


def chunk_problem(seed=0):
  """Operands of a chunk: rows at position 32, keys at 16, of batch 1 and head 2 of a
  larger problem, with lengths and dropout (positions in whole 16 x 16 blocks)."""
  inputs = make_inputs(np.random.default_rng(seed), 2, 40, 50, 4, 2, 8)
  absent = absent_mask_operands(jnp.float64)
  ops = dict(zip(primitives.MASK_OPERANDS, absent))
  ops.update(q_seqlens=jnp.asarray([60, 40], jnp.int32), kv_seqlens=jnp.asarray([50, 30], jnp.int32),
             dropout_key=jax.random.bits(jax.random.key(seed), (1, 2), jnp.uint32),
             offsets=jnp.asarray([32, 16, 1, 2], jnp.int32))
  params = dict(scale=0.3, softcap=2.0, is_causal=True, window_left=20, window_right=4,
                dropout_rate=REALISED, broadcast_dropout=False, deterministic=False)
  primals = [jnp.asarray(x) for x in (inputs.q, inputs.k, inputs.v)]
  return primals, list(ops.values()), params


def test_blockwise_jvp_places_a_chunk_as_the_kernel_does(backend):
  """Offsets (positions for causal, window and lengths; global indices for
  dropout) mean the same in the blockwise JVP as in the kernels."""
  primals, masks, params = chunk_problem()
  rng = np.random.default_rng(1)
  tangents = [jnp.asarray(rng.standard_normal(x.shape)) for x in primals]
  f = lambda q, k, v: tuple(flash_fwd_p.bind(q, k, v, *masks, **params))
  run = lambda: jax.jit(lambda p, t: jax.jvp(f, p, t)[1])(primals, tangents)
  with jax.default_device(jax.devices("cpu")[0]):
    kernel = run()
    with blockwise_jvp_on_cpu():
      jax_code = run()
  assert np.abs(np.asarray(kernel[0])).max() > 0.1
  assert_trees_close(jax_code, kernel, 1e-10, 1e-12)
  # and second order, where the blockwise backward runs on the chunk too
  loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)[0]))
  hvp = jax.jit(lambda p, t: jax.jvp(jax.grad(loss, argnums=(0, 1, 2)), p, t)[1])
  check_grads(loss, primals, order=2, modes=["rev"])
  assert all(np.isfinite(np.asarray(x)).all() for x in hvp(primals, tangents))


@pytest.fixture(scope="module")
def devices():
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
  return cpus[:4]


@pytest.mark.parametrize("layout", ["batch_x_heads", "sequence"])
def test_sharded_jvp_runs_each_shard_locally(devices, layout):
  """The JVP has the forward's sharding rule: no collective, each device its shard
  (told its rows' positions and its global indices, for causal masks and dropout)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=devices)
  spec = P("x", None, "y") if layout == "batch_x_heads" else P(None, ("x", "y"))
  kv_spec = P("x", None, "y") if layout == "batch_x_heads" else P()
  pb = Problem("everything" if layout == "sequence" else "causal", shape=(2, 64, 40, 4, 2, 8))
  pb.kwargs.pop("mask", None)  # a dense mask would be gathered (not sharded like q)
  pb.visible = visible_mask(dataclasses.replace(pb.opts, mask_shape=None), pb.inputs)
  for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids"):
    if name in pb.kwargs:
      pb.kwargs[name] = jax.device_put(pb.kwargs[name], NamedSharding(mesh, P(spec[0])))
  q, k, v = pb.args()[:3]
  tq, tk, tv = pb.tangents()[:3]
  put = lambda s, *xs: [jax.device_put(x, NamedSharding(mesh, s)) for x in xs]
  q, tq = put(spec, q, tq)
  k, v, tk, tv = put(kv_spec, k, v, tk, tv)
  attn = lambda q, k, v: pb.flash(q, k, v, *pb.args()[3:])
  jvp = jax.jit(lambda p, t: jax.jvp(attn, p, t))
  text = jvp.lower((q, k, v), (tq, tk, tv)).compile().as_text()
  assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", text)
  assert text.count('custom_call_target="jax_flash_jvp"') == 1
  out, out_dot = jvp((q, k, v), (tq, tk, tv))
  assert out_dot.sharding.is_equivalent_to(q.sharding, 4)
  dense = lambda q, k, v: pb.dense(q, k, v, *pb.args()[3:])
  want = jax.jit(lambda p, t: jax.jvp(dense, p, t)[1])(pb.args()[:3], pb.tangents()[:3])
  assert_trees_close(out_dot, want, 1e-10)


def test_batch_sharded_second_order_gathers_nothing(devices):
  """Second order is plain JAX code, which XLA partitions itself: over the batch, locally."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((4,), ("x",), devices=devices)
  pb = Problem("causal", shape=(4, 24, 20, 2, 1, 8))
  batch = NamedSharding(mesh, P("x"))
  args = [jax.device_put(x, batch) for x in pb.args()]
  tangents = [jax.device_put(x, batch) for x in pb.tangents()]
  hvp = lambda f: jax.jit(lambda p, t: jax.jvp(jax.grad(loss_of(f), argnums=(0, 1, 2)), p, t)[1])
  text = hvp(pb.flash).lower(args, tangents).compile().as_text()
  assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", text)
  got = hvp(pb.flash)(args, tangents)
  assert all(g.sharding.is_equivalent_to(batch, 4) for g in got)
  assert_trees_close(got, hvp(pb.dense)(pb.args(), pb.tangents()))


def test_shard_map_jvp_and_second_order(devices):
  """Inside shard_map (check_vma=True): tangents and second derivatives keep their
  types, and equal the dense reference's over the whole batch."""
  from jax.sharding import AxisType, PartitionSpec as P
  mesh = jax.make_mesh((4,), ("x",), devices=devices, axis_types=(AxisType.Auto,))
  pb = Problem("causal", shape=(4, 12, 12, 2, 1, 8))
  args, tangents = pb.args(), pb.tangents()
  sharded = jax.shard_map(pb.flash, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
  jvp = lambda f: lambda *a: jax.jvp(f, a, tangents)[1]
  hvp = lambda f: lambda *a: jax.jvp(jax.grad(loss_of(f), argnums=(0, 1, 2)), a, tangents)[1]
  for transform in (jvp, hvp):
    assert_trees_close(jax.jit(transform(sharded))(*args), jax.jit(transform(pb.dense))(*args))


# -- dropout: the JAX mask is the kernels' mask ---------------------------------


@pytest.mark.parametrize("broadcast", [False, True])
def test_jax_dropout_mask_is_the_kernels(broadcast):
  inputs = make_inputs(np.random.default_rng(5), 3, 37, 70, 2, 2, 4)
  want = kernel_keep(inputs, RATE, broadcast)
  keep = lambda keys, batch, j0, cols: np.asarray(jax.jit(lambda k: dropout.keep_mask(
      k, RATE, broadcast, batch, 2, 37, j0, cols))(keys))
  key = jax.random.bits(dropout_rng(inputs), (1, 2), jnp.uint32)
  np.testing.assert_array_equal(keep(key, 3, 0, 80)[..., :70], want)
  # Columns from a later block, as the blockwise formulation asks for them.
  np.testing.assert_array_equal(keep(key, 3, 48, 32)[..., :22], want[..., 48:])
  # A key per batch element (vmap over keys folds them into the batch).
  keys = jax.random.bits(jax.random.key(9), (3, 2), jnp.uint32)
  np.testing.assert_array_equal(keep(keys, 3, 16, 16),
                                np.concatenate([keep(keys[b:b + 1], 1, 16, 16) for b in range(3)]))


def test_kernels_mask_follows_dropout_h_element_by_element():
  """dropout.h's definition, one element at a time, against the CPU kernels:
  i = 16 I + 8 a + 2 u + e, j = 16 J + 8 b + 2 v + c; Philox counter
  {J, I, (4 u + v) << 24 | head, batch}; the draw is byte 2 e + c of word
  2 a + b, kept when >= round(rate * 256). One call serves 16 elements."""
  inputs = make_inputs(np.random.default_rng(6), 2, 37, 40, 3, 3, 4)
  want = kernel_keep(inputs, RATE)  # (B, N, T, S)
  key = np.asarray(jax.random.bits(dropout_rng(inputs), (1, 2), jnp.uint32))[0]
  b, h, i, j = (x.ravel().astype(np.uint32) for x in np.indices(want.shape))
  calls = (j // 16, i // 16, (((i % 8) // 2 * 4 + (j % 8) // 2) << 24) | h, b)
  words = np.stack([np.asarray(w) for w in dropout.philox4x32(
      [jnp.asarray(c) for c in calls], (jnp.uint32(key[0]), jnp.uint32(key[1])))])
  word = words[(i % 16) // 8 * 2 + (j % 16) // 8, np.arange(i.size)]
  draw = (word >> (8 * (2 * (i % 2) + j % 2))) & 0xFF
  np.testing.assert_array_equal(want.ravel(), draw >= 77)
  # 16 elements per call: the counters of a 16 x 16 block take 16 values.
  assert len({c for c in zip(*(x[(b == 0) & (h == 0) & (i < 16) & (j < 16)] for x in calls))}) == 16


def test_philox_words_without_x64():
  """uint32 arithmetic only: the same draws with x64 off (jax's default)."""
  counter = [jnp.asarray([0, 1, 0xFFFFFFFF], jnp.uint32)] * 4
  key = (jnp.uint32(0x12345678), jnp.uint32(0x9ABCDEF0))
  with_x64 = [np.asarray(w) for w in dropout.philox4x32(counter, key)]
  with jax.enable_x64(False):
    without = [np.asarray(w) for w in dropout.philox4x32(counter, key)]
  for a, b in zip(with_x64, without):
    np.testing.assert_array_equal(a, b)
  # Philox-4x32-7: Random123's known answers (its kat_vectors file, Salmon et al.).
  known = [([0] * 4, [0] * 2, [0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48]),
           ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662]),
           ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
            [0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A])]
  for counter, key, want in known:
    got = dropout.philox4x32([jnp.uint32(c) for c in counter], [jnp.uint32(k) for k in key])
    assert [int(w) for w in got] == want
