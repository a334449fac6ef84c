"""The post-norm before the fused residual add (``rms_norm(x, scale, residual=r,
post_norm_scale=p)``): h = r + rms_norm(x, p) rounded to x's dtype, y = rms_norm(h,
scale): Gemma 2/3's post-norm, residual add and next pre-norm.

Oracles: the same two calls (``rms_norm(x, p)`` then ``rms_norm(., scale, residual=r)``),
which the one-kernel forward must equal bit for bit, and the jnp formula (backend="xla").
On CPU the kernels run in Pallas interpret mode; ``make gpu-check`` runs this file with
interpret=False (the forward's reductions then may differ in order from the two calls':
within a bf16 unit there).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_norm
from pallas_norm.kernels import forward

_GPU = jax.default_backend() == "gpu"


def _inputs(m, n, xd="bfloat16", rd="bfloat16", seed=0):
  k = jax.random.split(jax.random.key(seed + 7 * m + n), 5)
  x = jax.random.normal(k[0], (m, n), jnp.float32).astype(xd) * 4
  r = jax.random.normal(k[1], (m, n), jnp.float32).astype(rd)
  scale = 0.3 * jax.random.normal(k[2], (n,), jnp.float32)
  post = 0.3 * jax.random.normal(k[3], (n,), jnp.float32)
  dy = jax.random.normal(k[4], (m, n), jnp.float32).astype(xd)
  return x, r, scale, post, dy


def _fused(x, r, s, p, **kw):
  return pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=p, eps=1e-6, **kw)


def _two_calls(x, r, s, p, **kw):
  res = {k: v for k, v in kw.items() if k == "residual_dtype"}
  rest = {k: v for k, v in kw.items() if k != "residual_dtype"}
  y1 = pallas_norm.rms_norm(x, p, eps=1e-6, **rest)
  return pallas_norm.rms_norm(y1, s, residual=r, eps=1e-6, **rest, **res)


def _pallas_calls(f, *args) -> int:
  return str(jax.make_jaxpr(f)(*args)).count("pallas_call")


def _exact_or_ulp(got, want, dtype):
  if _GPU:  # the fused kernel's reductions need not be ordered as the two kernels'
    ulp = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=4 * ulp * 8, rtol=2 * ulp)
  else:
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m,n", [(1, 256), (2, 384), (7, 2048), (64, 512), (511, 128)])
@pytest.mark.parametrize("cast,rd,residual_dtype", [
    ("gemma", "bfloat16", None), ("torch", "float32", None),
    ("torch", "bfloat16", "float32")], ids=["gemma", "f32_residual", "residual_in_fp32"])
def test_one_kernel_equals_the_two_calls(m, n, cast, rd, residual_dtype):
  """Outside jax.vjp one kernel (one pallas_call where the two calls make two) whose y
  and h equal the two calls', and the jnp formula's within a unit of bf16."""
  x, r, s, p, _ = _inputs(m, n, rd=rd)
  kw = dict(cast=cast, **({} if residual_dtype is None else {"residual_dtype": residual_dtype}))
  assert _pallas_calls(lambda *a: _fused(*a, **kw), x, r, s, p) == 1
  assert _pallas_calls(lambda *a: _two_calls(*a, **kw), x, r, s, p) == 2
  y, h = _fused(x, r, s, p, **kw)
  y2, h2 = _two_calls(x, r, s, p, **kw)
  assert y.dtype == x.dtype and h.dtype == jnp.dtype(residual_dtype or rd)
  _exact_or_ulp(y, y2, y.dtype)
  _exact_or_ulp(h, h2, h.dtype)
  yx, hx = _fused(x, r, s, p, backend="xla", **kw)
  for got, want in ((y, yx), (h, hx)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=0.05, rtol=2**-7)


@pytest.mark.parametrize("m,n", [(1, 256), (7, 384), (64, 128)])
def test_grads_are_the_two_calls(m, n):
  """Under jax.vjp: the two ops' kernels, so every cotangent (x, residual, scale, and the
  post-norm's scale) equals the two calls' bit for bit, and matches the jnp formula's;
  dscale and dpost bitwise equal across runs (deterministic)."""
  x, r, s, p, dy = _inputs(m, n)
  dh = jnp.flip(dy, 0)

  def grads(f):
    out, pull = jax.vjp(lambda x, r, s, p: f(x, r, s, p, cast="gemma"), x, r, s, p)
    return (*out, *pull((dy, dh)))

  got, want = grads(_fused), grads(_two_calls)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref = grads(lambda *a, **kw: _fused(*a, backend="xla", **kw))
  for name, a, b in zip(("y", "h", "dx", "dresidual", "dscale", "dpost"), got, ref):
    tol = 0.05 if name in ("y", "h", "dx", "dresidual") else 2e-2 * np.sqrt(m)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=tol, rtol=2**-6, err_msg=name)
  again = grads(_fused)
  for a, b in zip(got[4:], again[4:]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_modes_run_the_two_calls():
  """A mode whose config does not hold the row in one program (multi_wave_reload, the
  Triton backend): the two calls' kernels, the same values."""
  x, r, s, p, _ = _inputs(3, 512)
  for kw in (dict(mode="multi_wave_reload"), dict(mode="static_persistent")):
    assert _pallas_calls(lambda *a: _fused(*a, **kw), x, r, s, p) == 2
    for a, b in zip(_fused(x, r, s, p, **kw), _two_calls(x, r, s, p, **kw)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_launcher_refuses_split_rows():
  """The launcher's own check: the post-norm needs the row in one program."""
  from pallas_norm.config import ForwardConfig
  x, r, s, p, _ = _inputs(2, 512)
  cfg = ForwardConfig(mode="multi_wave_cached", block_m=1, block_n=256, num_warps=4)
  assert not forward.post_norm_fits(cfg, 512)
  with pytest.raises(ValueError, match="post_norm_scale needs"):
    forward.norm_forward(x, s, None, eps=1e-6, scale_offset=0.0, subtract_mean=False,
                         config=cfg, interpret=not _GPU, return_residuals=False,
                         residual=r, post_norm_scale=p)


def test_errors():
  x, r, s, p, _ = _inputs(2, 64)
  with pytest.raises(ValueError, match="needs a residual"):
    pallas_norm.rms_norm(x, s, post_norm_scale=p)
  with pytest.raises(ValueError, match="not cast='llama'"):
    pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=p, cast="llama")
  with pytest.raises(ValueError, match=r"post_norm_scale.shape=\(63,\) must be \(64,\)"):
    pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=p[:63])
  with pytest.raises(TypeError, match="post_norm_scale must be an array"):
    pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=[1.0] * 64)
  with pytest.raises(TypeError, match="post_norm_scale.dtype=int32"):
    pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=jnp.ones(64, jnp.int32))


