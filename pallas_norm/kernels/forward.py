"""Pallas forward kernels (Triton lowering) for RMSNorm and LayerNorm.

Three kernels, one per mode (TileGym's names), each with its own grid and loop:

  multi_wave_cached   grid = cdiv(M, block_m). One row block per program; the whole
                      [block_m, block_n >= N] tile is loaded once and stays in registers.
  multi_wave_reload   grid = cdiv(M, block_m). One row block per program; pass 1 walks
                      the row in block_n chunks accumulating fp32 statistics, pass 2
                      reloads each chunk to normalise. Any N (262144 and beyond).
  static_persistent   grid = num_programs (about SMs x occupancy). Each program loops
                      over row blocks with a grid stride. When the row fits one tile,
                      scale/bias are loaded once per program (hoisted), several short
                      rows are packed per tile (e.g. Qwen3 QK-norm, 32768 x 128) and the
                      next row block is prefetched while the current one is reduced;
                      otherwise each row block is chunked as in multi_wave_reload.

Outside ``jax.vjp`` the forward runs without residuals (``return_residuals=False``):
no mean/rstd are written.

RMSNorm and LayerNorm share the kernels through the static ``subtract_mean`` flag.
LayerNorm's variance is two-pass within a tile, and chunked rows combine per-chunk
(mean, M2) pairs with Chan et al.'s parallel update; never E[x^2] - E[x]^2.

Refs end in ``_ref``; x is [M, N] and indexed with (row, col) index vectors, so the
Triton lowering switches to 64-bit offsets by itself when x exceeds 2**32 bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.config import ForwardConfig, cdiv

__all__ = ["norm_forward"]

_F32 = jnp.float32


# --------------------------------------------------------------------------- tile helpers


def _tile_index(rb, k, m, n, *, block_m, block_n, rows_in_bounds=False):
  """Rows [block_m], cols [block_n] and the masks of tile (rb, k).

  A mask the shapes make unnecessary is None (statically): columns when block_n divides
  N, rows when block_m divides M and the caller guarantees ``rb`` is a valid row block.
  Unmasked loads and stores vectorise without per-element predicates.
  """
  rows = rb * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [block_m]
  cols = k * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [block_n]
  row_mask = None if rows_in_bounds and m % block_m == 0 else rows < m
  col_mask = None if n % block_n == 0 else cols < n
  shape = (block_m, block_n)
  if row_mask is None:
    mask = None if col_mask is None else jnp.broadcast_to(col_mask[None, :], shape)
  elif col_mask is None:
    mask = jnp.broadcast_to(row_mask[:, None], shape)
  else:
    mask = row_mask[:, None] & col_mask[None, :]
  return rows, cols, row_mask, col_mask, mask


def _load(ref_at, mask, **kwargs):
  """Masked load with 0 outside the mask (or a plain load when mask is None)."""
  return plgpu.load(ref_at, mask=mask, other=None if mask is None else 0.0, **kwargs)


def _where0(mask, a):
  return a if mask is None else jnp.where(mask, a, 0.0)


def _load_tile(ref, rows, cols, mask, eviction_policy=None):
  return _load(ref.at[rows[:, None], cols[None, :]], mask,
               eviction_policy=eviction_policy).astype(_F32)  # [block_m, block_n] f32


def _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset):
  """w = scale_offset + scale and b = bias as [block_n] f32 (None when absent)."""
  w = b = None
  if scale_ref is not None:
    w = _load(scale_ref.at[cols], col_mask).astype(_F32)
    if scale_offset:
      w = w + _F32(scale_offset)
  if bias_ref is not None:
    b = _load(bias_ref.at[cols], col_mask).astype(_F32)
  return w, b


def _affine(x_hat, w, b):
  y = x_hat  # [block_m, block_n] f32
  if w is not None:
    y = y * w[None, :]
  if b is not None:
    y = y + b[None, :]
  return y


def _store_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd):
  if rstd_ref is None:  # no residuals wanted (a forward outside of jax.vjp)
    return
  plgpu.store(rstd_ref.at[rows], rstd, mask=row_mask)
  if mean_ref is not None:
    plgpu.store(mean_ref.at[rows], mean, mask=row_mask)


def _load_row_block(x_ref, rb, *, n, block_m, block_n):
  """x tile of row block ``rb`` in x's dtype; rows past M are masked (no memory access)."""
  rows, cols, _, _, mask = _tile_index(rb, 0, x_ref.shape[0], n, block_m=block_m,
                                       block_n=block_n)
  return _load(x_ref.at[rows[:, None], cols[None, :]], mask)


