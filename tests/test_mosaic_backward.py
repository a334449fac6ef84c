"""The Mosaic GPU backward (``kernels/mosaic_backward.py``) against the Pallas backend's
(``kernels/backward.py``) and the reference's vjp.

On CPU both run in their interpreters (Mosaic GPU's: ``InterpretGPUParams``); with
``--gpu`` both are compiled. dx within 1 ulp of the Pallas backend's (its dtype), dscale
and dbias within sqrt(M) float32 ulps of their magnitude plus one rounding to their
dtype; both backends within float32 tolerances of the reference's vjp; two runs bitwise
equal. ``test_lowers_for_cuda`` lowers the compiled kernels for CUDA on any machine
(Mosaic GPU lowers in Python), which is what catches a register layout Mosaic GPU
cannot lower without a GPU.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import config as pn_config
from pallas_norm import reference
from pallas_norm.kernels import backward, mosaic_backward

_INTERPRET = jax.default_backend() != "gpu"


def _inputs(m, n, dtype, *, layer, has_scale=True, has_bias=None, scale_offset=0.0,
            seed=0):
  """(dy, x, scale, mean, rstd, kwargs of norm_backward, reference kwargs, bias)."""
  k = jax.random.split(jax.random.key(seed), 4)
  x = (jax.random.normal(k[0], (m, n), jnp.float32) + (2.0 if layer else 0.0)).astype(dtype)
  dy = jax.random.normal(k[1], (m, n), jnp.float32).astype(dtype)
  scale = (1.0 + 0.2 * jax.random.normal(k[2], (n,), jnp.float32)).astype(dtype)
  bias = (0.1 * jax.random.normal(k[3], (n,), jnp.float32)).astype(dtype)
  scale = scale if has_scale else None
  bias = bias if (layer if has_bias is None else has_bias) else None
  ref_kw = dict(eps=1e-5, scale_offset=scale_offset, subtract_mean=layer)
  _, mean, rstd = reference.norm(x, scale, bias, **ref_kw)
  kw = dict(has_bias=bias is not None, scale_offset=scale_offset, subtract_mean=layer,
            interpret=_INTERPRET, scale_dtype=jnp.dtype(dtype), bias_dtype=jnp.dtype(dtype))
  return dy, x, scale, mean if layer else None, rstd, kw, ref_kw, bias


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _ulp(a, dtype):
  """One ulp of ``dtype`` at |a| (float64 array; the smallest normal's below it)."""
  fi = jnp.finfo(dtype)
  expo = np.floor(np.log2(np.maximum(np.abs(a), float(fi.tiny))))
  return 2.0 ** (expo - fi.nmant)


def _check_dx(got, want, dtype):
  """1 ulp of dx's dtype, plus the float32 rounding of the row sums carried through the
  cancellation in g - (x_hat c1 + c2) (8 float32 ulps of the row's largest dx; below a
  bf16/f16 ulp, visible in float32 where dx is near 0)."""
  g, w = _f64(got), _f64(want)
  err = np.abs(g - w)
  tol = (_ulp(np.maximum(np.abs(g), np.abs(w)), dtype)
         + 8 * 2.0 ** -24 * np.abs(w).max(axis=1, keepdims=True))
  assert np.all(err <= tol), f"{np.sum(err > tol)} of {err.size} dx values apart"


def _check_sum(got, want, m, dtype):
  """A column sum of M float32 terms, cast to ``dtype``: another order of the same sum
  (sqrt(M) float32 ulps of the largest sum, plus one rounding to ``dtype``)."""
  g, w = _f64(got), _f64(want)
  tol = math.sqrt(m) * 2.0 ** -23 * (np.abs(w).max() + 1.0) + _ulp(w, dtype)
  assert np.all(np.abs(g - w) <= tol), np.abs(g - w).max()


# (m, n, dtype, layer, has_scale, has_bias, scale_offset, config or None)
_CASES = [
    (37, 384, "bfloat16", True, True, True, 0.0, None),  # ragged M, 128-column chunks
    (24, 256, "float32", False, True, False, 0.0, None),
    (13, 1000, "float16", False, True, False, 1.0, None),  # ragged N: a partial chunk
    (5, 128, "float32", True, False, False, 0.0, None),  # no scale, no bias
    (7, 200, "bfloat16", True, False, True, 0.0, None),  # bias only, N < one chunk
    # one row a block, one stage, more programs than the CPU's 4: 3 row blocks each
    (9, 512, "bfloat16", True, True, True, 0.0,
     mosaic_backward.MosaicBackwardConfig(block_m=1, block_w=256, num_stages=1,
                                          num_programs=3)),
    # 3 stages, 128-column chunks of a 256-column row, 2 programs
    (21, 256, "float32", True, True, True, 0.0,
     mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=3,
                                          num_programs=2)),
    # two warpgroups, each with half the columns, the row sums exchanged (4 only on
    # the GPU: the interpreter runs each in a thread, more than CI's 2 cores deadlock)
    (10, 512, "bfloat16", True, True, True, 0.0,
     mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=2,
                                          num_programs=2, num_warpgroups=2,
                                          warp_rows=True)),
    (9, 1000, "float32", False, True, False, 1.0,  # a partial last chunk, 3 programs
     mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=1,
                                          num_programs=3, num_warpgroups=2,
                                          warp_rows=True)),
    # each warp with whole rows, one warpgroup: the partials a row of the block at a
    # time, summed at the end (register layouts: on the GPU, test_gpu_matches_pallas)
    (13, 384, "bfloat16", True, True, True, 0.0,
     mosaic_backward.MosaicBackwardConfig(block_m=8, block_w=128, num_stages=2,
                                          num_programs=2, warp_rows=True)),
    # warp-specialised: a producer warpgroup loads, one consumer computes (2 stages over
    # 3 row blocks a program: a slot released and refilled; 2 threads in the interpreter)
    (23, 256, "bfloat16", True, True, True, 0.0,
     mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=2,
                                          num_programs=2, warp_specialized=True)),
    (9, 384, "float32", False, True, False, 1.0,  # RMSNorm, one stage
     mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=1,
                                          num_programs=2, warp_specialized=True)),
]


