"""``jax_triton.triton_call`` glue for the plain Triton kernels (``backend="triton"``).

``norm_forward`` / ``norm_backward`` are what ``ops.py`` calls; the custom_vjp there
gives ``grad``. jax-triton has no batching rule (nor JVP), so the launches are wrapped in
``jax.custom_batching.custom_vmap``: a new vmap axis is folded into the kernels' batch
axis (``[batch, M, N]``, see ``triton_kernels``), which handles a batched or shared
scale/bias in one launch, and nested vmaps fold again. Under vmap the backward returns
per-example dscale / dbias (``[batch, N]``); JAX's custom_vjp batching then sums them
for a scale that was not batched.

jax-triton is imported lazily: 0.3.x takes ``out_shape=`` (it fits triton 3.6),
0.4.x ``out_type=`` (triton >= 3.7). Without it, or without a GPU jaxlib, the first
use raises ``ImportError`` saying what to install. Launch parameters come from the
plans in ``triton_kernels``; ``interpret`` does not apply (GPU only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_norm import config as _config

__all__ = ["norm_forward", "norm_backward", "INSTALL_HINT"]

INSTALL_HINT = ("backend='triton' needs jax-triton and a CUDA jaxlib: "
                "pip install 'pallas-norm[triton,cuda12]' "
                "(or: pip install jax-triton 'jax[cuda12]')")


def _jax_triton():
  """The jax_triton module; ImportError with INSTALL_HINT when it cannot run here."""
  if jax.default_backend() != "gpu":
    raise ImportError(f"{INSTALL_HINT}; jax.default_backend()="
                      f"{jax.default_backend()!r} has no GPU")
  try:
    import jax_triton as jt  # pylint: disable=import-outside-toplevel
  except (ImportError, ValueError) as e:  # jax-triton 0.3 raises either without GPU jaxlib
    raise ImportError(INSTALL_HINT) from e
  return jt


def _triton_call(kernel, *args, out, plan, name):
  """One launch of ``kernel`` with ``plan``; ``out`` is a tuple of ShapeDtypeStructs."""
  jt = _jax_triton()
  version = tuple(getattr(jt, "__version_info__", (0, 3)))
  out_kw = "out_type" if version >= (0, 4) else "out_shape"
  return jt.triton_call(*args, kernel=kernel, grid=plan.grid, num_warps=plan.num_warps,
                        num_stages=plan.num_stages, name=name, **{out_kw: out},
                        **plan.kwargs)


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _param_rows(params, batch):
  """Brings the present params to a common leading dim: 1 (shared) or ``batch``.

  Returns (params, param_batch).
  """
  pb = max([p.shape[0] for p in params if p is not None], default=1)
  if pb == 1:
    return params, 1
  return tuple(None if p is None else jnp.broadcast_to(p, (batch, p.shape[-1]))
               for p in params), batch


# --------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class _FwdStatic:
  eps: float
  scale_offset: float
  subtract_mean: bool
  config: _config.ForwardConfig
  return_residuals: bool


def _launch_forward(x3, scale, bias, st: _FwdStatic):
  """x3: [B, M, N]; scale, bias: [PB, N] (PB in {1, B}) or None.

  Returns (y [B, M, N] x.dtype,), then with ``st.return_residuals`` mean [B, M] f32
  (LayerNorm only) and rstd [B, M] f32.
  """
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  (scale, bias), pb = _param_rows((scale, bias), batch)
  # Shared params: fold the batch into the rows (one row space, better tail blocks).
  kb, km = (1, batch * m) if pb == 1 else (batch, m)
  plan = tk.forward_plan(st.config, batch=kb, m=km, n=n, eps=st.eps,
                         scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
                         has_scale=scale is not None, has_bias=bias is not None,
                         return_residuals=st.return_residuals,
                         param_stride=0 if pb == 1 else n)
  # Without residuals the kernel writes no statistics: 1-element placeholders.
  rows = batch * m if st.return_residuals else 1
  y, mean, rstd = _triton_call(
      tk.norm_fwd_kernel,
      x3, x3 if scale is None else scale, x3 if bias is None else bias,  # absent: unread
      out=(jax.ShapeDtypeStruct(x3.shape, x3.dtype),
           _f32(rows if st.subtract_mean else 1), _f32(rows)),
      plan=plan, name=f"pallas_norm_triton_fwd_{st.config.mode}")
  if not st.return_residuals:
    return (y,)
  rstd = rstd.reshape(batch, m)
  if st.subtract_mean:
    return y, mean.reshape(batch, m), rstd
  return y, rstd


@functools.lru_cache(maxsize=None)
def _forward_fn(st: _FwdStatic):
  """custom_vmap'd ``_launch_forward`` for ``st``."""

  @jax.custom_batching.custom_vmap
  def fwd(x3, scale, bias):
    return _launch_forward(x3, scale, bias, st)

  @fwd.def_vmap
  def _fwd_vmap(axis_size, in_batched, x3, scale, bias):
    x_b, s_b, b_b = in_batched
    params_shared = not (s_b or b_b) and all(
        p is None or p.shape[0] == 1 for p in (scale, bias))
    if params_shared:  # x must be the batched one: fold the new axis into B.
      x4 = x3
    else:
      x4, scale, bias = _broadcast_new_axis(axis_size, (x3, x_b), (scale, s_b), (bias, b_b))
      scale, bias = (None if p is None else _merge(p) for p in (scale, bias))
    out = fwd(_merge(x4), scale, bias)
    out = tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in out)
    return out, tuple(True for _ in out)

  return fwd


