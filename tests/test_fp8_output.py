"""FP8 output (issue #27 item 2): pallas_norm.rms_norm_fp8 / layer_norm_fp8 and
pallas_norm.fp8.norm_backward.

Oracles:
  - the kernels' own statistics through the jnp chain (``_chain``: y_f32 from the
    returned mean/rstd, amax, scale, quantise): amax, y_scale and y bitwise in interpret
    mode (the same float32 operations in the same order; on the GPU, within one FP8 ulp);
  - backend="xla" (reference.norm in float32, amax, quantise, transpose): statistics to
    float32 rounding (the kernels sum in another order), amax and y_scale to 2^-20
    relative (2^-17 on the GPU), y within one FP8 ulp (most bit-equal), y_t == y.T
    bitwise;
  - norm_backward against jax.vjp of pallas_norm.rms_norm / layer_norm.
On CPU the kernels run in Pallas interpret mode; ``make gpu-check`` runs this file with
interpret=False, plus the ``gpu`` tests at 4096 x 4096 and 8192 x 2048.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import fp8, reference
from pallas_norm.kernels import fp8 as kfp8

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = jnp.float32
OPS = {"rms": pallas_norm.rms_norm_fp8, "layer": pallas_norm.layer_norm_fp8}


def _on_gpu():
  return jax.default_backend() == "gpu"


def _rtol():
  """Statistics and amax against the jnp chain: float32 rounding of sums taken in another
  order; on the GPU also rsqrt.approx and the kernels' approximate division."""
  return 2.0**-17 if _on_gpu() else 2.0**-20


def _data(shape, *, layer, dtype=jnp.bfloat16, seed=0, scale=True, bias=True):
  rng = np.random.default_rng(seed + 17 * shape[-1] + len(shape))
  n = shape[-1]
  x = jnp.asarray(rng.standard_normal(shape) * 2.0 + (1.5 if layer else 0.0), dtype)
  s = jnp.asarray(1.0 + 0.5 * rng.standard_normal(n), F32) if scale else None
  b = jnp.asarray(rng.standard_normal(n), F32) if layer and bias else None
  return x, s, b


def _args(op, x, s, b):
  return (x, s, b) if op == "layer" else (x, s)


def _f32(a):
  return np.asarray(jnp.asarray(a).astype(F32))


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@functools.partial(jax.jit, static_argnames=("layer", "scale_offset", "fp8_dtype"))
def _chain(x, s, b, mean, rstd, *, layer, scale_offset, y_scale, fp8_dtype):
  """The jnp chain on given statistics: (y_f32, amax, y_scale, y). Jitted, as the
  kernels are in interpret mode: XLA contracts y * w + b to an FMA there."""
  xc = x.astype(F32)
  if layer:
    xc = xc - mean[..., None]
  y = xc * rstd[..., None]
  if s is not None:
    y = y * (F32(scale_offset) + s.astype(F32))
  if b is not None:
    y = y + b.astype(F32)
  amax = jnp.max(jnp.abs(y))
  if y_scale is None:
    y_scale = fp8.current_scale(amax, fp8_dtype)
  return y, amax, y_scale, fp8.quantise(y, F32(1) / y_scale, fp8_dtype)


def _ulp_ok(a, b, fp8_dtype):
  """|a - b| <= one FP8 ulp at max(|a|, |b|) (as float32; NaN only where both are)."""
  a, b = _f32(a), _f32(b)
  fi = jnp.finfo(fp8_dtype)
  nan = np.isnan(a)
  np.testing.assert_array_equal(nan, np.isnan(b))
  mag = np.maximum(np.abs(a), np.abs(b))[~nan]
  expo = np.floor(np.log2(np.maximum(mag, float(fi.smallest_normal))))
  ulp = 2.0 ** (expo - fi.nmant)
  err = np.abs(a - b)[~nan]
  assert np.all(err <= ulp), f"{np.sum(err > ulp)} values more than one ulp apart"
  return np.mean(err == 0) if err.size else 1.0


def _check_self(r, x, s, b, *, layer, scale_offset, y_scale, fp8_dtype):
  """r against the jnp chain on r's own statistics."""
  _, amax, ys, y = _chain(x, s, b, r.mean, r.rstd, layer=layer, scale_offset=scale_offset,
                          y_scale=y_scale, fp8_dtype=fp8_dtype)
  if _on_gpu():  # y_f32's last bit may differ (FMA contraction, the order of ops)
    np.testing.assert_allclose(_f32(r.amax), _f32(amax), rtol=_rtol())
    _ulp_ok(r.y, y, fp8_dtype)
    return
  np.testing.assert_array_equal(_f32(r.amax), _f32(amax))
  np.testing.assert_array_equal(_f32(r.y_scale), _f32(ys))
  np.testing.assert_array_equal(_bits(r.y), _bits(y))


