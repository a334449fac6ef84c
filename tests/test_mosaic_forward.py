"""The Pallas Mosaic GPU forward (kernels/mosaic_forward.py, issue #29): against the
reference norm and the Pallas (Triton lowering) backend, through JAX's Mosaic GPU
interpreter on CPU; CUDA lowering on CPU; compiled on the GPU (``--gpu``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import config as pn_config
from pallas_norm import reference
from pallas_norm.kernels import forward, mosaic_forward

ON_GPU = jax.default_backend() == "gpu"


def _inputs(m, n, dtype, *, layer, has_scale=True, has_bias=True, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  x = (jax.random.normal(k[0], (m, n)) * 2 + (1.5 if layer else 0.0)).astype(dtype)
  s = (1 + 0.1 * jax.random.normal(k[1], (n,))) if has_scale else None
  b = 0.1 * jax.random.normal(k[2], (n,)) if layer and has_bias else None
  return x, s, b


def _ulp_close(got, want, dtype, what):
  """Within 2 ulps of ``dtype`` at each value's magnitude, and at least 2^-20 relative:
  the row sums are taken in another order, so rstd may differ by an ulp of float32 and
  y by one more rounding (float32 y on the H200: 16 of 4.2 M elements of a LayerNorm
  4097x1024 were 4 ulps apart, h200_2026-11-24_gpu-check_mosaic_a8946c4.log)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  eps = max(2 * float(jnp.finfo(dtype).eps), 2.0**-20)
  np.testing.assert_allclose(got, want, rtol=eps, atol=eps, err_msg=what)


_CASES = [  # m, n, dtype, layer, has_scale, has_bias, scale_offset, config
    (10, 256, jnp.bfloat16, True, True, True, 0.0, None),  # a ragged last row block
    (9, 384, jnp.float32, False, True, False, 0.0, None),  # 3 chunks of 128
    (37, 512, jnp.float16, True, False, True, 0.0, None),  # bias only
    (21, 256, jnp.bfloat16, False, True, False, 1.0,  # one stage, 2 programs
     mosaic_forward.MosaicForwardConfig(block_m=8, block_w=128, num_stages=1,
                                        num_programs=2)),
    # y staged in its x slot: 2 stages (refill one step behind), 3 programs over 6 row
    # blocks, and 3 stages with one program over 5 blocks (every slot refilled)
    (41, 256, jnp.bfloat16, True, True, True, 0.0,
     mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=2,
                                        num_programs=3, y_in_place=True)),
    (20, 384, jnp.float32, False, True, False, 0.0,
     mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=3,
                                        num_programs=1, y_in_place=True)),
    # each warp with whole rows (the interpreter ignores register layouts: on the GPU
    # test_gpu_matches_pallas), one warpgroup
    (13, 256, jnp.bfloat16, True, True, True, 0.0,
     mosaic_forward.MosaicForwardConfig(block_m=8, block_w=128, num_stages=2,
                                        num_programs=2, y_in_place=True,
                                        warp_rows=True)),
    # two warpgroups a program, each with half the columns, the row sums exchanged
    # (the interpreter runs each warpgroup in a thread: more than the CPU's 2 cores
    # would deadlock its callbacks, so 4 warpgroups are tested on the GPU only)
    (10, 512, jnp.bfloat16, True, True, True, 0.0,
     mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=2,
                                        num_programs=2, y_in_place=True,
                                        num_warpgroups=2, warp_rows=True)),
    (9, 512, jnp.float32, False, True, False, 1.0,
     mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=1,
                                        num_programs=3, num_warpgroups=2,
                                        warp_rows=True)),
    # warp-specialised: a producer warpgroup loads, one consumer computes (2 stages over
    # 3 row blocks a program: a slot released and refilled)
    (23, 256, jnp.bfloat16, True, True, True, 0.0,
     mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=2,
                                        num_programs=2, warp_specialized=True)),
]


