"""Public functional ops: argument checks, backend dispatch and the custom_vjp.

RMSNorm and LayerNorm are one op with a static ``subtract_mean`` flag, as in tokamax.
Order: checks -> forward launcher -> custom_vjp rules -> public ops.

Backward math (per row, x_hat = (x - mean) * rstd, w = scale_offset + scale,
g = dy * w, N = row length):

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N                      (LayerNorm; 0 for RMSNorm)
    dx = (g - (x_hat * c1 + c2)) * rstd
    dscale = sum_rows(dy * x_hat)        dbias = sum_rows(dy)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm import config as _config
from pallas_norm import tuning as _tuning
from pallas_norm import reference, spmd
from pallas_norm.kernels._compat import to_varying, varying_axes

__all__ = ["rms_norm", "layer_norm", "BACKENDS", "GROUP_SIZES"]

BACKENDS = ("pallas", "triton", "xla", "mosaic")
# backend="mosaic" (Pallas Mosaic GPU, issue #29; docs/mosaic.md): its one forward
# structure is TileGym's static_persistent (a persistent grid over row blocks, TMA
# pipelined), so the modes it serves are these:
MOSAIC_MODES = (None, "static_persistent")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# FP8 x (issue #27, COAT's group-scaled input): its dtypes, and the group sizes the
# kernels serve (powers of 2 up to the narrowest column tile config.py picks, 512).
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
GROUP_SIZES = (16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable non-differentiable arguments of the custom_vjp."""

  eps: float
  scale_offset: float
  subtract_mean: bool
  mode: str | None
  backend: str
  interpret: bool
  axis_name: tuple[str, ...] | None = None
  axis_index_groups: tuple[tuple[int, ...], ...] | None = None
  # the fused residual add: h's dtype (None: no residual), x's and residual's dtypes
  residual_dtype: str | None = None
  x_dtype: str | None = None
  residual_in_dtype: str | None = None
  # cast="llama": (x's dtype, y's dtype) names; None for "torch" (and "gemma")
  llama: tuple[str, str] | None = None
  # FP8 x (x_scale=): y's and dx's dtype name; None for a float x
  out_dtype: str | None = None
  # the tuning tables' context (tuning.context()): the jitted bodies are traced again
  # when it changes, so that configs chosen at trace time follow it
  tables: tuple = ()
  # param_cast: the dtype name the Pallas kernels round scale/bias to as they load them
  param_cast: str | None = None
  # post_norm_scale= (RMSNorm with a residual): the forward launchers take the post-norm's
  # scale in bias's place (spmd lays it out as scale; RMSNorm has no bias)
  post_norm: bool = False


# --------------------------------------------------------------------------- checks


def _check_array(op: str, name: str, a) -> None:
  """TypeError unless ``a`` is an array (a jax.Array, tracer or numpy array: anything
  with a shape and a dtype); a list or a Python number is refused as ``jnp`` functions
  refuse them, naming the argument."""
  if not (hasattr(a, "shape") and hasattr(a, "dtype")):
    raise TypeError(f"{op + ': ' if op else ''}{name} must be an array (jax.Array or "
                    f"numpy.ndarray), got {type(a).__name__}")


def _check_float(name: str, a, op: str = "") -> None:
  _check_array(op, name, a)
  dt = jnp.result_type(a)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{op + ': ' if op else ''}{name}.dtype={dt} must be a floating dtype "
                    f"(float32, bfloat16 or float16)")


def _check_real(op: str, name: str, v, *, non_negative: bool = False) -> float:
  """``v`` as a float: a static real number (no bool, array or tracer: it is part of
  the compiled kernel), finite, and >= 0 with ``non_negative``. TypeError / ValueError
  naming ``op`` and ``name`` (also the Flax layers' epsilon and scale_offset)."""
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating,
                                                           np.integer)):
    raise TypeError(f"{op}: {name} must be a real number (static: it is part of the "
                    f"compiled kernel), got {v!r}")
  try:
    f = float(v)
  except OverflowError:  # an int beyond float's range
    f = math.inf
  if not (math.isfinite(f) and (f >= 0 or not non_negative)):
    raise ValueError(f"{op}: {name}={v!r} must be finite" + (" and >= 0" if non_negative
                                                               else ""))
  return f


def _check_mode_backend(op: str, mode, backend) -> None:
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"{op}: {backend=} is not a valid backend; valid backends: "
                     f"{BACKENDS} or None")
  if mode is not None and mode not in _config.MODES:
    raise ValueError(f"{op}: {mode=} is not a valid mode; valid modes: {_config.MODES} "
                     f"or None")


def _check_cast_name(op: str, cast) -> None:
  if not isinstance(cast, str) or cast not in CASTS:
    raise ValueError(f"{op}: {cast=} is not a casting mode; valid: {CASTS}")


def _check_residual_dtype(op: str, residual_dtype):
  """h's dtype from ``residual_dtype``: float32, bfloat16 or float16."""
  try:
    dt = jnp.dtype(residual_dtype)
  except TypeError as e:
    raise TypeError(f"{op}: {residual_dtype=} is not a dtype") from e
  if dt not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{op}: residual_dtype={dt} must be float32, bfloat16 or float16")
  return dt


def _check_args(op: str, x, scale, bias, eps, mode, backend, allow_fp8=False) -> int:
  _check_mode_backend(op, mode, backend)
  _check_float("x", x, op)  # an array of a float dtype
  x_shape = jnp.shape(x)
  if len(x_shape) == 0:
    raise ValueError(f"{op}: x must have rank >= 1, got {x_shape=}")
  dtypes = _FLOAT_DTYPES + (_FP8_DTYPES if allow_fp8 else ())
  if jnp.result_type(x) not in [jnp.dtype(d) for d in dtypes]:
    raise TypeError(f"{op}: x.dtype={jnp.result_type(x)} must be float32, bfloat16 or float16"
                    + (" (or float8_e4m3fn / float8_e5m2 with x_scale)" if allow_fp8 else ""))
  n = x_shape[-1]
  if n == 0:
    raise ValueError(f"{op}: the normalised axis is empty: {x_shape=} has N=0")
  for name, p in (("scale", scale), ("bias", bias)):
    if p is None:
      continue
    _check_array(op, name, p)
    if jnp.result_type(p) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
      raise TypeError(f"{op}: {name}.dtype={jnp.result_type(p)} must be float32, bfloat16 "
                      f"or float16")
    if tuple(jnp.shape(p)) != (n,):
      raise ValueError(f"{op}: {name}.shape={tuple(jnp.shape(p))} must be ({n},) to match "
                       f"x.shape[-1] ({x_shape=})")
  _check_real(op, "eps", eps, non_negative=True)
  return n


def _check_residual(op: str, x, residual, residual_dtype):
  """The residual's dtype name and h's, or (None, None) without a residual."""
  if residual is None:
    if residual_dtype is not None:
      raise ValueError(f"{op}: {residual_dtype=} needs a residual")
    return None, None
  _check_float("residual", residual, op)
  floats = [jnp.dtype(d) for d in _FLOAT_DTYPES]
  if jnp.result_type(residual) not in floats:
    raise TypeError(f"{op}: residual.dtype={jnp.result_type(residual)} must be float32, "
                    f"bfloat16 or float16")
  if tuple(jnp.shape(residual)) != tuple(jnp.shape(x)):
    raise ValueError(f"{op}: residual.shape={tuple(jnp.shape(residual))} must equal "
                     f"x.shape={tuple(jnp.shape(x))}")
  h_dtype = (jnp.result_type(residual) if residual_dtype is None
             else _check_residual_dtype(op, residual_dtype))
  return jnp.result_type(residual).name, h_dtype.name


