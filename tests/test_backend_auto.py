"""backend=None: per kernel, the backend config.choose_backend measured faster, where it
serves the call; "pallas" otherwise and on CPU (issue #29)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import config, ops

H100 = config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
H200 = config.DeviceInfo("gpu", "NVIDIA H200", 132)
CPU = config.DeviceInfo("cpu", "cpu", 4)


@pytest.mark.parametrize("pass_,op,n,dtype,device,want", [
    ("bwd", "layer", 2048, jnp.bfloat16, H100, "mosaic"),   # the measured rules
    ("bwd", "layer", 1152, jnp.float16, H100, "mosaic"),
    ("bwd", "rms", 2048, jnp.bfloat16, H100, "triton"),
    ("bwd", "rms", 1024, jnp.bfloat16, H100, "triton"),
    ("bwd", "rms", 4096, jnp.bfloat16, H200, "triton"),
    ("bwd", "rms", 1024, jnp.bfloat16, H200, "pallas"),     # outside a rule's N range
    ("bwd", "layer", 1024, jnp.bfloat16, H100, "pallas"),
    ("bwd", "layer", 4096, jnp.bfloat16, H100, "pallas"),
    ("bwd", "rms", 8192, jnp.bfloat16, H100, "pallas"),
    ("fwd", "layer", 4096, jnp.bfloat16, H200, "triton"),
    ("fwd", "layer", 8192, jnp.bfloat16, H200, "triton"),
    ("fwd", "layer", 2048, jnp.bfloat16, H200, "pallas"),   # a tie there: no rule
    ("fwd", "rms", 4096, jnp.bfloat16, H200, "pallas"),
    ("fwd", "layer", 4096, jnp.bfloat16, H100, "pallas"),   # the H100 forward: no rule
    ("fwd", "rms", 2048, jnp.bfloat16, H100, "pallas"),
    ("bwd", "layer", 2048, jnp.float32, H100, "pallas"),    # 4-byte dtypes: unmeasured
    ("bwd", "layer", 2048, jnp.bfloat16, H200, "pallas"),   # another device
    ("bwd", "rms", 2048, jnp.bfloat16, CPU, "pallas"),      # interpret mode
    # the fused residual add (H200): its own rules, not the plain norms'
    ("fwd", "rms_res", 4096, jnp.bfloat16, H200, "triton"),
    ("fwd", "rms_res", 2048, jnp.bfloat16, H200, "pallas"),   # a tie there
    ("fwd", "layer_res", 2048, jnp.bfloat16, H200, "triton"),
    ("fwd", "layer_res", 8192, jnp.float16, H200, "triton"),
    ("bwd", "rms_res", 2048, jnp.bfloat16, H200, "triton"),
    ("bwd", "rms_res", 16384, jnp.bfloat16, H200, "pallas"),
    ("bwd", "layer_res", 4096, jnp.bfloat16, H200, "pallas"),  # Pallas's is faster
    ("bwd", "layer_res", 2048, jnp.bfloat16, H100, "pallas"),  # not the plain norm's rule
    ("fwd", "layer_res", 4096, jnp.bfloat16, H100, "pallas"),  # the H100: no rule
    ("fwd", "layer_res", 4096, jnp.float32, H200, "pallas"),
])
def test_choose_backend(pass_, op, n, dtype, device, want):
  layer, residual = op.startswith("layer"), op.endswith("_res")
  assert config.choose_backend(pass_, n, dtype, layer, device, residual=residual) == want


def _st(**kw):
  base = dict(eps=1e-6, scale_offset=0.0, subtract_mean=False, mode=None, backend=None,
              interpret=False)
  return ops._Static(**{**base, **kw})


def test_auto_backend_falls_back_where_the_pick_does_not_serve(monkeypatch):
  """A rule's backend is taken only where it serves the call (checked on shapes,
  before any kernel): the fused paths, cast="llama", a mode it lacks, its launchers'
  limits; an explicit backend is never changed."""
  picks = {}
  monkeypatch.setattr(config, "choose_backend", lambda p, n, dt, sm, residual=False, **kw: picks[p])
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((256,), jnp.bfloat16)
  picks.update(fwd="mosaic", bwd="mosaic")
  assert ops._auto_backend("fwd", x, s, None, _st(), fused=False) == "mosaic"
  assert ops._auto_backend("bwd", x, s, s, _st(subtract_mean=True), fused=False) == "mosaic"
  assert ops._auto_backend("fwd", x, None, None, _st(), fused=False) == "mosaic"
  s32 = jax.ShapeDtypeStruct((256,), jnp.float32)  # parameters in another dtype: unmeasured
  assert ops._auto_backend("fwd", x, s32, None, _st(), fused=False) == "pallas"
  assert ops._auto_backend("bwd", x, s, s32, _st(subtract_mean=True), fused=False) == "pallas"
  assert ops._auto_backend("bwd", x, s, None, _st(), fused=True) == "pallas"
  # the fused residual add: the rule's backend with x, residual and h in one dtype
  res = dict(x_dtype="bfloat16", residual_dtype="bfloat16", residual_in_dtype="bfloat16")
  picks.update(fwd="triton", bwd="triton")
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # jax-triton
  assert ops._auto_backend("fwd", x, s, None, _st(**res), fused=False,
                           residual=True) == "triton"
  for other in (dict(res, residual_dtype="float32"), dict(res, residual_in_dtype="float32")):
    assert ops._auto_backend("bwd", x, s, None, _st(**other), fused=False,
                             residual=True) == "pallas"  # an fp32 residual stream
  # (no rule picks Mosaic GPU for the fused ops; if one did, its own checks decide,
  # with the residual's tiles counted: N = 8192 in bf16 does not fit one program)
  picks.update(fwd="mosaic", bwd="mosaic")
  assert ops._auto_backend("fwd", x, s, None, _st(**res), fused=False,
                           residual=True) == "mosaic"
  assert ops._auto_backend("bwd", x, s, None, _st(**res), fused=False,
                           residual=True) == "mosaic"
  wide = jax.ShapeDtypeStruct((64, 8192), jnp.bfloat16)
  s8k = jax.ShapeDtypeStruct((8192,), jnp.bfloat16)
  assert ops._auto_backend("fwd", wide, s8k, None, _st(**res), fused=False,
                           residual=True) == "pallas"
  assert ops._auto_backend("fwd", wide, s8k, None, _st(), fused=False) == "mosaic"
  assert ops._auto_backend("fwd", x, s, None, _st(llama=("bfloat16", "float32")),
                           fused=False) == "pallas"
  assert ops._auto_backend("fwd", x, s, None, _st(mode="multi_wave_reload"),
                           fused=False) == "pallas"
  assert ops._auto_backend("fwd", x, s, None, _st(interpret=True), fused=False) == "pallas"
  odd = jax.ShapeDtypeStruct((64, 200), jnp.bfloat16)  # N % 128: Mosaic refuses
  assert ops._auto_backend("fwd", odd, None, None, _st(), fused=False) == "pallas"
  wide = jax.ShapeDtypeStruct((64, 65536), jnp.bfloat16)  # beyond its shared memory
  assert ops._auto_backend("bwd", wide, None, None, _st(), fused=False) == "pallas"
  assert ops._auto_backend("fwd", x, s, None, _st(backend="triton"), fused=True) == "triton"
  picks.update(fwd="triton")
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  assert ops._auto_backend("fwd", x, s, None, _st(), fused=False) == "pallas"


def _inputs(shape, seed):
  """x, scale, bias, dy, all bf16 (the backend rules' dtype: the parameters in x's)."""
  k = jax.random.split(jax.random.key(seed), 4)
  n = shape[-1]
  return (jax.random.normal(k[0], shape, jnp.bfloat16),
          (1 + 0.1 * jax.random.normal(k[1], (n,))).astype(jnp.bfloat16),
          (0.1 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16),
          jax.random.normal(k[3], shape, jnp.bfloat16))


def _fwd_bwd(op, backend, x, s, b, dy):
  """(y, dx, dscale, dbias) of the op on ``backend``."""
  if op == "rms":
    fn = lambda x, s, b: pallas_norm.rms_norm(x, s, backend=backend)
  else:
    fn = lambda x, s, b: pallas_norm.layer_norm(x, s, b, backend=backend)
  y, vjp = jax.vjp(fn, x, s, b)
  return (y, *vjp(dy))


@pytest.mark.parametrize("op", ["rms", "layer"])
def test_none_matches_pallas(op):
  """On CPU backend=None is the Pallas backend: the same bits, forward and grads."""
  args = _inputs((48, 256), 0)
  for got, want in zip(_fwd_bwd(op, None, *args), _fwd_bwd(op, "pallas", *args)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_flax_layers_take_none():
  """The Flax layers pass backend=None through (NNX and Linen)."""
  from flax import nnx
  import flax_layers
  from flax_layers import linen as pn_linen
  x = _inputs((8, 256), 2)[0]
  for cls in (flax_layers.RMSNorm, flax_layers.LayerNorm):
    got = cls(256, backend=None, rngs=nnx.Rngs(0))(x)
    want = cls(256, backend="pallas", rngs=nnx.Rngs(0))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  for cls in (pn_linen.RMSNorm, pn_linen.LayerNorm):
    m = cls(backend=None)
    got = m.apply(m.init(jax.random.key(0), x), x)
    want = cls(backend="pallas").apply(m.init(jax.random.key(0), x), x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_backend_is_still_an_error():
  with pytest.raises(ValueError, match="not a valid backend"):
    pallas_norm.rms_norm(jnp.ones((2, 128)), backend="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 2048), (333, 4096)])
def test_gpu_none_matches_pallas(op, shape):
  """On the GPU (an H100 takes the Triton RMSNorm and the Mosaic GPU LayerNorm backward
  at N = 2048, an H200 the Triton RMSNorm backward at 2048 and 4096): y and dx within
  bf16 rounding of backend="pallas", dscale/dbias (bf16, as the parameters) within 2% or
  sqrt(M) float32 roundings."""
  m, n = shape
  args = _inputs(shape, 1)
  got, want = _fwd_bwd(op, None, *args), _fwd_bwd(op, "pallas", *args)
  for name, g, w, tol in zip(("y", "dx", "dscale", "dbias"), got, want,
                             (2e-2, 2e-2, 2e-5 * m ** 0.5, 2e-5 * m ** 0.5)):
    if op == "rms" and name == "dbias":
      continue
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=tol, rtol=2e-2, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(8192, 4096), (1000, 2048)])
def test_gpu_none_matches_pallas_residual(op, shape):
  """The fused residual add under backend=None (an H200 takes the Triton forward of
  both ops and the Triton RMSNorm backward): y, h, dx, dresidual within bf16 rounding
  of backend="pallas", dscale/dbias within 2% or sqrt(M) float32 roundings."""
  m, n = shape
  x, s, b, dy = _inputs(shape, 3)
  r = jax.random.normal(jax.random.key(9), shape, jnp.bfloat16)
  dh = jax.random.normal(jax.random.key(10), shape, jnp.bfloat16)

  def run(backend):
    if op == "rms":
      fn = lambda x, r, s, b: pallas_norm.rms_norm(x, s, residual=r, backend=backend)
    else:
      fn = lambda x, r, s, b: pallas_norm.layer_norm(x, s, b, residual=r, backend=backend)
    (y, h), vjp = jax.vjp(fn, x, r, s, b)
    return (y, h, *vjp((dy, dh)))

  got, want = jax.jit(lambda: run(None))(), jax.jit(lambda: run("pallas"))()
  for name, g, w, tol in zip(("y", "h", "dx", "dresidual", "dscale", "dbias"), got, want,
                             (2e-2, 0.0, 2e-2, 2e-2, 2e-5 * m ** 0.5, 2e-5 * m ** 0.5)):
    if op == "rms" and name == "dbias":
      continue
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=tol, rtol=2e-2 if tol else 0.0, err_msg=name)
