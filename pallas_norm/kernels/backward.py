"""Pallas backward kernels (Triton lowering) for RMSNorm and LayerNorm.

Math, per row (x_hat = (x - mean) * rstd, w = scale_offset + scale, g = dy * w, N the
row length; RMSNorm has mean = 0 and c2 = 0):

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N
    dx = (g - (x_hat * c1 + c2)) * rstd
    dscale = sum over rows of dy * x_hat
    dbias  = sum over rows of dy

Stage 1 writes dx and fp32 dscale/dbias partials, one partial row per program, [G, N],
never [M, N]:
  - single tile (block_n >= N), ``pallas_norm_bwd_persistent``: G programs (about the
    SM count) each loop over row blocks with a grid stride (TileGym's persistent
    backward), prefetching the next row block; scale is loaded once and the partials
    stay in registers across row blocks. With ``config.pieces`` the tile is column
    pieces of those widths (LayerNorm 2048 < N <= 3072: 2048 + 512 or 1024);
  - chunked (block_n < N, long rows): ``pallas_norm_bwd_row_stats`` first computes
    c1 and c2 per row ([M] f32 each); then ``pallas_norm_bwd_columns`` runs a
    persistent [G, N / block_n] grid: program (r, k) owns column chunk k for row
    blocks r, r + G, ..., so its partials again stay in registers. x and dy are read
    twice, and there is no read-modify-write of partials;
  - reload rows (``config.reload_rows``, block_n < N; no default picks it since the
    split-row rule of 2026-11-22), ``pallas_norm_bwd_reload``: G programs walk whole
    rows, pass 1 for c1 and c2, pass 2 reloading x and dy from L2 for dx, with every
    chunk's partials in registers, so x and dy come from HBM once
    (``_bwd_reload_kernel``);
  - split rows (``config.split_rows``, block_n < N; the default for rows wider than one
    tile, up to 4096 x SMs), ``pallas_norm_bwd_split``: each row over cdiv(N, block_n)
    programs that exchange
    their shares of c1 (and c2) through slots in global memory, so x and dy are read
    once (``_bwd_split_kernel``).
FP8 x (``x_scale=``): every stage-1 kernel loads x through forward.py's ``_load_x``,
which dequantises it again in registers; dx is written in ``dx_dtype``.
Stage 2 (``pallas_norm_bwd_reduce``): sums [G, N] -> [N] in a fixed order and casts to
the parameter's dtype, dscale's and dbias's partials in one launch, one program a
(column strip, array). With G = 1 there is no stage 2: stage 1's one partial row is the
sum, stored in the parameter's dtype.
Few rows (``config.fused_reduce``, single tile): one kernel, ``pallas_norm_bwd_fused``.
Its first G programs are the persistent stage 1 without partials; the others sum
dscale/dbias of one column strip each over all M rows, in row order, from x, dy and the
forward's rstd/mean (``_column_sums``): no program waits for another, one launch instead
of two, at the price of reading x and dy a second time (from L2, at these sizes). No
atomic accumulates anything (the split kernel's one atomic hands out program numbers),
so the gradients are bitwise deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.config import BackwardConfig, cdiv, next_power_of_2, split_resident_programs
from pallas_norm.kernels._compat import out_struct
from pallas_norm.kernels.forward import (_chunk_index, _load, _load_params, _load_stream,
                                         _load_x, _round, _slot_bits, _split_count,
                                         _split_rows_call, _split_rows_loop, _split_rows_refs,
                                         _split_slot_tiles, _tile_index, _where0, _x_src,
                                         _y_dtype, _f32_again, fp8_group_size)

__all__ = ["norm_backward"]

_F32 = jnp.float32


def _row_stats(mean_ref, rstd_ref, rows, row_mask):
  rstd = _load(rstd_ref.at[rows], row_mask)  # [block_m] f32
  mean = None
  if mean_ref is not None:
    mean = _load(mean_ref.at[rows], row_mask)
  return mean, rstd


class _DxOut:
  """dx's destination with a fused residual add (``residual=``): ``dh`` (the cotangent
  of h = x + residual, or None) is added to dx in float32, and the sum is stored in
  x's dtype (``dx``) and, when it differs, in the residual's (``dres``)."""

  def __init__(self, dx_ref, dres_ref, dh_ref):
    self.dx, self.dres, self.dh = dx_ref, dres_ref, dh_ref


def _dx_out(dx_ref, dres_ref, dh_ref):
  if dres_ref is None and dh_ref is None:
    return dx_ref
  return _DxOut(dx_ref, dres_ref, dh_ref)


# LayerNorm's backward stage 1 with the fused residual add prefetches the next row
# block's dh with its x and dy when block_n <= this; wider tiles, and RMSNorm, load dh at
# the store. H200, bf16 (docs/tuning_rules.md#residual): prefetched, LayerNorm 8192x4096
# 98.4 -> 91.8 us ([1, 4096] x 16 warps) and 88.5 -> 82.6 ([2, 4096] x 8), 16384x4096
# 187.9 -> 177.1; but [1, 8192] tiles lose (LayerNorm 8192x8192 171.6 -> 199.6, RMSNorm
# 141.8 -> 156.3), and so does RMSNorm's [1, 4096] x 16 at 2 programs a SM (the kernel
# bench's rms_res forward+backward 8192x4096 from 89% to 80% of copy).
PREFETCH_DH_MAX_BLOCK_N = 4096


def _load_dh(dx_ref, rows, cols, mask):
  """The dh tile (its dtype) of a _DxOut destination with one, else None."""
  if not isinstance(dx_ref, _DxOut) or dx_ref.dh is None:
    return None
  return _load_stream(dx_ref.dh.at[rows[:, None], cols[None, :]], mask)


def _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd, dh=None):
  """dx = (g - (x_hat c1 + c2)) rstd, plus h's cotangent with the fused residual add:
  ``dh`` when the caller loaded (prefetched) that tile, else loaded here."""
  dx = g - x_hat * c1[:, None]
  if c2 is not None:
    dx = dx - c2[:, None]
  dx = dx * rstd[:, None]
  idx = (rows[:, None], cols[None, :])
  if isinstance(dx_ref, _DxOut):
    if dh is not None:
      dx = dx + dh.astype(_F32)
    elif dx_ref.dh is not None:
      dx = dx + _load_stream(dx_ref.dh.at[idx], mask).astype(_F32)
    if dx_ref.dres is not None:
      plgpu.store(dx_ref.dres.at[idx], dx.astype(dx_ref.dres.dtype), mask=mask)
    dx_ref = dx_ref.dx
  plgpu.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)


def _split_refs(refs, has_scale, has_bias, subtract_mean, n_extra_in=0, has_dh=False,
                has_dres=False, group_size=0):
  """(dy, x, x_scale, scale, mean, rstd, *extra, dh) inputs then (dx, dres, dscale_part,
  dbias_part) outputs; with dh or dres, dx_ref is their _DxOut; with a ``group_size``
  (FP8 x), x_ref is the forward's _Fp8 of x and x_scale."""
  refs = list(refs)
  dy_ref = refs.pop(0)
  x_ref = _x_src(refs.pop(0), refs, group_size, "backward", subtract_mean)
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  extra = [refs.pop(0) for _ in range(n_extra_in)]
  dh_ref = refs.pop(0) if has_dh else None
  dx_ref = refs.pop(0)
  dx_ref = _dx_out(dx_ref, refs.pop(0) if has_dres else None, dh_ref)
  dw_ref = refs.pop(0) if has_scale else None
  db_ref = refs.pop(0) if has_bias else None
  return dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, extra, dx_ref, dw_ref, db_ref


