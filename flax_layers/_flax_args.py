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


def check_config(layer: str, *, features: dict, epsilon, scale_offset, cast=None,
                 mode=None, backend=None, residual_dtype=None) -> None:
  """At construction (NNX) or at the first call (Linen): the layer's own arguments,
  with the ops' checks (``pallas_norm.ops``), each error naming the layer and the
  argument, before any kernel. ``features``: {name: value} of the feature counts
  (positive ints)."""
  from pallas_norm import ops as _ops
  for name, v in features.items():
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{layer}: {name}={v!r} must be a positive int")
  _ops._check_real(layer, "epsilon", epsilon, non_negative=True)
  _ops._check_real(layer, "scale_offset", scale_offset)
  if cast is not None:
    _ops._check_cast_name(layer, cast)
  _ops._check_mode_backend(layer, mode, backend)
  if residual_dtype is not None:
    _ops._check_residual_dtype(layer, residual_dtype)
