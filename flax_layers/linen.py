"""Flax Linen layers backed by the fused ``pallas_norm`` ops.

``RMSNorm`` and ``LayerNorm`` take the same attributes and create the same ``params``
collection (``scale``, ``bias``: names, shapes, dtypes and initialisers) as
``flax.linen.RMSNorm`` / ``flax.linen.LayerNorm``. The result dtype follows flax:
``dtype`` if given, otherwise the result type of the input and the parameters. They
add ``scale_offset``, ``mode`` and ``backend``, which pass through to
``pallas_norm.rms_norm`` / ``layer_norm``. Every flax attribute is accepted, in flax's
order (positional construction matches flax's), with the NNX layers' differences: the
normalised axis is always the last one (other ``reduction_axes`` / ``feature_axes``:
ValueError), ``mask`` is not supported (NotImplementedError), and
``use_fast_variance`` / ``force_float32_reductions`` do not change the math (float32
statistics, at least as accurate as either flax setting).
``axis_name`` / ``axis_index_groups`` have flax's meaning (inside ``jax.shard_map``);
sharded arrays under ``jax.jit`` need neither. ``RMSNormDenseFP8`` / ``LayerNormDenseFP8``
are the twins of the FP8 norm -> dense layers of ``flax_layers.fp8``.
"""

from __future__ import annotations

import typing as tp

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes as _dtypes
from flax.linen import initializers

from flax_layers import _flax_args
from flax_layers import fp8 as _fp8
from pallas_norm import ops as _ops

__all__ = ["RMSNorm", "LayerNorm", "RMSNormDenseFP8", "LayerNormDenseFP8"]


def _params_and_input(mdl: nn.Module, x, names: tuple[str, ...], inits, uses, residual,
                      mask):
  """Checks flax's axes and mask, creates the [N] params named ``names``; returns (x for
  the op, the params, y's dtype or None). As flax.linen, the statistics come from x as
  given and only the output is cast to the result dtype: x is promoted (exactly) when
  that dtype is wider, and kept when it is narrower (y then cast by ``_finish``; a
  residual stream h keeps ``residual_dtype``). Under cast="llama": x keeps its dtype,
  the params are cast to ``dtype`` if given, y is the op's."""
  _flax_args.check_axes(mdl.reduction_axes, mdl.feature_axes)
  _flax_args.check_call(x, mdl.reduction_axes, mdl.feature_axes, mask, residual)
  feature_shape = (jnp.shape(x)[-1],)
  params = [mdl.param(name, init, feature_shape, mdl.param_dtype) if use else None
            for name, init, use in zip(names, inits, uses)]
  if mdl.cast == "llama":
    return x, [p if p is None or mdl.dtype is None else p.astype(mdl.dtype)
               for p in params], None
  dtype = _dtypes.canonicalize_dtype(x, *params, dtype=mdl.dtype)
  x = jnp.asarray(x)
  return jnp.asarray(x, jnp.promote_types(x.dtype, dtype)), params, dtype


