"""Pallas forward kernels (Triton lowering) for RMSNorm and LayerNorm.

Three kernels, one per mode (TileGym's names), each with its own grid and loop:

  multi_wave_cached   grid = cdiv(M, block_m). One row block per program; the whole
                      [block_m, block_n >= N] tile is loaded once and stays in registers.
                      With block_n < N the row block is split over cdiv(N, block_n)
                      programs, each holding its split in registers; they exchange
                      partial statistics through global memory (_split_kernel), so x
                      is still read once. Needs cdiv(N, block_n) <= the SM count.
                      A program that waits too long for the others computes the
                      row's statistics itself, so no launch order can deadlock it.
  multi_wave_reload   grid = cdiv(M, block_m). One row block per program; pass 1 walks
                      the row in block_n chunks accumulating fp32 statistics, pass 2
                      reloads each chunk to normalise (both passes unrolled for rows
                      of <= config.RELOAD_UNROLL_MAX_CHUNKS chunks). Any N (262144
                      and beyond).
  static_persistent   grid = num_programs (about SMs x occupancy). Each program loops
                      over row blocks with a grid stride. When the row fits one tile,
                      scale/bias are loaded once per program (hoisted), several short
                      rows are packed per tile (e.g. Qwen3 QK-norm, 32768 x 128) and the
                      next row block is prefetched while the current one is reduced;
                      otherwise each row block is chunked as in multi_wave_reload.

Outside ``jax.vjp`` the forward runs without residuals (``return_residuals=False``):
no mean/rstd are written.

FP8 x (``x_scale=``, COAT's group-scaled input: one float32 scale per ``G`` consecutive
elements of a row) is served by every kernel, here and in backward.py: they read x
through ``_load_x``, which dequantises an ``_Fp8`` source in registers as it loads a tile
(``_dequantise``), so the kernels see float32 x; y is written in ``y_dtype``.

RMSNorm and LayerNorm share the kernels through the static ``subtract_mean`` flag.
LayerNorm's variance is two-pass within a tile, and chunked rows combine per-chunk
(mean, M2) pairs with Chan et al.'s parallel update; never E[x^2] - E[x]^2 on raw x. A
split row's (mean, M2) per split comes from sums of x - c, with c the mean of the
split's first chunk (shifted data: c is near the split's mean, so nothing cancels),
then Chan's update across splits.

Refs end in ``_ref``; x is [M, N] and indexed with (row, col) index vectors, so the
Triton lowering switches to 64-bit offsets by itself when x exceeds 2**32 bytes.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.config import (RELOAD_UNROLL_MAX_CHUNKS, ForwardConfig, cdiv, device_info,
                                next_power_of_2, split_resident_programs)
from pallas_norm.kernels._compat import out_struct, stream_cache_modifier

__all__ = ["norm_forward", "norm_forward_stats", "norm_forward_apply", "fp8_group_size",
           "post_norm_fits",
           "FP8_DTYPES"]

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


def _chunk_index(rb, i, m, n, *, block_m, block_n, chunk_n, rows_in_bounds=False):
  """_tile_index of chunk i (columns [i * chunk_n, (i + 1) * chunk_n)) of a row cut into
  block_n-wide splits of block_n / chunk_n chunks each. The column mask is kept
  whenever block_n does not divide N: whole chunks of the last split may lie past N."""
  rows, cols, row_mask, col_mask, mask = _tile_index(
      rb, i, m, n, block_m=block_m, block_n=chunk_n, rows_in_bounds=rows_in_bounds)
  if col_mask is None and n % block_n:
    col_mask = cols < n
    mask = jnp.broadcast_to(col_mask[None, :], (block_m, chunk_n))
    if row_mask is not None:
      mask = row_mask[:, None] & mask
  return rows, cols, row_mask, col_mask, mask


def _load(ref_at, mask, **kwargs):
  """Masked load with 0 outside the mask (or a plain load when mask is None)."""
  return plgpu.load(ref_at, mask=mask, other=None if mask is None else 0.0, **kwargs)


def _load_stream(ref_at, mask, eviction_policy=None, stream=True):
  """_load of x (or dy), data read from HBM once a row block: cached in L2 only
  (``_compat.stream_cache_modifier``), unless an L1 ``eviction_policy`` is asked for
  (ptxas refuses ".cg" with ".evict_last"/".evict_first") or ``stream`` is False (a
  plain load, L1 and L2: ``ForwardConfig.stream_x``)."""
  if eviction_policy is not None:
    return _load(ref_at, mask, eviction_policy=eviction_policy)
  if not stream:
    return _load(ref_at, mask)
  return _load(ref_at, mask, cache_modifier=stream_cache_modifier())


class _Sum:
  """x + residual as a kernel's input (``residual=``, flash-attention's fused add).

  ``_load_x`` of it returns the float32 sum ``h`` of the x and residual tiles; with
  ``first`` (the one load of each element that the kernel's schedule makes first) it
  also stores h, in h_ref's dtype. Passes that reload x reload both and add again, so
  y is computed from the float32 sum whatever h's dtype.
  """

  def __init__(self, x_ref, r_ref, h_ref):
    self.x, self.r, self.h = x_ref, r_ref, h_ref

  @property
  def shape(self):
    return self.x.shape


class _PostSum(_Sum):
  """post_norm(x) + residual as a kernel's input (``post_norm_scale=``: Gemma 2/3's
  post-norm of a sublayer's output, the residual add and the next pre-norm in one pass).

  ``_load_x`` of it returns the float32 sum ``h`` of the residual tile and x's RMSNorm
  with the scale ``p`` (``scale_offset + p``, the same ``eps``), rounded to x's dtype:
  the value a separate ``rms_norm(x, p)`` would have written. The tile must hold whole
  rows (multi_wave_cached, block_n >= N: the launcher checks it); with ``first`` it
  stores h as _Sum does.
  """

  def __init__(self, x_ref, r_ref, h_ref, p_ref, eps: float, scale_offset: float):
    super().__init__(x_ref, r_ref, h_ref)
    self.p, self.eps, self.scale_offset = p_ref, eps, scale_offset


class _Fp8:
  """x stored in FP8 as a kernel's input (``x_scale=``, COAT's group-scaled input).

  ``x`` is the [M, N] float8_e4m3fn / float8_e5m2 ref, ``s`` the [M, N // group_size]
  float32 dequantisation scales: one per ``group_size`` consecutive elements of a row,
  x ~= x_fp8 * s. ``_load_x`` of it returns the float32 tile, dequantised in registers
  (_dequantise); masked elements are 0.
  """

  def __init__(self, x_ref, s_ref, group_size: int, vector: int):
    self.x, self.s, self.group_size = x_ref, s_ref, group_size
    self.vector = vector  # runs of FP8 values a thread's load of x takes (_fp8_vector)

  @property
  def shape(self):
    return self.x.shape


def _x_src(x_ref, refs: list, group_size: int, kernel: str, subtract_mean: bool):
  """x's source in a kernel: ``x_ref`` itself, or with a ``group_size`` (FP8 x) the
  _Fp8 of it and its scales, the next ref of ``refs`` (popped). ``kernel`` and
  ``subtract_mean`` pick the FP8 load's vector (``_fp8_vector``)."""
  if not group_size:
    return x_ref
  return _Fp8(x_ref, refs.pop(0), group_size,
              _fp8_vector(kernel, subtract_mean, x_ref.shape[1]))


# FP8 x's load vector (docs/fp8_tuning.md#fp8-x-vector). Triton vectorises a load up to 16 bytes
# a thread, 16 FP8 values, and the 2-byte tiles beside it (dy, y, dx) 8; the compiler may
# then lay the tile out from the FP8 load and convert each 2-byte store through shared
# memory (the FP8-x LayerNorm backward at [2, 4096] x 16 warps, ptxas sm_90a: 952
# instructions, 80 STS / 76 LDS, a 16-byte stack; x loaded in runs of 8: 648, 16 / 18,
# none). Runs of 8 everywhere but the kernels below, which keep 16-value runs: H100,
# 2026-11-26, benchmarks/fp8_x_vector_ab.py at fd31e12 (the default configs; us of the kernel, runs
# of 16 / 8). Runs of 8 gained up to 43% elsewhere (LayerNorm's backward at 32768x2048
# 268.6 / 152.6, RMSNorm's at 4096x16384 199.7 / 144.7, LayerNorm's forward there 125.4 /
# 89.7), and were level or 2-6% faster in the other cells. The H200 is not measured.
# {(kernel, op, N')}: kernel "forward" (no residuals), "forward_res" (under jax.vjp),
# "backward", or the tensor-parallel pair's "stats" / "apply"; N' capped at 16384.
_FP8_VECTOR_16: frozenset[tuple[str, str, int]] = frozenset({
    ("forward_res", "rms", 8192),    # 8192x8192: 79.2 / 89.3
    ("forward_res", "rms", 16384),   # 4096x16384: 106.3 / 108.8
    ("backward", "rms", 2048),       # 32768x2048: 140.6 / 149.2
    ("backward", "layer", 8192),     # 8192x8192: 140.0 / 150.1
    ("backward", "layer", 16384),    # 4096x16384, the column kernel: 163.6 / 247.6
})
_FP8_VECTOR, _FP8_VECTOR_MAX_N = 8, 16384


def _fp8_vector(kernel: str, subtract_mean: bool, n: int) -> int:
  """Runs of contiguous FP8 values a thread's load of x takes in ``kernel`` ("forward",
  "forward_res", "backward", "stats", "apply") for rows of ``n`` (0: as many as 16
  bytes hold): ``_FP8_VECTOR_16``'s kernels keep 0, the others take 8. (The A/B scripts
  replace this function while they trace: benchmarks/_fp8_sweep.forced_fp8_vector at fd31e12.)"""
  key = (kernel, "layer" if subtract_mean else "rms",
         min(next_power_of_2(n), _FP8_VECTOR_MAX_N))
  return 0 if key in _FP8_VECTOR_16 else _FP8_VECTOR


def _fwd_kernel(return_residuals: bool) -> str:
  """_fp8_vector's name of a forward kernel: "forward_res" writes the backward's
  residuals (under jax.vjp), "forward" does not."""
  return "forward_res" if return_residuals else "forward"


def _vector_cols(cols, vec):
  """``cols`` (a tile's column indices, consecutive) written as ``(c / vec) * vec + c %
  vec``: the same values, which Triton's axis analysis sees as runs of ``vec``
  contiguous columns, so that a load through them is vectorised ``vec`` elements a
  thread at most. ``vec`` 0: cols itself."""
  if not vec:
    return cols
  v = jnp.int32(vec)
  return lax.div(cols, v) * v + lax.rem(cols, v)


def _dequantise(src: _Fp8, rows, cols, mask, eviction_policy=None, stream=True):
  """The [block_m, block_n] f32 tile x_fp8 * s of an _Fp8 source, as COAT's
  ``_rms_norm_fwd_fused`` does it: the fp8 tile and the [block_m, block_n / G] scale
  tile are loaded, and the tile, viewed as [block_m, block_n / G, G], is multiplied by
  the scales broadcast over each group. ``cols`` is a column tile starting at a
  multiple of G (every tile of the kernels: G divides block_n, chunk_n and the pieces;
  the launchers check it)."""
  m, n = src.shape
  g = src.group_size
  block_m, block_n = rows.shape[0], cols.shape[0]
  ng = block_n // g
  gcols = jnp.min(cols) // g + jnp.arange(ng, dtype=jnp.int32)  # [ng] group indices
  smask = None
  if mask is not None:  # the groups of the elements in the mask (G divides N)
    smask = (rows < m)[:, None] & (gcols < n // g)[None, :]
  q = _load_stream(src.x.at[rows[:, None], _vector_cols(cols, src.vector)[None, :]], mask,
                   eviction_policy, stream)
  s = _load_stream(src.s.at[rows[:, None], gcols[None, :]], smask, eviction_policy, stream)
  x = q.astype(_F32).reshape(block_m, ng, g) * s[:, :, None]  # [block_m, ng, G] f32
  return x.reshape(block_m, block_n)


def _load_x(src, rows, cols, mask, *, first, eviction_policy=None, stream=True):
  """The [rows, cols] tile of x (x's dtype), or of x + residual (float32; see _Sum), or
  of FP8 x dequantised (float32; see _Fp8); ``stream``: as ``_load_stream``'s."""
  idx = (rows[:, None], cols[None, :])
  if isinstance(src, _Fp8):
    return _dequantise(src, rows, cols, mask, eviction_policy, stream)
  if not isinstance(src, _Sum):
    return _load_stream(src.at[idx], mask, eviction_policy, stream)
  x = _load_stream(src.x.at[idx], mask, eviction_policy, stream).astype(_F32)
  if isinstance(src, _PostSum):  # x's post-norm, rounded to x's dtype, then the add
    n = src.x.shape[1]
    _, rstd, _ = _tile_stats(x, mask, n=n, eps=src.eps, subtract_mean=False)
    w, _ = _load_params(src.p, None, cols, cols < n, src.scale_offset)
    x = _round(_affine(x * rstd[:, None], w, None), src.x.dtype)
  h = x + _load_stream(src.r.at[idx], mask, eviction_policy, stream).astype(_F32)
  if first:
    plgpu.store(src.h.at[idx], h.astype(src.h.dtype), mask=mask)
  return h


def _where0(mask, a):
  return a if mask is None else jnp.where(mask, a, 0.0)


def _load_tile(ref, rows, cols, mask, first=False):
  return _load_x(ref, rows, cols, mask, first=first).astype(_F32)  # f32 tile


def _f32_again(x_raw):
  """bf16 -> f32 through an exact bit shift. Used for a second conversion of a bf16
  tile, so that the compiler keeps the bf16 tile (half the registers) live rather
  than the first conversion."""
  bits = lax.bitcast_convert_type(x_raw, jnp.uint16).astype(jnp.uint32) << 16
  return lax.bitcast_convert_type(bits, _F32)


_PARAM_CAST = threading.local()


@contextlib.contextmanager
def params_cast_to(dtype):
  """Kernels traced inside the block (here and in backward.py) round scale and bias to
  ``dtype`` as they load them: the same values as ``scale.astype(dtype)`` passed in
  (``ops``' ``param_cast``), without that cast's kernel. None: as loaded."""
  prev = getattr(_PARAM_CAST, "dtype", None)
  _PARAM_CAST.dtype = None if dtype is None else jnp.dtype(dtype)
  try:
    yield
  finally:
    _PARAM_CAST.dtype = prev


def _param(ref, cols, col_mask):
  v = _load(ref.at[cols], col_mask)
  cast = getattr(_PARAM_CAST, "dtype", None)
  if cast is not None and v.dtype != cast:
    v = v.astype(cast)
  return v.astype(_F32)


def _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset):
  """w = scale_offset + scale and b = bias as [block_n] f32 (None when absent); scale
  and bias first rounded to ``params_cast_to``'s dtype inside that block."""
  w = b = None
  if scale_ref is not None:
    w = _param(scale_ref, cols, col_mask)
    if scale_offset:
      w = w + _F32(scale_offset)
  if bias_ref is not None:
    b = _param(bias_ref, cols, col_mask)
  return w, b


class _LlamaY:
  """y's destination under ``cast="llama"`` (HF ``LlamaRMSNorm``): x_hat is rounded to
  x's dtype before the weight multiplies it, and the product to y's dtype (the
  promotion of x's and the weight's) before the bias is added. ``.at`` and ``.dtype``
  are the ref's, so the stores are unchanged."""

  def __init__(self, y_ref, x_dtype):
    self.ref, self.x_dtype = y_ref, jnp.dtype(x_dtype)

  @property
  def at(self):
    return self.ref.at

  @property
  def dtype(self):
    return self.ref.dtype


def _y_out(y_ref, cast_dtype):
  return y_ref if cast_dtype is None or y_ref is None else _LlamaY(y_ref, cast_dtype)


def _round(v, dtype):
  """float32 ``v`` rounded to ``dtype`` and back (exact for float32)."""
  return v if jnp.dtype(dtype) == _F32 else v.astype(dtype).astype(_F32)


def _affine(x_hat, w, b, y_ref=None):
  """y = x_hat * w + b in float32 (``cast="torch"``: one rounding, at the store); with
  a _LlamaY destination, HF Llama's roundings in between. w and b are [block_n]
  vectors, or [1, block_n] rows already in the tile's shape."""
  llama = isinstance(y_ref, _LlamaY)
  y = _round(x_hat, y_ref.x_dtype) if llama else x_hat  # [block_m, block_n] f32
  if w is not None:
    y = y * (w if w.ndim == 2 else w[None, :])
    if llama:
      y = _round(y, y_ref.dtype)
  if b is not None:
    y = y + (b if b.ndim == 2 else b[None, :])
  return y


def _store_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd):
  if rstd_ref is None:  # no residuals wanted (a forward outside of jax.vjp)
    return
  plgpu.store(rstd_ref.at[rows], rstd, mask=row_mask)
  if mean_ref is not None:
    plgpu.store(mean_ref.at[rows], mean, mask=row_mask)


