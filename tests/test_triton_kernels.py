"""The plain Triton kernels (backend="triton") on CPU, under the Triton interpreter.

The kernels run with ``TRITON_INTERPRET=1`` on torch CPU tensors, launched from the same
plans (``triton_kernels.forward_plan`` / ``backward_plan`` / ``reduce_plan``) that the
jax-triton glue uses, and are compared, forward and backward, with
``torch.nn.functional.rms_norm`` / ``layer_norm`` (autograd) in the same dtype and in
float64, in every mode, including chunked paths forced by a small ``block_n``. The
tensor-parallel kernels (a shard of the hidden dim) are checked against float64 row
statistics and the normalising formula, and the backward with given row sums by
splitting rows into two shards whose sums are averaged as the caller's pmean does.

jax-triton itself needs a GPU jaxlib. Here its ``triton_call`` is stood in for by a
``jax.pure_callback`` that launches the same kernels in the interpreter: like
jax-triton, a pure_callback has no vmap rule and no JVP, so the glue's custom_vmap and
the custom_vjp are exercised for real (vmap, nested vmap, batched scale, grad, jit).
"""

import os


import dataclasses  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402

import pallas_norm  # noqa: E402
from pallas_norm import config as pn_config  # noqa: E402
from pallas_norm import reference, spmd  # noqa: E402
from pallas_norm.kernels import jax_triton as glue  # noqa: E402
from pallas_norm.kernels import triton_kernels as tk  # noqa: E402

# Triton's interpreter on torch CPU tensors: conftest sets TRITON_INTERPRET=1 for CPU runs;
# `make gpu-check` (--gpu) skips this module, whose launches are CPU-only.
pytestmark = pytest.mark.cpu_only


def _patch_interpreter_index():
  """triton 3.6's interpreter turns scalar tensors into ints with int(ndarray of shape
  [1]), which NumPy >= 2.4 refuses ("only 0-dimensional arrays ..."): every
  ``range(0, N, BLOCK_N)`` with a runtime N fails. Convert through the single element
  instead; the interpreter restores the attribute when each launch ends."""
  try:
    int(np.ones(1, np.int32))
    return
  except TypeError:
    pass
  original = _interpreter._patch_lang_tensor

  def patched(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

  _interpreter._patch_lang_tensor = patched


_patch_interpreter_index()


def _patch_interpreter_bf16_rounding():
  """triton 3.6's interpreter converts float32 -> bfloat16 by truncating the mantissa;
  on the GPU the same ``.to(tl.bfloat16)`` is ``cvt.rn`` (round to nearest even), as in
  XLA and torch. Convert through ml_dtypes (round to nearest even) instead, so that
  bf16 results (h, the llama roundings) can be compared bit for bit here too."""
  builder = _interpreter.InterpreterBuilder
  original = builder.cast_impl

  def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      data = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
      return _interpreter.TensorHandle(data, dst_type.scalar)
    return original(self, src, dst_type)

  builder.cast_impl = cast_impl
  # create_fp_trunc is a lambda bound to cast_impl by name: it picks up the patch.


_patch_interpreter_bf16_rounding()

_CPU = pn_config.DeviceInfo("cpu", "cpu", 4)
# An unused pointer argument (the residual's h / dresidual outputs without a residual).
_UNUSED = torch.full((1,), float("nan"))
MODES = pn_config.MODES
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
DTYPE_NAMES = tuple(TORCH_DTYPES)
# Relative error allowed on top of torch's own error, per dtype: about one output ulp.
ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-10}
# Every M in {1, 7, 199} with every N in {1, 3, 64, 760, 1000}.
SHAPES = [(m, n) for m in (1, 7, 199) for n in (1, 3, 64, 760, 1000)]
# (has_scale, has_bias, scale_offset); RMSNorm ignores has_bias.
AFFINE = [(True, True, 0.0), (False, False, 0.0), (True, False, 1.0), (False, True, 0.0)]


