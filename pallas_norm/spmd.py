"""Sharded inputs: the per-shard computation and JAX's SPMD machinery around it.

The ops normalise the last axis of ``x: [..., N]``. Under ``jax.jit`` with ``x`` sharded
by a ``NamedSharding``, every dimension of x falls in one of two groups:

  rows    the leading axes (batch: data parallel / FSDP; sequence: sequence parallel).
          Each device runs the kernels on its own rows. y and dx keep x's sharding.
          dscale and dbias are each device's sums over its rows (the [G, N] partials
          reduced by stage 2 in float32), then one ``psum`` over the row axes.
  hidden  the last axis (tensor parallel), scale and bias sharded the same way.
          Statistics are partial sums over each shard's columns, combined across the
          hidden axes (``pmean`` of equal-sized shards):
            RMSNorm    mean(x^2) = pmean(sum(x_i^2) / n)
            LayerNorm  mean = pmean(mean_i);  var = pmean(M2_i / n + (mean_i - mean)^2)
                       (Chan et al.'s pairwise combination, never E[x^2] - E[x]^2)
          then a second kernel normalises (kernels.*.norm_forward_stats / _apply). The
          backward's row sums c1 = mean(x_hat * g) and c2 = mean(g) are combined the same
          way between its row-statistics and column kernels.

Three ways in, one per-shard body (``_local_forward`` / ``_local_backward``):

  Explicit meshes  the sharding is in x's type (``jax.typeof(x).sharding``): the body runs
                   under ``jax.shard_map`` with specs read from it.
  Auto meshes      the sharding is known only to XLA's partitioner: the op is a
                   ``jax.experimental.custom_partitioning`` call, and its ``partition`` rule
                   picks the same specs from the operand shardings it is handed.
  axis_name        inside the caller's own ``shard_map`` (flax's ``axis_name``): the body
                   runs as it is, with the statistics reduced over ``axis_name``.

Collectives are ``jax.lax.psum`` / ``pmean`` only. A layout that cannot be served without
gathering x (a dimension sharded unevenly) is a ``ValueError`` naming the sharding,
raised before any kernel runs (on an Auto mesh from inside XLA's compilation, which
reports it as a ``jax.errors.JaxRuntimeError`` carrying the message).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["forward", "backward", "mesh_layout"]

_F32 = jnp.float32


# --------------------------------------------------------------------------- layouts


def _axes(entry) -> tuple[str, ...]:
  """Mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def mesh_layout(shape, spec, axis_sizes: dict, what: str = "x"):
  """(full spec, row axes, hidden axes) of an array ``shape`` sharded by ``spec``.

  Args:
    shape: x's shape, rank >= 2.
    spec: its PartitionSpec (shorter specs are padded with None).
    axis_sizes: mesh axis name -> size.
    what: the name used in errors.

  Raises:
    ValueError: a dimension whose size its shards do not divide: serving it would need
      gathering (or padding rows into dscale's sums).
  """
  entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  for d, (size, entry) in enumerate(zip(shape, entries)):
    shards = math.prod(axis_sizes[a] for a in _axes(entry))
    if size % shards:
      raise ValueError(
          f"pallas_norm: {what} of shape {tuple(shape)} is sharded {P(*entries)}: dimension "
          f"{d} (size {size}) over {_axes(entry)} ({shards} shards) is uneven; pallas_norm "
          f"serves evenly sharded dimensions only (it never gathers x). Shard that "
          f"dimension over axes whose product divides {size}, or pad it.")
  rows = tuple(a for e in entries[:-1] for a in _axes(e))
  return P(*entries), rows, _axes(entries[-1])


def _explicit_sharding(x):
  """(mesh, sharding) when x's type carries an Explicit sharding, else None."""
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
    return None
  return mesh, sharding


def _param_spec(hidden) -> P:
  return P(hidden if len(hidden) != 1 else hidden[0]) if hidden else P(None)


# --------------------------------------------------------------------------- per shard


def _pmean(v, axes, groups):
  return jax.lax.pmean(v, axes, axis_index_groups=groups)


def _combine_stats(s1, s2, *, n, eps, axes, groups):
  """Whole-row (mean, rstd) [M] f32 from this shard's (s1, s2) over its n columns."""
  if s2 is None:  # RMSNorm: s1 = sum(x^2)
    return None, jax.lax.rsqrt(_pmean(s1 / n, axes, groups) + _F32(eps))
  mean = _pmean(s1, axes, groups)  # LayerNorm: s1 = mean, s2 = M2 of the shard
  delta = s1 - mean
  var = _pmean(s2 / n + delta * delta, axes, groups)
  return mean, jax.lax.rsqrt(var + _F32(eps))