def _load_xdy(x_ref, dy_ref, rows, cols, mask, eviction_policy=None):
  """Raw x and dy tiles (their own dtype; FP8 x dequantised, float32); masked elements
  do not touch memory."""
  idx = (rows[:, None], cols[None, :])
  return (_load_x(x_ref, rows, cols, mask, first=False, eviction_policy=eviction_policy),
          _load_stream(dy_ref.at[idx], mask, eviction_policy=eviction_policy))


def _x_hat_g(x, dy, mask, mean, rstd, w, cast=None):
  """(x_hat, dy, g, x_hat_w) [block_m, block_n] f32: g = dy * w is x_hat's cotangent,
  x_hat_w what dscale sums dy against. ``cast`` (x's and y's dtype names, for
  ``cast="llama"``): g through the forward's roundings' transposes (to y's dtype, then
  x's), and x_hat_w the rounded x_hat the weight multiplied."""
  x = x.astype(_F32)  # [block_m, block_n] f32
  dy = dy.astype(_F32)
  if mean is not None:
    x = x - mean[:, None]
  x_hat = _where0(mask, x * rstd[:, None])
  g = dy if w is None else dy * w[None, :]
  if cast is None:
    return x_hat, dy, g, x_hat
  x_dtype, y_dtype = cast
  return x_hat, dy, _round(_round(g, y_dtype), x_dtype), _round(x_hat, x_dtype)


def _store_partials(dw_ref, db_ref, r, cols, col_mask, dw_acc, db_acc):
  """Partial row r (float32; or, with one stage-1 program, the sums themselves in the
  parameters' dtypes)."""
  if dw_ref is not None:
    plgpu.store(dw_ref.at[r, cols], dw_acc.astype(dw_ref.dtype), mask=col_mask)
  if db_ref is not None:
    plgpu.store(db_ref.at[r, cols], db_acc.astype(db_ref.dtype), mask=col_mask)


def _piece_index(rb, offset, width, *, m, n, block_m, rows_in_bounds=False):
  """_tile_index of the ``width``-wide column piece at static ``offset`` (a multiple of
  width), its column mask dropped (None) when the piece lies inside the row."""
  rows, cols, row_mask, col_mask, mask = _tile_index(
      rb, offset // width, m, n, block_m=block_m, block_n=width,
      rows_in_bounds=rows_in_bounds)
  if col_mask is not None and offset + width <= n:
    col_mask = None
    mask = None if row_mask is None else jnp.broadcast_to(row_mask[:, None],
                                                          (block_m, width))
  return rows, cols, row_mask, col_mask, mask


def _sum(terms):
  """terms[0] + terms[1] + ..., in order (one term: itself, with no added 0)."""
  return functools.reduce(lambda a, b: a + b, terms)


def _row_sums(a, b):
  """(sum(a, axis=1), sum(b, axis=1)) of two [block_m, block_n] f32 tiles as one
  reduction of the pair (BackwardConfig.joint_row_sums): on the GPU a Triton reduce of
  their [block_m, block_n, 2] join, whose cross-warp step takes one set of barriers for
  both sums. Each sum adds the same values in the same order as its own reduction."""
  pair = jnp.sum(lax.stack([a, b], axis=2), axis=1)  # [block_m, 2]; tt.join in Triton
  return tuple(lax.unstack(pair, axis=1))  # tt.split