def _cases():
  """mode x op x shape; the dtype and the affine variant (id suffix: index into AFFINE)
  rotate over the shapes."""
  out = []
  for mode in MODES:
    for layer in (False, True):
      for i, (m, n) in enumerate(SHAPES):
        out.append(pytest.param(mode, layer, m, n, DTYPE_NAMES[i % 3], AFFINE[(i // 3) % 4],
                                id=f"{mode}-{'ln' if layer else 'rms'}-{m}x{n}-"
                                   f"{DTYPE_NAMES[i % 3]}-{(i // 3) % 4}"))
  return out


# --------------------------------------------------------------------------- launchers


def _fwd(x3, scale, bias, cfg, *, eps, scale_offset, layer, return_residuals=True):
  """Torch launch of norm_fwd_kernel. x3: [B, M, N]; scale, bias: [PB, N] or None.

  mean / rstd start NaN-filled: without residuals they must come back untouched."""
  b, m, n = x3.shape
  pb = max([p.shape[0] for p in (scale, bias) if p is not None], default=1)
  plan = tk.forward_plan(cfg, batch=b, m=m, n=n, eps=eps, scale_offset=scale_offset,
                         subtract_mean=layer, has_scale=scale is not None,
                         has_bias=bias is not None, return_residuals=return_residuals,
                         param_stride=0 if pb == 1 else n)
  y = torch.empty_like(x3)
  mean = torch.full((b * m,), float("nan"))
  rstd = torch.full((b * m,), float("nan"))
  tk.norm_fwd_kernel[plan.grid](
      x3, x3, x3 if scale is None else scale, x3 if bias is None else bias,  # r: unread
      y, _UNUSED, mean, rstd, num_warps=plan.num_warps, num_stages=plan.num_stages,
      **plan.kwargs)
  return y, mean.reshape(b, m), rstd.reshape(b, m)


def _bwd_common(dy3, x3, scale, mean, rstd, *, scale_offset, layer, combine_row_sums):
  """(plan keywords, kernel inputs) of the backward launches."""
  b, m, n = x3.shape
  pb = 1 if scale is None else scale.shape[0]
  common = dict(batch=b, m=m, n=n, scale_offset=scale_offset, subtract_mean=layer,
                has_scale=scale is not None, param_stride=0 if pb == 1 else n,
                combine_row_sums=combine_row_sums)
  inputs = (dy3, x3, x3 if scale is None else scale, rstd if mean is None else mean, rstd,
            x3)  # xs (FP8 x's scales): unused
  return common, inputs


def _launch_row_sums(inputs, plan, rows):
  """bwd_row_stats_kernel -> (c1, c2) [rows] f32, NaN-filled first (c2 stays NaN for
  RMSNorm)."""
  c1 = torch.full((rows,), float("nan"))
  c2 = torch.full((rows,), float("nan"))
  tk.bwd_row_stats_kernel[plan.grid](*inputs, c1, c2, num_warps=plan.num_warps,
                                     num_stages=plan.num_stages, **plan.kwargs)
  return c1, c2


def _shard_row_sums(dy3, x3, scale, mean, rstd, cfg, *, scale_offset, layer):
  """c1, c2 [B * M] f32 of a shard of the hidden dim: its row sums over its n columns,
  divided by n (the tensor-parallel backward's first kernel)."""
  common, inputs = _bwd_common(dy3, x3, scale, mean, rstd, scale_offset=scale_offset,
                               layer=layer, combine_row_sums=True)
  plan = tk.row_stats_plan(cfg, **common)
  return _launch_row_sums(inputs, plan, x3.shape[0] * x3.shape[1])


def _bwd(dy3, x3, scale, mean, rstd, cfg, *, has_bias, scale_offset, layer, scale_dtype,
         bias_dtype, row_sums=None):
  """Torch launch of the backward: the row statistics kernel (chunked only), stage 1 and
  stage 2. ``row_sums``: given (c1, c2) [B * M] f32 (the tensor-parallel path: no row
  statistics kernel, stage 1 reads them). Returns dx [B, M, N], dscale / dbias [B, N]."""
  b, m, n = x3.shape
  common, inputs = _bwd_common(dy3, x3, scale, mean, rstd, scale_offset=scale_offset,
                               layer=layer, combine_row_sums=row_sums is not None)
  plan = tk.backward_plan(cfg, has_bias=has_bias, **common)
  g = plan.grid[0]
  if row_sums is not None:
    c1, c2 = row_sums
  else:
    stats_plan = tk.row_stats_plan(cfg, **common)
    c1 = c2 = rstd
    if stats_plan is not None:
      c1, c2 = _launch_row_sums(inputs, stats_plan, b * m)
  dx = torch.empty_like(x3)
  # NaN-filled: a partial row the kernel forgot to write poisons the result.
  dscale_part = torch.full((b * g, n), float("nan"))
  dbias_part = torch.full((b * g, n), float("nan"))
  tk.norm_bwd_kernel[plan.grid](
      *inputs, c1, c2, dy3, dx, _UNUSED, dscale_part, dbias_part,  # dh, dres: unused
      num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.kwargs)
  rplan = tk.reduce_plan(cfg, batch=b, groups=g, n=n)
  out = []
  for present, part, dtype in ((scale is not None, dscale_part, scale_dtype),
                               (has_bias, dbias_part, bias_dtype)):
    red = None
    if present:
      red = torch.empty((b, n), dtype=dtype)
      tk.partial_reduce_kernel[rplan.grid](part, red, num_warps=rplan.num_warps,
                                           num_stages=rplan.num_stages, **rplan.kwargs)
    out.append(red)
  return dx, out[0], out[1]


def _shard_stats(x3, cfg, *, layer):
  """Torch launch of fwd_shard_stats_kernel. x3: [B, M, n] -> (s1, s2) [B, M] f32, NaN
  where unwritten (s2 for RMSNorm)."""
  b, m, n = x3.shape
  plan = tk.shard_stats_plan(cfg, batch=b, m=m, n=n, subtract_mean=layer)
  s1 = torch.full((b * m,), float("nan"))
  s2 = torch.full((b * m,), float("nan"))
  tk.fwd_shard_stats_kernel[plan.grid](x3, x3, s1, s2, _UNUSED, num_warps=plan.num_warps,
                                       num_stages=plan.num_stages, **plan.kwargs)
  return s1.reshape(b, m), s2.reshape(b, m)


def _shard_apply(x3, scale, bias, mean, rstd, cfg, *, scale_offset):
  """Torch launch of fwd_shard_apply_kernel. x3: [B, M, n]; scale, bias: [PB, n] or None;
  mean (LayerNorm; None for RMSNorm), rstd: [B, M] f32 -> y [B, M, n] x.dtype."""
  b, m, n = x3.shape
  pb = max([p.shape[0] for p in (scale, bias) if p is not None], default=1)
  plan = tk.shard_apply_plan(cfg, batch=b, m=m, n=n, scale_offset=scale_offset,
                             subtract_mean=mean is not None, has_scale=scale is not None,
                             has_bias=bias is not None, param_stride=0 if pb == 1 else n)
  y = torch.empty_like(x3)
  tk.fwd_shard_apply_kernel[plan.grid](
      x3, x3, x3 if scale is None else scale, x3 if bias is None else bias,
      rstd if mean is None else mean, rstd, y, num_warps=plan.num_warps,
      num_stages=plan.num_stages, **plan.kwargs)
  return y


# --------------------------------------------------------------------------- oracle


def _inputs(m, n, dtype, *, seed=0, batch=1, mean=0.5):
  g = torch.Generator().manual_seed(seed + 7919 * m + n)
  x = (torch.randn(batch, m, n, generator=g) * 2.0 + mean).to(dtype)
  scale = (1.0 + 0.5 * torch.randn(n, generator=g)).to(dtype)
  bias = torch.randn(n, generator=g).to(dtype)
  dy = torch.randn(batch, m, n, generator=g).to(dtype)
  return x, scale, bias, dy


def _torch_ref(x, scale, bias, dy, *, layer, eps, scale_offset, dtype):
  """torch forward + backward in ``dtype``: (y, dx, dscale, dbias, mean, rstd) float64."""
  t = lambda a: None if a is None else a.detach().to(dtype).requires_grad_(True)
  xt, st, bt = t(x), t(scale), t(bias)
  n = x.shape[-1]
  w = None if st is None else st + scale_offset
  if layer:
    y = torch.nn.functional.layer_norm(xt, (n,), w, bt, eps)
  else:
    y = torch.nn.functional.rms_norm(xt, (n,), w, eps)
  y.backward(dy.to(dtype))
  xd = x.double()
  if layer:
    mu = xd.mean(-1)
    var = ((xd - mu[..., None]) ** 2).mean(-1)
  else:
    mu = torch.zeros(xd.shape[:-1], dtype=torch.float64)
    var = (xd * xd).mean(-1)
  out = [y, xt.grad, None if st is None else st.grad, None if bt is None else bt.grad]
  return [None if a is None else a.detach().double() for a in out] + [mu, 1 / (var + eps).sqrt()]


def _check(name, got, ref64, ref_same, *, dtype, scale_len):
  """|got - ref64| <= 2 max|torch_same - ref64| + 4 ulp sqrt(len) (1 + |ref64|)."""
  assert got is not None, name
  got = got.double()
  assert got.shape == ref64.shape, (name, got.shape, ref64.shape)
  err = (got - ref64).abs()
  torch_err = (ref_same - ref64).abs().max() if ref_same is not None else 0.0
  tol = 2 * torch_err + 4 * ULP[dtype] * math.sqrt(scale_len) * (1 + ref64.abs())
  bad = ~(err <= tol)
  assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} out of tolerance; "
                         f"max err {float(err.max()):.3g}, max tol {float(tol.max()):.3g}")


def _run_and_check(fcfg, bcfg, *, layer, m, n, dtype, has_scale, has_bias, scale_offset,
                   batch=1, batched_params=False, eps=1e-5):
  td = TORCH_DTYPES[dtype]
  has_bias = has_bias and layer
  x, scale, bias, dy = _inputs(m, n, td, batch=batch)
  scale = scale if has_scale else None
  bias = bias if has_bias else None
  if batched_params:  # one scale / bias row per batch entry
    rows = lambda p: None if p is None else torch.stack([p * (1 + 0.1 * i) for i in range(batch)])
    scale, bias = rows(scale), rows(bias)
  params = lambda p: None if p is None else (p if batched_params else p[None])
  y, mean, rstd = _fwd(x, params(scale), params(bias), fcfg, eps=eps,
                       scale_offset=scale_offset, layer=layer)
  dx, dscale, dbias = _bwd(dy, x, params(scale), mean if layer else None, rstd, bcfg,
                           has_bias=has_bias, scale_offset=scale_offset, layer=layer,
                           scale_dtype=td, bias_dtype=td)
  assert y.dtype == td and dx.dtype == td and y.shape == x.shape == dx.shape
  for i in range(batch):
    pick = lambda p: None if p is None else (p[i] if batched_params else p)
    same = _torch_ref(x[i], pick(scale), pick(bias), dy[i], layer=layer, eps=eps,
                      scale_offset=scale_offset, dtype=td)
    ref = _torch_ref(x[i], pick(scale), pick(bias), dy[i], layer=layer, eps=eps,
                     scale_offset=scale_offset, dtype=torch.float64)
    _check("y", y[i], ref[0], same[0], dtype=dtype, scale_len=n)
    _check("dx", dx[i], ref[1], same[1], dtype=dtype, scale_len=n)
    _check("rstd", rstd[i], ref[5], None, dtype="float32", scale_len=n)
    if layer:
      _check("mean", mean[i], ref[4], None, dtype="float32", scale_len=n)
    if has_scale:
      assert dscale.dtype == td
      _check("dscale", dscale[i], ref[2], same[2], dtype=dtype, scale_len=m)
    if has_bias:
      _check("dbias", dbias[i], ref[3], same[3], dtype=dtype, scale_len=m)


# --------------------------------------------------------------------------- kernel tests


@pytest.mark.parametrize("mode,layer,m,n,dtype,affine", _cases())
def test_kernels_match_torch(mode, layer, m, n, dtype, affine):
  td = TORCH_DTYPES[dtype]
  fcfg = pn_config.forward_config(m, n, td, mode, _CPU, backend="triton")
  bcfg = pn_config.backward_config(m, n, td, _CPU, backend="triton")
  _run_and_check(fcfg, bcfg, layer=layer, m=m, n=n, dtype=dtype, has_scale=affine[0],
                 has_bias=affine[1], scale_offset=affine[2])