@pytest.mark.parametrize("m,n,dtype,layer,has_scale,has_bias,scale_offset,cfg", _CASES)
def test_matches_reference_and_pallas(m, n, dtype, layer, has_scale, has_bias,
                                      scale_offset, cfg):
  x, s, b = _inputs(m, n, dtype, layer=layer, has_scale=has_scale, has_bias=has_bias)
  eps = 1e-5
  kw = dict(eps=eps, scale_offset=scale_offset, subtract_mean=layer, interpret=not ON_GPU)
  y, mean, rstd = mosaic_forward.norm_forward(x, s, b, config=cfg, **kw)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert (mean is None) == (not layer) and rstd.shape == (m,)
  yr, mr, rr = reference.norm(x, s, b, eps=eps, scale_offset=scale_offset,
                              subtract_mean=layer)
  _ulp_close(y, yr, dtype, "y vs reference")
  _ulp_close(rstd, rr, jnp.float32, "rstd")
  if layer:
    _ulp_close(mean, mr, jnp.float32, "mean")
  yp, _, _ = forward.norm_forward(
      x, s, b, config=pn_config.forward_config(m, n, dtype, subtract_mean=layer), **kw)
  _ulp_close(y, yp, dtype, "y vs the Pallas backend")
  y2, mean2, rstd2 = mosaic_forward.norm_forward(x, s, b, config=cfg, **kw)
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y, np.float32))
  y3, mean3, rstd3 = mosaic_forward.norm_forward(x, s, b, config=cfg,
                                                 return_residuals=False, **kw)
  assert mean3 is None and rstd3 is None
  np.testing.assert_array_equal(np.asarray(y3, np.float32), np.asarray(y, np.float32))


def test_errors():
  x, s, b = _inputs(4, 200, jnp.bfloat16, layer=True)
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=True, interpret=True)
  with pytest.raises(NotImplementedError, match="multiple of 128"):
    mosaic_forward.norm_forward(x, s, b, **kw)
  x, s, b = _inputs(4, 32768, jnp.bfloat16, layer=True)
  with pytest.raises(NotImplementedError, match="shared memory"):
    mosaic_forward.norm_forward(x, s, b, **kw)
  for bad in (2, 6, 0, 64):
    with pytest.raises(ValueError, match="block_m"):
      mosaic_forward.MosaicForwardConfig(block_m=bad, block_w=128, num_stages=1,
                                         num_programs=1)
  with pytest.raises(ValueError, match="block_w"):
    mosaic_forward.MosaicForwardConfig(block_m=4, block_w=64, num_stages=1, num_programs=1)
  with pytest.raises(ValueError, match="num_stages"):  # in place: a slot refilled behind
    mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=1,
                                       num_programs=1, y_in_place=True)
  with pytest.raises(ValueError, match="num_warpgroups"):
    mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=1,
                                       num_programs=1, num_warpgroups=3, warp_rows=True)
  with pytest.raises(ValueError, match="warp_specialized needs"):
    mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=2,
                                       num_programs=1, y_in_place=True,
                                       warp_specialized=True)
  with pytest.raises(ValueError, match="warp_rows=True"):  # rows over the warpgroup race
    mosaic_forward.MosaicForwardConfig(block_m=4, block_w=128, num_stages=1,
                                       num_programs=1, num_warpgroups=2)
  x, s, b = _inputs(4, 384, jnp.bfloat16, layer=True)  # 3 chunks over 2 warpgroups
  with pytest.raises(ValueError, match="num_warpgroups"):
    mosaic_forward.norm_forward(x, s, b, config=mosaic_forward.MosaicForwardConfig(
        block_m=4, block_w=128, num_stages=1, num_programs=1, num_warpgroups=2,
        warp_rows=True), **kw)


def test_default_config():
  """Three or two programs a SM where they fit; else one, with two warpgroups; whole
  rows a warp (figures in forward_config's docstring)."""
  h100 = pn_config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
  cfg = mosaic_forward.forward_config(8192, 4096, jnp.bfloat16, True, h100)
  assert (cfg.num_programs, cfg.num_warpgroups, cfg.y_in_place) == (264, 1, True)
  assert cfg.warp_rows
  cfg = mosaic_forward.forward_config(8192, 2048, jnp.bfloat16, True, h100)
  assert (cfg.num_programs, cfg.num_stages) == (396, 3)  # three a SM
  cfg = mosaic_forward.forward_config(4096, 8192, jnp.bfloat16, True, h100)
  assert (cfg.num_programs, cfg.num_warpgroups, cfg.warp_rows) == (132, 2, True)
  assert cfg.num_stages == 2 and cfg.y_in_place