def _persistent_columns(refs, c_refs, r, k, *, n, scale_offset, block_m, block_n,
                        num_programs, pieces=(), cast=None, prefetch_depth=1,
                        recompute_dx=False, prefetch_stats=False, joint_row_sums=False,
                        reload_scale=False):
  """Program (r, k): dx and partials of column chunk k for row blocks r, r + G, ...

  ``c_refs`` is None when the row fits the tile (c1, c2 are computed here), else the
  [M] f32 refs (c1, and c2 for LayerNorm) from the row-statistics kernel. ``pieces``
  (single tile only): the tile as column pieces of these widths, side by side from
  column 0, instead of one block_n-wide tile. ``prefetch_depth``, ``recompute_dx``,
  ``prefetch_stats``, ``joint_row_sums`` and ``reload_scale``: BackwardConfig's.
  """
  dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = refs
  m = x_ref.shape[0]
  widths = tuple(pieces) or (block_n,)
  if pieces:  # one tile (k = 0): static offsets
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    tiles = [functools.partial(_piece_index, offset=o, width=w, m=m, n=n, block_m=block_m)
             for o, w in zip(offsets, widths)]
  else:  # column chunk k (a program id in the column-tiled pair)
    tiles = [functools.partial(_tile_index, k=k, m=m, n=n, block_m=block_m,
                               block_n=block_n)]
  def load_scale():  # one [width] f32 a piece
    out = []
    for tile in tiles:
      _, cols, _, col_mask, _ = tile(0)
      out.append(_load_params(scale_ref, None, cols, col_mask, scale_offset)[0])
    return out

  hoisted = None if reload_scale else load_scale()  # held across the row blocks

  prefetch_dh = mean_ref is not None and block_n <= PREFETCH_DH_MAX_BLOCK_N  # LayerNorm

  def load(rb):  # may be past the last row block (a prefetch): rows stay masked
    out = []
    for tile in tiles:
      rows, cols, _, _, mask = tile(rb)
      dh = _load_dh(dx_ref, rows, cols, mask) if prefetch_dh else None
      out.append(_load_xdy(x_ref, dy_ref, rows, cols, mask) + (dh,))
    stats = None
    if prefetch_stats:
      rows, _, row_mask, _, _ = tiles[0](rb)
      stats = _row_stats(mean_ref, rstd_ref, rows, row_mask)
    return tuple(out), stats

  depth = prefetch_depth  # >= 1 (BackwardConfig checks it)

  def body(i, carry):
    # [width] f32 partials in registers, a (dscale, dbias) pair a piece; the x, dy (and,
    # with the fused residual add, dh: PREFETCH_DH_MAX_BLOCK_N) tiles of this row block
    # and of the next depth - 1, a triple a piece each.
    accs, queue = carry
    xdy, stats = queue[0]
    rb = r + i * num_programs
    # Prefetch row block rb + depth * G (fully masked past the end) before this one's math.
    queue = queue[1:] + (load(rb + depth * num_programs),)
    idx = [tile(rb, rows_in_bounds=True) for tile in tiles]
    rows, row_mask = idx[0][0], idx[0][2]
    mean, rstd = stats if prefetch_stats else _row_stats(mean_ref, rstd_ref, rows, row_mask)
    ws = load_scale() if reload_scale else hoisted
    parts = [_x_hat_g(x, dy, t[4], mean, rstd, w, cast)
             for (x, dy, _), t, w in zip(xdy, idx, ws)]

    def accumulate():
      if dw_ref is None and db_ref is None:  # dx only (no partials)
        return accs
      return tuple((dw_acc + jnp.sum(dy * x_hat_w, axis=0), db_acc + jnp.sum(dy, axis=0))
                   for (_, dy, _, x_hat_w), (dw_acc, db_acc) in zip(parts, accs))

    # recompute_dx: the partials first, then dx from the raw (bf16) tiles again after
    # the row reductions, so that the float32 x_hat and g need not stay live across them
    new_accs = accumulate() if recompute_dx else None
    if c_refs is None and mean_ref is not None and joint_row_sums:
      sums = [_row_sums(x_hat * g, g) for x_hat, _, g, _ in parts]
      c1 = _sum([s1 for s1, _ in sums]) / n  # [block_m]
      c2 = _sum([s2 for _, s2 in sums]) / n
    elif c_refs is None:
      c1 = _sum([jnp.sum(x_hat * g, axis=1) for x_hat, _, g, _ in parts]) / n  # [block_m]
      c2 = None
      if mean_ref is not None:
        c2 = _sum([jnp.sum(g, axis=1) for _, _, g, _ in parts]) / n
    else:
      c1 = _load(c_refs[0].at[rows], row_mask)
      c2 = None
      if mean_ref is not None:
        c2 = _load(c_refs[1].at[rows], row_mask)
    for (x_hat, _, g, _), t, (x, dy, dh), w in zip(parts, idx, xdy, ws):
      if recompute_dx and cast is None and x.dtype == dy.dtype == jnp.bfloat16:
        x_hat, _, g, _ = _x_hat_g(_f32_again(x), _f32_again(dy), t[4], mean, rstd, w)
      _store_dx(dx_ref, rows, t[1], t[4], g, x_hat, c1, c2, rstd, dh)
    return (new_accs if recompute_dx else accumulate()), queue

  num_steps = (cdiv(m, block_m) - 1 - r) // num_programs + 1
  zeros = tuple((jnp.zeros((w,), _F32), jnp.zeros((w,), _F32)) for w in widths)
  queue = tuple(load(r + j * num_programs) for j in range(depth))
  accs, _ = lax.fori_loop(0, num_steps, body, (zeros, queue))
  for tile, (dw_acc, db_acc) in zip(tiles, accs):
    _, cols, _, col_mask, _ = tile(0)
    _store_partials(dw_ref, db_ref, r, cols, col_mask, dw_acc, db_acc)


def _bwd_persistent_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                           has_dh, has_dres, block_m, block_n, num_programs, chunked,
                           pieces=(), cast=None, group_size=0, prefetch_depth=1,
                           recompute_dx=False, prefetch_stats=False,
                           joint_row_sums=False, reload_scale=False):
  """Stage 1. Single tile: grid (G,), c1/c2 computed in the tile. Chunked: grid
  (G, cdiv(N, block_n)), c1 (and c2 for LayerNorm) read from the row-statistics kernel."""
  n_c = (2 if subtract_mean else 1) if chunked else 0
  (dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, c_refs,
   dx_ref, dw_ref, db_ref) = _split_refs(refs, has_scale, has_bias, subtract_mean, n_c,
                                         has_dh, has_dres, group_size)
  _persistent_columns((dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref),
                      c_refs if chunked else None, pl.program_id(0),
                      pl.program_id(1) if chunked else 0, n=n, scale_offset=scale_offset,
                      block_m=block_m, block_n=block_n, num_programs=num_programs,
                      pieces=pieces, cast=cast, prefetch_depth=prefetch_depth,
                      recompute_dx=recompute_dx, prefetch_stats=prefetch_stats,
                      joint_row_sums=joint_row_sums, reload_scale=reload_scale)


