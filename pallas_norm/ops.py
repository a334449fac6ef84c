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
from pallas_norm import reference

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


def _forward(x2, scale, bias, st: _Static, return_residuals: bool = True):
  """x2: [M, N] -> (y [M, N] x.dtype, mean [M] f32 | None, rstd [M] f32 | None)."""
  m, n = x2.shape
  cfg = _config.forward_config(m, n, x2.dtype, st.mode, subtract_mean=st.subtract_mean,
                               backend=st.backend)
  fwd, _ = _backend_module(st.backend)
  return fwd.norm_forward(x2, scale, bias, eps=st.eps, scale_offset=st.scale_offset,
                          subtract_mean=st.subtract_mean, config=cfg,
                          interpret=st.interpret, return_residuals=return_residuals)


def _backward(dy, x2, scale, bias, mean, rstd, st: _Static):
  """-> (dx [M, N] x.dtype, dscale [N] scale.dtype | None, dbias [N] bias.dtype | None)."""
  m, n = x2.shape
  cfg = _config.backward_config(m, n, x2.dtype, subtract_mean=st.subtract_mean,
                               backend=st.backend)
  _, bwd = _backend_module(st.backend)
  return bwd.norm_backward(dy, x2, scale, mean, rstd,
                           has_bias=bias is not None,
                           scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
                           config=cfg, interpret=st.interpret,
                           scale_dtype=None if scale is None else scale.dtype,
                           bias_dtype=None if bias is None else bias.dtype)


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm2d(x2, scale, bias, st: _Static):
  return _forward(x2, scale, bias, st, return_residuals=False)[0]


def _norm2d_fwd(x2, scale, bias, st: _Static):
  y, mean, rstd = _forward(x2, scale, bias, st)
  return y, (x2, scale, bias, mean, rstd)


def _norm2d_bwd(st: _Static, res, dy):
  x2, scale, bias, mean, rstd = res
  dx, dscale, dbias = _backward(dy, x2, scale, bias, mean, rstd, st)
  return dx, dscale, dbias


_norm2d.defvjp(_norm2d_fwd, _norm2d_bwd)


def _norm(op, x, scale, bias, *, eps, scale_offset, subtract_mean, mode, backend, interpret):
  n = _check_args(op, x, scale, bias, eps, mode, backend)
  x = jnp.asarray(x)
  if backend == "xla":
    return reference.norm(x, scale, bias, eps=eps, scale_offset=scale_offset,
                          subtract_mean=subtract_mean)[0]
  m = math.prod(x.shape[:-1])
  if m == 0:
    return jnp.zeros(x.shape, x.dtype)
  st = _Static(float(eps), float(scale_offset), subtract_mean, mode, backend,
               _resolve_interpret(interpret))
  y = _norm2d(x.reshape(m, n), scale, bias, st)
  return y.reshape(x.shape)


# --------------------------------------------------------------------------- public ops


def rms_norm(x, scale=None, *, eps=None, scale_offset=0.0, mode=None, backend="pallas",
             interpret=None):
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

  Returns:
    y: [..., N] with x's dtype. Differentiable in x and scale (custom_vjp).

  Raises:
    ValueError: rank 0, N == 0, a scale shape other than (N,), eps < 0, or an unknown
      mode or backend.
    TypeError: integer or complex x or scale.
    NotImplementedError: mode="multi_wave_cached" for a row too long for registers: on
      the Pallas backend N > 8192 x the SM count (RMSNorm) or 4096 x the SM count
      (LayerNorm; the row is split over programs); on the Triton backend N > 32768.
    ImportError: backend="triton" without jax-triton and a GPU jaxlib.
  """
  if eps is None:
    eps = float(jnp.finfo(jnp.float32).eps)
  return _norm("rms_norm", x, scale, None, eps=eps, scale_offset=scale_offset,
               subtract_mean=False, mode=mode, backend=backend, interpret=interpret)


def layer_norm(x, scale=None, bias=None, *, eps=1e-5, scale_offset=0.0, mode=None,
               backend="pallas", interpret=None):
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
    mode, backend, interpret: as in ``rms_norm``.

  Returns:
    y: [..., N] with x's dtype. Differentiable in x, scale and bias (custom_vjp).

  Raises:
    ValueError, TypeError, NotImplementedError, ImportError: as in ``rms_norm``.
  """
  return _norm("layer_norm", x, scale, bias, eps=eps, scale_offset=scale_offset,
               subtract_mean=True, mode=mode, backend=backend, interpret=interpret)
