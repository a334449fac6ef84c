"""Flax NNX layers backed by the fused ``pallas_norm`` ops.

``RMSNorm`` and ``LayerNorm`` take the same constructor arguments, create the same
parameters (``scale``, ``bias``: names, shapes, dtypes, initialisers and rng draws) and
promote dtypes the same way as ``flax.nnx.RMSNorm`` / ``flax.nnx.LayerNorm``, so they
drop into a model built for flax's layers. They add ``scale_offset``, ``mode`` and
``backend``, which pass through to ``pallas_norm.rms_norm`` / ``layer_norm``.
The Linen twins live in ``flax_layers.linen``. ``RMSNormDenseFP8`` / ``LayerNormDenseFP8``
(``flax_layers.fp8``) fuse a norm with the FP8 dense layer it feeds.

Multi-device: under ``jax.jit`` with sharded activations (rows and/or the hidden dim)
the layers need nothing: the ops serve the sharding as it is. ``axis_name`` and
``axis_index_groups`` have flax's meaning, inside ``jax.shard_map``: the statistics are
reduced over that mesh axis. Params may carry ``nnx.with_partitioning`` metadata.

Every argument of flax's layers is accepted. Differences from flax: the normalised axis
is always the last one (``reduction_axes`` / ``feature_axes`` other than the last axis:
ValueError); ``mask`` is not supported (NotImplementedError); ``use_fast_variance`` does
not change the math: the statistics are float32 and LayerNorm's variance is that of the
centred values, at least as accurate as either flax setting.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as _dtypes

from flax_layers import _flax_args, linen
from flax_layers.fp8 import Fp8Meta, LayerNormDenseFP8, RMSNormDenseFP8, update_fp8_meta
from pallas_norm import ops as _ops

__all__ = ["RMSNorm", "LayerNorm", "RMSNormDenseFP8", "LayerNormDenseFP8", "Fp8Meta",
           "update_fp8_meta", "linen"]


def _maybe_param(use: bool, init, rngs: nnx.Rngs, num_features: int, param_dtype,
                 metadata=MappingProxyType({})):
  """A [num_features] Param with flax's ``*_metadata``, drawing one ``rngs.params()`` key
  only when used (as flax)."""
  if not use:
    return nnx.data(None)
  return nnx.Param(init(rngs.params(), (num_features,), param_dtype), **metadata)


def _residual(layer, residual) -> dict:
  """The ops' residual arguments of a call (none without a residual: a drop-in)."""
  if residual is None:
    return {}
  return dict(residual=residual, residual_dtype=layer.residual_dtype)


class _Norm(nnx.Module):
  """The scale and the attributes RMSNorm and LayerNorm share (RMSNorm's arguments)."""

  def __init__(
      self,
      num_features: int,
      *,
      epsilon: float = 1e-6,
      dtype: tp.Any | None = None,
      param_dtype: tp.Any = jnp.float32,
      use_scale: bool = True,
      scale_init: nnx.Initializer = nnx.initializers.ones,
      scale_offset: float = 0.0,
      mode: str | None = None,
      backend: str | None = "pallas",
      reduction_axes: _flax_args.Axes = -1,
      feature_axes: _flax_args.Axes = -1,
      axis_name: str | tuple[str, ...] | None = None,
      axis_index_groups: tp.Any = None,
      use_fast_variance: bool = True,
      promote_dtype: tp.Callable = _dtypes.promote_dtype,
      residual_dtype: tp.Any | None = None,
      cast: str = "torch",
      rngs: nnx.Rngs,
      scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
  ):
    _flax_args.check_axes(reduction_axes, feature_axes)
    _flax_args.check_config(type(self).__name__, features=dict(num_features=num_features),
                            epsilon=epsilon, scale_offset=scale_offset, cast=cast,
                            mode=mode, backend=backend, residual_dtype=residual_dtype)
    if cast == "llama" and promote_dtype is not _dtypes.promote_dtype:
      raise ValueError(
          "cast='llama' keeps x's dtype (HF's LlamaRMSNorm rounds x_hat to it) and casts "
          "the params to `dtype`: a custom promote_dtype does not apply; pass one or the other")
    self.scale: nnx.Param[jax.Array] | None = _maybe_param(use_scale, scale_init, rngs,
                                                            num_features, param_dtype,
                                                            scale_metadata)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_scale = use_scale
    self.scale_offset = scale_offset
    self.mode = mode
    self.backend = backend
    self.reduction_axes = reduction_axes
    self.feature_axes = feature_axes
    self.axis_name = axis_name
    self.axis_index_groups = axis_index_groups
    self.use_fast_variance = use_fast_variance
    self.promote_dtype = promote_dtype
    self.residual_dtype = residual_dtype
    self.cast = cast

  def _inputs(self, x, residual, mask, *params):
    """Checks the call (flax's axes and mask), then (x, *params, param_cast) for the op:
    ``promote_dtype`` (flax's promotion to ``dtype`` by default); under cast="llama" x
    keeps its dtype (HF rounds x_hat to it) and the params are cast to ``dtype``. With
    flax's promote_dtype, a ``dtype`` and the Pallas backend, the params' cast to
    ``dtype`` is the op's ``param_cast`` (done as the kernels load them: the same values
    with no kernel of its own; else None)."""
    _flax_args.check_call(x, self.reduction_axes, self.feature_axes, mask, residual)
    if self.cast == "llama":
      return (x, *(p if p is None or self.dtype is None else p.astype(self.dtype)
                   for p in params), None)
    if (self.promote_dtype is _dtypes.promote_dtype and self.dtype is not None
        and self.backend == "pallas"
        and any(p is not None and p.dtype != jnp.dtype(self.dtype) for p in params)):
      return (jnp.asarray(x, self.dtype), *params, jnp.dtype(self.dtype))
    return (*self.promote_dtype((x, *params), dtype=self.dtype), None)


