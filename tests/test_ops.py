"""pallas_norm.rms_norm / layer_norm against PyTorch, forward and backward, every mode.

Oracle: torch.nn.functional.rms_norm / layer_norm on the same (rounded) inputs, in the
same dtype for parity and in float64 for the error bound. Tolerances scale with sqrt(N)
for y and dx and with sqrt(M) for dscale and dbias. On CPU the kernels run in Pallas
interpret mode; ``make gpu-check`` runs this file with interpret=False.
"""

import itertools
import math

import hypothesis
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm
from pallas_norm import config as pn_config
from pallas_norm import reference

MODES = pn_config.MODES
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
# Every M in {1, 7, 199, 1024} and every N in {1, 3, 64, 760, 1000, 4096}.
SHAPES = [(1, 1), (7, 3), (199, 64), (1024, 760), (7, 1000), (199, 4096), (1, 4096),
          (1024, 3)]
# Relative error allowed on top of torch's own error, per dtype: about one output ulp.
ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-10}


def _inputs(m, n, dtype, *, layer, seed=0, mean=0.0):
  rng = np.random.default_rng(seed + 7919 * m + n)
  x = (rng.standard_normal((m, n)) * 2.0 + mean).astype(np.float32)
  scale = (1.0 + 0.5 * rng.standard_normal(n)).astype(np.float32)
  bias = rng.standard_normal(n).astype(np.float32) if layer else None
  dy = rng.standard_normal((m, n)).astype(np.float32)
  cast = lambda a: None if a is None else jnp.asarray(a, DTYPES[dtype])
  return cast(x), cast(scale), cast(bias), cast(dy)


def _torch(x, scale, bias, dy, *, layer, eps, dtype):
  """torch forward + backward on the same values; returns numpy float64 arrays."""
  t = lambda a: None if a is None else torch.tensor(
      np.asarray(jnp.asarray(a, jnp.float32)), dtype=dtype, requires_grad=True)
  xt, st, bt, dyt = t(x), t(scale), t(bias), t(dy)
  n = xt.shape[-1]
  if layer:
    y = torch.nn.functional.layer_norm(xt, (n,), st, bt, eps)
  else:
    y = torch.nn.functional.rms_norm(xt, (n,), st, eps)
  y.backward(dyt.detach())
  out = [y, xt.grad, st.grad if st is not None else None, bt.grad if bt is not None else None]
  return [None if a is None else a.detach().double().numpy() for a in out]


def _ours(x, scale, bias, dy, *, layer, eps, mode):
  if layer:
    f = lambda x, s, b: pallas_norm.layer_norm(x, s, b, eps=eps, mode=mode)
  else:
    f = lambda x, s, b: pallas_norm.rms_norm(x, s, eps=eps, mode=mode)
  y, vjp = jax.vjp(f, x, scale, bias)
  return [y, *vjp(dy)]


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check(name, ours, ref64, ref_same, *, dtype, scale_len):
  """|ours - ref64| <= 2 max|torch_same - ref64| + 4 ulp sqrt(len) (1 + |ref64|)."""
  assert ours is not None, name
  got = _f64(ours)
  assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
  err = np.abs(got - ref64)
  torch_err = np.abs(ref_same - ref64)
  tol = 2 * torch_err.max() + 4 * ULP[dtype] * math.sqrt(scale_len) * (1 + np.abs(ref64))
  bad = ~(err <= tol)
  assert not bad.any(), (f"{name}: {bad.sum()} of {bad.size} out of tolerance; max err "
                         f"{err.max():.3e}, torch's {torch_err.max():.3e}")


def _compare(m, n, dtype, mode, *, layer, eps=1e-5, mean=0.0, shape=None):
  x, scale, bias, dy = _inputs(m, n, dtype, layer=layer, mean=mean)
  if shape is not None:
    x, dy = x.reshape(shape), dy.reshape(shape)
  y, dx, dscale, dbias = _ours(x, scale, bias, dy, layer=layer, eps=eps, mode=mode)
  assert y.dtype == x.dtype and y.shape == x.shape
  assert dx.dtype == x.dtype and dx.shape == x.shape
  assert dscale.dtype == scale.dtype and dscale.shape == (n,)
  ref64 = _torch(x, scale, bias, dy, layer=layer, eps=eps, dtype=torch.float64)
  same = _torch(x, scale, bias, dy, layer=layer, eps=eps, dtype=TORCH_DTYPES[dtype])
  _check("y", y, ref64[0], same[0], dtype=dtype, scale_len=n)
  _check("dx", dx, ref64[1], same[1], dtype=dtype, scale_len=n)
  _check("dscale", dscale, ref64[2], same[2], dtype=dtype, scale_len=m)
  if layer:
    assert dbias.dtype == bias.dtype
    _check("dbias", dbias, ref64[3], same[3], dtype=dtype, scale_len=m)
  else:
    assert dbias is None


def _pairwise(*factors, full=2):
  """A deterministic covering subset of the product of ``factors``: every combination of
  the first ``full`` factors, and every value of every factor with every value of every
  other factor (all pairs). For each combination of the first ``full`` factors in turn,
  the row whose other values cover the most pairs not covered yet (ties: product order);
  then rows for any pair left."""
  def pairs(row):
    return {(i, row[i], j, row[j]) for i in range(len(row)) for j in range(i + 1, len(row))}
  want = set().union(*(pairs(r) for r in itertools.product(*factors)))
  rows, covered = [], set()
  for head in itertools.product(*factors[:full]):
    best = max((head + rest for rest in itertools.product(*factors[full:])),
               key=lambda r: len(pairs(r) - covered))
    rows.append(best)
    covered |= pairs(best)
  for r in itertools.product(*factors):
    if pairs(r) - covered:
      rows.append(r)
      covered |= pairs(r)
  assert covered == want
  return rows


def pytest_generate_tests(metafunc):
  """test_matches_torch: shapes x dtypes x modes x {RMSNorm, LayerNorm}. On the GPU
  (``--gpu``) the full product (144 cases); in interpret mode on CPU (CI time) a
  covering subset (``_pairwise``): every dtype x mode x op, and every shape with every
  dtype, every mode and both ops."""
  if metafunc.function.__name__ != "test_matches_torch":
    return
  factors = (list(DTYPES), list(MODES), [False, True], SHAPES)
  rows = (list(itertools.product(*factors)) if metafunc.config.getoption("--gpu")
          else _pairwise(*factors, full=3))
  rows = sorted(rows, key=lambda r: (SHAPES.index(r[3]), r[:3]))
  metafunc.parametrize(
      "m,n,dtype,mode,layer", [(m, n, d, mo, l) for d, mo, l, (m, n) in rows],
      ids=[f"{m}-{n}-{d}-{mo}-{'layer' if l else 'rms'}" for d, mo, l, (m, n) in rows])