@pytest.mark.parametrize("m,n,dtype,layer,has_scale,has_bias,scale_offset,cfg", _CASES)
def test_matches_pallas_and_reference(m, n, dtype, layer, has_scale, has_bias, scale_offset,
                                      cfg):
  dy, x, scale, mean, rstd, kw, ref_kw, bias = _inputs(
      m, n, dtype, layer=layer, has_scale=has_scale, has_bias=has_bias,
      scale_offset=scale_offset)
  got = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, config=cfg, **kw)
  pallas = backward.norm_backward(
      dy, x, scale, mean, rstd,
      config=pn_config.backward_config(m, n, x.dtype, subtract_mean=layer), **kw)
  assert got[0].shape == x.shape and got[0].dtype == x.dtype
  assert (got[1] is None) == (scale is None) and (got[2] is None) == (bias is None)
  _check_dx(got[0], pallas[0], dtype)
  for g, p in zip(got[1:], pallas[1:]):
    if p is not None:
      assert g.shape == (n,) and g.dtype == jnp.dtype(dtype)
      _check_sum(g, p, m, dtype)
  # both against the reference's vjp (float32 math, so only rounding apart)
  _, pull = jax.vjp(lambda x, s, b: reference.norm(x, s, b, **ref_kw)[0], x, scale, bias)
  want = pull(dy)
  for g, w in zip(got, want):
    if w is not None:
      w = _f64(w)
      tol = 4 * float(jnp.finfo(dtype).eps) * max(1.0, np.abs(w).max()) * (
          1 if g.ndim == 2 else math.sqrt(m))
      np.testing.assert_allclose(_f64(g), w, rtol=0, atol=tol)


