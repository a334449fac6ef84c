"""``jax_triton.triton_call`` glue for the plain Triton kernels (``backend="triton"``).

``norm_forward`` / ``norm_backward`` are what ``ops.py`` calls; the custom_vjp there
gives ``grad``. For a shard of the hidden dim (tensor parallel, spmd.py) the forward is
``norm_forward_stats``, the caller's all-reduce, then ``norm_forward_apply``, and
``norm_backward(combine_row_sums=...)`` all-reduces the row sums between its kernels.

jax-triton has no batching rule (nor JVP), so the launches are wrapped in
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
from pallas_norm.kernels._compat import to_varying, varying_axes

__all__ = ["norm_forward", "norm_forward_stats", "norm_forward_apply", "norm_backward",
           "INSTALL_HINT"]

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
  outs = jt.triton_call(*args, kernel=kernel, grid=plan.grid, num_warps=plan.num_warps,
                        num_stages=plan.num_stages, name=name, **{out_kw: out},
                        **plan.kwargs)
  # jax-triton types its outputs as invariant; inside a check_vma shard_map they vary
  # like the inputs (_compat.to_varying).
  axes = frozenset().union(*(varying_axes(a) for a in args if hasattr(a, "shape")))
  if not axes:
    return outs
  if isinstance(outs, (list, tuple)):
    return type(outs)(to_varying(o, axes) for o in outs)
  return to_varying(outs, axes)


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
  residual_dtype: str | None = None  # h's dtype, with the fused residual add
  llama: tuple[str, str] | None = None  # cast="llama": (x's, y's dtype names)
  x_group: int = 0  # FP8 x: its scales' group size (the scales take r3's place)
  y_dtype: str | None = None  # FP8 x: y's dtype (out_dtype)


def _y_dtype(x, st):
  """y's dtype: FP8 x's out_dtype, x's, or the promotion of x's and the params' under
  cast="llama"."""
  if st.y_dtype is not None:
    return jnp.dtype(st.y_dtype)
  return x.dtype if st.llama is None else jnp.dtype(st.llama[1])


def _x_group(x, x_scale) -> int:
  """The group size of FP8 x's scales (x [..., N], x_scale [..., N // G]), 0 without."""
  return 0 if x_scale is None else x.shape[-1] // x_scale.shape[-1]


def _launch_forward(x3, r3, scale, bias, st: _FwdStatic):
  """x3: [B, M, N]; r3: [B, M, N] (the residual) or None, or with ``st.x_group`` FP8
  x3's scales [B, M, N // G]; scale, bias: [PB, N] (PB in {1, B}) or None.

  Returns (y [B, M, N],), then h [B, M, N] (h's dtype) with a residual, then with
  ``st.return_residuals`` mean [B, M] f32 (LayerNorm only) and rstd [B, M] f32.
  """
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  (scale, bias), pb = _param_rows((scale, bias), batch)
  # Shared params: fold the batch into the rows (one row space, better tail blocks).
  kb, km = (1, batch * m) if pb == 1 else (batch, m)
  has_res = r3 is not None and not st.x_group
  plan = tk.forward_plan(st.config, batch=kb, m=km, n=n, eps=st.eps,
                         scale_offset=st.scale_offset, subtract_mean=st.subtract_mean,
                         has_scale=scale is not None, has_bias=bias is not None,
                         return_residuals=st.return_residuals,
                         param_stride=0 if pb == 1 else n, has_residual=has_res,
                         cast=st.llama, x_group=st.x_group)
  # Without residuals the kernel writes no statistics, without a residual no h: 1-element
  # placeholders.
  rows = batch * m if st.return_residuals else 1
  h_out = (jax.ShapeDtypeStruct(x3.shape, st.residual_dtype) if has_res
           else _f32(1))
  y, h, mean, rstd = _triton_call(
      tk.norm_fwd_kernel,
      x3, x3 if r3 is None else r3,  # absent: unread
      x3 if scale is None else scale, x3 if bias is None else bias,
      out=(jax.ShapeDtypeStruct(x3.shape, _y_dtype(x3, st)), h_out,
           _f32(rows if st.subtract_mean else 1), _f32(rows)),
      plan=plan, name=f"pallas_norm_triton_fwd_{st.config.mode}")
  out = (y, h) if has_res else (y,)
  if not st.return_residuals:
    return out
  rstd = rstd.reshape(batch, m)
  if st.subtract_mean:
    return (*out, mean.reshape(batch, m), rstd)
  return (*out, rstd)