def _load_row_block(x_ref, rb, *, n, block_m, block_n, stream=True):
  """x tile of row block ``rb`` in x's dtype; rows past M are masked (no memory access);
  ``stream``: as ``_load_stream``'s."""
  rows, cols, _, _, mask = _tile_index(rb, 0, x_ref.shape[0], n, block_m=block_m,
                                       block_n=block_n)
  return _load_x(x_ref, rows, cols, mask, first=True, stream=stream)


def _mapped_rows(rows, x_rows):
  """x's physical rows of logical ``rows`` under ``x_rows`` = (group, stride, offset, m):
  logical row r is x's row (r // group) * stride + offset + r % group (a head range of
  each token's packed projection: ``pallas_norm.qk_norm``); None: the rows themselves."""
  if x_rows is None:
    return rows
  group, stride, offset, _ = x_rows
  return (rows // group) * stride + offset + rows % group


def _tile_stats(x, mask, *, n, eps, subtract_mean):
  """(mean [block_m] f32 or None, rstd [block_m] f32, the centred tile) of a whole-row
  f32 tile (0 outside ``mask``); LayerNorm's variance is two-pass within the tile, its
  centred tile 0 outside ``mask`` (RMSNorm's: x itself)."""
  mean = None
  if subtract_mean:
    mean = jnp.sum(x, axis=1) / n  # [block_m]
    x = _where0(mask, x - mean[:, None])
  return mean, lax.rsqrt(jnp.sum(x * x, axis=1) / n + _F32(eps)), x


def _single_tile(rb, refs, params, *, n, eps, subtract_mean, block_m, block_n, x=None,
                 x_rows=None, stream=True):
  """Normalise row block ``rb`` held as one [block_m, block_n >= N] tile.

  ``params()`` gives (w, b), called once the statistics are done: the multi-wave kernel
  loads scale/bias there, so that they are not live in registers across the reductions
  (a [2, 8192] LayerNorm tile at 4 warps took 161 registers a thread with them loaded
  first, against 127 for tokamax's kernel, which loads them last; H200 ncu). The
  persistent kernel passes the values it hoisted. ``x`` is the tile when the caller
  already loaded it (a prefetch); else it is loaded. ``x_rows``: y's rows are logical
  rows of x (``_mapped_rows``; plain x only), y is [x_rows[3], N]. ``stream``: x
  loaded with ``.cg`` (``ForwardConfig.stream_x``; ``_load_stream``).
  """
  x_ref, y_ref, mean_ref, rstd_ref = refs
  m = x_ref.shape[0] if x_rows is None else x_rows[3]
  rows, cols, row_mask, _, mask = _tile_index(rb, 0, m, n, block_m=block_m, block_n=block_n,
                                              rows_in_bounds=True)
  if x is None and x_rows is not None:
    x = _load_x(x_ref, _mapped_rows(rows, x_rows), cols, mask, first=True, stream=stream)
  elif x is None:
    x = _load_row_block(x_ref, rb, n=n, block_m=block_m, block_n=block_n, stream=stream)
  x = x.astype(_F32)  # [block_m, block_n] f32, 0 outside
  mean, rstd, x = _tile_stats(x, mask, n=n, eps=eps, subtract_mean=subtract_mean)
  w, b = params()
  y = _affine(x * rstd[:, None], w, b, y_ref)
  plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
  _store_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd)