def _check_ref(r, ref, *, fp8_dtype, transpose, layer):
  """r (pallas) against ref (backend="xla")."""
  assert r.y.dtype == ref.y.dtype == jnp.dtype(fp8_dtype)
  assert r.y.shape == ref.y.shape
  assert r.mean.shape == r.rstd.shape == ref.rstd.shape
  assert r.amax.dtype == r.y_scale.dtype == jnp.float32 and r.amax.shape == ()
  tol = _rtol()
  np.testing.assert_allclose(_f32(r.rstd), _f32(ref.rstd), rtol=tol)
  np.testing.assert_allclose(_f32(r.mean), _f32(ref.mean), rtol=tol, atol=tol)
  if not layer:
    np.testing.assert_array_equal(_f32(r.mean), 0.0)
  np.testing.assert_allclose(_f32(r.amax), _f32(ref.amax), rtol=tol)
  np.testing.assert_allclose(_f32(r.y_scale), _f32(ref.y_scale), rtol=tol)
  assert _ulp_ok(r.y, ref.y, fp8_dtype) > 0.99
  if transpose:
    n = r.y.shape[-1]
    assert r.y_t.shape == (n, r.y.size // n) and r.y_t.dtype == r.y.dtype
    np.testing.assert_array_equal(_bits(r.y_t), _bits(r.y.reshape(-1, n).T))
    np.testing.assert_array_equal(_bits(ref.y_t), _bits(ref.y.reshape(-1, n).T))
  else:
    assert r.y_t is None and ref.y_t is None


def _run(op, x, s, b, **kw):
  args = _args(op, x, s, b)
  return OPS[op](*args, **kw), OPS[op](*args, backend="xla", **kw)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("fp8_dtype,transpose", [(E4M3, True), (E5M2, False)],
                         ids=["e4m3-yt", "e5m2"])
@pytest.mark.parametrize("y_scale", [None, 0.01], ids=["current", "delayed"])
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_matches_xla(op, y_scale, fp8_dtype, transpose):
  # rank 3, M = 18 and N = 200: ragged for every tile, masked rows and columns
  x, s, b = _data((2, 9, 200), layer=op == "layer")
  r, ref = _run(op, x, s, b, y_scale=y_scale, fp8_dtype=fp8_dtype, transpose=transpose)
  _check_ref(r, ref, fp8_dtype=fp8_dtype, transpose=transpose, layer=op == "layer")
  _check_self(r, x, s, b, layer=op == "layer", scale_offset=0.0, y_scale=y_scale,
              fp8_dtype=fp8_dtype)
  if y_scale is not None:
    assert float(r.y_scale) == np.float32(y_scale)


@pytest.mark.parametrize("shape", [(1, 8192), (8, 8192), (7, 4096)], ids=str)
@pytest.mark.parametrize("y_scale", [None, 0.01], ids=["current", "delayed"])
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_few_rows_default_matches_xla(op, y_scale, shape):
  """The default config at decode sizes (on a GPU the few-row picks: up to 8 rows of
  N' >= 8192 with column splits, else a row a program; interpret mode its own tiles)
  against backend="xla"."""
  x, s, b = _data(shape, layer=op == "layer", seed=3)
  r, ref = _run(op, x, s, b, y_scale=y_scale)
  _check_ref(r, ref, fp8_dtype=E4M3, transpose=False, layer=op == "layer")


@pytest.mark.parametrize("op", ["rms", "layer"])
def test_delayed_transpose_separately(op, monkeypatch):
  """Delayed scaling's y_t as XLA's transpose of the one-pass kernel's y (the H100's pick,
  kernels/fp8.transpose_separately): y bitwise the y of transpose=False, y_t == y.T
  bitwise, and the reference's values."""
  layer = op == "layer"
  x, s, b = _data((2, 9, 200), layer=layer)
  plain = OPS[op](*_args(op, x, s, b), y_scale=0.01)
  monkeypatch.setattr(kfp8, "transpose_separately", lambda *a, **k: True)
  r, ref = _run(op, x, s, b, y_scale=0.01, transpose=True)
  _check_ref(r, ref, fp8_dtype=E4M3, transpose=True, layer=layer)
  np.testing.assert_array_equal(_bits(r.y), _bits(plain.y))
  if jax.default_backend() == "gpu":  # the same kernel: bitwise
    np.testing.assert_array_equal(_f32(r.amax), _f32(plain.amax))
  else:  # two interpret-mode programs, which XLA's CPU backend may reassociate: the
    # LayerNorm amax moved by one float32 ulp (make test on a clean clone, 2026-11-28)
    np.testing.assert_allclose(_f32(r.amax), _f32(plain.amax), rtol=2.0 ** -22, atol=0)


@pytest.mark.parametrize("transpose", [False, True], ids=["y", "y-yt"])
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_quantise_bottom_up(op, transpose, monkeypatch):
  """Current scaling's quantise pass walked a row block at a time from the last one up
  (the H100's order, kernels/fp8.quantise_bottom_up): y, y_t, the scale and the amax
  bitwise those of the launch order, on a shape of ragged row blocks and column tiles
  (interpret mode: 3 x 3 tiles of [64, 512] for y, 3 x 9 of [64, 128] with y_t)."""
  layer = op == "layer"
  x, s, b = _data((150, 1100), layer=layer, seed=5)
  # the order under test first: a tile it left unwritten must not find the launch
  # order's values in a reused buffer; jax.clear_caches() around it, since the ops'
  # jits keep their first trace
  jax.clear_caches()
  monkeypatch.setattr(kfp8, "quantise_bottom_up", lambda *a, **k: True)
  r = OPS[op](*_args(op, x, s, b), transpose=transpose)
  monkeypatch.undo()
  jax.clear_caches()
  plain = OPS[op](*_args(op, x, s, b), transpose=transpose)
  for name in ("y", "y_t") if transpose else ("y",):
    np.testing.assert_array_equal(_bits(getattr(r, name)), _bits(getattr(plain, name)))
  np.testing.assert_array_equal(_f32(r.amax), _f32(plain.amax))
  np.testing.assert_array_equal(_f32(r.y_scale), _f32(plain.y_scale))


def test_quantise_bottom_up_amax_passes(monkeypatch):
  """The tensor-parallel passes that share the quantise kernel (``fp8_tile_amax``, and
  ``fp8_quantise(return_amax=True)``) under the bottom-up order: the tile amaxes land at
  the same [i * grid_n + j] slots, bitwise, and y as well."""
  x, s, b = _data((150, 1100), layer=True, dtype=F32, seed=7)
  mean = jnp.mean(x, axis=-1)
  rstd = jax.lax.rsqrt(jnp.var(x, axis=-1) + 1e-5)
  kw = dict(scale_offset=0.0, subtract_mean=True, interpret=True)
  outs = {}
  for bottom_up in (True, False):  # the order under test first (see above)
    monkeypatch.setattr(kfp8, "quantise_bottom_up", lambda *a, v=bottom_up, **k: v)
    tile = kfp8.fp8_tile_amax(x, s, b, mean, rstd, **kw)
    y, _, bits = kfp8.fp8_quantise(x, s, b, mean, rstd, jnp.float32(0.01), **kw,
                                   fp8_dtype=E4M3, transpose=False, return_amax=True)
    outs[bottom_up] = [np.asarray(a) for a in (tile, bits, _bits(y))]
  assert outs[True][0].shape[0] > 1  # several tiles
  for a, b_, name in zip(outs[True], outs[False], ("tile amax", "quantise amax", "y")):
    np.testing.assert_array_equal(a, b_, err_msg=name)


@pytest.mark.parametrize("rule", ["transpose_separately", "quantise_bottom_up"])
def test_h100_only_rules(rule, monkeypatch):
  """Measured on the H100 only: there, not on the H200 nor in interpret mode."""
  for name, want in (("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", False)):
    info = pallas_norm.config.DeviceInfo("gpu", name, 132)
    monkeypatch.setattr(kfp8, "device_info", lambda info=info: info)
    assert getattr(kfp8, rule)() is want
    assert getattr(kfp8, rule)(interpret=True) is False


@pytest.mark.parametrize("op,scale,bias,scale_offset,dtype,y_scale", [
    ("rms", False, False, 0.0, jnp.float32, None),
    ("rms", True, False, 1.0, jnp.float16, 0.02),
    ("layer", False, False, 0.0, jnp.bfloat16, 0.02),
    ("layer", True, False, 1.0, jnp.float32, None),
    ("layer", False, True, 0.0, jnp.bfloat16, None),
])
def test_params_and_dtypes(op, scale, bias, scale_offset, dtype, y_scale):
  layer = op == "layer"
  x, s, b = _data((37, 64), layer=layer, dtype=dtype, scale=scale, bias=bias)
  r, ref = _run(op, x, s, b, y_scale=y_scale, scale_offset=scale_offset, transpose=True)
  _check_ref(r, ref, fp8_dtype=E4M3, transpose=True, layer=layer)
  _check_self(r, x, s, b, layer=layer, scale_offset=scale_offset, y_scale=y_scale,
              fp8_dtype=E4M3)


# Configs that force the chunked walks on a short row: 2 chunks (unrolled), 7 chunks (a
# loop), the last one ragged.
_CHUNKED = [kfp8.Fp8Config(8, 128, 4), kfp8.Fp8Config(32, 32, 4)]


@pytest.mark.parametrize("op,cfg", [("rms", _CHUNKED[0]), ("layer", _CHUNKED[1])],
                         ids=["rms-unrolled", "layer-loop"])
def test_chunked_kernels(op, cfg):
  layer = op == "layer"
  x, s, b = _data((37, 200), layer=layer)
  eps = 1e-5 if layer else float(jnp.finfo(F32).eps)
  _, _, ref_rstd = reference.norm(x, eps=eps, subtract_mean=layer)
  kw = dict(scale_offset=0.0, subtract_mean=layer, interpret=not _on_gpu())
  y_scale = F32(0.01)
  y, y_t, mean, rstd, amax = kfp8.fp8_norm_delayed(
      x, s, b, F32(1) / y_scale, eps=eps, fp8_dtype=E4M3, transpose=True, config=cfg, **kw)
  r = fp8.Fp8Norm(y, y_scale, kfp8.reduce_amax(amax), y_t, mean, rstd)
  _check_self(r, x, s, b, layer=layer, scale_offset=0.0, y_scale=y_scale, fp8_dtype=E4M3)
  np.testing.assert_allclose(_f32(rstd), _f32(ref_rstd), rtol=_rtol())
  np.testing.assert_array_equal(_bits(y_t), _bits(y.T))
  mean2, rstd2, amax2 = kfp8.fp8_stats(x, s, b, eps=eps, config=cfg, **kw)
  np.testing.assert_array_equal(_f32(mean2), _f32(mean))
  np.testing.assert_array_equal(_f32(rstd2), _f32(rstd))
  np.testing.assert_array_equal(np.asarray(amax2), np.asarray(amax))


@pytest.mark.parametrize("op,y_scale", [("rms", None), ("layer", 0.01)],
                         ids=["rms-current", "layer-delayed"])
def test_apply_passes(op, y_scale):
  """The tensor-parallel apply kernels on given statistics (spmd's whole-row mean/rstd):
  fp8_tile_amax and fp8_quantise(return_amax=True) against the jnp chain on the same
  statistics: amax, y, y_t bitwise (interpret mode); ragged tiles (37 x 200)."""
  layer = op == "layer"
  x, s, b = _data((37, 200), layer=layer, seed=5)
  x = x.at[36, 199].set(9.0)  # the amax in the last, ragged tile
  eps = 1e-5 if layer else float(jnp.finfo(F32).eps)
  _, mean, rstd = reference.norm(x.astype(F32), eps=eps, subtract_mean=layer)
  mean = jnp.zeros_like(rstd) if mean is None else mean
  kw = dict(scale_offset=0.0, subtract_mean=layer, interpret=not _on_gpu())
  _, amax, ys, y = _chain(x, s, b, mean, rstd, layer=layer, scale_offset=0.0,
                          y_scale=y_scale, fp8_dtype=E4M3)
  cfg = kfp8.Fp8Config(8, 64, 4)  # 5 x 4 tiles
  bits = kfp8.fp8_tile_amax(x, s, b, mean, rstd, config=cfg, **kw)
  assert bits.shape == (20,)
  got_y, got_t, bits2 = kfp8.fp8_quantise(x, s, b, mean, rstd, F32(1) / ys, fp8_dtype=E4M3,
                                          transpose=True, config=cfg, return_amax=True, **kw)
  np.testing.assert_array_equal(np.asarray(bits2), np.asarray(bits))
  if _on_gpu():
    np.testing.assert_allclose(_f32(kfp8.reduce_amax(bits)), _f32(amax), rtol=_rtol())
    _ulp_ok(got_y, y, E4M3)
  else:
    np.testing.assert_array_equal(_f32(kfp8.reduce_amax(bits)), _f32(amax))
    np.testing.assert_array_equal(_bits(got_y), _bits(y))
  np.testing.assert_array_equal(_bits(got_t), _bits(got_y.T))


# The row-block kernels' variants against the default one-block-a-program kernel:
# persistent programs (Fp8Config.num_programs > 0) over whole rows with the prefetch (M =
# 37: 19 ragged row blocks over 3 programs; scale/bias loaded a row block, hoisted in
# test_config_picks_variants) and over chunked rows (5 chunks: a loop), and scale/bias
# loaded in the tile's layout (tile_params; ragged columns: masked); x loaded without
# the .cg modifier (stream_x=False). y_t and the statistics kernel too. Same statistics,
# y, y_t and tensor amax, bitwise.
_VARIANTS = [("rms", kfp8.Fp8Config(2, 256, 4), dict(num_programs=3, tile_params=True,
                                                     hoist_params=False)),
             ("layer", kfp8.Fp8Config(2, 512, 4), dict(num_programs=3, tile_params=True,
                                                       row_amax=True, stream_x=False)),
             ("layer", kfp8.Fp8Config(8, 64, 4), dict(num_programs=2, tile_params=True)),
             ("rms", kfp8.Fp8Config(2, 256, 4), dict(tile_params=True))]


@pytest.mark.parametrize("op,cfg,var", _VARIANTS,
                         ids=["rms-persistent-whole-row", "layer-persistent-plain-loads",
                              "layer-persistent-chunked", "rms-tile-params"])
def test_row_kernel_variants(op, cfg, var):
  x, s, b = _data((37, 300 if op == "layer" else 200), layer=op == "layer")
  _check_variant(op, x, s, b, cfg, dataclasses.replace(cfg, **var), transpose=True)


def _check_variant(op, x, s, b, cfg, vcfg, *, transpose):
  """The delayed and statistics kernels under ``vcfg`` against ``cfg``: bitwise in
  interpret mode; on the GPU y within one FP8 ulp, the statistics and amax to _rtol()
  (the same operations, but the compiler may schedule them otherwise)."""
  layer = op == "layer"
  m = x.shape[0]
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=not _on_gpu())
  inv = F32(1) / F32(0.01)
  base = kfp8.fp8_norm_delayed(x, s, b, inv, fp8_dtype=E4M3, transpose=transpose,
                               config=cfg, **kw)
  var = kfp8.fp8_norm_delayed(x, s, b, inv, fp8_dtype=E4M3, transpose=transpose,
                              config=vcfg, **kw)
  stats = kfp8.fp8_stats(x, s, b, config=vcfg, **kw)
  # an amax a row, or one a persistent program
  assert base[4].shape == (m,) and var[4].shape == stats[2].shape == (
      min(vcfg.num_programs, -(-m // vcfg.block_m)) or m * vcfg.column_splits,)
  amaxes = [_f32(kfp8.reduce_amax(a)) for a in (base[4], var[4], stats[2])]
  assert amaxes[0] > 0
  if transpose:
    np.testing.assert_array_equal(_bits(var[1]), _bits(var[0].T))
  if _on_gpu():
    _ulp_ok(var[0], base[0], E4M3)
    for got in (var[2:4], stats[:2]):
      for a, c in zip(got, base[2:4]):
        np.testing.assert_allclose(_f32(a), _f32(c), rtol=_rtol(), atol=_rtol())
    np.testing.assert_allclose(amaxes[1:], amaxes[0], rtol=_rtol())
    return
  for a, c in zip(base[:2], var[:2]):  # y, y_t
    if a is not None or c is not None:
      np.testing.assert_array_equal(_bits(a), _bits(c))
  for got in (var[2:4], stats[:2]):  # mean, rstd
    for a, c in zip(got, base[2:4]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  assert amaxes[1] == amaxes[0] and amaxes[2] == amaxes[0]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturation(fp8_dtype):
  """A delayed scale too small: values clip to +-fp8_max, no Inf or NaN."""
  x, s, b = _data((16, 128), layer=True)
  hi = fp8.fp8_max(fp8_dtype)
  y_scale = 2.0 / hi  # |y| of a few units overflow
  r, ref = _run("layer", x, s, b, y_scale=y_scale, fp8_dtype=fp8_dtype, transpose=True)
  y = _f32(r.y)
  assert np.all(np.isfinite(y)) and np.max(np.abs(y)) == hi
  assert np.mean(np.abs(y) == hi) > 0.05
  np.testing.assert_array_equal(_bits(r.y), _bits(ref.y))
  np.testing.assert_array_equal(_bits(r.y_t), _bits(r.y.T))


@pytest.mark.parametrize("op,y_scale", [("rms", None), ("layer", 0.01)],
                         ids=["rms-current", "layer-delayed"])
def test_nan_inf(op, y_scale):
  """NaN in x: amax is NaN, current scaling falls back to y_scale = 1, the row is NaN;
  an Inf gives rstd = 0 and NaN where inf * 0 (the whole row for LayerNorm, whose mean
  is Inf), as in the jnp chain."""
  x, s, b = _data((8, 64), layer=op == "layer", dtype=jnp.float32)
  x = x.at[2, 5].set(jnp.nan).at[6, 0].set(jnp.inf)
  r, ref = _run(op, x, s, b, y_scale=y_scale)
  assert np.isnan(_f32(r.amax)) and np.isnan(_f32(ref.amax))
  np.testing.assert_array_equal(_f32(r.y_scale), _f32(ref.y_scale))
  if y_scale is None:
    assert float(r.y_scale) == 1.0
  y, yr = _f32(r.y), _f32(ref.y)
  np.testing.assert_array_equal(np.isnan(y), np.isnan(yr))
  assert np.all(np.isnan(y[2])) and np.isnan(y[6, 0])
  keep = np.array([0, 1, 3, 4, 5, 7])
  np.testing.assert_array_equal(_bits(r.y[keep]), _bits(ref.y[keep]))


def test_deterministic_jit_rank1_empty():
  x, s, b = _data((5, 9, 96), layer=True)
  call = functools.partial(pallas_norm.layer_norm_fp8, transpose=True)
  r1, r2 = call(x, s, b), call(x, s, b)
  for a, c in zip(r1, r2):
    np.testing.assert_array_equal(np.asarray(a).tobytes(), np.asarray(c).tobytes())
  # a traced delayed scale (no concrete check), under jit
  rj = jax.jit(lambda x, ys: pallas_norm.rms_norm_fp8(x, s, y_scale=ys))(x, F32(0.05))
  ref = pallas_norm.rms_norm_fp8(x, s, y_scale=0.05, backend="xla")
  _ulp_ok(rj.y, ref.y, E4M3)
  # rank 1: M = 1, y_t [N, 1], statistics of shape ()
  r = pallas_norm.rms_norm_fp8(x[0, 0], s, transpose=True)
  ref = pallas_norm.rms_norm_fp8(x[0, 0], s, transpose=True, backend="xla")
  assert r.y.shape == (96,) and r.y_t.shape == (96, 1) and r.rstd.shape == ()
  _check_ref(r, ref, fp8_dtype=E4M3, transpose=True, layer=False)
  # M == 0
  for backend in ("pallas", "xla"):
    e = pallas_norm.layer_norm_fp8(x[:0], s, b, transpose=True, backend=backend)
    assert e.y.shape == (0, 9, 96) and e.y_t.shape == (96, 0) and e.mean.shape == (0, 9)
    assert float(e.amax) == 0.0 and float(e.y_scale) == 1.0


def test_not_differentiable():
  x, s, _ = _data((4, 32), layer=False, dtype=jnp.float32)
  loss = lambda x: pallas_norm.rms_norm_fp8(x, s).y.astype(F32).sum()
  with pytest.raises(TypeError, match="not differentiable.*FP8 dense"):
    jax.grad(loss)(x)


_BAD = [
    (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, "floating"),
    (dict(x=jnp.ones(())), ValueError, "rank"),
    (dict(x=jnp.ones((4, 0))), ValueError, "N=0"),
    (dict(scale=jnp.ones(7)), ValueError, r"scale.shape=\(7,\)"),
    (dict(fp8_dtype=jnp.bfloat16), TypeError, "float8_e4m3fn or float8_e5m2"),
    (dict(fp8_dtype=jnp.float8_e4m3fnuz), TypeError, "float8_e4m3fn or float8_e5m2"),
    (dict(y_scale=jnp.ones((), jnp.bfloat16)), TypeError, "float32"),
    (dict(y_scale=jnp.ones((1,), F32)), ValueError, r"must be \(\)"),
    (dict(y_scale=0.0), ValueError, "finite and > 0"),
    (dict(y_scale=float("inf")), ValueError, "finite and > 0"),
    (dict(y_scale=-1.0), ValueError, "finite and > 0"),
    (dict(y_scale=1e-38), ValueError, "below float32's smallest normal"),
    (dict(y_scale="1"), TypeError, "y_scale must be a float32 scalar, got a str"),
    (dict(fp8_dtype=None), TypeError, "fp8_dtype=None must be float8_e4m3fn"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(mode="multi_wave_cached"), NotImplementedError, "mode=None"),
    (dict(mode="fast"), ValueError, "valid modes"),
    (dict(backend="triton"), NotImplementedError, "FP8-output backends"),
    (dict(backend="cuda"), ValueError, "valid backends"),
    (dict(transpose=1), TypeError, "transpose"),
]


@pytest.mark.parametrize("bad,exc,match", _BAD, ids=[str(i) for i in range(len(_BAD))])
def test_errors(bad, exc, match):
  kw = dict(x=jnp.ones((4, 8), jnp.bfloat16), scale=jnp.ones(8))
  kw.update(bad)
  x, scale = kw.pop("x"), kw.pop("scale")
  with pytest.raises(exc, match=match):
    pallas_norm.rms_norm_fp8(x, scale, **kw)


@pytest.mark.parametrize("op", ["rms", "layer"])
def test_current_scale_floor(op):
  """An amax under fp8_max * 2**-126 (here about 3e-37): y_scale is floored at float32's
  smallest normal instead of a subnormal that the GPU flushes to 0 (whose reciprocal
  turned every exact zero of y into NaN, both backends, until 2026-11-27); the values
  still dequantise to within the amax."""
  layer = op == "layer"
  x = jnp.zeros((4, 128), F32).at[0, 1].set(1e-30).at[2, 7].set(-3e-30)
  s = jnp.full((128,), 1e-10, F32)
  b = jnp.zeros((128,), F32) if layer else None
  for backend in ("pallas", "xla"):
    r = OPS[op](*_args(op, x, s, b), backend=backend)
    y = np.asarray(r.y.astype(F32))
    assert not np.isnan(y).any(), backend
    assert float(r.y_scale) == np.finfo(np.float32).tiny, (backend, float(r.y_scale))
    assert 0 < float(r.amax) < 448 * np.finfo(np.float32).tiny
    assert np.abs(y).max() * float(r.y_scale) <= float(r.amax) * (1 + 2 ** -3)
  assert float(pallas_norm.fp8.current_scale(jnp.float32(1.0), jnp.float8_e4m3fn)) == (
      np.float32(1.0) / np.float32(448.0))


def test_config_errors():
  with pytest.raises(ValueError, match="power of 2"):
    kfp8.Fp8Config(24, 128, 4)
  with pytest.raises(ValueError, match="num_programs"):
    kfp8.Fp8Config(32, 128, 4, -1)
  with pytest.raises(ValueError, match="not an FP8 kernel"):
    kfp8.fp8_config(64, 64, kernel="fused")


def test_config_picks_variants(monkeypatch):
  """fp8_config's GPU picks (H200-measured): persistent whole-row tiles from
  _PERSISTENT_ROWS, persistent y_t programs, scale/bias in the tile's layout there; the
  forward's tile elsewhere; interpret mode keeps one row block a program."""
  d = kfp8.fp8_config(8192, 4096, kernel="delayed", interpret=True)
  assert d.num_programs == 0 and not d.tile_params
  t = kfp8.fp8_config(8192, 4096, kernel="delayed", transpose=True, interpret=True)
  assert t.num_programs == 0
  h200 = pallas_norm.config.DeviceInfo("gpu", "NVIDIA H200", 132)
  monkeypatch.setattr(kfp8, "device_info", lambda: h200)
  assert kfp8.fp8_config(8192, 4096, kernel="delayed") == kfp8.Fp8Config(1, 4096, 16, 396,
                                                                         True, False)
  assert kfp8.fp8_config(8192, 4096, kernel="stats", subtract_mean=True) == (
      kfp8.Fp8Config(1, 4096, 4, 528, True, False))
  # not in the table (LayerNorm's statistics at N' = 8192): the forward's tile
  assert kfp8.fp8_config(8192, 8192, kernel="stats", subtract_mean=True).num_programs == 0
  t = kfp8.fp8_config(8192, 4096, kernel="delayed", transpose=True)
  assert (t.block_m, t.block_n, t.num_warps, t.num_programs, t.tile_params) == (
      32, 128, 16, 264, True)
  # the H200 keeps its LayerNorm picks, which the H100 overrides
  assert kfp8.fp8_config(8192, 8192, kernel="delayed", subtract_mean=True) == (
      kfp8.Fp8Config(2, 8192, 8, 264, True, True))
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", subtract_mean=True,
                         transpose=True).num_programs == 264
  h100 = pallas_norm.config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
  monkeypatch.setattr(kfp8, "device_info", lambda: h100)
  f16 = dict(dtype=jnp.float16)  # x not bf16: the H100's tables before sweep 8
  assert kfp8.fp8_config(8192, 8192, kernel="delayed", subtract_mean=True, **f16) == (
      kfp8.Fp8Config(2, 8192, 16, 132, True, True))
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", subtract_mean=True,
                         transpose=True).num_programs == 528
  # five-element tiles: row_amax; float32 scale/bias (or none) and 2-byte ones differ
  assert kfp8.fp8_config(8192, 8192, kernel="stats", subtract_mean=True, **f16) == (
      kfp8.Fp8Config(1, 8192, 8, 264, True, True, True))
  assert kfp8.fp8_config(8192, 8192, kernel="stats", subtract_mean=True,
                         param_dtype=jnp.float32, **f16) == kfp8.Fp8Config(
                             1, 8192, 8, 264, True, True, True)
  # programs a SM 0 in the table: one row block a program, scale/bias in the tile's layout
  assert kfp8.fp8_config(8192, 8192, kernel="stats", subtract_mean=True,
                         param_dtype=jnp.bfloat16, **f16) == kfp8.Fp8Config(
                             1, 8192, 4, 0, True, True)
  assert kfp8.fp8_config(32768, 2048, kernel="delayed", **f16) == kfp8.Fp8Config(
      1, 2048, 4, 1056, True, True, True)
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", **f16) == kfp8.Fp8Config(
      1, 4096, 8, 528, True, True, True)
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", param_dtype=jnp.float16,
                         **f16) == kfp8.Fp8Config(1, 4096, 16, 396, True, False)
  # bf16 x of even N (sweep 8): the packed kernel, x loaded without .cg
  packed = dict(packed=True, stream_x=False)
  assert kfp8.fp8_config(8192, 4096, kernel="delayed") == kfp8.Fp8Config(
      2, 4096, 8, 264, True, True, True, **packed)
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", param_dtype=jnp.bfloat16) == (
      kfp8.fp8_config(8192, 4096, kernel="delayed"))
  assert kfp8.fp8_config(32768, 2048, kernel="stats", subtract_mean=True) == (
      kfp8.Fp8Config(2, 2048, 4, 528, True, True, True, **packed))
  # LayerNorm delayed at N' = 8192: float32 scale/bias unpacked, 2-byte ones packed
  assert kfp8.fp8_config(8192, 8192, kernel="delayed", subtract_mean=True) == (
      kfp8.Fp8Config(2, 8192, 16, 132, True, True, False, False, False))
  # ... and from N' = 8192 the 2-byte scale/bias as uint32 pairs too (packed_params)
  assert kfp8.fp8_config(8192, 8192, kernel="delayed", subtract_mean=True,
                         param_dtype=jnp.bfloat16) == kfp8.Fp8Config(
                             1, 8192, 4, 264, True, True, True, **packed,
                             packed_params=True)
  assert kfp8.fp8_config(4096, 8192, kernel="delayed", param_dtype=jnp.bfloat16) == (
      kfp8.Fp8Config(1, 8192, 8, 264, True, True, True, **packed, packed_params=True))
  assert not kfp8.fp8_config(8192, 4096, kernel="delayed", subtract_mean=True,
                             param_dtype=jnp.float32).packed_params
  # ... and LayerNorm's delayed kernel at N' = 4096 takes them at [1, 4096] x 8 warps
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", subtract_mean=True,
                         param_dtype=jnp.bfloat16) == kfp8.Fp8Config(
                             1, 4096, 8, 396, True, True, True, **packed,
                             packed_params=True)
  assert not kfp8.fp8_config(8192, 4096, kernel="delayed",
                             param_dtype=jnp.bfloat16).packed_params
  # ... its statistics kernel too (without 2-byte params: the packed [2, 4096] tile)
  assert kfp8.fp8_config(8192, 4096, kernel="stats", subtract_mean=True,
                         param_dtype=jnp.bfloat16) == kfp8.Fp8Config(
                             1, 4096, 8, 396, True, True, True, **packed,
                             packed_params=True)
  assert kfp8.fp8_config(8192, 4096, kernel="stats", subtract_mean=True) == (
      kfp8.Fp8Config(2, 4096, 4, 528, True, True, True, **packed))
  # an odd N keeps the tables before it
  assert not kfp8.fp8_config(8192, 4095, kernel="delayed").packed
  # the rest as on the H200
  assert kfp8.fp8_config(8192, 4096, kernel="delayed", transpose=True).num_programs == 264
  assert kfp8.fp8_config(8192, 4096, kernel="stats") == kfp8.fp8_config(
      8192, 4096, kernel="stats", param_dtype=jnp.bfloat16)
  monkeypatch.setattr(kfp8, "device_info", lambda: h200)
  monkeypatch.setattr(kfp8, "_PERSISTENT_ROWS", {("delayed", "rms", 128): (2, 4, 2, True)})
  assert kfp8.fp8_config(24, 100, kernel="delayed") == kfp8.Fp8Config(2, 128, 4, 264, True,
                                                                       True)
  assert kfp8.fp8_config(24, 100, kernel="stats").num_programs == 0  # not in the table


