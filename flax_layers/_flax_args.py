"""The flax arguments the layers accept for drop-in compatibility, and their checks.

flax's norms take ``reduction_axes`` / ``feature_axes`` (default -1), ``use_fast_variance``
(NNX and Linen), ``force_float32_reductions`` (Linen) and a ``mask`` at call time. The
fused kernels normalise the last axis, in float32, over every element of a row, so:
the axes are accepted when they name the last axis and rejected with a ValueError
otherwise; ``use_fast_variance`` and ``force_float32_reductions`` are accepted and do
not change the math (float32 statistics, LayerNorm's variance from the centred values:
at least as accurate as either flax setting); a ``mask`` raises NotImplementedError.
All before any kernel runs.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
import typing as tp

import numpy as np

Axes = tp.Union[int, tp.Sequence[int]]  # flax's reduction_axes / feature_axes


def _axes_tuple(axes) -> tuple:
  if isinstance(axes, collections.abc.Iterable) and not isinstance(axes, str):
    return tuple(axes)
  return (axes,)


def check_axes(reduction_axes, feature_axes) -> None:
  """At construction: each of ``reduction_axes`` / ``feature_axes`` must be one int axis
  (-1, or a non-negative index checked against x's rank at call time)."""
  for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
    t = _axes_tuple(axes)
    if len(t) != 1 or not isinstance(t[0], int) or isinstance(t[0], bool) or t[0] < -1:
      raise ValueError(
          f"{name}={axes!r}: pallas_norm's layers normalise the last axis only "
          f"({name}=-1, flax's default); for other axes use flax's layer")


def check_call(x, reduction_axes, feature_axes, mask, residual) -> None:
  """At call time: the axes resolve to x's last axis; no ``mask``; a boolean
  ``residual`` is taken for flax's positional ``mask``."""
  if mask is not None:
    raise NotImplementedError(
        "mask=: pallas_norm's kernels take the statistics over every element of a row; "
        "for masked statistics use flax's layer")
  if residual is not None and getattr(getattr(residual, "dtype", None), "kind", None) == "b":
    raise TypeError(
        "the second argument is `residual` (the fused residual add), not flax's `mask`; "
        f"got a boolean array of shape {getattr(residual, 'shape', None)}. pallas_norm's "
        "layers take no mask: for masked statistics use flax's layer")
  ndim = len(x.shape)
  for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
    (axis,) = _axes_tuple(axes)
    if ndim and axis != -1 and axis != ndim - 1:
      raise ValueError(
          f"{name}={axes!r} on x of rank {ndim}: pallas_norm's layers normalise the last "
          f"axis only ({name}=-1 or {ndim - 1}); for other axes use flax's layer")



def _real(layer: str, name: str, v, *, non_negative: bool = False) -> float:
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating,
                                                           np.integer)):
    raise TypeError(f"{layer}: {name} must be a real number, got {v!r}")
  try:
    f = float(v)
  except OverflowError:
    f = math.inf
  if not math.isfinite(f) or (non_negative and f < 0):
    raise ValueError(f"{layer}: {name}={v!r} must be finite"
                     + (" and >= 0" if non_negative else ""))
  return f


def check_config(layer: str, *, features: dict, epsilon, scale_offset, cast=None,
                 mode=None, backend=None, residual_dtype=None) -> None:
  """At construction (NNX) or at the first call (Linen): the layer's own arguments,
  each error naming the layer and the argument, before any kernel. ``features``:
  {name: value} of the feature counts (positive ints)."""
  from pallas_norm import config as _config
  from pallas_norm import ops as _ops
  for name, v in features.items():
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{layer}: {name}={v!r} must be a positive int")
  _real(layer, "epsilon", epsilon, non_negative=True)
  _real(layer, "scale_offset", scale_offset)
  if cast is not None and (not isinstance(cast, str) or cast not in _ops.CASTS):
    raise ValueError(f"{layer}: {cast=} is not a casting mode; valid: {_ops.CASTS}")
  if mode is not None and mode not in _config.MODES:
    raise ValueError(f"{layer}: {mode=} is not a valid mode; valid modes: {_config.MODES} "
                     f"or None")
  if backend is not None and backend not in _ops.BACKENDS:
    raise ValueError(f"{layer}: {backend=} is not a valid backend; valid backends: "
                     f"{_ops.BACKENDS} or None")
  if residual_dtype is not None:
    import jax.numpy as jnp
    try:
      dt = jnp.dtype(residual_dtype)
    except TypeError as e:
      raise TypeError(f"{layer}: {residual_dtype=} is not a dtype") from e
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise TypeError(f"{layer}: residual_dtype={dt} must be float32, bfloat16 or float16")