def _check_fp8(op: str, x, x_scale, group_size, out_dtype, cast, residual) -> str | None:
  """y's (and dx's) dtype name for FP8 x (default bfloat16), None for a float x; every
  error of FP8 input, before any kernel."""
  x_dtype = jnp.result_type(x)
  if x_dtype not in [jnp.dtype(d) for d in _FP8_DTYPES]:
    if x_scale is not None:
      raise ValueError(f"{op}: x_scale is the dequantisation scale of FP8 x (float8_e4m3fn "
                       f"or float8_e5m2), but x.dtype={x_dtype}")
    if out_dtype is not None:
      raise ValueError(f"{op}: {out_dtype=} is for FP8 x only; y has x's dtype ({x_dtype})")
    if isinstance(group_size, bool) or group_size != 16:
      raise ValueError(f"{op}: {group_size=} is for FP8 x only (the elements an x_scale "
                       f"covers); x.dtype={x_dtype}")
    return None
  n = jnp.shape(x)[-1]
  if x_scale is None:
    raise ValueError(f"{op}: x.dtype={x_dtype} needs x_scale, its float32 dequantisation "
                     f"scales of shape x.shape[:-1] + (N // group_size,)")
  _check_array(op, "x_scale", x_scale)
  if residual is not None:
    raise ValueError(f"{op}: residual= is not supported with FP8 x (x.dtype={x_dtype})")
  if cast == "llama":
    raise ValueError(f"{op}: cast='llama' rounds x_hat to x's dtype, which has no meaning "
                     f"for FP8 x (x.dtype={x_dtype}); use cast='torch' or 'gemma'")
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
    raise TypeError(f"{op}: {group_size=} must be an int")
  if int(group_size) not in GROUP_SIZES or n % group_size:
    raise ValueError(f"{op}: {group_size=} must be one of {GROUP_SIZES} and divide N={n} "
                     f"(x_scale.shape={tuple(jnp.shape(x_scale))})")
  want = tuple(jnp.shape(x)[:-1]) + (n // group_size,)
  if tuple(jnp.shape(x_scale)) != want:
    raise ValueError(f"{op}: x_scale.shape={tuple(jnp.shape(x_scale))} must be {want}: "
                     f"x.shape[:-1] + (N // group_size,) with N={n}, {group_size=}")
  if jnp.result_type(x_scale) != jnp.float32:
    raise TypeError(f"{op}: x_scale.dtype={jnp.result_type(x_scale)} must be float32")
  try:
    out = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  except TypeError as e:
    raise TypeError(f"{op}: {out_dtype=} is not a dtype") from e
  if out not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{op}: out_dtype={out} must be float32, bfloat16 or float16")
  return out.name


CASTS = ("torch", "llama", "gemma")


def _check_cast(op: str, cast: str, scale, scale_offset) -> float:
  """The scale_offset the casting mode implies; ValueError for a combination that has
  no meaning."""
  _check_cast_name(op, cast)
  scale_offset = _check_real(op, "scale_offset", scale_offset)
  if scale is None and scale_offset != 0.0:
    raise ValueError(f"{op}: {scale_offset=} without a scale has no effect: y = x_hat * "
                     f"(scale_offset + scale) needs a scale (pass one, or scale_offset=0)")
  if cast == "gemma":
    if scale is None:
      raise ValueError(f"{op}: cast='gemma' multiplies by 1 + scale: pass a scale")
    if scale_offset not in (0.0, 1.0):
      raise ValueError(f"{op}: cast='gemma' implies scale_offset=1.0, got {scale_offset}")
    return 1.0
  if cast == "llama" and scale_offset != 0.0:
    raise ValueError(f"{op}: cast='llama' multiplies by the weight itself "
                     f"(HF LlamaRMSNorm); {scale_offset=} has no meaning there")
  return scale_offset


def _check_post_norm(op: str, x, post_norm_scale, residual, cast) -> None:
  """post_norm_scale's errors: it needs a residual, a float x, cast "torch" or "gemma",
  and a float [N] array."""
  if residual is None:
    raise ValueError(f"{op}: post_norm_scale normalises x before the residual add: it "
                     f"needs a residual")
  if cast == "llama":
    raise ValueError(f"{op}: post_norm_scale is for cast='torch' or 'gemma', not "
                     f"cast='llama'")
  if jnp.result_type(x) in [jnp.dtype(d) for d in _FP8_DTYPES]:
    raise ValueError(f"{op}: post_norm_scale needs a float x, not x.dtype={jnp.result_type(x)}")
  _check_array(op, "post_norm_scale", post_norm_scale)
  if jnp.result_type(post_norm_scale) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{op}: post_norm_scale.dtype={jnp.result_type(post_norm_scale)} must be "
                    f"float32, bfloat16 or float16")
  n = jnp.shape(x)[-1]
  if tuple(jnp.shape(post_norm_scale)) != (n,):
    raise ValueError(f"{op}: post_norm_scale.shape={tuple(jnp.shape(post_norm_scale))} must "
                     f"be ({n},) to match x.shape[-1] (x.shape={tuple(jnp.shape(x))})")


def _check_mosaic(op: str, mode, out_dtype) -> None:
  """NotImplementedError for what backend="mosaic" does not serve yet (before any
  kernel runs). Its kernels' own limits (N a multiple of 128, shared memory) are
  checked by the launchers at trace time."""
  what = None
  if mode not in MOSAIC_MODES:
    what = (f"{mode=}: its forward is static_persistent (a persistent grid over row "
            f"blocks); valid modes for it: {MOSAIC_MODES}")
  elif out_dtype is not None:
    what = "FP8 x (x_scale=)"
  if what:
    raise NotImplementedError(f"{op}: backend='mosaic' does not serve {what} yet "
                              f"(issue #29, docs/mosaic.md); use backend='pallas'")


def _resolve_interpret(interpret: bool | None, op: str = "") -> bool:
  """None: interpret mode unless on a GPU; TypeError for a non-bool (a string such as
  "no" is not taken as True). interpret=False stays allowed without a GPU: lowering
  for CUDA from a CPU (jax.export, tests/test_export.py) needs it; run there, JAX's
  lowering refuses it ("Only interpret mode is supported on CPU backend")."""
  if interpret is None:
    return _config.device_info().platform != "gpu"
  if not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(f"{op + ': ' if op else ''}interpret must be None, True or False, got "
                    f"{interpret!r}")
  return bool(interpret)


# --------------------------------------------------------------------------- launchers