def test_config_few_rows(monkeypatch):
  """Up to 64 rows on a GPU (config._few_rows_tile's rows), "delayed" without y_t and
  "stats": a row a program, scale/bias hoisted, the forward's few-row warps; on any GPU
  (before the H100's packed picks), up to 8 rows of N' >= 8192 with 8 column splits
  instead; not for y_t, 65 rows, narrow rows, 1 x 16384 or interpret mode."""
  for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA L40S"):
    dev = pallas_norm.config.DeviceInfo("gpu", name, 132)
    monkeypatch.setattr(kfp8, "device_info", lambda: dev)
    for m, n, warps in ((1, 2048, 4), (7, 4096, 4), (64, 8192, 8), (9, 8192, 8)):
      for kernel, layer in (("delayed", False), ("stats", True)):
        assert kfp8.fp8_config(m, n, kernel=kernel, subtract_mean=layer) == (
            kfp8.Fp8Config(1, n, warps, m, tile_params=True, hoist_params=True)), (name, m, n)
    # Up to 8 rows of N' >= 8192: each row over 8 programs (column splits).
    for m, n, warps in ((1, 8192, 8), (8, 8192, 8), (8, 16384, 16)):
      for kernel, layer in (("delayed", False), ("stats", True)):
        assert kfp8.fp8_config(m, n, kernel=kernel, subtract_mean=layer) == (
            kfp8.Fp8Config(1, n, warps, tile_params=True, column_splits=8)), (name, m, n)
    assert kfp8.fp8_config(8, 4096, kernel="delayed", transpose=True).block_m == 32
    for m, n in ((65, 4096), (8, 256), (1, 16384)):
      assert kfp8.fp8_config(m, n, kernel="delayed").num_programs != m, (m, n)
  assert kfp8.fp8_config(8, 4096, kernel="delayed", interpret=True).num_programs == 0