def _column_split_tile(rb, k, refs, scale_ref, bias_ref, *, n, eps, scale_offset,
                       subtract_mean, block_m, block_n, splits, x_rows=None):
  """Columns [k * w, (k + 1) * w) of row block ``rb`` (w = block_n / ``splits``; program
  (rb, k) of a row block's ``splits``), XLA's few-row schedule: the program loads the
  whole [block_m, block_n >= N] tile for the row statistics (the same reductions as
  ``_single_tile``'s, so the same bits; y from the same operations, which the compiler
  may contract otherwise: within an ulp of y's dtype) and reloads its w columns (a
  load issued before the statistics), loads only their scale/bias and stores only
  their y (and, with a residual, h).
  Split k = 0 stores mean/rstd. No exchange between programs: a row block's splits
  each read its row from L2, so few rows spread over ``splits`` times as many SMs.
  ``x_rows`` as in ``_single_tile``."""
  x_ref, y_ref, mean_ref, rstd_ref = refs
  m = x_ref.shape[0] if x_rows is None else x_rows[3]
  rows, cols, row_mask, _, mask = _tile_index(rb, 0, m, n, block_m=block_m, block_n=block_n,
                                              rows_in_bounds=True)
  # _chunk_index keeps the column mask whenever block_n > N: a split whose width divides
  # N may still lie past it (N 384 in 4 splits of a 512 tile), and unmasked it would
  # store into the next row
  _, cols_k, _, col_mask_k, mask_k = _chunk_index(rb, k, m, n, block_m=block_m,
                                                  block_n=block_n, chunk_n=block_n // splits,
                                                  rows_in_bounds=True)
  w, b = _load_params(scale_ref, bias_ref, cols_k, col_mask_k, scale_offset)
  x_rows_phys = _mapped_rows(rows, x_rows)
  x = _load_x(x_ref, x_rows_phys, cols, mask, first=False).astype(_F32)
  # the share's load before the reduction, its latency under the row's: the same bits,
  # 0.97-1.08x the load after it in 36 cells of 1-8 rows (faster in 24, none slower
  # than 3%: H200, 2026-11-29, benchmarks/results/h200_2026-11-29_split_load_first_f7ca074.*)
  xk = _load_x(x_ref, x_rows_phys, cols_k, mask_k, first=True).astype(_F32)
  mean, rstd, _ = _tile_stats(x, mask, n=n, eps=eps, subtract_mean=subtract_mean)
  if subtract_mean:
    xk = xk - mean[:, None]
  y = _affine(xk * rstd[:, None], w, b, y_ref)
  plgpu.store(y_ref.at[rows[:, None], cols_k[None, :]], y.astype(y_ref.dtype), mask=mask_k)
  first = k == 0
  _store_stats(mean_ref, rstd_ref, rows, first if row_mask is None else row_mask & first,
               mean, rstd)


def _chunked_rows(rb, refs, scale_ref, bias_ref, *, n, eps, scale_offset, subtract_mean,
                  block_m, block_n, stream=True):
  """Normalise row block ``rb`` in block_n chunks: statistics pass, then reload pass.
  ``stream`` (``ForwardConfig.stream_x``): both passes load x (and the residual) with
  ``.cg``; False: with the L1 eviction hints instead, evict_last in the statistics pass
  and evict_first in the reload (the Triton backend's and the backward's reload)."""
  x_ref, y_ref, mean_ref, rstd_ref = refs
  chunks = dict(n=n, block_m=block_m, block_n=block_n)
  mean, acc = _chunk_stats(rb, x_ref, subtract_mean=subtract_mean,
                           eviction_policy=None if stream else "evict_last", **chunks)
  rstd = lax.rsqrt(acc / n + _F32(eps))  # [block_m]
  _chunk_normalise(rb, x_ref, y_ref, scale_ref, bias_ref, mean, rstd,
                   scale_offset=scale_offset,
                   eviction_policy=None if stream else "evict_first", **chunks)
  rows, _, row_mask, _, _ = _tile_index(rb, 0, x_ref.shape[0], n, block_m=block_m,
                                        block_n=block_n, rows_in_bounds=True)
  _store_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd)


def _chunk_stats(rb, x_ref, *, n, subtract_mean, block_m, block_n, eviction_policy=None):
  """Pass 1 over row block ``rb`` in block_n chunks: (mean [block_m] f32 or None,
  acc [block_m] f32), acc the sum of squares (RMSNorm) or M2 = sum((x - mean)^2)
  (LayerNorm, per-chunk (mean, M2) pairs combined with Chan et al.'s update).
  ``eviction_policy``: x's loads with that L1 hint instead of ``.cg``."""
  m = x_ref.shape[0]
  num_chunks = cdiv(n, block_n)
  tile = functools.partial(_tile_index, rb, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)

  def stats_body(k, carry):
    mean, acc = carry  # [block_m] f32: running mean (LayerNorm) and M2 / sum of squares
    rows, cols, _, _, mask = tile(k)
    # Cached in L2 only (".cg"), like pass 2's reload, by default: with the L1 eviction
    # hints (evict_last here, evict_first there), which ptxas refuses with ".cg",
    # RMSNorm 16384^2 took 288.0 us against 275.2 (H200, load_cg.txt); the hints stay a
    # tuned alternative (stream_x=False), as the Triton backend's reload uses them.
    x = _load_x(x_ref, rows, cols, mask, first=True,
                eviction_policy=eviction_policy).astype(_F32)
    if not subtract_mean:
      # acc is [block_m, block_n]: squares are summed across the row once, after the
      # last chunk, not once a chunk.
      return mean, acc + x * x
    count = (k * block_n).astype(_F32)  # elements already folded in
    nk = jnp.minimum(block_n, n - k * block_n).astype(_F32)  # elements in this chunk
    cmean = jnp.sum(x, axis=1) / nk
    xc = _where0(mask, x - cmean[:, None])
    cm2 = jnp.sum(xc * xc, axis=1)
    total = count + nk
    delta = cmean - mean
    return mean + delta * (nk / total), acc + cm2 + delta * delta * (count * nk / total)

  # Short rows unroll both passes at trace time, so that each chunk's loads are issued
  # without waiting on the loop's previous iteration (config.RELOAD_UNROLL_MAX_CHUNKS).
  zeros = jnp.zeros((block_m,), _F32)
  acc0 = zeros if subtract_mean else jnp.zeros((block_m, block_n), _F32)
  if num_chunks <= RELOAD_UNROLL_MAX_CHUNKS:
    carry = (zeros, acc0)
    for k in range(num_chunks):
      carry = stats_body(jnp.int32(k), carry)
    mean, acc = carry
  else:
    mean, acc = lax.fori_loop(0, num_chunks, stats_body, (zeros, acc0))
  if not subtract_mean:
    return None, jnp.sum(acc, axis=1)
  return mean, acc


def _chunk_normalise(rb, x_ref, y_ref, scale_ref, bias_ref, mean, rstd, *, n, scale_offset,
                     block_m, block_n, eviction_policy=None):
  """Pass 2 over row block ``rb``: reload each chunk, normalise with the row's ``mean``
  (None for RMSNorm) and ``rstd`` ([block_m] f32) and store y; ``eviction_policy`` as
  ``_chunk_stats``'."""
  m = x_ref.shape[0]
  num_chunks = cdiv(n, block_n)
  tile = functools.partial(_tile_index, rb, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)

  def normalise(j):
    # Walk the chunks backwards: the last ones read by pass 1 are the likeliest to
    # still be in L2.
    rows, cols, _, col_mask, mask = tile(num_chunks - 1 - j)
    x = _load_x(x_ref, rows, cols, mask, first=False,
                eviction_policy=eviction_policy).astype(_F32)
    if mean is not None:
      x = x - mean[:, None]
    w, b = _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset)
    y = _affine(x * rstd[:, None], w, b, y_ref)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)

  if num_chunks <= RELOAD_UNROLL_MAX_CHUNKS:
    for j in range(num_chunks):
      normalise(jnp.int32(j))
  else:
    pl.loop(0, num_chunks)(normalise)