def _single_tile(rb, refs, params, *, n, eps, subtract_mean, block_m, block_n, x=None):
  """Normalise row block ``rb`` held as one [block_m, block_n >= N] tile.

  ``params()`` gives (w, b), called once the statistics are done: the multi-wave kernel
  loads scale/bias there, so that they are not live in registers across the reductions
  (a [2, 8192] LayerNorm tile at 4 warps took 161 registers a thread with them loaded
  first, against 127 for tokamax's kernel, which loads them last; H200 ncu). The
  persistent kernel passes the values it hoisted. ``x`` is the tile when the caller
  already loaded it (a prefetch); else it is loaded.
  """
  x_ref, y_ref, mean_ref, rstd_ref = refs
  m = x_ref.shape[0]
  rows, cols, row_mask, _, mask = _tile_index(rb, 0, m, n, block_m=block_m, block_n=block_n,
                                              rows_in_bounds=True)
  if x is None:
    x = _load_row_block(x_ref, rb, n=n, block_m=block_m, block_n=block_n)
  x = x.astype(_F32)  # [block_m, block_n] f32, 0 outside
  if subtract_mean:
    mean = jnp.sum(x, axis=1) / n  # [block_m]
    x = _where0(mask, x - mean[:, None])
  else:
    mean = None
  var = jnp.sum(x * x, axis=1) / n  # [block_m] (mean square for RMSNorm)
  rstd = lax.rsqrt(var + _F32(eps))
  w, b = params()
  y = _affine(x * rstd[:, None], w, b)
  plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
  _store_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd)


def _chunked_rows(rb, refs, scale_ref, bias_ref, *, n, eps, scale_offset, subtract_mean,
                  block_m, block_n):
  """Normalise row block ``rb`` in block_n chunks: statistics pass, then reload pass."""
  x_ref, y_ref, mean_ref, rstd_ref = refs
  m = x_ref.shape[0]
  num_chunks = cdiv(n, block_n)
  tile = functools.partial(_tile_index, rb, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)

  def stats_body(k, carry):
    mean, acc = carry  # [block_m] f32: running mean (LayerNorm) and M2 / sum of squares
    rows, cols, _, _, mask = tile(k)
    # evict_last: this chunk is read again by pass 2.
    x = _load_tile(x_ref, rows, cols, mask, eviction_policy="evict_last")
    if not subtract_mean:
      return mean, acc + jnp.sum(x * x, axis=1)
    count = (k * block_n).astype(_F32)  # elements already folded in
    nk = jnp.minimum(block_n, n - k * block_n).astype(_F32)  # elements in this chunk
    cmean = jnp.sum(x, axis=1) / nk
    xc = _where0(mask, x - cmean[:, None])
    cm2 = jnp.sum(xc * xc, axis=1)
    total = count + nk
    delta = cmean - mean
    return mean + delta * (nk / total), acc + cm2 + delta * delta * (count * nk / total)

  zeros = jnp.zeros((block_m,), _F32)
  mean, acc = lax.fori_loop(0, num_chunks, stats_body, (zeros, zeros))
  rstd = lax.rsqrt(acc / n + _F32(eps))  # [block_m]

  @pl.loop(0, num_chunks)
  def _normalise(j):
    # Walk the chunks backwards: the last ones read by pass 1 are the likeliest to
    # still be in L2.
    rows, cols, _, col_mask, mask = tile(num_chunks - 1 - j)
    x = _load_tile(x_ref, rows, cols, mask, eviction_policy="evict_first")
    if subtract_mean:
      x = x - mean[:, None]
    w, b = _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset)
    y = _affine(x * rstd[:, None], w, b)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)

  rows, _, row_mask, _, _ = tile(0)
  _store_stats(mean_ref, rstd_ref, rows, row_mask, mean if subtract_mean else None, rstd)


# --------------------------------------------------------------------------- kernels