@pytest.mark.cpu_only
def test_lowers_for_cuda():
  """Lowers for CUDA on CPU (Mosaic GPU lowers in Python): the bench's LayerNorm
  8192 x 4096 bf16 and an f32 RMSNorm."""
  four = mosaic_forward.MosaicForwardConfig(4, 256, 2, 264, y_in_place=True,
                                            num_warpgroups=4, warp_rows=True)
  rows = mosaic_forward.MosaicForwardConfig(8, 128, 2, 264, y_in_place=True,
                                            warp_rows=True)
  for m, n, dtype, layer, cfg in ((8192, 4096, jnp.bfloat16, True, None),
                                  (40, 768, jnp.float32, False, None),
                                  (8192, 4096, jnp.bfloat16, True, four),
                                  (40, 768, jnp.float32, False, rows)):
    specs = [jax.ShapeDtypeStruct((m, n), dtype), jax.ShapeDtypeStruct((n,), jnp.float32)]

    def f(x, s, layer=layer, cfg=cfg):
      return mosaic_forward.norm_forward(x, s, s if layer else None, eps=1e-5,
                                         scale_offset=0.0, subtract_mean=layer,
                                         config=cfg, interpret=False)

    text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  # the fused residual add, h in float32 (a tile of its own)
  spec = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
  g = lambda x, r, s: mosaic_forward.norm_forward(
      x, s, s, eps=1e-5, scale_offset=0.0, subtract_mean=True, interpret=False,
      residual=r, residual_dtype=jnp.float32)
  text = jax.jit(g).trace(spec, spec, jax.ShapeDtypeStruct((2048,), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  # cast="llama" with float32 scale: y in float32, a tile of its own
  ll = lambda x, s: mosaic_forward.norm_forward(
      x, s, None, eps=1e-5, scale_offset=0.0, subtract_mean=False, interpret=False,
      cast="llama")
  text = jax.jit(ll).trace(spec, jax.ShapeDtypeStruct((2048,), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


_RES_CASES = [  # m, n, x dtype, residual dtype, h dtype (None: residual's), layer, config
    (10, 256, jnp.bfloat16, jnp.bfloat16, None, True, None),
    (9, 384, jnp.bfloat16, jnp.float32, jnp.float32, False, None),  # fp32 residual stream
    (41, 256, jnp.bfloat16, jnp.bfloat16, None, True,  # y in place, slots refilled
     mosaic_forward.MosaicForwardConfig(4, 128, 2, 3, y_in_place=True)),
    (9, 512, jnp.bfloat16, jnp.bfloat16, None, True,  # two warpgroups
     mosaic_forward.MosaicForwardConfig(4, 128, 1, 3, num_warpgroups=2, warp_rows=True)),
    (23, 256, jnp.float16, jnp.bfloat16, jnp.float32, True,  # warp-specialised
     mosaic_forward.MosaicForwardConfig(4, 128, 2, 2, warp_specialized=True)),
]
if ON_GPU:  # real shapes, compiled
  _RES_CASES += [(8192, 4096, jnp.bfloat16, jnp.bfloat16, None, True, None),
                 (8192, 2048, jnp.bfloat16, jnp.float32, jnp.float32, False, None),
                 (1000, 768, jnp.bfloat16, jnp.bfloat16, jnp.float32, True, None)]


@pytest.mark.parametrize("m,n,dtype,rdt,hdt,layer,cfg", _RES_CASES)
def test_residual_matches_pallas(m, n, dtype, rdt, hdt, layer, cfg):
  """residual= (the fused residual add): y, h, mean and rstd against the Pallas
  backend's fused kernel (h bitwise: the same float32 sum, one rounding)."""
  k = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(k[0], (m, n)).astype(dtype)
  r = (2 * jax.random.normal(k[1], (m, n)) + 1).astype(rdt)
  s = 1 + 0.1 * jax.random.normal(k[2], (n,))
  b = 0.1 * jax.random.normal(k[3], (n,)) if layer else None
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=not ON_GPU,
            residual=r, residual_dtype=hdt)
  y, mean, rstd, h = mosaic_forward.norm_forward(x, s, b, config=cfg, **kw)
  yp, mp, rp, hp = forward.norm_forward(
      x, s, b, config=pn_config.forward_config(m, n, dtype, subtract_mean=layer,
                                               residual=True), **kw)
  assert h.dtype == jnp.dtype(hdt or rdt) and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hp, np.float32))
  _ulp_close(y, yp, dtype, "y")
  _ulp_close(rstd, rp, jnp.float32, "rstd")
  if layer:
    _ulp_close(mean, mp, jnp.float32, "mean")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dtype,layer", [
    (8192, 4096, jnp.bfloat16, True), (8192, 4096, jnp.bfloat16, False),
    (1000, 768, jnp.bfloat16, True), (333, 8192, jnp.float16, False),
    (4097, 1024, jnp.float32, True)])