def _bwd_column_split_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                             has_dh, has_dres, block_m, block_n, num_programs, splits,
                             cast=None, group_size=0):
  """Stage 1 of a row in one tile over ``splits`` programs a row-block group
  (``BackwardConfig.column_splits``): program p = r * splits + k walks row blocks r,
  r + G, ... and for each loads the whole [block_m, block_n] tile of x and dy for the
  row sums c1 (and c2), the same reductions as ``_persistent_columns``'s, and (issued
  before those sums) reloads its columns [k * w, (k + 1) * w) (w = block_n / splits;
  from L2 but for the first load), then writes their dx and adds to their dscale/dbias
  partials, stored in row r of the partials (the sums themselves with one group). No
  exchange between programs."""
  (dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, _,
   dx_ref, dw_ref, db_ref) = _split_refs(refs, has_scale, has_bias, subtract_mean, 0,
                                         has_dh, has_dres, group_size)
  m = x_ref.shape[0]
  pid = pl.program_id(0)
  r, k = pid // splits, pid % splits
  tile = functools.partial(_tile_index, k=0, m=m, n=n, block_m=block_m, block_n=block_n)
  # _chunk_index keeps the column mask whenever block_n > N (a split past N stays masked)
  split = functools.partial(_chunk_index, i=k, m=m, n=n, block_m=block_m, block_n=block_n,
                            chunk_n=block_n // splits)
  _, cols, _, col_mask, _ = tile(0)
  w = _load_params(scale_ref, None, cols, col_mask, scale_offset)[0]
  _, cols_k, _, col_mask_k, _ = split(0)
  w_k = _load_params(scale_ref, None, cols_k, col_mask_k, scale_offset)[0]

  def body(i, accs):
    rb = r + i * num_programs
    rows, _, row_mask, _, mask = tile(rb, rows_in_bounds=True)
    mean, rstd = _row_stats(mean_ref, rstd_ref, rows, row_mask)
    x_hat, _, g, _ = _x_hat_g(*_load_xdy(x_ref, dy_ref, rows, cols, mask), mask, mean, rstd,
                              w, cast)
    mask_k = split(rb, rows_in_bounds=True)[4]
    # the share's x and dy loaded before the row sums, their latency under the row's
    # (forward._column_split_tile)
    xdy_k = _load_xdy(x_ref, dy_ref, rows, cols_k, mask_k)
    c1 = jnp.sum(x_hat * g, axis=1) / n  # [block_m]
    c2 = jnp.sum(g, axis=1) / n if mean_ref is not None else None
    x_hat_k, dy_k, g_k, x_hat_w_k = _x_hat_g(*xdy_k, mask_k, mean, rstd, w_k, cast)
    _store_dx(dx_ref, rows, cols_k, mask_k, g_k, x_hat_k, c1, c2, rstd)
    dw_acc, db_acc = accs
    return dw_acc + jnp.sum(dy_k * x_hat_w_k, axis=0), db_acc + jnp.sum(dy_k, axis=0)

  num_steps = (cdiv(m, block_m) - 1 - r) // num_programs + 1
  zeros = jnp.zeros((block_n // splits,), _F32)
  dw_acc, db_acc = lax.fori_loop(0, num_steps, body, (zeros, zeros))
  _store_partials(dw_ref, db_ref, r, cols_k, col_mask_k, dw_acc, db_acc)


def _column_sums(dy_ref, x_ref, mean_ref, rstd_ref, dw_ref, db_ref, c, *, n, block_m,
                 block_n, cast=None):
  """dscale (and dbias) of column strip ``c`` summed over all M rows, block_m rows a
  step in row order (the next step's tiles loaded before this one's sum), from x, dy
  and the forward's rstd (and mean); stored in the parameters' dtypes."""
  m = x_ref.shape[0]
  tile = functools.partial(_tile_index, k=c, m=m, n=n, block_m=block_m, block_n=block_n)

  def load(rb):  # past the last row block: fully masked
    rows, cols, row_mask, _, mask = tile(rb)
    return _load_xdy(x_ref, dy_ref, rows, cols, mask), _row_stats(mean_ref, rstd_ref, rows,
                                                                   row_mask)

  def body(rb, carry):
    dw, db, ((x, dy), (mean, rstd)) = carry
    nxt = load(rb + 1)
    mask = tile(rb, rows_in_bounds=True)[4]
    _, dy, _, x_hat_w = _x_hat_g(x, dy, mask, mean, rstd, None, cast)
    return dw + jnp.sum(dy * x_hat_w, axis=0), db + jnp.sum(dy, axis=0), nxt

  zeros = jnp.zeros((block_n,), _F32)
  dw, db, _ = lax.fori_loop(0, cdiv(m, block_m), body, (zeros, zeros, load(0)))
  _, cols, _, col_mask, _ = tile(0)
  if dw_ref is not None:
    plgpu.store(dw_ref.at[cols], dw.astype(dw_ref.dtype), mask=col_mask)
  if db_ref is not None:
    plgpu.store(db_ref.at[cols], db.astype(db_ref.dtype), mask=col_mask)


def _bwd_fused_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias, has_dh,
                      has_dres, block_m, block_n, num_programs, column_block_m,
                      column_block_n, pieces=(), cast=None, group_size=0, prefetch_depth=1,
                      recompute_dx=False, prefetch_stats=False, joint_row_sums=False,
                      reload_scale=False):
  """The one-kernel backward (``BackwardConfig.fused_reduce``): programs [0, G) are the
  persistent stage 1 without partials (dx); program G + c sums dscale/dbias of column
  strip c over all rows (``_column_sums``). Neither waits for the other."""
  (dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, _,
   dx_ref, dw_ref, db_ref) = _split_refs(refs, has_scale, has_bias, subtract_mean, 0,
                                         has_dh, has_dres, group_size)
  pid = pl.program_id(0)  # read here: interpret mode cannot read it inside pl.when

  @pl.when(pid < num_programs)
  def _rows():
    _persistent_columns((dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, dx_ref, None, None),
                        None, pid, 0, n=n, scale_offset=scale_offset, block_m=block_m,
                        block_n=block_n, num_programs=num_programs, pieces=pieces,
                        cast=cast, prefetch_depth=prefetch_depth,
                        recompute_dx=recompute_dx, prefetch_stats=prefetch_stats,
                        joint_row_sums=joint_row_sums, reload_scale=reload_scale)

  @pl.when(pid >= num_programs)
  def _columns():
    _column_sums(dy_ref, x_ref, mean_ref, rstd_ref, dw_ref, db_ref, pid - num_programs,
                 n=n, block_m=column_block_m, block_n=column_block_n, cast=cast)


def _bwd_row_stats_kernel(*refs, n, scale_offset, subtract_mean, has_scale, block_m,
                          block_n, cast=None, group_size=0):
  """c1 = sum(x_hat * g) / N and (LayerNorm) c2 = sum(g) / N per row, walking the row in
  chunks."""
  refs = list(refs)
  dy_ref = refs.pop(0)
  x_ref = _x_src(refs.pop(0), refs, group_size, "backward", subtract_mean)
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref, c1_ref, *c2_ref = refs  # c2 only for LayerNorm
  m = x_ref.shape[0]
  rb = pl.program_id(0)
  tile = functools.partial(_tile_index, rb, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)
  rows, _, row_mask, _, _ = tile(0)
  mean, rstd = _row_stats(mean_ref, rstd_ref, rows, row_mask)

  def body(k, carry):
    c1, c2 = carry  # [block_m] f32 running sums
    _, cols, _, col_mask, mask = tile(k)
    w, _ = _load_params(scale_ref, None, cols, col_mask, scale_offset)
    x_hat, _, g, _ = _x_hat_g(*_load_xdy(x_ref, dy_ref, rows, cols, mask), mask, mean, rstd,
                              w, cast)
    c2 = c2 + jnp.sum(g, axis=1) if subtract_mean else c2
    return c1 + jnp.sum(x_hat * g, axis=1), c2

  zeros = jnp.zeros((block_m,), _F32)
  c1, c2 = lax.fori_loop(0, cdiv(n, block_n), body, (zeros, zeros))
  plgpu.store(c1_ref.at[rows], c1 / n, mask=row_mask)
  if subtract_mean:
    plgpu.store(c2_ref[0].at[rows], c2 / n, mask=row_mask)


def _bwd_reload_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                       has_dh, has_dres, block_m, block_n, num_programs, cast=None,
                       group_size=0):
  """Stage 1 for rows of a few chunks: G persistent programs, each over whole rows.

  Program r walks row blocks r, r + G, ... (x and dy read from HBM once). Per row
  block, pass 1 loads x and dy chunk by chunk (evict_last) and sums x_hat * g (and g)
  elementwise over the chunks, then across the row once; pass 2 reloads the chunks in
  reverse order (from L2, where pass 1 left them; evict_first) and writes dx. The
  dscale/dbias partials of every chunk stay in registers across row blocks, so the row
  is unrolled at trace time (``cdiv(N, block_n)`` chunks) and HBM sees x and dy once and
  dx once.
  """
  (dy_ref, x_ref, scale_ref, mean_ref, rstd_ref, _,
   dx_ref, dw_ref, db_ref) = _split_refs(refs, has_scale, has_bias, subtract_mean, 0,
                                         has_dh, has_dres, group_size)
  m = x_ref.shape[0]
  r = pl.program_id(0)
  num_chunks = cdiv(n, block_n)
  tile = functools.partial(_tile_index, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)  # the loop visits valid row blocks only

  def chunk(rb, k, mean, rstd, eviction_policy):
    rows, cols, _, col_mask, mask = tile(rb, k)
    xdy = _load_xdy(x_ref, dy_ref, rows, cols, mask, eviction_policy)
    w, _ = _load_params(scale_ref, None, cols, col_mask, scale_offset)
    return (rows, cols, mask, *_x_hat_g(*xdy, mask, mean, rstd, w, cast))

  def body(i, accs):
    rb = r + i * num_programs
    rows, _, row_mask, _, _ = tile(rb, 0)
    mean, rstd = _row_stats(mean_ref, rstd_ref, rows, row_mask)
    s1 = s2 = jnp.zeros((block_m, block_n), _F32)
    for k in range(num_chunks):  # pass 1: the row sums, elementwise over chunks
      *_, x_hat, _, g, _ = chunk(rb, k, mean, rstd, "evict_last")
      s1 = s1 + x_hat * g
      if subtract_mean:
        s2 = s2 + g
    c1 = jnp.sum(s1, axis=1) / n
    c2 = jnp.sum(s2, axis=1) / n if subtract_mean else None
    dw, db = list(accs[0]), list(accs[1])
    for k in reversed(range(num_chunks)):  # pass 2: dx, last chunks (likeliest in L2) first
      rows, cols, mask, x_hat, dy, g, x_hat_w = chunk(rb, k, mean, rstd, "evict_first")
      _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd)
      if dw_ref is not None:
        dw[k] = dw[k] + jnp.sum(dy * x_hat_w, axis=0)
      if db_ref is not None:
        db[k] = db[k] + jnp.sum(dy, axis=0)
    return tuple(dw), tuple(db)

  num_steps = (cdiv(m, block_m) - 1 - r) // num_programs + 1
  zeros = (jnp.zeros((block_n,), _F32),) * num_chunks
  # Only the partials that are wanted are carried (an empty tuple otherwise).
  dw, db = lax.fori_loop(0, num_steps, body, (zeros if dw_ref is not None else (),
                                              zeros if db_ref is not None else ()))
  for k in range(num_chunks):
    _, cols, _, col_mask, _ = tile(0, k)
    _store_partials(dw_ref, db_ref, r, cols, col_mask, dw[k] if dw else None,
                    db[k] if db else None)