@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_few_rows_kernel_bitwise(m):
  """The few-row config (a row a persistent program, scale/bias hoisted) against one row
  block a program: the same y, y_t, statistics and amax bits (interpret mode; one FP8
  ulp and _rtol() on a GPU)."""
  x, s, b = _data((m, 300), layer=True)
  few = kfp8.Fp8Config(1, 512, 4, m, tile_params=True, hoist_params=True)
  _check_variant("layer", x, s, b, kfp8.Fp8Config(1, 512, 4), few, transpose=False)
  _check_variant("rms", x, s, None, kfp8.Fp8Config(1, 512, 4), few, transpose=False)


@pytest.mark.parametrize("m,n,block_m,splits,transpose", [
    (1, 300, 1, 4, False), (7, 1000, 2, 8, True), (64, 256, 4, 2, False),
    (3, 384, 1, 4, True)])
def test_column_splits_bitwise(m, n, block_m, splits, transpose):
  """Fp8Config.column_splits (programs a row block, each the whole row's statistics and
  a share of the columns, an amax partial a row and split) against one program a row
  block: the same y, y_t, statistics and tensor amax (interpret mode bitwise; on a GPU
  one FP8 ulp and _rtol()), for the delayed and the statistics kernels."""
  for op, layer in (("rms", False), ("layer", True)):
    x, s, b = _data((m, n), layer=layer)
    cfg = kfp8.Fp8Config(block_m, 1024 if n > 512 else 512, 4)
    _check_variant(op, x, s, b if layer else None, cfg,
                   dataclasses.replace(cfg, column_splits=splits), transpose=transpose)