def _split_refs(refs, has_scale, has_bias, subtract_mean, return_residuals):
  """(x, scale, bias) inputs then (y, mean, rstd) outputs; absent ones are None."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  y_ref = refs.pop(0)
  mean_ref = refs.pop(0) if subtract_mean and return_residuals else None
  rstd_ref = refs.pop(0) if return_residuals else None
  return x_ref, scale_ref, bias_ref, (x_ref, y_ref, mean_ref, rstd_ref)


def _cached_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                   return_residuals,
                   block_m, block_n):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals)
  _, cols, _, col_mask, _ = _tile_index(0, 0, 1, n, block_m=1, block_n=block_n)
  params = functools.partial(_load_params, scale_ref, bias_ref, cols, col_mask, scale_offset)
  _single_tile(pl.program_id(0), io, params, n=n, eps=eps, subtract_mean=subtract_mean,
               block_m=block_m, block_n=block_n)


def _reload_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                   return_residuals,
                   block_m, block_n):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals)
  _chunked_rows(pl.program_id(0), io, scale_ref, bias_ref, n=n, eps=eps,
                scale_offset=scale_offset, subtract_mean=subtract_mean,
                block_m=block_m, block_n=block_n)


def _persistent_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                       return_residuals,
                       block_m, block_n, num_programs):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals)
  num_row_blocks = cdiv(x_ref.shape[0], block_m)
  if block_n >= n:
    # The row fits one tile: load scale/bias once for all of this program's row blocks.
    _, cols, _, col_mask, _ = _tile_index(0, 0, 1, n, block_m=1, block_n=block_n)
    w, b = _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset)

    pid = pl.program_id(0)
    load = functools.partial(_load_row_block, x_ref, n=n, block_m=block_m, block_n=block_n)

    def body(i, x):
      rb = pid + i * num_programs
      # Prefetch the next row block before working on this one: its loads are in
      # flight during this block's reductions. Past the last block it is fully masked.
      x_next = load(rb + num_programs)
      _single_tile(rb, io, lambda: (w, b), n=n, eps=eps, subtract_mean=subtract_mean,
                   block_m=block_m, block_n=block_n, x=x)
      return x_next

    num_steps = (num_row_blocks - 1 - pid) // num_programs + 1
    lax.fori_loop(0, num_steps, body, load(pid))
  else:
    @pl.loop(pl.program_id(0), num_row_blocks, step=num_programs)
    def _row_block(rb):
      _chunked_rows(rb, io, scale_ref, bias_ref, n=n, eps=eps, scale_offset=scale_offset,
                    subtract_mean=subtract_mean, block_m=block_m, block_n=block_n)


# --------------------------------------------------------------------------- launcher


def norm_forward(x, scale, bias, *, eps: float, scale_offset: float, subtract_mean: bool,
                 config: ForwardConfig, interpret: bool, return_residuals: bool = True):
  """Launch the forward kernel that ``config.mode`` names.

  Args:
    x: [M, N] float32/bfloat16/float16.
    scale, bias: [N] float arrays or None.
    eps, scale_offset, subtract_mean: as in ``pallas_norm.layer_norm``.
    config: the launch config (mode, block_m, block_n, num_warps, num_programs).
    interpret: run in Pallas interpret mode.
    return_residuals: write mean/rstd (what the backward needs). A plain forward skips
      them: at 4096 x 1024 bf16 the kernel writing them took ~1.3 us more (H200).

  Returns:
    (y [M, N] x.dtype, mean [M] f32 or None, rstd [M] f32 or None). mean is None for
    RMSNorm; both are None without ``return_residuals``.

  Raises:
    NotImplementedError: multi_wave_cached with ``config.block_n < N``.
  """
  m, n = x.shape
  cfg = config
  statics = dict(n=n, eps=float(eps), scale_offset=float(scale_offset),
                 subtract_mean=subtract_mean, has_scale=scale is not None,
                 has_bias=bias is not None, return_residuals=return_residuals,
                 block_m=cfg.block_m, block_n=cfg.block_n)
  num_row_blocks = cdiv(m, cfg.block_m)
  if cfg.mode == "multi_wave_cached":
    if cfg.block_n < n:
      raise NotImplementedError(
          f"multi_wave_cached needs the whole row in one tile: {cfg.block_n=} < {n=}; "
          f"use mode='multi_wave_reload'")
    kernel, grid, name = _cached_kernel, num_row_blocks, "pallas_norm_fwd_cached"
  elif cfg.mode == "multi_wave_reload":
    kernel, grid, name = _reload_kernel, num_row_blocks, "pallas_norm_fwd_reload"
  else:
    grid = max(1, min(cfg.num_programs or num_row_blocks, num_row_blocks))
    statics["num_programs"] = grid
    kernel, name = _persistent_kernel, "pallas_norm_fwd_persistent"
  out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)]
  if return_residuals:
    out_shape += [jax.ShapeDtypeStruct((m,), _F32)] * (2 if subtract_mean else 1)
  inputs = [a for a in (x, scale, bias) if a is not None]
  outs = pl.pallas_call(
      functools.partial(kernel, **statics),
      out_shape=out_shape,
      grid=(grid,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name=name,
  )(*inputs)
  y, *stats = outs
  if not return_residuals:
    return y, None, None
  return (y, *stats) if subtract_mean else (y, None, *stats)
