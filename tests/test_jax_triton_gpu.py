"""backend="triton" (plain Triton through jax-triton) against backend="pallas", on GPU.

Both backends run the same algorithms with the same launch configs, so y and dx must
agree within one ulp of the output dtype (plus an f32-rounding floor for dx, whose
c1/c2 reductions may run in another order), and dscale / dbias within a tolerance that
grows with sqrt(M). Also: vmap / grad / jit through the custom_vmap and custom_vjp glue,
N = 262144 on the reload path, int64 offsets, and bitwise-deterministic gradients; and
the tensor-parallel entry points (``norm_forward_stats`` / ``norm_forward_apply`` /
``norm_backward(combine_row_sums=...)``) on hidden-dim shards against the reference.

GPU only (``make gpu-check``, which brings jax-triton from .whl/).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import config as pn_config
from pallas_norm import reference, spmd
from pallas_norm.kernels import jax_triton

pytestmark = pytest.mark.gpu

MODES = pn_config.MODES
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHAPES = [(1, 1), (7, 3), (199, 760), (1024, 1000), (4097, 128), (33, 4096), (5, 8192)]


def _inputs(m, n, dtype, *, seed=0, layer=True):
  k = jax.random.split(jax.random.key(seed + 7919 * m + n), 4)
  x = (2.0 * jax.random.normal(k[0], (m, n), jnp.float32) + 0.5).astype(dtype)
  scale = (1.0 + 0.5 * jax.random.normal(k[1], (n,), jnp.float32)).astype(dtype)
  bias = jax.random.normal(k[2], (n,), jnp.float32).astype(dtype) if layer else None
  dy = jax.random.normal(k[3], (m, n), jnp.float32).astype(dtype)
  return x, scale, bias, dy


def _op(layer, backend, mode, scale_offset=0.0):
  if layer:
    return lambda x, s, b: pallas_norm.layer_norm(x, s, b, mode=mode, backend=backend,
                                                  scale_offset=scale_offset)
  return lambda x, s, b: pallas_norm.rms_norm(x, s, mode=mode, backend=backend,
                                              scale_offset=scale_offset)


def _run(layer, backend, mode, x, s, b, dy, scale_offset=0.0):
  y, vjp = jax.vjp(jax.jit(_op(layer, backend, mode, scale_offset)), x, s, b)
  return (y, *vjp(dy))


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _assert_ulp_close(name, a, b, *, n, floor_ulps=0.0, cancel_scale=0.0, ulp_dtype=None,
                      ulps=1.0):
  """|a - b| <= ``ulps`` ulps (of a's dtype, or ``ulp_dtype``'s, at max(|a|, |b|)) +
  floor_ulps f32 ulps * sqrt(n) * max(mean|b|, cancel_scale): a floor for values that
  cancel in f32. ``cancel_scale`` is the size of the terms that cancel, e.g. mean|dy w|
  rstd for dx, which is exactly 0 at N = 1."""
  fi = jnp.finfo(ulp_dtype or a.dtype)
  a64, b64 = _f64(a), _f64(b)
  mag = np.maximum(np.abs(a64), np.abs(b64))
  ulp = np.exp2(np.floor(np.log2(np.maximum(mag, float(fi.tiny))))) * float(fi.eps)
  tol = ulps * ulp + floor_ulps * 2.0**-23 * math.sqrt(n) * max(np.abs(b64).mean(), cancel_scale)
  err = np.abs(a64 - b64)
  bad = ~(err <= tol)
  assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} differ by more than "
                         f"1 ulp; max err {err.max():.3g}")


def _dx_scale(x, s, dy, layer, scale_offset=0.0):
  """mean |dy * w| * rstd: the size of the terms that cancel in dx."""
  eps = 1e-5 if layer else float(jnp.finfo(jnp.float32).eps)
  rstd = np.asarray(reference.norm(x, None, None, eps=eps, subtract_mean=layer)[2])
  w = 1.0 if s is None else scale_offset + _f64(s)
  return float(np.mean(np.abs(_f64(dy) * w) * rstd[..., None]))


def _assert_param_grad_close(name, a, b, *, m, extra_tol=0.0):
  assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
  a64, b64 = _f64(a), _f64(b)
  tol = 4 * float(jnp.finfo(a.dtype).eps) * math.sqrt(m) * (1 + np.abs(b64)) + extra_tol
  err = np.abs(a64 - b64)
  assert (err <= tol).all(), f"{name}: max err {err.max():.3g}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("m,n", SHAPES)
def test_triton_matches_pallas(m, n, layer, mode, dtype):
  x, s, b, dy = _inputs(m, n, DTYPES[dtype], layer=layer)
  got = _run(layer, "triton", mode, x, s, b, dy, scale_offset=1.0)
  want = _run(layer, "pallas", mode, x, s, b, dy, scale_offset=1.0)
  assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
  _assert_ulp_close("y", got[0], want[0], n=n, floor_ulps=2.0)
  _assert_ulp_close("dx", got[1], want[1], n=n, floor_ulps=4.0,
                    cancel_scale=_dx_scale(x, s, dy, layer, scale_offset=1.0))
  _assert_param_grad_close("dscale", got[2], want[2], m=m)
  if layer:
    _assert_param_grad_close("dbias", got[3], want[3], m=m)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_triton_no_affine(layer):
  x, _, _, dy = _inputs(199, 760, jnp.bfloat16, layer=layer)
  got = _run(layer, "triton", None, x, None, None, dy)
  want = _run(layer, "pallas", None, x, None, None, dy)
  _assert_ulp_close("y", got[0], want[0], n=760, floor_ulps=2.0)
  _assert_ulp_close("dx", got[1], want[1], n=760, floor_ulps=4.0,
                    cancel_scale=_dx_scale(x, None, dy, layer))
  assert got[2] is None and got[3] is None


# (x, residual, residual_dtype, cast, scale dtype) of the fused residual add and the
# casting modes.
FUSED = [("bfloat16", "float32", None, "torch", "float32"),
         ("bfloat16", "bfloat16", "float32", "torch", "bfloat16"),
         ("float16", "float16", None, "torch", "float16"),
         ("bfloat16", None, None, "llama", "float32"),
         ("bfloat16", "float32", None, "llama", "bfloat16"),
         ("float16", None, None, "gemma", "float32")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n", [(1024, 1000), (5, 8192)])
@pytest.mark.parametrize("case,layer", [(c, layer) for c in FUSED for layer in (False, True)
                                        if not (layer and c[3] == "gemma")],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple)
                         else ("ln" if c else "rms"))
def test_triton_fused_matches_pallas(case, layer, m, n, mode):
  """residual= and cast= on backend="triton" against "pallas" (same algorithms and
  configs): y within 1 ulp (+ an f32 floor), h bit for bit, dx / dresidual as dx,
  dscale / dbias within sqrt(M) ulps."""
  xd, rd, hd, cast, sd = case  # (cast="gemma" is RMSNorm's: GemmaRMSNorm)
  x, s, b, dy = _inputs(m, n, DTYPES[xd], layer=layer)
  s = s.astype(sd)
  r = None if rd is None else (3.0 * x.astype(jnp.float32) - 1.0).astype(rd)
  kw = dict(mode=mode, cast=cast)
  if r is not None:
    kw.update(residual=r, residual_dtype=hd)

  def run(backend):
    f = (lambda x, s, b: pallas_norm.layer_norm(x, s, b, backend=backend, **kw)) if layer \
        else (lambda x, s, b: pallas_norm.rms_norm(x, s, backend=backend, **kw))
    out, vjp = jax.vjp(jax.jit(f), x, s, b)
    outs = out if isinstance(out, tuple) else (out,)
    cts = tuple(jax.random.normal(jax.random.key(9 + i), o.shape, jnp.float32).astype(o.dtype)
                for i, o in enumerate(outs))
    return outs, vjp(cts if isinstance(out, tuple) else cts[0])

  (outs, grads), (outs_w, grads_w) = run("triton"), run("pallas")
  assert [o.dtype for o in outs] == [o.dtype for o in outs_w]
  if cast == "llama":
    # x_hat is rounded to x's dtype before the weight: where the two backends' x_hat
    # straddle a rounding boundary, x_hat * w differs by one ulp of x's dtype times |w|
    # (<= 2 ulps at |x_hat * w|), and the bias is added after.
    y_off = 0.0 if b is None else _f64(b)
    _assert_ulp_close("y", _f64(outs[0]) - y_off, _f64(outs_w[0]) - y_off, n=n,
                      floor_ulps=2.0, ulp_dtype=DTYPES[xd], ulps=2.0)
  else:
    _assert_ulp_close("y", outs[0], outs_w[0], n=n, floor_ulps=2.0)
  if r is not None:
    np.testing.assert_array_equal(_f64(outs[1]), _f64(outs_w[1]))
  _assert_ulp_close("dx", grads[0], grads_w[0], n=n, floor_ulps=4.0,
                    cancel_scale=_dx_scale(x, s, dy, layer))
  flips = 0.0
  if cast == "llama":
    # dscale sums dy against x_hat rounded to x's dtype: a rounding that flips between
    # the backends moves its term by one ulp of x's dtype. Allow two flips a column.
    eps = 1e-5 if layer else float(jnp.finfo(jnp.float32).eps)
    x_hat = np.asarray(reference.norm(x, None, None, eps=eps, subtract_mean=layer)[0],
                       np.float64)
    dy0 = _f64(jax.random.normal(jax.random.key(9), x.shape, jnp.float32).astype(
        outs[0].dtype))
    flips = 2 * float(jnp.finfo(DTYPES[xd]).eps) * np.max(np.abs(x_hat * dy0), axis=0)
  _assert_param_grad_close("dscale", grads[1], grads_w[1], m=m, extra_tol=flips)
  if layer:
    _assert_param_grad_close("dbias", grads[2], grads_w[2], m=m)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_triton_vmap_grad_jit(layer, mode):
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (4, 3, 65, 384), jnp.bfloat16)
  s = (1 + 0.3 * jax.random.normal(k[1], (4, 384))).astype(jnp.float32)
  b = jax.random.normal(k[2], (384,), jnp.bfloat16) if layer else None

  def loss(backend):
    f = _op(layer, backend, mode)
    return lambda x, s, b: jnp.sum(jnp.sin(f(x, s, b).astype(jnp.float32)))

  cases = [
      (lambda be: jax.vmap(_op(layer, be, mode), (0, None, None)), s[0]),  # folded
      (lambda be: jax.vmap(_op(layer, be, mode), (0, 0, None)), s),  # batched scale
      (lambda be: jax.vmap(jax.grad(loss(be), (0, 1, 2)), (0, None, None)), s[0]),  # per example
      (lambda be: jax.grad(lambda x, s, b: jnp.sum(jax.vmap(loss(be), (0, 0, None))(x, s, b)),
                           (0, 1, 2)), s),  # grad of vmap
      (lambda be: jax.vmap(jax.vmap(_op(layer, be, mode), (0, None, None)), (0, 0, None)), s),
  ]
  for make, sv in cases:
    got = jax.jit(make("triton"))(x, sv, b)
    want = jax.jit(make("pallas"))(x, sv, b)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(_f64(g), _f64(w), rtol=2e-2,
                                                         atol=2e-2), got, want)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_triton_large_n_reload(layer):
  """N = 262144 on multi_wave_reload, against the fp32 reference."""
  x, s, b, dy = _inputs(8, 262144, jnp.bfloat16, layer=layer)
  got = _run(layer, "triton", "multi_wave_reload", x, s, b, dy)
  want = _run(layer, "pallas", "multi_wave_reload", x, s, b, dy)
  ref = reference.norm(x, s, b, eps=1e-5 if layer else float(jnp.finfo(jnp.float32).eps),
                       subtract_mean=layer)[0]
  np.testing.assert_allclose(_f64(got[0]), _f64(ref), rtol=2e-2, atol=2e-2)
  _assert_ulp_close("y", got[0], want[0], n=262144, floor_ulps=2.0)
  _assert_ulp_close("dx", got[1], want[1], n=262144, floor_ulps=4.0,
                    cancel_scale=_dx_scale(x, s, dy, layer))
  _assert_param_grad_close("dscale", got[2], want[2], m=8)


@pytest.mark.bigmem
def test_triton_int64_offsets():
  """M * N > 2**31 - 1: the USE_INT64 path; checks rows at both ends against the
  reference."""
  m, n = 8193, 262144  # 2_147_745_792 elements
  assert m * n > 2**31 - 1
  x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
  s = jnp.full((n,), 1.5, jnp.bfloat16)
  y = jax.jit(lambda x, s: pallas_norm.rms_norm(x, s, backend="triton"))(x, s)
  rows = np.array([0, 1, m // 2, m - 2, m - 1])
  ref = reference.norm(x[rows], s, eps=float(jnp.finfo(jnp.float32).eps),
                       subtract_mean=False)[0]
  _assert_ulp_close("y", y[rows], ref, n=n)
  del y
  dx, ds = jax.jit(jax.grad(lambda x, s: jnp.sum(
      pallas_norm.rms_norm(x, s, backend="triton").astype(jnp.float32)), (0, 1)))(x, s)
  assert np.isfinite(_f64(dx[rows])).all() and np.isfinite(_f64(ds)).all()
  # d/dx sum(y) for a constant scale: rstd * w * (1 - x_hat * mean(x_hat)).
  xr = _f64(x[rows])
  rstd = 1 / np.sqrt((xr * xr).mean(-1, keepdims=True) + float(jnp.finfo(jnp.float32).eps))
  want = 1.5 * rstd * (1 - xr * rstd * (xr * rstd).mean(-1, keepdims=True))
  np.testing.assert_allclose(_f64(dx[rows]), want, rtol=2e-2, atol=2e-2)


def test_triton_backward_deterministic():
  x, s, b, dy = _inputs(4097, 1000, jnp.bfloat16)
  f = jax.jit(lambda x, s, b: jax.vjp(_op(True, "triton", "static_persistent"), x, s, b)[1](dy))
  first = f(x, s, b)
  for _ in range(3):
    again = f(x, s, b)
    for a, c in zip(first, again):
      assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16))


# --------------------------------------------------------------------------- tensor parallel

# (M, N, shards): shard widths 3, 500, 2048, 128 and 32768 (chunked, but in
# multi_wave_cached); the dtype rotates over them.
TP_CASES = [(7, 6, 2, "float32"), (199, 1000, 2, "bfloat16"), (33, 8192, 4, "float32"),
            (4097, 256, 2, "bfloat16"), (8, 65536, 2, "bfloat16")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("m,n,shards,dtype", TP_CASES)
def test_triton_tensor_parallel(m, n, shards, dtype, layer, mode):
  """jax_triton.norm_forward_stats, the combination, norm_forward_apply, then
  norm_backward(combine_row_sums=pmean), the hidden dim split into ``shards`` shards on
  a vmap axis whose pmean stands in for the all-reduce, against the reference on the
  whole rows."""
  eps, offset, w = 1e-5, 1.0, n // shards
  x, s, b, dy = _inputs(m, n, DTYPES[dtype], layer=layer)
  fcfg = pn_config.forward_config(m, w, x.dtype, mode, subtract_mean=layer, backend="triton")
  bcfg = pn_config.backward_config(m, w, x.dtype, subtract_mean=layer, backend="triton")
  cols = lambda a: jnp.moveaxis(a.reshape(m, shards, w), 1, 0)  # [shards, M, w]
  rows = lambda a: jnp.moveaxis(a, 0, 1).reshape(m, n)
  params = lambda p: None if p is None else p.reshape(shards, w)

  def forward(xk, sk, bk):
    s1, s2 = jax_triton.norm_forward_stats(xk, subtract_mean=layer, config=fcfg,
                                           interpret=False)
    mean, rstd = spmd._combine_stats(s1, s2, n=w, eps=eps, axes="h", groups=None)
    y = jax_triton.norm_forward_apply(xk, sk, bk, mean, rstd, scale_offset=offset,
                                      config=fcfg, interpret=False)
    return y, mean, rstd

  y, mean, rstd = jax.jit(jax.vmap(forward, axis_name="h"))(cols(x), params(s), params(b))
  y_ref, mean_ref, rstd_ref = reference.norm(x, s, b, eps=eps, scale_offset=offset,
                                             subtract_mean=layer)
  assert y.dtype == x.dtype and rows(y).shape == x.shape
  _assert_ulp_close("y", rows(y), y_ref, n=n, floor_ulps=4.0)
  _assert_ulp_close("rstd", rstd[0], rstd_ref, n=n, floor_ulps=4.0)
  if layer:
    _assert_ulp_close("mean", mean[0], mean_ref, n=n, floor_ulps=4.0, cancel_scale=2.0)

  pmean = lambda c1, c2: tuple(None if c is None else jax.lax.pmean(c, "h") for c in (c1, c2))

  def backward(dyk, xk, sk, mean, rstd):
    return jax_triton.norm_backward(
        dyk, xk, sk, mean, rstd, has_bias=layer, scale_offset=offset, subtract_mean=layer,
        config=bcfg, interpret=False, scale_dtype=s.dtype,
        bias_dtype=None if b is None else b.dtype, combine_row_sums=pmean)

  dx, dscale, dbias = jax.jit(jax.vmap(backward, (0, 0, 0, None, None), axis_name="h"))(
      cols(dy), cols(x), params(s), mean_ref if layer else None, rstd_ref)
  _, vjp = jax.vjp(lambda x, s, b: reference.norm(x, s, b, eps=eps, scale_offset=offset,
                                                  subtract_mean=layer)[0], x, s, b)
  dx_ref, dscale_ref, dbias_ref = vjp(dy)
  _assert_ulp_close("dx", rows(dx), dx_ref, n=n, floor_ulps=8.0,
                    cancel_scale=_dx_scale(x, s, dy, layer, scale_offset=offset))
  _assert_param_grad_close("dscale", dscale.reshape(n), dscale_ref, m=m)
  if layer:
    _assert_param_grad_close("dbias", dbias.reshape(n), dbias_ref, m=m)
  else:
    assert dbias is None