def test_column_splits_errors():
  for bad in (dict(column_splits=3), dict(column_splits=1024),
              dict(column_splits=2, num_programs=4)):
    with pytest.raises(ValueError, match="column_splits"):
      kfp8.Fp8Config(1, 512, 4, **bad)
  x, s, _ = _data((2, 1000), layer=False)
  with pytest.raises(ValueError, match="whole rows"):
    kfp8.fp8_norm_delayed(x, s, None, F32(2), eps=1e-5, scale_offset=0.0,
                          subtract_mean=False, fp8_dtype=E4M3, transpose=False,
                          interpret=True, config=kfp8.Fp8Config(1, 512, 4, column_splits=2))


@pytest.mark.parametrize("subtract_mean", [False, True])
def test_row_amax_matches_elementwise_carry(subtract_mean):
  """Fp8Config.row_amax (each row block's amax reduced at once) gives the outputs of
  the elementwise amax carry bitwise, a NaN in a row included, with ragged row blocks
  (37 rows in blocks of 2 over 5 programs)."""
  m, n = 37, 256
  x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
  x = x.at[29, 5].set(30.0)
  s = 1 + 0.1 * jax.random.normal(jax.random.key(1), (n,))
  b = 0.1 * s if subtract_mean else None
  for xx in (x, x.at[11, 7].set(jnp.nan)):
    outs = [kfp8.fp8_norm_delayed(
        xx, s, b, 10.0, eps=1e-5, scale_offset=0.0, subtract_mean=subtract_mean,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=not _on_gpu(),
        config=kfp8.Fp8Config(2, n, 4, 5, True, True, ra)) for ra in (False, True)]
    (y0, _, mean0, rstd0, a0), (y1, _, mean1, rstd1, a1) = outs
    np.testing.assert_array_equal(np.asarray(y0).view(np.uint8),
                                  np.asarray(y1).view(np.uint8))
    np.testing.assert_array_equal(a0, a1)
    np.testing.assert_array_equal(rstd0, rstd1)
    np.testing.assert_array_equal(mean0, mean1)
    amax = float(kfp8.reduce_amax(a1))
    assert np.isnan(amax) == bool(jnp.isnan(xx).any()) and (np.isnan(amax) or amax > 10)
    st = [kfp8.fp8_stats(xx, s, b, eps=1e-5, scale_offset=0.0, subtract_mean=subtract_mean,
                         interpret=not _on_gpu(),
                         config=kfp8.Fp8Config(2, n, 4, 5, True, True, ra))
          for ra in (False, True)]
    np.testing.assert_array_equal(st[0][2], st[1][2])