class RMSNorm(_Norm):
  """RMS layer normalization (https://arxiv.org/abs/1910.07467), fused.

  A drop-in for ``flax.nnx.RMSNorm`` that calls ``pallas_norm.rms_norm``: it
  normalises the last axis by its root mean square, with statistics in float32, and
  multiplies by ``scale_offset + scale``.

  Example usage::

    >>> from flax import nnx
    >>> import jax
    >>> import pallas_norm

    >>> x = jax.random.normal(jax.random.key(0), (5, 6))
    >>> layer = pallas_norm.RMSNorm(num_features=6, rngs=nnx.Rngs(0))

    >>> nnx.state(layer)
    State({
      'scale': Param( # 6 (24 B)
        value=Array([1., 1., 1., 1., 1., 1.], dtype=float32)
      )
    })

    >>> y = layer(x)

  Args:
    num_features: the number of input features (the size of the last axis).
    epsilon: a small float added to the mean square to avoid dividing by zero
      (default: 1e-6, flax's).
    dtype: the dtype of the result (default: None, the result type of the input
      and the parameters, as in flax); with cast="llama" the result is jnp's promotion
      of x's dtype and ``dtype`` (the params are cast to ``dtype``, x is not: HF's
      LlamaRMSNorm), so bf16 x with dtype=bf16 gives bf16, float32 x float32.
    param_dtype: the dtype passed to parameter initializers (default: float32).
    use_scale: if True (default), multiply by ``scale_offset + scale``.
    scale_init: initializer for scale (default: ones).
    scale_offset: y = x_hat * (scale_offset + scale) (default: 0.0); use 1.0 with
      ``scale_init=nnx.initializers.zeros`` for Gemma's zero-centred gamma.
    mode: the kernel mode, passed to ``pallas_norm.rms_norm`` (default: None, the
      heuristic picks).
    backend: "pallas" (default), "triton", "mosaic", "xla" or None (per kernel, the
      backend measured faster on this GPU), passed to ``pallas_norm.rms_norm``.
    axis_name: inside ``jax.shard_map``, the mesh axis (or axes) over which the
      features are split: the statistics are those of the whole feature vector, as in
      flax (default: None). Sharded arrays under ``jax.jit`` do not need it.
    axis_index_groups: groups of axis indices reduced separately, as in flax
      (default: None).
    residual_dtype: with ``layer(x, residual=r)``: the dtype of the returned residual
      stream h (default: None, r's dtype; ``jnp.float32`` is flash-attention's
      ``residual_in_fp32``). r is not cast by ``dtype``; x is, first, as flax.nnx casts
      its input (so x wider than ``dtype`` is rounded before h = x + r: pass x in the
      dtype the sum should see; the Linen twin, as flax.linen, keeps x as given).
    cast: "torch" (default), "llama" or "gemma": where the casts happen, as in
      ``pallas_norm.rms_norm`` (HF's LlamaRMSNorm and GemmaRMSNorm; "gemma" implies
      ``scale_offset=1.0``, use it with ``scale_init=nnx.initializers.zeros``). Under
      "llama" x is not promoted: y's dtype is that of x times the weight.
    reduction_axes, feature_axes: flax's; the last axis only (-1, the default, or
      ``x.ndim - 1``); any other raises ValueError.
    use_fast_variance: accepted for flax compatibility; no effect (the statistics are
      float32, LayerNorm's variance that of the centred values).
    promote_dtype: the function that promotes ``(x, scale[, bias])`` to ``dtype``
      (default: flax's ``promote_dtype``); not with ``cast="llama"`` (ValueError).
    rngs: rng key.
    scale_metadata: metadata of the ``scale`` Param, as in flax (for example
      ``{"sharding": ("model",)}`` under a mesh).
  """

  def __call__(self, x, residual=None, *, mask=None, post_norm=None):
    """Normalises ``x: [..., num_features]``; returns the same shape.

    With ``residual`` (x's shape), the fused residual add of a pre-norm block: returns
    ``(y, h)``, h = x + residual (in ``residual_dtype``) and y = the norm of h
    (``pallas_norm.rms_norm(..., residual=)``). ``mask`` (flax's) is not supported:
    anything but None raises NotImplementedError.

    ``post_norm`` (with a residual): another ``RMSNorm`` of the same configuration
    (epsilon, dtype, param_dtype, scale_offset, cast, backend, mode, axes, promote_dtype)
    applied to x first: ``layer(x, h, post_norm=post)`` returns what ``layer(post(x),
    h)`` returns, Gemma 2/3's post-norm, residual add and pre-norm in one kernel
    (``pallas_norm.rms_norm(..., post_norm_scale=)``); post's scale gets its gradient.
    ValueError for a post_norm without a residual, not an RMSNorm, without a scale, or
    configured otherwise.
    """
    scale = None if self.scale is None else self.scale[...]
    if post_norm is None:
      x, scale, param_cast = self._inputs(x, residual, mask, scale)
      extra = {}
    else:
      self._check_post_norm(post_norm, residual)
      x, scale, post_scale, param_cast = self._inputs(x, residual, mask, scale,
                                                      post_norm.scale[...])
      extra = dict(post_norm_scale=post_scale)
    return _ops.rms_norm(x, scale, eps=float(self.epsilon), cast=self.cast,
                         param_cast=param_cast,
                         scale_offset=float(self.scale_offset), mode=self.mode,
                         backend=self.backend, axis_name=self.axis_name,
                         axis_index_groups=self.axis_index_groups, **_residual(self, residual),
                         **extra)

  _POST_NORM_FIELDS = ("num_features", "epsilon", "dtype", "param_dtype", "scale_offset",
                       "cast", "backend", "mode", "reduction_axes", "feature_axes",
                       "axis_name", "axis_index_groups", "promote_dtype")

  def _check_post_norm(self, post_norm, residual) -> None:
    if residual is None:
      raise ValueError("post_norm normalises x before the residual add: pass a residual")
    if not isinstance(post_norm, RMSNorm) or post_norm.scale is None:
      raise ValueError(f"post_norm must be a pallas_norm.RMSNorm with a scale, got "
                       f"{type(post_norm).__name__}"
                       + (" without a scale" if isinstance(post_norm, RMSNorm) else ""))
    diff = [f for f in self._POST_NORM_FIELDS if getattr(post_norm, f) != getattr(self, f)]
    if diff:
      raise ValueError(f"post_norm must be configured as this layer (one kernel runs "
                       f"both norms); it differs in {diff}")


