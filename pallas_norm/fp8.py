"""FP8 output: the quantising RMSNorm / LayerNorm, and the backward from saved statistics.

Issue #27 item 2 (COAT's ``_rms_norm_fwd_fused`` / ``fp8_rmsnorm_forward``, with
TransformerEngine's delayed and current scaling). The norm's float32 output ``y_f32``
(cast="torch" math: ``x_hat * (scale_offset + scale) + bias``, all float32) is quantised
directly to FP8 with one per-tensor scale (never rounded to bf16 first):

    amax    = max |y_f32| over the tensor                  (NaN propagates)
    y_scale = max(amax / fp8_max, 2**-126) if amax is finite and > 0, else 1  (current)
            = the caller's scale                                   (delayed scaling)
    inv     = 1 / y_scale                       (float32, computed once, multiplied)
    y       = saturate(y_f32 * inv).astype(fp8_dtype)       y ~= y.astype(f32) * y_scale
    y_t     = y.reshape(M, N).T                  (optional: the weight-gradient GEMM's)

``saturate`` clips to +-fp8_max and keeps NaN (+-Inf saturate); fp8_max is
``jnp.finfo(fp8_dtype).max``: 448 for float8_e4m3fn, 57344 for float8_e5m2. The scale
is the DEQUANTISATION scale (COAT's s_x, TransformerEngine's scale_inv, flax fp8_ops'
``scale``). The design and bytes model: docs/fp8.md, "FP8 output".

Backends: "xla" is the jnp chain (``reference.norm`` in float32, amax, quantise,
transpose), the oracle of the tests and the bench's baseline; "pallas" runs
``kernels/fp8.py`` (delayed scaling: one pass; current scaling: a statistics + amax pass
then a quantising pass).

``norm_backward`` is the library's two-stage deterministic backward (``ops._backward``
through ``spmd.backward``) from saved (mean, rstd): a fused norm -> FP8 dense layer owns
its custom_vjp and calls it for the norm's part.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_norm import config as _config
from pallas_norm import ops, reference, spmd, tuning

__all__ = ["Fp8Norm", "rms_norm_fp8", "layer_norm_fp8", "norm_backward", "FP8_DTYPES",
           "MIN_Y_SCALE", "fp8_max", "current_scale", "quantise"]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_BACKENDS = ("pallas", "xla")
_F32 = jnp.float32
MIN_Y_SCALE = float(np.finfo(np.float32).tiny)  # 2**-126: the smallest y_scale (1 / it is finite)


class Fp8Norm(NamedTuple):
  """The result of ``rms_norm_fp8`` / ``layer_norm_fp8``.

  Attributes:
    y: x's shape, fp8_dtype; ``y.astype(f32) * y_scale`` approximates the norm's output.
    y_scale: () float32, the dequantisation scale (the given one under delayed scaling).
    amax: () float32, max |y_f32| of this call, before quantisation (for an amax
      history); NaN if y_f32 has a NaN.
    y_t: [N, M] fp8_dtype, ``y.reshape(M, N).T`` (``transpose=True``), else None.
    mean: x.shape[:-1] float32 (zeros for RMSNorm), for a fused layer's backward.
    rstd: x.shape[:-1] float32.

  With ``stats=False`` (static scaling's y alone) amax, mean and rstd are None.
  """

  y: jax.Array
  y_scale: jax.Array
  amax: jax.Array
  y_t: jax.Array | None
  mean: jax.Array
  rstd: jax.Array


# --------------------------------------------------------------------------- FP8 math
# One copy, used by the jnp reference and (traced inside the kernels) by kernels/fp8.py,
# so that both take the same operations in the same order.


def fp8_max(fp8_dtype) -> float:
  """Largest finite value of ``fp8_dtype``: 448.0 (e4m3fn), 57344.0 (e5m2)."""
  return float(jnp.finfo(fp8_dtype).max)


def current_scale(amax, fp8_dtype):
  """Current scaling's y_scale from this call's amax (() f32): amax / fp8_max when amax
  is finite and > 0, else 1.0 (TransformerEngine's rule for an all-zero or non-finite
  amax), and never below float32's smallest normal 2**-126: an amax under fp8_max *
  2**-126 (about 5.3e-36 for e4m3fn) would give a subnormal scale, flushed to 0 on the
  GPU, whose reciprocal (the quantiser's multiplier) is inf and turns exact zeros into
  NaN. At the floor every |y| <= amax still quantises within fp8_max."""
  amax = jnp.asarray(amax, _F32)
  ok = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(ok, jnp.maximum(amax / _F32(fp8_max(fp8_dtype)), _F32(MIN_Y_SCALE)),
                   _F32(1.0))


def quantise(v, inv, fp8_dtype):
  """``clip(v * inv, -fp8_max, fp8_max).astype(fp8_dtype)`` for float32 ``v`` and
  ``inv`` (= 1 / scale), NaN kept: the clip is two selects on comparisons, which NaN
  fails (a ``jnp.clip`` in a Triton kernel lowers to minnum/maxnum, which would turn NaN
  into -fp8_max). +-Inf saturate to +-fp8_max."""
  hi = fp8_max(fp8_dtype)  # a Python float (weakly typed: the selects stay float32)
  q = v * inv
  q = jnp.where(q > hi, hi, q)
  q = jnp.where(q < -hi, -hi, q)
  return q.astype(fp8_dtype)


# --------------------------------------------------------------------------- checks


@dataclasses.dataclass(frozen=True)
class _Fp8Static:
  """Hashable non-array arguments of one quantising norm."""

  eps: float
  scale_offset: float
  subtract_mean: bool
  fp8_dtype: str
  transpose: bool
  delayed: bool
  backend: str
  interpret: bool
  yt_lead: bool = False  # y_t as [N, *x.shape[:-1]] (the FP8 dense layer's), not [N, M]
  tables: tuple = ()  # tuning.context(): a change of the tables' answers traces again
  residual_dtype: str | None = None  # residual=: h's dtype name (None: no residual)
  stats: bool = True  # False: y (y_t, h) alone; amax, mean and rstd None


def _check_backend(op: str, mode, backend: str) -> None:
  if mode is not None and mode not in _config.MODES:
    raise ValueError(f"{op}: {mode=} is not a valid mode; valid modes: {_config.MODES} or None")
  if mode is not None:
    raise NotImplementedError(
        f"{op}: {mode=} is not served: the quantising kernels have their own structure "
        f"(kernels/fp8.py: delayed scaling one pass over tall row blocks, current scaling "
        f"a statistics pass then an elementwise quantising pass); pass mode=None")
  if backend not in FP8_BACKENDS:
    if backend in ops.BACKENDS:
      raise NotImplementedError(f"{op}: {backend=} is not served; the FP8-output backends "
                                f"are {FP8_BACKENDS}")
    raise ValueError(f"{backend=} is not a valid backend; valid backends: {FP8_BACKENDS}")


def _check_fp8_dtype(op: str, fp8_dtype) -> jnp.dtype:
  if fp8_dtype is None:  # jnp.dtype(None) is float64: name what was given
    raise TypeError(f"{op}: fp8_dtype=None must be float8_e4m3fn or float8_e5m2")
  try:
    dt = jnp.dtype(fp8_dtype)
  except TypeError as e:
    raise TypeError(f"{op}: {fp8_dtype=} is not a dtype") from e
  if dt not in FP8_DTYPES:
    raise TypeError(f"{op}: fp8_dtype={dt} must be float8_e4m3fn or float8_e5m2")
  return dt


def _check_y_scale(op: str, y_scale):
  """y_scale as a () float32 array, or None (current scaling)."""
  if y_scale is None:
    return None
  if isinstance(y_scale, (bool, np.bool_)):
    raise TypeError(f"{op}: y_scale must be a float32 scalar, got a bool")
  if isinstance(y_scale, str):
    raise TypeError(f"{op}: y_scale must be a float32 scalar, got a str ({y_scale!r})")
  if isinstance(y_scale, (int, float)):  # a Python number: weakly typed, taken as f32
    y_scale = jnp.asarray(y_scale, _F32)
  dt = jnp.result_type(y_scale)
  if dt != jnp.dtype(_F32):
    raise TypeError(f"{op}: y_scale.dtype={dt} must be float32 (a dequantisation scale, "
                    f"as TransformerEngine and flax fp8_ops keep it)")
  if jnp.shape(y_scale) != ():
    raise ValueError(f"{op}: y_scale.shape={jnp.shape(y_scale)} must be () (one "
                     f"per-tensor scale; reshape a (1,) scale with .reshape(()))")
  y_scale = jnp.asarray(y_scale)
  if not isinstance(y_scale, jax.core.Tracer):
    v = float(y_scale)
    if not (math.isfinite(v) and v > 0):
      raise ValueError(f"{op}: y_scale={v} must be finite and > 0")
    if v < MIN_Y_SCALE:  # 1 / y_scale would overflow (or y_scale be flushed to 0)
      raise ValueError(f"{op}: y_scale={v} is below float32's smallest normal "
                       f"({MIN_Y_SCALE:.7g}): its reciprocal, the quantiser's multiplier, "
                       f"is inf or imprecise, and an exact 0 in y would quantise to NaN")
  return y_scale


def _check(op, x, scale, bias, *, eps, y_scale, fp8_dtype, transpose, mode, backend,
           residual=None, residual_dtype=None, stats=True):
  """(fp8 dtype, y_scale, h's dtype name or None): every error before any kernel."""
  _check_backend(op, mode, backend)
  ops._check_args(op, x, scale, bias, eps, None, "pallas")
  dt = _check_fp8_dtype(op, fp8_dtype)
  if not isinstance(transpose, (bool, np.bool_)):
    raise TypeError(f"{op}: transpose must be a bool, got {type(transpose).__name__}")
  _, h_dtype = ops._check_residual(op, x, residual, residual_dtype)
  y_scale = _check_y_scale(op, y_scale)
  if not isinstance(stats, (bool, np.bool_)):
    raise TypeError(f"{op}: stats must be a bool, got {type(stats).__name__}")
  if not stats and y_scale is None:
    raise ValueError(f"{op}: stats=False (y alone: no amax, mean or rstd) needs a given "
                     f"y_scale; current scaling (y_scale=None) scales y by its amax")
  if residual is not None and y_scale is None:
    raise ValueError(f"{op}: residual= is served with a given y_scale (delayed or static "
                     f"scaling: one pass); current scaling (y_scale=None) reads x twice: "
                     f"pass y_scale, or call rms_norm / layer_norm with residual= first")
  if backend != "xla":
    ops._check_concrete_shape(op, x, backend)
  return dt, y_scale, h_dtype


# --------------------------------------------------------------------------- backends


def _xla(x, scale, bias, y_scale, st: _Fp8Static, residual=None):
  """The jnp chain: reference norm in float32, amax, scale, quantise, transpose; with a
  residual, of h = x + residual in float32, and h (in its dtype) after the Fp8Norm."""
  if residual is not None:
    h = x.astype(_F32) + residual.astype(_F32)
    return _xla(h, scale, bias, y_scale, dataclasses.replace(st, residual_dtype=None)), \
        h.astype(st.residual_dtype)
  n = x.shape[-1]
  dt = jnp.dtype(st.fp8_dtype)
  y, mean, rstd = reference.norm(x.astype(_F32), scale, bias, eps=st.eps,
                                 scale_offset=st.scale_offset,
                                 subtract_mean=st.subtract_mean)  # y [..., N] f32
  amax = jnp.max(jnp.abs(y))
  if y_scale is None:
    y_scale = current_scale(amax, dt)
  q = quantise(y, _F32(1.0) / y_scale, dt)
  y_t = None
  if st.transpose:
    y_t = jnp.moveaxis(q, -1, 0) if st.yt_lead else q.reshape(-1, n).T
  return _stats_only_if(Fp8Norm(q, y_scale, amax, y_t, mean, rstd), st)


def _stats_only_if(out: Fp8Norm, st: _Fp8Static) -> Fp8Norm:
  """``out`` (an Fp8Norm of values or of their specs) as the call returns it: amax, mean
  and rstd None with ``stats=False``."""
  return out if st.stats else out._replace(amax=None, mean=None, rstd=None)


def _pallas(x, scale, bias, y_scale, st: _Fp8Static, rows=(), hidden=(), residual=None):
  """The kernels on x [..., n] (one device's shard). ``rows``: the mesh axes that shard
  x's rows; ``hidden``: those that shard its last dim (tensor parallel: x, scale and
  bias hold the shard's n columns). The tensor amax is a ``pmax`` over both (of the
  amax's int32 bits, so that a NaN on any device wins, as in ``reduce_amax``) before
  current scaling uses it. With a residual (delayed scaling; rows only): (Fp8Norm, h).

  Without ``st.stats``: y (y_t, h) alone from the one-pass kernel, no amax (no pmax).

  Raises:
    NotImplementedError: a residual, or stats=False, with the hidden dim sharded.
  """
  from pallas_norm.kernels import fp8 as _kernels
  n, lead = x.shape[-1], x.shape[:-1]
  h = None
  if (residual is not None or not st.stats) and hidden:
    op = "layer_norm_fp8" if st.subtract_mean else "rms_norm_fp8"
    what = "residual=" if residual is not None else "stats=False"
    raise NotImplementedError(
        f"{op}({what}) with x's last dim sharded over {tuple(hidden)} (tensor "
        f"parallel) is not served yet: shard the rows"
        + (", or call rms_norm / layer_norm with residual= and quantise its y"
           if residual is not None else ", or pass stats=True"))
  dt = jnp.dtype(st.fp8_dtype)
  x2 = x.reshape(-1, n)
  kw = dict(scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
            interpret=st.interpret)
  q = dict(fp8_dtype=dt, transpose=st.transpose)
  axes = tuple(rows) + tuple(hidden)

  def amax_of(bits):
    bits = jnp.max(bits)
    return _kernels.reduce_amax(jax.lax.pmax(bits, axes) if axes else bits)

  if hidden:  # whole-row statistics from the shards' partial sums, then apply passes
    mean, rstd = _tp_stats(x2, st, hidden)
    if y_scale is None:  # the amax pass (reads x again), then the quantise pass
      amax = amax_of(_kernels.fp8_tile_amax(x2, scale, bias, mean, rstd, **kw))
      y_scale = current_scale(amax, dt)
      y, y_t = _kernels.fp8_quantise(x2, scale, bias, mean, rstd, _F32(1.0) / y_scale,
                                     **kw, **q)
    else:  # one apply pass: quantise and the amax
      y, y_t, bits = _kernels.fp8_quantise(x2, scale, bias, mean, rstd,
                                           _F32(1.0) / y_scale, **kw, **q, return_amax=True)
      amax = amax_of(bits)
  elif y_scale is None:  # pass 1: statistics and row amax; pass 2: quantise
    mean, rstd, row_amax = _kernels.fp8_stats(x2, scale, bias, eps=st.eps, **kw)
    amax = amax_of(row_amax)
    y_scale = current_scale(amax, dt)
    y, y_t = _kernels.fp8_quantise(x2, scale, bias, mean, rstd, _F32(1.0) / y_scale,
                                   **kw, **q)
  else:  # one pass; y_t from it, or XLA's transpose of y where that is faster
    sep = st.transpose and _kernels.transpose_separately(
        st.interpret, x2.shape, x2.dtype, st.subtract_mean,
        None if scale is None and bias is None else (scale if scale is not None
                                                     else bias).dtype)
    res = {} if residual is None else dict(residual=residual.reshape(-1, n),
                                           residual_dtype=jnp.dtype(st.residual_dtype))
    outs = _kernels.fp8_norm_delayed(
        x2, scale, bias, _F32(1.0) / y_scale, eps=st.eps, **kw,
        fp8_dtype=dt, transpose=st.transpose and not sep, stats=st.stats, **res)
    if st.stats:
      y, y_t, mean, rstd, row_amax, *hs = outs
      amax = amax_of(row_amax)
    else:
      (y, y_t, *hs), mean, rstd, amax = outs, None, None, None
    h = hs[0] if hs else None
    if sep:
      y_t = y.T
  if y_t is not None and st.yt_lead:  # [N, M] -> [N, *lead]: the same bytes
    y_t = y_t.reshape(n, *lead)
  out = Fp8Norm(y.reshape(x.shape), y_scale, amax, y_t,
                None if mean is None else mean.reshape(lead),
                None if rstd is None else rstd.reshape(lead))
  return out if h is None else (out, h.reshape(x.shape))


def _tp_stats(x2, st: _Fp8Static, hidden):
  """(mean [M] f32 (zeros for RMSNorm), rstd [M] f32) of the whole rows of which x2
  [M, n] holds n columns: the forward's shard-statistics kernel (RMSNorm: sum of
  squares; LayerNorm: the shard's mean and M2), then spmd's all-reduce over ``hidden``
  (Chan et al.'s combination for LayerNorm), as ``pallas_norm.layer_norm`` does."""
  from pallas_norm.kernels import forward as _forward
  m, n = x2.shape
  cfg = _config.forward_config(m, n, x2.dtype, None, subtract_mean=st.subtract_mean)
  s1, s2 = _forward.norm_forward_stats(x2, subtract_mean=st.subtract_mean, config=cfg,
                                       interpret=st.interpret)
  mean, rstd = spmd._combine_stats(s1, s2, n=n, eps=st.eps, axes=hidden, groups=None)
  return (jnp.zeros((m,), _F32) if mean is None else mean), rstd


# ------------------------------------------------------------ sharded x (spmd.py's way)
# Rows sharded (data / sequence parallel): each device quantises its own rows. Hidden
# dim sharded (tensor parallel; scale and bias laid out like it): the shard-statistics
# kernel, an all-reduce of [M_local] floats, then the apply passes (delayed: quantise
# and amax in one; current: an amax pass, then quantise). The amax (and so current
# scaling's y_scale) is global: a pmax over every axis that shards x. Explicit meshes:
# shard_map with the specs of x's type; Auto meshes: custom_partitioning, whose rule
# picks the same specs.


def _fp8_plan(mesh, x_shape, x_sharding, st: _Fp8Static):
  """(x spec, row spec, param spec, y_t spec or None, row axes, hidden axes) of x
  sharded by ``x_sharding``; ValueError for the layouts the FP8 ops do not serve."""
  op = "layer_norm_fp8" if st.subtract_mean else "rms_norm_fp8"
  spec, row_spec, p_spec, rows, hidden = spmd._plan(mesh, x_shape, x_sharding)
  yt_spec = None
  if st.transpose and st.yt_lead:  # [N, *lead]: laid out like x, any row layout
    yt_spec = P(tuple(spec)[-1], *tuple(spec)[:-1])
  elif st.transpose:
    sharded = [d for d, e in enumerate(tuple(spec)[:-1]) if spmd._axes(e)]
    if sharded not in ([], [0]):
      raise ValueError(
          f"{op}(transpose=True): x of shape {tuple(x_shape)} is sharded {spec}; the "
          f"transposed copy y_t [N, M] is served when at most the first dimension of x "
          f"is sharded (data parallel): then each device's rows are one contiguous "
          f"block of M. Shard the first dimension only, or pass transpose=False")
    yt_spec = P(tuple(spec)[-1], tuple(spec)[0] if sharded else None)
  return spec, row_spec, p_spec, yt_spec, rows, hidden


def _fp8_out_specs(spec, row_spec, yt_spec, st: _Fp8Static):
  """The outputs' specs: Fp8Norm's (None for its absent fields), then h's (laid out like
  x) with a residual."""
  specs = _stats_only_if(Fp8Norm(spec, P(), P(), yt_spec, row_spec, row_spec), st)
  return tuple(specs) + ((spec,) if st.residual_dtype else ())


def _flat(out, st: _Fp8Static) -> tuple:
  """``_pallas``'s result as a flat tuple: Fp8Norm's fields, then h with a residual."""
  return (*out[0], out[1]) if st.residual_dtype else tuple(out)


def _unflat(outs, st: _Fp8Static):
  """``_flat``'s inverse: Fp8Norm, or (Fp8Norm, h) with a residual."""
  if st.residual_dtype:
    return Fp8Norm(*outs[:6]), outs[6]
  return Fp8Norm(*outs)


def _fp8_cp_impl(x, scale, bias, y_scale, residual, st):
  return _flat(_pallas(x, scale, bias, y_scale, st, residual=residual), st)


def _fp8_cp_partition(st, mesh, arg_shapes, result_shape):
  del result_shape
  x_shape, scale, bias, y_scale, residual = arg_shapes
  spec, row_spec, p_spec, yt_spec, rows, hidden = _fp8_plan(mesh, x_shape.shape,
                                                            x_shape.sharding, st)
  named = lambda s: None if s is None else NamedSharding(mesh, s)
  if residual is not None:
    spmd._same_layout(mesh, x_shape, residual, "residual")

  def lower(x, scale, bias, y_scale, residual):
    return _flat(_pallas(x, scale, bias, y_scale, st, rows, hidden, residual), st)

  args = (named(spec), named(None if scale is None else p_spec),
          named(None if bias is None else p_spec), named(None if y_scale is None else P()),
          named(None if residual is None else spec))
  return mesh, lower, tuple(map(named, _fp8_out_specs(spec, row_spec, yt_spec, st))), args


def _fp8_cp_infer(st, mesh, arg_shapes, result_shape):
  del result_shape
  spec, row_spec, _, yt_spec, _, _ = _fp8_plan(mesh, arg_shapes[0].shape,
                                               arg_shapes[0].sharding, st)
  return tuple(None if s is None else NamedSharding(mesh, s)
               for s in _fp8_out_specs(spec, row_spec, yt_spec, st))


def _fp8_cp_rule(st, mesh, operand_types, result_types):
  del mesh, result_types
  lead = spmd._letters(len(operand_types[0].shape))
  ops = [f"{lead} n"] + [f"{lead} n" if len(t.shape) > 1 else "n" if len(t.shape) == 1
                         else "" for t in operand_types[1:]]
  rows = f"({lead})" if " " in lead else lead  # y_t's M: the leading dims flattened
  yt = f"n {lead}" if st.yt_lead else f"n {rows}"
  res = ([f"{lead} n", ""] + ([""] if st.stats else []) + ([yt] if st.transpose else [])
         + ([lead, lead] if st.stats else []) + ([f"{lead} n"] if st.residual_dtype else []))
  return f"{', '.join(ops)} -> {', '.join(res)}"


_fp8_cp = custom_partitioning(_fp8_cp_impl, static_argnums=(5,))
_fp8_cp.def_partition(partition=_fp8_cp_partition, infer_sharding_from_operands=_fp8_cp_infer,
                      sharding_rule=_fp8_cp_rule)


def _pallas_sharded(x, scale, bias, y_scale, st: _Fp8Static, residual=None):
  """``_pallas`` wherever x lives: one device, an Explicit mesh or an Auto mesh."""
  if x.ndim < 2:  # one row
    return _pallas(x, scale, bias, y_scale, st, residual=residual)
  explicit = spmd._explicit_sharding(x)
  if explicit is not None:
    mesh, sharding = explicit
    spec, row_spec, p_spec, yt_spec, rows, hidden = _fp8_plan(mesh, x.shape, sharding, st)
    scale, bias = (spmd._reshard(p, mesh, p_spec) for p in (scale, bias))
    y_scale = spmd._reshard(y_scale, mesh, P())
    residual = spmd._explicit_like(residual, mesh, spec, "residual")
    out = spmd._shard_map(
        lambda x, s, b, ys, r: _flat(_pallas(x, s, b, ys, st, rows, hidden, r), st), mesh,
        (x, scale, bias, y_scale, residual), (spec, p_spec, p_spec, P(), spec),
        _fp8_out_specs(spec, row_spec, yt_spec, st))
    return _unflat(out, st)
  if jax.device_count() > 1:
    out = spmd._unbatched(lambda x, s, b, ys, r: _fp8_cp(x, s, b, ys, r, st),
                          lambda x, s, b, ys, r: _flat(_pallas(x, s, b, ys, st, residual=r),
                                                       st),
                          x, scale, bias, y_scale, residual)
    return _unflat(out, st)
  return _pallas(x, scale, bias, y_scale, st, residual=residual)


def _empty(x, y_scale, st: _Fp8Static, residual=None):
  """M == 0: empty y (and y_t [N, 0], or [N, *lead]); amax 0, y_scale 1 (current) or
  the given one; an empty h with a residual."""
  n, lead = x.shape[-1], x.shape[:-1]
  dt = jnp.dtype(st.fp8_dtype)
  amax = jnp.zeros((), _F32)
  yt_shape = (n, *lead) if st.yt_lead else (n, 0)
  out = _stats_only_if(Fp8Norm(
      jnp.zeros(x.shape, dt), current_scale(amax, dt) if y_scale is None else y_scale,
      amax, jnp.zeros(yt_shape, dt) if st.transpose else None, jnp.zeros(lead, _F32),
      jnp.zeros(lead, _F32)), st)
  return out if residual is None else (out, jnp.zeros(x.shape, st.residual_dtype))


def _dispatch(x, scale, bias, y_scale, residual, st: _Fp8Static):
  if math.prod(x.shape[:-1]) == 0:
    return _empty(x, y_scale, st, residual)
  return (_xla if st.backend == "xla" else _pallas_sharded)(x, scale, bias, y_scale, st,
                                                             residual=residual)


# Not differentiable: FP8 values have no useful cotangent. A fused layer (item 3 of the
# issue) owns the vjp of norm -> quantise -> matmul and calls norm_backward.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fp8_norm(x, scale, bias, y_scale, residual, st: _Fp8Static):
  return _dispatch(x, scale, bias, y_scale, residual, st)


def _fp8_norm_fwd(x, scale, bias, y_scale, residual, st: _Fp8Static):
  return _dispatch(x, scale, bias, y_scale, residual, st), None


def _fp8_norm_bwd(st: _Fp8Static, res, ct):
  del res, ct
  op = "layer_norm_fp8" if st.subtract_mean else "rms_norm_fp8"
  raise TypeError(
      f"{op} is not differentiable: its output is quantised to FP8. Differentiate a "
      f"layer that owns the quantisation's vjp (pallas_norm's fused norm -> FP8 dense "
      f"layer, whose backward is pallas_norm.fp8.norm_backward), or use "
      f"pallas_norm.rms_norm / layer_norm")


_fp8_norm.defvjp(_fp8_norm_fwd, _fp8_norm_bwd)
_fp8_norm_jit = jax.jit(_fp8_norm, static_argnums=(5,))


def _norm_fp8(op, x, scale, bias, *, eps, y_scale, fp8_dtype, transpose, scale_offset,
              subtract_mean, mode, backend, interpret, yt_lead=False, residual=None,
              residual_dtype=None, stats=True):
  """The public ops' body. ``yt_lead`` (the FP8 dense layer's): y_t as [N, *lead], the
  bytes of [N, M] with x's row dims kept, so that it is served for every row sharding
  (sequence parallel too) and contracted over those dims by the weight-gradient GEMM.
  Returns an Fp8Norm, or (Fp8Norm, h) with a residual."""
  dt, y_scale, h_dtype = _check(op, x, scale, bias, eps=eps, y_scale=y_scale,
                                fp8_dtype=fp8_dtype, transpose=transpose, mode=mode,
                                backend=backend, residual=residual,
                                residual_dtype=residual_dtype, stats=stats)
  st = _Fp8Static(float(eps), float(scale_offset), subtract_mean, dt.name, bool(transpose),
                  y_scale is not None, backend, ops._resolve_interpret(interpret),
                  bool(yt_lead), tuning.context(), h_dtype, bool(stats))
  return _fp8_norm_jit(jnp.asarray(x), scale, bias, y_scale,
                       None if residual is None else jnp.asarray(residual), st)


# --------------------------------------------------------------------------- public ops


def rms_norm_fp8(x, scale=None, *, y_scale=None, fp8_dtype=jnp.float8_e4m3fn,
                 transpose=False, eps=None, scale_offset=0.0, mode=None, backend="pallas",
                 interpret=None, residual=None, residual_dtype=None, stats=True):
  """RMSNorm over the last axis with its output quantised to FP8 (COAT's
  ``fp8_rmsnorm_forward``; TransformerEngine's RMSNorm with an FP8 output).

  ``y_f32 = x / sqrt(mean(x**2) + eps) * (scale_offset + scale)`` in float32 (as
  ``pallas_norm.rms_norm``, cast="torch"), then quantised with one per-tensor scale:
  ``y = saturate(y_f32 / y_scale)`` in ``fp8_dtype`` (module docstring). Not
  differentiable (``jax.grad`` raises TypeError): a fused layer owns the vjp and calls
  ``norm_backward`` with the returned mean and rstd.

  Args:
    x: [..., N] float32, bfloat16 or float16, rank >= 1; M = prod(x.shape[:-1]).
    scale: [N] float array or None.
    y_scale: None for current scaling (this call's amax / fp8_max), or delayed scaling's
      dequantisation scale: a float32 scalar (a () array, or a Python float or int,
      taken as float32), finite and >= float32's smallest normal 2**-126 (checked when
      concrete: below it 1 / y_scale overflows), e.g. from an amax history.
    fp8_dtype: jnp.float8_e4m3fn (default; fp8_max 448) or jnp.float8_e5m2 (57344).
    transpose: also return ``y_t = y.reshape(M, N).T`` [N, M], written by the same
      kernel pass as y (the weight-gradient GEMM's operand).
    eps: None means ``jnp.finfo(jnp.float32).eps``, as ``rms_norm``.
    scale_offset: y = x_hat * (scale_offset + scale).
    mode: None only (the kernels have their own structure, kernels/fp8.py); a mode name
      raises NotImplementedError.
    backend: "pallas" (default: kernels/fp8.py) or "xla" (the jnp chain).
    interpret: None runs Pallas interpret mode when there is no GPU; True/False force it.
    residual: None, or an array of x's shape (float32, bfloat16 or float16), with a
      given ``y_scale``: the fused residual add before the quantising norm (vLLM's
      ``fused_add_rms_norm_static_fp8_quant``, W8A8 serving): the op normalises and
      quantises ``h = x + residual`` (summed in float32; y from that sum) and also
      returns h, in ``residual_dtype`` (default: residual's), from the same one pass
      (Pallas: one program a row block). Rows may be sharded, not the hidden dim.
    residual_dtype: h's dtype (float32, bfloat16 or float16); only with a residual.
    stats: True (default) also computes amax, mean and rstd; False, with a given
      ``y_scale``: y (y_t, h) alone, amax, mean and rstd neither computed nor written
      (None in the Fp8Norm): W8A8 serving's static quantisation, whose caller reads y
      alone (vLLM's ``rms_norm_static_fp8_quant``; a kernel's outputs cannot be dropped
      under jit). Pallas: the one-pass kernel on its own config, without those
      stores. Rows may be sharded, not the hidden dim.

  Returns:
    Fp8Norm(y [..., N] fp8_dtype, y_scale () f32, amax () f32, y_t [N, M] fp8_dtype or
    None, mean [...] f32 (zeros), rstd [...] f32); ``(Fp8Norm, h)`` with a residual;
    amax, mean and rstd None with ``stats=False``.

  Raises:
    ValueError: rank 0, N == 0, a scale shape other than (N,), eps < 0, a y_scale that is
      not () or (concrete) not finite and >= 2**-126, an unknown mode or backend; under a
      multi-device jit (rows and the hidden dim may be sharded; the amax is a pmax over
      every axis that shards x; docs/fp8.md "Multi-device"), a dimension sharded
      unevenly, or transpose=True with a row dimension other than the first sharded
      (on an Auto mesh XLA's compilation reports these as a jax.errors.JaxRuntimeError
      carrying the same message); a residual without y_scale, of another shape than x,
      or sharded unlike x; a residual_dtype without a residual; stats=False without
      y_scale.
    TypeError: integer or complex x or scale, x not float32/bfloat16/float16, fp8_dtype
      not float8_e4m3fn/float8_e5m2, y_scale not float32, a non-bool transpose or
      stats; jax.grad through it.
    NotImplementedError: a mode name, or backend="triton"; a residual or stats=False
      with x's hidden dim sharded (tensor parallel).
  """
  if eps is None:
    eps = float(jnp.finfo(jnp.float32).eps)
  return _norm_fp8("rms_norm_fp8", x, scale, None, eps=eps, y_scale=y_scale,
                   fp8_dtype=fp8_dtype, transpose=transpose, scale_offset=scale_offset,
                   subtract_mean=False, mode=mode, backend=backend, interpret=interpret,
                   residual=residual, residual_dtype=residual_dtype, stats=stats)


def layer_norm_fp8(x, scale=None, bias=None, *, y_scale=None, fp8_dtype=jnp.float8_e4m3fn,
                   transpose=False, eps=1e-5, scale_offset=0.0, mode=None, backend="pallas",
                   interpret=None, residual=None, residual_dtype=None, stats=True):
  """LayerNorm over the last axis with its output quantised to FP8 (TransformerEngine's
  LayerNorm with an FP8 output).

  ``y_f32 = (x - mean) / sqrt(var + eps) * (scale_offset + scale) + bias`` in float32
  (as ``pallas_norm.layer_norm``), quantised as in ``rms_norm_fp8``.

  Args:
    x, scale, y_scale, fp8_dtype, transpose, scale_offset, mode, backend, interpret,
      residual, residual_dtype, stats: as in ``rms_norm_fp8``.
    bias: [N] float array or None.
    eps: added to the variance (default 1e-5, torch's; None means the same).

  Returns:
    Fp8Norm, as in ``rms_norm_fp8``; mean is the rows' mean; ``(Fp8Norm, h)`` with a
    residual.

  Raises:
    ValueError, TypeError, NotImplementedError: as in ``rms_norm_fp8``.
  """
  if eps is None:
    eps = 1e-5
  return _norm_fp8("layer_norm_fp8", x, scale, bias, eps=eps, y_scale=y_scale,
                   fp8_dtype=fp8_dtype, transpose=transpose, scale_offset=scale_offset,
                   subtract_mean=True, mode=mode, backend=backend, interpret=interpret,
                   residual=residual, residual_dtype=residual_dtype, stats=stats)


# --------------------------------------------------------------------------- backward


def _xla_backward(dy, x, scale, bias, mean, rstd, *, subtract_mean, scale_offset):
  """ops.py's backward math in jnp, from the saved statistics."""
  n = x.shape[-1]
  xf, g = x.astype(_F32), dy.astype(_F32)
  if subtract_mean:
    xf = xf - mean[..., None]
  x_hat = xf * rstd[..., None]  # [..., N] f32
  dyf = g
  if scale is not None:
    g = g * (_F32(scale_offset) + scale.astype(_F32))
  c1 = jnp.sum(x_hat * g, axis=-1, keepdims=True) / n
  c2 = jnp.sum(g, axis=-1, keepdims=True) / n if subtract_mean else 0.0
  dx = ((g - (x_hat * c1 + c2)) * rstd[..., None]).astype(x.dtype)
  rows = tuple(range(x.ndim - 1))
  dscale = None if scale is None else jnp.sum(dyf * x_hat, axis=rows).astype(scale.dtype)
  dbias = None if bias is None else jnp.sum(dyf, axis=rows).astype(bias.dtype)
  return dx, dscale, dbias


def _backward(dy, x, scale, bias, mean, rstd, st: ops._Static):
  if st.backend == "xla":
    return _xla_backward(dy, x, scale, bias, mean, rstd, subtract_mean=st.subtract_mean,
                         scale_offset=st.scale_offset)
  if x.ndim == 1:
    dx, dscale, dbias = _backward(dy[None], x[None], scale, bias,
                                  None if mean is None else mean[None], rstd[None], st)
    return dx[0], dscale, dbias
  dx, _, dscale, dbias = spmd.backward(ops._backward, dy, x, scale, bias, mean, rstd, st)
  return dx, dscale, dbias


_backward_jit = jax.jit(_backward, static_argnums=(6,))


def norm_backward(dy, x, scale, bias, mean, rstd, *, subtract_mean, scale_offset=0.0,
                  mode=None, backend="pallas", interpret=None):
  """The norm's backward from the statistics its forward saved: pallas_norm's
  deterministic two-stage backward (stage 1 dx and per-program dscale/dbias partials,
  stage 2 their fixed-order sum; ops.py's module docstring gives the math), the one
  ``jax.vjp`` of ``rms_norm`` / ``layer_norm`` runs.

  For a fused layer that quantises the norm's output (``rms_norm_fp8``): it keeps
  (x, mean, rstd) from the forward and calls this with the cotangent of y_f32.

  Args:
    dy: x's shape, a float dtype: the cotangent of the norm's output; cast to x's dtype
      (the dtype the norm's own vjp receives it in).
    x: [..., N] float32, bfloat16 or float16, rank >= 1: the norm's input.
    scale: [N] or None; bias: [N] or None (LayerNorm; only whether it is there matters).
    mean: x.shape[:-1] float32 (LayerNorm; ignored, and may be None, for RMSNorm).
    rstd: x.shape[:-1] float32.
    subtract_mean: True for LayerNorm, False for RMSNorm.
    scale_offset: as in the forward.
    mode: None or a mode name; as in ``rms_norm``'s vjp, the backward kernels have one
      structure whatever the forward's mode, so it only is validated.
    backend: as in ``rms_norm``: "pallas" (default), "triton", "mosaic", "xla" (the
      same math in jnp) or None (the measured pick).
    interpret: as in ``rms_norm``.

  Returns:
    (dx [..., N] x.dtype, dscale [N] scale.dtype or None, dbias [N] bias.dtype or None).

  Raises:
    ValueError: shapes that do not match x (dy, scale, bias, mean, rstd), rank 0, N == 0,
      an unknown mode or backend, LayerNorm without a mean.
    TypeError: non-float dy, x, scale or bias; mean or rstd not float32.
  """
  op = "norm_backward"
  ops._check_args(op, x, scale, bias, 0.0, mode, backend)
  ops._check_float("dy", dy, op)
  if not isinstance(subtract_mean, (bool, np.bool_)):
    raise TypeError(f"{op}: subtract_mean must be a bool, got {subtract_mean!r}")
  if tuple(jnp.shape(dy)) != tuple(jnp.shape(x)):
    raise ValueError(f"{op}: dy.shape={tuple(jnp.shape(dy))} must equal "
                     f"x.shape={tuple(jnp.shape(x))}")
  lead = tuple(jnp.shape(x))[:-1]
  stats = (("mean", mean), ("rstd", rstd)) if subtract_mean else (("rstd", rstd),)
  for name, a in stats:
    if a is None:
      raise ValueError(f"{op}: {name} is None; " + (
          "LayerNorm's backward (subtract_mean=True) needs the saved mean and rstd"
          if subtract_mean else "RMSNorm's backward needs the saved rstd"))
    if tuple(jnp.shape(a)) != lead:
      raise ValueError(f"{op}: {name}.shape={tuple(jnp.shape(a))} must be x.shape[:-1]"
                       f"={lead}")
    if jnp.result_type(a) != jnp.dtype(_F32):
      raise TypeError(f"{op}: {name}.dtype={jnp.result_type(a)} must be float32")
  x = jnp.asarray(x)
  dy = jnp.asarray(dy).astype(x.dtype)
  mean = jnp.asarray(mean) if subtract_mean else None
  if math.prod(lead) == 0:
    zeros = lambda p: None if p is None else jnp.zeros(p.shape, p.dtype)
    return jnp.zeros(x.shape, x.dtype), zeros(scale), zeros(bias)
  st = ops._Static(0.0, float(scale_offset), bool(subtract_mean), mode, backend,
                   ops._resolve_interpret(interpret))
  return _backward_jit(dy, x, scale, bias, mean, jnp.asarray(rstd), st)