def _auto_backend(pass_: str, x2, scale, bias, st: _Static, fused: bool,
                  residual: bool = False, return_residuals: bool = True) -> str:
  """backend=None: ``config.choose_backend``'s pick for this kernel, if that backend
  serves the call; else "pallas". ``return_residuals``: the forward also writes
  mean/rstd (under jax.vjp: the tables' "fwd_stats"; else their "fwd"). ``fused``: FP8
  x or a sharded hidden dim (which the rules do not cover). ``residual``: the fused
  residual add, whose rules were measured with x, the residual and h in one dtype
  (others: "pallas"). Also "pallas" for
  scale/bias in another dtype than x's: the rules were measured with them in x's (the
  Pallas backend has its own float32-parameter tiles). A table's "xla" (the jnp math,
  which XLA fuses) is taken wherever nothing is fused and no ``axis_name`` is given."""
  if st.backend is not None:
    return st.backend
  m, n = x2.shape
  params = [p.dtype for p in (scale, bias) if p is not None]
  backend = _config.choose_backend(pass_, n, x2.dtype, st.subtract_mean,
                                   residual=residual, m=m,
                                   param_dtype=params[0] if params else None,
                                   llama=st.llama is not None,
                                   return_residuals=return_residuals)
  if backend == "xla" and not fused and st.axis_name is None:
    return "xla"  # a table's pick: XLA's fusion of the jnp math is the faster there
  if backend in ("pallas", "xla") or st.interpret or fused or st.llama is not None:
    return "pallas"
  if residual and len({st.x_dtype, st.residual_dtype, st.residual_in_dtype}) != 1:
    return "pallas"  # an fp32 residual stream, say: not measured
  if any(p is not None and p.dtype != x2.dtype for p in (scale, bias)):
    return "pallas"  # the rules were measured with scale/bias in x's dtype
  if backend == "triton":
    import importlib.util
    return "triton" if importlib.util.find_spec("jax_triton") else "pallas"
  if backend == "mosaic":  # its launchers' own checks, on shapes only
    if st.mode not in MOSAIC_MODES:
      return "pallas"
    from pallas_norm.kernels import mosaic_backward as mb
    from pallas_norm.kernels import mosaic_forward as mf
    try:
      if pass_ == "fwd":  # (x, the residual and h in one dtype: checked above)
        mf.checked_config(m, n, x2.dtype, [p.dtype for p in (scale, bias) if p is not None],
                          st.subtract_mean,
                          residual_dtypes=(x2.dtype, x2.dtype) if residual else None)
      else:  # x2 is h; dh and dx in its dtype, no dresidual of another
        mb.checked_config(m, n, x2.dtype, x2.dtype, None if scale is None else scale.dtype,
                          bias is not None, st.subtract_mean,
                          fused_dtypes=(x2.dtype, x2.dtype, None) if residual else None)
    except (NotImplementedError, ValueError):
      return "pallas"
  return backend


def _backend_module(backend: str):
  if backend == "pallas":
    from pallas_norm.kernels import backward, forward
    return forward, backward
  if backend == "mosaic":
    from pallas_norm.kernels import mosaic_backward, mosaic_forward
    return mosaic_forward, mosaic_backward
  from pallas_norm.kernels import jax_triton
  return jax_triton, jax_triton


def _forward(x2, scale, bias, st: _Static, return_residuals: bool = True,
             combine_stats=None, residual=None, x_scale=None):
  """x2: [M, N] -> (y [M, N] x.dtype, mean [M] f32 | None, rstd [M] f32 | None,
  h [M, N] | None).

  ``combine_stats`` (x2 a shard of the hidden dim, spmd.py): ``(s1, s2) -> (mean, rstd)``
  of the whole rows from this shard's statistics; the forward is then the statistics
  kernel, that function, and the normalise kernel. ``residual`` ([M, N] or None): the
  fused add, normalising h = x2 + residual (h in ``st.residual_dtype``). ``x_scale``
  ([M, N // G] f32 or None): FP8 x2's scales, y in ``st.out_dtype``.
  """
  if st.post_norm:
    return _post_norm_forward(x2, scale, bias, st, return_residuals, combine_stats, residual)
  m, n = x2.shape
  backend = _auto_backend("fwd", x2, scale, bias, st,
                          fused=combine_stats is not None or x_scale is not None,
                          residual=residual is not None,
                          return_residuals=return_residuals)
  if backend == "xla":  # the jnp math on these rows (no collectives: not fused)
    y, mean, rstd, h = _xla_of(st, x2, residual, scale, bias)
    mean = mean if st.subtract_mean else None
    return (y, mean, rstd, h) if return_residuals else (y, None, None, h)
  params = [p.dtype for p in (scale, bias) if p is not None]
  if st.param_cast is not None:  # the kernels see the params in that dtype
    params = [jnp.dtype(st.param_cast)] * len(params)
  cfg = _config.forward_config(
      m, n, x2.dtype, st.mode, subtract_mean=st.subtract_mean, backend=backend,
      residual=residual is not None,
      # float32 scale/bias have their own tiles (measured on the plain norm only)
      param_dtype=params[0] if params and combine_stats is None else None,
      return_residuals=return_residuals and combine_stats is None,
      llama=st.llama is not None)
  fwd, _ = _backend_module(backend)
  if backend == "mosaic" and combine_stats is not None:
    raise NotImplementedError(
        "backend='mosaic' does not serve a sharded hidden dim (tensor parallel, or "
        "axis_name) yet: it has no statistics-only pass; use backend='pallas'")
  res = {} if residual is None else dict(residual=residual,
                                         residual_dtype=jnp.dtype(st.residual_dtype))
  fp8 = {} if x_scale is None else dict(x_scale=x_scale)
  y_dtype = {} if x_scale is None else dict(y_dtype=jnp.dtype(st.out_dtype))
  with _params_cast_to(st):
    return _forward_launch(fwd, x2, scale, bias, st, cfg, return_residuals, combine_stats,
                           residual, res, fp8, y_dtype)


def _post_norm_statics(st: _Static) -> tuple[_Static, _Static]:
  """(the post-norm's statics, the residual norm's) of a ``post_norm_scale=`` call."""
  res = dataclasses.replace(st, post_norm=False)
  return dataclasses.replace(res, residual_dtype=None, x_dtype=None,
                             residual_in_dtype=None), res


def _post_norm_forward(x2, scale, post_scale, st: _Static, return_residuals, combine_stats,
                       residual):
  """``post_norm_scale=``'s forward on [M, N] rows: h = residual + rms_norm(x2,
  post_scale) (rounded to x's dtype), y = rms_norm(h, scale); (y, None, rstd | None, h).

  One kernel (forward.norm_forward's ``post_norm_scale``) where the Pallas backend serves
  the residual norm, nothing else is fused, no residuals are wanted (outside jax.vjp)
  and its config (``config.forward_config(post_norm=True)``: the tables' "rms_res_post"
  entry, else the residual norm's cached config without column splits) holds a row in
  one program; else the post-norm and the residual norm launched one after the other
  (the same values)."""
  m, n = x2.shape
  post, res = _post_norm_statics(st)
  if combine_stats is None and not return_residuals and st.mode in (None, "multi_wave_cached"):
    backend = _auto_backend("fwd", x2, scale, None, res, fused=False, residual=True,
                            return_residuals=False)
    params = [p.dtype for p in (scale, post_scale) if p is not None]
    if st.param_cast is not None:
      params = [jnp.dtype(st.param_cast)] * len(params)
    forward, _ = _backend_module("pallas")
    try:
      cfg = _config.forward_config(m, n, x2.dtype, "multi_wave_cached", backend="pallas",
                                   residual=True, param_dtype=params[0],
                                   return_residuals=False, post_norm=True)
    except NotImplementedError:  # a row too long for the cached mode at all
      cfg = None
    if backend == "pallas" and cfg is not None and forward.post_norm_fits(cfg, n):
      with _params_cast_to(st):
        y, _, _, h = forward.norm_forward(
            x2, scale, None, eps=st.eps, scale_offset=st.scale_offset, subtract_mean=False,
            config=cfg, interpret=st.interpret, return_residuals=False, residual=residual,
            residual_dtype=jnp.dtype(st.residual_dtype), post_norm_scale=post_scale)
      return y, None, None, h
  y1 = _forward(x2, post_scale, None, post, False, combine_stats)[0]
  return _forward(y1, scale, None, res, return_residuals, combine_stats, residual)