def test_matches_torch(m, n, dtype, mode, layer):
  _compare(m, n, dtype, mode, layer=layer)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("mode", ["multi_wave_reload", "static_persistent"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_n(dtype, mode, layer):
  _compare(3, 65536 + 3, dtype, mode, layer=layer)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_n_split_rows(dtype):
  """RMSNorm multi_wave_cached beyond one program's registers: the row is split."""
  _compare(3, 65536 + 3, dtype, "multi_wave_cached", layer=False)


def test_large_n_split_rows_layer():
  """LayerNorm rows longer than 16384: the heuristic splits them over persistent
  programs (static_persistent with split_rows; 2048-wide splits past 65536)."""
  cfg = pn_config.forward_config(2, 65536 + 5, jnp.bfloat16, subtract_mean=True)
  assert (cfg.mode, cfg.block_n, cfg.split_rows) == ("static_persistent", 2048, True)
  _compare(2, 65536 + 5, "bfloat16", None, layer=True)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,block_n,chunk_n", [
    (5, 1000, 2, 256, 0),  # ragged last split, M not a multiple of block_m
    (5, 1000, 2, 256, 64),  # a ragged chunk
    (5, 1000, 2, 256, 8),  # chunks wholly past N (N a multiple of chunk_n, not block_n)
    (8, 96, 4, 32, 0),
    (2, 3 * 8192 + 5, 1, 8192, 0),
    (2, 3 * 8192 + 5, 1, 8192, 2048),
])
def test_split_rows_forward(m, n, block_m, block_n, chunk_n, layer):
  """multi_wave_cached with block_n < N (forward.py's _split_kernel), any config."""
  from pallas_norm import reference
  from pallas_norm.kernels import forward
  x, scale, bias, _ = _inputs(m, n, "float32", layer=layer, mean=3.0 if layer else 0.0)
  cfg = pn_config.ForwardConfig("multi_wave_cached", block_m, block_n, 4, chunk_n=chunk_n)
  got = forward.norm_forward(x, scale, bias if layer else None, eps=1e-5, scale_offset=0.5,
                             subtract_mean=layer, config=cfg,
                             interpret=jax.default_backend() != "gpu")
  want = reference.norm(x, scale, bias if layer else None, eps=1e-5, scale_offset=0.5,
                        subtract_mean=layer)
  (y, mean, rstd), (y_ref, mean_ref, rstd_ref) = got, want
  assert (mean is None) == (not layer)
  for g, w in [(y, y_ref), (rstd, rstd_ref)] + ([(mean, mean_ref)] if layer else []):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("max_polls", [None, 0], ids=["polls", "nopolls"])
def test_split_rows_fallback_same_bits(layer, max_polls, monkeypatch):
  """multi_wave_cached's split: a program that stops waiting computes the row's
  statistics itself, chunk by chunk (the fallback); a program that reads the slots gets
  the same bits. With no scale or bias, y = (x - mean) * rstd: every split's y is
  checked bit for bit against that, from the mean/rstd that split 0 stored (two f32
  ops, nothing to contract). On CPU each row block's last program reads the slots and
  the others fall back; on the GPU, with max_polls 0 (nopolls), every program that
  arrives before its row is complete falls back."""
  from pallas_norm.kernels import forward
  if max_polls is not None:
    monkeypatch.setattr(forward, "_SPLIT_MAX_POLLS", max_polls)
  x, _, _, _ = _inputs(6, 1000, "float32", layer=layer, mean=100.0 if layer else 0.0)
  cfg = pn_config.ForwardConfig("multi_wave_cached", 1, 256, 4, chunk_n=64)
  y, mean, rstd = forward.norm_forward(x, None, None, eps=1e-5, scale_offset=0.0,
                                       subtract_mean=layer, config=cfg,
                                       interpret=jax.default_backend() != "gpu")
  xn = np.asarray(x)
  xc = xn - np.asarray(mean)[:, None] if layer else xn
  np.testing.assert_array_equal(np.asarray(y), xc * np.asarray(rstd)[:, None])


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,block_n,split_lag,num_programs,early", [
    (5, 1000, 1, 256, 0, 2, False),  # ragged last split, M not a multiple of G; no lead
    (9, 1000, 2, 256, 2, 2, False),  # block_m 2 with a partial last row block
    (9, 1000, 2, 256, 2, 2, True),  # the same, publish loads issued early
    (7, 300, 1, 128, 3, 3, False),  # a lead of 3 row blocks
    (7, 300, 1, 128, 1, 3, True),  # a lead of 1, early
    (3, 3 * 4096 + 5, 1, 4096, 2, 1, True),  # one group walks every row block
    (4, 96, 4, 32, 3, 5, True),  # more groups than row blocks; a lead past the last one
])
@pytest.mark.parametrize("return_residuals", [True, False], ids=["res", "nores"])
def test_split_persistent_forward(m, n, block_m, block_n, split_lag, num_programs, early,
                                  layer, return_residuals):
  """static_persistent with split_rows (forward.py's _split_persistent_kernel), any
  config. (On CPU the kernel runs as its publish and consume phases, so the lead and
  split_early_publish matter on the GPU only.)"""
  from pallas_norm import reference
  from pallas_norm.kernels import forward
  x, scale, bias, _ = _inputs(m, n, "float32", layer=layer, mean=3.0 if layer else 0.0)
  cfg = pn_config.ForwardConfig("static_persistent", block_m, block_n, 4, num_programs,
                                split_rows=True, split_lag=split_lag,
                                split_early_publish=early)
  got = forward.norm_forward(x, scale, bias if layer else None, eps=1e-5, scale_offset=0.5,
                             subtract_mean=layer, config=cfg,
                             interpret=jax.default_backend() != "gpu",
                             return_residuals=return_residuals)
  want = reference.norm(x, scale, bias if layer else None, eps=1e-5, scale_offset=0.5,
                        subtract_mean=layer)
  (y, mean, rstd), (y_ref, mean_ref, rstd_ref) = got, want
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-5)
  if not return_residuals:
    assert mean is None and rstd is None
    return
  assert (mean is None) == (not layer)
  for g, w in [(rstd, rstd_ref)] + ([(mean, mean_ref)] if layer else []):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("block_m", [1, 4])
def test_forward_without_residuals(layer, block_m):
  """A plain forward returns no mean/rstd, and the same y as the forward with them
  (one-row and packed-row tiles)."""
  from pallas_norm.kernels import forward
  x, scale, bias, _ = _inputs(10, 96, "float32", layer=layer, mean=3.0 if layer else 0.0)
  cfg = pn_config.ForwardConfig("multi_wave_cached", block_m, 128, 4)
  outs = [forward.norm_forward(x, scale, bias if layer else None, eps=1e-5,
                               scale_offset=0.0, subtract_mean=layer, config=cfg,
                               interpret=jax.default_backend() != "gpu",
                               return_residuals=res) for res in (False, True)]
  assert outs[0][1] is None and outs[0][2] is None
  assert outs[1][2] is not None and (outs[1][1] is None) == (not layer)
  np.testing.assert_array_equal(np.asarray(outs[0][0]), np.asarray(outs[1][0]))


def test_split_persistent_forward_matches_split():
  """The persistent split and multi_wave_cached's split combine the same partials in the
  same order: the same bits of y, mean and rstd (bf16, LayerNorm, rows far from 0)."""
  from pallas_norm.kernels import forward
  rng = np.random.default_rng(5)
  x = jnp.asarray(100.0 + rng.standard_normal((6, 1000)), jnp.bfloat16)
  scale = jnp.asarray(rng.standard_normal(1000), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(1000), jnp.bfloat16)
  interpret = jax.default_backend() != "gpu"
  outs = [forward.norm_forward(x, scale, bias, eps=1e-5, scale_offset=0.0,
                               subtract_mean=True, config=cfg, interpret=interpret)
          for cfg in (pn_config.ForwardConfig("multi_wave_cached", 1, 256, 4),
                      pn_config.ForwardConfig("static_persistent", 1, 256, 4, 2,
                                              split_rows=True))]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_split_persistent_kernels_take_no_constant(layer):
  """The persistent split-row kernels (forward static_persistent with split_rows, the
  split-row backward) take their ticket counter in the _PENDING fill of their slots
  (forward._split_rows_refs): no array of their own that XLA would make a constant and
  copy into the aliased buffer with a MemcpyD2D every call, which the kernel bench's
  CUPTI kernel time does not see (docs/performance.md). Lowered for CUDA on CPU: the
  kernels' aliased int32 operands are broadcasts of _PENDING with the extra row."""
  import re
  from pallas_norm.kernels import backward, forward
  m, n = 64, 1024
  x = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((n,), jnp.bfloat16)
  fcfg = pn_config.ForwardConfig("static_persistent", 1, 256, 4, 8, split_rows=True,
                                 split_lag=2)
  bcfg = pn_config.BackwardConfig(1, 256, 4, 8, split_rows=True, split_lag=1,
                                  **pn_config.reduce_config(n, 8))
  kw = dict(scale_offset=0.0, subtract_mean=layer, interpret=False)

  def f(x, w):
    y, mean, rstd = forward.norm_forward(x, w, w if layer else None, eps=1e-5, config=fcfg,
                                         **kw)
    return backward.norm_backward(y, x, w, mean, rstd, has_bias=layer, config=bcfg,
                                  scale_dtype=w.dtype, bias_dtype=w.dtype, **kw)

  text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3  # forward, stage 1, stage 2
  assert "tensor<1xi32>" not in text  # the counter of its own, before
  slots = re.findall(r"= stablehlo\.broadcast_in_dim [^\n]*-> tensor<(\d+)x4xi32>", text)
  # each kernel's slot arrays (LayerNorm: two), all with the counter's row (one shape:
  # XLA fills them in one fusion)
  assert list(map(int, slots)) == [m + 1] * (4 if layer else 2), slots