def _bwd_split_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                      has_dh, has_dres, block_m, block_n, chunk_n, num_splits, num_groups,
                      num_warps, lag, early, phase, cast=None, group_size=0):
  """Stage 1 for long rows, each split over ``num_splits`` programs (x and dy read once
  from HBM).

  Program (group r, split k) owns columns [k * block_n, (k + 1) * block_n) of row
  blocks r, r + G, ... (G = ``num_groups``), so its dscale/dbias partials stay in
  registers, as in the column-tiled kernel. Row block i of the program is
    1. published ``lag`` row blocks ahead of its dx: the program loads its split of x
       and dy (evict_last) and stores the split's sums of x_hat * g (and g) in slots
       [row, k], which start out _PENDING;
    2. finished: the program issues the reload of its split of x and dy (from L2,
       where step 1 left them; evict_first), re-reads the row's slots until every
       split has stored its own (_split_slot_tiles) and sums them in split order, so
       every split gets the same bits; then it writes dx and adds to its partials.
  Nothing is held in registers across the wait, so the program is small (ncu, H200:
  96 registers a thread for RMSNorm [1, 2048] at 4 warps, against 255 when the split
  was held; 94 for [1, 512] at 1 warp, 127 for LayerNorm's) and many fit a SM;
  ``lag`` row blocks of lead mean the slots are complete by the time they are read
  (H200 4096 x 65536 RMSNorm at [1, 2048], 4 warps: 527 us at lag 2 against 560 with
  the split held in registers; with the reload issued after the wait, 696;
  docs/tuning_rules.md#bwd-split gives the sweeps).
  With ``early`` (``BackwardConfig.split_early_publish``) step 1's loads are issued
  before step 2 of the row block ``lag`` behind and reduced after it
  (_split_rows_loop): the HBM loads are in flight across the wait, at the price of
  holding them in registers (LayerNorm's rule, docs/tuning_rules.md#bwd-split-ln-early).
  The split is reduced and written as block_n / chunk_n separate column chunks (and
  scale and the partials as as many vectors).
  Programs take (r, k) from a ticket counter in the order they start, so a waiting
  program only waits on programs of its own group that are running or will get an SM
  when an earlier group finishes: no deadlock while a row's num_splits programs can all
  be resident at once (``config.split_resident_programs`` a SM).

  ``phase`` "all" is the GPU kernel; interpret mode runs programs one after another,
  which the wait would deadlock, so it runs "publish" (step 1 for program (rb, k)) and
  then "consume" (step 2 for program (r, k), reading the published slots).
  """
  refs = list(refs)
  dy_ref = refs.pop(0)
  x_ref = _x_src(refs.pop(0), refs, group_size, "backward", subtract_mean)
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  m = x_ref.shape[0]
  slot_refs, outs, r, k = _split_rows_refs(refs, 2 if subtract_mean else 1, num_splits,
                                           phase)
  if outs:
    dx_ref = outs.pop(0)
    dx_ref = _dx_out(dx_ref, outs.pop(0) if has_dres else None, dh_ref)
    dw_ref = outs.pop(0) if has_scale else None
    db_ref = outs.pop(0) if has_bias else None
  c1_ref, c2_ref = (*slot_refs, None)[:2]
  num_chunks = block_n // chunk_n

  def tile(rb, c):  # chunk c of split k of row block rb (a valid row block)
    return _chunk_index(rb, k * num_chunks + c, m, n, block_m=block_m, block_n=block_n,
                        chunk_n=chunk_n, rows_in_bounds=True)

  ws = []  # scale, hoisted: one [chunk_n] f32 vector a chunk
  for c in range(num_chunks):
    _, cols, _, col_mask, _ = tile(0, c)
    ws.append(_load_params(scale_ref, None, cols, col_mask, scale_offset)[0])

  def stats(rb):
    rows, _, row_mask, _, _ = tile(rb, 0)
    return (rows, row_mask, *_row_stats(mean_ref, rstd_ref, rows, row_mask))

  def load(rb, eviction_policy):  # raw [x_0, dy_0, x_1, dy_1, ...] of row block rb
    out = []
    for c in range(num_chunks):
      rows, cols, _, _, mask = tile(rb, c)
      out += _load_xdy(x_ref, dy_ref, rows, cols, mask, eviction_policy)
    return out

  def chunk(rb, c, xdy, mean, rstd):  # (cols, mask, x_hat, dy, g) of chunk c
    _, cols, _, _, mask = tile(rb, c)
    return (cols, mask, *_x_hat_g(xdy[2 * c], xdy[2 * c + 1], mask, mean, rstd, ws[c], cast))

  def publish(rb):  # step 1: this split's share of c1 and c2 of row block rb
    xdy = load(rb, "evict_last")
    rows, row_mask, mean, rstd = stats(rb)

    def complete():
      s1 = s2 = 0.0
      for c in range(num_chunks):
        _, _, x_hat, _, g, _ = chunk(rb, c, xdy, mean, rstd)
        s1 = s1 + jnp.sum(x_hat * g, axis=1)
        s2 = s2 + jnp.sum(g, axis=1)
      plgpu.store(c1_ref.at[rows, k], _slot_bits(s1), mask=row_mask)
      if subtract_mean:
        plgpu.store(c2_ref.at[rows, k], _slot_bits(s2), mask=row_mask)
    return complete

  def finish(rb, acc):  # step 2: dx of row block rb once its row sums are complete
    xdy = load(rb, "evict_first")  # issued before the wait, which hides its latency
    rows, row_mask, mean, rstd = stats(rb)
    _, tiles = _split_slot_tiles(slot_refs, rows, row_mask, num_splits=num_splits,
                                 num_threads=32 * num_warps, poll=phase == "all")
    c1, c2 = (*(jnp.sum(t, axis=1) / n for t in tiles), None)[:2]
    out = []  # [dscale_0, dbias_0, dscale_1, ...] partials
    for c in range(num_chunks):
      cols, mask, x_hat, dy, g, x_hat_w = chunk(rb, c, xdy, mean, rstd)
      _store_dx(dx_ref, rows, cols, mask, g, x_hat, c1, c2, rstd)
      out.append(acc[2 * c] + jnp.sum(dy * x_hat_w, axis=0))
      out.append(acc[2 * c + 1] + jnp.sum(dy, axis=0) if db_ref is not None
                 else acc[2 * c + 1])
    return tuple(out)

  accs = _split_rows_loop(r, cdiv(m, block_m), num_groups=num_groups, lag=lag, phase=phase,
                          publish=publish, finish=finish, early=early,
                          init=(jnp.zeros((chunk_n,), _F32),) * (2 * num_chunks))
  if phase == "publish":
    return
  for c in range(num_chunks):
    _, cols, _, col_mask, _ = tile(0, c)
    _store_partials(dw_ref, db_ref, r, cols, col_mask, accs[2 * c], accs[2 * c + 1])