def _params_cast_to(st: _Static):
  """The Pallas kernels' rounding of scale/bias to ``st.param_cast`` while they trace."""
  from pallas_norm.kernels import forward
  return forward.params_cast_to(st.param_cast)


def _forward_launch(fwd, x2, scale, bias, st, cfg, return_residuals, combine_stats,
                    residual, res, fp8, y_dtype):
  if combine_stats is None:
    out = fwd.norm_forward(x2, scale, bias, eps=st.eps, scale_offset=st.scale_offset,
                           subtract_mean=st.subtract_mean, config=cfg,
                           interpret=st.interpret, return_residuals=return_residuals,
                           **res, **_cast_kw(st), **fp8, **y_dtype)
    return out if residual is not None else (*out, None)
  s1, s2, *h = fwd.norm_forward_stats(x2, subtract_mean=st.subtract_mean, config=cfg,
                                      interpret=st.interpret, **res, **fp8)
  mean, rstd = combine_stats(s1, s2)
  y = fwd.norm_forward_apply(x2, scale, bias, mean, rstd, scale_offset=st.scale_offset,
                             config=cfg, interpret=st.interpret, residual=residual,
                             **_cast_kw(st), **fp8, **y_dtype)
  h = h[0] if h else None
  return (y, mean, rstd, h) if return_residuals else (y, None, None, h)


def _cast_kw(st: _Static) -> dict:
  """The launchers' casting argument: none for cast="torch" (the Triton backend has no
  other)."""
  return {} if st.llama is None else {"cast": "llama"}


def _backward(dy, x2, scale, bias, mean, rstd, st: _Static, combine_row_sums=None,
              param_grad_dtype=None, dh=None, x_scale=None):
  """-> (dx [M, N] x.dtype, dresidual [M, N] | None, dscale [N] | None, dbias [N] | None),
  dscale and dbias in ``param_grad_dtype`` if given, else in scale's and bias's dtypes.
  ``combine_row_sums``: as in kernels.backward.norm_backward (x2 a shard of the hidden
  dim). With a residual (``st.residual_dtype``) x2 is h and dh its cotangent. With FP8
  x2, ``x_scale`` its [M, N // G] scales, and dx is in ``st.out_dtype``."""
  m, n = x2.shape
  backend = _auto_backend("bwd", x2, scale, bias, st,
                          fused=combine_row_sums is not None or x_scale is not None,
                          residual=st.residual_dtype is not None)
  if backend == "xla":  # the jnp math's vjp on these rows (no collectives: not fused)
    dx, dres, dscale, dbias = _bwd_reference(st, dy, x2, None, scale, bias, mean, rstd,
                                             dh)
    if param_grad_dtype is not None:
      dscale, dbias = (None if g is None else g.astype(param_grad_dtype)
                       for g in (dscale, dbias))
    return dx, dres, dscale, dbias
  pc = st.param_cast
  cfg = _config.backward_config(m, n, x2.dtype, subtract_mean=st.subtract_mean,
                               backend=backend, residual=st.residual_dtype is not None,
                               param_dtype=None if scale is None else (pc or scale.dtype),
                               llama=st.llama is not None)
  _, bwd = _backend_module(backend)
  # with param_cast, dscale/dbias in that dtype (_bwd_kernels casts them back)
  dtype = lambda p: None if p is None else (param_grad_dtype or pc or p.dtype)
  res = {}
  if st.residual_dtype is not None:
    res = dict(dh=dh, dx_dtype=jnp.dtype(st.x_dtype),
               residual_dtype=jnp.dtype(st.residual_in_dtype))
  fp8 = {} if x_scale is None else dict(x_scale=x_scale, dx_dtype=jnp.dtype(st.out_dtype))
  with _params_cast_to(st):
    out = bwd.norm_backward(dy, x2, scale, mean, rstd,
                            has_bias=bias is not None,
                            scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
                            config=cfg, interpret=st.interpret,
                            scale_dtype=dtype(scale), bias_dtype=dtype(bias),
                            combine_row_sums=combine_row_sums, **res, **fp8,
                            **({} if st.llama is None else {"cast": st.llama}))
  return out if res else (out[0], None, *out[1:])


# --------------------------------------------------------------------------- the jnp math


def _xla_forward(x, residual, scale, bias, *, eps, scale_offset, subtract_mean, names,
                 groups, llama, h_dtype=None, x_scale=None, out_dtype=None):
  """backend="xla"'s forward, and the reference the kernels' higher-order derivatives
  come from: (y, mean [...] f32, rstd [...] f32, h or None). With a residual, h = x +
  residual in float32 (returned in h_dtype) and y the norm of that sum in x's dtype;
  ``llama`` (cast="llama"): x_hat rounded to x's dtype before the weight."""
  kw = dict(eps=eps, subtract_mean=subtract_mean, axis_name=names, axis_index_groups=groups)
  if residual is None:
    return (*reference.norm(x, scale, bias, scale_offset=scale_offset, x_scale=x_scale,
                            cast="llama" if llama else "torch", out_dtype=out_dtype,
                            **kw), None)
  h = x.astype(jnp.float32) + residual.astype(jnp.float32)
  y, mean, rstd = _xla_norm_of_sum(h, scale, bias, x.dtype, llama=llama,
                                   scale_offset=scale_offset, **kw)
  return y, mean, rstd, h.astype(h_dtype)


def _xla_norm_of_sum(h, scale, bias, x_dtype, *, llama, scale_offset, **kw):
  """(y in x's dtype, mean, rstd) of the float32 residual sum h (the fused residual's y;
  ``llama``: x_hat rounded to x's dtype before the weight)."""
  if llama:
    xr, mean, rstd = reference.norm(h, None, None, **kw)
    y = xr.astype(x_dtype)
    y = y if scale is None else y * scale
    return (y if bias is None else y + bias), mean, rstd
  y, mean, rstd = reference.norm(h, scale, bias, scale_offset=scale_offset, **kw)
  return y.astype(x_dtype), mean, rstd


def _cast_params(st: "_Static", *params):
  """scale/bias as ``st.param_cast`` rounds them (the jnp math's side of it)."""
  if st.param_cast is None:
    return params
  return tuple(None if p is None else p.astype(st.param_cast) for p in params)


def _xla_of(st: "_Static", x, residual, scale, bias, x_scale=None):
  """``_xla_forward`` with the arguments ``st`` holds."""
  scale, bias = _cast_params(st, scale, bias)
  return _xla_forward(x, residual, scale, bias, eps=st.eps, scale_offset=st.scale_offset,
                      subtract_mean=st.subtract_mean, names=st.axis_name,
                      groups=st.axis_index_groups, llama=st.llama is not None,
                      h_dtype=st.residual_dtype, x_scale=x_scale, out_dtype=st.out_dtype)