def test_deterministic():
  """Two runs of the same inputs are bitwise equal (no atomics; fixed sum orders)."""
  dy, x, scale, mean, rstd, kw, _, _ = _inputs(29, 256, "bfloat16", layer=True)
  a = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, **kw)
  b = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, **kw)
  for u, v in zip(a, b):
    np.testing.assert_array_equal(np.asarray(u.view(jnp.uint16)), np.asarray(v.view(jnp.uint16)))


def test_other_backends_config_ignored():
  """ops passes a config.BackwardConfig: the module's own default is used instead."""
  dy, x, scale, mean, rstd, kw, _, _ = _inputs(6, 128, "float32", layer=False)
  other = pn_config.backward_config(6, 128, x.dtype)
  a = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, config=other, **kw)
  b = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, **kw)
  for u, v in zip(a, b):
    if u is not None:
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_default_config():
  cfg = mosaic_backward.backward_config(8192, 4096, jnp.bfloat16, True)
  assert cfg.num_programs <= 256 and cfg.block_w == 256 and cfg.num_stages >= 2
  small = mosaic_backward.backward_config(3, 760, jnp.bfloat16, False)
  assert small.num_programs == 1 and small.block_w == 256  # one row block; 768 / 256


def test_lowers_for_cuda():
  """Both stages lower for CUDA (Mosaic GPU lowers in Python, no GPU needed): the
  bench's LayerNorm 8192 x 4096 bf16 and a ragged f32 RMSNorm."""
  four = mosaic_backward.MosaicBackwardConfig(4, 256, 2, 132, num_warpgroups=4,
                                              warp_rows=True)
  ws = mosaic_backward.MosaicBackwardConfig(4, 256, 2, 132, warp_specialized=True)
  ws2 = mosaic_backward.MosaicBackwardConfig(4, 128, 2, 132, num_warpgroups=2,
                                             warp_rows=True, warp_specialized=True)
  for m, n, dtype, layer, cfg in ((8192, 4096, jnp.bfloat16, True, None),
                                  (40, 760, jnp.float32, False, None),
                                  (8192, 4096, jnp.bfloat16, True, four),
                                  (8192, 4096, jnp.bfloat16, True, ws),
                                  (8192, 2048, jnp.bfloat16, False, ws2)):
    dy, x, scale, mean, rstd, kw, _, _ = _inputs(8, n, dtype, layer=layer)
    kw = dict(kw, interpret=False, config=cfg)
    specs = [jax.ShapeDtypeStruct((m, n), dtype)] * 2 + [
        jax.ShapeDtypeStruct((n,), dtype), jax.ShapeDtypeStruct((m,), jnp.float32)]

    def f(dy, x, s, r, kw=kw, layer=layer):
      return mosaic_backward.norm_backward(dy, x, s, r if layer else None, r, **kw)

    text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  # the fused residual add: h and dh in float32, dx in bf16 and dresidual in float32
  h = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)
  dy = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
  st = jax.ShapeDtypeStruct((8192,), jnp.float32)
  g = lambda dy, h, dh, s, r: mosaic_backward.norm_backward(
      dy, h, s, r, r, has_bias=True, scale_offset=0.0, subtract_mean=True,
      interpret=False, scale_dtype=jnp.float32, bias_dtype=jnp.float32, dh=dh,
      dx_dtype=jnp.bfloat16, residual_dtype=jnp.float32)
  text = jax.jit(g).trace(dy, h, h, jax.ShapeDtypeStruct((2048,), jnp.float32), st).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  # cast="llama": bf16 x, float32 dy (y's dtype), the roundings transposed
  x = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
  ll = lambda dy, x, s, r: mosaic_backward.norm_backward(
      dy, x, s, None, r, has_bias=False, scale_offset=0.0, subtract_mean=False,
      interpret=False, scale_dtype=jnp.float32, cast=("bfloat16", "float32"))
  text = jax.jit(ll).trace(h, x, jax.ShapeDtypeStruct((2048,), jnp.float32), st).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("n,dtype,match", [
    (100, "bfloat16", "16 bytes"),  # 200-byte rows: no TMA
    (65536, "bfloat16", "registers"),  # LayerNorm's two partials of 512 f32 a thread
])
def test_not_implemented(n, dtype, match):
  dy, x, scale, mean, rstd, kw, _, _ = _inputs(2, n, dtype, layer=True)
  with pytest.raises(NotImplementedError, match=match):
    mosaic_backward.norm_backward(dy, x, scale, mean, rstd, **kw)