def _vmapped(launch, fold_args):
  """``jax.custom_batching.custom_vmap`` of ``launch(*args)``: its rule folds the new
  vmap axis into the kernels' batch (``fold_args(axis_size, in_batched, *args)`` gives
  the merged arguments), calls it, and splits the axis off the outputs again."""

  @jax.custom_batching.custom_vmap
  def call(*args):
    return launch(*args)

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    return _split_axis(axis_size, call(*fold_args(axis_size, in_batched, *args)))

  return call


def _fwd_fold(axis_size, in_batched, x3, r3, scale, bias):
  """The forward's arguments with the new vmap axis merged into the batch."""
  x_b, r_b, s_b, b_b = in_batched
  params_shared = not (s_b or b_b) and all(
      p is None or p.shape[0] == 1 for p in (scale, bias))
  if params_shared:  # fold the new axis into B
    x4 = _new_axis(axis_size, x3, x_b)
  else:
    x4, scale, bias = _broadcast_new_axis(axis_size, (x3, x_b), (scale, s_b), (bias, b_b))
    scale, bias = (None if p is None else _merge(p) for p in (scale, bias))
  r4 = _new_axis(axis_size, r3, r_b)
  return _merge(x4), None if r4 is None else _merge(r4), scale, bias


@functools.lru_cache(maxsize=None)
def _forward_fn(st: _FwdStatic):
  """custom_vmap'd ``_launch_forward`` for ``st``."""
  return _vmapped(functools.partial(_launch_forward, st=st), _fwd_fold)


def _merge(a):
  """[A, B, ...] -> [A * B, ...]."""
  return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _new_axis(axis_size, a, batched):
  """``a`` with the vmap axis in front ([axis_size, B, ...]): broadcast when it has none;
  None stays None."""
  if a is None:
    return None
  return jnp.broadcast_to(a if batched else a[None],
                          (axis_size,) + (a.shape[1:] if batched else a.shape))


def _split_axis(axis_size, out):
  """Outputs of a custom_vmap rule: [axis_size * B, ...] -> [axis_size, B, ...], all
  batched."""
  out = tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in out)
  return out, tuple(True for _ in out)


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


def _llama_cast(cast, x, scale, bias):
  """(x's, y's dtype names) for cast="llama" (y's: ``forward.llama_dtype``, the one
  rule both backends use), None for "torch".

  Raises:
    ValueError: another cast (``ops`` turns "gemma" into "torch" with an offset).
  """
  if cast == "torch":
    return None
  if cast != "llama":
    raise ValueError(f"{cast=}: the kernels take 'torch' or 'llama'")
  from pallas_norm.kernels.forward import llama_dtype  # pylint: disable=import-outside-toplevel
  return (jnp.dtype(x.dtype).name, jnp.dtype(llama_dtype(x, scale, bias)).name)