def test_gpu_matches_pallas(m, n, dtype, layer):
  x, s, b = _inputs(m, n, dtype, layer=layer)
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
  yp, mp, rp = forward.norm_forward(
      x, s, b, config=pn_config.forward_config(m, n, dtype, subtract_mean=layer), **kw)
  dflt = mosaic_forward.forward_config(m, n, dtype, layer)
  sms = pn_config.device_info().num_sms
  for cfg in (None,  # the default, then y in place with two and three programs a SM
              mosaic_forward.MosaicForwardConfig(dflt.block_m, dflt.block_w, 2, 2 * sms,
                                                 y_in_place=True),
              mosaic_forward.MosaicForwardConfig(4, dflt.block_w, 2, 3 * sms,
                                                 y_in_place=True),
              # each warp with whole rows: one warpgroup, then two and four a program
              # (whole chunks each: N / 128 of them)
              mosaic_forward.MosaicForwardConfig(4, dflt.block_w, 2, 2 * sms,
                                                 y_in_place=True, warp_rows=True),
              mosaic_forward.MosaicForwardConfig(4, 128, 2, 2 * sms, y_in_place=True,
                                                 num_warpgroups=2, warp_rows=True),
              mosaic_forward.MosaicForwardConfig(4, 128, 2, sms, y_in_place=True,
                                                 num_warpgroups=4, warp_rows=True),
              # warp-specialised: a producer warpgroup, one or two consumers
              mosaic_forward.MosaicForwardConfig(4, 128, 2, sms, warp_specialized=True),
              mosaic_forward.MosaicForwardConfig(4, 128, 2, sms, num_warpgroups=2,
                                                 warp_rows=True, warp_specialized=True)):
    if cfg is not None and (n // cfg.block_w) % cfg.num_warpgroups:
      continue  # the warpgroups need whole chunks each (test_errors)
    if cfg is not None and cfg.warp_specialized and n * x.dtype.itemsize > 8192:
      continue  # its y tile of its own does not fit beside 2 stages (test_errors)
    y, mean, rstd = mosaic_forward.norm_forward(x, s, b, config=cfg, **kw)
    _ulp_close(y, yp, dtype, f"y {cfg}")
    _ulp_close(rstd, rp, jnp.float32, f"rstd {cfg}")


# --------------------------------------------------------------------------- ops


@pytest.mark.parametrize("op,shape,dtype,mode", [
    ("layer", (2, 5, 256), jnp.bfloat16, None),
    ("rms", (9, 384), jnp.float32, "static_persistent"),
])
def test_ops_backend_mosaic(op, shape, dtype, mode):
  """pallas_norm.rms_norm / layer_norm(backend="mosaic"): y and the grads (dx, dscale,
  dbias) of a jitted value_and_grad against backend="pallas" (Mosaic GPU interpreter
  on CPU, compiled with --gpu); rank 3 included."""
  import pallas_norm
  layer = op == "layer"
  n = shape[-1]
  k = jax.random.split(jax.random.key(3), 4)
  x = (jax.random.normal(k[0], shape) * 2 + 0.5).astype(dtype)
  s = 1 + 0.1 * jax.random.normal(k[1], (n,))
  b = 0.1 * jax.random.normal(k[2], (n,))
  w = jax.random.normal(k[3], shape)

  def loss(backend):
    def f(x, s, b):
      y = (pallas_norm.layer_norm(x, s, b, backend=backend, mode=mode) if layer
           else pallas_norm.rms_norm(x, s, backend=backend, mode=mode))
      return jnp.sum(y.astype(jnp.float32) * w), y
    return f

  (l1, y1), g1 = jax.jit(jax.value_and_grad(loss("mosaic"), (0, 1, 2), has_aux=True))(x, s, b)
  (l2, y2), g2 = jax.jit(jax.value_and_grad(loss("pallas"), (0, 1, 2), has_aux=True))(x, s, b)
  _ulp_close(y1, y2, dtype, "y")
  eps = 2 * float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(g1[0], np.float64), np.asarray(g2[0], np.float64),
                             rtol=eps, atol=eps * float(jnp.abs(g2[0]).max()), err_msg="dx")
  for name, a, c in (("dscale", g1[1], g2[1]), ("dbias", g1[2], g2[2])):
    if layer or name == "dscale":
      np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5,
                                 atol=1e-5 * float(jnp.abs(c).max()), err_msg=name)