def test_errors():
  dy, x, scale, mean, rstd, kw, _, _ = _inputs(4, 128, "float32", layer=True)
  with pytest.raises(NotImplementedError, match="combine_row_sums"):
    mosaic_backward.norm_backward(dy, x, scale, mean, rstd,
                                  combine_row_sums=lambda c1, c2: (c1, c2), **kw)
  with pytest.raises(ValueError, match="block_w"):
    mosaic_backward.norm_backward(
        dy, x, scale, mean, rstd, config=mosaic_backward.MosaicBackwardConfig(
            block_m=1, block_w=256, num_stages=1, num_programs=1), **kw)
  for bad in (2, 3, 6):  # a row block's statistics would start misaligned for TMA
    with pytest.raises(ValueError, match="multiple of 4"):
      mosaic_backward.MosaicBackwardConfig(block_m=bad, block_w=128, num_stages=1,
                                           num_programs=1)
  for n in (256, 1024, 1280, 1536, 2048, 4096, 8192):  # the defaults never pick them
    assert mosaic_backward.backward_config(8192, n, jnp.bfloat16, False).block_m in (
        1, 4, 8, 16, 32)
  with pytest.raises(ValueError, match="block_m"):
    mosaic_backward.MosaicBackwardConfig(block_m=0, block_w=128, num_stages=1,
                                         num_programs=1)
  with pytest.raises(NotImplementedError, match="shared memory"):
    mosaic_backward.norm_backward(
        dy, x, scale, mean, rstd, config=mosaic_backward.MosaicBackwardConfig(
            block_m=32, block_w=128, num_stages=64, num_programs=1), **kw)
  with pytest.raises(ValueError, match="warp_rows=True"):  # rows over the warpgroup
    mosaic_backward.MosaicBackwardConfig(block_m=4, block_w=128, num_stages=1,
                                         num_programs=1, num_warpgroups=2)
  with pytest.raises(ValueError, match="warp_rows needs"):  # one-row blocks
    mosaic_backward.MosaicBackwardConfig(block_m=1, block_w=128, num_stages=1,
                                         num_programs=1, warp_rows=True)
  with pytest.raises(ValueError, match="num_warpgroups"):  # 1 chunk over 2
    mosaic_backward.norm_backward(
        dy, x, scale, mean, rstd, config=mosaic_backward.MosaicBackwardConfig(
            block_m=4, block_w=128, num_stages=1, num_programs=1, num_warpgroups=2,
            warp_rows=True), **kw)


_RES_CASES = [  # m, n, h dtype, x dtype (dx's), layer, config
    (10, 256, "bfloat16", "bfloat16", True, None),
    (9, 384, "float32", "bfloat16", False, None),  # fp32 residual stream: dresidual f32
    (23, 256, "bfloat16", "float16", True,  # warp-specialised
     mosaic_backward.MosaicBackwardConfig(4, 128, 2, 2, warp_specialized=True)),
    (10, 512, "bfloat16", "bfloat16", True,  # two warpgroups
     mosaic_backward.MosaicBackwardConfig(4, 128, 2, 2, num_warpgroups=2, warp_rows=True)),
    (9, 512, "float32", "bfloat16", True,  # one-row blocks, one stage
     mosaic_backward.MosaicBackwardConfig(1, 256, 1, 3)),
]
if not _INTERPRET:  # real shapes, compiled
  _RES_CASES += [(8192, 4096, "bfloat16", "bfloat16", True, None),
                 (8192, 2048, "float32", "bfloat16", False, None),
                 (1000, 768, "bfloat16", "bfloat16", True, None)]