def norm_forward(x2, scale, bias, *, eps, scale_offset, subtract_mean, config, interpret,
                 return_residuals=True, residual=None, residual_dtype=None, cast="torch",
                 x_scale=None, y_dtype=None):
  """Forward through jax-triton.

  Args:
    x2: [M, N] float32, bfloat16 or float16.
    scale, bias: [N] or None.
    eps, scale_offset, subtract_mean: as in ``ops``.
    config: ``ForwardConfig`` (mode, blocks, warps, persistent grid).
    interpret: ignored (jax-triton runs on GPU only).
    return_residuals: write and return mean/rstd (what the backward needs); a plain
      forward skips them (the kernel's ``STATS`` constexpr).
    residual: None, or [M, N] float: the kernel normalises h = x + residual (summed in
      float32) and also writes h, in ``residual_dtype`` (default: residual's dtype).
    cast: "torch" or "llama", as in ``forward.norm_forward``.
    x_scale: FP8 x2's group scales [M, N // G] f32 (x2 float8_e4m3fn / e5m2), or None:
      x is dequantised as the kernels load it (as in ``forward.norm_forward``); not with
      a residual.
    y_dtype: y's dtype with FP8 x (out_dtype; default bfloat16).

  Returns:
    (y [M, N], mean [M] f32 or None, rstd [M] f32 or None), and h [M, N] last with a
    residual: y in y_dtype with FP8 x, else in x's dtype (the promotion of x's and the
    params' under "llama"),
    mean None for RMSNorm, both None without ``return_residuals``.

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
  if residual is not None and residual_dtype is None:
    residual_dtype = residual.dtype
  if x_scale is not None and residual is not None:
    raise ValueError("FP8 x (x_scale=) with a residual is not served")
  st = _FwdStatic(float(eps), float(scale_offset), bool(subtract_mean), config,
                  bool(return_residuals),
                  None if residual is None else jnp.dtype(residual_dtype).name,
                  _llama_cast(cast, x2, scale, bias), _x_group(x2, x_scale),
                  None if x_scale is None else jnp.dtype(y_dtype or jnp.bfloat16).name)
  second = residual if x_scale is None else x_scale
  out = list(_forward_fn(st)(x2[None], None if second is None else second[None],
                             *(None if p is None else p[None] for p in (scale, bias))))
  y = out.pop(0)[0]
  h = None if residual is None else out.pop(0)[0]
  mean = rstd = None
  if return_residuals:
    mean = out.pop(0)[0] if subtract_mean else None
    rstd = out.pop(0)[0]
  return (y, mean, rstd) if residual is None else (y, mean, rstd, h)


# ------------------------------------------------------ tensor parallel: statistics, then y


@dataclasses.dataclass(frozen=True)
class _ShardStatic:
  subtract_mean: bool
  config: _config.ForwardConfig
  scale_offset: float = 0.0  # the apply kernel's
  residual_dtype: str | None = None  # the statistics kernel's h, with a residual
  llama: tuple[str, str] | None = None  # the apply kernel's, as in _FwdStatic
  x_group: int = 0  # FP8 x, as in _FwdStatic (its scales take r3's place)
  y_dtype: str | None = None  # the apply kernel's, as in _FwdStatic


def _launch_shard_stats(x3, r3, st: _ShardStatic):
  """x3: [B, M, n]; r3: [B, M, n] (the residual) or None -> (s1 [B, M] f32,), then s2
  [B, M] f32 for LayerNorm, then h [B, M, n] with a residual."""
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  has_res = r3 is not None and not st.x_group
  # No params: the batch always folds into the rows.
  plan = tk.shard_stats_plan(st.config, batch=1, m=batch * m, n=n,
                             subtract_mean=st.subtract_mean, has_residual=has_res,
                             x_group=st.x_group)
  s1, s2, h = _triton_call(
      tk.fwd_shard_stats_kernel, x3, x3 if r3 is None else r3,  # absent: unread
      out=(_f32(batch * m), _f32(batch * m if st.subtract_mean else 1),
           jax.ShapeDtypeStruct(x3.shape, st.residual_dtype) if has_res else _f32(1)),
      plan=plan, name="pallas_norm_triton_fwd_shard_stats")
  out = tuple(s.reshape(batch, m) for s in ((s1, s2) if st.subtract_mean else (s1,)))
  return (*out, h) if has_res else out


def _shard_stats_fold(axis_size, in_batched, x3, r3):
  x_b, r_b = in_batched
  r4 = _new_axis(axis_size, r3, r_b)
  return _merge(_new_axis(axis_size, x3, x_b)), None if r4 is None else _merge(r4)


@functools.lru_cache(maxsize=None)
def _shard_stats_fn(st: _ShardStatic):
  """custom_vmap'd ``_launch_shard_stats`` for ``st``."""
  return _vmapped(functools.partial(_launch_shard_stats, st=st), _shard_stats_fold)