def _fp8_kw(x_scale) -> dict:
  """The launchers' ``x_scale=`` ([M, n // G], FP8 x), none for a float x."""
  return {} if x_scale is None else {"x_scale": x_scale.reshape(-1, x_scale.shape[-1])}


def _local_forward(fwd2d, x, scale, bias, st, return_residuals, hidden, residual=None,
                   x_scale=None):
  """One shard: x [..., n] (and residual, like x, or None; x_scale [..., n // G] with
  FP8 x, or None) -> (y [..., n], mean [...] | None, rstd [...] | None,
  h [..., n] | None)."""
  lead, n = x.shape[:-1], x.shape[-1]
  combine = None
  if hidden:
    combine = functools.partial(_combine_stats, n=n, eps=st.eps, axes=hidden,
                                groups=st.axis_index_groups)
  flat = lambda a: None if a is None else a.reshape(-1, n)
  y, mean, rstd, h = fwd2d(x.reshape(-1, n), scale, bias, st, return_residuals, combine,
                           flat(residual), **_fp8_kw(x_scale))
  back = lambda a: None if a is None else a.reshape(lead)
  return y.reshape(x.shape), back(mean), back(rstd), None if h is None else h.reshape(x.shape)


def _local_backward(bwd2d, dy, x, scale, bias, mean, rstd, st, hidden, rows, dh=None,
                    x_scale=None):
  """One shard: -> (dx [..., n], dresidual [..., n] | None, dscale [n] | None,
  dbias [n] | None), dscale and dbias summed over the ``rows`` mesh axes (in float32,
  then cast to the parameter's dtype). With a residual (``st.residual_dtype``) x is h
  and dh its cotangent; with FP8 x, x_scale its scales."""
  n = x.shape[-1]
  combine = None
  if hidden:
    combine = lambda c1, c2: tuple(None if c is None else _pmean(c, hidden,
                                                                 st.axis_index_groups)
                                   for c in (c1, c2))
  flat = lambda a: None if a is None else a.reshape(-1)
  dx, dres, dscale, dbias = bwd2d(dy.reshape(-1, n), x.reshape(-1, n), scale, bias,
                                  flat(mean), flat(rstd), st, combine,
                                  _F32 if rows else None,
                                  None if dh is None else dh.reshape(-1, n),
                                  **_fp8_kw(x_scale))
  if rows:
    dscale, dbias = (None if d is None else jax.lax.psum(d, rows).astype(p.dtype)
                     for d, p in ((dscale, scale), (dbias, bias)))
  return (dx.reshape(x.shape), None if dres is None else dres.reshape(x.shape), dscale,
          dbias)


# ------------------------------------------------- Auto meshes: custom_partitioning rules


def _named(sharding, what):
  if not isinstance(sharding, NamedSharding):
    raise ValueError(f"pallas_norm: {what} has sharding {sharding}; under a multi-device "
                     f"jit pallas_norm needs a NamedSharding over a Mesh (jax.make_mesh) "
                     f"to know which axes shard rows and which the hidden dim")
  return sharding


def _plan(mesh, x_shape, x_sharding, what="x"):
  """(x spec, row spec, param spec, row axes, hidden axes) from x's operand sharding."""
  spec, rows, hidden = mesh_layout(x_shape, _named(x_sharding, what).spec,
                                   dict(mesh.shape), what)
  return spec, P(*tuple(spec)[:-1]), _param_spec(hidden), rows, hidden


def _letters(rank):
  return " ".join("abcdefghijklm"[:rank - 1])


def _same_layout(mesh, x_shape, like, what):
  """``like``'s spec (an array laid out like x: residual, dy, dh) when it is x's; a
  ValueError otherwise (matching them would move data)."""
  if like is None:
    return
  spec, *_ = _plan(mesh, x_shape.shape, x_shape.sharding)
  other, *_ = _plan(mesh, like.shape, like.sharding, what)
  if tuple(other) != tuple(spec):
    raise ValueError(f"pallas_norm: {what} is sharded {other} but x {spec}; shard them "
                     f"alike (pallas_norm never reshards them)")


def _fwd_impl(x, params, residual, x_scale, fwd2d, st, return_residuals):
  return _local_forward(fwd2d, x, *params, st, return_residuals, (), residual, x_scale)