def _split_partials(chunk, num_chunks, k, *, n, block_n, subtract_mean, stream=False):
  """Statistics of split k (columns [k * block_n, ...)) of each row of a row block.

  ``chunk(c)`` gives chunk c of the split (columns [c * chunk_n, ...) of it, c <
  ``num_chunks``) as (x tile in x's dtype with 0 outside the mask, mask).
  RMSNorm: (sum of squares, None). LayerNorm: (mean, M2) of the split's elements, from
  sums of x - c, where c is the mean of the first chunk (the shifted-data formula: c is
  close to the split's mean, so M2 = sum(d^2) - sum(d)^2 / n_k does not cancel; with a
  single chunk sum(d) is ~0 and this is the two-pass formula).
  With ``stream``, ``chunk`` loads the chunk and the chunks are walked in a loop, each
  loaded where it is reduced, so that one chunk at a time is live (_split_kernel's
  fallback); the sums are the same, in the same order.
  """
  def walk(step, init):
    if stream:
      return lax.fori_loop(0, num_chunks, lambda c, acc: step(chunk(c), acc), init)
    acc = None
    for c in range(num_chunks):
      acc = step(chunk(c), acc)
    return acc

  def add(acc, v):
    return v if acc is None else acc + v

  first = chunk(0)
  # A loop's sums start at 0, the unrolled ones at the first chunk's: 0 + v is v but for
  # the sign of a zero, which mean and M2 below do not keep.
  zero = jnp.zeros((first[0].shape[0],), _F32) if stream else None
  if not subtract_mean:
    def sq(xm, s2):
      x = xm[0].astype(_F32)
      return add(s2, jnp.sum(x * x, axis=1))
    return walk(sq, zero), None
  chunk_n = first[0].shape[1]
  n0 = jnp.minimum(chunk_n, n - k * block_n).astype(_F32)  # >= 1: split k exists
  shift = jnp.sum(first[0].astype(_F32), axis=1) / n0

  def shifted(xm, acc):
    x_raw, mask = xm
    d = _where0(mask, x_raw.astype(_F32) - shift[:, None])
    s1, s2 = (None, None) if acc is None else acc
    return add(s1, jnp.sum(d, axis=1)), add(s2, jnp.sum(d * d, axis=1))

  s1, s2 = walk(shifted, None if zero is None else (zero, zero))
  nk = jnp.minimum(block_n, n - k * block_n).astype(_F32)
  return shift + s1 / nk, s2 - s1 * (s1 / nk)


def _slot_tile(rows, row_mask, num_splits, num_threads):
  """Split indices ks [width] and mask [block_m, width] of the slot tile of ``rows``.

  The tile is padded to at least one element a thread: a [1, 4] slot tile in a 4-warp
  program made Triton lay the [1, 8192] x tile out with most threads replicated, 12x
  slower (H200, 4096 x 65536: 4361 us at a 32-wide slot tile, 352 us at 128 = 4 warps
  x 32).
  """
  block_m = rows.shape[0]
  width = max(next_power_of_2(num_splits), num_threads // block_m)
  ks = jnp.arange(width, dtype=jnp.int32)
  kmask = ks < num_splits
  mask = kmask[None, :] if row_mask is None else row_mask[:, None] & kmask[None, :]
  return ks, jnp.broadcast_to(mask, (block_m, width))


def _combine_splits(p1, p2, ks, *, n, eps, block_n):
  """(mean, rstd) [block_m] of whole rows from their split partials p1 (and p2), f32
  [block_m, width] tiles with 0 past the last split.

  The partials are combined in split order (Chan et al.'s pairwise formula for
  LayerNorm), so every program of a row gets the same bits.
  """
  if p2 is None:
    return None, lax.rsqrt(jnp.sum(p1, axis=1) / n + _F32(eps))
  nk = jnp.clip(n - ks * block_n, 0, block_n).astype(_F32)  # [width]
  mean = jnp.sum(p1 * nk[None, :], axis=1) / n
  delta = p1 - mean[:, None]
  m2 = jnp.sum(p2 + nk[None, :] * delta * delta, axis=1)
  return mean, lax.rsqrt(m2 / n + _F32(eps))


def _split_store(x, mask, rows, cols, row_mask, k, mean, rstd, y_ref, mean_ref, rstd_ref,
                 params):
  """Normalise a chunk of a split (f32) and store it; split 0 writes the row statistics
  (``k`` is None for the chunks that do not). ``params()`` gives (w, b), as in
  _single_tile."""
  if mean is not None:
    x = _where0(mask, x - mean[:, None])
  w, b = params()
  y = _affine(x * rstd[:, None], w, b, y_ref)
  plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)
  if rstd_ref is not None and k is not None:
    first = k == 0
    smask = first if row_mask is None else row_mask & first
    plgpu.store(rstd_ref.at[rows], rstd, mask=smask)
    if mean_ref is not None:
      plgpu.store(mean_ref.at[rows], mean, mask=smask)


# --------------------------------------------------------------------------- kernels


def _split_refs(refs, has_scale, has_bias, subtract_mean, return_residuals,
                has_residual=False, cast_dtype=None, group_size=0, post_norm=None):
  """(x, x_scale, residual, post_norm_scale, scale, bias) inputs then (y, h, mean, rstd)
  outputs; absent ones are None. With a residual, x_ref is the _Sum of x and residual
  (storing h), with ``post_norm`` = (eps, scale_offset) the _PostSum; with a
  ``group_size``, the _Fp8 of x and x_scale."""
  refs = list(refs)
  x_ref = _x_src(refs.pop(0), refs, group_size, _fwd_kernel(return_residuals),
                 subtract_mean)
  r_ref = refs.pop(0) if has_residual else None
  p_ref = refs.pop(0) if post_norm else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  y_ref = _y_out(refs.pop(0), cast_dtype)
  if post_norm:
    x_ref = _PostSum(x_ref, r_ref, refs.pop(0), p_ref, *post_norm)
  elif has_residual:
    x_ref = _Sum(x_ref, r_ref, refs.pop(0))
  mean_ref = refs.pop(0) if subtract_mean and return_residuals else None
  rstd_ref = refs.pop(0) if return_residuals else None
  return x_ref, scale_ref, bias_ref, (x_ref, y_ref, mean_ref, rstd_ref)


def _row_params(scale_ref, bias_ref, n, block_n, scale_offset, *, hold):
  """A loader of a whole-row tile's scale and bias (f32 [block_n] each, or None), which
  ``_single_tile`` calls after the row's statistics; with ``hold`` they are loaded here
  and the loader returns them (held in registers from here: ``hoist_params``, or
  static_persistent's once a program)."""
  _, cols, _, col_mask, _ = _tile_index(0, 0, 1, n, block_m=1, block_n=block_n)
  params = functools.partial(_load_params, scale_ref, bias_ref, cols, col_mask, scale_offset)
  if not hold:
    return params
  wb = params()
  return lambda: wb


def _cached_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                   return_residuals, has_residual, cast_dtype, group_size,
                   block_m, block_n, hoist_params=False, x_rows=None, column_splits=1,
                   post_norm=False, stream_x=True):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals, has_residual, cast_dtype,
                                               group_size,
                                               (eps, scale_offset) if post_norm else None)
  if column_splits > 1:  # ForwardConfig.column_splits programs a row block
    pid = pl.program_id(0)
    _column_split_tile(pid // column_splits, pid % column_splits, io, scale_ref, bias_ref,
                       n=n, eps=eps, scale_offset=scale_offset,
                       subtract_mean=subtract_mean, block_m=block_m, block_n=block_n,
                       splits=column_splits, x_rows=x_rows)
    return
  params = _row_params(scale_ref, bias_ref, n, block_n, scale_offset,
                       hold=hoist_params)  # hoisted: loaded with x
  _single_tile(pl.program_id(0), io, params, n=n, eps=eps, subtract_mean=subtract_mean,
               block_m=block_m, block_n=block_n, x_rows=x_rows, stream=stream_x)


def _reload_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                   return_residuals, has_residual, cast_dtype, group_size,
                   block_m, block_n, stream_x=True):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals, has_residual, cast_dtype,
                                               group_size)
  _chunked_rows(pl.program_id(0), io, scale_ref, bias_ref, n=n, eps=eps,
                scale_offset=scale_offset, subtract_mean=subtract_mean,
                block_m=block_m, block_n=block_n, stream=stream_x)


def _persistent_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                       return_residuals, has_residual, cast_dtype, group_size,
                       block_m, block_n, num_programs, stream_x=True,
                       reload_params=False):
  x_ref, scale_ref, bias_ref, io = _split_refs(refs, has_scale, has_bias, subtract_mean,
                                               return_residuals, has_residual, cast_dtype,
                                               group_size)
  num_row_blocks = cdiv(x_ref.shape[0], block_m)
  if block_n >= n:
    # The row fits one tile: load scale/bias once for all of this program's row blocks,
    # or (reload_params) for each row block after its statistics, as _cached_kernel.
    params = _row_params(scale_ref, bias_ref, n, block_n, scale_offset,
                         hold=not reload_params)

    pid = pl.program_id(0)
    load = functools.partial(_load_row_block, x_ref, n=n, block_m=block_m, block_n=block_n,
                             stream=stream_x)

    def body(i, x):
      rb = pid + i * num_programs
      # Prefetch the next row block before working on this one: its loads are in
      # flight during this block's reductions. Past the last block it is fully masked.
      x_next = load(rb + num_programs)
      _single_tile(rb, io, params, n=n, eps=eps, subtract_mean=subtract_mean,
                   block_m=block_m, block_n=block_n, x=x)
      return x_next

    num_steps = (num_row_blocks - 1 - pid) // num_programs + 1
    lax.fori_loop(0, num_steps, body, load(pid))
  else:
    @pl.loop(pl.program_id(0), num_row_blocks, step=num_programs)
    def _row_block(rb):
      _chunked_rows(rb, io, scale_ref, bias_ref, n=n, eps=eps, scale_offset=scale_offset,
                    subtract_mean=subtract_mean, block_m=block_m, block_n=block_n,
                    stream=stream_x)