def _launch_shard_apply(x3, r3, scale, bias, mean, rstd, st: _ShardStatic):
  """x3: [B, M, n]; r3: [B, M, n] (the residual) or None; scale, bias: [PB, n] (PB in
  {1, B}) or None; mean (LayerNorm only), rstd: [B, M] f32. Returns (y [B, M, n],) in
  x's dtype (y's under cast="llama")."""
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  (scale, bias), pb = _param_rows((scale, bias), batch)
  kb, km = (1, batch * m) if pb == 1 else (batch, m)  # shared params: rows fold
  plan = tk.shard_apply_plan(st.config, batch=kb, m=km, n=n, scale_offset=st.scale_offset,
                             subtract_mean=st.subtract_mean, has_scale=scale is not None,
                             has_bias=bias is not None, param_stride=0 if pb == 1 else n,
                             has_residual=r3 is not None and not st.x_group,
                             cast=st.llama, x_group=st.x_group)
  return _triton_call(
      tk.fwd_shard_apply_kernel,
      x3, x3 if r3 is None else r3,
      x3 if scale is None else scale, x3 if bias is None else bias,  # absent: unread
      rstd if mean is None else mean, rstd,
      out=(jax.ShapeDtypeStruct(x3.shape, _y_dtype(x3, st)),),
      plan=plan, name="pallas_norm_triton_fwd_shard_apply")


def _shard_apply_fold(axis_size, in_batched, x3, r3, scale, bias, mean, rstd):
  x_b, r_b, s_b, b_b, mean_b, rstd_b = in_batched
  if s_b or b_b or any(p is not None and p.shape[0] > 1 for p in (scale, bias)):
    _, scale, bias = _broadcast_new_axis(axis_size, (x3, x_b), (scale, s_b), (bias, b_b))
    scale, bias = (None if p is None else _merge(p) for p in (scale, bias))
  x4, r4, mean4, rstd4 = (_new_axis(axis_size, a, b) for a, b in
                          ((x3, x_b), (r3, r_b), (mean, mean_b), (rstd, rstd_b)))
  merged = lambda a: None if a is None else _merge(a)
  return _merge(x4), merged(r4), scale, bias, merged(mean4), _merge(rstd4)


@functools.lru_cache(maxsize=None)
def _shard_apply_fn(st: _ShardStatic):
  """custom_vmap'd ``_launch_shard_apply`` for ``st``."""
  return _vmapped(functools.partial(_launch_shard_apply, st=st), _shard_apply_fold)


def norm_forward_stats(x, *, subtract_mean: bool, config: _config.ForwardConfig,
                       interpret: bool, residual=None, residual_dtype=None, x_scale=None):
  """Row statistics of a shard of the hidden dim (tensor parallel), pass 1 of 2.

  As ``forward.norm_forward_stats`` (Pallas): the row block is walked in
  ``config.block_n`` chunks (one chunk when the row fits); static_persistent loops over
  row blocks with ``config.num_programs`` programs, the multi-wave modes take one row
  block a program. ``config.split_rows`` and ``chunk_n`` are not used.

  Args:
    x: [M, n] the shard's columns of each row.
    subtract_mean: LayerNorm (True) or RMSNorm.
    config: ``ForwardConfig``.
    interpret: ignored (jax-triton runs on GPU only).
    residual, residual_dtype: as in ``norm_forward``: the statistics are those of
      h = x + residual, and h is written.
    x_scale: FP8 x's group scales [M, n // G], as in ``norm_forward``.

  Returns:
    (s1, s2), [M] f32 each: RMSNorm (sum of x^2, None); LayerNorm (mean, M2 =
    sum((x - mean)^2)) over the n columns, for Chan et al.'s combination across shards;
    and h [M, n] third with a residual.

  Raises:
    ImportError: jax-triton or a GPU jaxlib is missing.
  """
  del interpret
  _jax_triton()
  if residual is not None and residual_dtype is None:
    residual_dtype = residual.dtype
  st = _ShardStatic(bool(subtract_mean), config,
                    residual_dtype=None if residual is None else jnp.dtype(residual_dtype).name,
                    x_group=_x_group(x, x_scale))
  second = residual if x_scale is None else x_scale
  out = [o[0] for o in _shard_stats_fn(st)(x[None],
                                           None if second is None else second[None])]
  s = (out[0], out[1]) if subtract_mean else (out[0], None)
  return s if residual is None else (*s, out[-1])