@pytest.mark.parametrize("subtract_mean", [False, True])
@pytest.mark.parametrize("m,n,fp8_dtype,hoist,row_amax,params", [
    (37, 256, E4M3, True, True, "scale+bias"),     # ragged row blocks, whole tile
    (21, 200, E5M2, False, False, "scale+bias"),   # column mask: 100 of 128 pairs
    (16, 512, E4M3, True, False, "none"),          # no scale, no bias
    (9, 130, E4M3, True, True, "offset"),          # scale_offset 1 (zero-centred)
])
def test_packed_matches_unpacked(subtract_mean, m, n, fp8_dtype, hoist, row_amax, params):
  """Fp8Config.packed (x as bf16 pairs, y as FP8 pairs) against the persistent kernel at
  the same tile, delayed and statistics kernels, with a NaN row, a saturating value and
  the row blocks ragged: y within one FP8 ulp (all but a few bit-equal), amax, mean and
  rstd to _rtol() (the pairs are summed before the row's reduction: another order)."""
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.standard_normal((m, n)) * 2 + (1.5 if subtract_mean else 0),
                  jnp.bfloat16)
  x = x.at[m - 2, 3].set(3000.0).at[1, n - 1].set(jnp.nan)
  s = jnp.asarray(1 + 0.5 * rng.standard_normal(n), F32) if params != "none" else None
  b = (jnp.asarray(rng.standard_normal(n), F32)
       if params == "scale+bias" and subtract_mean else None)
  kw = dict(eps=1e-5, scale_offset=1.0 if params == "offset" else 0.0,
            subtract_mean=subtract_mean, interpret=not _on_gpu())
  cfg = kfp8.Fp8Config(2, 256 if n <= 256 else 512, 4, 5, True, hoist, row_amax)
  pcfg = dataclasses.replace(cfg, packed=True, stream_x=hoist)  # both loads
  inv = F32(1e3 if fp8_dtype == E4M3 else 1e5)  # |y| above 0.448 / 0.573 saturates
  ref = kfp8.fp8_norm_delayed(x, s, b, inv, fp8_dtype=fp8_dtype, transpose=False,
                              config=cfg, **kw)
  got = kfp8.fp8_norm_delayed(x, s, b, inv, fp8_dtype=fp8_dtype, transpose=False,
                              config=pcfg, **kw)
  stats = kfp8.fp8_stats(x, s, b, config=pcfg, **kw)
  assert got[0].shape == (m, n) and got[0].dtype == fp8_dtype and got[1] is None
  assert _ulp_ok(got[0], ref[0], fp8_dtype) > 0.99
  assert np.isnan(_f32(got[0])[1]).any()  # the NaN row stays NaN
  assert np.nanmax(np.abs(_f32(got[0]))) == float(jnp.finfo(fp8_dtype).max)  # saturated
  for a in (got[2:4], stats[:2]):
    for v, r in zip(a, ref[2:4]):
      np.testing.assert_allclose(_f32(v), _f32(r), rtol=_rtol(), atol=_rtol())
  amaxes = [_f32(kfp8.reduce_amax(a)) for a in (ref[4], got[4], stats[2])]
  assert np.isnan(amaxes).all()  # the NaN propagates into this call's amax
  clean = x.at[1, n - 1].set(0.0)
  amaxes = [_f32(kfp8.reduce_amax(f(clean)[i])) for f, i in (
      (lambda v: kfp8.fp8_norm_delayed(v, s, b, inv, fp8_dtype=fp8_dtype, transpose=False,
                                       config=cfg, **kw), 4),
      (lambda v: kfp8.fp8_norm_delayed(v, s, b, inv, fp8_dtype=fp8_dtype, transpose=False,
                                       config=pcfg, **kw), 4),
      (lambda v: kfp8.fp8_stats(v, s, b, config=pcfg, **kw), 2))]
  assert amaxes[0] > 1
  np.testing.assert_allclose(amaxes[1:], amaxes[0], rtol=_rtol())