def _split_kernel(x_ref, *refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                  return_residuals, has_residual, cast_dtype, group_size, block_m, block_n,
                  chunk_n, num_splits, num_warps, max_polls, interpret):
  """multi_wave_cached for rows split over ``num_splits`` programs (block_n < N).

  Program p = rb * num_splits + k holds columns [k * block_n, (k + 1) * block_n) of
  row block rb in registers, so x is read from memory once and y written once. It
  holds them as block_n / chunk_n separate [block_m, chunk_n] tiles, and normalises
  and stores them one after another: smaller live ranges, fewer registers, more
  programs a SM (H200, LayerNorm [1, 4096] splits at 1 warp: 253 registers a thread
  as one tile, 167 as four; docs/tuning_rules.md#ln-split gives the times).
    1. it stores the split's partial statistics in slot [row, k];
    2. it adds 1 to the row block's arrival counter (acquire-release, GPU scope) and
       reads the counter again, at most ``max_polls`` times, until it reads
       ``num_splits``;
    3. it combines the row's slots in split order and normalises its split.
  If the counter is still short after ``max_polls`` reads, the program computes every
  split's partials itself from x (the same code on the same tiles, so the same bits)
  instead of waiting on the others. It loads and reduces one chunk at a time
  (``_split_partials`` with ``stream``): whole splits loaded at once set the kernel's
  register count (H200, ncu: LayerNorm [1, 4096] at 1 warp 167 registers a thread
  against 128; RMSNorm 4096 x 65536 295.0 against 291.5 us, 1024 x 262144 301.0 / 296.2;
  results/h200_2026-11-22_split_fallback_stream.txt). Programs of one row block
  normally run together (the hardware starts programs in about the order of their ids)
  and the fallback never runs; it makes the kernel finish whatever order programs start
  in, with no ticket counter: taking (rb, k) from one (an atomic every program starts
  with) cost 16% at 4096 x 65536 (H200: 340 against 292 us). A bf16 split stays bf16
  in registers across the wait (``_f32_again``: 338 against 346 us).

  Interpret mode runs programs one after another, with ``max_polls`` 0 (its state
  discharge has no rule for an atomic in a loop): each row block's last program finds
  the counter full when it arrives and reads the slots, the others take the fallback,
  so CPU tests run both paths.
  """
  refs = list(refs)
  x_ref = _x_src(x_ref, refs, group_size, _fwd_kernel(return_residuals), subtract_mean)
  r_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  refs.pop(0)  # the zeroed counters (input), aliased to the output below
  y_ref = _y_out(refs.pop(0), cast_dtype)
  if has_residual:
    x_ref = _Sum(x_ref, r_ref, refs.pop(0))
  mean_ref = refs.pop(0) if subtract_mean and return_residuals else None
  rstd_ref = refs.pop(0) if return_residuals else None
  # int32, one counter every _SYNC_STRIDE: one arrival counter a row block.
  sync_ref = refs.pop(0)
  p1_ref = refs.pop(0)
  p2_ref = refs.pop(0) if subtract_mean else None
  m = x_ref.shape[0]
  pid = pl.program_id(0)
  rb, k = pid // num_splits, pid % num_splits
  num_chunks = block_n // chunk_n

  chunk_tile = functools.partial(_chunk_index, rb, m=m, n=n, block_m=block_m,
                                 block_n=block_n, chunk_n=chunk_n, rows_in_bounds=True)

  def load_chunk(j, c, first=False):  # chunk c of split j: (x tile, mask)
    _, cols_c, _, _, mask_c = chunk_tile(j * num_chunks + c)
    return _load_x(x_ref, rows, cols_c, mask_c, first=first), mask_c

  partials = functools.partial(_split_partials, n=n, block_n=block_n,
                               subtract_mean=subtract_mean)
  rows, _, row_mask, _, _ = chunk_tile(0)
  chunks = [load_chunk(k, c, first=True) for c in range(num_chunks)]
  s1, s2 = partials(lambda c: chunks[c], num_chunks, k)
  plgpu.store(p1_ref.at[rows, k], s1, mask=row_mask)
  if subtract_mean:
    plgpu.store(p2_ref.at[rows, k], s2, mask=row_mask)
  if not interpret:  # (no barrier primitive in interpret mode, where it is moot)
    plgpu.debug_barrier()  # every thread's slot stores come before the release
  slot = rb * _SYNC_STRIDE  # one counter a 128-byte line
  arrived = plgpu.atomic_add(sync_ref, slot, jnp.int32(1)) + 1
  if max_polls:
    arrived, _ = lax.while_loop(
        lambda c: (c[0] < num_splits) & (c[1] < max_polls),
        lambda c: (plgpu.atomic_add(sync_ref, slot, jnp.int32(0)), c[1] + 1),
        (arrived, jnp.int32(0)))
  ks, smask = _slot_tile(rows, row_mask, num_splits, 32 * num_warps)
  slot_refs = (p1_ref,) if p2_ref is None else (p1_ref, p2_ref)

  def from_slots():  # [block_m, width] f32 each, 0 past the last split
    return tuple(plgpu.load(r.at[rows[:, None], ks[None, :]], mask=smask, other=0.0,
                            volatile=True) for r in slot_refs)

  def recompute():  # every split's partials from x, as its own program computes them
    def body(j, tiles):
      load = functools.partial(load_chunk, j)
      new = [v for v in partials(load, num_chunks, j, stream=True) if v is not None]
      return tuple(jnp.where(ks[None, :] == j, v[:, None], t) for v, t in zip(new, tiles))
    zeros = jnp.zeros((block_m, ks.shape[0]), _F32)
    return lax.fori_loop(0, num_splits, body, (zeros,) * len(slot_refs))

  p1, *p2 = lax.cond(arrived >= num_splits, from_slots, recompute)
  mean, rstd = _combine_splits(p1, p2[0] if p2 else None, ks, n=n, eps=eps,
                               block_n=block_n)
  for c, (x_raw, mask) in enumerate(chunks):
    rows_c, cols_c, row_mask_c, col_mask_c, _ = chunk_tile(k * num_chunks + c)
    # A second conversion of a bf16 split, so that the bf16 tile is what stays live.
    x = _f32_again(x_raw) if x_raw.dtype == jnp.bfloat16 else x_raw.astype(_F32)
    params = functools.partial(_load_params, scale_ref, bias_ref, cols_c, col_mask_c,
                               scale_offset)
    _split_store(x, mask, rows_c, cols_c, row_mask_c, k if c == 0 else None, mean, rstd,
                 y_ref, mean_ref, rstd_ref, params)


# ------------------------------------------------------- persistent split-row machinery
# Used by _split_persistent_kernel here and backward.py's _bwd_split_kernel: G groups of
# num_splits programs; program (group r, split k) owns columns [k * block_n, ...) of row
# blocks r, r + G, ... It publishes a row block's partial statistics in slots [row, k]
# ``lag`` row blocks ahead, and finishes a row block once all its row's slots are
# written, reloading its split from L2 (nothing is held in registers across the wait).

# Slots are int32 bit patterns of f32 partial sums. _PENDING marks a slot not yet
# written: a NaN the kernels never store, since they store every NaN as _NAN_BITS (the
# hardware's own NaN is 0x7FFFFFFF, hence the rewrite).
_PENDING, _NAN_BITS = 0x7FFFFFFF, 0x7FC00000


def _slot_bits(v):
  """f32 -> int32 bit pattern, NaN rewritten to _NAN_BITS so that it is never _PENDING."""
  return jnp.where(v != v, jnp.int32(_NAN_BITS), lax.bitcast_convert_type(v, jnp.int32))


def _split_slot_tiles(slot_refs, rows, row_mask, *, num_splits, num_threads, poll):
  """(ks, [f32 [block_m, width] tile of each slot ref]) of ``rows``, 0 past the last
  split.

  With ``poll`` the slots are re-read (volatile, from L2) until none is _PENDING: the
  data is its own flag, so publishing is one plain store and waiting one round trip
  once the row is complete, with no atomics or fences that would stall on this
  program's loads in flight. The slot tile is _slot_tile's.
  """
  ks, mask = _slot_tile(rows, row_mask, num_splits, num_threads)

  def load():  # int32 [block_m, width] each, 0 (+0.0) past the last split
    return tuple(plgpu.load(r.at[rows[:, None], ks[None, :]], mask=mask, other=0,
                            volatile=poll) for r in slot_refs)

  def pending(tiles):
    return sum(jnp.sum((t == _PENDING).astype(jnp.int32)) for t in tiles) > 0

  tiles = load()
  if poll:
    tiles = lax.while_loop(pending, lambda _: load(), tiles)
  return ks, [lax.bitcast_convert_type(t, _F32) for t in tiles]


def _split_rows_refs(refs, n_slots, num_splits, phase):
  """(slot refs, output refs, r, k) of a persistent split-row kernel, from its refs
  after its own inputs.

  ``phase`` "all" (the GPU kernel): refs are the _PENDING slots (inputs), the outputs,
  then the slots again (outputs aliased to those inputs). Each slot array has an extra
  last row; the first's holds the ticket counter at [rows, 0], counting down from
  _PENDING (one fill for slots and counter: a counter of its own was a constant that XLA
  copied in with a MemcpyD2D every call, docs/performance.md). (r, k) come from the
  ticket counter in the order programs start, so a
  waiting program only waits on programs of its own group that are running or will get
  an SM when an earlier group finishes: no deadlock while a row's num_splits programs
  can all be resident (config.split_resident_programs a SM). Interpret mode runs
  programs one after another, which the wait would deadlock, so it runs "publish"
  (refs: the slots, outputs; r is a row block) then "consume" (refs: the slots, inputs;
  then the outputs).
  """
  if phase == "publish":
    return refs[:n_slots], [], pl.program_id(0), pl.program_id(1)
  if phase == "consume":
    return refs[:n_slots], refs[n_slots:], pl.program_id(0), pl.program_id(1)
  refs = refs[n_slots:]
  outs, slot_refs = refs[:-n_slots], refs[-n_slots:]
  counter = (slot_refs[0].shape[0] - 1, 0)  # starts at _PENDING, counts down: no overflow
  ticket = jnp.int32(_PENDING) - plgpu.atomic_add(slot_refs[0], counter, jnp.int32(-1))
  return slot_refs, outs, ticket // num_splits, ticket % num_splits