def _merge(a):
  """[A, B, ...] -> [A * B, ...]."""
  return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _broadcast_new_axis(axis_size, *pairs):
  """Gives every (array, batched) pair the new vmap axis in front; params [PB, N] are
  broadcast to the batch B of the first array (the data, [B, ...])."""
  first = pairs[0][0]
  batch = first.shape[1] if pairs[0][1] else first.shape[0]
  out = []
  for i, (a, batched) in enumerate(pairs):
    if a is None:
      out.append(None)
      continue
    if not batched:
      a = a[None]
    if i > 0 and a.ndim == 3 and a.shape[1] != batch:  # a param row shared over B
      a = jnp.broadcast_to(a, (a.shape[0], batch, a.shape[2]))
    out.append(jnp.broadcast_to(a, (axis_size,) + a.shape[1:]))
  return tuple(out)


def norm_forward(x2, scale, bias, *, eps, scale_offset, subtract_mean, config, interpret,
                 return_residuals=True):
  """Forward through jax-triton.

  Args:
    x2: [M, N] float32, bfloat16 or float16.
    scale, bias: [N] or None.
    eps, scale_offset, subtract_mean: as in ``ops``.
    config: ``ForwardConfig`` (mode, blocks, warps, persistent grid).
    interpret: ignored (jax-triton runs on GPU only).
    return_residuals: write and return mean/rstd (what the backward needs); a plain
      forward skips them (the kernel's ``STATS`` constexpr).

  Returns:
    (y [M, N] x.dtype, mean [M] f32 or None, rstd [M] f32 or None): mean is None for
    RMSNorm, both are None without ``return_residuals``.

  Raises:
    NotImplementedError: ``config.split_rows`` (that long-row kernel is Pallas-only).
    ImportError: jax-triton or a GPU jaxlib is missing.
  """
  del interpret
  if config.split_rows:
    raise NotImplementedError(
        "ForwardConfig(split_rows=True) is Pallas-only; backend='triton' walks rows wider "
        "than block_n in chunks (split_rows=False)")
  _jax_triton()
  st = _FwdStatic(float(eps), float(scale_offset), bool(subtract_mean), config,
                  bool(return_residuals))
  out = _forward_fn(st)(x2[None], *(None if p is None else p[None] for p in (scale, bias)))
  if not return_residuals:
    return out[0][0], None, None
  if subtract_mean:
    y, mean, rstd = out
  else:
    (y, rstd), mean = out, None
  return y[0], None if mean is None else mean[0], rstd[0]


# --------------------------------------------------------------------------- backward


@dataclasses.dataclass(frozen=True)
class _BwdStatic:
  scale_offset: float
  subtract_mean: bool
  has_bias: bool
  config: _config.BackwardConfig
  scale_dtype: jnp.dtype | None
  bias_dtype: jnp.dtype | None


