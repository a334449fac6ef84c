"""Pallas backward kernels (Triton lowering) for RMSNorm and LayerNorm.

Math, per row (x_hat = (x - mean) * rstd, w = scale_offset + scale, g = dy * w, N the
row length; RMSNorm has mean = 0 and c2 = 0):

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N
    dx = (g - (x_hat * c1 + c2)) * rstd
    dscale = sum over rows of dy * x_hat
    dbias  = sum over rows of dy

Stage 1 (``pallas_norm_bwd_persistent``): G = ``num_programs`` programs, each looping
over row blocks with a grid stride (TileGym's persistent backward). It writes dx and
accumulates fp32 dscale/dbias partials, one row per program: [G, N], never [M, N].
  - single tile (block_n >= N): the partials stay in registers across row blocks and
    scale is loaded once per program;
  - chunked (block_n < N): pass 1 computes c1/c2 over chunks, pass 2 writes dx and adds
    into the program's own partial row in memory (each row has one owner: no atomics).
Stage 2 (``pallas_norm_bwd_reduce``): sums [G, N] -> [N] in a fixed order and casts to
the parameter's dtype. Without atomics the gradients are bitwise deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.config import BackwardConfig, cdiv
from pallas_norm.kernels.forward import _load_params, _load_tile, _tile_index

__all__ = ["norm_backward"]

_F32 = jnp.float32


def _row_stats(mean_ref, rstd_ref, rows, row_mask):
  rstd = plgpu.load(rstd_ref.at[rows], mask=row_mask, other=0.0)  # [block_m] f32
  mean = None
  if mean_ref is not None:
    mean = plgpu.load(mean_ref.at[rows], mask=row_mask, other=0.0)
  return mean, rstd


def _x_hat_g(x_ref, dy_ref, rows, cols, mask, mean, rstd, w):
  x = _load_tile(x_ref, rows, cols, mask)  # [block_m, block_n] f32
  dy = _load_tile(dy_ref, rows, cols, mask)
  if mean is not None:
    x = x - mean[:, None]
  x_hat = jnp.where(mask, x * rstd[:, None], 0.0)
  g = dy if w is None else dy * w[None, :]
  return x_hat, dy, g


def _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd):
  dx = g - x_hat * c1[:, None]
  if c2 is not None:
    dx = dx - c2[:, None]
  dx = dx * rstd[:, None]
  plgpu.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dx_ref.dtype), mask=mask)


def _split_refs(refs, has_scale, has_bias, subtract_mean):
  """(dy, x, scale, mean, rstd) inputs then (dx, dscale_part, dbias_part) outputs."""
  refs = list(refs)
  dy_ref, x_ref = refs.pop(0), refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref, dx_ref = refs.pop(0), refs.pop(0)
  dw_ref = refs.pop(0) if has_scale else None
  db_ref = refs.pop(0) if has_bias else None
  return dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref


def _bwd_persistent_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                           block_m, block_n, num_programs):
  (dy_ref, x_ref, scale_ref, mean_ref, rstd_ref,
   dx_ref, dw_ref, db_ref) = _split_refs(refs, has_scale, has_bias, subtract_mean)
  m = x_ref.shape[0]
  pid = pl.program_id(0)
  num_row_blocks = cdiv(m, block_m)
  # Row blocks of this program: pid, pid + G, ... (at least one, since G <= row blocks).
  num_steps = (num_row_blocks - 1 - pid) // num_programs + 1
  tile = functools.partial(_tile_index, m=m, n=n, block_m=block_m, block_n=block_n)

  if block_n >= n:
    cols = jnp.arange(block_n, dtype=jnp.int32)
    col_mask = cols < n
    w, _ = _load_params(scale_ref, None, cols, col_mask, scale_offset)  # hoisted

    def body(i, acc):
      dw_acc, db_acc = acc  # [block_n] f32 partials, in registers
      rows, _, row_mask, _, mask = tile(pid + i * num_programs, 0)
      mean, rstd = _row_stats(mean_ref, rstd_ref, rows, row_mask)
      x_hat, dy, g = _x_hat_g(x_ref, dy_ref, rows, cols, mask, mean, rstd, w)
      c1 = jnp.sum(x_hat * g, axis=1) / n  # [block_m]
      c2 = jnp.sum(g, axis=1) / n if subtract_mean else None
      _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd)
      return dw_acc + jnp.sum(dy * x_hat, axis=0), db_acc + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((block_n,), _F32)
    dw_acc, db_acc = lax.fori_loop(0, num_steps, body, (zeros, zeros))
    if dw_ref is not None:
      plgpu.store(dw_ref.at[pid, cols], dw_acc, mask=col_mask)
    if db_ref is not None:
      plgpu.store(db_ref.at[pid, cols], db_acc, mask=col_mask)
    return

  num_chunks = cdiv(n, block_n)
  part_refs = [r for r in (dw_ref, db_ref) if r is not None]

  @pl.loop(0, num_chunks)
  def _zero_partials(k):
    cols = k * block_n + jnp.arange(block_n, dtype=jnp.int32)
    for r in part_refs:
      plgpu.store(r.at[pid, cols], jnp.zeros((block_n,), _F32), mask=cols < n)

  @pl.loop(0, num_steps)
  def _row_block(i):
    rb = pid + i * num_programs
    rows, _, row_mask, _, _ = tile(rb, 0)
    mean, rstd = _row_stats(mean_ref, rstd_ref, rows, row_mask)

    def c_body(k, carry):
      c1, c2 = carry  # [block_m] f32 running sums
      _, cols, _, col_mask, mask = tile(rb, k)
      w, _ = _load_params(scale_ref, None, cols, col_mask, scale_offset)
      x_hat, _, g = _x_hat_g(x_ref, dy_ref, rows, cols, mask, mean, rstd, w)
      return c1 + jnp.sum(x_hat * g, axis=1), c2 + jnp.sum(g, axis=1)

    zeros = jnp.zeros((block_m,), _F32)
    c1, c2 = lax.fori_loop(0, num_chunks, c_body, (zeros, zeros))
    c1 = c1 / n
    c2 = c2 / n if subtract_mean else None

    @pl.loop(0, num_chunks)
    def _dx_chunk(k):
      _, cols, _, col_mask, mask = tile(rb, k)
      w, _ = _load_params(scale_ref, None, cols, col_mask, scale_offset)
      x_hat, dy, g = _x_hat_g(x_ref, dy_ref, rows, cols, mask, mean, rstd, w)
      _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd)
      for r, d in ((dw_ref, dy * x_hat), (db_ref, dy)):
        if r is not None:
          part = plgpu.load(r.at[pid, cols], mask=col_mask, other=0.0)
          plgpu.store(r.at[pid, cols], part + jnp.sum(d, axis=0), mask=col_mask)


def _reduce_kernel(part_ref, out_ref, *, block_g, block_n):
  """out[cols] = sum over the G partial rows, in a fixed order."""
  g_total, n = part_ref.shape
  cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
  col_mask = cols < n

  def load(j):
    rows = j * block_g + jnp.arange(block_g, dtype=jnp.int32)
    mask = (rows < g_total)[:, None] & col_mask[None, :]
    return plgpu.load(part_ref.at[rows[:, None], cols[None, :]], mask=mask,
                      other=0.0)  # [block_g, block_n] f32

  if block_g >= g_total:  # one tile holds every partial row: a single load
    acc = load(0)
  else:
    acc = lax.fori_loop(1, cdiv(g_total, block_g), lambda j, acc: acc + load(j), load(0))
  plgpu.store(out_ref.at[cols], jnp.sum(acc, axis=0).astype(out_ref.dtype), mask=col_mask)


def _reduce_partials(part, dtype, cfg: BackwardConfig, interpret: bool):
  """[G, N] f32 -> [N] in ``dtype``."""
  _, n = part.shape
  return pl.pallas_call(
      functools.partial(_reduce_kernel, block_g=cfg.reduce_block_g, block_n=cfg.reduce_block_n),
      out_shape=jax.ShapeDtypeStruct((n,), dtype),
      grid=(cdiv(n, cfg.reduce_block_n),),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.reduce_num_warps, num_stages=1),
      interpret=interpret,
      name="pallas_norm_bwd_reduce",
  )(part)


def norm_backward(dy, x, scale, mean, rstd, *, has_bias: bool, scale_offset: float,
                  subtract_mean: bool, config: BackwardConfig, interpret: bool,
                  scale_dtype=None, bias_dtype=None):
  """Two-stage backward.

  Args:
    dy, x: [M, N] (x's dtype).
    scale: [N] or None.
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32, saved by the forward.
    has_bias: whether to produce dbias.
    scale_offset, subtract_mean: as in the forward.
    config: BackwardConfig (block_m, block_n, num_warps, num_programs = G, stage 2 knobs).
    interpret: run in Pallas interpret mode.
    scale_dtype, bias_dtype: dtypes of dscale and dbias.

  Returns:
    (dx [M, N] x.dtype, dscale [N] scale_dtype or None, dbias [N] bias_dtype or None).
  """
  m, n = x.shape
  cfg = config
  has_scale = scale is not None
  g = max(1, min(cfg.num_programs, cdiv(m, cfg.block_m)))
  out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)]
  out_shape += [jax.ShapeDtypeStruct((g, n), _F32)] * (int(has_scale) + int(has_bias))
  inputs = [a for a in (dy, x, scale, mean if subtract_mean else None, rstd) if a is not None]
  outs = pl.pallas_call(
      functools.partial(_bwd_persistent_kernel, n=n, scale_offset=float(scale_offset),
                        subtract_mean=subtract_mean, has_scale=has_scale, has_bias=has_bias,
                        block_m=cfg.block_m, block_n=cfg.block_n, num_programs=g),
      out_shape=out_shape,
      grid=(g,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name="pallas_norm_bwd_persistent",
  )(*inputs)
  dx, parts = outs[0], list(outs[1:])
  dscale = _reduce_partials(parts.pop(0), scale_dtype, cfg, interpret) if has_scale else None
  dbias = _reduce_partials(parts.pop(0), bias_dtype, cfg, interpret) if has_bias else None
  return dx, dscale, dbias
