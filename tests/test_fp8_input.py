"""FP8 input (issue #27 item 1): ``rms_norm(x_fp8, scale, x_scale=s)`` / ``layer_norm``.

x is float8_e4m3fn or float8_e5m2 with one float32 dequantisation scale per group of
``group_size`` consecutive elements of a row (COAT's s_x); the kernels dequantise in
registers, forward and backward. Oracle: the jnp reference that dequantises first
(``reference.dequantise``, then ``reference.norm`` in float32): y against it rounded to
out_dtype, dx / dscale / dbias against ``jax.vjp`` of it on the float32 dequantised x.
Every forward and backward kernel variant is forced through its config at the launcher
level; the public op runs in every mode. On CPU the kernels run in Pallas interpret
mode; ``make gpu-check`` runs this file with interpret=False, plus the ``gpu`` test on
real shapes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import config as pn_config
from pallas_norm import ops, reference

MODES = pn_config.MODES
FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_EPS_RMS = float(jnp.finfo(jnp.float32).eps)
# About one unit roundoff of the compared dtype; float32 gets a floor of 2^-17 (the
# residual tests' scale).
_ULP = {"float32": 2.0**-17, "bfloat16": 2.0**-8, "float16": 2.0**-10}
# (M, N, group_size, FP8 dtype): a single row, ragged M, N that needs column masking
# (96 in a 128-wide tile, 1008 in 1024, 384 in 512), group sizes 16 to 128, both FP8
# dtypes. One row a case (CPU time), every mode and both ops among the cases; every
# kernel variant in both ops below (test_kernel_variants).
SHAPES = [(1, 64, 16, "e4m3"), (7, 96, 32, "e5m2"), (13, 1008, 16, "e5m2"),
          (5, 384, 128, "e4m3")]
_CASES = [(False, "multi_wave_cached", SHAPES[2]), (False, "static_persistent", SHAPES[3]),
          (True, "multi_wave_reload", SHAPES[1]), (True, "multi_wave_cached", SHAPES[0])]


def _interpret():
  return jax.default_backend() != "gpu"


def _quantise(v, fp8, group_size):
  """v [..., N] f32 -> (x fp8, x_scale [..., N // G] f32): current scaling per group,
  scale = amax / fp8_max, as the FP8 contract's quantise (NaN-free inputs here)."""
  fmax = float(jnp.finfo(fp8).max)
  g = v.reshape(*v.shape[:-1], -1, group_size)
  amax = np.abs(g).max(-1)
  s = np.where(amax > 0, amax / fmax, 1.0).astype(np.float32)
  q = np.clip(g * (np.float32(1) / s)[..., None], -fmax, fmax).reshape(v.shape)
  return jnp.asarray(q, jnp.float32).astype(fp8), jnp.asarray(s)


def _inputs(m, n, group_size, fp8="e4m3", *, layer, seed=0, lead=None):
  rng = np.random.default_rng(seed + 7919 * m + n + group_size)
  # Groups of different magnitudes: the scales matter.
  v = rng.standard_normal((m, n)) * np.exp(rng.uniform(-3, 3, (m, n // group_size))).repeat(
      group_size, -1) + (0.5 if layer else 0.0)
  x, s = _quantise(v.astype(np.float32), FP8[fp8], group_size)
  scale = jnp.asarray(1 + 0.5 * rng.standard_normal(n), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32) if layer else None
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  if lead is not None:
    x, s, dy = (a.reshape(*lead, *a.shape[1:]) for a in (x, s, dy))
  return x, s, scale, bias, dy


def _op(layer, **kw):
  if layer:
    return lambda x, s, w, b: pallas_norm.layer_norm(x, w, b, x_scale=s, **kw)
  return lambda x, s, w, b: pallas_norm.rms_norm(x, w, x_scale=s, **kw)


def _ref_fn(layer, out_dtype=jnp.bfloat16, scale_offset=0.0):
  """(dequantised float32 x, scale, bias) -> y in out_dtype: the reference."""
  eps = 1e-5 if layer else _EPS_RMS
  return lambda xd, w, b: reference.norm(xd, w, b, eps=eps, scale_offset=scale_offset,
                                         subtract_mean=layer, out_dtype=out_dtype)[0]


def _close(got, want, dtype, n=1, what=""):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = 4 * _ULP[jnp.dtype(dtype).name] * max(1.0, np.sqrt(n) / 8)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()),
                             err_msg=what)


def _check_vjp(f, x, s, scale, bias, dy, *, layer, out_dtype=jnp.bfloat16, ref=None):
  """y and (dx, dx_scale, dscale, dbias) of ``f`` against the reference's; returns them."""
  m, n = x.shape[0], x.shape[-1]
  y, pull = jax.vjp(f, x, s, scale, bias)
  xd = reference.dequantise(x, s)
  y_w, pull_w = jax.vjp(ref or _ref_fn(layer, out_dtype), xd, scale, bias)
  assert y.dtype == y_w.dtype == jnp.dtype(out_dtype) and y.shape == x.shape
  _close(y, y_w, out_dtype, n, "y")
  dx, ds_x, ds, db = grads = pull(dy.astype(out_dtype))
  dx_w, ds_w, db_w = pull_w(dy.astype(out_dtype))
  assert dx.dtype == jnp.dtype(out_dtype) and dx.shape == x.shape
  _close(dx, dx_w, out_dtype, n, "dx")
  assert ds_x.dtype == jnp.float32 and not np.asarray(ds_x).any()  # x_scale: constants
  _close(ds, ds_w, jnp.float32, m, "dscale")
  if layer:
    _close(db, db_w, jnp.float32, m, "dbias")
  return y, grads


# --------------------------------------------------------------------------- public op


@pytest.mark.parametrize("layer,mode,shape", _CASES,
                         ids=[f"{'layer' if c[0] else 'rms'}-{c[1]}" for c in _CASES])
def test_matches_reference(layer, mode, shape):
  """y, dx, dscale (and dbias) of the public op in every mode, on the shape table (the
  heuristic's mode=None is one of these on CPU; the gpu test runs it too)."""
  m, n, g, fp8 = shape
  x, s, scale, bias, dy = _inputs(m, n, g, fp8, layer=layer)
  _check_vjp(_op(layer, group_size=g, mode=mode), x, s, scale, bias, dy, layer=layer)


def test_out_dtype():
  """y and dx in out_dtype (float32 here, float16 in the tensor-parallel kernels' test);
  scale_offset (Gemma's cast) applied as for a float x; groups of 256."""
  x, s, scale, bias, dy = _inputs(6, 768, 256, "e5m2", layer=True)
  f = _op(True, group_size=256, out_dtype=jnp.float32, cast="gemma")
  _check_vjp(f, x, s, scale, bias, dy, layer=True, out_dtype=jnp.float32,
             ref=_ref_fn(True, jnp.float32, scale_offset=1.0))


def test_xla_backend():
  """backend='xla' is the reference (bitwise), under the same contract: dx the
  cotangent of the dequantised x, in out_dtype; x_scale's cotangent zero."""
  x, s, scale, _, dy = _inputs(7, 96, 32, layer=False)
  f = _op(False, group_size=32, backend="xla")
  y, (dx, ds_x, ds, _) = _check_vjp(f, x, s, scale, None, dy, layer=False)
  y_w, pull_w = jax.vjp(_ref_fn(False), reference.dequantise(x, s), scale, None)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_w, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32),
                                np.asarray(pull_w(dy)[0].astype(jnp.bfloat16), np.float32))