_X64_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import pallas_norm
out = {}
for op in ("rms", "layer"):
  f = pallas_norm.layer_norm if op == "layer" else pallas_norm.rms_norm
  x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32)
  s = 1 + 0.1 * jax.random.normal(jax.random.key(1), (256,), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (8, 256), jnp.float32)
  run = lambda be: jax.jit(jax.value_and_grad(
      lambda x, s: jnp.sum(f(x, s, backend=be) * w), (0, 1)))(x, s)
  l0, g0 = run("xla")
  for be in ("mosaic", "pallas"):
    l1, g1 = run(be)
    out[op + "-" + be] = dict(
        loss=abs(float(l1 - l0)) / abs(float(l0)),
        dtypes=[str(a.dtype) for a in g1],
        grads=[float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g1, g0)])
print(json.dumps(out))
"""


def test_ops_under_x64():
  """With jax_enable_x64 on (a user's global setting; JAX_ENABLE_X64=1, in a process of
  its own), the kernels' index arithmetic stays int32: the loss and the grads of x and
  scale, backend="mosaic" and "pallas", as backend="xla" gives them. (Until 2026-11-27
  backend="mosaic" raised a TypeError from lax.rem under x64.)"""
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_ENABLE_X64="1")
  r = subprocess.run([sys.executable, "-c", _X64_SCRIPT], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert len(out) == 4
  for k, v in out.items():
    assert v["loss"] < 1e-5, (k, v)
    assert v["dtypes"] == ["float32", "float32"], (k, v)
    assert max(v["grads"]) < 1e-4, (k, v)


def test_ops_backend_mosaic_refuses():
  """What backend="mosaic" does not serve yet: NotImplementedError before any kernel."""
  import pallas_norm
  x = jnp.ones((4, 256), jnp.bfloat16)
  s = jnp.ones((256,))
  for kw, match in ((dict(mode="multi_wave_cached"), "static_persistent"),):
    with pytest.raises(NotImplementedError, match=match):
      pallas_norm.rms_norm(x, s, backend="mosaic", **kw)
  with pytest.raises(NotImplementedError, match="FP8"):
    pallas_norm.rms_norm(x.astype(jnp.float8_e4m3fn), s, backend="mosaic",
                         x_scale=jnp.ones((4, 16)))
  with pytest.raises(NotImplementedError, match="multiple of 128"):
    pallas_norm.rms_norm(jnp.ones((4, 200), jnp.bfloat16), backend="mosaic")
  wide = jnp.ones((4, 8192), jnp.float32)
  with pytest.raises(NotImplementedError, match="shared memory"):  # x, r, y and h tiles
    pallas_norm.rms_norm(wide, backend="mosaic", residual=wide)


@pytest.mark.parametrize("op,shape,dtype,residual_dtype,res_in", [
    ("layer", (2, 5, 256), jnp.bfloat16, None, jnp.bfloat16),
    ("rms", (9, 384), jnp.bfloat16, jnp.float32, jnp.float32),  # an fp32 residual stream
    ("rms", (7, 256), jnp.float16, jnp.float32, jnp.bfloat16),  # h in a third dtype
])
def test_ops_backend_mosaic_residual(op, shape, dtype, residual_dtype, res_in):
  """residual= (the fused residual add) on backend="mosaic": y, h and the grads of x,
  residual, scale (and bias) of a jitted vjp with cotangents on y and h, against
  backend="pallas" (Mosaic GPU interpreter on CPU, compiled with --gpu)."""
  import pallas_norm
  layer = op == "layer"
  n = shape[-1]
  k = jax.random.split(jax.random.key(4), 6)
  x = jax.random.normal(k[0], shape).astype(dtype)
  r = (2 * jax.random.normal(k[1], shape) + 0.5).astype(res_in)
  s = 1 + 0.1 * jax.random.normal(k[2], (n,))
  b = 0.1 * jax.random.normal(k[3], (n,))
  h_dt = jnp.dtype(residual_dtype or res_in)
  dy = jax.random.normal(k[4], shape).astype(dtype)
  dh = jax.random.normal(k[5], shape).astype(h_dt)

  def run(backend):
    def f(x, r, s, b):
      if layer:
        return pallas_norm.layer_norm(x, s, b, residual=r, residual_dtype=residual_dtype,
                                      backend=backend)
      return pallas_norm.rms_norm(x, s, residual=r, residual_dtype=residual_dtype,
                                  backend=backend)
    (y, h), pull = jax.vjp(f, x, r, s, b)
    return (y, h, *pull((dy, dh)))

  got, want = jax.jit(lambda: run("mosaic"))(), jax.jit(lambda: run("pallas"))()
  assert got[1].dtype == h_dt and got[3].dtype == r.dtype and got[2].dtype == x.dtype
  _ulp_close(got[0], want[0], dtype, "y")
  np.testing.assert_array_equal(np.asarray(got[1], np.float32),
                                np.asarray(want[1], np.float32), err_msg="h")
  for name, g, w, dt in (("dx", got[2], want[2], dtype), ("dresidual", got[3], want[3], r.dtype)):
    eps = 2 * float(jnp.finfo(dt).eps)
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=eps, atol=eps * float(jnp.abs(w.astype(jnp.float32)).max()),
                               err_msg=name)
  for name, g, w in (("dscale", got[4], want[4]), ("dbias", got[5], want[5])):
    if layer or name == "dscale":
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                                 atol=1e-5 * float(jnp.abs(w).max()), err_msg=name)


@pytest.mark.parametrize("op,shape,dtype,param_dtype,residual", [
    ("rms", (9, 384), jnp.bfloat16, jnp.float32, False),  # y in float32: a tile of its own
    ("rms", (2, 5, 256), jnp.bfloat16, jnp.bfloat16, False),  # y in place
    ("layer", (10, 256), jnp.float16, jnp.float32, True),  # with a residual and a bias
])
def test_ops_backend_mosaic_llama(op, shape, dtype, param_dtype, residual):
  """cast="llama" (HF LlamaRMSNorm's roundings) on backend="mosaic": y (in the promoted
  dtype) and the grads of a jitted vjp against backend="xla" (the jnp formula; not
  the Pallas backend here: in interpret mode XLA's excess precision drops its
  kernels' round trip of x_hat through x's dtype, --xla_allow_excess_precision)."""
  import pallas_norm
  layer = op == "layer"
  n = shape[-1]
  k = jax.random.split(jax.random.key(7), 5)
  x = (2 * jax.random.normal(k[0], shape)).astype(dtype)
  r = jax.random.normal(k[1], shape).astype(dtype) if residual else None
  s = (1 + 0.1 * jax.random.normal(k[2], (n,))).astype(param_dtype)
  b = (0.1 * jax.random.normal(k[3], (n,))).astype(param_dtype)

  def run(backend):
    def f(x, s, b):
      kw = dict(cast="llama", backend=backend, residual=r)
      y = (pallas_norm.layer_norm(x, s, b, **kw) if layer
           else pallas_norm.rms_norm(x, s, **kw))
      return y[0] if residual else y
    y, pull = jax.vjp(f, x, s, b)
    dy = jax.random.normal(k[4], shape).astype(y.dtype)
    return (y, *pull(dy))

  got, want = jax.jit(lambda: run("mosaic"))(), jax.jit(lambda: run("xla"))()
  assert got[0].dtype == want[0].dtype == jnp.result_type(dtype, param_dtype)
  _ulp_close(got[0], want[0], got[0].dtype, "y")
  eps = 2 * float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(got[1], np.float64), np.asarray(want[1], np.float64),
                             rtol=eps, atol=eps * float(jnp.abs(want[1]).max()), err_msg="dx")
  # dscale sums dy against x_hat rounded to x's dtype; with a residual the kernels take
  # x_hat from the saved h (in the residual's dtype), the formula from the float32 sum
  tol = 2 * float(jnp.finfo(dtype if residual else param_dtype).eps)
  for name, g, w in (("dscale", got[2], want[2]), ("dbias", got[3], want[3])):
    if layer or name == "dscale":
      np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                 rtol=tol, atol=tol * float(jnp.abs(w).max()), err_msg=name)
