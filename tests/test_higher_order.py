"""Higher-order derivatives through the ops: jax.grad of jax.grad, jax.hessian and
Hessian-vector products (jax.jvp of jax.grad). The custom_vjp rules call the kernels;
each call is a custom_jvp whose tangent is the same math in jnp (ops._with_reference_jvp),
so the second derivatives must equal backend="xla"'s (plain jnp, differentiable to any
order). jax.jvp of an op itself stays unsupported (a custom_vjp), and the FP8 dense layer
is differentiable once: both raise a TypeError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from flax_layers import fp8 as fp8_dense

_N = 40


def _inputs(dtype=jnp.float32, n=_N, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = (jax.random.normal(k[0], (4, 3, n)) + 0.5).astype(dtype)
  r = jax.random.normal(k[1], (4, 3, n)).astype(dtype)
  w = 1 + 0.1 * jax.random.normal(k[2], (n,))
  b = 0.1 * jax.random.normal(k[3], (n,))
  return x, r, w, b


def _loss(y):
  return sum(jnp.sum(t.astype(jnp.float32) ** 3) for t in jax.tree.leaves(y))


# name -> (loss(backend, x, w), dtype, tolerance relative to the largest value)
def _cases():
  x, r, w, b = _inputs()
  xb, rb, _, _ = _inputs(jnp.bfloat16)
  x8 = (2 * x[..., :32]).astype(jnp.float8_e4m3fn)
  s8 = jnp.full((4, 3, 2), 0.5)
  return {
      "rms_f32": (lambda be, x, w: _loss(pallas_norm.rms_norm(x, w, backend=be)), x, 1e-4),
      "layer_f32": (lambda be, x, w: _loss(pallas_norm.layer_norm(x, w, b, backend=be)), x,
                    1e-4),
      "layer_reload": (lambda be, x, w: _loss(pallas_norm.layer_norm(
          x, w, b, backend=be, mode=None if be == "xla" else "multi_wave_reload")), x, 1e-4),
      "rms_persistent_bf16": (lambda be, x, w: _loss(pallas_norm.rms_norm(
          x, w, backend=be, mode=None if be == "xla" else "static_persistent")), xb, 2e-2),
      "rms_residual_f32_stream": (lambda be, x, w: _loss(pallas_norm.rms_norm(
          x, w, residual=r[:x.shape[0], :x.shape[1]], residual_dtype=jnp.float32,
          backend=be)), x, 1e-4),
      "layer_residual_bf16": (lambda be, x, w: _loss(pallas_norm.layer_norm(
          x, w, b, residual=rb, backend=be)), xb, 2e-2),
      "rms_llama_bf16": (lambda be, x, w: _loss(pallas_norm.rms_norm(
          x, w.astype(jnp.bfloat16), cast="llama", backend=be)), xb, 2e-2),
      "rms_gemma": (lambda be, x, w: _loss(pallas_norm.rms_norm(
          x, w - 1, cast="gemma", backend=be)), x, 1e-4),
      "rms_fp8_x": (lambda be, x, w: _loss(pallas_norm.rms_norm(
          x8, w[:32] * x[0, 0, :32], x_scale=s8, out_dtype=jnp.float32, backend=be)), x, 1e-4),
  }


_CASES = _cases()


def _close(got, want, tol, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), what
    np.testing.assert_allclose(g, w, rtol=0, atol=tol * max(np.abs(w).max(), 1e-6),
                               err_msg=what)


@pytest.mark.parametrize("name", list(_CASES))
def test_grad_of_grad_matches_xla(name):
  f, x, tol = _CASES[name]
  w = _inputs()[2]

  def gg(be):
    g = jax.grad(lambda x, w: f(be, x, w), argnums=(0, 1))
    return jax.jit(jax.grad(lambda x, w: sum(jnp.sum(t.astype(jnp.float32) ** 2)
                                             for t in g(x, w)), argnums=(0, 1)))(x, w)

  _close(gg("pallas"), gg("xla"), tol, name)


@pytest.mark.parametrize("name", ["rms_f32", "layer_f32", "rms_residual_f32_stream"])
def test_hessian_and_hvp_match_xla(name):
  f, x, tol = _CASES[name]
  w = _inputs()[2]
  x = x[:1, :1]                                          # a [1, 1, N] row: a small Hessian
  hess = lambda be: jax.hessian(lambda x, w: f(be, x, w), argnums=(0, 1))(x, w)
  _close(hess("pallas"), hess("xla"), tol, "hessian")
  v = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
  hvp = lambda be: jax.jvp(lambda x: jax.grad(lambda x: f(be, x, w))(x), (x,), (v,))[1]
  _close(hvp("pallas"), hvp("xla"), tol, "hvp")


@pytest.mark.gpu
def test_triton_backend_grad_of_grad():
  f = lambda be, x, w: _loss(pallas_norm.layer_norm(x, w, None, backend=be))
  x, _, w, _ = _inputs()
  gg = lambda be: jax.grad(lambda x: jnp.sum(jax.grad(lambda x: f(be, x, w))(x) ** 2))(x)
  _close(gg("triton"), gg("xla"), 1e-4, "triton")


def test_forward_mode_of_the_op_is_a_type_error():
  x, _, w, _ = _inputs()
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: pallas_norm.rms_norm(x, w), (x,), (x,))


def test_fp8_dense_layer_is_differentiable_once():
  x = jax.random.normal(jax.random.key(0), (8, 64))
  k = 0.05 * jax.random.normal(jax.random.key(1), (64, 32))
  f = lambda x: jnp.sum(fp8_dense.norm_dense_fp8(x, k, jnp.ones(64), eps=1e-6) ** 2)
  assert jax.grad(f)(x).shape == x.shape
  with pytest.raises(TypeError, match="differentiable once"):
    jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