@pytest.mark.parametrize("mode", ["multi_wave_reload", "static_persistent"])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("m,n,dtype,block_m,block_n", [
    (7, 760, "float32", 4, 128), (199, 1000, "bfloat16", 32, 256), (1, 64, "float16", 1, 16),
    (7, 3, "float32", 2, 2)])
def test_chunked_paths(mode, layer, m, n, dtype, block_m, block_n):
  """block_n < N (last chunk partial): reload passes in the forward; in the backward the
  row statistics kernel, then stage 1 on a (G, chunks) grid."""
  fcfg = pn_config.ForwardConfig(mode, block_m=block_m, block_n=block_n, num_warps=4,
                                 num_programs=3)
  bcfg = pn_config.BackwardConfig(block_m=block_m, block_n=block_n, num_warps=4,
                                  num_programs=3, reduce_block_n=64, reduce_block_g=2)
  assert tk.forward_plan(fcfg, batch=1, m=m, n=n, eps=1e-5, scale_offset=0.0,
                         subtract_mean=layer, has_scale=True,
                         has_bias=layer).kwargs["CHUNKED"]
  common = dict(batch=1, m=m, n=n, scale_offset=0.0, subtract_mean=layer, has_scale=True)
  bplan = tk.backward_plan(bcfg, has_bias=layer, **common)
  assert bplan.kwargs["CHUNKED"] and bplan.grid[1] == -(-n // block_n) > 1
  assert tk.row_stats_plan(bcfg, **common).grid == (-(-m // block_m), 1)
  _run_and_check(fcfg, bcfg, layer=layer, m=m, n=n, dtype=dtype, has_scale=True,
                 has_bias=True, scale_offset=0.0)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_large_n_chunked(layer):
  """2 x 65536 in 4096-column chunks (the reload path that serves N >= 262144)."""
  fcfg = pn_config.ForwardConfig("multi_wave_reload", block_m=2, block_n=4096, num_warps=8)
  bcfg = pn_config.BackwardConfig(block_m=2, block_n=4096, num_warps=8, num_programs=2,
                                  reduce_block_n=4096, reduce_block_g=2)
  _run_and_check(fcfg, bcfg, layer=layer, m=2, n=65536, dtype="bfloat16", has_scale=True,
                 has_bias=True, scale_offset=0.0)


@pytest.mark.parametrize("chunked", [False, True], ids=["tile", "chunked"])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_persistent_prefetch_tail(chunked, layer):
  """M = 199 is no multiple of block_m = 8: 25 row blocks over G = 3 programs, so every
  program prefetches past the last row block (fully masked) and one ends on the partial
  block; also G = 3 in the backward, on the single-tile or the (G, chunks) grid."""
  m, n, bn = 199, 96, 32 if chunked else 128
  fcfg = pn_config.ForwardConfig("static_persistent", block_m=8, block_n=bn, num_warps=4,
                                 num_programs=3)
  bcfg = pn_config.BackwardConfig(block_m=8, block_n=bn, num_warps=4, num_programs=3,
                                  reduce_block_n=32, reduce_block_g=4)
  _run_and_check(fcfg, bcfg, layer=layer, m=m, n=n, dtype="float32", has_scale=True,
                 has_bias=True, scale_offset=0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_no_residuals(mode, layer):
  """return_residuals=False (STATS off): the same y, and mean / rstd left unwritten."""
  m, n = 7, 40 if mode != "multi_wave_reload" else 100
  fcfg = pn_config.ForwardConfig(mode, block_m=4, block_n=64, num_warps=4, num_programs=2)
  x, scale, bias, _ = _inputs(m, n, torch.float32)
  kw = dict(eps=1e-5, scale_offset=0.0, layer=layer)
  bias = bias[None] if layer else None
  y, _, _ = _fwd(x, scale[None], bias, fcfg, **kw)
  y2, mean, rstd = _fwd(x, scale[None], bias, fcfg, return_residuals=False, **kw)
  assert torch.equal(y, y2)
  assert mean.isnan().all() and rstd.isnan().all()


@pytest.mark.parametrize("knobs", [dict(evict_first=True, loop_stages=2),
                                   dict(stream_cg=True)], ids=["evict_first", "cg"])
def test_knobs(monkeypatch, knobs):
  """The plain-Triton A/B switches reach the plans and keep the results (the interpreter
  ignores the cache hints; this runs their code paths)."""
  monkeypatch.setattr(tk, "KNOBS", tk.TritonKnobs(**knobs))
  fcfg = pn_config.ForwardConfig("static_persistent", block_m=4, block_n=16, num_warps=4,
                                 num_programs=2)
  plan = tk.forward_plan(fcfg, batch=1, m=7, n=40, eps=1e-5, scale_offset=0.0,
                         subtract_mean=True, has_scale=True, has_bias=True)
  assert plan.kwargs["EVICT_FIRST"] == knobs.get("evict_first", False)
  assert plan.kwargs["STREAM_CG"] == knobs.get("stream_cg", False)
  assert plan.kwargs["LOOP_STAGES"] == knobs.get("loop_stages", 0)
  with pytest.raises(ValueError, match="evict_first"):
    tk.TritonKnobs(evict_first=True, stream_cg=True)
  for bn in (16, 64):
    fcfg = dataclasses.replace(fcfg, block_n=bn)
    bcfg = pn_config.BackwardConfig(block_m=4, block_n=bn, num_warps=4, num_programs=2,
                                    reduce_block_n=16, reduce_block_g=2)
    _run_and_check(fcfg, bcfg, layer=True, m=7, n=40, dtype="float32", has_scale=True,
                   has_bias=True, scale_offset=0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batched_params", [False, True], ids=["shared", "batched"])
def test_batch_axis(mode, batched_params):
  """Grid axis 1: [B, M, N] with shared or per-entry scale/bias; per-entry dscale."""
  m, n = 7, 40
  fcfg = pn_config.forward_config(m, n, torch.float32, mode, _CPU, backend="triton")
  bcfg = dataclasses.replace(pn_config.backward_config(m, n, torch.float32, _CPU, backend="triton"),
                           num_programs=5)
  _run_and_check(fcfg, bcfg, layer=True, m=m, n=n, dtype="float32", has_scale=True,
                 has_bias=True, scale_offset=0.5, batch=3, batched_params=batched_params)


@pytest.mark.parametrize("chunked", [False, True])
def test_int64_offsets(chunked, monkeypatch):
  """The USE_INT64 code path (forced: no 2**31-element tensor on CPU)."""
  monkeypatch.setattr(tk, "_needs_int64", lambda *a: True)
  bn = 16 if chunked else 64
  fcfg = pn_config.ForwardConfig("static_persistent", block_m=4, block_n=bn, num_warps=4,
                                 num_programs=2)
  bcfg = pn_config.BackwardConfig(block_m=4, block_n=bn, num_warps=4, num_programs=2,
                                  reduce_block_n=16, reduce_block_g=2)
  assert tk.forward_plan(fcfg, batch=1, m=7, n=40, eps=1e-5, scale_offset=0.0,
                         subtract_mean=True, has_scale=True, has_bias=True).kwargs["USE_INT64"]
  _run_and_check(fcfg, bcfg, layer=True, m=7, n=40, dtype="float32", has_scale=True,
                 has_bias=True, scale_offset=0.0)


def test_plans():
  cfg = pn_config.ForwardConfig("static_persistent", 4, 1024, 4, num_programs=10)
  kw = dict(eps=1e-6, scale_offset=1.0, subtract_mean=False, has_scale=True, has_bias=False)
  plan = tk.forward_plan(cfg, batch=1, m=100, n=1000, **kw)
  assert plan.grid == (10, 1) and plan.num_warps == 4 and plan.num_stages == 1
  # Shapes are constexprs: jax-triton gives integer arguments no divisibility hint.
  assert plan.kwargs == dict(M=100, N=1000, PARAM_STRIDE=0, EPS=1e-6, SCALE_OFFSET=1.0, SUBTRACT_MEAN=False, HAS_SCALE=True,
                             HAS_BIAS=False, STATS=True, HAS_RESIDUAL=False, XGROUP=0,
                             LLAMA_X=0,
                             LLAMA_Y=0, BLOCK_M=4, BLOCK_N=1024,
                             CHUNKED=False, PERSISTENT=True, USE_INT64=False,
                             EVICT_FIRST=False, STREAM_CG=False, LOOP_STAGES=0)
  fused = tk.forward_plan(cfg, batch=1, m=100, n=1000, has_residual=True,
                          cast=("bfloat16", "float32"), **kw).kwargs
  assert (fused["HAS_RESIDUAL"], fused["LLAMA_X"], fused["LLAMA_Y"]) == (True, 2, 1)
  with pytest.raises(ValueError, match="'int8' is not one of"):
    tk.forward_plan(cfg, batch=1, m=100, n=1000, cast=("int8", "float32"), **kw)
  assert not tk.forward_plan(cfg, batch=1, m=100, n=1000, return_residuals=False,
                             **kw).kwargs["STATS"]
  assert tk.forward_plan(cfg, batch=4, m=100, n=1000, **kw).grid == (3, 4)
  wave = pn_config.ForwardConfig("multi_wave_reload", 4, 1024, 4)
  assert tk.forward_plan(wave, batch=1, m=101, n=1000, **kw).grid == (26, 1)
  assert tk.forward_plan(wave, batch=1, m=101, n=1000, **kw).kwargs["CHUNKED"]
  big = tk.forward_plan(wave, batch=1, m=8192, n=262144, **kw)
  assert big.kwargs["USE_INT64"] and big.kwargs["CHUNKED"]
  assert not tk.forward_plan(wave, batch=1, m=4096, n=4096, **kw).kwargs["USE_INT64"]
  with pytest.raises(ValueError, match="block_n"):
    tk.forward_plan(pn_config.ForwardConfig("multi_wave_cached", 4, 512, 4), batch=1, m=8,
                    n=1000, **kw)
  with pytest.raises(ValueError, match="num_programs"):
    tk.forward_plan(pn_config.ForwardConfig("static_persistent", 4, 512, 4), batch=1, m=8,
                    n=100, **kw)
  bcfg = pn_config.BackwardConfig(8, 128, 4, num_programs=6, reduce_block_n=32,
                                  reduce_block_g=4, reduce_num_warps=2)
  bkw = dict(scale_offset=0.0, subtract_mean=True, has_scale=True)
  bplan = tk.backward_plan(bcfg, batch=1, m=100, n=1000, has_bias=True, **bkw)
  assert bplan.grid == (6, 8, 1) and bplan.kwargs["CHUNKED"]
  assert tk.row_stats_plan(bcfg, batch=2, m=100, n=1000, **bkw).grid == (13, 2)
  tile = dataclasses.replace(bcfg, block_n=1024)
  assert tk.backward_plan(tile, batch=2, m=100, n=1000, has_bias=True, **bkw).grid == (3, 1, 2)
  assert tk.row_stats_plan(tile, batch=2, m=100, n=1000, **bkw) is None
  rplan = tk.reduce_plan(bcfg, batch=2, groups=6, n=1000)
  assert rplan.grid == (32, 2) and rplan.num_warps == 2
  assert (rplan.kwargs["G"], rplan.kwargs["N"]) == (6, 1000)
  fused = tk.backward_plan(bcfg, batch=1, m=100, n=1000, has_bias=True, has_dh=True,
                           has_dres=True, cast=("float16", "float16"), **bkw).kwargs
  assert (fused["HAS_DH"], fused["HAS_DRES"], fused["LLAMA_X"], fused["LLAMA_Y"]) == (
      True, True, 3, 3)
  assert fused["PREFETCH_DH"]  # LayerNorm, block_n 128
  assert not tk.backward_plan(bcfg, batch=1, m=100, n=1000, has_bias=False, has_dh=True,
                              **dict(bkw, subtract_mean=False)).kwargs["PREFETCH_DH"]
  wide = dataclasses.replace(bcfg, block_n=8192)
  assert not tk.backward_plan(wide, batch=1, m=100, n=8192, has_bias=True, has_dh=True,
                              **bkw).kwargs["PREFETCH_DH"]
  assert not bplan.kwargs["HAS_DH"] and not bplan.kwargs["LLAMA_X"]
  batched = tk.backward_plan(bcfg, batch=2, m=100, n=1000, has_bias=True, param_stride=1000,
                             **bkw)
  assert (batched.kwargs["M"], batched.kwargs["N"], batched.kwargs["PARAM_STRIDE"]) == (
      100, 1000, 1000)


# --------------------------------------------------------------------------- tensor parallel

# Shard widths n (the columns a device holds) of the tensor-parallel tests; the backward
# splits rows of N = 2n columns into two shards.
TP_SHAPES = [(m, n) for m in (1, 7, 33) for n in (3, 64, 200, 1000)]


def _tp_cases(modes=None):
  """(mode x) op x shape, without the mode when ``modes`` is None (the backward has
  none); the dtype (f32, bf16), the config (forward_config's, or chunked) and the affine
  variant rotate over the shapes."""
  out = []
  for mode in modes or (None,):
    for layer in (False, True):
      for i, (m, n) in enumerate(TP_SHAPES):
        j, k = i % 4, i // 4  # n's index, m's index: each n gets both dtypes and configs
        dtype, chunked = ("float32", "bfloat16")[(j + k) % 2], bool((j // 2 + k) % 2)
        affine = i // 3 % 4
        out.append(pytest.param(
            *(() if mode is None else (mode,)), layer, m, n, dtype, chunked, AFFINE[affine],
            id=f"{'' if mode is None else mode + '-'}{'ln' if layer else 'rms'}-{m}x{n}-"
               f"{dtype}-{'chunked' if chunked else 'default'}-{affine}"))
  return out


def _tp_chunk(n):
  """block_n of the chunked configs: about a quarter of the shard (the last chunk partial
  for n = 200, 1000; one column a chunk for n = 3)."""
  return max(1, pn_config.next_power_of_2(n) // 4)


def _tp_forward_config(mode, m, n, td, layer, chunked):
  """forward_config's config for the shard [m, n], or one with 4-row blocks, 4 chunks a
  row and 3 persistent programs (9 row blocks at M = 33)."""
  cfg = pn_config.forward_config(m, n, td, mode, _CPU, subtract_mean=layer, backend="triton")
  if chunked:
    cfg = dataclasses.replace(cfg, block_m=4, block_n=_tp_chunk(n), num_programs=3)
  return cfg


@pytest.mark.parametrize("mode,layer,m,n,dtype,chunked,affine", _tp_cases(MODES))
def test_shard_stats(mode, layer, m, n, dtype, chunked, affine):
  """fwd_shard_stats_kernel against float64: RMSNorm sum(x^2); LayerNorm mean and M2 of
  rows centred near 1000, where E[x^2] - E[x]^2 in f32 would lose M2 entirely."""
  del affine
  td = TORCH_DTYPES[dtype]
  cfg = _tp_forward_config(mode, m, n, td, layer, chunked)
  plan = tk.shard_stats_plan(cfg, batch=1, m=m, n=n, subtract_mean=layer)
  assert plan.kwargs["PERSISTENT"] == (mode == "static_persistent")
  x, _, _, _ = _inputs(m, n, td, mean=1000.0 if layer else 0.5)
  s1, s2 = _shard_stats(x, cfg, layer=layer)
  xd = x[0].double()  # [m, n] f64
  if layer:
    mu = xd.mean(-1)
    _check("mean", s1[0], mu, None, dtype="float32", scale_len=n)
    _check("M2", s2[0], ((xd - mu[:, None]) ** 2).sum(-1), None, dtype="float32",
           scale_len=n)
  else:
    _check("sum(x^2)", s1[0], (xd * xd).sum(-1), None, dtype="float32", scale_len=n)
    assert s2.isnan().all()  # RMSNorm writes no s2


@pytest.mark.parametrize("mode,layer,m,n,dtype,chunked,affine", _tp_cases(MODES))
def test_shard_apply(mode, layer, m, n, dtype, chunked, affine):
  """fwd_shard_apply_kernel against y = (x - mean) * rstd * (scale_offset + scale) + bias
  for given whole-row statistics (random: nothing the shard alone could compute)."""
  has_scale, has_bias, scale_offset = affine
  td = TORCH_DTYPES[dtype]
  cfg = _tp_forward_config(mode, m, n, td, layer, chunked)
  x, scale, bias, _ = _inputs(m, n, td)
  scale = scale if has_scale else None
  bias = bias if has_bias else None
  g = torch.Generator().manual_seed(m * n)
  mean = torch.randn(1, m, generator=g) if layer else None  # [1, m] f32
  rstd = 0.5 + torch.rand(1, m, generator=g)
  y = _shard_apply(x, None if scale is None else scale[None],
                   None if bias is None else bias[None], mean, rstd, cfg,
                   scale_offset=scale_offset)
  assert y.dtype == td and y.shape == x.shape

  def formula(dt):
    y = x[0].to(dt)
    if layer:
      y = y - mean[0, :, None].to(dt)
    y = y * rstd[0, :, None].to(dt)
    if scale is not None:
      y = y * (scale_offset + scale.to(dt))
    return y if bias is None else y + bias.to(dt)

  _check("y", y[0], formula(torch.float64), formula(torch.float32).to(td), dtype=dtype,
         scale_len=1)


@pytest.mark.parametrize("layer,m,n,dtype,chunked,affine", _tp_cases())
def test_shard_backward_given_row_sums(layer, m, n, dtype, chunked, affine):
  """Rows of N = 2n columns split into two shards of n: each shard's row sums
  (bwd_row_stats_kernel over its columns), averaged as the caller's pmean does, then
  stage 1 with those sums and stage 2 per shard; the concatenated dx / dscale / dbias
  against torch autograd on the whole rows."""
  has_scale, has_bias, scale_offset = affine
  has_bias = has_bias and layer
  td, big_n, eps = TORCH_DTYPES[dtype], 2 * n, 1e-5
  x, scale, bias, dy = _inputs(m, big_n, td)
  scale = scale if has_scale else None
  bias = bias if has_bias else None
  param = lambda p, s: None if p is None else p[s][None]
  fcfg = pn_config.forward_config(m, big_n, td, "multi_wave_reload", _CPU,
                                  subtract_mean=layer, backend="triton")
  _, mean, rstd = _fwd(x, param(scale, slice(None)), param(bias, slice(None)), fcfg,
                       eps=eps, scale_offset=scale_offset, layer=layer)  # whole rows
  mean = mean if layer else None
  if chunked:  # 4 chunks a row; 5 row blocks over G = 3 programs at M = 33
    bcfg = pn_config.BackwardConfig(block_m=8, block_n=_tp_chunk(n), num_warps=4,
                                    num_programs=3, reduce_block_n=64, reduce_block_g=2)
  else:  # block_n >= n: one chunk, still the row-statistics + column-tiled pair
    bcfg = pn_config.backward_config(m, n, td, _CPU, backend="triton")
  common = dict(scale_offset=scale_offset, layer=layer)
  shards = [slice(0, n), slice(n, big_n)]
  parts = [(dy[..., s].contiguous(), x[..., s].contiguous(), param(scale, s)) for s in shards]
  sums = [_shard_row_sums(dy_k, x_k, s_k, mean, rstd, bcfg, **common)
          for dy_k, x_k, s_k in parts]
  c1 = (sums[0][0] + sums[1][0]) / 2  # [m] f32: the pmean over the two shards
  c2 = (sums[0][1] + sums[1][1]) / 2 if layer else c1
  outs = [_bwd(dy_k, x_k, s_k, mean, rstd, bcfg, has_bias=has_bias, scale_dtype=td,
               bias_dtype=td, row_sums=(c1, c2), **common) for dy_k, x_k, s_k in parts]
  dx, dscale, dbias = (None if o[0] is None else torch.cat(o, -1) for o in zip(*outs))
  assert dx.dtype == td and dx.shape == x.shape
  same = _torch_ref(x[0], scale, bias, dy[0], layer=layer, eps=eps,
                    scale_offset=scale_offset, dtype=td)
  ref = _torch_ref(x[0], scale, bias, dy[0], layer=layer, eps=eps,
                   scale_offset=scale_offset, dtype=torch.float64)
  _check("dx", dx[0], ref[1], same[1], dtype=dtype, scale_len=big_n)
  if has_scale:
    _check("dscale", dscale[0], ref[2], same[2], dtype=dtype, scale_len=m)
  if has_bias:
    _check("dbias", dbias[0], ref[3], same[3], dtype=dtype, scale_len=m)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_shard_int64_offsets(monkeypatch, layer):
  """The USE_INT64 code path of the tensor-parallel launches (forced: no 2**31-element
  tensor on CPU)."""
  monkeypatch.setattr(tk, "_needs_int64", lambda *a: True)
  cfg = _tp_forward_config("static_persistent", 7, 64, torch.float32, layer, True)
  assert tk.shard_stats_plan(cfg, batch=1, m=7, n=64, subtract_mean=layer).kwargs["USE_INT64"]
  case = dict(layer=layer, m=7, n=64, dtype="float32", chunked=True, affine=AFFINE[0])
  for mode in ("multi_wave_reload", "static_persistent"):
    test_shard_stats(mode=mode, **case)
    test_shard_apply(mode=mode, **case)
  test_shard_backward_given_row_sums(**case)


def test_shard_plans():
  """The tensor-parallel grids per mode, and combine_row_sums forcing the row-statistics
  + column-tiled pair on a row that fits one tile."""
  kw = dict(batch=1, m=100, n=1000, subtract_mean=True)
  persistent = pn_config.ForwardConfig("static_persistent", 4, 256, 4, num_programs=10)
  plan = tk.shard_stats_plan(persistent, **kw)
  assert plan.grid == (10, 1) and plan.kwargs["PERSISTENT"] and plan.kwargs["BLOCK_N"] == 256
  assert tk.shard_stats_plan(persistent, **dict(kw, batch=4)).grid == (3, 4)
  assert tk.shard_stats_plan(persistent, **dict(kw, m=9)).grid == (3, 1)  # 3 row blocks
  unset = dataclasses.replace(persistent, num_programs=0)  # one program a row block
  assert tk.shard_stats_plan(unset, **kw).grid == (25, 1)
  # multi_wave_cached with block_n < n walks the row in chunks, as the Pallas kernels do.
  cached = pn_config.ForwardConfig("multi_wave_cached", 4, 256, 4)
  plan = tk.shard_apply_plan(cached, scale_offset=1.0, has_scale=True, has_bias=False,
                             param_stride=1000, **dict(kw, batch=2))
  assert plan.grid == (25, 2) and not plan.kwargs["PERSISTENT"]
  assert (plan.kwargs["PARAM_STRIDE"], plan.kwargs["SCALE_OFFSET"]) == (1000, 1.0)
  assert tk.shard_stats_plan(cached, **dict(kw, m=8192, n=262144)).kwargs["USE_INT64"]
  tile = pn_config.BackwardConfig(8, 1024, 4, num_programs=6)
  bkw = dict(batch=1, m=100, n=1000, scale_offset=0.0, subtract_mean=True, has_scale=True)
  assert tk.row_stats_plan(tile, **bkw) is None
  assert not tk.backward_plan(tile, has_bias=True, **bkw).kwargs["CHUNKED"]
  assert tk.row_stats_plan(tile, combine_row_sums=True, **bkw).grid == (13, 1)
  plan = tk.backward_plan(tile, has_bias=True, combine_row_sums=True, **bkw)
  assert plan.kwargs["CHUNKED"] and plan.grid == (6, 1, 1)


# --------------------------------------------------------------------------- jax glue


def test_triton_backend_import_error_on_cpu():
  """No GPU jaxlib here: backend="triton" names what to install, before any launch."""
  assert jax.default_backend() != "gpu"
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ImportError, match=r"jax-triton and a CUDA jaxlib.*pallas-norm\[triton"):
    pallas_norm.rms_norm(x, backend="triton")
  with pytest.raises(ImportError, match="jax-triton"):
    jax.grad(lambda x: pallas_norm.layer_norm(x, backend="triton").sum())(x)


_FP8_TORCH = {np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
              np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}


def _to_torch(a):
  a = np.asarray(a)
  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
  if a.dtype in _FP8_TORCH:
    return torch.from_numpy(a.view(np.uint8).copy()).view(_FP8_TORCH[a.dtype])
  return torch.from_numpy(a.copy())


def _to_numpy(t):
  if t.dtype == torch.bfloat16:
    return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def _fake_jax_triton(version):
  """A jax_triton stand-in: triton_call launches the kernel in the interpreter from a
  pure_callback (no vmap rule, no JVP: the same limits as jax-triton)."""
  out_kw = "out_type" if version >= (0, 4) else "out_shape"

  def triton_call(*args, kernel, grid, num_warps, num_stages, name, **kwargs):
    assert name.startswith("pallas_norm_triton_"), name
    outs = kwargs.pop(out_kw)
    assert not {"out_type", "out_shape"} & kwargs.keys(), kwargs.keys()
    arrays = [a for a in args if not isinstance(a, int)]

    def host(*host_arrays):
      it = iter(host_arrays)
      targs = [a if isinstance(a, int) else _to_torch(next(it)) for a in args]
      touts = [torch.from_numpy(np.full(o.shape, np.nan, np.float32)).to(
          TORCH_DTYPES[jnp.dtype(o.dtype).name]) for o in outs]
      kernel[grid](*targs, *touts, num_warps=num_warps, num_stages=num_stages, **kwargs)
      return tuple(_to_numpy(t) for t in touts)

    return jax.pure_callback(host, tuple(outs), *arrays)

  return type("FakeJaxTriton", (), {"__version_info__": version,
                                    "triton_call": staticmethod(triton_call)})


@pytest.fixture(params=[(0, 3, 1), (0, 4, 1)], ids=["jt0.3", "jt0.4"])
def fake_jt(request, monkeypatch):
  monkeypatch.setattr(glue, "_jax_triton", lambda: _fake_jax_triton(request.param))


@pytest.fixture
def fake_jt4(monkeypatch):
  """jax-triton 0.4's stand-in only (the version switch is covered by ``fake_jt``)."""
  monkeypatch.setattr(glue, "_jax_triton", lambda: _fake_jax_triton((0, 4, 1)))


def _loss(backend, mode, layer, scale_offset=0.0):
  def f(x, s, b):
    if layer:
      y = pallas_norm.layer_norm(x, s, b, scale_offset=scale_offset, mode=mode,
                                 backend=backend)
    else:
      y = pallas_norm.rms_norm(x, s, scale_offset=scale_offset, mode=mode, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
  return f


def _assert_tree_close(a, b, rtol=2e-5, atol=2e-5):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(
      np.asarray(u, np.float64), np.asarray(v, np.float64), rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_glue_forward_grad_jit(fake_jt, mode, layer):
  """jit(value_and_grad) of the public op through the glue vs backend="xla"."""
  del fake_jt
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, 5, 48), jnp.float32)
  s = 1 + 0.3 * jax.random.normal(k[1], (48,), jnp.bfloat16)
  b = jax.random.normal(k[2], (48,), jnp.float32) if layer else None
  got = jax.jit(jax.value_and_grad(_loss("triton", mode, layer, 1.0), (0, 1, 2)))(x, s, b)
  want = jax.value_and_grad(_loss("xla", mode, layer, 1.0), (0, 1, 2))(x, s, b)
  assert got[1][1].dtype == jnp.bfloat16
  if layer:
    assert got[1][2].dtype == jnp.float32
  _assert_tree_close(got[0], want[0])
  _assert_tree_close(got[1][0], want[1][0])
  _assert_tree_close(got[1][1:], want[1][1:], rtol=1e-2, atol=1e-2)  # bf16 dscale


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_glue_vmap(fake_jt4, layer):
  """vmap: batched x with shared scale (folded), batched scale, nested, vmap of grad
  (per-example dscale) and grad of vmap (dscale summed over the batch)."""
  del fake_jt4
  mode = "static_persistent"
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (3, 4, 2, 24), jnp.float32)
  s = 1 + 0.3 * jax.random.normal(k[1], (3, 24), jnp.float32)
  b = jax.random.normal(k[2], (24,), jnp.float32) if layer else None

  def op(backend):
    if layer:
      return lambda x, s, b: pallas_norm.layer_norm(x, s, b, mode=mode, backend=backend)
    return lambda x, s, b: pallas_norm.rms_norm(x, s, mode=mode, backend=backend)

  for in_axes, sv in (((0, None, None), s[0]), ((0, 0, None), s), ((None, 0, None), s)):
    xv = x if in_axes[0] == 0 else x[0]
    _assert_tree_close(jax.jit(jax.vmap(op("triton"), in_axes))(xv, sv, b),
                       jax.vmap(op("xla"), in_axes)(xv, sv, b))
  nested = lambda be: jax.vmap(jax.vmap(op(be), (0, None, None)), (0, 0, None))
  _assert_tree_close(nested("triton")(x, s, b), nested("xla")(x, s, b))
  per_example = lambda be: jax.vmap(jax.grad(_loss(be, mode, layer), (0, 1, 2)),
                                    (0, None, None))
  _assert_tree_close(jax.jit(per_example("triton"))(x, s[0], b),
                     per_example("xla")(x, s[0], b), rtol=1e-4, atol=1e-4)
  of_vmap = lambda be: jax.grad(lambda x, s, b: jnp.sum(jnp.sin(
      jax.vmap(op(be), (0, 0, None))(x, s, b))), (0, 1, 2))
  _assert_tree_close(jax.jit(of_vmap("triton"))(x, s, b), of_vmap("xla")(x, s, b),
                     rtol=1e-4, atol=1e-4)
  remat = lambda be: jax.grad(jax.checkpoint(_loss(be, mode, layer)), (0, 1, 2))
  _assert_tree_close(remat("triton")(x[0], s[0], b), remat("xla")(x[0], s[0], b),
                     rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer,mode", [(False, "static_persistent"),
                                        (True, "multi_wave_reload")], ids=["rms", "ln"])
def test_glue_shard(monkeypatch, layer, mode):
  """norm_forward_stats, norm_forward_apply and norm_backward(combine_row_sums=...)
  through the glue (jax-triton 0.4's stand-in; the kernels' modes are tested above), the
  hidden dim split into 2 shards over a vmap axis whose pmean stands in for the
  all-reduce (so the custom_vmap rules run too, with batched scale / bias, and an outer
  vmap of 2 examples sharing them), against the reference on the whole rows."""
  monkeypatch.setattr(glue, "_jax_triton", lambda: _fake_jax_triton((0, 4, 1)))
  batch, m, n, shards, eps, offset = 2, 7, 48, 2, 1e-5, 0.5
  w = n // shards
  k = jax.random.split(jax.random.key(2), 4)
  x = 2 * jax.random.normal(k[0], (batch, m, n), jnp.float32) + 0.5
  s = 1 + 0.3 * jax.random.normal(k[1], (n,), jnp.float32)
  b = jax.random.normal(k[2], (n,), jnp.float32) if layer else None
  dy = jax.random.normal(k[3], (batch, m, n), jnp.float32)
  fcfg = pn_config.forward_config(m, w, jnp.float32, mode, _CPU, subtract_mean=layer,
                                  backend="triton")
  bcfg = pn_config.backward_config(m, w, jnp.float32, _CPU, backend="triton")
  cols = lambda a: jnp.moveaxis(a.reshape(batch, m, shards, w), 2, 1)  # [B, shards, M, w]
  rows = lambda a: jnp.moveaxis(a, 1, 2).reshape(batch, m, n)
  params = lambda p: None if p is None else p.reshape(shards, w)

  def forward(xk, sk, bk):
    s1, s2 = glue.norm_forward_stats(xk, subtract_mean=layer, config=fcfg, interpret=True)
    assert s1.shape == (m,) and (s2 is None) == (not layer)
    mean, rstd = spmd._combine_stats(s1, s2, n=w, eps=eps, axes="h", groups=None)
    y = glue.norm_forward_apply(xk, sk, bk, mean, rstd, scale_offset=offset, config=fcfg,
                                interpret=True)
    return y, mean, rstd

  sharded = jax.vmap(forward, axis_name="h")
  y, mean, rstd = jax.jit(jax.vmap(sharded, (0, None, None)))(cols(x), params(s), params(b))
  assert y.dtype == x.dtype and rows(y).shape == x.shape
  y_ref, mean_ref, rstd_ref = reference.norm(x, s, b, eps=eps, scale_offset=offset,
                                             subtract_mean=layer)
  _assert_tree_close(rows(y), y_ref)
  _assert_tree_close(rstd[:, 0], rstd_ref)
  if layer:
    _assert_tree_close(mean[:, 0], mean_ref)

  pmean = lambda c1, c2: tuple(None if c is None else jax.lax.pmean(c, "h") for c in (c1, c2))

  def backward(dyk, xk, sk, mean, rstd):
    return glue.norm_backward(dyk, xk, sk, mean if layer else None, rstd, has_bias=layer,
                              scale_offset=offset, subtract_mean=layer, config=bcfg,
                              interpret=True, scale_dtype=jnp.float32,
                              bias_dtype=jnp.float32, combine_row_sums=pmean)

  # mean / rstd of the whole rows: the same on every shard (not batched over "h").
  sharded = jax.vmap(backward, (0, 0, 0, None, None), axis_name="h")
  dx, dscale, dbias = jax.jit(jax.vmap(sharded, (0, 0, None, 0, 0)))(
      cols(dy), cols(x), params(s), mean_ref, rstd_ref)
  _, vjp = jax.vjp(lambda x, s, b: reference.norm(x, s, b, eps=eps, scale_offset=offset,
                                                  subtract_mean=layer)[0], x, s, b)
  dx_ref, dscale_ref, dbias_ref = vjp(dy)
  _assert_tree_close(rows(dx), dx_ref, rtol=1e-4, atol=1e-4)
  _assert_tree_close(dscale.sum(0).reshape(n), dscale_ref, rtol=1e-4, atol=1e-4)
  if layer:
    _assert_tree_close(dbias.sum(0).reshape(n), dbias_ref, rtol=1e-4, atol=1e-4)
  else:
    assert dbias is None


# ------------------------------------------- the fused residual add and cast="llama"

# (x, residual, residual_dtype): bf16 x with an fp32 residual stream, an fp32 h of bf16
# inputs (dresidual then differs from dx), and a bf16 h of an fp32 x.
_RES_DTYPES = [("bfloat16", "float32", None), ("bfloat16", "bfloat16", "float32"),
               ("float32", "bfloat16", "bfloat16")]
# Unit roundoff per dtype; float32 with test_residual's floor (rstd amplifies last bits).
_RES_ULP = {"float32": 2.0**-17, "bfloat16": 2.0**-8, "float16": 2.0**-10}
_RED = pn_config.reduce_config(1000, 2)
# Every forward code path of the Triton kernels (single tile, chunked reload, persistent
# with either) and both backward ones (single tile; row statistics + column tiles).
GLUE_FWD = {
    "cached": pn_config.ForwardConfig("multi_wave_cached", 2, 1024, 4),
    "reload": pn_config.ForwardConfig("multi_wave_reload", 2, 256, 4),
    "persistent": pn_config.ForwardConfig("static_persistent", 2, 1024, 4, 3),
    "persistent_chunked": pn_config.ForwardConfig("static_persistent", 2, 256, 4, 3),
}
GLUE_BWD = {
    "tile": pn_config.BackwardConfig(2, 1024, 4, 2, **_RED),
    "columns": pn_config.BackwardConfig(2, 256, 4, 2, **_RED),
}


def _res_inputs(m, n, xd, rd, *, layer, sd="float32", seed=0):
  rng = np.random.default_rng(seed + 31 * m + n)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  x = jnp.asarray(f(m, n) * 2 + 0.5, xd)
  r = jnp.asarray(f(m, n) * 3 + (2.0 if layer else 0.0), rd)
  scale = jnp.asarray(1 + 0.5 * f(n), sd)
  bias = jnp.asarray(f(n), sd) if layer else None
  return x, r, scale, bias


def _res_close(got, want, dtypes, n, what):
  """Within 4 units roundoff of the coarsest of ``dtypes`` (x's, h's: the backward
  recomputes x_hat from the saved h), times sqrt(n) / 8 for the sums."""
  name = max((jnp.dtype(d).name for d in dtypes if d is not None), key=_RES_ULP.get)
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  tol = 4 * _RES_ULP[name] * max(1.0, np.sqrt(n) / 8)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()),
                             err_msg=what)


def _fused_op(layer, backend, *, residual, cast, mode=None, residual_dtype=None):
  """(x, r, scale, bias) -> the public op's output(s), with or without the residual."""
  kw = dict(cast=cast, mode=mode, backend=backend)
  if residual:
    kw["residual_dtype"] = residual_dtype
  def f(x, r, s, b):
    extra = dict(kw, residual=r) if residual else kw
    if layer:
      return pallas_norm.layer_norm(x, s, b, **extra)
    return pallas_norm.rms_norm(x, s, **extra)
  return f


def _check_fused_vjp(ours, want, args, *, n, dtypes, what):
  """jax.vjp of ``ours`` against ``want``: values (h bit for bit) and every grad, with
  random cotangents on every output."""
  out, pull = jax.vjp(ours, *args)
  out_w, pull_w = jax.vjp(want, *args)
  outs, outs_w = (out, out_w) if isinstance(out, tuple) else ((out,), (out_w,))
  for i, (o, w) in enumerate(zip(outs, outs_w)):
    assert o.dtype == w.dtype and o.shape == w.shape, (what, i, o.dtype, w.dtype)
    if i == 1:  # h = x + residual, rounded once
      np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(w, np.float32))
    else:
      _res_close(o, w, dtypes, n, f"{what}: y")
  rng = np.random.default_rng(5)
  cts = tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in outs)
  grads = pull(cts if isinstance(out, tuple) else cts[0])
  grads_w = pull_w(cts if isinstance(out, tuple) else cts[0])
  for name, g, w in zip(("dx", "dresidual", "dscale", "dbias"), grads, grads_w):
    if w is None or name == "dresidual" and len(outs) == 1:
      continue
    assert g.dtype == w.dtype, (what, name, g.dtype, w.dtype)
    _res_close(g, w, dtypes, args[0].shape[0] if name in ("dscale", "dbias") else n,
               f"{what}: {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_glue_residual_and_llama(fake_jt4, mode, layer):
  """The public op on backend="triton" (through the glue) against backend="xla" (the
  formula), jitted, in every mode: the fused residual add over the dtype table, and
  cast="llama" with and without a residual (bf16 x with an fp32 scale: y in fp32; a
  bf16 scale: y in bf16)."""
  del fake_jt4
  m, n = 6, 200
  for xd, rd, hd in _RES_DTYPES:
    x, r, s, b = _res_inputs(m, n, xd, rd, layer=layer)
    kw = dict(residual=True, cast="torch", residual_dtype=hd)
    _check_fused_vjp(jax.jit(_fused_op(layer, "triton", mode=mode, **kw)),
                     _fused_op(layer, "xla", **kw), (x, r, s, b), n=n,
                     dtypes=(xd, hd or rd), what=f"{mode} residual {xd}/{rd}/{hd}")
  for sd, residual in (("float32", False), ("bfloat16", False), ("float32", True)):
    x, r, s, b = _res_inputs(m, n, "bfloat16", "float32", layer=layer, sd=sd)
    kw = dict(residual=residual, cast="llama")
    _check_fused_vjp(jax.jit(_fused_op(layer, "triton", mode=mode, **kw)),
                     _fused_op(layer, "xla", **kw), (x, r, s, b), n=n,
                     dtypes=("bfloat16",), what=f"{mode} llama scale {sd} res {residual}")


@pytest.mark.parametrize("fwd,bwd,cast", [("cached", "tile", "torch"),
                                          ("reload", "columns", "llama"),
                                          ("persistent", "columns", "torch"),
                                          ("persistent_chunked", "tile", "llama")])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "ln"])