@pytest.mark.parametrize("m,n,hdt,xdt,layer,cfg", _RES_CASES)
def test_residual_matches_pallas(m, n, hdt, xdt, layer, cfg):
  """The fused residual add's backward (x is h = x + residual; dh, h's cotangent, added
  to dx in float32; dx in x's dtype and dresidual in the residual's) against the Pallas
  backend's."""
  k = jax.random.split(jax.random.key(6), 5)
  h = (jax.random.normal(k[0], (m, n)) * 2 + 0.5).astype(hdt)
  dy = jax.random.normal(k[1], (m, n)).astype(xdt)
  dh = jax.random.normal(k[2], (m, n)).astype(hdt)
  s = 1 + 0.1 * jax.random.normal(k[3], (n,))
  b = 0.1 * jax.random.normal(k[4], (n,)) if layer else None
  ref_kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer)
  _, mean, rstd = reference.norm(h, s, b, **ref_kw)
  kw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=_INTERPRET,
            scale_dtype=jnp.float32, bias_dtype=jnp.float32 if layer else None, dh=dh,
            dx_dtype=jnp.dtype(xdt), residual_dtype=jnp.dtype(hdt))
  mean = mean if layer else None
  got = mosaic_backward.norm_backward(dy, h, s, mean, rstd, config=cfg, **kw)
  want = backward.norm_backward(
      dy, h, s, mean, rstd, config=pn_config.backward_config(
          m, n, jnp.dtype(hdt), subtract_mean=layer, residual=True), **kw)
  assert got[0].dtype == jnp.dtype(xdt) and got[1].dtype == jnp.dtype(hdt)
  _check_dx(got[0], want[0], xdt)
  _check_dx(got[1], want[1], hdt)
  for g, p in zip(got[2:], want[2:]):
    if p is not None:
      _check_sum(g, p, m, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dtype,layer", [
    (8192, 4096, "bfloat16", True), (8192, 4096, "bfloat16", False),
    (1000, 760, "bfloat16", True), (333, 8192, "float16", False), (4097, 1024, "float32", True),
])
def test_gpu_matches_pallas(m, n, dtype, layer):
  """Compiled, on the bench's shape and ragged ones, against the compiled Pallas
  backend; and deterministic."""
  dy, x, scale, mean, rstd, kw, _, _ = _inputs(m, n, dtype, layer=layer)
  pallas = backward.norm_backward(
      dy, x, scale, mean, rstd,
      config=pn_config.backward_config(m, n, x.dtype, subtract_mean=layer), **kw)
  dflt = mosaic_backward.backward_config(m, n, x.dtype, layer)
  cfgs = [None]
  if dflt.block_m > 1:  # each warp with whole rows, with one warpgroup (N <= 2048:
    # the partials take N / 32 floats a thread) and with two and four (whole chunks)
    chunks = mosaic_backward._padded(n) // 128
    cfgs += [dataclasses.replace(dflt, block_w=128, num_warpgroups=k, warp_rows=True)
             for k in (1, 2, 4) if chunks % k == 0 and n // k <= 2048]
  # warp-specialised (a producer warpgroup): on the default, and with two consumers
  cfgs.append(dataclasses.replace(dflt, warp_specialized=True))
  if dflt.block_m > 1 and (mosaic_backward._padded(n) // 128) % 2 == 0 and n <= 4096:
    cfgs.append(dataclasses.replace(dflt, block_w=128, num_warpgroups=2, warp_rows=True,
                                    warp_specialized=True))
  for cfg in cfgs:
    got = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, config=cfg, **kw)
    again = mosaic_backward.norm_backward(dy, x, scale, mean, rstd, config=cfg, **kw)
    _check_dx(got[0], pallas[0], dtype)
    for g, p in zip(got[1:], pallas[1:]):
      if p is not None:
        _check_sum(g, p, m, dtype)
    for u, v in zip(got, again):
      if u is not None:
        np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)),
                                      np.asarray(v.astype(jnp.float32)))