def test_rank_one_and_leading_axes():
  x, r, s, p, _ = _inputs(6, 128)
  y, h = _fused(x.reshape(2, 3, 128), r.reshape(2, 3, 128), s, p)
  y2, h2 = _two_calls(x, r, s, p)
  _exact_or_ulp(y.reshape(6, 128), y2, y.dtype)
  y, h = _fused(x[0], r[0], s, p)
  assert y.shape == h.shape == (128,)
  _exact_or_ulp(y, y2[0], y.dtype)


def test_flax_layer_post_norm():
  """``layer(x, h, post_norm=post)`` is ``layer(post(x), h)``, in one kernel; post's
  scale gets the gradient of the two calls; a post_norm configured otherwise is a
  ValueError."""
  make = lambda **kw: pallas_norm.RMSNorm(  # noqa: E731
      256, epsilon=1e-6, dtype=jnp.bfloat16, cast="gemma",
      scale_init=nnx.initializers.normal(0.3), rngs=nnx.Rngs(kw.pop("seed", 0)), **kw)
  pre, post = make(seed=1), make(seed=2)
  x, r, *_ = _inputs(5, 256)
  y, h = pre(x, r, post_norm=post)
  y2, h2 = pre(post(x), r)
  _exact_or_ulp(y, y2, y.dtype)
  _exact_or_ulp(h, h2, h.dtype)
  assert _pallas_calls(lambda x, r: pre(x, r, post_norm=post), x, r) == 1

  def loss(models, fused):
    pre, post = models
    y, h = pre(x, r, post_norm=post) if fused else pre(post(x), r)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h.astype(jnp.float32))

  g = nnx.grad(lambda m: loss(m, True))((pre, post))
  g2 = nnx.grad(lambda m: loss(m, False))((pre, post))
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"differs in \['epsilon'\]"):
    pre(x, r, post_norm=pallas_norm.RMSNorm(256, epsilon=1e-5, dtype=jnp.bfloat16,
                                            cast="gemma", rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="pass a residual"):
    pre(x, post_norm=post)
  with pytest.raises(ValueError, match="must be a pallas_norm.RMSNorm"):
    pre(x, r, post_norm=nnx.RMSNorm(256, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_linen_layer_post_norm(param_dtype):
  """Linen: ``pre(x, h, post_norm=self.post)`` inside a parent module is ``pre(post(x),
  h)``, in one kernel; init creates post's params as its own call would; post's scale
  gets the gradient of the two calls; the refusals as the NNX layer's."""
  from flax import linen as nn

  from flax_layers import linen

  make = lambda name, **kw: linen.RMSNorm(  # noqa: E731
      epsilon=1e-6, cast="gemma", param_dtype=param_dtype,
      scale_init=nn.initializers.normal(0.3), name=name, **kw)

  class Block(nn.Module):
    fused: bool

    @nn.compact
    def __call__(self, x, r):
      pre, post = make("pre"), make("post")
      return pre(x, r, post_norm=post) if self.fused else pre(post(x), r)

  x, r, *_ = _inputs(5, 256)
  v = Block(True).init(jax.random.key(0), x, r)
  assert jax.tree.structure(v) == jax.tree.structure(
      Block(False).init(jax.random.key(0), x, r))
  assert v["params"]["post"]["scale"].dtype == param_dtype
  y, h = Block(True).apply(v, x, r)
  y2, h2 = Block(False).apply(v, x, r)
  _exact_or_ulp(y, y2, y.dtype)
  _exact_or_ulp(h, h2, h.dtype)
  assert _pallas_calls(lambda x, r: Block(True).apply(v, x, r), x, r) == 1

  def loss(v, fused):
    y, h = Block(fused).apply(v, x, r)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h.astype(jnp.float32))

  g, g2 = jax.grad(lambda v: loss(v, True))(v), jax.grad(lambda v: loss(v, False))(v)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  outside = linen.RMSNorm(epsilon=1e-6, cast="gemma", param_dtype=param_dtype)  # unbound

  class Bad(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x, r):
      pre = make("pre")
      if self.kind == "eps":
        return pre(x, r, post_norm=linen.RMSNorm(epsilon=1e-5, cast="gemma",
                                                 param_dtype=param_dtype, name="post"))
      if self.kind == "no_residual":
        return pre(x, post_norm=make("post"))
      if self.kind == "flax":
        return pre(x, r, post_norm=nn.RMSNorm(name="post"))
      return pre(x, r, post_norm=outside)

  for kind, match in [("eps", r"differs in \['epsilon'\]"), ("no_residual", "pass a residual"),
                      ("flax", "must be a flax_layers.linen.RMSNorm"),
                      ("unbound", "bound submodule")]:
    with pytest.raises(ValueError, match=match):
      Bad(kind).init(jax.random.key(0), x, r)
