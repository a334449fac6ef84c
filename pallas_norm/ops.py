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
from pallas_norm import reference, spmd

__all__ = ["rms_norm", "layer_norm", "BACKENDS"]

BACKENDS = ("pallas", "triton", "xla")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


# --------------------------------------------------------------------------- checks


def _check_float(name: str, a) -> None:
  dt = jnp.result_type(a)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{name}.dtype={dt} must be a floating dtype "
                    f"(float32, bfloat16 or float16)")


def _check_args(op: str, x, scale, bias, eps, mode, backend) -> int:
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} is not a valid backend; valid backends: {BACKENDS}")
  if mode is not None and mode not in _config.MODES:
    raise ValueError(f"{mode=} is not a valid mode; valid modes: {_config.MODES} or None")
  x_shape = jnp.shape(x)
  if len(x_shape) == 0:
    raise ValueError(f"{op}: x must have rank >= 1, got {x_shape=}")
  _check_float("x", x)
  if jnp.result_type(x) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{op}: x.dtype={jnp.result_type(x)} must be float32, bfloat16 or float16")
  n = x_shape[-1]
  if n == 0:
    raise ValueError(f"{op}: the normalised axis is empty: {x_shape=} has N=0")
  for name, p in (("scale", scale), ("bias", bias)):
    if p is None:
      continue
    _check_float(name, p)
    if tuple(jnp.shape(p)) != (n,):
      raise ValueError(f"{op}: {name}.shape={tuple(jnp.shape(p))} must be ({n},) to match "
                       f"x.shape[-1] ({x_shape=})")
  if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, np.floating, np.integer)):
    raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
  if not eps >= 0:  # also catches NaN
    raise ValueError(f"{op}: {eps=} must be >= 0")
  return n


def _resolve_interpret(interpret: bool | None) -> bool:
  if interpret is None:
    return _config.device_info().platform != "gpu"
  return bool(interpret)


# --------------------------------------------------------------------------- launchers


def _backend_module(backend: str):
  if backend == "pallas":
    from pallas_norm.kernels import backward, forward
    return forward, backward
  from pallas_norm.kernels import jax_triton
  return jax_triton, jax_triton


def _forward(x2, scale, bias, st: _Static, return_residuals: bool = True,
             combine_stats=None):
  """x2: [M, N] -> (y [M, N] x.dtype, mean [M] f32 | None, rstd [M] f32 | None).

  ``combine_stats`` (x2 a shard of the hidden dim, spmd.py): ``(s1, s2) -> (mean, rstd)``
  of the whole rows from this shard's statistics; the forward is then the statistics
  kernel, that function, and the normalise kernel.
  """
  m, n = x2.shape
  cfg = _config.forward_config(m, n, x2.dtype, st.mode, subtract_mean=st.subtract_mean,
                               backend=st.backend)
  fwd, _ = _backend_module(st.backend)
  if combine_stats is None:
    return fwd.norm_forward(x2, scale, bias, eps=st.eps, scale_offset=st.scale_offset,
                            subtract_mean=st.subtract_mean, config=cfg,
                            interpret=st.interpret, return_residuals=return_residuals)
  s1, s2 = fwd.norm_forward_stats(x2, subtract_mean=st.subtract_mean, config=cfg,
                                  interpret=st.interpret)
  mean, rstd = combine_stats(s1, s2)
  y = fwd.norm_forward_apply(x2, scale, bias, mean, rstd, scale_offset=st.scale_offset,
                             config=cfg, interpret=st.interpret)
  return (y, mean, rstd) if return_residuals else (y, None, None)


def _backward(dy, x2, scale, bias, mean, rstd, st: _Static, combine_row_sums=None,
              param_grad_dtype=None):
  """-> (dx [M, N] x.dtype, dscale [N] | None, dbias [N] | None), dscale and dbias in
  ``param_grad_dtype`` if given, else in scale's and bias's dtypes. ``combine_row_sums``:
  as in kernels.backward.norm_backward (x2 a shard of the hidden dim)."""
  m, n = x2.shape
  cfg = _config.backward_config(m, n, x2.dtype, subtract_mean=st.subtract_mean,
                               backend=st.backend)
  _, bwd = _backend_module(st.backend)
  dtype = lambda p: None if p is None else (param_grad_dtype or p.dtype)
  return bwd.norm_backward(dy, x2, scale, mean, rstd,
                           has_bias=bias is not None,
                           scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
                           config=cfg, interpret=st.interpret,
                           scale_dtype=dtype(scale), bias_dtype=dtype(bias),
                           combine_row_sums=combine_row_sums)


# --------------------------------------------------------------------------- custom_vjp


# x is [..., N] (rank >= 2) here, not [M, N]: the leading axes may be sharded, and
# spmd.py runs the launchers on each device's rows (and columns).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm_nd(x, scale, bias, st: _Static):
  return spmd.forward(_forward, x, scale, bias, st, return_residuals=False)[0]


def _norm_nd_fwd(x, scale, bias, st: _Static):
  y, mean, rstd = spmd.forward(_forward, x, scale, bias, st, return_residuals=True)
  return y, (x, scale, bias, mean, rstd)


def _norm_nd_bwd(st: _Static, res, dy):
  x, scale, bias, mean, rstd = res
  return spmd.backward(_backward, dy, x, scale, bias, mean, rstd, st)