def _fwd_partition(fwd2d, st, return_residuals, mesh, arg_shapes, result_shape):
  del result_shape
  x_shape, params, residual, x_scale = arg_shapes
  _same_layout(mesh, x_shape, residual, "residual")
  spec, row_spec, p_spec, _, hidden = _plan(mesh, x_shape.shape, x_shape.sharding)
  named = lambda s: NamedSharding(mesh, s)
  p_sh = tuple(None if p is None else named(p_spec) for p in params)
  out = _fwd_out_shardings(mesh, spec, row_spec, st, return_residuals)

  def lower(x, params, residual, x_scale):
    return _local_forward(fwd2d, x, *params, st, return_residuals, hidden, residual,
                          x_scale)

  return mesh, lower, out, (named(spec), p_sh, None if residual is None else named(spec),
                            _scale_sharding(mesh, spec, x_scale))


def _fwd_infer(fwd2d, st, return_residuals, mesh, arg_shapes, result_shape):
  del fwd2d, result_shape
  spec, row_spec, *_ = _plan(mesh, arg_shapes[0].shape, arg_shapes[0].sharding)
  return _fwd_out_shardings(mesh, spec, row_spec, st, return_residuals)


def _fwd_out_shardings(mesh, spec, row_spec, st, return_residuals):
  """(y, mean, rstd, h) shardings; None where _local_forward returns None."""
  row = NamedSharding(mesh, row_spec)
  full = NamedSharding(mesh, spec)
  return (full, row if return_residuals and st.subtract_mean else None,
          row if return_residuals else None, full if st.residual_dtype else None)


def _scale_sharding(mesh, spec, x_scale):
  """FP8 x's scales [..., N // G] (or None), laid out as x (``spec``): a ValueError
  where a shard would split a group (N // G not divisible by the hidden shards)."""
  if x_scale is None:
    return None
  mesh_layout(x_scale.shape, spec, dict(mesh.shape), "x_scale")
  return NamedSharding(mesh, spec)


def _fwd_sharding_rule(fwd2d, st, return_residuals, mesh, operand_types, result_types):
  del fwd2d, return_residuals, mesh
  rank = len(operand_types[0].shape)
  lead = _letters(rank)
  params = operand_types[1:len(operand_types) - (1 if st.out_dtype else 0)]
  ops = ", ".join([f"{lead} n"] + ["n" if len(t.shape) == 1 else f"{lead} n"
                                   for t in params] + ([f"{lead} g"] if st.out_dtype else []))
  res = ", ".join([f"{lead} n"] + [f"{lead} n" if len(t.shape) == rank else lead
                                   for t in result_types[1:]])
  return f"{ops} -> {res}"


_fwd_cp = custom_partitioning(_fwd_impl, static_argnums=(4, 5, 6))
_fwd_cp.def_partition(partition=_fwd_partition, infer_sharding_from_operands=_fwd_infer,
                      sharding_rule=_fwd_sharding_rule)


def _bwd_impl(dy, x, params, mean, rstd, dh, x_scale, bwd2d, st):
  return _local_backward(bwd2d, dy, x, *params, mean, rstd, st, (), (), dh, x_scale)


def _bwd_partition(bwd2d, st, mesh, arg_shapes, result_shape):
  del result_shape
  _, x_shape, params, mean, _, dh, x_scale = arg_shapes
  spec, row_spec, p_spec, rows, hidden = _plan(mesh, x_shape.shape, x_shape.sharding)
  named = lambda s: NamedSharding(mesh, s)
  p_sh = tuple(None if p is None else named(p_spec) for p in params)
  full = named(spec)
  args = (full, full, p_sh, None if mean is None else named(row_spec), named(row_spec),
          None if dh is None else full, _scale_sharding(mesh, spec, x_scale))

  def lower(dy, x, params, mean, rstd, dh, x_scale):
    return _local_backward(bwd2d, dy, x, *params, mean, rstd, st, hidden, rows, dh,
                           x_scale)

  return mesh, lower, (full, full if st.residual_dtype else None, *p_sh), args


def _bwd_infer(bwd2d, st, mesh, arg_shapes, result_shape):
  del bwd2d, result_shape
  _, x_shape, params, _, _, _, _ = arg_shapes
  spec, _, p_spec, _, _ = _plan(mesh, x_shape.shape, x_shape.sharding)
  full = NamedSharding(mesh, spec)
  return (full, full if st.residual_dtype else None,
          *(None if p is None else NamedSharding(mesh, p_spec) for p in params))


