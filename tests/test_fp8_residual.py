"""The fused residual add before the quantising norm (``rms_norm_fp8`` /
``layer_norm_fp8`` with ``y_scale=`` and ``residual=``: vLLM's
``fused_add_rms_norm_static_fp8_quant``, W8A8 serving): (Fp8Norm, h), h = x + r.

Oracles: backend="xla" (h summed in float32, the norm of that sum quantised), and the
same FP8 op on the float32 sum (the kernels' y must be that op's: y from the float32
sum, not from the rounded h). On CPU the kernels run in Pallas interpret mode;
``make gpu-check`` runs this file with interpret=False.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import fp8
from pallas_norm.kernels import fp8 as kfp8

F32 = jnp.float32
OPS = {"rms": pallas_norm.rms_norm_fp8, "layer": pallas_norm.layer_norm_fp8}
_Y_SCALE = 8.0 / 448.0


def _data(shape, xd=jnp.bfloat16, rd=jnp.bfloat16, seed=0):
  k = jax.random.split(jax.random.key(seed + shape[-1]), 4)
  n = shape[-1]
  x = (2 * jax.random.normal(k[0], shape, F32)).astype(xd)
  r = (jax.random.normal(k[1], shape, F32) + 0.5).astype(rd)
  s = 1 + 0.3 * jax.random.normal(k[2], (n,), F32)
  b = 0.3 * jax.random.normal(k[3], (n,), F32)
  return x, r, s, b


def _call(op, x, s, b, **kw):
  return OPS[op](x, s, b, **kw) if op == "layer" else OPS[op](x, s, **kw)


def _fp8_ulps(a, b):
  """Largest distance in FP8 codes (e4m3fn: the int8 bit patterns, same sign)."""
  ia = np.asarray(jax.lax.bitcast_convert_type(a, jnp.int8), np.int32)
  ib = np.asarray(jax.lax.bitcast_convert_type(b, jnp.int8), np.int32)
  return int(np.max(np.abs(ia - ib)))


@pytest.mark.parametrize("op", ["rms", "layer"])
@pytest.mark.parametrize("shape,rd,residual_dtype,transpose", [
    ((1, 256), jnp.bfloat16, None, False),
    ((7, 384), jnp.float32, None, True),
    ((2, 3, 512), jnp.bfloat16, jnp.float32, False),
    ((64, 128), jnp.bfloat16, None, True),
    ((2, 256), jnp.bfloat16, None, False),  # the M in {1, 2, 7, 64, 511}
    ((511, 128), jnp.bfloat16, jnp.float32, False)])
def test_matches_xla_and_the_sum(op, shape, rd, residual_dtype, transpose):
  """One kernel; h = x + r in its dtype bit for bit; y, amax and y_t as the FP8 op of
  the float32 sum (the same kernel config) and within one FP8 code of backend="xla"."""
  x, r, s, b = _data(shape, rd=rd)
  kw = dict(y_scale=_Y_SCALE, residual=r, residual_dtype=residual_dtype,
            transpose=transpose)
  out, h = _call(op, x, s, b, **kw)
  outx, hx = _call(op, x, s, b, backend="xla", **kw)
  h32 = x.astype(F32) + r.astype(F32)
  assert h.dtype == jnp.dtype(residual_dtype or rd) and h.shape == x.shape
  np.testing.assert_array_equal(np.asarray(h, F32), np.asarray(h32.astype(h.dtype), F32))
  np.testing.assert_array_equal(np.asarray(hx, F32), np.asarray(h, F32))
  assert _fp8_ulps(out.y, outx.y) <= 1
  np.testing.assert_allclose(float(out.amax), float(outx.amax), rtol=2**-17)
  if transpose:
    np.testing.assert_array_equal(np.asarray(out.y_t, F32),
                                  np.asarray(out.y.reshape(-1, shape[-1]).T, F32))
  # the kernel normalises the float32 sum: the plain op on it gives the same bits
  ref = _call(op, h32, s, b, y_scale=_Y_SCALE, transpose=transpose)
  if jax.default_backend() != "gpu":
    np.testing.assert_array_equal(np.asarray(out.y, F32), np.asarray(ref.y, F32))
    np.testing.assert_array_equal(np.asarray(out.rstd), np.asarray(ref.rstd))
  f = lambda x, r: _call(op, x, s, b, **kw)  # noqa: E731
  assert str(jax.make_jaxpr(f)(x, r)).count("pallas_call") == 1


@pytest.mark.parametrize("op", ["rms", "layer"])
def test_chunked_rows(op):
  """A row longer than the config's block_n (the two-walk kernel): h stored by the
  statistics walk, y from the sum reloaded."""
  x, r, s, b = _data((5, 1024))
  cfg = kfp8.fp8_config(5, 1024, x.dtype, kernel="delayed", subtract_mean=op == "layer",
                        transpose=False, interpret=True)
  cfg = dataclasses.replace(cfg, block_n=256)
  y, _, mean, rstd, bits, h = kfp8.fp8_norm_delayed(
      x, s, b if op == "layer" else None, jnp.float32(1 / _Y_SCALE), eps=1e-6,
      scale_offset=0.0, subtract_mean=op == "layer", fp8_dtype=jnp.float8_e4m3fn,
      transpose=False, interpret=jax.default_backend() != "gpu", config=cfg, residual=r)
  h32 = x.astype(F32) + r.astype(F32)
  np.testing.assert_array_equal(np.asarray(h, F32), np.asarray(h32.astype(r.dtype), F32))
  want = _call(op, h32, s, b, y_scale=_Y_SCALE, eps=1e-6, backend="xla")
  assert _fp8_ulps(y, want.y) <= 1


def test_residual_config_is_the_row_block_kernel():
  cfg = kfp8.Fp8Config(block_m=1, block_n=4096, num_warps=8, num_programs=132, packed=True,
                       column_splits=1)
  got = kfp8.residual_config(dataclasses.replace(cfg, packed=False, column_splits=8,
                                                 num_programs=0))
  assert (got.num_programs, got.packed, got.column_splits) == (0, False, 1)
  assert kfp8.residual_config(cfg).num_programs == 0


def test_empty_rank_one_and_deterministic():
  x, r, s, _ = _data((0, 64))
  out, h = pallas_norm.rms_norm_fp8(x, s, y_scale=_Y_SCALE, residual=r)
  assert out.y.shape == h.shape == (0, 64)
  x, r, s, _ = _data((3, 64))
  out1, h1 = pallas_norm.rms_norm_fp8(x[0], s, y_scale=_Y_SCALE, residual=r[0])
  assert out1.y.shape == h1.shape == (64,)
  out, h = pallas_norm.rms_norm_fp8(x, s, y_scale=_Y_SCALE, residual=r)
  np.testing.assert_array_equal(np.asarray(out1.y, F32), np.asarray(out.y[0], F32))
  again, _ = pallas_norm.rms_norm_fp8(x, s, y_scale=_Y_SCALE, residual=r)
  np.testing.assert_array_equal(np.asarray(again.y, F32), np.asarray(out.y, F32))


@pytest.mark.parametrize("bad,exc,match", [
    (dict(y_scale=None), ValueError, "served with a given y_scale"),
    (dict(residual=jnp.ones((4, 7), jnp.bfloat16)), ValueError, "residual.shape"),
    (dict(residual=jnp.ones((4, 8), jnp.int32)), TypeError, "residual.dtype"),
    (dict(residual=None, residual_dtype=jnp.float32), ValueError, "needs a residual"),
    (dict(residual_dtype=jnp.int8), TypeError, "residual_dtype"),
])
def test_errors(bad, exc, match):
  kw = dict(y_scale=_Y_SCALE, residual=jnp.ones((4, 8), jnp.bfloat16))
  kw.update(bad)
  with pytest.raises(exc, match=match):
    pallas_norm.rms_norm_fp8(jnp.ones((4, 8), jnp.bfloat16), jnp.ones(8), **kw)


def test_not_differentiable():
  x, r, s, _ = _data((2, 64))
  with pytest.raises(TypeError, match="not differentiable"):
    jax.grad(lambda x: jnp.sum(pallas_norm.rms_norm_fp8(
        x, s, y_scale=_Y_SCALE, residual=r)[1]))(x)
  assert fp8.Fp8Norm._fields[-1] == "rstd"  # the result type is unchanged


@pytest.mark.cpu_only
def test_lowers_for_cuda():
  """The residual variants lower through JAX's Pallas Triton lowering for CUDA (on a
  CPU-only machine too): the whole-row and the chunked row-block kernel, with y_t, one
  custom call each."""
  sds = jax.ShapeDtypeStruct
  for m, n, layer, transpose in [(8, 4096, False, False), (512, 2048, True, True),
                                 (4, 65536, False, False)]:
    op = OPS["layer" if layer else "rms"]
    args = (sds((m, n), jnp.bfloat16), sds((m, n), jnp.bfloat16), sds((n,), F32))

    def call(x, r, s, op=op, layer=layer, transpose=transpose):
      extra = (s,) if layer else ()
      return op(x, s, *extra, y_scale=jnp.float32(_Y_SCALE), residual=r,
                transpose=transpose, interpret=False)

    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, (m, n)