def _finish(out, dtype):
  """The op's y (or (y, h)) with y cast to ``dtype`` (None: as it is)."""
  if dtype is None:
    return out
  if isinstance(out, tuple):
    return out[0].astype(dtype), out[1]
  return out.astype(dtype)


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
    backend: "pallas" (default), "triton", "mosaic", "xla" or None (as in ``pallas_norm.rms_norm``).
    axis_name: inside ``jax.shard_map``, the mesh axis (or axes) over which the
      features are split; the statistics are the whole vector's, as in flax.
    axis_index_groups: groups of axis indices reduced separately, as in flax.
    residual_dtype: with ``layer.apply(variables, x, residual=r)``: the dtype of the
      returned residual stream h (default: None, r's dtype).
    cast: "torch" (default), "llama" or "gemma", as in ``pallas_norm.rms_norm``; under
      "llama" x keeps its dtype and the params are cast to ``dtype`` (if given).
    reduction_axes, feature_axes: flax's; the last axis only (-1, the default, or
      ``x.ndim - 1``); any other raises ValueError.
    use_fast_variance, force_float32_reductions: accepted for flax compatibility; no
      effect (the statistics are float32, LayerNorm's variance that of the centred
      values).
  """

  epsilon: float = 1e-6
  dtype: tp.Any | None = None
  param_dtype: tp.Any = jnp.float32
  use_scale: bool = True
  scale_init: initializers.Initializer = initializers.ones
  reduction_axes: _flax_args.Axes = -1
  feature_axes: _flax_args.Axes = -1
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: tp.Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  scale_offset: float = 0.0
  mode: str | None = None
  backend: str | None = "pallas"
  residual_dtype: tp.Any | None = None
  cast: str = "torch"

  @nn.compact
  def __call__(self, x, residual=None, *, mask=None, post_norm=None):
    """Normalises ``x: [..., N]``; returns the same shape. With ``residual`` (x's
    shape): ``(y, h)``, h = x + residual, y = the norm of h (the fused add).
    ``mask`` (flax's): NotImplementedError unless None.

    ``post_norm`` (with a residual): another ``RMSNorm`` of this module's parent (a
    bound submodule: declared in its ``setup`` or compact method), configured as this
    one, applied to x first: ``pre(x, h, post_norm=post)`` returns what ``pre(post(x),
    h)`` returns, Gemma 2/3's post-norm, residual add and pre-norm in one kernel
    (``pallas_norm.rms_norm(..., post_norm_scale=)``). post's ``scale`` is read from
    its variables (created by calling it once at ``init`` if it has not run) and gets
    its gradient. ValueError for a post_norm without a residual, not this class,
    unbound, without a scale, or configured otherwise."""
    _check_config(self)
    extra = {}
    if post_norm is not None:
      post_scale = _post_norm_scale(self, post_norm, x, residual)
      if self.cast == "llama" and self.dtype is not None:
        post_scale = post_scale.astype(self.dtype)
      extra = dict(post_norm_scale=post_scale)
    x, (scale,), dtype = _params_and_input(self, x, ("scale",), (self.scale_init,),
                                           (self.use_scale,), residual, mask)
    return _finish(_ops.rms_norm(x, scale, eps=float(self.epsilon), cast=self.cast,
                                 scale_offset=float(self.scale_offset), mode=self.mode,
                                 backend=self.backend, **_axis_args(self),
                                 **_residual(self, residual), **extra), dtype)


_POST_NORM_FIELDS = ("epsilon", "dtype", "param_dtype", "use_scale", "scale_offset", "cast",
                     "backend", "mode", "reduction_axes", "feature_axes", "axis_name",
                     "axis_index_groups")


def _post_norm_scale(pre: RMSNorm, post, x, residual):
  """post's scale for ``pre(x, residual, post_norm=post)`` (its checks first)."""
  if residual is None:
    raise ValueError("post_norm normalises x before the residual add: pass a residual")
  if not isinstance(post, RMSNorm) or not post.use_scale:
    raise ValueError(f"post_norm must be a flax_layers.linen.RMSNorm with a scale, got "
                     f"{type(post).__name__}"
                     + (" without a scale" if isinstance(post, RMSNorm) else ""))
  diff = [f for f in _POST_NORM_FIELDS if getattr(post, f) != getattr(pre, f)]
  if diff:
    raise ValueError(f"post_norm must be configured as this layer (one kernel runs both "
                     f"norms); it differs in {diff}")
  if post.scope is None:
    raise ValueError("post_norm must be a bound submodule of the calling module (declared "
                     "in its setup or compact method), not a module built outside it")
  if post.is_initializing() and not post.has_variable("params", "scale"):
    post(x)  # creates its params as its own call would (init only)
  return post.variables["params"]["scale"]


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
    backend: "pallas" (default), "triton", "mosaic", "xla" or None (as in ``pallas_norm.rms_norm``).
    axis_name, axis_index_groups: as in ``RMSNorm`` (flax's meaning).
    residual_dtype, cast: as in ``RMSNorm``.
    reduction_axes, feature_axes, use_fast_variance, force_float32_reductions: as in
      ``RMSNorm``.
  """

  epsilon: float = 1e-6
  dtype: tp.Any | None = None
  param_dtype: tp.Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: initializers.Initializer = initializers.zeros
  scale_init: initializers.Initializer = initializers.ones
  reduction_axes: _flax_args.Axes = -1
  feature_axes: _flax_args.Axes = -1
  axis_name: str | tuple[str, ...] | None = None
  axis_index_groups: tp.Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  scale_offset: float = 0.0
  mode: str | None = None
  backend: str | None = "pallas"
  residual_dtype: tp.Any | None = None
  cast: str = "torch"

  @nn.compact
  def __call__(self, x, residual=None, *, mask=None):
    """Normalises ``x: [..., N]``; returns the same shape, or ``(y, h)`` with a
    ``residual`` (as ``RMSNorm``; ``mask``: NotImplementedError unless None)."""
    _check_config(self)
    x, (scale, bias), dtype = _params_and_input(self, x, ("scale", "bias"),
                                                (self.scale_init, self.bias_init),
                                                (self.use_scale, self.use_bias), residual,
                                                mask)
    return _finish(_ops.layer_norm(x, scale, bias, eps=float(self.epsilon), cast=self.cast,
                                   scale_offset=float(self.scale_offset), mode=self.mode,
                                   backend=self.backend, **_axis_args(self),
                                   **_residual(self, residual)), dtype)


def _check_config(layer) -> None:
  _flax_args.check_config(type(layer).__name__, features={}, epsilon=layer.epsilon,
                          scale_offset=layer.scale_offset, cast=layer.cast, mode=layer.mode,
                          backend=layer.backend, residual_dtype=layer.residual_dtype)


# --------------------------------------------------------------------------- FP8 dense


class _NormDenseFP8(nn.Module):
  """The fields and call RMSNormDenseFP8 and LayerNormDenseFP8 share."""

  features: int
  epsilon: float = 1e-6
  use_scale: bool = True
  scale_init: initializers.Initializer = initializers.ones
  scale_offset: float = 0.0
  use_bias: bool = True
  kernel_init: initializers.Initializer = nn.linear.default_kernel_init
  bias_init: initializers.Initializer = initializers.zeros
  dtype: tp.Any | None = None
  param_dtype: tp.Any = jnp.float32
  scaling: str = "delayed"
  amax_history_length: int = 1024
  fp8_dtype: tp.Any = jnp.float8_e4m3fn
  grad_fp8_dtype: tp.Any = jnp.float8_e5m2
  backend: str = "pallas"

  subtract_mean: tp.ClassVar[bool] = False

  @nn.compact
  def __call__(self, x):
    """``x: [..., N]`` -> ``[..., features]`` in ``dtype`` (default: the result type of
    x and the params)."""
    _fp8.check_layer_args(self.scaling, self.amax_history_length, self.fp8_dtype,
                          self.grad_fp8_dtype, self.backend)
    _flax_args.check_config(type(self).__name__, features=dict(features=self.features),
                            epsilon=self.epsilon, scale_offset=self.scale_offset)
    if jnp.ndim(x) < 1:
      raise ValueError(f"{type(self).__name__}: x must have rank >= 1 (features last), got "
                       f"shape {jnp.shape(x)}")
    n = jnp.shape(x)[-1]
    use_ln_bias = getattr(self, "use_ln_bias", False)
    ln_bias_init = getattr(self, "ln_bias_init", initializers.zeros)
    params = [self.param(name, init, shape, self.param_dtype) if use else None
              for name, init, shape, use in (
                  ("scale", self.scale_init, (n,), self.use_scale),
                  ("ln_bias", ln_bias_init, (n,), use_ln_bias),
                  ("kernel", self.kernel_init, (n, self.features), True),
                  ("bias", self.bias_init, (self.features,), self.use_bias))]
    state = None
    if self.scaling == "delayed":
      init = _fp8.init_delayed_scaling(self.amax_history_length)
      state = _fp8.DelayedScalingState(
          *(self.variable(_fp8.OVERWRITE_WITH_GRADIENT, k, lambda v=v: v).value
            for k, v in init._asdict().items()))
    dtype = _dtypes.canonicalize_dtype(x, *params, dtype=self.dtype)
    scale, ln_bias, kernel, bias = params
    return _fp8.norm_dense_fp8(jnp.asarray(x, dtype), kernel, scale, ln_bias, bias,
                               subtract_mean=self.subtract_mean, eps=float(self.epsilon),
                               scale_offset=float(self.scale_offset), state=state,
                               fp8_dtype=self.fp8_dtype,
                               grad_fp8_dtype=self.grad_fp8_dtype, backend=self.backend)


class RMSNormDenseFP8(_NormDenseFP8):
  """RMSNorm then a dense layer in FP8: the Linen twin of
  ``flax_layers.RMSNormDenseFP8`` (``flax_layers.fp8``; TransformerEngine's
  ``LayerNormDenseGeneral(layernorm_type="rmsnorm")``).

  Params: ``scale`` [N], ``kernel`` [N, features], ``bias`` [features]. Delayed scaling
  keeps its amax histories and scales in flax's ``_overwrite_with_gradient`` collection
  (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``, the names of flax's
  ``Fp8DotGeneral``): differentiate the loss with respect to that collection too and
  use its gradients as its next value (flax's fp8 recipe)::

    grads = jax.grad(loss)({"params": params, OVERWRITE_WITH_GRADIENT: meta}, batch)
    meta = grads[OVERWRITE_WITH_GRADIENT]    # the new histories and scales

  A gradient taken with respect to the params alone would never update that collection;
  the layer sees it at trace time, warns, and runs current scaling for the call.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from flax_layers import linen

    >>> layer = linen.RMSNormDenseFP8(features=4, scaling="current", backend="xla")
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> jax.tree.map(jnp.shape, variables)
    {'params': {'bias': (4,), 'kernel': (8, 4), 'scale': (8,)}}
    >>> y = layer.apply(variables, jnp.ones((2, 8)))

  Attributes:
    features: F, the output features (N is x's last axis).
    epsilon, use_scale, scale_init, scale_offset, use_bias, kernel_init, bias_init,
    dtype, param_dtype, scaling, amax_history_length, fp8_dtype, grad_fp8_dtype,
    backend: as in ``flax_layers.RMSNormDenseFP8`` (checked when called); wrap
    kernel_init in ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` to shard
    the kernel (column or row parallel, FSDP; docs/fp8.md).
  """


class LayerNormDenseFP8(_NormDenseFP8):
  """LayerNorm then a dense layer in FP8: the Linen twin of
  ``flax_layers.LayerNormDenseFP8`` (TransformerEngine's ``LayerNormDenseGeneral``).

  As ``RMSNormDenseFP8``, plus ``use_ln_bias`` (default True) and ``ln_bias_init``
  (default zeros): LayerNorm's beta, param ``ln_bias`` [N].
  """

  use_ln_bias: bool = True
  ln_bias_init: initializers.Initializer = initializers.zeros

  subtract_mean: tp.ClassVar[bool] = True