def test_glue_fused_kernel_paths(fake_jt4, fwd, bwd, cast, layer):
  """Every Triton forward and backward code path with a residual (bf16 x, fp32 residual,
  bf16 h: dresidual in its own dtype), each backward path under each cast, called
  through the glue with a forced config, against the xla formula's values and vjp."""
  del fake_jt4
  m, n = 5, 600
  x, r, s, b = _res_inputs(m, n, "bfloat16", "float32", layer=layer)
  b = b if layer else None
  llama = ("bfloat16", "float32") if cast == "llama" else None
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=True)
  y, mean, rstd, h = glue.norm_forward(x, s, b, config=GLUE_FWD[fwd], residual=r,
                                       residual_dtype=jnp.bfloat16, cast=cast, **kw)
  want = lambda x, r, s, b: _fused_op(layer, "xla", residual=True, cast=cast,
                                      residual_dtype=jnp.bfloat16)(x, r, s, b)
  (y_w, h_w), pull = jax.vjp(want, x, r, s, b)
  assert (y.dtype, h.dtype) == (y_w.dtype, h_w.dtype)
  _res_close(y, y_w, ("bfloat16",), n, "y")
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_w, np.float32))
  rng = np.random.default_rng(3)
  dy = jnp.asarray(rng.standard_normal((m, n)), y.dtype)
  dh = jnp.asarray(rng.standard_normal((m, n)), h.dtype)
  dx, dres, ds, db = glue.norm_backward(
      dy, h, s, mean, rstd, has_bias=layer, scale_offset=0.0, subtract_mean=layer,
      config=GLUE_BWD[bwd], interpret=True, scale_dtype=s.dtype, bias_dtype=s.dtype, dh=dh,
      dx_dtype=jnp.bfloat16, residual_dtype=jnp.float32, cast=llama)
  assert (dx.dtype, dres.dtype) == (jnp.bfloat16, jnp.float32)
  for name, g, w in zip(("dx", "dres", "dscale", "dbias"), (dx, dres, ds, db),
                        pull((dy, dh))):
    if w is not None:
      _res_close(g, w, ("bfloat16",), m if name in ("dscale", "dbias") else n, name)