def _bwd_sharding_rule(bwd2d, st, mesh, operand_types, result_types):
  del bwd2d, mesh
  rank = len(operand_types[0].shape)
  lead = _letters(rank)
  n_res = 1 if st.residual_dtype else 0  # dh in, dresidual out
  n_params = len(result_types) - 1 - n_res
  x_like = f"{lead} n"
  ops = ([x_like, x_like] + ["n"] * n_params + [lead] * (2 if st.subtract_mean else 1)
         + [x_like] * n_res + ([f"{lead} g"] if st.out_dtype else []))
  res = [x_like] * (1 + n_res) + ["n"] * n_params
  return f"{', '.join(ops)} -> {', '.join(res)}"


_bwd_cp = custom_partitioning(_bwd_impl, static_argnums=(7, 8))
_bwd_cp.def_partition(partition=_bwd_partition, infer_sharding_from_operands=_bwd_infer,
                      sharding_rule=_bwd_sharding_rule)


# --------------------------------------------------------------------------- entry points


def _reshard(a, mesh, spec):
  if a is None:
    return None
  return jax.sharding.reshard(a, NamedSharding(mesh, spec))


def _refill(n, where, values):
  """A length-``n`` list with ``values`` at indices ``where`` and None elsewhere."""
  out = [None] * n
  for i, v in zip(where, values):
    out[i] = v
  return out


def _shard_map(body, mesh, args, in_specs, out_specs):
  """``jax.shard_map`` of ``body(*args)`` over every axis of ``mesh``; None args and
  outputs (absent scale, bias or residuals) stay out of it (their spec is None)."""
  present = [i for i, a in enumerate(args) if a is not None]
  outs = [i for i, s in enumerate(out_specs) if s is not None]

  def local(*xs):
    res = body(*_refill(len(args), present, xs))
    return tuple(res[i] for i in outs)

  res = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs[i] for i in present),
                      out_specs=tuple(out_specs[i] for i in outs), check_vma=False)(
                          *(args[i] for i in present))
  return tuple(_refill(len(out_specs), outs, res))


def _unbatched(partitioned, local, *args):
  """``partitioned(*args)`` (a custom_partitioning call), or under ``jax.vmap``, which
  custom_partitioning has no rule for, ``local`` vmapped: the kernels' own batching,
  unpartitioned, as on one device. None args stay out of custom_vmap."""
  present = [i for i, a in enumerate(args) if a is not None]
  full = functools.partial(_refill, len(args), present)

  @custom_batching.custom_vmap
  def call(*xs):
    return partitioned(*full(xs))

  @call.def_vmap
  def _rule(axis_size, in_batched, *xs):
    del axis_size
    out = jax.vmap(lambda *xs: local(*full(xs)), in_axes=[0 if b else None for b in in_batched])(*xs)
    return out, jax.tree.map(lambda _: True, out)

  return call(*(args[i] for i in present))


def _explicit_like(like, mesh, spec, what):
  """An array laid out like x (residual, dy, dh) on an Explicit mesh: itself when its
  spec is x's; resharded when it is replicated or unsharded where x is (a slice, no
  communication); a ValueError otherwise."""
  if like is None:
    return None
  other = jax.typeof(like).sharding
  if getattr(other, "mesh", None) is None or other.mesh.empty or not any(
      _axes(e) for e in tuple(other.spec)):
    return _reshard(like, mesh, spec)
  other_spec, *_ = mesh_layout(like.shape, other.spec, dict(mesh.shape), what)
  if tuple(other_spec) != tuple(spec):
    raise ValueError(f"pallas_norm: {what} is sharded {other_spec} but x {spec}; shard "
                     f"them alike (pallas_norm never reshards them)")
  return like