def _reduce_kernel(*refs, block_g, block_n):
  """out[cols] = sum over the G partial rows, in a fixed order, for each (part, out) pair
  of ``refs`` (the parts, then the outs: dscale's and dbias's in one launch). Program
  (j, i) sums column strip j of pair i."""
  half = len(refs) // 2
  j = pl.program_id(0)  # read here: interpret mode cannot read it inside pl.when
  for i, (part_ref, out_ref) in enumerate(zip(refs[:half], refs[half:])):
    pl.when(pl.program_id(1) == i)(functools.partial(
        _reduce_columns, part_ref, out_ref, j, block_g=block_g, block_n=block_n))


def _reduce_columns(part_ref, out_ref, j, *, block_g, block_n):
  g_total, n = part_ref.shape
  cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
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


def _reduce_partials(parts, dtypes, cfg: BackwardConfig, interpret: bool):
  """[G, N] f32 each -> [N] each in its dtype, in one launch (LayerNorm's dscale and
  dbias partials together: one kernel of 2.4-3.6 us on the H200 where two took 1.8-2.4
  each; results/h200_2026-11-22_full_b6f74e7_c.json against ..._475a610.json). The grid
  is (column strips, arrays): LayerNorm stage 1 + 2 at 4096 x 1024 11.9 us against 12.6
  with one program a strip summing both arrays, 32768 x 128 13.0 against 14.0, a tie on
  wider rows (results/h200_2026-11-22_bwd_pieces.txt, "@r1d")."""
  n = parts[0].shape[1]
  return pl.pallas_call(
      functools.partial(_reduce_kernel, block_g=cfg.reduce_block_g, block_n=cfg.reduce_block_n),
      out_shape=[out_struct((n,), dt, parts[0]) for dt in dtypes],
      grid=(cdiv(n, cfg.reduce_block_n), len(parts)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.reduce_num_warps, num_stages=1),
      interpret=interpret,
      name="pallas_norm_bwd_reduce",
  )(*parts)