def test_glue_fused_dh_loaded_at_store(fake_jt4, monkeypatch):
  """Backward stage 1 with dh loaded at the store (``PREFETCH_DH`` off: tiles wider than
  the prefetch rule's), both backward paths."""
  monkeypatch.setattr(tk, "_PREFETCH_DH_MAX_BLOCK_N", 0)
  test_glue_fused_kernel_paths(fake_jt4, "persistent", "columns", "torch", True)
  test_glue_fused_kernel_paths(fake_jt4, "cached", "tile", "llama", False)


@pytest.mark.parametrize("layer,mode", [(False, "static_persistent"),
                                        (True, "multi_wave_reload")], ids=["rms", "ln"])
def test_glue_shard_fused(fake_jt4, layer, mode):
  """The tensor-parallel pair with a residual and cast="llama", one shard (its combines
  are then the identity): the statistics kernel writes h and takes h's statistics, the
  apply kernel adds again and rounds as Llama does, and the backward with given row
  sums adds dh and writes dresidual; against the xla formula."""
  del fake_jt4
  m, n, eps = 7, 300, 1e-5
  x, r, s, b = _res_inputs(m, n, "bfloat16", "float32", layer=layer)
  b = b if layer else None
  cfg = pn_config.forward_config(m, n, jnp.bfloat16, mode, _CPU, subtract_mean=layer,
                                 backend="triton")
  bcfg = pn_config.backward_config(m, n, jnp.bfloat16, _CPU, backend="triton")
  s1, s2, h = glue.norm_forward_stats(x, subtract_mean=layer, config=cfg, interpret=True,
                                      residual=r)
  mean, rstd = spmd._combine_stats(s1, s2, n=n, eps=eps, axes=(), groups=None)
  y = glue.norm_forward_apply(x, s, b, mean, rstd, scale_offset=0.0, config=cfg,
                              interpret=True, residual=r, cast="llama")
  want = lambda x, r, s, b: _fused_op(layer, "xla", residual=True, cast="llama")(x, r, s, b)
  (y_w, h_w), pull = jax.vjp(want, x, r, s, b)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(h_w))
  assert y.dtype == y_w.dtype == jnp.float32
  _res_close(y, y_w, ("bfloat16",), n, "y")
  rng = np.random.default_rng(4)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  dh = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  dx, dres, ds, db = glue.norm_backward(
      dy, h, s, mean if layer else None, rstd, has_bias=layer, scale_offset=0.0,
      subtract_mean=layer, config=bcfg, interpret=True, scale_dtype=s.dtype,
      bias_dtype=s.dtype, combine_row_sums=lambda c1, c2: (c1, c2), dh=dh,
      dx_dtype=jnp.bfloat16, residual_dtype=jnp.float32, cast=("bfloat16", "float32"))
  for name, g, w in zip(("dx", "dres", "dscale", "dbias"), (dx, dres, ds, db),
                        pull((dy, dh))):
    if w is not None:
      _res_close(g, w, ("bfloat16",), m if name in ("dscale", "dbias") else n, name)