def norm_forward_apply(x, scale, bias, mean, rstd, *, scale_offset: float,
                       config: _config.ForwardConfig, interpret: bool, residual=None,
                       cast: str = "torch", x_scale=None, y_dtype=None):
  """y of a shard of the hidden dim from the whole rows' statistics, pass 2 of 2.

  y = (x - mean) * rstd * (scale_offset + scale) + bias, computed in f32; grid and
  chunks as in ``norm_forward_stats``.

  Args:
    x: [M, n]; scale, bias: [n] or None (the shard's columns).
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32.
    scale_offset: as in ``ops``.
    config: ``ForwardConfig``.
    interpret: ignored (jax-triton runs on GPU only).
    residual: the residual given to ``norm_forward_stats``: y is that of x + residual.
    cast: as in ``norm_forward``.
    x_scale, y_dtype: FP8 x's group scales [M, n // G] and y's dtype, as in
      ``norm_forward``.

  Returns:
    y: [M, n] in x's dtype (the promotion of x's and the params' under "llama"; y_dtype
    with FP8 x).

  Raises:
    ImportError: jax-triton or a GPU jaxlib is missing.
  """
  del interpret
  _jax_triton()
  st = _ShardStatic(mean is not None, config, float(scale_offset),
                    llama=_llama_cast(cast, x, scale, bias), x_group=_x_group(x, x_scale),
                    y_dtype=None if x_scale is None else jnp.dtype(y_dtype or jnp.bfloat16).name)
  second = residual if x_scale is None else x_scale
  (y,) = _shard_apply_fn(st)(x[None], *(None if a is None else a[None]
                                        for a in (second, scale, bias, mean, rstd)))
  return y[0]


# --------------------------------------------------------------------------- backward


@dataclasses.dataclass(frozen=True)
class _BwdStatic:
  scale_offset: float
  subtract_mean: bool
  has_bias: bool
  config: _config.BackwardConfig
  scale_dtype: jnp.dtype | None
  bias_dtype: jnp.dtype | None
  combine_row_sums: bool = False  # c1 / c2 of a shard, combined by the caller
  dx_dtype: str | None = None  # default: x's
  dres_dtype: str | None = None  # dresidual's, when it differs from dx's
  llama: tuple[str, str] | None = None  # cast="llama": (x's, y's dtype names)
  x_group: int = 0  # FP8 x: its scales' group size


def _bwd_launch_args(dy3, x3, scale, mean, rstd, xs3, st: _BwdStatic):
  """(plan keywords, kernel inputs) of the backward kernels; see ``_launch_backward``."""
  batch, m, n = x3.shape
  (scale,), pb = _param_rows((scale,), batch)
  common = dict(batch=batch, m=m, n=n, scale_offset=st.scale_offset,
                subtract_mean=st.subtract_mean, has_scale=scale is not None,
                param_stride=0 if pb == 1 else n, combine_row_sums=st.combine_row_sums,
                cast=st.llama, x_group=st.x_group)
  inputs = (dy3, x3, x3 if scale is None else scale, rstd if mean is None else mean, rstd,
            x3 if xs3 is None else xs3)  # absent: unread
  return common, inputs


def _row_sums_call(inputs, plan, rows, st: _BwdStatic):
  """``bwd_row_stats_kernel``: (c1 [rows] f32, c2 [rows] f32, or [1] for RMSNorm)."""
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  return _triton_call(tk.bwd_row_stats_kernel, *inputs,
                      out=(_f32(rows), _f32(rows if st.subtract_mean else 1)),
                      plan=plan, name="pallas_norm_triton_bwd_row_stats")


def _launch_row_sums(dy3, x3, scale, mean, rstd, xs3, st: _BwdStatic):
  """Row sums over x3's n columns (a shard of the hidden dim), arguments as in
  ``_launch_backward``. Returns (c1 [B, M] f32,), then c2 [B, M] f32 for LayerNorm."""
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  common, inputs = _bwd_launch_args(dy3, x3, scale, mean, rstd, xs3, st)
  batch, m, _ = x3.shape
  c1, c2 = _row_sums_call(inputs, tk.row_stats_plan(st.config, **common), batch * m, st)
  return tuple(c.reshape(batch, m) for c in ((c1, c2) if st.subtract_mean else (c1,)))