# Higher-order derivatives. The custom_vjp rules below call the kernels, which JAX cannot
# differentiate (Pallas' JVP of a kernel body fails inside the grid). A second
# differentiation (jax.grad of jax.grad, jax.hessian, a Hessian-vector product) goes
# through the rules themselves, so each kernel call is a custom_jvp whose tangent is
# that of the same math in jnp (``_xla_forward`` and its vjp): the values stay the
# kernels', the derivatives of the derivatives are the reference's.


def _with_reference_jvp(kernel_fn, reference_fn):
  """``kernel_fn(st, *args)`` (a tuple, entries may be None) as a custom_jvp whose tangent
  is ``reference_fn(st, *args)``'s (the same structure, cast to the kernel's dtypes)."""
  @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
  def f(st, *args):
    return kernel_fn(st, *args)

  @f.defjvp
  def f_jvp(st, primals, tangents):
    out = kernel_fn(st, *primals)
    _, t = jax.jvp(lambda *a: reference_fn(st, *a), primals, tangents)
    return out, tuple(None if o is None else ti.astype(o.dtype) for o, ti in zip(out, t))
  return f


def _fwd_kernels(st: "_Static", x, x_scale, scale, bias, residual):
  return spmd.forward(_forward, x, scale, bias, st, True, residual, x_scale=x_scale)


def _fwd_reference(st: "_Static", x, x_scale, scale, bias, residual):
  return _xla_of(st, x, residual, scale, bias, x_scale)


def _bwd_kernels(st: "_Static", dy, x, x_scale, scale, bias, mean, rstd, dh):
  dx, dres, dscale, dbias = spmd.backward(_backward, dy, x, scale, bias, mean, rstd, st, dh,
                                          x_scale=x_scale)
  if st.param_cast is not None:  # the cast's transpose: rounded to it, in the param's dtype
    dscale, dbias = (None if d is None else d.astype(st.param_cast).astype(p.dtype)
                     for d, p in ((dscale, scale), (dbias, bias)))
  return dx, dres, dscale, dbias


def _bwd_reference(st: "_Static", dy, x, x_scale, scale, bias, mean, rstd, dh):
  """The backward's math in jnp from x (or h) alone: mean and rstd are functions of it,
  so their tangents are not added again."""
  del mean, rstd
  if dh is None:  # no residual; FP8 x: the cotangent of the dequantised x, in out_dtype
    xd = x if x_scale is None else reference.dequantise(x, x_scale)
    _, pull = jax.vjp(lambda a, s, b: _xla_of(st, a, None, s, b)[0], xd, scale, bias)
    dx, dscale, dbias = pull(dy)
    return (dx if x_scale is None else dx.astype(st.out_dtype)), None, dscale, dbias
  # the fused residual: y is the norm of h (the saved sum); dx = dresidual = dy's + dh
  def y_of_h(a, s, b):
    s, b = _cast_params(st, s, b)
    return _xla_norm_of_sum(a, s, b, st.x_dtype, llama=st.llama is not None,
                            scale_offset=st.scale_offset, eps=st.eps,
                            subtract_mean=st.subtract_mean, axis_name=st.axis_name,
                            axis_index_groups=st.axis_index_groups)[0]
  _, pull = jax.vjp(y_of_h, x.astype(jnp.float32), scale, bias)
  dsum, dscale, dbias = pull(dy)
  dsum = dsum + dh.astype(jnp.float32)
  return dsum.astype(st.x_dtype), dsum.astype(st.residual_in_dtype), dscale, dbias


_fwd_diff = _with_reference_jvp(_fwd_kernels, _fwd_reference)
_bwd_diff = _with_reference_jvp(_bwd_kernels, _bwd_reference)


# --------------------------------------------------------------------------- custom_vjp


# x is [..., N] (rank >= 2) here, not [M, N]: the leading axes may be sharded, and
# spmd.py runs the launchers on each device's rows (and columns).


# FP8 x comes with its scales x_scale (None for a float x). The forward saves the FP8 x
# and x_scale, not a dequantised copy; the backward dequantises again as it loads x.
# x_scale's cotangent is zero (scales are constants, as in TransformerEngine and COAT);
# dx, the cotangent of the dequantised x, is in st.out_dtype (JAX takes a cotangent of
# another float dtype for an FP8 primal).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_nd(x, x_scale, scale, bias, st: _Static):
  return spmd.forward(_forward, x, scale, bias, st, False, x_scale=x_scale)[0]


def _norm_nd_fwd(x, x_scale, scale, bias, st: _Static):
  y, mean, rstd, _ = _fwd_diff(st, x, x_scale, scale, bias, None)
  return y, (x, x_scale, scale, bias, mean, rstd)


def _norm_nd_bwd(st: _Static, res, dy):
  x, x_scale, scale, bias, mean, rstd = res
  dx, _, dscale, dbias = _bwd_diff(st, dy, x, x_scale, scale, bias, mean, rstd, None)
  return dx, _zero_cotangent(x_scale), dscale, dbias


def _zero_cotangent(a):
  return None if a is None else jnp.zeros_like(a)


_norm_nd.defvjp(_norm_nd_fwd, _norm_nd_bwd)


# backend="xla" with FP8 x: the reference (dequantise, then the norm in float32) under
# the same custom_vjp contract: dx in st.out_dtype, not rounded to x's FP8 dtype as
# JAX's own derivative of x.astype(float32) would give it, and a zero x_scale cotangent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _xla_fp8(x, x_scale, scale, bias, st: _Static):
  return _xla_fp8_fwd(x, x_scale, scale, bias, st)[0]


def _xla_fp8_norm(st: _Static):
  """(dequantised x, scale, bias) -> y in st.out_dtype."""
  return lambda xd, scale, bias: reference.norm(
      xd, scale, bias, eps=st.eps, scale_offset=st.scale_offset,
      subtract_mean=st.subtract_mean, axis_name=st.axis_name,
      axis_index_groups=st.axis_index_groups, out_dtype=st.out_dtype)[0]


def _xla_fp8_fwd(x, x_scale, scale, bias, st: _Static):
  y = _xla_fp8_norm(st)(reference.dequantise(x, x_scale), scale, bias)
  return y, (x, x_scale, scale, bias)


def _xla_fp8_bwd(st: _Static, res, dy):
  x, x_scale, scale, bias = res
  _, pull = jax.vjp(_xla_fp8_norm(st), reference.dequantise(x, x_scale), scale, bias)
  dx, dscale, dbias = pull(dy)
  return dx.astype(st.out_dtype), _zero_cotangent(x_scale), dscale, dbias


_xla_fp8.defvjp(_xla_fp8_fwd, _xla_fp8_bwd)


# The fused residual add: (y, h) = (norm(x + residual), x + residual). The forward saves
# h, not x; the backward adds h's cotangent dh to dx inside the stage-1 kernel.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_res_nd(x, residual, scale, bias, st: _Static):
  y, _, _, h = spmd.forward(_forward, x, scale, bias, st, False, residual)
  return y, h


def _norm_res_nd_fwd(x, residual, scale, bias, st: _Static):
  y, mean, rstd, h = _fwd_diff(st, x, None, scale, bias, residual)
  return (y, h), (h, scale, bias, mean, rstd)