def _split_rows_loop(r, num_row_blocks, *, num_groups, lag, phase, publish, finish, init,
                     early=False):
  """Row blocks r, r + G, ... of group r: each published ``lag`` row blocks ahead of its
  finish (``finish(rb, carry) -> carry``); returns the last carry. In phase "publish"
  r is a row block, which is published alone (returns None).

  ``publish(rb)`` issues row block rb's loads and returns a thunk that reduces them and
  stores the slots. Step i publishes row block i + lag then finishes row block i; with
  ``early`` (and lag >= 1) it issues the publish's loads, finishes row block i, and only
  then reduces and stores them, so those loads (from HBM) are in flight across the
  finish's wait. That holds them in registers across it; the last ``lag`` steps load
  the group's last row block again (from L2) and store nothing. No deadlock either way:
  step i's wait needs row block i published, which every program of the group does at
  step i - lag at the latest, after its own wait on row block i - lag.
  """
  if phase == "publish":
    publish(r)()
    return None
  num_steps = (num_row_blocks - 1 - r) // num_groups + 1
  if phase == "all":  # the first ``lag`` row blocks, published before the loop
    for j in range(lag):
      pl.when(j < num_steps)(lambda j=j: publish(r + j * num_groups)())

  def body(i, carry):
    rb = r + i * num_groups
    if phase == "all" and early and lag >= 1:
      complete = publish(r + jnp.minimum(i + lag, num_steps - 1) * num_groups)
      carry = finish(rb, carry)
      pl.when(i + lag < num_steps)(complete)
      return carry
    if phase == "all":
      pl.when(i + lag < num_steps)(lambda: publish(rb + lag * num_groups)())
    return finish(rb, carry)

  return lax.fori_loop(0, num_steps, body, init)


def _split_rows_call(kernel, inputs, out_shape, *, num_row_blocks, block_m, num_splits,
                     num_groups, n_slots, num_warps, interpret, name):
  """pallas_call of a persistent split-row ``kernel`` (taking ``phase``): its outputs."""
  slot_shape = (num_row_blocks * block_m, num_splits)
  # Triton's own pipeliner stays off: the kernels schedule their loads themselves.
  call = functools.partial(pl.pallas_call, interpret=interpret,
                           compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                                num_stages=1))
  if interpret:
    slots = call(functools.partial(kernel, phase="publish"),
                 out_shape=[out_struct(slot_shape, jnp.int32, inputs[0])] * n_slots,
                 grid=(num_row_blocks, num_splits), name=f"{name}_publish")(*inputs)
    return call(functools.partial(kernel, phase="consume"), out_shape=out_shape,
                grid=(num_groups, num_splits), name=name)(*inputs, *slots)
  # the slots, each with an extra row: the first's holds the ticket counter
  # (_split_rows_refs); the same shape for all, so that XLA fills them in one fusion
  sync = [jnp.full((slot_shape[0] + 1, slot_shape[1]), _PENDING, jnp.int32)
          for _ in range(n_slots)]  # (one array each: each is aliased to an output)
  first = len(inputs)
  outs = call(functools.partial(kernel, phase="all"),
              out_shape=[*out_shape, *(out_struct(a.shape, a.dtype, a) for a in sync)],
              grid=(num_groups * num_splits,),
              input_output_aliases={first + i: len(out_shape) + i for i in range(len(sync))},
              name=name)(*inputs, *sync)
  return outs[:len(out_shape)]


def _split_persistent_kernel(x_ref, *refs, n, eps, scale_offset, subtract_mean, has_scale,
                             has_bias, return_residuals, has_residual, cast_dtype, group_size,
                             block_m, block_n, num_splits, num_groups, num_warps, lag, early,
                             phase):
  """static_persistent with ``split_rows``: each row over ``num_splits`` programs, x read
  once from HBM and nothing held across the wait.

  Program (group r, split k) owns columns [k * block_n, (k + 1) * block_n) of row
  blocks r, r + G, ... (G = ``num_groups``), with scale and bias loaded once. Row
  block i of the program is
    1. published ``lag`` row blocks ahead: the program loads its split of x
       (evict_last) and stores the split's statistics (RMSNorm: its sum of squares;
       LayerNorm: its mean and M2, _split_partials) in slots [row, k];
    2. finished: it reloads its split of x (from L2, where step 1 left it;
       evict_first), reads the row's slots until every split has stored its own, and
       combines them in split order (_combine_splits: every split gets the same bits,
       the ones multi_wave_cached's split gets), normalises and stores y; split 0
       stores mean and rstd.
  With ``early`` (``ForwardConfig.split_early_publish``) step 1's loads are issued
  before step 2 of the row block ``lag`` behind and reduced after it (_split_rows_loop).
  This is the split-row backward's schedule (backward.py's _bwd_split_kernel) without
  dy; the machinery is _split_rows_refs / _split_rows_loop / _split_rows_call.
  """
  refs = list(refs)
  x_ref = _x_src(x_ref, refs, group_size, _fwd_kernel(return_residuals), subtract_mean)
  r_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  n_slots = 2 if subtract_mean else 1
  slot_refs, outs, r, k = _split_rows_refs(refs, n_slots, num_splits, phase)
  y_ref = mean_ref = rstd_ref = None
  # (h is stored by finish, which each row block's split reaches once; publish only
  # reads: in interpret mode the two are separate calls and only finish's has outputs)
  src = _Sum(x_ref, r_ref, None) if has_residual else x_ref
  if outs:
    y_ref = _y_out(outs.pop(0), cast_dtype)
    if has_residual:
      src = _Sum(x_ref, r_ref, outs.pop(0))
    mean_ref = outs.pop(0) if subtract_mean and return_residuals else None
    rstd_ref = outs.pop(0) if return_residuals else None
  m = x_ref.shape[0]
  tile = functools.partial(_tile_index, k=k, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)  # the loop visits valid row blocks only

  def load(rb, eviction_policy, first=False):
    rows, cols, row_mask, col_mask, mask = tile(rb)
    x = _load_x(src, rows, cols, mask, first=first, eviction_policy=eviction_policy)
    return rows, cols, row_mask, col_mask, mask, x

  def publish(rb):
    rows, _, row_mask, _, mask, x = load(rb, "evict_last")

    def complete():
      parts = _split_partials(lambda c: (x, mask), 1, k, n=n, block_n=block_n,
                              subtract_mean=subtract_mean)
      for ref, v in zip(slot_refs, parts):
        plgpu.store(ref.at[rows, k], _slot_bits(v), mask=row_mask)
    return complete

  w = b = None
  if phase != "publish":
    _, cols, _, col_mask, _ = tile(0)
    w, b = _load_params(scale_ref, bias_ref, cols, col_mask, scale_offset)  # hoisted

  def finish(rb, carry):
    rows, cols, row_mask, _, mask, x = load(rb, "evict_first", first=True)
    ks, tiles = _split_slot_tiles(slot_refs, rows, row_mask, num_splits=num_splits,
                                  num_threads=32 * num_warps, poll=phase == "all")
    mean, rstd = _combine_splits(tiles[0], tiles[1] if subtract_mean else None, ks, n=n,
                                 eps=eps, block_n=block_n)
    _split_store(x.astype(_F32), mask, rows, cols, row_mask, k, mean, rstd, y_ref, mean_ref,
                 rstd_ref, lambda: (w, b))
    return carry

  _split_rows_loop(r, cdiv(m, block_m), num_groups=num_groups, lag=lag, phase=phase,
                   publish=publish, finish=finish, init=jnp.int32(0), early=early)


# --------------------------------------------------------------------------- launcher


def _io(x, residual, residual_dtype, scale, bias, return_residuals, subtract_mean,
        y_dtype=None, x_scale=None, rows=None, post_norm_scale=None):
  """The kernels' inputs (x, x_scale, residual, post_norm_scale, scale, bias; the present
  ones) and outputs (y, h, mean, rstd; the wanted ones), of ``rows`` rows (default x's)."""
  m, n = x.shape
  m = m if rows is None else rows
  inputs = [a for a in (x, x_scale, residual, post_norm_scale, scale, bias) if a is not None]
  outs = [out_struct((m, n), y_dtype or x.dtype, x)]
  if residual is not None:
    outs.append(out_struct((m, n), residual_dtype, x))
  if return_residuals:
    outs += [out_struct((m,), _F32, x)] * (2 if subtract_mean else 1)
  return inputs, outs


def _results(outs, has_residual, return_residuals, subtract_mean):
  """(y, mean, rstd), and h last with a residual, from the outputs _io asked for."""
  y, *rest = outs
  h = rest.pop(0) if has_residual else None
  mean = rest.pop(0) if return_residuals and subtract_mean else None
  rstd = rest.pop(0) if return_residuals else None
  return (y, mean, rstd, h) if has_residual else (y, mean, rstd)