@pytest.mark.parametrize("m,n,params,scale_offset", [
    (37, 256, "bf16", 0.0),       # ragged row blocks, whole tile
    (21, 200, "bf16", 1.0),       # column mask: 100 of 128 pairs; zero-centred scale
    (9, 130, "mixed", 0.0),       # bf16 scale as pairs, float32 bias gathered
    (16, 512, "scale", 0.0),      # RMSNorm's shape of it: scale only
])
def test_packed_params_bitwise(m, n, params, scale_offset):
  """Fp8Config.packed_params (bf16 scale/bias loaded as uint32 pairs, unpacked once)
  gives the same bits as their strided gathers, delayed and statistics kernels, with a
  NaN row and a saturating value."""
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, n)) * 2 + 1.5, jnp.bfloat16)
  x = x.at[m - 2, 3].set(3000.0).at[1, n - 1].set(jnp.nan)
  s = jnp.asarray(1 + 0.5 * rng.standard_normal(n), jnp.bfloat16)
  b = None if params == "scale" else jnp.asarray(
      rng.standard_normal(n), F32 if params == "mixed" else jnp.bfloat16)
  kw = dict(eps=1e-5, scale_offset=scale_offset, subtract_mean=b is not None,
            interpret=not _on_gpu())
  cfg = kfp8.Fp8Config(2, 256 if n <= 256 else 512, 4, 5, True, True, True, packed=True)
  outs = []
  for pp in (False, True):
    c = dataclasses.replace(cfg, packed_params=pp)
    y, _, *rest = kfp8.fp8_norm_delayed(x, s, b, F32(1e3), fp8_dtype=E4M3,
                                        transpose=False, config=c, **kw)
    outs.append([np.asarray(y).view(np.uint8), *map(np.asarray, rest),
                 *map(np.asarray, kfp8.fp8_stats(x, s, b, config=c, **kw))])
  for a, r in zip(*outs):
    np.testing.assert_array_equal(a, r)
  y = outs[1][0].view(jnp.float8_e4m3fn).astype(np.float32)
  assert np.isnan(y[1]).any() and np.nanmax(np.abs(y)) == 448.0  # NaN kept, saturated
  assert np.isnan(_f32(kfp8.reduce_amax(outs[1][3])))


def test_packed_config_errors():
  """A packed config where it does not apply: a ValueError before any kernel runs."""
  x = jnp.ones((8, 256), jnp.bfloat16)
  s = jnp.ones((256,), F32)
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=False, interpret=True)
  p = kfp8.Fp8Config(2, 256, 4, 4, True, True, True, packed=True)
  call = lambda x, cfg, t=False: kfp8.fp8_norm_delayed(
      x, s[:x.shape[1]], None, 1.0, fp8_dtype=E4M3, transpose=t, config=cfg, **kw)
  for x_, cfg, t in [(x.astype(F32), p, False), (x.astype(jnp.float16), p, False),
                     (x[:, :255], p, False), (x, dataclasses.replace(p, block_n=128), False),
                     (x, p, True), (x, dataclasses.replace(p, num_programs=0), False)]:
    with pytest.raises(ValueError, match="Fp8Config.packed"):
      call(x_, cfg, t)
  with pytest.raises(ValueError, match="Fp8Config.packed"):
    kfp8.fp8_stats(x.astype(F32), s, None, config=p, **kw)


@pytest.mark.cpu_only
def test_lowers_for_cuda():
  """Every FP8-output kernel lowers through JAX's Pallas Triton lowering for CUDA (on a
  CPU-only machine too): the FP8 casts, the transposed y_t store, the int32 amax, the
  whole-row, unrolled and looped walks, the 2-D quantise grid."""
  f32 = jax.ShapeDtypeStruct
  for m, n, layer, fp8_dtype, y_scale in [(4096, 4096, False, E4M3, 0.01),
                                          (1000, 300, True, E5M2, 0.01),
                                          (64, 16384, True, E4M3, None),
                                          (1000, 300, False, E5M2, None)]:
    for transpose in (False, True):
      op = functools.partial(OPS["layer" if layer else "rms"], fp8_dtype=fp8_dtype,
                             transpose=transpose, interpret=False)
      args = [f32((m, n), jnp.bfloat16), f32((n,), F32), f32((), F32)]
      if layer:
        call = lambda x, s, ys, op=op: op(x, s, s, y_scale=ys)
      else:
        call = lambda x, s, ys, op=op: op(x, s, y_scale=ys)
      if y_scale is None:
        args[2] = None
      text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("__gpu$xla.gpu.triton") == (1 if y_scale else 2)


@pytest.mark.cpu_only
def test_row_variants_lower_for_cuda():
  """The row-block variants lower for CUDA: the prefetching whole-row loop (1 and 2
  rows a block), the chunked loop with y_t in 32-row blocks, the scalar amax store,
  scale/bias in the tile's layout."""
  sds = jax.ShapeDtypeStruct
  for m, n, cfg, transpose, layer in [
      (8192, 4096, kfp8.Fp8Config(1, 4096, 4, 264), False, False),
      (8192, 4096, kfp8.Fp8Config(2, 4096, 8, 132, tile_params=True), False, True),
      (8192, 4096, kfp8.Fp8Config(1, 4096, 4, tile_params=True), False, True),
      (8, 16384, kfp8.Fp8Config(1, 16384, 16, 8, True, True), False, True),  # few rows
      (8, 8192, kfp8.Fp8Config(1, 8192, 8, tile_params=True, column_splits=4), True, True),
      (8192, 4096, kfp8.Fp8Config(32, 256, 16, 132), True, True)]:
    kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False, config=cfg)
    for fn in (functools.partial(kfp8.fp8_norm_delayed, inv=F32(2), fp8_dtype=E4M3,
                                 transpose=transpose, **kw),
               functools.partial(kfp8.fp8_stats, **kw)):
      args = (sds((m, n), jnp.bfloat16), sds((n,), F32), sds((n,), F32) if layer else None)
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("__gpu$xla.gpu.triton") == 1
  # the tensor-parallel apply kernels: the amax-only pass, quantise with the tile amax
  row = sds((8192,), F32)
  kw = dict(scale_offset=0.0, subtract_mean=True, interpret=False)
  for fn in (functools.partial(kfp8.fp8_tile_amax, **kw),
             functools.partial(kfp8.fp8_quantise, inv=F32(2), fp8_dtype=E4M3, transpose=True,
                               return_amax=True, **kw)):
    args = (sds((8192, 2048), jnp.bfloat16), sds((2048,), F32), sds((2048,), F32), row, row)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("op,shape,backend", [
    ("layer", (2, 5, 96), "pallas"), ("rms", (200,), "pallas"), ("layer", (40,), "xla")])
