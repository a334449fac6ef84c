"""Flax Linen layers backed by the fused ``pallas_norm`` ops.

``RMSNorm`` and ``LayerNorm`` take the same attributes and create the same ``params``
collection (``scale``, ``bias``: names, shapes, dtypes and initialisers) as
``flax.linen.RMSNorm`` / ``flax.linen.LayerNorm``. The result dtype follows flax:
``dtype`` if given, otherwise the result type of the input and the parameters. They
add ``scale_offset``, ``mode`` and ``backend``, which pass through to
``pallas_norm.rms_norm`` / ``layer_norm``. The normalised axis is always the last one.
``axis_name`` / ``axis_index_groups`` have flax's meaning (inside ``jax.shard_map``);
sharded arrays under ``jax.jit`` need neither.
"""

from __future__ import annotations

import typing as tp

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes as _dtypes
from flax.linen import initializers

from pallas_norm import ops as _ops

__all__ = ["RMSNorm", "LayerNorm"]


def _params_and_input(mdl: nn.Module, x, names: tuple[str, ...], inits, uses):
  """Creates the [N] params named ``names`` and casts x to the result dtype (under
  cast="llama": x keeps its dtype, the params are cast to ``dtype`` if given)."""
  feature_shape = (jnp.shape(x)[-1],)
  params = [mdl.param(name, init, feature_shape, mdl.param_dtype) if use else None
            for name, init, use in zip(names, inits, uses)]
  if mdl.cast == "llama":
    return x, [p if p is None or mdl.dtype is None else p.astype(mdl.dtype) for p in params]
  dtype = _dtypes.canonicalize_dtype(x, *params, dtype=mdl.dtype)
  return jnp.asarray(x, dtype), params


def _axis_args(mdl: nn.Module) -> dict:
  """axis_name / axis_index_groups, dropped while initializing (as flax's layers do:
  ``init`` usually runs outside the shard_map that binds the axis)."""
  if mdl.is_initializing() or mdl.axis_name is None:
    return {}
  return dict(axis_name=mdl.axis_name, axis_index_groups=mdl.axis_index_groups)


def _residual(mdl: nn.Module, residual) -> dict:
  """The ops' residual arguments of a call (none without a residual: a drop-in)."""
  if residual is None:
    return {}
  return dict(residual=residual, residual_dtype=mdl.residual_dtype)


class RMSNorm(nn.Module):
  """RMS layer normalization (https://arxiv.org/abs/1910.07467), fused.

  A drop-in for ``flax.linen.RMSNorm`` that calls ``pallas_norm.rms_norm``.

  Example usage::

    >>> import jax
    >>> from flax_layers import linen

    >>> x = jax.random.normal(jax.random.key(0), (5, 6))
    >>> layer = linen.RMSNorm()
    >>> variables = layer.init(jax.random.key(1), x)
    >>> variables
    {'params': {'scale': Array([1., 1., 1., 1., 1., 1.], dtype=float32)}}
    >>> y = layer.apply(variables, x)

  Args:
    epsilon: a small float added to the mean square to avoid dividing by zero
      (default: 1e-6, flax's).
    dtype: the dtype of the result (default: None, the result type of the input
      and the parameters, as in flax).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    use_scale: if True (default), multiply by ``scale_offset + scale``.
    scale_init: initializer for scale (default: ones).
    scale_offset: y = x_hat * (scale_offset + scale) (default: 0.0).
    mode: the kernel mode, passed to ``pallas_norm.rms_norm`` (default: None, the
      heuristic picks).
    backend: "pallas" (default), "triton" or "xla".
    axis_name: inside ``jax.shard_map``, the mesh axis (or axes) over which the
      features are split; the statistics are the whole vector's, as in flax.
    axis_index_groups: groups of axis indices reduced separately, as in flax.
    residual_dtype: with ``layer.apply(variables, x, residual=r)``: the dtype of the
      returned residual stream h (default: None, r's dtype).
    cast: "torch" (default), "llama" or "gemma", as in ``pallas_norm.rms_norm``; under
      "llama" x keeps its dtype and the params are cast to ``dtype`` (if given).
  """

  epsilon: float = 1e-6
  dtype: tp.Any | None = None
  param_dtype: tp.Any = jnp.float32
  use_scale: bool = True
  scale_init: initializers.Initializer = initializers.ones
  scale_offset: float = 0.0
  mode: str | None = None
  backend: str = "pallas"
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: tp.Any = None
  residual_dtype: tp.Any | None = None
  cast: str = "torch"

  @nn.compact
  def __call__(self, x, residual=None):
    """Normalises ``x: [..., N]``; returns the same shape. With ``residual`` (x's
    shape): ``(y, h)``, h = x + residual, y = the norm of h (the fused add)."""
    x, (scale,) = _params_and_input(self, x, ("scale",), (self.scale_init,),
                                    (self.use_scale,))
    return _ops.rms_norm(x, scale, eps=float(self.epsilon), cast=self.cast,
                         scale_offset=float(self.scale_offset), mode=self.mode,
                         backend=self.backend, **_axis_args(self),
                         **_residual(self, residual))


