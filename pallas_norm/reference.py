"""Pure-jnp reference for RMSNorm and LayerNorm (fp32 math, two-pass variance).

This is the oracle the tests, the benchmark and ``backend="xla"`` all use: nobody
re-derives it. It matches ``torch.nn.functional.rms_norm`` / ``layer_norm``:
statistics in float32, output cast back to x's dtype.

    mean = sum(x) / N                       (LayerNorm only; 0 for RMSNorm)
    var  = sum((x - mean)**2) / N            (LayerNorm: biased, two-pass)
    ms   = sum(x**2) / N                     (RMSNorm)
    rstd = 1 / sqrt(var_or_ms + eps)
    y    = (x - mean) * rstd * (scale_offset + scale) + bias
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["norm", "dequantise"]


def dequantise(x: jax.Array, x_scale: jax.Array) -> jax.Array:
  """FP8 ``x`` [..., N] with float32 ``x_scale`` [..., N // G] -> [..., N] float32
  ``x.astype(f32) * x_scale`` with each scale repeated over its group of G consecutive
  elements (COAT's ``x * s_x``; the scale is the dequantisation scale)."""
  g = x.shape[-1] // x_scale.shape[-1]
  return x.astype(jnp.float32) * jnp.repeat(x_scale.astype(jnp.float32), g, axis=-1)


def norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float,
    scale_offset: float = 0.0,
    subtract_mean: bool,
    axis_name=None,
    axis_index_groups=None,
    cast: str = "torch",
    x_scale: jax.Array | None = None,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Reference RMSNorm (``subtract_mean=False``) or LayerNorm (``True``).

  Args:
    x: [..., N] float array.
    scale: [N] or None.
    bias: [N] or None.
    eps: added to the variance (or mean square) before the square root.
    scale_offset: y = x_hat * (scale_offset + scale).
    subtract_mean: True for LayerNorm, False for RMSNorm.
    axis_name, axis_index_groups: inside ``jax.shard_map``, the mesh axes over which the
      last axis is split (equal shards): the statistics are ``pmean``s of the shards'
      (flax's ``axis_name``).
    cast: "torch" (the above, one rounding at the end) or "llama" (HF
      ``LlamaRMSNorm``: ``x_hat.astype(x.dtype) * scale (+ bias)`` in jnp's promotion,
      scale_offset not applied; y's dtype is that promotion).
    x_scale: None, or [..., N // G] float32 for FP8 x: x is dequantised first
      (``dequantise``), then normalised as a float32 x.
    out_dtype: y's dtype (default x's; bfloat16 with an ``x_scale``).

  Returns:
    (y, mean, rstd): y is [..., N] in ``out_dtype``, default x's dtype (cast="llama":
    the promotion of x's, scale's and bias's); mean and rstd are [...] float32 (mean is
    zeros for RMSNorm).
  """
  if x_scale is not None:
    return norm(dequantise(x, x_scale), scale, bias, eps=eps, scale_offset=scale_offset,
                subtract_mean=subtract_mean, axis_name=axis_name,
                axis_index_groups=axis_index_groups, cast=cast,
                out_dtype=jnp.bfloat16 if out_dtype is None else out_dtype)
  def pmean(v):
    if axis_name is None:
      return v
    return jax.lax.pmean(v, axis_name, axis_index_groups=axis_index_groups)

  xf = x.astype(jnp.float32)  # [..., N] f32
  if subtract_mean:
    mean = pmean(jnp.mean(xf, axis=-1))  # [...] f32
    xc = xf - mean[..., None]
    var = pmean(jnp.mean(xc * xc, axis=-1))
  else:
    mean = jnp.zeros(xf.shape[:-1], jnp.float32)
    xc = xf
    var = pmean(jnp.mean(xf * xf, axis=-1))
  rstd = jax.lax.rsqrt(var + jnp.float32(eps))  # [...] f32
  y = xc * rstd[..., None]
  if cast == "llama":  # HF: self.weight * hidden_states.to(input_dtype)
    y = y.astype(x.dtype)
    if scale is not None:
      y = y * scale
    if bias is not None:
      y = y + bias
    return y, mean, rstd
  if scale is not None:
    y = y * (jnp.float32(scale_offset) + scale.astype(jnp.float32))
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype if out_dtype is None else out_dtype), mean, rstd