def _launch_backward(dy3, x3, scale, mean, rstd, xs3, c1, c2, dh3, st: _BwdStatic):
  """dy3, x3: [B, M, N]; scale: [PB, N] (PB in {1, B}) or None; mean (LayerNorm only),
  rstd: [B, M] f32; xs3: FP8 x3's scales [B, M, N // G] (``st.x_group``) or None; c1, c2 (LayerNorm only): [B, M] f32, the row sums combined across
  the shards of the hidden dim with ``st.combine_row_sums``, else None (computed here);
  dh3: [B, M, N], h's cotangent with the fused residual add (x3 is then h), or None.

  Returns a tuple of dx [B, M, N] (``st.dx_dtype``, default x's), dresidual [B, M, N]
  (with ``st.dres_dtype``), then dscale [B, N] (with a scale) and dbias [B, N] (with a
  bias): the per-batch-entry sums over rows.
  """
  from pallas_norm.kernels import triton_kernels as tk  # pylint: disable=import-outside-toplevel
  batch, m, n = x3.shape
  common, inputs = _bwd_launch_args(dy3, x3, scale, mean, rstd, xs3, st)
  has_scale = common["has_scale"]
  has_dres = st.dres_dtype is not None
  plan = tk.backward_plan(st.config, has_bias=st.has_bias, has_dh=dh3 is not None,
                          has_dres=has_dres, **common)
  if not st.combine_row_sums:
    stats_plan = tk.row_stats_plan(st.config, **common)
    c1 = c2 = rstd  # single tile: c1/c2 are reduced in stage 1 (unread placeholders)
    if stats_plan is not None:
      c1, c2 = _row_sums_call(inputs, stats_plan, batch * m, st)
  elif c2 is None:
    c2 = c1  # RMSNorm: unread
  part_rows = batch * plan.grid[0]
  dx, dres, dscale_part, dbias_part = _triton_call(
      tk.norm_bwd_kernel, *inputs, c1, c2, dy3 if dh3 is None else dh3,  # absent: unread
      out=(jax.ShapeDtypeStruct(x3.shape, st.dx_dtype or x3.dtype),
           jax.ShapeDtypeStruct(x3.shape, st.dres_dtype) if has_dres else _f32(1),
           _f32(part_rows if has_scale else 1, n if has_scale else 1),
           _f32(part_rows if st.has_bias else 1, n if st.has_bias else 1)),
      plan=plan, name=("pallas_norm_triton_bwd_columns" if plan.kwargs["CHUNKED"]
                       else "pallas_norm_triton_bwd_persistent"))
  out = [dx, dres] if has_dres else [dx]
  rplan = tk.reduce_plan(st.config, batch=batch, groups=plan.grid[0], n=n)
  for present, part, dtype in ((has_scale, dscale_part, st.scale_dtype),
                               (st.has_bias, dbias_part, st.bias_dtype)):
    if present:
      (red,) = _triton_call(tk.partial_reduce_kernel, part,
                            out=(jax.ShapeDtypeStruct((batch, n), dtype),),
                            plan=rplan, name="pallas_norm_triton_bwd_reduce")
      out.append(red)
  return tuple(out)


def _bwd_vmap_args(axis_size, in_batched, dy3, x3, scale, *rows):
  """The new vmap axis merged into the batch of the backward's arguments: dy, x and the
  per-row arrays (mean, rstd [B, M], FP8 x's scales [B, M, N // G], c1, c2 [B, M],
  dh [B, M, N]; None stays None) all get it
  (their batch B is shared); scale too unless it is one row shared by every entry."""
  dy_b, x_b, s_b, *rows_b = in_batched
  dy4, x4 = _new_axis(axis_size, dy3, dy_b), _new_axis(axis_size, x3, x_b)
  if scale is not None and (s_b or scale.shape[0] > 1):
    (_, scale4) = _broadcast_new_axis(axis_size, (x4, True), (scale, s_b))
    scale = _merge(scale4)
  rows = (None if a is None else _merge(_new_axis(axis_size, a, b))
          for a, b in zip(rows, rows_b))
  return (_merge(dy4), _merge(x4), scale, *rows)


@functools.lru_cache(maxsize=None)
def _row_sums_fn(st: _BwdStatic):
  """custom_vmap'd ``_launch_row_sums`` for ``st``."""
  return _vmapped(functools.partial(_launch_row_sums, st=st), _bwd_vmap_args)