class LayerNorm(nn.Module):
  """Layer normalization (https://arxiv.org/abs/1607.06450), fused.

  A drop-in for ``flax.linen.LayerNorm`` that calls ``pallas_norm.layer_norm``.

  Example usage::

    >>> import jax
    >>> from flax_layers import linen

    >>> x = jax.random.normal(jax.random.key(0), (3, 4, 5, 6))
    >>> layer = linen.LayerNorm()
    >>> variables = layer.init(jax.random.key(1), x)
    >>> variables
    {'params': {'scale': Array([1., 1., 1., 1., 1., 1.], dtype=float32), 'bias': Array([0., 0., 0., 0., 0., 0.], dtype=float32)}}
    >>> y = layer.apply(variables, x)

  Args:
    epsilon: a small float added to the variance to avoid dividing by zero
      (default: 1e-6, flax's).
    dtype: the dtype of the result (default: None, the result type of the input
      and the parameters, as in flax).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    use_bias: if True (default), add ``bias`` (beta).
    use_scale: if True (default), multiply by ``scale_offset + scale`` (gamma).
    bias_init: initializer for bias (default: zeros).
    scale_init: initializer for scale (default: ones).
    scale_offset: y = x_hat * (scale_offset + scale) + bias (default: 0.0).
    mode: the kernel mode, passed to ``pallas_norm.layer_norm`` (default: None, the
      heuristic picks).
    backend: "pallas" (default), "triton" or "xla".
    axis_name, axis_index_groups: as in ``RMSNorm`` (flax's meaning).
    residual_dtype, cast: as in ``RMSNorm``.
  """

  epsilon: float = 1e-6
  dtype: tp.Any | None = None
  param_dtype: tp.Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: initializers.Initializer = initializers.zeros
  scale_init: initializers.Initializer = initializers.ones
  scale_offset: float = 0.0
  mode: str | None = None
  backend: str = "pallas"
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: tp.Any = None
  residual_dtype: tp.Any | None = None
  cast: str = "torch"

  @nn.compact
  def __call__(self, x, residual=None):
    """Normalises ``x: [..., N]``; returns the same shape, or ``(y, h)`` with a
    ``residual`` (as ``RMSNorm``)."""
    x, (scale, bias) = _params_and_input(self, x, ("scale", "bias"),
                                         (self.scale_init, self.bias_init),
                                         (self.use_scale, self.use_bias))
    return _ops.layer_norm(x, scale, bias, eps=float(self.epsilon), cast=self.cast,
                           scale_offset=float(self.scale_offset), mode=self.mode,
                           backend=self.backend, **_axis_args(self),
                           **_residual(self, residual))