def _norm_res_nd_bwd(st: _Static, res, cts):
  h, scale, bias, mean, rstd = res
  dy, dh = cts
  return _bwd_diff(st, dy, h, None, scale, bias, mean, rstd, dh)


_norm_res_nd.defvjp(_norm_res_nd_fwd, _norm_res_nd_bwd)


# The post-norm before the fused residual add (post_norm_scale=): (y, h) =
# (rms_norm(h, scale), h) with h = residual + rms_norm(x, post_norm_scale). The primal is
# one kernel where it can be (_post_norm_forward); under jax.vjp the forward is the two
# ops' forwards and the backward their backwards (the residual norm's, then the
# post-norm's): the same kernels, saves and determinism as the two calls.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _post_norm_res_nd(x, residual, scale, post_scale, st: _Static):
  y, _, _, h = spmd.forward(_forward, x, scale, post_scale, st, False, residual)
  return y, h


def _post_norm_res_nd_fwd(x, residual, scale, post_scale, st: _Static):
  post, res = _post_norm_statics(st)
  y1, saved1 = _norm_nd_fwd(x, None, post_scale, None, post)
  (y, h), saved2 = _norm_res_nd_fwd(y1, residual, scale, None, res)
  return (y, h), (saved1, saved2)


def _post_norm_res_nd_bwd(st: _Static, saved, cts):
  post, res = _post_norm_statics(st)
  saved1, saved2 = saved
  dy1, dres, dscale, _ = _norm_res_nd_bwd(res, saved2, cts)
  dx, _, dpost, _ = _norm_nd_bwd(post, saved1, dy1)
  return dx, dres, dscale, dpost


_post_norm_res_nd.defvjp(_post_norm_res_nd_fwd, _post_norm_res_nd_bwd)
# Jitted, so that an eager call on sharded arrays is partitioned as it is under the
# caller's jit (custom_partitioning runs its rule only when XLA compiles it).
_norm_nd_jit = jax.jit(_norm_nd, static_argnums=(4,))
_norm_res_nd_jit = jax.jit(_norm_res_nd, static_argnums=(4,))
_post_norm_res_nd_jit = jax.jit(_post_norm_res_nd, static_argnums=(4,))


def _axis_groups(axis_name, axis_index_groups):
  """Hashable (axis names, groups) from flax's ``axis_name`` / ``axis_index_groups``."""
  if axis_name is None:
    if axis_index_groups is not None:
      raise ValueError(f"{axis_index_groups=} needs an axis_name")
    return None, None
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  for a in names:
    try:
      jax.lax.axis_size(a)
    except NameError as e:
      raise ValueError(f"{axis_name=} is not a bound mesh axis: axis_name reduces the "
                       f"statistics over a shard_map axis, so call the op inside "
                       f"jax.shard_map (or omit it: sharded inputs are handled "
                       f"without it)") from e
  groups = None
  if axis_index_groups is not None:
    groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
  return names, groups


_PARAM_CAST_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _param_cast(op, scale, bias, param_cast, backend, x_scale, cast):
  """(scale, bias, param_cast's dtype name or None). The Pallas kernels round the params
  as they load them (backend="pallas", a float x, cast "torch" or "gemma"); elsewhere
  the params are cast here, up front (the same values either way).

  Raises:
    TypeError: a param_cast other than float32, bfloat16 or float16.
  """
  if param_cast is None:
    return scale, bias, None
  try:
    dt = jnp.dtype(param_cast)
  except TypeError:
    dt = None
  if dt not in [jnp.dtype(d) for d in _PARAM_CAST_DTYPES]:
    raise TypeError(f"{op}: param_cast={param_cast!r} must be float32, bfloat16 or float16")
  params = [p for p in (scale, bias) if p is not None]
  if all(p.dtype == dt for p in params):
    return scale, bias, None
  if backend != "pallas" or x_scale is not None or cast == "llama":
    return (*(None if p is None else p.astype(dt) for p in (scale, bias)), None)
  return scale, bias, dt.name


def _check_concrete_shape(op: str, x, backend) -> None:
  """NotImplementedError for a symbolic dimension (jax.export's shape polymorphism):
  the kernels' launch configs, grids and tiles are chosen from the concrete shape."""
  if not all(isinstance(d, int) for d in jnp.shape(x)):
    raise NotImplementedError(
        f"{op}: x.shape={tuple(jnp.shape(x))} has a symbolic dimension (jax.export shape "
        f"polymorphism); backend={backend!r} chooses its kernels' launch configs from "
        f"concrete shapes. Export one program per shape, or use backend='xla' (the jnp "
        f"reference), which exports with symbolic shapes.")