def test_split_rows_config_errors():
  with pytest.raises(ValueError, match="static_persistent option"):
    pn_config.ForwardConfig("multi_wave_cached", 1, 256, 4, split_rows=True)
  with pytest.raises(ValueError, match="split_lag"):
    pn_config.ForwardConfig("static_persistent", 1, 256, 4, 2, split_rows=True,
                            split_lag=-1)
  with pytest.raises(ValueError, match="split_early_publish needs split_rows"):
    pn_config.ForwardConfig("static_persistent", 1, 256, 4, 2, split_early_publish=True)
  with pytest.raises(ValueError, match="split_lag >= 1"):
    pn_config.ForwardConfig("static_persistent", 1, 256, 4, 2, split_rows=True,
                            split_lag=0, split_early_publish=True)
  with pytest.raises(ValueError, match="split_early_publish needs split_rows"):
    pn_config.BackwardConfig(1, 256, 4, 2, reload_rows=True, split_early_publish=True)
  with pytest.raises(ValueError, match="split_lag >= 1"):
    pn_config.BackwardConfig(1, 256, 4, 2, split_rows=True, split_lag=0,
                             split_early_publish=True)


def test_split_rows_layer_offset():
  """A split LayerNorm's variance does not cancel on rows far from 0 (mean 1000, std 1):
  its chunks' sums are shifted by the first chunk's mean. E[x^2] - E[x]^2 in f32 is off
  by ~6% here."""
  from pallas_norm import reference
  from pallas_norm.kernels import forward
  rng = np.random.default_rng(3)
  x = jnp.asarray(1000.0 + rng.standard_normal((3, 1000)), jnp.float32)
  cfg = pn_config.ForwardConfig("multi_wave_cached", 2, 256, 4, chunk_n=64)
  _, mean, rstd = forward.norm_forward(x, None, None, eps=1e-5, scale_offset=0.0,
                                       subtract_mean=True, config=cfg,
                                       interpret=jax.default_backend() != "gpu")
  xd = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(mean), xd.mean(1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(xd.var(1) + 1e-5), rtol=1e-4)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,block_n,split_lag,num_programs,chunk_n,early", [
    (5, 1000, 1, 256, 0, 2, 0, False),  # ragged last split, M not a multiple of G; no lead
    (9, 1000, 2, 256, 2, 2, 0, False),  # block_m 2 with a partial last row block
    (9, 1000, 2, 256, 2, 2, 0, True),  # the same, publish loads issued early
    (9, 1000, 2, 256, 1, 2, 64, False),  # the split as 4 chunks, the last one ragged
    (9, 1000, 2, 256, 1, 2, 64, True),  # the same, early, a lead of 1
    (5, 1000, 1, 256, 2, 2, 8, False),  # chunks wholly past N (N a multiple of chunk_n only)
    (7, 300, 1, 128, 3, 3, 0, True),  # a lead of 3 row blocks (LayerNorm's long rows)
    (3, 3 * 4096 + 5, 1, 4096, 2, 1, 2048, False),  # one group walks every row block
    (4, 96, 4, 32, 3, 5, 0, True),  # more groups than row blocks; a lead past the last one
])
def test_split_rows_backward(m, n, block_m, block_n, split_lag, num_programs, chunk_n,
                             early, layer):
  """The split-row backward (backward.py's _bwd_split_kernel), any config. (On CPU the
  kernel runs as its publish and consume phases, so the lead and split_early_publish
  matter on the GPU only.)"""
  _check_long_row_backward(m, n, layer, pn_config.BackwardConfig(
      block_m, block_n, 4, num_programs, split_lag=split_lag, split_rows=True,
      chunk_n=chunk_n, split_early_publish=early, **pn_config.reduce_config(n, num_programs)))


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,block_n,num_programs", [
    (5, 1000, 2, 256, 2),  # ragged last chunk, partial last row block, M not a multiple of G
    (9, 1000, 4, 128, 2),  # 8 chunks
    (3, 3 * 4096 + 5, 1, 4096, 1),  # one program walks every row block
    (4, 96, 4, 32, 5),  # more programs than row blocks
])
def test_reload_rows_backward(m, n, block_m, block_n, num_programs, layer):
  """The reload-row backward (backward.py's _bwd_reload_kernel), any config."""
  _check_long_row_backward(m, n, layer, pn_config.BackwardConfig(
      block_m, block_n, 4, num_programs, reload_rows=True,
      **pn_config.reduce_config(n, num_programs)))


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,pieces,num_programs", [
    (9, 3072, 1, (2048, 1024), 2),  # the default LayerNorm pieces, pieces inside the row
    (7, 2500, 2, (2048, 512), 3),  # last piece ragged, partial last row block
    (5, 1500, 4, (1024, 256, 128, 64, 32, 16), 2),  # many pieces, the last ragged
    (3, 100, 1, (64, 32, 4), 5),  # more programs than row blocks
])
def test_pieces_backward(m, n, block_m, pieces, num_programs, layer):
  """The single-tile backward with its tile as column pieces (BackwardConfig.pieces)."""
  bn = pn_config.next_power_of_2(sum(pieces))
  _check_long_row_backward(m, n, layer, pn_config.BackwardConfig(
      block_m, bn, 4, num_programs, pieces=pieces, **pn_config.reduce_config(n, num_programs)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pieces_default_matches_torch(dtype):
  """LayerNorm's default backward for 2048 < N <= 3072 cuts its tile into pieces."""
  assert pn_config.backward_config(33, 3000, jnp.float32, subtract_mean=True).pieces
  _compare(33, 3000, dtype, None, layer=True)


def test_pieces_errors():
  from pallas_norm.kernels import backward
  for pieces, match in (((1024, 1024), "decreasing"), ((1024, 96), "decreasing"),
                        ((2048, 1024), "fit block_n")):
    with pytest.raises(ValueError, match=match):
      pn_config.BackwardConfig(1, 2048, 4, 1, pieces=pieces)
  x = jnp.zeros((4, 3000), jnp.float32)
  for cfg in (pn_config.BackwardConfig(1, 4096, 4, 1, pieces=(2048, 512)),  # short of N
              pn_config.BackwardConfig(1, 2048, 4, 1, pieces=(1024, 512))):  # chunked
    with pytest.raises(ValueError, match="must cover the row"):
      backward.norm_backward(x, x, None, None, x[:, 0], has_bias=False, scale_offset=0.0,
                             subtract_mean=False, config=cfg, interpret=True,
                             scale_dtype=None, bias_dtype=None)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("m,n,block_m,block_n,num_programs", [
    (5, 1000, 2, 256, 2),  # ragged last chunk, partial last row block
    (4, 96, 4, 32, 5),  # more programs than row blocks
])
def test_column_pair_backward(m, n, block_m, block_n, num_programs, layer):
  """The row-statistics + column-tiled pair (block_n < N, neither split nor reload
  rows), which the Pallas backend takes for rows wider than 4096 x SMs."""
  _check_long_row_backward(m, n, layer, pn_config.BackwardConfig(
      block_m, block_n, 4, num_programs, **pn_config.reduce_config(n, num_programs)))


def _check_long_row_backward(m, n, layer, cfg):
  """norm_backward with ``cfg`` against the XLA reference's vjp (dx, dscale, dbias)."""
  from pallas_norm import reference
  from pallas_norm.kernels import backward
  x, scale, bias, dy = _inputs(m, n, "float32", layer=layer, mean=3.0 if layer else 0.0)
  b = bias if layer else None
  kw = dict(eps=1e-5, scale_offset=0.5, subtract_mean=layer)
  _, mean, rstd = reference.norm(x, scale, b, **kw)
  got = backward.norm_backward(dy, x, scale, mean, rstd, has_bias=layer, scale_offset=0.5,
                               subtract_mean=layer, config=cfg,
                               interpret=jax.default_backend() != "gpu",
                               scale_dtype=scale.dtype, bias_dtype=scale.dtype)
  _, pull = jax.vjp(lambda x, s, c: reference.norm(x, s, c, **kw)[0], x, scale, b)
  want = pull(dy)
  assert (got[2] is None) == (not layer)
  for g, w in zip(got, want):
    if w is not None:
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_large_mean(mode):
  """x = 1000 + noise: E[x^2] - E[x]^2 would lose every digit in float32."""
  _compare(7, 1000, "float32", mode, layer=True, mean=1000.0)
  x = jnp.asarray(1000.0 + np.random.default_rng(0).standard_normal((4, 3000)) * 1e-2,
                  jnp.float32)
  y = _f64(pallas_norm.layer_norm(x, mode=mode))
  xt = torch.tensor(np.asarray(x))
  ref64 = torch.nn.functional.layer_norm(xt.double(), (3000,)).numpy()
  ref32 = torch.nn.functional.layer_norm(xt, (3000,)).double().numpy()
  # The f32 input itself is quantised at ulp(1000) = 6e-5, 0.6% of its spread: no
  # float32 implementation is exact here. Be no worse than torch's float32 kernel.
  assert np.abs(y - ref64).max() <= 1.25 * np.abs(ref32 - ref64).max()


@pytest.mark.parametrize("shape", [(2, 3, 64), (2, 1, 3, 760)])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_rank_3_and_4(shape, layer):
  m = math.prod(shape[:-1])
  _compare(m, shape[-1], "float32", None, layer=layer, shape=shape)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(m=hst.integers(1, 40), n=hst.integers(1, 2100),
                  mode=hst.sampled_from(MODES + (None,)), layer=hst.booleans(),
                  dtype=hst.sampled_from(list(DTYPES)))
def test_property_random_shapes(m, n, mode, layer, dtype):
  _compare(m, n, dtype, mode, layer=layer)


def test_heuristic_modes():
  dev = pn_config.DeviceInfo("gpu", "NVIDIA H200", 132)
  # Measured on the H200 (config.py): cached wins up to N = 8192, reload up to 32768,
  # persistent with 16384-wide chunks beyond.
  assert pn_config.choose_mode(32768, 128, jnp.bfloat16, dev) == "multi_wave_cached"
  assert pn_config.choose_mode(16384, 12288, jnp.bfloat16, dev) == "multi_wave_reload"
  assert pn_config.choose_mode(16384, 16384, jnp.bfloat16, dev,
                               backend="triton") == "multi_wave_reload"
  # Rows padded to 16384 on the Pallas backend (fwd_persistent_tile.txt): one hoisted
  # [1, 16384] tile a static_persistent program, one program a SM; RMSNorm for
  # N > 12288 at 32 warps, LayerNorm for N > 8192 at 16 warps.
  for n, sm, warps in ((12289, False, 32), (16384, False, 32), (8193, True, 16),
                       (16384, True, 16)):
    assert pn_config.choose_mode(16384, n, jnp.bfloat16, dev,
                                 subtract_mean=sm) == "static_persistent"
    pt = pn_config.forward_config(16384, n, jnp.bfloat16, device=dev, subtract_mean=sm)
    assert (pt.mode, pt.block_m, pt.block_n, pt.num_warps, pt.num_programs,
            pt.split_rows) == ("static_persistent", 1, 16384, warps, 132, False), (n, sm)
  pt = pn_config.forward_config(100, 16384, jnp.bfloat16, device=dev)
  assert pt.num_programs == 100  # no more programs than rows
  # Rows padded to 8192 (fwd_persistent_tile_8192.txt): RMSNorm 6144 < N <= 8192 as a
  # [1, 8192] tile at 16 warps, 2 programs a SM; LayerNorm 4096 < N <= 5120 at 4
  # warps, 3 a SM. Both sides of each bound, and the Triton backend, stay cached.
  for n, sm, warps, per_sm in ((6145, False, 16, 2), (8192, False, 16, 2),
                               (4097, True, 4, 3), (5120, True, 4, 3)):
    pt = pn_config.forward_config(8192, n, jnp.bfloat16, device=dev, subtract_mean=sm)
    assert (pt.mode, pt.block_m, pt.block_n, pt.num_warps, pt.num_programs) == (
        "static_persistent", 1, 8192, warps, 132 * per_sm), (n, sm)
  for n, sm, backend, dt in ((6144, False, "pallas", jnp.bfloat16),
                             (8192, False, "triton", jnp.bfloat16),
                             (4096, True, "pallas", jnp.bfloat16),
                             (5121, True, "pallas", jnp.bfloat16),
                             (8192, True, "pallas", jnp.bfloat16),
                             (5120, True, "triton", jnp.bfloat16),
                             (5120, True, "pallas", jnp.float32)):  # LayerNorm: 2 bytes
    assert pn_config.choose_mode(8192, n, dt, dev, subtract_mean=sm,
                                 backend=backend) == "multi_wave_cached", (n, sm, backend, dt)
  assert pn_config.choose_mode(8192, 8192, jnp.float32, dev) == "static_persistent"
  # On other GPUs (h100_2026-11-22_persistent_tiles.txt) only LayerNorm's [1, 16384]
  # tile is taken: RMSNorm's tiles and LayerNorm's 5120 one lost on the H100.
  h100 = pn_config.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132)
  for n, sm, mode in ((8192, False, "multi_wave_cached"), (16384, False, "multi_wave_reload"),
                      (5120, True, "multi_wave_cached"), (16384, True, "static_persistent")):
    assert pn_config.choose_mode(8192, n, jnp.bfloat16, h100, subtract_mean=sm) == mode, (n, sm)
  # RMSNorm rows > 16384 on the Pallas backend: multi_wave_cached split over 8192-wide
  # programs at 4 warps (sweep_split_rms.json), up to 8192 x SMs; LayerNorm and the
  # Triton backend keep reload up to 32768; LayerNorm splits beyond, over 4096-wide
  # programs of 1 warp in 1024-wide chunks (split_chunks.txt), up to 4096 x SMs; the
  # Triton backend takes persistent.
  assert pn_config.choose_mode(4096, 32768, jnp.bfloat16, dev,
                               backend="triton") == "multi_wave_reload"
  assert pn_config.choose_mode(4096, 32769, jnp.bfloat16, dev,
                               backend="triton") == "static_persistent"
  long = pn_config.forward_config(1024, 131072, jnp.bfloat16, device=dev, backend="triton")
  assert (long.mode, long.block_m, long.block_n, long.num_warps, long.num_programs) == (
      "static_persistent", 1, 16384, 16, 528)
  long = pn_config.forward_config(1024, 262144, jnp.bfloat16, device=dev, backend="triton")
  assert long.mode == "static_persistent"
  for n in (32769, 65536, 262144, 4096 * 132):  # LayerNorm's split when asked for
    split = pn_config.forward_config(1024, n, jnp.bfloat16, "multi_wave_cached", dev,
                                     subtract_mean=True)
    assert (split.mode, split.block_m, split.block_n, split.num_warps, split.chunk_n) == (
        "multi_wave_cached", 1, 4096, 1, 1024)
  # LayerNorm rows of 16384 < N <= 4096 x SMs: static_persistent split over programs of
  # 1 warp, 1024 wide up to 65536 (16 a SM), else 2048 wide (8 a SM)
  # (h200_2026-11-22_split_fwd.txt); 16384 takes the [1, 16384] tile above.
  assert pn_config.choose_mode(4096, 8192, jnp.bfloat16, dev,
                               subtract_mean=True) == "multi_wave_cached"
  for n, bn, g in ((16385, 1024, 124), (32768, 1024, 66), (65536, 1024, 33),
                   (65537, 2048, 32), (262144, 2048, 8), (4096 * 132, 2048, 4)):
    ps = pn_config.forward_config(1024, n, jnp.bfloat16, device=dev, subtract_mean=True)
    assert (ps.mode, ps.split_rows, ps.block_m, ps.block_n, ps.num_warps, ps.num_programs,
            ps.split_lag, ps.split_early_publish) == ("static_persistent", True, 1, bn, 1,
                                                      g, 2, True), n
  ps = pn_config.forward_config(1024, 65536, jnp.bfloat16, device=dev, subtract_mean=True,
                                backend="triton")
  assert not ps.split_rows
  assert pn_config.choose_mode(64, 4096 * 132 + 1, jnp.bfloat16, dev,
                               subtract_mean=True) == "static_persistent"
  assert pn_config.choose_mode(4096, 16385, jnp.bfloat16, dev) == "multi_wave_cached"
  for n in (16385, 65536, 262144, 8192 * 132):
    split = pn_config.forward_config(1024, n, jnp.bfloat16, device=dev)
    assert (split.mode, split.block_m, split.block_n, split.num_warps, split.chunk_n) == (
        "multi_wave_cached", 1, 8192, 4, 4096)
  assert pn_config.choose_mode(64, 8192 * 132 + 1, jnp.bfloat16, dev) == "static_persistent"
  with pytest.raises(NotImplementedError, match="at most one a SM"):
    pn_config.forward_config(64, 8192 * 132 + 1, jnp.bfloat16, "multi_wave_cached", dev)
  # LayerNorm's single tiles (sweep_ln2_fwd.json): one row and 8 warps at 8192 wide (4
  # warps for N <= 5120, ln_wide_warps.txt),
  # else >= 2 rows with 64 f32 values a thread, and >= 2 warps for rows of <= 256.
  ln = pn_config.forward_config(8192, 5120, jnp.bfloat16, device=dev, subtract_mean=True)
  assert (ln.block_m, ln.block_n, ln.num_warps) == (1, 8192, 4)  # padded: 4 warps
  for n in (5121, 8192):
    ln = pn_config.forward_config(8192, n, jnp.bfloat16, device=dev, subtract_mean=True)
    assert (ln.block_m, ln.block_n, ln.num_warps) == (1, 8192, 8)
  ln = pn_config.forward_config(4096, 4096, jnp.bfloat16, device=dev, subtract_mean=True)
  assert (ln.block_m, ln.block_n, ln.num_warps) == (2, 4096, 4)
  ln = pn_config.forward_config(32768, 128, jnp.bfloat16, device=dev, subtract_mean=True)
  assert (ln.block_m, ln.block_n, ln.num_warps) == (16, 128, 2)
  # Backward of rows wider than one tile on the Pallas backend, both ops: the split-row
  # kernel, cdiv(N, W) programs of W / 512 warps, W the narrowest power of 2 >= 512 with
  # 4 N <= W^2, 20 (RMSNorm) or 16 (LayerNorm) warps a SM, each row block published 2
  # ahead (h200_2026-11-22_split_bwd_occupancy.txt), while every program of a row can be
  # resident (cdiv(N, W) <= SMs x 8 / warps, so N <= 4096 x SMs); beyond, and on the
  # Triton backend, the row-statistics + column-tiled pair.
  def bwd_cfg(m, n, **kw):
    c = pn_config.backward_config(m, n, jnp.bfloat16, device=dev, **kw)
    return (c.reload_rows, c.split_rows, c.block_m, c.block_n, c.num_warps, c.num_programs)

  # LayerNorm rows of 32768 < N <= 262144 instead: 1024-wide splits of 1 warp, 8 a SM,
  # published 3 ahead with split_early_publish (split_early_publish.txt).
  ln_early = (1024, 1, 3, True)
  for n, rms, ln in (
      (8193, (512, 1, 155), (512, 1, 124)), (16384, (512, 1, 82), (512, 1, 66)),
      (32768, (512, 1, 41), (512, 1, 33)), (32769, (512, 1, 40), (1024, 1, 32)),
      (65536, (512, 1, 20), (1024, 1, 16)), (65537, (1024, 2, 20), (1024, 1, 16)),
      (262144, (1024, 2, 5), (1024, 1, 4)), (262145, (2048, 4, 5), (2048, 4, 4)),
      (4096 * 132, (2048, 4, 2), (2048, 4, 2))):
    for sm, (bn, nw, g) in ((False, rms), (True, ln)):
      lag, early = ln_early[2:] if sm and bn == 1024 and n > 32768 else (2, False)
      bwd = pn_config.backward_config(1024, n, jnp.bfloat16, device=dev, subtract_mean=sm)
      assert (bwd.split_rows, bwd.reload_rows, bwd.block_m, bwd.block_n, bwd.num_warps,
              bwd.num_programs, bwd.split_lag, bwd.split_early_publish, bwd.chunk_n) == (
                  True, False, 1, bn, nw, g, lag, early, 0), (n, sm)
  assert bwd_cfg(1, 16384) == (False, True, 1, 512, 1, 1)
  assert pn_config.split_resident_programs(1) == 8
  assert pn_config.split_resident_programs(4) == 2
  assert pn_config.split_resident_programs(16) == 1
  assert pn_config.backward_config(3, 65536, jnp.bfloat16, device=dev).num_programs == 3
  bwd = pn_config.backward_config(1024, 65536, jnp.bfloat16, device=dev, backend="triton")
  assert (bwd.split_rows, bwd.reload_rows, bwd.block_n, bwd.num_warps,
          bwd.num_programs) == (False, False, 4096, 16, 16)
  assert bwd_cfg(1024, 16384, backend="triton") == (False, False, 1, 4096, 16, 66)
  for n in (8192, 4096 * 132 + 1):
    for sm in (False, True):
      assert bwd_cfg(1024, n, subtract_mean=sm)[:2] == (False, False)
  with pytest.raises(ValueError, match="exclusive"):
    pn_config.BackwardConfig(1, 4096, 4, 1, split_rows=True, reload_rows=True)
  from pallas_norm.kernels import jax_triton  # refuses before it needs jax-triton
  x = jnp.zeros((4, 8), jnp.float32)
  for cfg in (pn_config.backward_config(1024, 65536, jnp.bfloat16, device=dev),
              pn_config.BackwardConfig(1, 4096, 16, 132, reload_rows=True)):
    with pytest.raises(NotImplementedError, match="Pallas-only"):
      jax_triton.norm_backward(x, x, None, None, x[:, 0], has_bias=False, scale_offset=0.0,
                               subtract_mean=False, config=cfg,
                               interpret=True, scale_dtype=None, bias_dtype=None)
  with pytest.raises(NotImplementedError, match="Pallas-only"):
    jax_triton.norm_backward(x, x, None, None, x[:, 0], has_bias=False, scale_offset=0.0,
                             subtract_mean=False,
                             config=pn_config.BackwardConfig(1, 4, 1, 1, pieces=(2, 1)),
                             interpret=True, scale_dtype=None, bias_dtype=None)
  with pytest.raises(NotImplementedError, match="Pallas-only"):
    jax_triton.norm_forward(x, None, None, eps=1e-5, scale_offset=0.0, subtract_mean=False,
                            config=pn_config.ForwardConfig("static_persistent", 1, 4, 1, 1,
                                                           split_rows=True),
                            interpret=True)
  # Backward, narrow rows (sweep_bwd_narrow.json): [16, 128] tiles, 2 warps, SMs x 4
  # programs, rounded down to a power of 2 for RMSNorm (narrow_bwd_programs.json).
  bwd = pn_config.backward_config(32768, 128, jnp.bfloat16, device=dev)
  assert (bwd.block_m, bwd.block_n, bwd.num_warps, bwd.num_programs) == (16, 128, 2, 512)
  assert (bwd.reduce_block_g, bwd.reduce_block_n) == (512, 16)  # one unpadded tile
  bwd = pn_config.backward_config(32768, 128, jnp.bfloat16, device=dev, subtract_mean=True)
  assert (bwd.block_m, bwd.block_n, bwd.num_warps, bwd.num_programs) == (16, 128, 2, 528)
  # Backward, single tiles (config.py): RMSNorm block_n / 256 warps (4 under 4096), 2
  # programs a SM up to 4096 wide, else 1; LayerNorm's 2048-wide tiles 8 warps, rows of
  # 2048 < N <= 3072 as 2048 + 512 / 1024 column pieces at 8 warps, 2 a SM
  # (bwd_pieces.txt), its 4096- and 8192-wide tiles 16 warps, 1 a SM (ln_bwd_tile.txt),
  # the 4096-wide ones as [2, 4096] row blocks (ab_ln_bwd_4096.txt).
  for n, rms, ln, ln_pieces in ((2048, (2, 2048, 4, 264), (2, 2048, 8, 264), ()),
                                (2500, (1, 4096, 16, 264), (1, 4096, 8, 264), (2048, 512)),
                                (3072, (1, 4096, 16, 264), (1, 4096, 8, 264), (2048, 1024)),
                                (3584, (1, 4096, 16, 264), (2, 4096, 16, 132), ()),
                                (4096, (1, 4096, 16, 264), (2, 4096, 16, 132), ()),
                                (5120, (1, 8192, 32, 132), (1, 8192, 16, 132), ()),
                                (8192, (1, 8192, 32, 132), (1, 8192, 16, 132), ())):
    for sm, want, pieces in ((False, rms, ()), (True, ln, ln_pieces)):
      bwd = pn_config.backward_config(8192, n, jnp.bfloat16, device=dev, subtract_mean=sm)
      assert (bwd.block_m, bwd.block_n, bwd.num_warps, bwd.num_programs) == want, (n, sm)
      assert bwd.pieces == pieces, (n, sm)
      assert not (bwd.split_rows or bwd.reload_rows)
    triton = pn_config.backward_config(8192, n, jnp.bfloat16, device=dev,
                                       subtract_mean=True, backend="triton")
    assert triton.pieces == ()  # the Triton backend's kernel has no pieces
  rms = pn_config.forward_config(8192, 5120, jnp.bfloat16, device=dev)
  assert (rms.block_m, rms.block_n, rms.num_warps) == (1, 8192, 8)
  # LayerNorm forward tiles on the Pallas backend (h200_h100_2026-11-22_ln_fwd_tiles.txt):
  # [2, 2048] at 4 warps, rows of 2048 < N <= 3072 one a [1, 4096] tile at 4 warps, full
  # rows of 4096 two a tile; the Triton backend keeps the rule before (2 warps, 2 rows).
  for n, want in ((2048, (2, 2048, 4)), (3072, (1, 4096, 4)), (3073, (2, 4096, 4))):
    ln = pn_config.forward_config(8192, n, jnp.bfloat16, device=dev, subtract_mean=True)
    assert (ln.mode, ln.block_m, ln.block_n, ln.num_warps) == ("multi_wave_cached", *want)
  for n, want in ((2048, (2, 2048, 2)), (3072, (2, 4096, 4))):
    ln = pn_config.forward_config(8192, n, jnp.bfloat16, device=dev, subtract_mean=True,
                                  backend="triton")
    assert (ln.block_m, ln.block_n, ln.num_warps) == want
  forced = pn_config.forward_config(1024, 262144, jnp.bfloat16, "multi_wave_reload", dev)
  assert (forced.block_n, forced.num_warps) == (4096, 16)
  for m, n in [(1, 1), (4096, 4096), (32768, 128), (1024, 262144), (7, 760)]:
    cfg = pn_config.forward_config(m, n, jnp.bfloat16, device=dev)
    assert cfg.mode in MODES
    if cfg.mode == "multi_wave_cached":  # one tile, or 8192-wide splits of the row
      assert cfg.block_n >= n or (cfg.block_n, cfg.num_warps) == (8192, 4)


def test_caller_config_wins():
  x, scale, _, _ = _inputs(9, 300, "float32", layer=False)
  from pallas_norm.kernels import forward
  cfg = pn_config.ForwardConfig("static_persistent", block_m=2, block_n=64, num_warps=4,
                                num_programs=3)
  y, _, rstd = forward.norm_forward(x, scale, None, eps=1e-6, scale_offset=0.0,
                                    subtract_mean=False, config=cfg,
                                    interpret=jax.default_backend() != "gpu")
  ref = pallas_norm.rms_norm(x, scale, eps=1e-6, backend="xla")
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("mode", ["multi_wave_reload", "static_persistent"])
@pytest.mark.parametrize("block_n", [128, 64], ids=["3_chunks_unrolled", "5_chunks_loop"])
def test_chunked_rows_unrolled_and_looped(block_n, mode, subtract_mean):
  """Rows of <= RELOAD_UNROLL_MAX_CHUNKS chunks unroll both passes; longer ones loop."""
  n = 300  # ragged last chunk in both cases
  assert (pn_config.cdiv(n, block_n) <= pn_config.RELOAD_UNROLL_MAX_CHUNKS) == (block_n == 128)
  x, scale, bias, _ = _inputs(9, n, "float32", layer=subtract_mean, mean=3.0)
  from pallas_norm.kernels import forward
  cfg = pn_config.ForwardConfig(mode, block_m=2, block_n=block_n, num_warps=4,
                                num_programs=3 if mode == "static_persistent" else 0)
  y, mean, rstd = forward.norm_forward(
      x, scale, bias if subtract_mean else None, eps=1e-6, scale_offset=0.0,
      subtract_mean=subtract_mean, config=cfg, interpret=jax.default_backend() != "gpu",
      return_residuals=True)
  ref_y, ref_mean, ref_rstd = reference.norm(x, scale, bias if subtract_mean else None,
                                             eps=1e-6, subtract_mean=subtract_mean)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(rstd).ravel(), np.asarray(ref_rstd).ravel(), rtol=1e-5)
  if subtract_mean:
    np.testing.assert_allclose(np.asarray(mean).ravel(), np.asarray(ref_mean).ravel(),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- options


def test_eps_accepts_numpy_scalars():
  x = jnp.ones((2, 8), jnp.float32) * jnp.arange(8.0)
  a = pallas_norm.rms_norm(x, eps=np.float32(1e-6))
  b = pallas_norm.rms_norm(x, eps=1e-6)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(TypeError, match="eps"):
    pallas_norm.rms_norm(x, eps="1e-6")


def test_eps_none_is_float32_eps():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 64)) * 1e-4, jnp.float32)
  y = pallas_norm.rms_norm(x)
  ref = torch.nn.functional.rms_norm(torch.tensor(np.asarray(x)), (64,))  # eps=None
  np.testing.assert_allclose(np.asarray(y), ref.numpy(), rtol=1e-5)
  y_big = pallas_norm.rms_norm(x, eps=1e-6)  # a different eps matters at this scale
  assert not np.allclose(np.asarray(y_big), ref.numpy(), rtol=1e-3)