def test_transforms_and_determinism():
  """jit of a rank-3 x, vmap, a 1-D x, grad under checkpoint; bitwise-equal reruns; the
  saved residuals are the FP8 x and its scales (no dequantised copy)."""
  x, s, scale, _, dy = _inputs(12, 128, 16, layer=False)
  f = _op(False)
  want = _ref_fn(False)(reference.dequantise(x, s), scale, None)
  x3, s3 = x.reshape(3, 4, 128), s.reshape(3, 4, 8)
  for got in (jax.jit(f)(x3, s3, scale, None),
              jax.vmap(f, in_axes=(0, 0, None, None))(x3, s3, scale, None)):
    np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(want.shape),
                                  np.asarray(want, np.float32))
  y1 = f(x[0], s[0], scale, None)
  assert y1.shape == (128,) and y1.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(want[0], np.float32))

  _, res = jax.vjp(f, x, s, scale, None)
  big = [a for a in jax.tree_util.tree_leaves(res) if getattr(a, "size", 0) >= x.size]
  assert [a.dtype for a in big] == [x.dtype]

  def loss(x, s, w):
    return jnp.sum(jax.checkpoint(f)(x, s, w, None).astype(jnp.float32) * dy)

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  g1, g2 = g(x, s, scale), g(x, s, scale)
  for a, b in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  _, pull_w = jax.vjp(_ref_fn(False), reference.dequantise(x, s), scale, None)
  dx_w, ds_w, _ = pull_w(dy)
  assert g1[0].dtype == jnp.bfloat16 and not np.asarray(g1[1]).any()
  _close(g1[0], dx_w, "bfloat16", 128, "dx")
  _close(g1[2], ds_w, "float32", 12, "dscale")


def test_empty_rows():
  x = jnp.zeros((0, 64), jnp.float8_e4m3fn)
  y = pallas_norm.layer_norm(x, x_scale=jnp.zeros((0, 4)), out_dtype=jnp.float16)
  assert y.shape == (0, 64) and y.dtype == jnp.float16