@functools.lru_cache(maxsize=None)
def _backward_fn(st: _BwdStatic):
  """custom_vmap'd ``_launch_backward`` for ``st``."""
  return _vmapped(functools.partial(_launch_backward, st=st), _bwd_vmap_args)


def norm_backward(dy, x2, scale, mean, rstd, *, has_bias, scale_offset, subtract_mean,
                  config, interpret, scale_dtype, bias_dtype, combine_row_sums=None,
                  dh=None, dx_dtype=None, residual_dtype=None, cast=None, x_scale=None):
  """Backward through jax-triton (stage 1 dx + partials, stage 2 reduction).

  Args:
    dy, x2: [M, N] in x's dtype (dy in y's under cast="llama").
    scale: [N] or None.
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32.
    has_bias, scale_offset, subtract_mean: as in ``ops``.
    config: ``BackwardConfig``.
    interpret: ignored (jax-triton runs on GPU only).
    scale_dtype, bias_dtype: dtypes of dscale / dbias.
    combine_row_sums: for x a shard of the hidden dim (tensor parallel): a function
      ``(c1, c2) -> (c1, c2)`` ([M] f32 each, c2 None for RMSNorm) that turns this
      shard's row sums (over its N columns, divided by N) into the whole row's (a
      ``pmean`` over the hidden axes), called between the row-statistics kernel and
      the column-tiled stage 1. It selects that pair whatever ``block_n``;
      ``config.split_rows``, ``reload_rows`` and ``pieces`` are not used (as in the
      Pallas ``norm_backward``).
    dh, dx_dtype, residual_dtype: the fused residual add, as in the Pallas
      ``norm_backward`` (x2 is then h = x + residual): dh [M, N] or None is added to dx
      in float32 inside stage 1; dx is written in ``dx_dtype`` (default x2's) and,
      given a different ``residual_dtype``, once more in that dtype (dresidual).
    cast: None (``cast="torch"``) or (x's dtype name, y's dtype name) for
      ``cast="llama"``, as in the Pallas ``norm_backward``.
    x_scale: FP8 x2's group scales [M, N // G] f32, or None: x2 is dequantised as it is
      loaded (dx in ``dx_dtype``).

  Returns:
    (dx [M, N] dx_dtype, dscale [N] scale_dtype or None, dbias [N] bias_dtype or None);
    with a ``residual_dtype``, (dx, dresidual, dscale, dbias), dresidual being dx
    itself when the dtypes agree.

  Raises:
    NotImplementedError: without ``combine_row_sums``, ``config.split_rows`` or
      ``config.reload_rows`` (those long-row kernels are Pallas-only), or
      ``config.pieces`` (Pallas-only too).
    ImportError: jax-triton or a GPU jaxlib is missing.
  """
  del interpret
  if combine_row_sums is None:
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
  dx_name = jnp.dtype(dx_dtype or x2.dtype).name
  dres_name = None
  if residual_dtype is not None and jnp.dtype(residual_dtype).name != dx_name:
    dres_name = jnp.dtype(residual_dtype).name
  st = _BwdStatic(float(scale_offset), bool(subtract_mean), bool(has_bias), config,
                  None if scale is None else jnp.dtype(scale_dtype),
                  jnp.dtype(bias_dtype) if has_bias else None,
                  combine_row_sums is not None, dx_name, dres_name,
                  None if cast is None else tuple(cast), _x_group(x2, x_scale))
  args = (dy[None], x2[None], None if scale is None else scale[None],
          None if mean is None else mean[None], rstd[None],
          None if x_scale is None else x_scale[None])
  c1 = c2 = None
  if combine_row_sums is not None:
    c = _row_sums_fn(st)(*args)
    c1, c2 = combine_row_sums(c[0][0], c[1][0] if subtract_mean else None)
    c1, c2 = c1[None], (c2[None] if subtract_mean else None)
  out = list(_backward_fn(st)(*args, c1, c2, None if dh is None else dh[None]))
  dx = out.pop(0)[0]
  dres = out.pop(0)[0] if dres_name is not None else dx
  dscale = out.pop(0)[0] if scale is not None else None
  dbias = out.pop(0)[0] if has_bias else None
  if residual_dtype is None:
    return dx, dscale, dbias
  return dx, dres, dscale, dbias