def norm_forward(x, scale, bias, *, eps: float, scale_offset: float, subtract_mean: bool,
                 config: ForwardConfig, interpret: bool, return_residuals: bool = True,
                 residual=None, residual_dtype=None, cast: str = "torch", x_scale=None,
                 y_dtype=None, x_rows=None, post_norm_scale=None):
  """Launch the forward kernel that ``config.mode`` names.

  Args:
    x: [M, N] float32/bfloat16/float16, or float8_e4m3fn/float8_e5m2 with ``x_scale``.
    scale, bias: [N] float arrays or None.
    eps, scale_offset, subtract_mean: as in ``pallas_norm.layer_norm``.
    config: the launch config (mode, block_m, block_n, num_warps, num_programs).
    interpret: run in Pallas interpret mode.
    return_residuals: write mean/rstd (what the backward needs). A plain forward skips
      them: at 4096 x 1024 bf16 the kernel writing them took ~1.3 us more (H200).
    residual: None, or [M, N] float: the kernel normalises h = x + residual (summed in
      float32) and also writes h, in ``residual_dtype`` (default: residual's dtype).
    cast: "torch" (y rounded once, in x's dtype) or "llama" (HF LlamaRMSNorm: x_hat
      rounded to x's dtype, times the weight in the promotion of x's and the weight's
      dtypes, which is y's dtype). ("gemma" is "torch" with scale_offset=1: ops.py.)
    x_scale: None, or [M, N // G] float32 for FP8 x: the dequantisation scale of each
      group of G consecutive elements of a row (x ~= x.astype(f32) * x_scale repeated
      G times; COAT's s_x), applied in registers as the tiles are loaded (_Fp8). G, a
      power of 2, must divide N and every column tile of ``config``.
    y_dtype: y's dtype (default x's; for FP8 x, bfloat16). Not with cast="llama".
    x_rows: None, or (group, stride, offset, rows): normalise ``rows`` logical rows of
      x, logical row r being x's row (r // group) * stride + offset + r % group (a head
      range of each token's packed q|k|v: ``pallas_norm.qk_norm``), read in place; y,
      mean and rstd have ``rows`` rows. multi_wave_cached with block_n >= N only, no
      residual, no FP8 x.
    post_norm_scale: None, or [N] float: with a residual, the kernel first RMS-normalises
      x with it (``scale_offset + post_norm_scale``, the same eps; in float32, rounded to
      x's dtype: Gemma 2/3's post-norm of a sublayer's output), then adds the residual
      and normalises that sum: one pass for ``h = residual + rms_norm(x,
      post_norm_scale)``, ``y = norm(h)``. Needs whole rows a program
      (``post_norm_fits(config, N)``), cast="torch", a plain float x.

  Returns:
    (y [M, N] y_dtype, mean [M] f32 or None, rstd [M] f32 or None), and h [M, N] last
    with a residual. mean is None for RMSNorm; both are None without
    ``return_residuals``.

  Raises:
    ValueError: an ``x_scale`` that does not fit x or ``config`` (fp8_group_size).
    NotImplementedError: multi_wave_cached split over more programs than the device has
      SMs (``cdiv(N, config.block_n) > SMs``).
  """
  m, n = x.shape
  cfg = config
  group_size = fp8_group_size(x, x_scale, cfg)
  statics = dict(n=n, eps=float(eps), scale_offset=float(scale_offset),
                 subtract_mean=subtract_mean, has_scale=scale is not None,
                 has_bias=bias is not None, return_residuals=return_residuals,
                 has_residual=residual is not None, block_m=cfg.block_m, block_n=cfg.block_n,
                 cast_dtype=x.dtype.name if cast == "llama" else None, group_size=group_size)
  if residual is not None and residual_dtype is None:
    residual_dtype = residual.dtype
  io = _io(x, residual, residual_dtype, scale, bias, return_residuals, subtract_mean,
           llama_dtype(x, scale, bias) if cast == "llama" else _y_dtype(x, y_dtype),
           x_scale, rows=None if x_rows is None else x_rows[3],
           post_norm_scale=post_norm_scale)
  if post_norm_scale is not None:
    if (residual is None or not post_norm_fits(cfg, n) or cast != "torch"
        or x_scale is not None or x_rows is not None):
      raise ValueError(f"post_norm_scale needs a residual, whole rows a program "
                       f"(multi_wave_cached, block_n >= N={n}, column_splits 1: {cfg}), "
                       f"cast='torch' and a float x without x_rows")
    statics = dict(statics, post_norm=True)
  if x_rows is not None:
    if (cfg.mode != "multi_wave_cached" or cfg.block_n < n or residual is not None
        or x_scale is not None):
      raise ValueError(f"x_rows needs multi_wave_cached with block_n >= N ({cfg}), no "
                       f"residual and no FP8 x")
    statics = dict(statics, x_rows=tuple(int(v) for v in x_rows))
    m = x_rows[3]
  if cfg.column_splits > 1 and (cfg.block_n < n or x_scale is not None):
    raise ValueError(f"column_splits needs the row in one tile (block_n >= N={n}) and "
                     f"no FP8 x ({cfg})")
  num_row_blocks = cdiv(m, cfg.block_m)
  if cfg.mode == "multi_wave_cached" and cfg.block_n < n:
    outs = _split_forward(x, *io, statics, cfg, interpret)
  elif cfg.mode == "static_persistent" and cfg.split_rows and cfg.block_n < n:
    outs = _split_persistent_forward(x, *io, statics, cfg, interpret)
  else:
    outs = _whole_rows_forward(*io, statics, cfg, num_row_blocks, interpret)
  return _results(outs, residual is not None, return_residuals, subtract_mean)


def post_norm_fits(config: ForwardConfig, n: int) -> bool:
  """Whether ``norm_forward(..., post_norm_scale=)`` serves ``config`` at rows of ``n``:
  the cached mode with each row whole in one program (its post-norm's statistics are
  the row's own)."""
  return (config.mode == "multi_wave_cached" and config.block_n >= n
          and config.column_splits == 1)


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def fp8_group_size(x, x_scale, config=None) -> int:
  """G, the group size of FP8 ``x`` [M, N] scaled by ``x_scale`` [M, N // G] (0 when
  x_scale is None): the one check of the launchers of both passes.

  Raises:
    ValueError: x_scale with an x that is not FP8 (FP8_DTYPES) or none with FP8 x;
      an x_scale that is not float32 [M, N // G] for a power of 2 G; a column tile of
      ``config`` (block_n, chunk_n, pieces) that is not a multiple of G.
  """
  if x_scale is None:
    if x.dtype in FP8_DTYPES:
      raise ValueError(f"{x.dtype=} needs x_scale, its [M, N // group_size] dequantisation "
                       f"scales")
    return 0
  m, n = x.shape
  if x.dtype not in FP8_DTYPES:
    raise ValueError(f"x_scale is for FP8 x ({', '.join(d.name for d in FP8_DTYPES)}), "
                     f"not {x.dtype=}")
  groups = x_scale.shape[-1] if x_scale.ndim == 2 else 0
  g = n // groups if groups else 0
  if (x_scale.dtype != _F32 or x_scale.shape != (m, groups) or not g or g * groups != n
      or g & (g - 1)):
    raise ValueError(f"{x_scale.shape=} ({x_scale.dtype}) must be float32 [M, N // G] for "
                     f"x [M, N] = {x.shape} and a group size G, a power of 2 dividing N")
  widths = () if config is None else (config.block_n, config.chunk_n,
                                      *getattr(config, "pieces", ()))
  for w in widths:
    if w % g:
      raise ValueError(f"the config's column tiles {tuple(v for v in widths if v)} must be "
                       f"multiples of the group size {g} (N={n}, {x_scale.shape=})")
  return g


def _y_dtype(x, y_dtype):
  """y's dtype: ``y_dtype``, else x's, bfloat16 for FP8 x."""
  if y_dtype is not None:
    return jnp.dtype(y_dtype)
  return jnp.dtype(jnp.bfloat16) if x.dtype in FP8_DTYPES else x.dtype


def llama_dtype(x, scale, bias):
  """y's dtype under cast="llama": jnp's promotion of x's, scale's and bias's dtypes."""
  return jnp.result_type(*(a.dtype for a in (x, scale, bias) if a is not None))