def test_errors():
  x = jnp.ones((4, 64), jnp.float8_e4m3fn)
  s = jnp.ones((4, 4), jnp.float32)
  xb = jnp.ones((4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs x_scale"):
    pallas_norm.rms_norm(x)
  with pytest.raises(ValueError, match="x_scale is the dequantisation scale of FP8 x"):
    pallas_norm.rms_norm(xb, x_scale=s)
  with pytest.raises(ValueError, match="out_dtype=.* is for FP8 x only"):
    pallas_norm.layer_norm(xb, out_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"x_scale.shape=\(4, 8\) must be \(4, 4\)"):
    pallas_norm.rms_norm(x, x_scale=jnp.ones((4, 8)))
  with pytest.raises(ValueError, match=r"x_scale.shape=\(4,\) must be \(4, 4\)"):
    pallas_norm.rms_norm(x, x_scale=jnp.ones((4,)))
  with pytest.raises(TypeError, match="x_scale.dtype=bfloat16 must be float32"):
    pallas_norm.rms_norm(x, x_scale=s.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"group_size=48 must be one of .* N=64 "
                                       r"\(x_scale.shape=\(4, 4\)\)"):
    pallas_norm.rms_norm(x, x_scale=s, group_size=48)
  with pytest.raises(ValueError, match=r"group_size=128 .* divide N=64"):
    pallas_norm.rms_norm(x, x_scale=s, group_size=128)
  with pytest.raises(ValueError, match=r"group_size=16 .* divide N=40"):
    pallas_norm.rms_norm(jnp.ones((4, 40), jnp.float8_e5m2), x_scale=jnp.ones((4, 2)))
  with pytest.raises(TypeError, match="group_size=16.0 must be an int"):
    pallas_norm.rms_norm(x, x_scale=s, group_size=16.0)
  with pytest.raises(TypeError, match="out_dtype=int8 must be float32, bfloat16 or float16"):
    pallas_norm.rms_norm(x, x_scale=s, out_dtype=jnp.int8)
  with pytest.raises(TypeError, match="out_dtype=float8_e4m3fn must be"):
    pallas_norm.rms_norm(x, x_scale=s, out_dtype=jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="cast='llama' .* no meaning for FP8 x"):
    pallas_norm.rms_norm(x, jnp.ones(64), x_scale=s, cast="llama")
  with pytest.raises(ValueError, match="residual= is not supported with FP8 x"):
    pallas_norm.rms_norm(x, x_scale=s, residual=xb)
  with pytest.raises(TypeError, match="x.dtype=float8_e4m3fnuz must be"):
    pallas_norm.rms_norm(x.astype(jnp.float8_e4m3fnuz), x_scale=s)


# ------------------------------------------------------- every kernel variant, by config


def _launch_case(m, n, g, fp8, layer, cfg_fwd, cfg_bwd):
  """norm_forward(x_scale=) with cfg_fwd and norm_backward(x_scale=) with cfg_bwd
  against the reference's values and vjp; the launch runs twice and gives the same
  bits (deterministic)."""
  from pallas_norm.kernels import backward, forward
  x, s, scale, bias, dy = _inputs(m, n, g, fp8, layer=layer)
  b = bias if layer else None

  @jax.jit
  def launch(x, s, scale, b, dy):
    y, mean, rstd = forward.norm_forward(x, scale, b, eps=1e-5, scale_offset=0.5,
                                         subtract_mean=layer, config=cfg_fwd,
                                         interpret=_interpret(), x_scale=s)
    return (y, *backward.norm_backward(
        dy, x, scale, mean, rstd, has_bias=layer, scale_offset=0.5, subtract_mean=layer,
        config=cfg_bwd, interpret=_interpret(), scale_dtype=jnp.float32,
        bias_dtype=jnp.float32, x_scale=s))

  out = launch(x, s, scale, b, dy)
  ref = lambda xd, w, b: reference.norm(xd, w, b, eps=1e-5, scale_offset=0.5,
                                        subtract_mean=layer, out_dtype=jnp.bfloat16)[0]
  y_w, pull = jax.vjp(ref, reference.dequantise(x, s), scale, b)
  assert out[0].dtype == out[1].dtype == jnp.bfloat16
  for name, got, want, d, k in zip(("y", "dx", "dscale", "dbias"), out, (y_w, *pull(dy)),
                                   ("bfloat16", "bfloat16", "float32", "float32"),
                                   (n, n, m, m)):
    if want is not None:
      _close(got, want, d, k, name)
  for first, again in zip(out, launch(x, s, scale, b, dy)):
    if first is not None:
      np.testing.assert_array_equal(np.asarray(first, np.float32),
                                    np.asarray(again, np.float32))


# test_residual's kernel-variant configs at half its tile widths (CPU time).
FWD = {
    "cached": pn_config.ForwardConfig("multi_wave_cached", 2, 512, 4),
    "cached_split": pn_config.ForwardConfig("multi_wave_cached", 2, 128, 4, chunk_n=64),
    "reload": pn_config.ForwardConfig("multi_wave_reload", 2, 128, 4),
    "persistent": pn_config.ForwardConfig("static_persistent", 2, 512, 4, 3),
    "persistent_chunked": pn_config.ForwardConfig("static_persistent", 2, 128, 4, 3),
    "persistent_split": pn_config.ForwardConfig("static_persistent", 1, 128, 4, 2,
                                                split_rows=True, split_lag=2),
}
_RED = pn_config.reduce_config(512, 2)
BWD = {
    "persistent": pn_config.BackwardConfig(2, 512, 4, 2, **_RED),
    "pieces": pn_config.BackwardConfig(1, 512, 4, 2, pieces=(256, 128), **_RED),
    "reload": pn_config.BackwardConfig(2, 128, 4, 2, reload_rows=True, **_RED),
    "split": pn_config.BackwardConfig(1, 128, 4, 2, split_rows=True, split_lag=1,
                                      chunk_n=64, **_RED),
    "columns": pn_config.BackwardConfig(2, 128, 4, 2, **_RED),
}
# (forward, backward, group size, FP8 dtype, LayerNorm): every variant once (the
# split-row pair in both ops; CPU time), with group sizes up to the narrowest tile of
# its configs (the splits' 64-wide chunks). x reaches the kernels through one load
# helper whatever the op (forward._load_x).
VARIANTS = [("cached", "persistent", 128, "e4m3", True),
            ("cached_split", "split", 64, "e5m2", False),
            ("cached_split", "split", 64, "e4m3", True),
            ("reload", "reload", 32, "e4m3", False),
            ("persistent", "pieces", 16, "e5m2", True),
            ("persistent_chunked", "columns", 64, "e4m3", False),
            ("persistent_split", "persistent", 16, "e5m2", True),
            ("persistent_split", "split", 16, "e4m3", False)]


@pytest.mark.parametrize("fwd,bwd,g,fp8,layer", VARIANTS,
                         ids=["-".join(map(str, v[:2])) + ("-layer" if v[4] else "-rms")
                              for v in VARIANTS])
def test_kernel_variants(fwd, bwd, g, fp8, layer):
  """Every forward and backward kernel on a ragged M and an N that needs masking (the
  chunked and split ones over 3 tiles), run twice for the same bits."""
  _launch_case(9, 384 - g, g, fp8, layer, FWD[fwd], BWD[bwd])


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_stage1_flags_bitwise(layer):
  """FP8 x through the persistent stage 1 with the flags that free registers for two
  programs a SM (BackwardConfig.reload_scale and recompute_dx, with prefetch_stats and
  joint_row_sums; docs/fp8_tuning.md#fp8-x-occupancy): dx, dscale and dbias bit for bit the
  stock kernel's on the same tile (the same float32 operations in the same order). On
  the GPU (``--gpu``) at the tile of the rule and ragged rows."""
  from pallas_norm.kernels import backward
  m, n, g, w = (13, 256, 3, 4) if _interpret() else (1000, 4096, 264, 16)  # >= 3 steps
  x, s, scale, _, dy = _inputs(m, n, 16, layer=layer)
  _, mean, rstd = reference.norm(reference.dequantise(x, s), scale, None, eps=1e-5,
                                 subtract_mean=layer)
  base = pn_config.BackwardConfig(1, n, w, g, **pn_config.reduce_config(n, g))
  run = lambda cfg: backward.norm_backward(
      dy, x, scale.astype(jnp.bfloat16), mean, rstd, has_bias=layer, scale_offset=0.0,
      subtract_mean=layer, config=cfg, interpret=_interpret(), scale_dtype=jnp.bfloat16,
      bias_dtype=jnp.bfloat16, x_scale=s)
  want = run(base)
  got = run(dataclasses.replace(base, reload_scale=True, recompute_dx=True,
                                prefetch_stats=True, joint_row_sums=True))
  for a, b in zip(got, want):
    if b is not None:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_tensor_parallel_kernels():
  """norm_forward_stats / norm_forward_apply with x_scale (the hidden-dim-sharded pair),
  one shard, and the backward's row-statistics + column pair that it takes (LayerNorm;
  RMSNorm's run in tests/sharded); y and dx in float16."""
  from pallas_norm.kernels import backward, forward
  m, n, g = 7, 320, 32
  x, s, scale, bias, dy = _inputs(m, n, g, "e4m3", layer=True)
  dy = dy.astype(jnp.float16)
  cfg = pn_config.forward_config(m, n, x.dtype, "static_persistent", subtract_mean=True)
  mean, m2 = forward.norm_forward_stats(x, subtract_mean=True, config=cfg,
                                        interpret=_interpret(), x_scale=s)
  rstd = jax.lax.rsqrt(m2 / n + 1e-5)
  y = forward.norm_forward_apply(x, scale, bias, mean, rstd, scale_offset=0.0, config=cfg,
                                 interpret=_interpret(), x_scale=s, y_dtype=jnp.float16)
  y_w, pull = jax.vjp(_ref_fn(True, jnp.float16), reference.dequantise(x, s), scale, bias)
  assert y.dtype == jnp.float16
  _close(y, y_w, "float16", n, "y")
  dx, ds, db = backward.norm_backward(
      dy, x, scale, mean, rstd, has_bias=True, scale_offset=0.0, subtract_mean=True,
      config=pn_config.backward_config(m, n, x.dtype, subtract_mean=True),
      interpret=_interpret(), scale_dtype=jnp.float32, bias_dtype=jnp.float32,
      combine_row_sums=lambda c1, c2: (c1, c2), x_scale=s, dx_dtype=jnp.float16)
  assert dx.dtype == jnp.float16
  for name, got, want, d, k in zip(("dx", "dscale", "dbias"), (dx, ds, db), pull(dy),
                                   ("float16", "float32", "float32"), (n, m, m)):
    _close(got, want, d, k, name)


def test_launcher_checks():
  """The launchers' own check (fp8_group_size): scales that do not fit x or the config."""
  from pallas_norm.kernels import forward
  x = jnp.ones((4, 256), jnp.float8_e4m3fn)
  cfg = pn_config.ForwardConfig("multi_wave_reload", 4, 64, 4)
  run = functools.partial(forward.norm_forward, eps=1e-5, scale_offset=0.0,
                          subtract_mean=False, interpret=True)
  with pytest.raises(ValueError, match=r"column tiles \(64,\) must be multiples of the "
                                       r"group size 128"):
    run(x, None, None, config=cfg, x_scale=jnp.ones((4, 2)))
  with pytest.raises(ValueError, match="a power of 2 dividing N"):
    run(x, None, None, config=cfg, x_scale=jnp.ones((4, 5)))
  with pytest.raises(ValueError, match="needs x_scale"):
    run(x, None, None, config=cfg)
  with pytest.raises(ValueError, match="x_scale is for FP8 x"):
    run(x.astype(jnp.bfloat16), None, None, config=cfg, x_scale=jnp.ones((4, 16)))


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("device", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_config_tiles_fit_every_group_size(device):
  """The configs config.py picks for FP8 x (its itemsize-1 dtype goes through the
  2-byte rules) have every column tile a multiple of each group size the ops accept,
  over row lengths that group sizes divide, on the GPUs and on CPU."""
  devices = [pn_config.DeviceInfo("gpu", device, 132), pn_config.device_info()]
  ns = [16, 48, 96, 512, 1008, 3072, 4096, 5120, 8192, 12288, 16384, 24576, 32768,
        65536, 98304, 131072, 262144, 540672, 1048576]
  for dev in devices:
    for n in ns:
      for layer in (False, True):
        for mode in (None, *MODES):
          for m in (1, 4096):
            try:
              f = pn_config.forward_config(m, n, jnp.float8_e4m3fn, mode, dev,
                                           subtract_mean=layer)
            except NotImplementedError:  # multi_wave_cached's limit, as for bf16
              continue
            b = pn_config.backward_config(m, n, jnp.float8_e4m3fn, dev, subtract_mean=layer)
            for g in ops.GROUP_SIZES:
              if n % g == 0:
                for w in (f.block_n, f.chunk_n, b.block_n, b.chunk_n, *b.pieces):
                  assert w % g == 0, (dev, n, layer, mode, g, f, b)


def test_lowers_for_cuda():
  """The FP8 kernels of every mode, forward and backward, lower through JAX's Pallas
  Triton lowering for CUDA (which runs on a CPU-only machine): the dequantising reshape
  and the FP8 loads are accepted. (4096 rows: on a GPU fewer rows take a one-kernel
  backward, tests/test_few_rows.py.)"""
  m, n, g = 4096, 1024, 16
  args = (jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((m, n // g), jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))
  lower = lambda f: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  for mode in MODES:
    assert "__gpu$xla.gpu.triton" in lower(_op(False, mode=mode, interpret=False))
  f = _op(True, interpret=False)
  vjp = lambda x, s, w, b: jax.vjp(f, x, s, w, b)[1](jnp.ones((m, n), jnp.bfloat16))
  assert lower(vjp).count("__gpu$xla.gpu.triton") == 3  # forward, stage 1, stage 2


def test_vector_cols_are_the_columns():
  """The FP8 load's index (forward._vector_cols: columns as runs of 8 for
  Triton's axis analysis, docs/fp8_tuning.md#fp8-x-vector) holds the same column numbers, for
  tile starts at any multiple of the tile and every vector width (0: cols itself)."""
  from pallas_norm.kernels import forward
  for start in (0, 16, 512, 4096, 2**20):
    cols = start + jnp.arange(512, dtype=jnp.int32)
    for vec in (0, 4, 8, 16):
      got = forward._vector_cols(cols, vec)
      assert got.dtype == jnp.int32
      np.testing.assert_array_equal(np.asarray(got), np.asarray(cols))


def test_fp8_vector_rule():
  """forward._fp8_vector, the measured rule (docs/fp8_tuning.md#fp8-x-vector): runs of 8 but
  for the kernels of _FP8_VECTOR_16 (16-value runs, 0), N' capped at 16384; _x_src gives
  each FP8 source its kernel's vector."""
  from pallas_norm.kernels import forward
  v = forward._fp8_vector
  assert [v("forward", sm, n) for sm in (False, True) for n in (1000, 4096, 8192, 65536)
          ] == [8] * 8
  assert [v("forward_res", False, n) for n in (4096, 5000, 16384, 65536)] == [8, 0, 0, 0]
  assert [v("forward_res", True, n) for n in (4096, 8192, 16384)] == [8, 8, 8]
  assert [v("backward", False, n) for n in (1000, 1500, 4096, 16384)] == [8, 0, 8, 8]
  assert [v("backward", True, n) for n in (2048, 4096, 8192, 12288, 65536)] == [8, 8, 0, 0, 0]
  assert v("stats", True, 8192) == v("apply", False, 2048) == 8
  refs = [object()]
  src = forward._x_src(jax.ShapeDtypeStruct((64, 8192), jnp.float8_e4m3fn), refs, 16,
                       "backward", True)
  assert (src.group_size, src.vector, refs) == (16, 0, [])
  assert forward._x_src("x", [], 0, "backward", True) == "x"  # not FP8: x itself


def test_fp8_bwd_two_byte_scale_rule():
  """config._FP8_BWD_H100_2B (docs/fp8_tuning.md#fp8-x-occupancy): on the H100 the FP8-x
  backward's one-tile stage 1 with a 2-byte scale runs 8 elements a thread at 1024
  threads a SM with the flags measured (LayerNorm N' = 2048, 4096, 8192; RMSNorm N' =
  2048); a float32 or unknown scale, RMSNorm at 4096, bf16 x, the H200 and other widths
  keep their configs; ops passes the scale's dtype."""
  h100 = pn_config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
  want = {(True, 2048): (8, 528, False, True), (True, 4096): (16, 264, True, True),
          (True, 8192): (32, 132, True, False), (False, 2048): (8, 528, True, False)}
  for (layer, n), (warps, g, recompute, reload) in want.items():
    for pd in (jnp.bfloat16, jnp.float16):
      c = pn_config.backward_config(8192, n, jnp.float8_e4m3fn, h100, subtract_mean=layer,
                                    param_dtype=pd)
      assert (c.block_m, c.block_n, c.num_warps, c.num_programs) == (1, n, warps, g)
      assert (c.recompute_dx, c.reload_scale, c.prefetch_stats) == (recompute, reload, True)
      assert c.joint_row_sums == layer
  bwd = functools.partial(pn_config.backward_config, 8192, 4096, jnp.float8_e4m3fn, h100,
                          subtract_mean=True)
  for c in (bwd(param_dtype=jnp.float32), bwd()):
    assert (c.num_warps, c.num_programs, c.recompute_dx, c.reload_scale) == (32, 132, 0, 0)
  h200 = pn_config.DeviceInfo("gpu", "NVIDIA H200", 132)
  for m, n, dtype, dev, layer in [(8192, 4096, jnp.float8_e4m3fn, h100, False),
                                  (8192, 8192, jnp.float8_e4m3fn, h100, False),
                                  (8192, 1024, jnp.float8_e4m3fn, h100, True),
                                  (8192, 4096, jnp.bfloat16, h100, True),
                                  (8192, 4096, jnp.float8_e4m3fn, h200, True),
                                  (8192, 2048, jnp.float8_e4m3fn, h200, False)]:
    cfg = functools.partial(pn_config.backward_config, m, n, dtype, dev, subtract_mean=layer)
    assert cfg(param_dtype=jnp.bfloat16) == cfg(), (m, n, dtype, dev.name, layer)
  seen = []
  real = pn_config.backward_config
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(pn_config, "backward_config",
               lambda *a, **k: seen.append(k.get("param_dtype")) or real(*a, **k))
    x, s, scale, bias, dy = _inputs(4, 256, 16, layer=True)
    jax.clear_caches()  # the ops' jit may hold a trace of these shapes
    y, pull = jax.vjp(lambda w: _op(True)(x, s, w, bias), scale.astype(jnp.bfloat16))
    pull(dy)
  assert seen and all(jnp.dtype(d) == jnp.bfloat16 for d in seen)


def test_wide_fp8_mode_rule():
  """config._FP8_WIDE_MODES_H100 (docs/fp8_tuning.md#fp8-x-wide): on the H100, FP8 x at
  8192 < N <= 16384 picks its forward mode by op and by return_residuals (LayerNorm's
  plain forward with 2-byte scale/bias by _FP8_WIDE_MODES_H100_2B; RMSNorm's under
  jax.vjp splits rows, _FP8_RMS_VJP_SPLIT_H100, #fp8-x-wide-split); bf16 x, the
  H200, N outside the range, a residual add and the Triton backend keep the heuristic's
  other rules."""
  h100 = pn_config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
  h200 = pn_config.DeviceInfo("gpu", "NVIDIA H200", 132)
  f8 = jnp.float8_e4m3fn
  pick = lambda n, dev=h100, dt=f8, **kw: pn_config.choose_mode(4096, n, dt, dev, **kw)
  assert pick(16384, return_residuals=False) == "multi_wave_cached"
  assert pick(12288, return_residuals=True) == "static_persistent"
  assert pick(16384, subtract_mean=True, return_residuals=True) == "multi_wave_cached"
  assert pick(16384, subtract_mean=True, return_residuals=False) == "static_persistent"
  assert pick(16384, subtract_mean=True, return_residuals=False,
              param_dtype=jnp.float32) == "static_persistent"
  # LayerNorm's plain forward with 2-byte scale/bias: [1, 16384] x 16, multi_wave_cached
  for pd in (jnp.bfloat16, jnp.float16):
    assert pick(16384, subtract_mean=True, return_residuals=False,
                param_dtype=pd) == "multi_wave_cached"
    c = pn_config.forward_config(4096, 16384, f8, device=h100, subtract_mean=True,
                                 return_residuals=False, param_dtype=pd)
    assert (c.mode, c.block_m, c.block_n, c.num_warps) == ("multi_wave_cached", 1, 16384, 16)
  # RMSNorm under jax.vjp: rows split over persistent programs, 1024 wide, 1 warp,
  # 16 a SM, early publish 2 ahead (_FP8_RMS_VJP_SPLIT_H100); alone, the one-tile rule
  for n, groups in ((16384, 132), (12288, 176)):
    for pd in (None, jnp.bfloat16, jnp.float32):
      c = pn_config.forward_config(4096, n, f8, device=h100, param_dtype=pd)
      assert c == pn_config.ForwardConfig("static_persistent", 1, 1024, 1, groups,
                                          split_rows=True, split_lag=2,
                                          split_early_publish=True), (n, pd, c)
  c = pn_config.forward_config(4096, 16384, f8, device=h100, return_residuals=False)
  assert (c.mode, c.block_n, c.split_rows) == ("multi_wave_cached", 16384, False)
  for kw in (dict(device=h200), dict(device=h100, residual=True),
             dict(device=h100, backend="triton"), dict(device=h100, subtract_mean=True)):
    assert not pn_config.forward_config(4096, 16384, f8, **kw).split_rows, kw
  assert not pn_config.forward_config(4096, 16384, jnp.bfloat16, device=h100).split_rows
  assert pick(16384, subtract_mean=True, return_residuals=True,
              param_dtype=jnp.bfloat16) == "multi_wave_cached"  # the vjp rule's
  assert pn_config.forward_config(4096, 16384, f8, device=h100, subtract_mean=True,
                                  param_dtype=jnp.bfloat16).block_m == 2
  for kw in (dict(dev=h200), dict(residual=True), dict(backend="triton")):
    # FP8 x there picks as bf16 x does (the 2-byte rules)
    assert (pick(16384, return_residuals=False, **kw)
            == pick(16384, return_residuals=False, dt=jnp.bfloat16, **kw)), kw
  assert pick(16384, return_residuals=False, dt=jnp.bfloat16) == "multi_wave_reload"
  assert pick(8192, return_residuals=False) == "multi_wave_cached"  # N' 8192's own rules
  assert pick(32768, return_residuals=False) == "multi_wave_cached"  # split rows


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_gpu_real_shapes(layer, mode):
  """Compiled (interpret=False) on real shapes, every mode: 4096 x 4096 and 1024 x 8192
  (one-tile rows), 512 x 16384 (the H100's wide-row rules: RMSNorm's split-row forward
  under jax.vjp) and 256 x 65536 (the split-row forward and backward); groups of 16,
  512 and 256, both FP8 dtypes."""
  for (m, n), (fp8, g) in [((4096, 4096), ("e4m3", 16)), ((1024, 8192), ("e5m2", 512)),
                           ((512, 16384), ("e4m3", 16)), ((256, 65536), ("e4m3", 256))]:
    x, s, scale, bias, dy = _inputs(m, n, g, fp8, layer=layer)
    f = jax.jit(_op(layer, group_size=g, mode=mode, interpret=False))
    _check_vjp(f, x, s, scale, bias if layer else None, dy, layer=layer)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_gpu_triton_backend(layer, mode):
  """backend="triton" (plain Triton through jax-triton) with FP8 x, compiled: against
  the reference, and y within one bf16 ulp of backend="pallas" (the CPU tests run its
  kernels in Triton's interpreter: tests/test_triton_kernels.py::test_glue_fp8_input)."""
  for (m, n), (fp8, g) in [((4096, 4096), ("e4m3", 16)), ((1024, 8192), ("e5m2", 512))]:
    x, s, scale, bias, dy = _inputs(m, n, g, fp8, layer=layer)
    b = bias if layer else None
    y, _ = _check_vjp(jax.jit(_op(layer, group_size=g, mode=mode, backend="triton")),
                      x, s, scale, b, dy, layer=layer)
    y_p = jax.jit(_op(layer, group_size=g, mode=mode, interpret=False))(x, s, scale, b)
    _close(y, y_p, jnp.bfloat16, 1, "y triton vs pallas")


# --------------------------------------------------------------------------- bench op


def test_bench_fp8in_plan_and_bytes():
  """--ops fp8in: rms_fp8in and layer_fp8in, forward and forward+backward, on pallas and
  triton (every mode) and the jnp chain (xla), no other peer; the bytes model reads x at
  1 byte plus 4 bytes a group of 16, writes y (and dx) at the run's itemsize."""
  from pallas_norm import bench
  from pallas_norm.bench import cli
  from pallas_norm.bench import plan as bench_plan
  args = cli.parser().parse_args(["--shapes", "64x256", "--ops", "fp8in"])
  plan = bench.build_plan(args)
  assert {c.op for c in plan} == {"rms_fp8in", "layer_fp8in"}
  assert {c.pass_ for c in plan} == {"fwd", "fwdbwd"}
  assert {c.impl for c in plan} == {"pallas", "pallas-untuned", "triton", "xla",
                                    "pallas:reload",
                                    "pallas:cached", "pallas:persistent", "triton:reload",
                                    "triton:cached", "triton:persistent"}
  m, n = 8, 32
  fwd = m * n * (1 + 2) + 4 * m * n // 16
  assert bench.bytes_model(m, n, 2, "fwd", "rms_fp8in") == fwd
  assert bench.bytes_model(m, n, 2, "fwdbwd", "layer_fp8in") == fwd + fwd + 2 * m * n
  assert bench_plan.fp8_variant("rms_fp8in") is None


def test_bench_fp8in_on_cpu(tmp_path, monkeypatch):
  """rms_fp8in forward+backward through the bench's run loop (interpret mode): pallas
  and the jnp chain run, --check passes on y, dx and dscale (no CUPTI on CPU: no time)."""
  import json
  from pallas_norm import bench
  from pallas_norm.bench import cli, report, run, timing
  from pallas_norm.bench import plan as bench_plan
  monkeypatch.setattr(bench_plan, "MAX_ROTATIONS", 1)
  # The run's GPU preliminaries (clock ramp, copy, torch, the plot) are not under test.
  monkeypatch.setattr(timing, "warm_up", lambda: None)
  monkeypatch.setattr(timing, "measure_copy", lambda dtype, iters: {"copy_gbs": None})
  monkeypatch.setattr(timing, "torch_status", lambda: (False, "not in this test"))
  monkeypatch.setattr(report, "plot", lambda doc, png: None)
  out = tmp_path / "fp8in.json"
  args = cli.parser().parse_args(["--shapes", "8x256", "--ops", "rms_fp8in", "--passes",
                                  "fwdbwd", "--impls", "pallas,xla", "--iters", "2",
                                  "--check", "--out", str(out)])
  assert run.run_plan(args, bench.build_plan(args)) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["impl"] for r in rows] == ["pallas", "xla"]
  for r in rows:
    assert r["check"] == "ok", r
    assert "dx:rel=" in r["check_detail"] and "dscale:rel=" in r["check_detail"], r
    assert r["bytes"] == bench.bytes_model(8, 256, 2, "fwdbwd", "rms_fp8in")