def test_layer_norm_eps_none_is_torchs_default():
  """layer_norm's (and layer_norm_fp8's) eps=None is torch's default, 1e-5, as rms_norm's
  None is torch's default there; a non-number is a TypeError."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 64)) * 1e-3, jnp.float32)
  np.testing.assert_array_equal(np.asarray(pallas_norm.layer_norm(x, eps=None)),
                                np.asarray(pallas_norm.layer_norm(x, eps=1e-5)))
  a = pallas_norm.layer_norm_fp8(x, eps=None)
  b = pallas_norm.layer_norm_fp8(x, eps=1e-5)
  np.testing.assert_array_equal(np.asarray(a.y, np.float32), np.asarray(b.y, np.float32))
  assert not np.allclose(np.asarray(pallas_norm.layer_norm(x, eps=1e-6)),
                         np.asarray(pallas_norm.layer_norm(x)), rtol=1e-3)
  with pytest.raises(TypeError, match="eps must be a real number"):
    pallas_norm.layer_norm(x, eps="1e-5")


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_no_scale_and_scale_offset(layer):
  x, scale, bias, _ = _inputs(7, 100, "float32", layer=layer)
  f = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
  y0 = f(x)
  ref0 = f(x, backend="xla")
  np.testing.assert_allclose(np.asarray(y0), np.asarray(ref0), rtol=1e-5, atol=1e-6)
  y1 = f(x, scale, scale_offset=1.0)
  ref1 = f(x, 1.0 + scale, backend="xla")
  np.testing.assert_allclose(np.asarray(y1), np.asarray(ref1), rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda s: jnp.sum(f(x, s, scale_offset=1.0) ** 2))(scale)
  g_ref = jax.grad(lambda s: jnp.sum(f(x, 1.0 + s, backend="xla") ** 2))(scale)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-4)


def test_mixed_param_dtype():
  x, _, _, _ = _inputs(7, 64, "bfloat16", layer=False)
  scale = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
  y, vjp = jax.vjp(lambda x, s: pallas_norm.rms_norm(x, s), x, scale)
  dx, ds = vjp(jnp.ones_like(y))
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and ds.dtype == jnp.float32


def test_nan_inf_propagate_like_torch():
  x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
  x[1, 3] = np.nan
  x[2, 5] = np.inf
  for layer in (False, True):
    f = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
    tf = torch.nn.functional.layer_norm if layer else torch.nn.functional.rms_norm
    for mode in MODES:
      y = np.asarray(f(jnp.asarray(x), mode=mode, eps=1e-5))
      ref = tf(torch.tensor(x), (32,), eps=1e-5).numpy()
      np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
      np.testing.assert_array_equal(np.isinf(y), np.isinf(ref))
      np.testing.assert_allclose(y[[0, 3]], ref[[0, 3]], rtol=1e-5, atol=1e-6)


def test_empty_rows():
  x = jnp.zeros((0, 16), jnp.float32)
  assert pallas_norm.rms_norm(x).shape == (0, 16)
  assert pallas_norm.layer_norm(jnp.zeros((2, 0, 8), jnp.bfloat16)).dtype == jnp.bfloat16
  g = jax.grad(lambda s: jnp.sum(pallas_norm.rms_norm(x, s)))(jnp.ones(16))
  np.testing.assert_array_equal(np.asarray(g), np.zeros(16))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call,exc,match", [
    (lambda: pallas_norm.rms_norm(jnp.float32(1.0)), ValueError, "rank"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 0))), ValueError, "N=0"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(5)), ValueError, "scale.shape"),
    (lambda: pallas_norm.layer_norm(jnp.ones((3, 4)), jnp.ones(4), jnp.ones((4, 1))),
     ValueError, "bias.shape"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), eps=-1.0), ValueError, "eps"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4), jnp.int32)), TypeError, "dtype"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4), jnp.complex64)), TypeError, "dtype"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4, jnp.int32)), TypeError,
     "scale"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), mode="fast"), ValueError,
     "multi_wave_reload"),
    (lambda: pallas_norm.layer_norm(jnp.ones((3, 4)), backend="cuda"), ValueError, "xla"),
    (lambda: pallas_norm.layer_norm(jnp.ones((1, 40000)), mode="multi_wave_cached",
                                    backend="triton"),
     NotImplementedError, "multi_wave_reload"),
    (lambda: pallas_norm.rms_norm(jnp.ones((1, 40000)), mode="multi_wave_cached",
                                  backend="triton"),
     NotImplementedError, "multi_wave_reload"),
    # scale_offset is static: a real number, finite, and only with a scale
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4), scale_offset=None),
     TypeError, "scale_offset must be a real number"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4), scale_offset=jnp.ones(4)),
     TypeError, "scale_offset must be a real number"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4), scale_offset="1"),
     TypeError, "scale_offset must be a real number"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4), scale_offset=float("nan")),
     ValueError, "scale_offset=nan must be finite"),
    (lambda: pallas_norm.layer_norm(jnp.ones((3, 4)), None, jnp.ones(4), scale_offset=1.0),
     ValueError, "without a scale has no effect"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), eps=10 ** 400), ValueError,
     "must be finite"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), interpret="no"), TypeError,
     "interpret must be None, True or False"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), group_size=32), ValueError,
     "group_size=32 is for FP8 x only"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), jnp.ones(4, jnp.float8_e4m3fn)),
     TypeError, "rms_norm: scale.dtype=float8_e4m3fn must be float32, bfloat16"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4), jnp.int32)), TypeError, "rms_norm: x.dtype"),
    # arrays only (as jnp functions): a list or a Python number named, not jnp's
    # "Cannot determine dtype"
    (lambda: pallas_norm.rms_norm([[1.0, 2.0]]), TypeError,
     "rms_norm: x must be an array .* got list"),
    (lambda: pallas_norm.layer_norm(2.0), TypeError, "layer_norm: x must be an array"),
    (lambda: pallas_norm.layer_norm(jnp.ones((3, 4)), [1.0] * 4), TypeError,
     "layer_norm: scale must be an array .* got list"),
    (lambda: pallas_norm.layer_norm(jnp.ones((3, 4)), None, (0.0,) * 4), TypeError,
     "bias must be an array .* got tuple"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 4)), residual=[[0.0] * 4] * 3), TypeError,
     "rms_norm: residual must be an array"),
    (lambda: pallas_norm.rms_norm(jnp.ones((3, 32), jnp.float8_e4m3fn), x_scale=[[1.0, 1.0]] * 3),
     TypeError, "rms_norm: x_scale must be an array"),
    (lambda: pallas_norm.rms_norm_fp8([[1.0, 2.0]]), TypeError, "x must be an array"),
])
def test_errors_before_any_kernel(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# --------------------------------------------------------------------------- transforms


def test_jit_vmap_grad_checkpoint():
  x, scale, bias, dy = _inputs(24, 96, "float32", layer=True)
  xb = x.reshape(3, 8, 96)

  def loss(x, s, b):
    return jnp.sum(pallas_norm.layer_norm(x, s, b) * dy.reshape(x.shape))

  def loss_ref(x, s, b):
    return jnp.sum(pallas_norm.layer_norm(x, s, b, backend="xla") * dy.reshape(x.shape))

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xb, scale, bias)
  g_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(xb, scale, bias)
  for a, r in zip(g, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4)

  # vmap over a leading axis, scale shared, and with a batched scale.
  yv = jax.vmap(lambda x: pallas_norm.rms_norm(x, scale))(xb)
  np.testing.assert_allclose(np.asarray(yv), np.asarray(pallas_norm.rms_norm(xb, scale)),
                             rtol=1e-6, atol=1e-6)
  scales = jnp.stack([scale, 2 * scale, scale + 1])
  yv2 = jax.jit(jax.vmap(lambda x, s: pallas_norm.rms_norm(x, s)))(xb, scales)
  for i in range(3):
    np.testing.assert_allclose(np.asarray(yv2[i]),
                               np.asarray(pallas_norm.rms_norm(xb[i], scales[i])),
                               rtol=1e-6, atol=1e-6)
  gv = jax.vmap(jax.grad(lambda x, s: jnp.sum(pallas_norm.rms_norm(x, s) ** 2),
                         argnums=(0, 1)), in_axes=(0, None))(xb, scale)
  gv_ref = jax.vmap(jax.grad(lambda x, s: jnp.sum(pallas_norm.rms_norm(x, s,
                                                                       backend="xla") ** 2),
                             argnums=(0, 1)), in_axes=(0, None))(xb, scale)
  for a, r in zip(gv, gv_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4)

  # jax.checkpoint (remat) around the op.
  gc = jax.grad(jax.checkpoint(loss), argnums=1)(xb, scale, bias)
  np.testing.assert_allclose(np.asarray(gc), np.asarray(g_ref[1]), rtol=1e-4, atol=1e-4)


def test_gradients_deterministic():
  x, scale, bias, dy = _inputs(1024, 760, "bfloat16", layer=True)
  f = jax.jit(lambda x, s, b: jax.vjp(pallas_norm.layer_norm, x, s, b)[1](dy))
  first = [np.asarray(a) for a in f(x, scale, bias)]
  for _ in range(2):
    again = [np.asarray(a) for a in f(x, scale, bias)]
    for a, b in zip(first, again):
      np.testing.assert_array_equal(a, b)


def test_saves_only_row_statistics():
  """The forward residuals are x, the params and [M] f32 stats: no M x N temporary."""
  x, scale, bias, _ = _inputs(64, 256, "bfloat16", layer=True)
  _, res = jax.vjp(pallas_norm.layer_norm, x, scale, bias)
  leaves = [a for a in jax.tree_util.tree_leaves(res) if hasattr(a, "shape")]
  big = [a for a in leaves if a.size >= x.size]
  assert len(big) == 1 and big[0].dtype == x.dtype  # x itself
  stats = [a for a in leaves if a.shape == (64,)]
  assert len(stats) == 2 and all(a.dtype == jnp.float32 for a in stats)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("mode", MODES)
def test_int64_offsets_past_2_31_elements(mode):
  """M * N > 2**31 - 1 elements: x no longer fits 32-bit offsets (the Triton lowering
  switches to 64-bit ones). Rows at both ends and dscale against the reference."""
  m, n = (8193, 262144) if mode == "multi_wave_reload" else (524289, 4096)
  assert m * n > 2**31 - 1
  x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
  s = jnp.full((n,), 1.5, jnp.bfloat16)
  eps = float(jnp.finfo(jnp.float32).eps)
  rows = np.array([0, 1, m // 2, m - 2, m - 1])
  y = jax.jit(lambda x, s: pallas_norm.rms_norm(x, s, mode=mode))(x, s)
  ref = pallas_norm.reference.norm(x[rows], s, eps=eps, subtract_mean=False)[0]
  np.testing.assert_allclose(_f64(y[rows]), _f64(ref), rtol=1e-2, atol=1e-2)
  del y
  loss = lambda x, s: jnp.sum(pallas_norm.rms_norm(x, s, mode=mode).astype(jnp.float32))
  dx, ds = jax.jit(jax.grad(loss, (0, 1)))(x, s)
  # d/dx sum(y) with a constant scale w: w * rstd * (1 - x_hat * mean(x_hat)).
  xr = _f64(x[rows])
  rstd = 1 / np.sqrt((xr * xr).mean(-1, keepdims=True) + eps)
  want = 1.5 * rstd * (1 - xr * rstd * (xr * rstd).mean(-1, keepdims=True))
  np.testing.assert_allclose(_f64(dx[rows]), want, rtol=2e-2, atol=2e-2)
  del dx
  # dscale = sum over rows of x_hat, in f32 through XLA.
  rstd_all = pallas_norm.reference.norm(x, None, eps=eps, subtract_mean=False)[2]
  ds_ref = jax.jit(lambda x, r: jnp.sum(x.astype(jnp.float32) * r[:, None], axis=0))(
      x, rstd_all)
  tol = 4 * ULP["bfloat16"] * math.sqrt(m) * (1 + np.abs(_f64(ds_ref)))
  assert (np.abs(_f64(ds) - _f64(ds_ref)) <= tol).all()


def test_stream_cache_modifier_lowers_for_cuda():
  # x and dy are loaded with ".cg" (kernels/_compat.py), which JAX's Pallas Triton
  # lowering refuses with a KeyError unless the fix applies. Lowering for CUDA runs on
  # a CPU-only machine, so this checks the fix against the installed jax; a None here
  # means the kernels lost the modifier (slower on the GPU, h200_2026-11-22_load_cg.txt).
  from pallas_norm.kernels import _compat, forward
  assert _compat.stream_cache_modifier() == ".cg"
  x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
  for mode in ("multi_wave_cached", "multi_wave_reload"):
    cfg = pn_config.ForwardConfig(mode, 4, 1024 if mode == "multi_wave_cached" else 256, 4)
    fn = jax.jit(lambda x, w, cfg=cfg: forward.norm_forward(
        x, w, None, eps=1e-6, scale_offset=0.0, subtract_mean=False, config=cfg,
        interpret=False))
    text = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "pallas_norm_fwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("op, m, n", [("layer", 4096, 8192), ("layer", 8192, 4096),
                                      ("rms", 8192, 4096), ("layer", 1000, 3000)])
def test_gpu_f32_params_with_bf16_x(op, m, n):
  """float32 scale/bias with bf16 x ([T#f32-params]: static_persistent [2, N'] tiles on
  the H100 and H200): y and the grads against the same call in multi_wave_reload (another
  kernel) and the float64 formula."""
  ln = op == "layer"
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (m, n), jnp.bfloat16)
  s = 1 + 0.1 * jax.random.normal(k[1], (n,), jnp.float32)
  b = 0.1 * jax.random.normal(k[2], (n,), jnp.float32) if ln else None
  dy = jax.random.normal(k[3], (m, n), jnp.bfloat16)
  fn = pallas_norm.layer_norm if ln else pallas_norm.rms_norm
  params = (s, b) if ln else (s,)
  if any(d in pn_config.device_info().name for d in ("H100", "H200")):
    cfg = pn_config.forward_config(m, n, x.dtype, subtract_mean=ln, param_dtype=s.dtype)
    assert (cfg.mode, cfg.block_m) == ("static_persistent", 2)

  def run(mode):
    y, vjp = jax.vjp(lambda x, *p: fn(x, *p, eps=1e-5, mode=mode), x, *params)
    return (y, *vjp(dy))

  got, other = jax.jit(lambda: run(None))(), jax.jit(lambda: run("multi_wave_reload"))()
  ulp = float(jnp.finfo(jnp.bfloat16).eps)
  np.testing.assert_allclose(_f64(got[0]), _f64(other[0]), rtol=ulp, atol=ulp)
  # the same backward kernel, from statistics equal up to float32 rounding
  np.testing.assert_allclose(_f64(got[1]), _f64(other[1]), rtol=ulp, atol=ulp)
  for g, o in zip(got[2:], other[2:]):
    np.testing.assert_allclose(_f64(g), _f64(o), rtol=1e-4, atol=1e-3)
  xf = _f64(x)
  mu = xf.mean(-1, keepdims=True) if ln else 0.0
  rstd = 1 / np.sqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
  want = (xf - mu) * rstd * _f64(s) + (_f64(b) if ln else 0.0)
  np.testing.assert_allclose(_f64(got[0]), want, rtol=1e-2, atol=2e-2)