def _whole_rows_forward(inputs, outs, statics, cfg: ForwardConfig, num_row_blocks: int,
                        interpret: bool):
  """multi_wave_cached (a row a tile), multi_wave_reload, static_persistent."""
  if cfg.mode == "multi_wave_cached":
    kernel, name = _cached_kernel, "pallas_norm_fwd_cached"
    grid = num_row_blocks * cfg.column_splits
    statics = dict(statics, hoist_params=cfg.hoist_params, stream_x=cfg.stream_x)
    if cfg.column_splits > 1:
      statics["column_splits"] = cfg.column_splits
  elif cfg.mode == "multi_wave_reload":
    kernel, grid, name = _reload_kernel, num_row_blocks, "pallas_norm_fwd_reload"
    statics = dict(statics, stream_x=cfg.stream_x)
  else:
    grid = _persistent_programs(cfg, num_row_blocks)
    statics.update(num_programs=grid, stream_x=cfg.stream_x,
                   reload_params=cfg.reload_params)
    kernel, name = _persistent_kernel, "pallas_norm_fwd_persistent"
  return pl.pallas_call(
      functools.partial(kernel, **statics),
      out_shape=outs,
      grid=(grid,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name=name,
  )(*inputs)


def _split_forward(x, inputs, outs, statics, cfg: ForwardConfig, interpret: bool):
  """multi_wave_cached with the row split over cdiv(N, block_n) programs (_split_kernel)."""
  m, n = x.shape
  sm = statics["subtract_mean"]
  num_splits = _split_count(n, cfg.block_n, interpret, what="multi_wave_cached",
                            remedy=f"use a larger block_n (up to {_SPLIT_MAX_BLOCK_N}) or "
                                   f"mode='static_persistent'")
  num_row_blocks = cdiv(m, cfg.block_m)
  chunk_n = min(cfg.chunk_n or cfg.block_n, cfg.block_n)
  statics = dict(statics, chunk_n=chunk_n, num_splits=num_splits, num_warps=cfg.num_warps,
                 max_polls=0 if interpret else _SPLIT_MAX_POLLS, interpret=interpret)
  slots = [out_struct((num_row_blocks * cfg.block_m, num_splits), _F32, x)
           ] * (2 if sm else 1)
  sync = jnp.zeros((num_row_blocks * _SYNC_STRIDE,), jnp.int32)
  inputs = [*inputs, sync]
  res = pl.pallas_call(
      functools.partial(_split_kernel, **statics),
      out_shape=outs + [out_struct(sync.shape, sync.dtype, sync)] + slots,
      grid=(num_row_blocks * num_splits,),
      input_output_aliases={len(inputs) - 1: len(outs)},
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name="pallas_norm_fwd_split")(*inputs)
  return res[:len(outs)]


def _split_persistent_forward(x, inputs, outs, statics, cfg: ForwardConfig,
                              interpret: bool):
  """static_persistent with the row split over cdiv(N, block_n) programs
  (_split_persistent_kernel)."""
  m, n = x.shape
  sm = statics["subtract_mean"]
  num_splits = _split_count(n, cfg.block_n, interpret, what="static_persistent with split_rows",
                            remedy="use a larger block_n or split_rows=False",
                            per_sm=split_resident_programs(cfg.num_warps))
  num_row_blocks = cdiv(m, cfg.block_m)
  num_groups = _persistent_programs(cfg, num_row_blocks)
  statics = dict(statics, num_splits=num_splits, num_groups=num_groups,
                 num_warps=cfg.num_warps, lag=cfg.split_lag, early=cfg.split_early_publish)
  return _split_rows_call(
      functools.partial(_split_persistent_kernel, **statics), inputs, outs,
      num_row_blocks=num_row_blocks, block_m=cfg.block_m, num_splits=num_splits,
      num_groups=num_groups, n_slots=2 if sm else 1, num_warps=cfg.num_warps,
      interpret=interpret, name="pallas_norm_fwd_split_persistent")


_SYNC_STRIDE = 32  # int32s: one counter a 128-byte line
# Counter reads before a split program stops waiting and computes the row's statistics
# itself (_split_kernel). A read is an L2 round trip (~1 us under load); the programs
# of a row block normally arrive within a few.
# On the H200 the fallback forced on every program that finds the row incomplete after
# 0 reads passed the GPU tests; after 2 reads, 4096 x 65536 took 315.6 us against 305.8
# after 256 (2026-11-21).
_SPLIT_MAX_POLLS = 256
# Widest split: 16384 f32 values over 16 warps is 32 registers a thread for x.
_SPLIT_MAX_BLOCK_N = 16384


def _split_count(n: int, block_n: int, interpret: bool, *, what: str, remedy: str,
                 per_sm: int = 1) -> int:
  """cdiv(N, block_n), the programs one row is split over; at most ``per_sm`` x the SM
  count, the programs that are surely resident together, since they wait on each other
  (no limit in interpret mode).

  Raises:
    NotImplementedError: more splits than that, naming ``what`` and the ``remedy``.
  """
  num_splits = cdiv(n, block_n)
  max_splits = 1 << 30 if interpret else device_info().num_sms * per_sm
  if num_splits > max_splits:
    raise NotImplementedError(
        f"{what} splits a row over cdiv(N, block_n) programs that wait on each other, at "
        f"most {'one' if per_sm == 1 else per_sm} a SM ({max_splits}): N={n} with "
        f"block_n={block_n} needs {num_splits}; {remedy}")
  return num_splits


# ----------------------------------------------------- tensor parallel: statistics, then y


def _stats_kernel(*refs, n, subtract_mean, has_residual, group_size, block_m, block_n,
                  num_programs):
  """Per row of this shard: RMSNorm s1 = sum(x^2); LayerNorm s1 = mean, s2 = M2 (of
  h = x + residual with one, storing h)."""
  refs = list(refs)
  x_ref = _x_src(refs.pop(0), refs, group_size, "stats", subtract_mean)
  r_ref = refs.pop(0) if has_residual else None
  s1_ref = refs.pop(0)
  s2_ref = [refs.pop(0)] if subtract_mean else []
  if has_residual:
    x_ref = _Sum(x_ref, r_ref, refs.pop(0))

  def row_block(rb):
    mean, acc = _chunk_stats(rb, x_ref, n=n, subtract_mean=subtract_mean, block_m=block_m,
                             block_n=block_n)
    rows, _, row_mask, _, _ = _tile_index(rb, 0, x_ref.shape[0], n, block_m=block_m,
                                          block_n=block_n, rows_in_bounds=True)
    plgpu.store(s1_ref.at[rows], acc if mean is None else mean, mask=row_mask)
    if mean is not None:
      plgpu.store(s2_ref[0].at[rows], acc, mask=row_mask)

  _row_blocks(cdiv(x_ref.shape[0], block_m), num_programs, row_block)


def _apply_kernel(x_ref, *refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                  has_residual, cast_dtype, group_size, block_m, block_n, num_programs):
  """y from x (+ residual) and the whole row's mean (LayerNorm) and rstd, [M] f32
  inputs."""
  refs = list(refs)
  x_ref = _x_src(x_ref, refs, group_size, "apply", subtract_mean)
  if has_residual:
    x_ref = _Sum(x_ref, refs.pop(0), None)  # h was stored by the statistics kernel
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref, y_ref = refs
  y_ref = _y_out(y_ref, cast_dtype)

  def row_block(rb):
    rows, _, row_mask, _, _ = _tile_index(rb, 0, x_ref.shape[0], n, block_m=block_m,
                                          block_n=block_n, rows_in_bounds=True)
    mean = None if mean_ref is None else _load(mean_ref.at[rows], row_mask)  # [block_m]
    rstd = _load(rstd_ref.at[rows], row_mask)  # [block_m] f32
    _chunk_normalise(rb, x_ref, y_ref, scale_ref, bias_ref, mean, rstd, n=n,
                     scale_offset=scale_offset, block_m=block_m, block_n=block_n)

  _row_blocks(cdiv(x_ref.shape[0], block_m), num_programs, row_block)


def _row_blocks(num_row_blocks, num_programs, row_block):
  """One row block a program (multi-wave grids), or a grid-stride loop over them
  (static_persistent: ``num_programs`` programs)."""
  if num_programs is None:
    row_block(pl.program_id(0))
  else:
    pl.loop(pl.program_id(0), num_row_blocks, step=num_programs)(row_block)


def _persistent_programs(cfg: ForwardConfig, num_row_blocks: int) -> int:
  """static_persistent's grid: ``cfg.num_programs`` (all row blocks when 0), at most one
  program a row block."""
  return max(1, min(cfg.num_programs or num_row_blocks, num_row_blocks))


def _tp_launch(cfg: ForwardConfig, m: int):
  """(grid, num_programs) of the two tensor-parallel kernels for ``cfg.mode``."""
  num_row_blocks = cdiv(m, cfg.block_m)
  if cfg.mode != "static_persistent":
    return num_row_blocks, None
  grid = _persistent_programs(cfg, num_row_blocks)
  return grid, grid


def norm_forward_stats(x, *, subtract_mean: bool, config: ForwardConfig, interpret: bool,
                       residual=None, residual_dtype=None, x_scale=None):
  """Row statistics of a shard of the hidden dim (tensor parallel), pass 1 of 2.

  The row block is walked in ``config.block_n`` chunks (one chunk when the row fits, as
  multi_wave_cached holds it); static_persistent loops over row blocks with
  ``config.num_programs`` programs, the multi-wave modes take one row block a program.

  Args:
    x: [M, n] the shard's columns of each row.
    subtract_mean: LayerNorm (True) or RMSNorm.
    config, interpret, residual, residual_dtype: as in ``norm_forward``; with a
      residual the statistics are those of h = x + residual, and h is written.
    x_scale: as in ``norm_forward`` (FP8 x; the shard's [M, n // G] scales).

  Returns:
    (s1, s2), [M] f32 each: RMSNorm (sum of x^2, None); LayerNorm (mean, M2 =
    sum((x - mean)^2)) over the n columns, for Chan et al.'s combination across shards;
    and h [M, n] third with a residual.
  """
  m, n = x.shape
  cfg = config
  group_size = fp8_group_size(x, x_scale, cfg)
  grid, num_programs = _tp_launch(cfg, m)
  outs = [out_struct((m,), _F32, x)] * (2 if subtract_mean else 1)
  if residual is not None:
    outs.append(out_struct((m, n), residual_dtype or residual.dtype, x))
  out = pl.pallas_call(
      functools.partial(_stats_kernel, n=n, subtract_mean=subtract_mean,
                        has_residual=residual is not None, group_size=group_size,
                        block_m=cfg.block_m, block_n=cfg.block_n, num_programs=num_programs),
      out_shape=outs,
      grid=(grid,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="pallas_norm_fwd_shard_stats",
  )(*[a for a in (x, x_scale, residual) if a is not None])
  s = (out[0], out[1]) if subtract_mean else (out[0], None)
  return s if residual is None else (*s, out[-1])


def norm_forward_apply(x, scale, bias, mean, rstd, *, scale_offset: float,
                       config: ForwardConfig, interpret: bool, residual=None,
                       cast: str = "torch", x_scale=None, y_dtype=None):
  """y of a shard of the hidden dim from the whole rows' statistics, pass 2 of 2.

  Args:
    x: [M, n]; scale, bias: [n] or None (the shard's columns).
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32.
    scale_offset, config, interpret: as in ``norm_forward``.
    residual: the residual given to ``norm_forward_stats``: y is that of x + residual.
    cast, x_scale, y_dtype: as in ``norm_forward``.

  Returns:
    y: [M, n] in ``y_dtype`` (default x's dtype; bfloat16 for FP8 x).
  """
  m, n = x.shape
  cfg = config
  group_size = fp8_group_size(x, x_scale, cfg)
  grid, num_programs = _tp_launch(cfg, m)
  inputs = [a for a in (x, x_scale, residual, scale, bias, mean, rstd) if a is not None]
  return pl.pallas_call(
      functools.partial(_apply_kernel, n=n, scale_offset=float(scale_offset),
                        subtract_mean=mean is not None, has_scale=scale is not None,
                        has_bias=bias is not None, has_residual=residual is not None,
                        cast_dtype=x.dtype.name if cast == "llama" else None,
                        group_size=group_size, block_m=cfg.block_m, block_n=cfg.block_n,
                        num_programs=num_programs),
      out_shape=out_struct((m, n), llama_dtype(x, scale, bias) if cast == "llama"
                           else _y_dtype(x, y_dtype), x),
      grid=(grid,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="pallas_norm_fwd_shard_apply",
  )(*inputs)