@pytest.mark.parametrize("mode,layer,fp8_dtype,g", [
    ("multi_wave_cached", False, "float8_e4m3fn", 16),
    ("multi_wave_reload", True, "float8_e5m2", 32),
    ("static_persistent", True, "float8_e4m3fn", 16),
    ("static_persistent", False, "float8_e4m3fn", 64),
])
def test_glue_fp8_input(fake_jt4, mode, layer, fp8_dtype, g):
  """FP8 x with group scales through the Triton kernels (issue #27 item 1): y and the
  grads (dx in out_dtype, dscale, dbias) of jit(value_and_grad) against backend="xla"
  (dequantise, then the float32 norm); x_scale's cotangent is zero. A small block_n
  forces the chunked paths (multi_wave_reload; the backward's row statistics)."""
  del fake_jt4
  k = jax.random.split(jax.random.key(5), 4)
  m, n = 10, 192
  x8 = (2 * jax.random.normal(k[0], (m, n))).astype(getattr(jnp, fp8_dtype))
  xs = jax.random.uniform(k[1], (m, n // g), minval=0.25, maxval=2.0)
  s = 1 + 0.3 * jax.random.normal(k[2], (n,), jnp.float32)
  b = jax.random.normal(k[3], (n,), jnp.float32) if layer else None

  def loss(backend):
    def f(x8, xs, s, b):
      kw = dict(x_scale=xs, group_size=g, mode=mode, backend=backend)
      y = (pallas_norm.layer_norm(x8, s, b, **kw) if layer
           else pallas_norm.rms_norm(x8, s, **kw))
      assert y.dtype == jnp.bfloat16
      return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    return f

  args = (x8, xs, s, b)
  got = jax.jit(jax.value_and_grad(loss("triton"), (0, 1, 2, 3)))(*args)
  want = jax.value_and_grad(loss("xla"), (0, 1, 2, 3))(*args)
  assert got[1][0].dtype == jnp.bfloat16 and not np.asarray(got[1][1]).any()
  _assert_tree_close(got[0], want[0], rtol=1e-2, atol=1e-1)  # y in bf16 before the sum
  _assert_tree_close(got[1][0], want[1][0], rtol=2e-2, atol=2e-2)  # dx in bf16
  _assert_tree_close(got[1][2:], want[1][2:], rtol=2e-2, atol=2e-2)


def test_glue_fp8_input_tensor_parallel_pair(fake_jt4):
  """The tensor-parallel kernels with FP8 x: statistics and the normalise pass of the
  Triton backend against the Pallas backend's (interpret mode) on the same shard."""
  del fake_jt4
  from pallas_norm.kernels import forward as pallas_fwd
  k = jax.random.split(jax.random.key(6), 3)
  m, n, g = 9, 96, 16
  x8 = (2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn)
  xs = jax.random.uniform(k[1], (m, n // g), minval=0.25, maxval=2.0)
  s = 1 + 0.3 * jax.random.normal(k[2], (n,), jnp.float32)
  cfg = pn_config.ForwardConfig("multi_wave_reload", 4, 32, 4)
  for layer in (False, True):
    got = glue.norm_forward_stats(x8, subtract_mean=layer, config=cfg, interpret=True,
                                  x_scale=xs)
    want = pallas_fwd.norm_forward_stats(x8, subtract_mean=layer, config=cfg,
                                         interpret=True, x_scale=xs)
    for a, b_ in zip(got[:2], want[:2]):
      assert (a is None) == (b_ is None)
      if a is not None:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-5)
    mean = jnp.zeros(m) + 0.1 if layer else None
    rstd = jnp.full((m,), 0.7)
    y = glue.norm_forward_apply(x8, s, None, mean, rstd, scale_offset=0.0, config=cfg,
                                interpret=True, x_scale=xs, y_dtype=jnp.bfloat16)
    y_p = pallas_fwd.norm_forward_apply(x8, s, None, mean, rstd, scale_offset=0.0,
                                        config=cfg, interpret=True, x_scale=xs,
                                        y_dtype=jnp.dtype(jnp.bfloat16))
    assert y.dtype == y_p.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_p, np.float32))