def test_norm_backward(op, shape, backend):
  """Against jax.vjp of rms_norm / layer_norm on the same backend, with the statistics
  of the forward (reference.norm's)."""
  layer = op == "layer"
  x, s, b = _data(shape, layer=layer, dtype=jnp.float32)
  dy = jnp.asarray(np.random.default_rng(3).standard_normal(shape), jnp.bfloat16)
  f = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
  kw = dict(scale_offset=1.0)
  _, vjp = jax.vjp(lambda x, s, b: f(*_args(op, x, s, b), backend=backend, **kw), x, s, b)
  want = vjp(dy.astype(F32))
  eps = 1e-5 if layer else float(jnp.finfo(F32).eps)
  _, mean, rstd = reference.norm(x, eps=eps, subtract_mean=layer)
  got = fp8.norm_backward(dy, x, s, b, mean, rstd, subtract_mean=layer, backend=backend,
                          **kw)
  n = shape[-1]
  for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
    if not layer and name == "dbias":
      assert g is None
      continue
    assert g.dtype == w.dtype and g.shape == w.shape, name
    np.testing.assert_allclose(_f32(g), _f32(w), rtol=1e-5, atol=1e-5 * n**0.5, err_msg=name)


def test_norm_backward_errors():
  x = jnp.ones((4, 8))
  r = jnp.ones((4,))
  nb = functools.partial(fp8.norm_backward, subtract_mean=True)
  with pytest.raises(ValueError, match="dy.shape"):
    nb(jnp.ones((4, 9)), x, None, None, r, r)
  with pytest.raises(ValueError, match="rstd.shape"):
    nb(x, x, None, None, r, jnp.ones((8,)))
  with pytest.raises(ValueError, match="mean is None"):
    nb(x, x, None, None, None, r)
  with pytest.raises(TypeError, match="float32"):
    nb(x, x, None, None, r, r.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="valid backends"):
    nb(x, x, None, None, r, r, backend="cuda")
  with pytest.raises(ValueError, match="RMSNorm's backward needs the saved rstd"):
    fp8.norm_backward(x, x, None, None, None, None, subtract_mean=False)
  with pytest.raises(TypeError, match="subtract_mean must be a bool"):
    fp8.norm_backward(x, x, None, None, r, r, subtract_mean="no")
  dx, ds, db = fp8.norm_backward(x[:0], x[:0], jnp.ones(8), None, None, r[:0],
                                 subtract_mean=False)
  assert dx.shape == (0, 8) and float(jnp.sum(jnp.abs(ds))) == 0.0 and db is None


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 2048)])
@pytest.mark.parametrize("y_scale", [None, 0.01], ids=["current", "delayed"])
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_gpu_compiled_vs_xla(op, y_scale, shape):
  layer = op == "layer"
  x, s, b = _data(shape, layer=layer)
  for transpose in (False, True):
    args = _args(op, x, s, b)
    r = OPS[op](*args, y_scale=y_scale, transpose=transpose, interpret=False)
    ref = OPS[op](*args, y_scale=y_scale, transpose=transpose, backend="xla")
    _check_ref(r, ref, fp8_dtype=E4M3, transpose=transpose, layer=layer)
    _check_self(r, x, s, b, layer=layer, scale_offset=0.0, y_scale=y_scale, fp8_dtype=E4M3)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_gpu_row_kernel_variants(op):
  """The compiled variants against the default kernels at 4096 x 4096: persistent whole
  rows (2 programs a SM) with tile_params, and persistent 32-row y_t blocks (a program a
  SM)."""
  sms = pallas_norm.config.device_info().num_sms
  x, s, b = _data((4096, 4096), layer=op == "layer")
  for cfg, vcfg, transpose in [
      (kfp8.Fp8Config(1, 4096, 8), kfp8.Fp8Config(1, 4096, 8, 2 * sms, True), False),
      (kfp8.Fp8Config(32, 256, 16), kfp8.Fp8Config(32, 256, 16, sms, True), True)]:
    _check_variant(op, x, s, b, cfg, vcfg, transpose=transpose)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms", "layer"])
def test_gpu_amax_paths_bitwise(op, monkeypatch):
  """The compiled kernels' float32 amax (HW_AMAX: |y| max-ed with PTX max.NaN.f32) against
  the int32-bits amax that interpret mode runs: y, y_t, mean, rstd and the amax partials
  bitwise equal (a NaN amax as NaN), for the one-block, persistent (with and without
  row_amax) and y_t kernels and the quantise pass, on
  finite data, with a NaN and an Inf in x, and with subnormal y (scale and bias times
  1e-39: a flush to zero would give amax 0)."""
  layer = op == "layer"
  sms = pallas_norm.config.device_info().num_sms
  x, s, b = _data((1024, 4096), layer=layer)
  xs = {"finite": x, "nan_inf": x.at[5, 7].set(jnp.nan).at[900, 3].set(jnp.inf)}
  inv = F32(1) / F32(0.01)
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
  cfgs = [(kfp8.Fp8Config(1, 4096, 8), False), (kfp8.Fp8Config(1, 4096, 8, 2 * sms, True),
                                                 False),
          (kfp8.Fp8Config(1, 4096, 8, 3 * sms, True, True, True), False),  # row_amax
          (kfp8.Fp8Config(32, 128, 16, 2 * sms, True), True)]
  tiny = (jnp.full_like(s, 1e-39), None if b is None else b * 1e-39)  # subnormal y
  for name, xv in xs.items():
    for sv, bv in ((s, b), tiny):
      outs = {}
      for hw in (True, False):
        monkeypatch.setattr(kfp8, "HW_AMAX", hw)
        got = [kfp8.fp8_norm_delayed(xv, sv, bv, inv, fp8_dtype=E4M3, transpose=t, config=c,
                                     **kw) for c, t in cfgs]
        got.append(kfp8.fp8_stats(xv, sv, bv, **kw))
        mean, rstd = got[0][2], got[0][3]
        got.append(kfp8.fp8_quantise(xv, sv, bv, mean if layer else None, rstd, inv,
                                     scale_offset=0.0, subtract_mean=layer, fp8_dtype=E4M3,
                                     transpose=False, interpret=False, return_amax=True))
        # amax bits (int32): any NaN as one value (max.NaN.f32 gives the canonical NaN,
        # the int32 max the bits of |x| of the NaN it met)
        outs[hw] = [_bits(jnp.where(a > 0x7F800000, -1, a) if a.dtype == jnp.int32 else a)
                    for a in jax.tree.leaves(got)]
      assert len(outs[True]) == len(outs[False])
      for a, c in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(a, c, err_msg=f"{op} {name}")
      amax = _f32(kfp8.reduce_amax(got[0][4]))
      if name == "nan_inf":
        assert np.isnan(amax)
      else:
        assert 0 < amax < (1e-37 if sv is not s else np.inf)