def _norm(op, x, scale, bias, *, eps, scale_offset, subtract_mean, mode, backend, interpret,
          axis_name, axis_index_groups, residual=None, residual_dtype=None, cast="torch",
          x_scale=None, group_size=16, out_dtype=None, param_cast=None,
          post_norm_scale=None):
  _check_args(op, x, scale, bias, eps, mode, backend, allow_fp8=True)
  if post_norm_scale is not None:
    _check_post_norm(op, x, post_norm_scale, residual, cast)
    # the post-norm's scale travels in bias's place (RMSNorm has none): cast alike
    scale, post_norm_scale, param_cast = _param_cast(op, scale, post_norm_scale, param_cast,
                                                     backend, x_scale, cast)
  else:
    scale, bias, param_cast = _param_cast(op, scale, bias, param_cast, backend, x_scale,
                                          cast)
  scale_offset = _check_cast(op, cast, scale, scale_offset)
  res_in_dtype, h_dtype = _check_residual(op, x, residual, residual_dtype)
  out_dtype = _check_fp8(op, x, x_scale, group_size, out_dtype, cast, residual)
  if out_dtype is not None:
    x_scale = jnp.asarray(x_scale)
  names, groups = _axis_groups(axis_name, axis_index_groups)
  if backend == "mosaic":
    _check_mosaic(op, mode, out_dtype)
  x = jnp.asarray(x)
  if residual is not None:
    residual = jnp.asarray(residual)
  if backend == "xla" and out_dtype is not None:
    st = _Static(float(eps), float(scale_offset), subtract_mean, mode, backend, False,
                 names, groups, out_dtype=out_dtype)
    return _xla_fp8(x, x_scale, scale, bias, st)
  if backend == "xla" and post_norm_scale is not None:  # the post-norm, then the rest
    x = reference.norm(x, post_norm_scale, None, eps=eps, scale_offset=scale_offset,
                       subtract_mean=False, axis_name=names,
                       axis_index_groups=groups)[0].astype(x.dtype)
  if backend == "xla":
    y, _, _, h = _xla_forward(x, residual, scale, bias, eps=eps, scale_offset=scale_offset,
                              subtract_mean=subtract_mean, names=names, groups=groups,
                              llama=cast == "llama", h_dtype=h_dtype)
    return y if residual is None else (y, h)
  _check_concrete_shape(op, x, backend)
  llama = None
  if cast == "llama":
    llama = (x.dtype.name, jnp.result_type(*(jnp.result_type(a) for a in (x, scale, bias)
                                            if a is not None)).name)
  m = math.prod(x.shape[:-1])
  if m == 0:
    y = jnp.zeros(x.shape, out_dtype or (x.dtype if llama is None else llama[1]))
    if residual is None:
      return y
    return y, (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(h_dtype)
  # inside a shard_map with check_vma=True: one set of varying axes for the kernels'
  # operands (a replicated scale's cotangent is then psummed by JAX's transpose)
  axes = frozenset().union(*(varying_axes(a) for a in (x, x_scale, residual, scale, bias,
                                                      post_norm_scale) if a is not None))
  interpret = _resolve_interpret(interpret, op)
  # backend=None in interpret mode (CPU): the Pallas backend, or a table's "xla"
  if axes and interpret and backend in ("pallas", None):
    raise ValueError(
        f"{op} in Pallas interpret mode cannot run inside a jax.shard_map with "
        f"check_vma=True: JAX's interpret-mode lowering rejects operands typed as varying "
        f"over mesh axes {sorted(axes)}. Pass check_vma=False to that shard_map, or run on "
        f"a GPU (interpret=False), where check_vma=True is supported.")
  if backend == "mosaic" and interpret and jax.device_count() > 1:
    raise NotImplementedError(
        f"{op}(backend='mosaic') in interpret mode (CPU) with {jax.device_count()} "
        f"devices: JAX's Mosaic GPU interpreter (jax 0.10) cannot run these kernels on "
        f"several devices (under custom_partitioning it cannot lower its callbacks; "
        f"under shard_map the backward's barriers collide across devices). Run it on "
        f"one device, on a GPU (interpret=False), or use backend='pallas'")
  x, x_scale, residual, scale, bias, post_norm_scale = (
      to_varying(a, axes) for a in (x, x_scale, residual, scale, bias, post_norm_scale))
  tables = _tuning.context()
  if residual is None:
    st = _Static(float(eps), float(scale_offset), subtract_mean, mode, backend, interpret,
                 names, groups, llama=llama, out_dtype=out_dtype, tables=tables,
                 param_cast=param_cast)
    if x.ndim == 1:
      return _norm_nd_jit(x[None], None if x_scale is None else x_scale[None], scale, bias,
                          st)[0]
    return _norm_nd_jit(x, x_scale, scale, bias, st)
  st = _Static(float(eps), float(scale_offset), subtract_mean, mode, backend, interpret,
               names, groups, h_dtype, x.dtype.name, res_in_dtype, llama, tables=tables,
               param_cast=param_cast, post_norm=post_norm_scale is not None)
  if post_norm_scale is not None:
    lead = x.ndim == 1
    y, h = _post_norm_res_nd_jit(x[None] if lead else x, residual[None] if lead else residual,
                                 scale, post_norm_scale, st)
    return (y[0], h[0]) if lead else (y, h)
  if x.ndim == 1:
    y, h = _norm_res_nd_jit(x[None], residual[None], scale, bias, st)
    return y[0], h[0]
  return _norm_res_nd_jit(x, residual, scale, bias, st)


# --------------------------------------------------------------------------- public ops


def rms_norm(x, scale=None, *, x_scale=None, group_size=16, out_dtype=None, residual=None,
             residual_dtype=None, post_norm_scale=None, eps=None, scale_offset=0.0,
             cast="torch", mode=None, backend="pallas", interpret=None, axis_name=None,
             axis_index_groups=None, param_cast=None):
  """Root-mean-square normalisation over the last axis (Zhang & Sennrich, 2019,
  https://arxiv.org/abs/1910.07467). Matches ``torch.nn.functional.rms_norm``.

  ``y = x / sqrt(mean(x**2) + eps) * (scale_offset + scale)``, statistics in float32.

  Args:
    x: [..., N] float32, bfloat16 or float16, any rank >= 1; M = prod(x.shape[:-1]) rows.
      Or FP8 (float8_e4m3fn or float8_e5m2) with ``x_scale``: COAT's group-scaled FP8
      input (Xi et al., 2024, https://arxiv.org/abs/2410.19313; its
      ``_rms_norm_fwd_fused``), dequantised in registers as the kernels load it, forward
      and backward: the op normalises ``x.astype(f32) * repeat(x_scale, group_size)``.
    scale: [N] float array or None (no scale).
    x_scale: for FP8 x only (required there): float32 of shape
      ``x.shape[:-1] + (N // group_size,)``, the DEQUANTISATION scale of each group of
      ``group_size`` consecutive elements of a row (COAT's s_x, TransformerEngine's
      scale_inv). Its cotangent is zero (scales are constants, as in TransformerEngine
      and COAT).
    group_size: elements a scale covers: 16 (COAT's QB, the default), 32, 64, 128, 256
      or 512, dividing N.
    out_dtype: FP8 x only: y's dtype, float32, bfloat16 (the default) or float16. dx,
      the cotangent of the dequantised x, is returned in it too (not in x's FP8 dtype).
    residual: None, or an array of x's shape (float32, bfloat16 or float16): the fused
      residual add of pre-norm transformers (flash-attention's and Quack's
      ``residual=``). The op normalises ``h = x + residual``, summed in float32, and
      returns ``(y, h)``: y in x's dtype, computed from the float32 sum; h in
      ``residual_dtype``. One pass over memory (read x and residual, write y and h);
      the backward returns dx = dresidual = (the norm's dx) + dh, added in the same
      kernel. The forward saves h, not x (as flash-attention does): the backward's
      x_hat carries h's rounding when ``residual_dtype`` is narrower than float32.
      Every backend.
    residual_dtype: h's dtype (default: residual's); ``jnp.float32`` keeps an fp32
      residual stream (flash-attention's ``residual_in_fp32``).
    post_norm_scale: None, or an [N] float array, with a residual: x is first
      RMS-normalised with it (the same eps, scale_offset and cast) and rounded to x's
      dtype, then added: ``h = residual + rms_norm(x, post_norm_scale)``, ``y =
      rms_norm(h, scale)``. Gemma 2/3's post-norm of a sublayer's output, residual add
      and next pre-norm (flax Gemma's ``post_attention_norm`` then ``pre_ffw_norm``;
      HF ``Gemma3DecoderLayer``), the same values as the two calls. Outside ``jax.vjp``
      one kernel reads x and the residual once (Pallas backend, the row in one program);
      under it, and elsewhere, the two ops' kernels (the same backward). Differentiable
      in post_norm_scale too. No FP8 x, no cast="llama".
    eps: added to the mean square; None means ``jnp.finfo(jnp.float32).eps``, as torch
      does for fp16/bf16/fp32 inputs.
    scale_offset: y = x_hat * (scale_offset + scale); 1.0 gives Gemma's zero-centred gamma.
    cast: where the casts happen, as HF transformers and Liger's ``casting_mode`` define
      them. "torch" (default): everything in float32, one cast to x's dtype at the end
      (``torch.nn.functional.rms_norm``). "llama" (HF ``LlamaRMSNorm``): x_hat computed
      in float32, cast to x's dtype, then multiplied by the weight in jnp's promotion of
      the two dtypes, which is y's dtype (float32 for bf16 x and float32 scale). "gemma"
      (HF ``GemmaRMSNorm``): "torch" times ``1 + scale`` (implies scale_offset=1.0; needs
      a scale). Every backend.
    mode: None (the heuristic picks), "multi_wave_reload", "multi_wave_cached" or
      "static_persistent".
    backend: "pallas" (default), "triton" (plain Triton through jax-triton), "xla"
      (the jnp reference), "mosaic" (Pallas Mosaic GPU: N a multiple of 128; mode None
      or "static_persistent"; no FP8 x or sharded hidden dim yet; docs/mosaic.md), or
      None: per kernel (forward, backward), the backend that measured faster on this
      GPU and serves the call, with scale/bias in x's dtype;
      else "pallas" (``config.choose_backend``, docs/tuning_rules.md#backend; on CPU too).
    interpret: None runs Pallas interpret mode when there is no GPU; True/False force it.
    axis_name: inside ``jax.shard_map`` only: a mesh axis name (or a tuple of them) over
      which x's last axis is split, as flax's ``axis_name``: the statistics are those
      of the whole row, the concatenation of the shards' rows (equal-sized shards; a
      ``pmean`` of per-shard partial statistics). Not needed for arrays sharded under
      ``jax.jit``: rows sharded over any mesh axes, and the last axis sharded (tensor
      parallel, scale sharded alike or replicated), are served without it, on Auto and
      Explicit meshes, with no all-gather (``pallas_norm.spmd``).
    axis_index_groups: with ``axis_name``: groups of axis indices reduced separately,
      as in ``jax.lax.pmean``.
    param_cast: None, or float32 / bfloat16 / float16: scale (and bias) are used as
      ``scale.astype(param_cast)`` (flax's ``promote_dtype`` of a float32 scale to a
      bfloat16 ``dtype``): the same values, but the Pallas kernels round them as they
      load them, so the cast costs no kernel of its own (at decode sizes a kernel
      launch is a norm's cost); their cotangents are that cast's transpose (rounded to
      param_cast, returned in the parameters' dtype). Other backends, FP8 x and
      cast="llama" cast up front.

  Returns:
    y: [..., N] with x's dtype (FP8 x: ``out_dtype``) and sharding; ``(y, h)`` with a
    residual. Differentiable in x, residual and scale (custom_vjp; higher orders too,
    their derivatives from the jnp math); dx has x's sharding, dscale scale's. FP8 x is
    sharded as a float x is (rows, or the hidden dim with N // group_size divisible by
    its shards), x_scale laid out like x.

  Raises:
    ValueError: rank 0, N == 0, a scale shape other than (N,), a residual shape other
      than x's (or a residual_dtype without a residual), an unknown cast, cast="gemma"
      without a scale or with a scale_offset other than 0 or 1, cast="llama" with a
      scale_offset, eps < 0 or not finite, a scale_offset that is not finite or is not
      0 without a scale; a post_norm_scale without a residual, with cast="llama" or
      FP8 x, or of a shape other than (N,); FP8 x without x_scale, with a residual or
      with cast="llama",
      x_scale, out_dtype or a group_size other than 16 with a float x, a group_size not one
      of the above or does not divide N, an x_scale shape other than
      ``x.shape[:-1] + (N // group_size,)``; an unknown
      mode or backend, an axis_name not bound by an enclosing shard_map, a
      ``check_vma=True`` shard_map in Pallas interpret mode (CPU; JAX's interpret
      lowering rejects varying-typed operands: pass ``check_vma=False``), or x sharded
      unevenly over a mesh axis (before any kernel: at trace time on an Explicit mesh;
      on an Auto mesh XLA's compilation reports it as a jax.errors.JaxRuntimeError
      carrying the same message).
    TypeError: x, scale, residual, post_norm_scale or x_scale not an array (a list, a
      Python number); integer or complex x, scale, residual or post_norm_scale, an FP8 x other than
      float8_e4m3fn / float8_e5m2; a residual_dtype or out_dtype that is not float32,
      bfloat16 or float16, or scale/bias in another dtype (FP8 included); an x_scale
      that is not float32; a group_size not an int; an eps or scale_offset that is not a
      real number (scale_offset is static: no arrays, no tracers); an interpret that is
      not None or a bool.
    NotImplementedError: mode="multi_wave_cached" for a row too long for registers: on
      the Pallas backend N > 8192 x the SM count (RMSNorm) or 4096 x the SM count
      (LayerNorm; the row is split over programs); on the Triton backend N > 32768.
      backend="mosaic" with what it does not serve (above), N not a multiple of 128, a
      row beyond one program's shared memory, or in interpret mode with several devices
      (JAX's Mosaic GPU interpreter runs on one). A symbolic dimension of x (jax.export
      shape polymorphism) on any backend but "xla".
    ImportError: backend="triton" without jax-triton and a GPU jaxlib.
  """
  if eps is None:
    eps = float(jnp.finfo(jnp.float32).eps)
  return _norm("rms_norm", x, scale, None, eps=eps, scale_offset=scale_offset,
               subtract_mean=False, mode=mode, backend=backend, interpret=interpret,
               axis_name=axis_name, axis_index_groups=axis_index_groups,
               residual=residual, residual_dtype=residual_dtype, cast=cast,
               x_scale=x_scale, group_size=group_size, out_dtype=out_dtype,
               param_cast=param_cast, post_norm_scale=post_norm_scale)


def layer_norm(x, scale=None, bias=None, *, x_scale=None, group_size=16, out_dtype=None,
               residual=None, residual_dtype=None, eps=1e-5, scale_offset=0.0, cast="torch",
               mode=None, backend="pallas", interpret=None, axis_name=None,
               axis_index_groups=None, param_cast=None):
  """Layer normalisation over the last axis (Ba et al., 2016,
  https://arxiv.org/abs/1607.06450). Matches ``torch.nn.functional.layer_norm`` over
  the last dimension.

  ``y = (x - mean) / sqrt(var + eps) * (scale_offset + scale) + bias``; the variance is
  biased and computed in float32 without ``E[x^2] - E[x]^2``.

  Args:
    x: [..., N] float32, bfloat16 or float16, any rank >= 1; M = prod(x.shape[:-1]) rows;
      or FP8 with ``x_scale``, as in ``rms_norm``.
    scale: [N] float array or None.
    bias: [N] float array or None.
    x_scale, group_size, out_dtype: FP8 x (COAT's group-scaled input), as in
      ``rms_norm``: y = layer_norm(x.astype(f32) * repeat(x_scale, group_size)) in
      out_dtype (default bfloat16).
    residual, residual_dtype: the fused residual add, as in ``rms_norm``.
    cast: as in ``rms_norm``; "llama" adds the bias after the rounded product, in the
      promotion of x's, scale's and bias's dtypes.
    eps: added to the variance (default 1e-5, torch's; None means the same, as
      ``rms_norm``'s None means torch's default there).
    scale_offset: y = x_hat * (scale_offset + scale) + bias.
    mode, backend, interpret, axis_name, axis_index_groups: as in ``rms_norm``;
      across shards the variance is combined with Chan et al.'s formula.

  Returns:
    y: [..., N] with x's dtype (FP8 x: ``out_dtype``); ``(y, h)`` with a residual.
    Differentiable in x, residual, scale and bias (custom_vjp; higher orders too).

  Raises:
    ValueError, TypeError, NotImplementedError, ImportError: as in ``rms_norm``.
  """
  if eps is None:
    eps = 1e-5
  return _norm("layer_norm", x, scale, bias, eps=eps, scale_offset=scale_offset,
               subtract_mean=True, mode=mode, backend=backend, interpret=interpret,
               axis_name=axis_name, axis_index_groups=axis_index_groups,
               residual=residual, residual_dtype=residual_dtype, cast=cast,
               x_scale=x_scale, group_size=group_size, out_dtype=out_dtype,
               param_cast=param_cast)