def norm_backward(dy, x, scale, mean, rstd, *, has_bias: bool, scale_offset: float,
                  subtract_mean: bool, config: BackwardConfig, interpret: bool,
                  scale_dtype=None, bias_dtype=None, combine_row_sums=None, dh=None,
                  dx_dtype=None, residual_dtype=None, cast=None, x_scale=None):
  """The backward: stage 1 then stage 2, or one kernel (``config.fused_reduce``, or
  a stage 1 of one program, whose partial row is the sum).

  Args:
    dy, x: [M, N] (x's dtype; dy in y's for FP8 x).
    scale: [N] or None.
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32, saved by the forward.
    has_bias: whether to produce dbias.
    scale_offset, subtract_mean: as in the forward.
    config: BackwardConfig (block_m, block_n, num_warps, num_programs = G, stage 2 knobs).
      ``block_n >= N`` selects the single-tile kernel (with ``fused_reduce`` and G > 1,
      the one-kernel backward), else the reload-row kernel (``reload_rows``), the
      split-row kernel (``split_rows``) or the chunked pair.
    interpret: run in Pallas interpret mode.
    scale_dtype, bias_dtype: dtypes of dscale and dbias.
    combine_row_sums: for x a shard of the hidden dim (tensor parallel): a function
      ``(c1, c2) -> (c1, c2)`` ([M] f32 each, c2 None for RMSNorm) that turns this
      shard's row sums (over its N columns, divided by N) into the whole row's (a
      ``pmean`` over the hidden axes). It selects the row-statistics + column-tiled
      pair, whatever ``block_n``; ``config.pieces`` are not used.
    dh, dx_dtype, residual_dtype: the fused residual add (``norm_forward(residual=)``,
      x then being h = x + residual): dh [M, N] (h's cotangent) or None is added to dx
      in float32; dx is written in ``dx_dtype`` (default x's dtype) and, given a
      different ``residual_dtype``, once more in that dtype (dresidual).
    cast: None (``cast="torch"``) or (x's dtype name, y's dtype name) for
      ``cast="llama"`` (the forward's roundings, transposed; dscale sums dy against the
      rounded x_hat).
    x_scale: None, or [M, N // G] float32 for FP8 x, as in ``forward.norm_forward``: x
      is dequantised again as stage 1 loads it (give ``dx_dtype``: dx is the cotangent
      of the dequantised x).

  Returns:
    (dx [M, N] dx_dtype, dscale [N] scale_dtype or None, dbias [N] bias_dtype or None);
    with a ``residual_dtype``, (dx, dresidual, dscale, dbias), dresidual being dx
    itself when the dtypes agree.

  Raises:
    ValueError: ``config.pieces`` that do not cover N, or with ``block_n < N``;
      ``config.fused_reduce`` or ``config.column_splits`` > 1 with ``block_n < N``
      (column splits also with FP8 x); an
      ``x_scale`` that does not fit x or ``config`` (``forward.fp8_group_size``).
    NotImplementedError: ``split_rows`` with more splits than can surely be resident
      (``cdiv(N, config.block_n) > SMs x config.split_resident_programs(num_warps)``).
  """
  m, n = x.shape
  cfg = config
  has_scale = scale is not None
  num_row_blocks = cdiv(m, cfg.block_m)
  g = max(1, min(cfg.num_programs, num_row_blocks))
  params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  statics = dict(n=n, scale_offset=float(scale_offset), subtract_mean=subtract_mean,
                 has_scale=has_scale, block_m=cfg.block_m, block_n=cfg.block_n,
                 cast=None if cast is None else tuple(cast),
                 group_size=fp8_group_size(x, x_scale, cfg))
  inputs = [a for a in (dy, x, x_scale, scale, mean if subtract_mean else None, rstd)
            if a is not None]
  dx_dtype = _y_dtype(x, dx_dtype)  # default x's; bfloat16 for FP8 x
  has_dres = residual_dtype is not None and jnp.dtype(residual_dtype) != dx_dtype
  out_shape = [out_struct((m, n), dx_dtype, x)]
  if has_dres:
    out_shape.append(out_struct((m, n), residual_dtype, x))
  param_dtypes = [dt for dt, has in ((scale_dtype, has_scale), (bias_dtype, has_bias)) if has]
  fused = dict(has_dh=dh is not None, has_dres=has_dres)  # the stage-1 kernels' statics
  tail = [] if dh is None else [dh]  # the stage-1 kernels' last input
  chunked = cfg.block_n < n or combine_row_sums is not None
  pieces = () if combine_row_sums is not None else cfg.pieces
  if pieces and (chunked or sum(pieces) < n):
    raise ValueError(f"config.pieces={cfg.pieces} must cover the row (N={n}) inside one "
                     f"tile (block_n={cfg.block_n})")
  if cfg.fused_reduce and cfg.block_n < n:
    raise ValueError(f"config.fused_reduce needs the row (N={n}) in one tile "
                     f"(block_n={cfg.block_n})")
  splits = 1 if combine_row_sums is not None else cfg.column_splits
  if splits > 1 and (chunked or x_scale is not None):
    raise ValueError(f"config.column_splits={splits} needs the row (N={n}) in one tile "
                     f"(block_n={cfg.block_n}) and x not FP8")
  # (a shard's row sums, combine_row_sums, take the two-stage pair)
  one_kernel = cfg.fused_reduce and not chunked and g > 1 and bool(param_dtypes)
  if g == 1 or one_kernel:  # the sums themselves, in the parameters' dtypes: no stage 2
    shape = (1, n) if g == 1 else (n,)
    out_shape += [out_struct(shape, dt, x) for dt in param_dtypes]
  else:
    out_shape += [out_struct((g, n), _F32, x)] * len(param_dtypes)
  # the persistent stage 1's flags (its kernel and the one-kernel backward's rows)
  stage1_flags = {f: getattr(cfg, f) for f in ("prefetch_depth", "recompute_dx",
                                              "prefetch_stats", "joint_row_sums",
                                              "reload_scale")}
  if one_kernel:
    columns = cdiv(n, max(cfg.column_block_n, statics["group_size"]))
    dx, *parts = pl.pallas_call(
        functools.partial(_bwd_fused_kernel, has_bias=has_bias, num_programs=g,
                          column_block_m=min(cfg.column_block_m, next_power_of_2(m)),
                          column_block_n=max(cfg.column_block_n, statics["group_size"]),
                          pieces=pieces, **fused, **statics, **stage1_flags),
        out_shape=out_shape,
        grid=(g + columns,),
        compiler_params=params,
        interpret=interpret,
        name="pallas_norm_bwd_fused",
    )(*inputs, *tail)
  elif splits > 1:
    dx, *parts = pl.pallas_call(
        functools.partial(_bwd_column_split_kernel, has_bias=has_bias, num_programs=g,
                          splits=splits, **fused, **statics),
        out_shape=out_shape,
        grid=(g * splits,),
        compiler_params=params,
        interpret=interpret,
        name="pallas_norm_bwd_column_split",
    )(*inputs, *tail)
  elif chunked and cfg.split_rows and combine_row_sums is None:
    dx, *parts = _split_stage1(inputs + tail, out_shape, dict(statics, **fused), has_bias,
                               g, cfg, interpret)
  elif chunked and cfg.reload_rows and combine_row_sums is None:
    dx, *parts = pl.pallas_call(
        functools.partial(_bwd_reload_kernel, has_bias=has_bias, num_programs=g, **fused,
                          **statics),
        out_shape=out_shape,
        grid=(g,),
        compiler_params=params,
        interpret=interpret,
        name="pallas_norm_bwd_reload",
    )(*inputs, *tail)
  else:
    if chunked:
      c = pl.pallas_call(
          functools.partial(_bwd_row_stats_kernel, **statics),
          out_shape=[out_struct((m,), _F32, x)] * (2 if subtract_mean else 1),
          grid=(num_row_blocks,),
          compiler_params=params,
          interpret=interpret,
          name="pallas_norm_bwd_row_stats",
      )(*inputs)
      if combine_row_sums is not None:
        c = [v for v in combine_row_sums(c[0], c[1] if subtract_mean else None)
             if v is not None]
      inputs += list(c)
    dx, *parts = pl.pallas_call(
        functools.partial(_bwd_persistent_kernel, has_bias=has_bias, num_programs=g,
                          chunked=chunked, pieces=pieces, **fused, **statics,
                          **stage1_flags),
        out_shape=out_shape,
        grid=(g, cdiv(n, cfg.block_n)) if chunked else (g,),
        compiler_params=params,
        interpret=interpret,
        name="pallas_norm_bwd_columns" if chunked else "pallas_norm_bwd_persistent",
    )(*inputs, *tail)
  dres = parts.pop(0) if has_dres else dx
  if g == 1 or one_kernel:
    sums = [p.reshape(n) for p in parts]
  else:
    sums = list(_reduce_partials(parts, param_dtypes, cfg, interpret)) if parts else []
  dscale = sums.pop(0) if has_scale else None
  dbias = sums.pop(0) if has_bias else None
  if residual_dtype is not None:
    return dx, dres, dscale, dbias
  return dx, dscale, dbias


