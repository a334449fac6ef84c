"""The FP8-output ops with ``stats=False``: static scaling's y alone (W8A8 serving, vLLM's
``rms_norm_static_fp8_quant``): the one-pass kernel without the amax, mean and rstd
outputs. y (y_t, h) bitwise the stats=True op's, at the issue's M in {1, 2, 7, 64, 511};
each path of the one-pass kernels (column splits, chunked rows, persistent, packed); the
errors before any kernel.
Interpret mode on CPU; ``make gpu-check`` runs them compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm.kernels import fp8 as kfp8

F32 = jnp.float32
_Y_SCALE = 0.05
OPS = {"rms": pallas_norm.rms_norm_fp8, "layer": pallas_norm.layer_norm_fp8}


def _data(shape, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  n = shape[-1]
  return (jax.random.normal(k[0], shape, jnp.bfloat16) * 2,
          jax.random.normal(k[1], shape, jnp.bfloat16),
          1 + 0.1 * jax.random.normal(k[2], (n,), F32),
          0.1 * jax.random.normal(k[3], (n,), F32))


def _call(op, x, s, b, **kw):
  extra = (b,) if op == "layer" else ()
  return OPS[op](x, s, *extra, y_scale=_Y_SCALE, **kw)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.int8))


@pytest.mark.parametrize("op", ["rms", "layer"])
@pytest.mark.parametrize("shape,residual,transpose", [
    ((1, 256), False, False), ((2, 384), True, True), ((7, 2048), False, True),
    ((64, 512), True, False), ((511, 128), False, False), ((2, 3, 256), True, False)])
def test_y_alone_is_the_stats_ops_y(op, shape, residual, transpose):
  """One kernel; y (y_t, h) bitwise the stats=True op's, amax/mean/rstd None, the
  y_scale handed back; within one FP8 code of backend="xla" with stats=False (itself
  None-filled); the same bits on a second call (no atomics, nothing order-dependent)."""
  x, r, s, b = _data(shape)
  kw = dict(transpose=transpose, **(dict(residual=r) if residual else {}))
  full, lean = _call(op, x, s, b, **kw), _call(op, x, s, b, stats=False, **kw)
  ref = _call(op, x, s, b, stats=False, backend="xla", **kw)
  if residual:
    (full, hf), (lean, hl), (ref, hr) = full, lean, ref
    np.testing.assert_array_equal(np.asarray(hl, F32), np.asarray(hf, F32))
    np.testing.assert_array_equal(np.asarray(hr, F32), np.asarray(hl, F32))
  for out in (lean, ref):
    assert out.amax is None and out.mean is None and out.rstd is None
    assert float(out.y_scale) == np.float32(_Y_SCALE)
  assert lean.y.shape == x.shape and lean.y.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_bits(lean.y), _bits(full.y))
  assert np.max(np.abs(_bits(lean.y).astype(np.int32) - _bits(ref.y))) <= 1
  if transpose:
    np.testing.assert_array_equal(_bits(lean.y_t), _bits(full.y_t))
  else:
    assert lean.y_t is None
  again = _call(op, x, s, b, stats=False, **kw)
  np.testing.assert_array_equal(_bits((again[0] if residual else again).y), _bits(lean.y))
  f = lambda x: _call(op, x, s, b, stats=False, **kw)  # noqa: E731
  assert str(jax.make_jaxpr(f)(x)).count("pallas_call") == 1


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("cfg,transpose", [
    (kfp8.Fp8Config(1, 1024, 4, tile_params=True, column_splits=4), True),  # split rows
    (kfp8.Fp8Config(2, 256, 4), True),                                      # chunked rows
    (kfp8.Fp8Config(4, 1024, 4, 3), True),                                  # persistent
    (kfp8.Fp8Config(2, 256, 4, 2), False),                    # persistent, chunked rows
    (kfp8.Fp8Config(2, 1024, 4, 2, packed=True), False)],     # packed bf16 pairs
    ids=["column_splits", "chunked", "persistent", "persistent_chunked", "packed"])
def test_kernel_paths_without_stats(layer, cfg, transpose):
  """fp8_norm_delayed(stats=False) on each path of the one-pass kernels, at the given
  config (the same kernel as with stats, its stores of mean, rstd and amax left out):
  (y, y_t) alone, y_t y's transpose, y bitwise the stats=True kernel's."""
  m, n = 5, 1000
  x, _, s, b = _data((m, n), seed=3)
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, fp8_dtype=jnp.float8_e4m3fn,
            interpret=True, config=cfg)
  bias = b if layer else None
  outs = kfp8.fp8_norm_delayed(x, s, bias, F32(1 / _Y_SCALE), transpose=transpose,
                               stats=False, **kw)
  assert len(outs) == 2
  y, y_t = outs
  full = kfp8.fp8_norm_delayed(x, s, bias, F32(1 / _Y_SCALE), transpose=False, **kw)
  assert len(full) == 5  # y, y_t (None), mean, rstd, amax bits
  np.testing.assert_array_equal(_bits(y), _bits(full[0]))
  if transpose:
    np.testing.assert_array_equal(_bits(y_t), _bits(y).T)
  else:
    assert y_t is None


def test_errors_before_any_kernel():
  x, _, s, _ = _data((4, 128))
  with pytest.raises(ValueError, match="stats=False.*needs a given y_scale"):
    pallas_norm.rms_norm_fp8(x, s, stats=False)
  with pytest.raises(TypeError, match="stats must be a bool"):
    pallas_norm.rms_norm_fp8(x, s, y_scale=_Y_SCALE, stats="no")


def test_empty_rows():
  """M == 0: empty y, None statistics."""
  out = pallas_norm.rms_norm_fp8(jnp.zeros((0, 128), jnp.bfloat16), y_scale=_Y_SCALE,
                                 stats=False)
  assert out.y.shape == (0, 128) and out.amax is None and out.rstd is None


def test_lowers_for_cuda_with_y_alone():
  """The y-only kernel lowers through the Pallas Triton lowering for CUDA (on a
  CPU-only machine too): one custom call whose only result is y."""
  sds = jax.ShapeDtypeStruct
  call = lambda x, s: pallas_norm.rms_norm_fp8(  # noqa: E731
      x, s, y_scale=jnp.float32(_Y_SCALE), stats=False, interpret=False).y
  text = jax.jit(call).trace(sds((8, 4096), jnp.bfloat16), sds((4096,), F32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
  line = next(l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l)
  assert line.rstrip().endswith("-> tensor<8x4096xf8E4M3FN>"), line[-200:]