def forward(fwd2d, x, scale, bias, st, return_residuals, residual=None, x_scale=None):
  """y (and the residuals) of ``x: [..., N]``, rank >= 2, wherever x lives.

  ``fwd2d(x2, scale, bias, st, return_residuals, combine_stats, residual2)`` is the
  single-device launcher on [M, n] (ops._forward; with FP8 x it also takes
  ``x_scale=`` [M, n // G]). ``residual``: None, or laid out like x (the fused add).
  ``x_scale``: None, or FP8 x's scales [..., N // G], laid out like x (a hidden shard
  holds its own groups). Returns (y [..., N], mean [...] | None, rstd [...] | None,
  h [..., N] | None).
  """
  if st.axis_name is not None:  # inside the caller's shard_map
    return _local_forward(fwd2d, x, scale, bias, st, return_residuals, st.axis_name,
                          residual, x_scale)
  explicit = _explicit_sharding(x)
  if explicit is not None:
    mesh, sharding = explicit
    spec, row_spec, p_spec, _, hidden = _plan(mesh, x.shape, sharding)
    scale, bias = (_reshard(p, mesh, p_spec) for p in (scale, bias))
    residual = _explicit_like(residual, mesh, spec, "residual")
    _scale_sharding(mesh, spec, x_scale)
    x_scale = _explicit_like(x_scale, mesh, spec, "x_scale")
    out_specs = (spec, row_spec if return_residuals and st.subtract_mean else None,
                 row_spec if return_residuals else None,
                 spec if residual is not None else None)
    body = functools.partial(_local_forward, fwd2d, st=st, return_residuals=return_residuals,
                             hidden=hidden)
    return _shard_map(lambda x, s, b, r, xs: body(x, s, b, residual=r, x_scale=xs), mesh,
                      (x, scale, bias, residual, x_scale), (spec, p_spec, p_spec, spec, spec),
                      out_specs)
  if jax.device_count() > 1:
    local = functools.partial(_local_forward, fwd2d, st=st, return_residuals=return_residuals,
                              hidden=())
    return _unbatched(
        lambda x, s, b, r, xs: _fwd_cp(x, (s, b), r, xs, fwd2d, st, return_residuals),
        lambda x, s, b, r, xs: local(x, s, b, residual=r, x_scale=xs), x, scale, bias,
        residual, x_scale)
  return _local_forward(fwd2d, x, scale, bias, st, return_residuals, (), residual, x_scale)


def backward(bwd2d, dy, x, scale, bias, mean, rstd, st, dh=None, x_scale=None):
  """(dx [..., N], dresidual [..., N] | None, dscale [N] | None, dbias [N] | None) for
  ``forward``'s residuals; with a residual, x is h and ``dh`` its cotangent; with FP8
  x, ``x_scale`` its scales, as in ``forward``.

  ``bwd2d(dy2, x2, scale, bias, mean, rstd, st, combine_row_sums, param_grad_dtype,
  dh2)`` is the single-device launcher on [M, n] (ops._backward; with FP8 x it also
  takes ``x_scale=``).
  """
  if st.axis_name is not None:
    return _local_backward(bwd2d, dy, x, scale, bias, mean, rstd, st, st.axis_name, (), dh,
                           x_scale)
  explicit = _explicit_sharding(x)
  if explicit is not None:
    mesh, sharding = explicit
    spec, row_spec, p_spec, rows, hidden = _plan(mesh, x.shape, sharding)
    param_specs = [None if p is None else jax.typeof(p).sharding.spec for p in (scale, bias)]
    scale, bias = (_reshard(p, mesh, p_spec) for p in (scale, bias))
    dy = _reshard(dy, mesh, spec)
    dh = _reshard(dh, mesh, spec)
    _scale_sharding(mesh, spec, x_scale)
    x_scale = _explicit_like(x_scale, mesh, spec, "x_scale")
    def body(dy, x, s, b, mu, r, dh, xs):
      return _local_backward(bwd2d, dy, x, s, b, mu, r, st, hidden, rows, dh, xs)

    dx, dres, dscale, dbias = _shard_map(
        body, mesh, (dy, x, scale, bias, mean, rstd, dh, x_scale),
        (spec, spec, p_spec, p_spec, row_spec, row_spec, spec, spec),
        (spec, spec if st.residual_dtype else None, p_spec if scale is not None else None,
         p_spec if bias is not None else None))
    dscale, dbias = (None if d is None else _reshard(d, mesh, ps)
                     for d, ps in zip((dscale, dbias), param_specs))
    return dx, dres, dscale, dbias
  if jax.device_count() > 1:
    local = functools.partial(_local_backward, bwd2d, st=st, hidden=(), rows=())
    return _unbatched(
        lambda dy, x, s, b, mu, r, dh, xs: _bwd_cp(dy, x, (s, b), mu, r, dh, xs, bwd2d, st),
        lambda dy, x, s, b, mu, r, dh, xs: local(dy, x, s, b, mu, r, dh=dh, x_scale=xs),
        dy, x, scale, bias, mean, rstd, dh, x_scale)
  return _local_backward(bwd2d, dy, x, scale, bias, mean, rstd, st, (), (), dh, x_scale)