def _split_stage1(inputs, out_shape, statics, has_bias, g, cfg: BackwardConfig,
                  interpret: bool):
  """Stage 1 with each row split over cdiv(N, block_n) programs (_bwd_split_kernel).

  Returns [dx, dscale partials, dbias partials] (the present ones; partials [G, N] f32).
  """
  m, n = out_shape[0].shape
  sm = statics["subtract_mean"]
  num_splits = _split_count(n, cfg.block_n, interpret, what="the split-row backward",
                            remedy="use a larger block_n or split_rows=False",
                            per_sm=split_resident_programs(cfg.num_warps))
  num_row_blocks = cdiv(m, cfg.block_m)
  chunk_n = min(cfg.chunk_n or cfg.block_n, cfg.block_n)
  statics = dict(statics, has_bias=has_bias, num_splits=num_splits, num_groups=g,
                 num_warps=cfg.num_warps, lag=cfg.split_lag, chunk_n=chunk_n,
                 early=cfg.split_early_publish)
  return _split_rows_call(functools.partial(_bwd_split_kernel, **statics), inputs, out_shape,
                          num_row_blocks=num_row_blocks, block_m=cfg.block_m,
                          num_splits=num_splits, num_groups=g, n_slots=2 if sm else 1,
                          num_warps=cfg.num_warps, interpret=interpret,
                          name="pallas_norm_bwd_split")