_norm_nd.defvjp(_norm_nd_fwd, _norm_nd_bwd)
# Jitted, so that an eager call on sharded arrays is partitioned as it is under the
# caller's jit (custom_partitioning runs its rule only when XLA compiles it).
_norm_nd_jit = jax.jit(_norm_nd, static_argnums=(3,))


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


def _norm(op, x, scale, bias, *, eps, scale_offset, subtract_mean, mode, backend, interpret,
          axis_name, axis_index_groups):
  _check_args(op, x, scale, bias, eps, mode, backend)
  names, groups = _axis_groups(axis_name, axis_index_groups)
  x = jnp.asarray(x)
  if backend == "xla":
    return reference.norm(x, scale, bias, eps=eps, scale_offset=scale_offset,
                          subtract_mean=subtract_mean, axis_name=names,
                          axis_index_groups=groups)[0]
  m = math.prod(x.shape[:-1])
  if m == 0:
    return jnp.zeros(x.shape, x.dtype)
  if names is not None:
    spmd.check_vma_off(x, axis_name)
  st = _Static(float(eps), float(scale_offset), subtract_mean, mode, backend,
               _resolve_interpret(interpret), names, groups)
  if x.ndim == 1:
    return _norm_nd_jit(x[None], scale, bias, st)[0]
  return _norm_nd_jit(x, scale, bias, st)


# --------------------------------------------------------------------------- public ops


def rms_norm(x, scale=None, *, eps=None, scale_offset=0.0, mode=None, backend="pallas",
             interpret=None, axis_name=None, axis_index_groups=None):
  """Root-mean-square normalisation over the last axis (Zhang & Sennrich, 2019,
  https://arxiv.org/abs/1910.07467). Matches ``torch.nn.functional.rms_norm``.

  ``y = x / sqrt(mean(x**2) + eps) * (scale_offset + scale)``, statistics in float32.

  Args:
    x: [..., N] float32, bfloat16 or float16, any rank >= 1; M = prod(x.shape[:-1]) rows.
    scale: [N] float array or None (no scale).
    eps: added to the mean square; None means ``jnp.finfo(jnp.float32).eps``, as torch
      does for fp16/bf16/fp32 inputs.
    scale_offset: y = x_hat * (scale_offset + scale); 1.0 gives Gemma's zero-centred gamma.
    mode: None (the heuristic picks), "multi_wave_reload", "multi_wave_cached" or
      "static_persistent".
    backend: "pallas" (default), "triton" (plain Triton through jax-triton) or "xla"
      (the jnp reference).
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

  Returns:
    y: [..., N] with x's dtype and sharding. Differentiable in x and scale (custom_vjp);
    dx has x's sharding, dscale scale's.

  Raises:
    ValueError: rank 0, N == 0, a scale shape other than (N,), eps < 0, an unknown
      mode or backend, an axis_name not bound by an enclosing shard_map (or one whose
      shard_map has check_vma=True; pass check_vma=False there), or x sharded
      unevenly over a mesh axis (raised at trace/compile time, before any kernel).
    TypeError: integer or complex x or scale.
    NotImplementedError: mode="multi_wave_cached" for a row too long for registers: on
      the Pallas backend N > 8192 x the SM count (RMSNorm) or 4096 x the SM count
      (LayerNorm; the row is split over programs); on the Triton backend N > 32768.
    ImportError: backend="triton" without jax-triton and a GPU jaxlib.
  """
  if eps is None:
    eps = float(jnp.finfo(jnp.float32).eps)
  return _norm("rms_norm", x, scale, None, eps=eps, scale_offset=scale_offset,
               subtract_mean=False, mode=mode, backend=backend, interpret=interpret,
               axis_name=axis_name, axis_index_groups=axis_index_groups)


def layer_norm(x, scale=None, bias=None, *, eps=1e-5, scale_offset=0.0, mode=None,
               backend="pallas", interpret=None, axis_name=None, axis_index_groups=None):
  """Layer normalisation over the last axis (Ba et al., 2016,
  https://arxiv.org/abs/1607.06450). Matches ``torch.nn.functional.layer_norm`` over
  the last dimension.

  ``y = (x - mean) / sqrt(var + eps) * (scale_offset + scale) + bias``; the variance is
  biased and computed in float32 without ``E[x^2] - E[x]^2``.

  Args:
    x: [..., N] float32, bfloat16 or float16, any rank >= 1; M = prod(x.shape[:-1]) rows.
    scale: [N] float array or None.
    bias: [N] float array or None.
    eps: added to the variance (default 1e-5, torch's).
    scale_offset: y = x_hat * (scale_offset + scale) + bias.
    mode, backend, interpret, axis_name, axis_index_groups: as in ``rms_norm``;
      across shards the variance is combined with Chan et al.'s formula.

  Returns:
    y: [..., N] with x's dtype. Differentiable in x, scale and bias (custom_vjp).

  Raises:
    ValueError, TypeError, NotImplementedError, ImportError: as in ``rms_norm``.
  """
  return _norm("layer_norm", x, scale, bias, eps=eps, scale_offset=scale_offset,
               subtract_mean=True, mode=mode, backend=backend, interpret=interpret,
               axis_name=axis_name, axis_index_groups=axis_index_groups)