def _launch_backward(dy3, x3, scale, mean, rstd, st: _BwdStatic):
  """dy3, x3: [B, M, N]; scale: [PB, N] (PB in {1, B}) or None; mean (LayerNorm only),
  rstd: [B, M] f32.

  Returns a tuple of dx [B, M, N] x.dtype, then dscale [B, N] (with a scale) and
  dbias [B, N] (with a bias): the per-batch-entry sums over rows.
  """
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  (scale,), pb = _param_rows((scale,), batch)
  has_scale = scale is not None
  common = dict(batch=batch, m=m, n=n, scale_offset=st.scale_offset,
                subtract_mean=st.subtract_mean, has_scale=has_scale,
                param_stride=0 if pb == 1 else n)
  plan = tk.backward_plan(st.config, has_bias=st.has_bias, **common)
  stats_plan = tk.row_stats_plan(st.config, **common)
  inputs = (dy3, x3, x3 if scale is None else scale, rstd if mean is None else mean, rstd)
  c1 = c2 = rstd  # single tile: c1/c2 are reduced in stage 1 (unread placeholders)
  if stats_plan is not None:
    c1, c2 = _triton_call(
        tk.bwd_row_stats_kernel, *inputs,
        out=(_f32(batch * m), _f32(batch * m if st.subtract_mean else 1)),
        plan=stats_plan, name="pallas_norm_triton_bwd_row_stats")
  part_rows = batch * plan.grid[0]
  dx, dscale_part, dbias_part = _triton_call(
      tk.norm_bwd_kernel, *inputs, c1, c2,
      out=(jax.ShapeDtypeStruct(x3.shape, x3.dtype),
           _f32(part_rows if has_scale else 1, n if has_scale else 1),
           _f32(part_rows if st.has_bias else 1, n if st.has_bias else 1)),
      plan=plan, name=("pallas_norm_triton_bwd_persistent" if stats_plan is None
                        else "pallas_norm_triton_bwd_columns"))
  out = [dx]
  rplan = tk.reduce_plan(st.config, batch=batch, groups=plan.grid[0], n=n)
  for present, part, dtype in ((has_scale, dscale_part, st.scale_dtype),
                               (st.has_bias, dbias_part, st.bias_dtype)):
    if present:
      (red,) = _triton_call(tk.partial_reduce_kernel, part,
                            out=(jax.ShapeDtypeStruct((batch, n), dtype),),
                            plan=rplan, name="pallas_norm_triton_bwd_reduce")
      out.append(red)
  return tuple(out)


@functools.lru_cache(maxsize=None)
def _backward_fn(st: _BwdStatic):
  """custom_vmap'd ``_launch_backward`` for ``st``."""

  @jax.custom_batching.custom_vmap
  def bwd(dy3, x3, scale, mean, rstd):
    return _launch_backward(dy3, x3, scale, mean, rstd, st)

  @bwd.def_vmap
  def _bwd_vmap(axis_size, in_batched, dy3, x3, scale, mean, rstd):
    dy_b, x_b, s_b, mean_b, rstd_b = in_batched
    # dy, x, mean, rstd all get the new axis (their batch B is shared); scale too
    # unless it is one row shared by every entry.
    dy4, x4, mean4, rstd4 = (
        None if a is None else jnp.broadcast_to(a if b else a[None], (axis_size,) + (
            a.shape[1:] if b else a.shape))
        for a, b in ((dy3, dy_b), (x3, x_b), (mean, mean_b), (rstd, rstd_b)))
    if scale is not None and (s_b or scale.shape[0] > 1):
      (_, scale4) = _broadcast_new_axis(axis_size, (x4, True), (scale, s_b))
      scale = _merge(scale4)
    out = bwd(_merge(dy4), _merge(x4), scale, None if mean4 is None else _merge(mean4),
              _merge(rstd4))
    out = tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in out)
    return out, tuple(True for _ in out)

  return bwd


def norm_backward(dy, x2, scale, mean, rstd, *, has_bias, scale_offset, subtract_mean,
                  config, interpret, scale_dtype, bias_dtype):
  """Backward through jax-triton (stage 1 dx + partials, stage 2 reduction).

  Args:
    dy, x2: [M, N] in x's dtype.
    scale: [N] or None.
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32.
    has_bias, scale_offset, subtract_mean: as in ``ops``.
    config: ``BackwardConfig``.
    interpret: ignored (jax-triton runs on GPU only).
    scale_dtype, bias_dtype: dtypes of dscale / dbias.

  Returns:
    (dx [M, N] x.dtype, dscale [N] scale_dtype or None, dbias [N] bias_dtype or None).

  Raises:
    NotImplementedError: ``config.split_rows`` or ``config.reload_rows`` (those
      long-row kernels are Pallas-only), or ``config.pieces`` (Pallas-only too).
    ImportError: jax-triton or a GPU jaxlib is missing.
  """
  del interpret
  for flag in ("split_rows", "reload_rows"):
    if getattr(config, flag):
      raise NotImplementedError(
          f"BackwardConfig({flag}=True) is Pallas-only; backend='triton' takes the "
          "row-statistics + column-tiled pair for rows wider than block_n")
  if config.pieces:
    raise NotImplementedError(
        f"BackwardConfig(pieces={config.pieces}) is Pallas-only; backend='triton' takes "
        "one block_n-wide tile")
  _jax_triton()
  st = _BwdStatic(float(scale_offset), bool(subtract_mean), bool(has_bias), config,
                  None if scale is None else jnp.dtype(scale_dtype),
                  jnp.dtype(bias_dtype) if has_bias else None)
  out = list(_backward_fn(st)(dy[None], x2[None], None if scale is None else scale[None],
                              None if mean is None else mean[None], rstd[None]))
  dx = out.pop(0)[0]
  dscale = out.pop(0)[0] if scale is not None else None
  dbias = out.pop(0)[0] if has_bias else None
  return dx, dscale, dbias