class LayerNorm(_Norm):
  """Layer normalization (https://arxiv.org/abs/1607.06450), fused.

  A drop-in for ``flax.nnx.LayerNorm`` that calls ``pallas_norm.layer_norm``: it
  subtracts the mean of the last axis, divides by its standard deviation (float32
  statistics), multiplies by ``scale_offset + scale`` and adds ``bias``.

  Example usage::

    >>> from flax import nnx
    >>> import jax
    >>> import pallas_norm

    >>> x = jax.random.normal(jax.random.key(0), (3, 4, 5, 6))
    >>> layer = pallas_norm.LayerNorm(num_features=6, rngs=nnx.Rngs(0))

    >>> nnx.state(layer)
    State({
      'bias': Param( # 6 (24 B)
        value=Array([0., 0., 0., 0., 0., 0.], dtype=float32)
      ),
      'scale': Param( # 6 (24 B)
        value=Array([1., 1., 1., 1., 1., 1.], dtype=float32)
      )
    })

    >>> y = layer(x)

  Args:
    num_features: the number of input features (the size of the last axis).
    epsilon: a small float added to the variance to avoid dividing by zero
      (default: 1e-6, flax's).
    dtype: the dtype of the result (default: None, the result type of the input
      and the parameters, as in flax); with cast="llama" the result is jnp's promotion
      of x's dtype and ``dtype`` (the params are cast to ``dtype``, x is not: HF's
      LlamaRMSNorm), so bf16 x with dtype=bf16 gives bf16, float32 x float32.
    param_dtype: the dtype passed to parameter initializers (default: float32).
    use_bias: if True (default), add ``bias`` (beta).
    use_scale: if True (default), multiply by ``scale_offset + scale`` (gamma).
    bias_init: initializer for bias (default: zeros).
    scale_init: initializer for scale (default: ones).
    scale_offset: y = x_hat * (scale_offset + scale) + bias (default: 0.0).
    mode: the kernel mode, passed to ``pallas_norm.layer_norm`` (default: None, the
      heuristic picks).
    backend: "pallas" (default), "triton", "mosaic", "xla" or None (per kernel, the
      backend measured faster on this GPU), passed to ``pallas_norm.layer_norm``.
    axis_name, axis_index_groups: as in ``RMSNorm`` (flax's meaning).
    residual_dtype, cast: as in ``RMSNorm``.
    reduction_axes, feature_axes, use_fast_variance, promote_dtype: as in ``RMSNorm``.
    rngs: rng key.
    bias_metadata, scale_metadata: metadata of the ``bias`` / ``scale`` Params, as in
      flax.
  """

  def __init__(
      self,
      num_features: int,
      *,
      epsilon: float = 1e-6,
      dtype: tp.Any | None = None,
      param_dtype: tp.Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
      scale_init: nnx.Initializer = nnx.initializers.ones_init(),
      scale_offset: float = 0.0,
      mode: str | None = None,
      backend: str | None = "pallas",
      axis_name: str | tuple[str, ...] | None = None,
      axis_index_groups: tp.Any = None,
      residual_dtype: tp.Any | None = None,
      cast: str = "torch",
      reduction_axes: _flax_args.Axes = -1,
      feature_axes: _flax_args.Axes = -1,
      use_fast_variance: bool = True,
      promote_dtype: tp.Callable = _dtypes.promote_dtype,
      rngs: nnx.Rngs,
      bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
  ):
    super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                     use_scale=use_scale, scale_init=scale_init, scale_offset=scale_offset,
                     mode=mode, backend=backend, reduction_axes=reduction_axes,
                     feature_axes=feature_axes, axis_name=axis_name,
                     axis_index_groups=axis_index_groups,
                     use_fast_variance=use_fast_variance, promote_dtype=promote_dtype,
                     residual_dtype=residual_dtype, cast=cast, rngs=rngs,
                     scale_metadata=scale_metadata)
    self.bias: nnx.Param[jax.Array] | None = _maybe_param(use_bias, bias_init, rngs,
                                                           num_features, param_dtype,
                                                           bias_metadata)
    self.use_bias = use_bias

  def __call__(self, x, residual=None, *, mask=None):
    """Normalises ``x: [..., num_features]``; returns the same shape, or ``(y, h)``
    with a ``residual`` (as ``RMSNorm``; ``mask``: NotImplementedError unless None)."""
    scale = None if self.scale is None else self.scale[...]
    bias = None if self.bias is None else self.bias[...]
    x, scale, bias, param_cast = self._inputs(x, residual, mask, scale, bias)
    return _ops.layer_norm(x, scale, bias, eps=float(self.epsilon), cast=self.cast,
                           param_cast=param_cast,
                           scale_offset=float(self.scale_offset), mode=self.mode,
                           backend=self.backend, axis_name=self.axis_name,
                           axis_index_groups=self.axis_index_groups,
                           **_residual(self, residual))

