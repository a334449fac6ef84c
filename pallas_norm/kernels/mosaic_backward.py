"""Pallas Mosaic GPU backward kernels (Hopper, sm_90) for RMSNorm and LayerNorm.

Status (2026-11-24, issue #29; docs/mosaic.md): runs through JAX's Mosaic GPU
interpreter (the CPU tests) and compiled on an H200 with jax 0.11.2 (``pytest --gpu
tests/test_mosaic_backward.py``: 19 passed, against the compiled Pallas backend at
8192x4096 and ragged shapes). Two fixes got it there: Lane lowering semantics
(``_compat.mosaic_lane_semantics``) and 16-byte aligned mean/rstd TMA windows (``_STATS_ALIGN``).
Tuned at a few shapes only: 0.45-0.90x the Pallas backend's speed on an H200 with the
warp-specialised default (2026-11-26: LayerNorm 8192x2048 38.2 against 34.3 us,
8192x4096 90.3 against 66.5, 4096x8192 150.4 against 67.0). The backward of
``backend="mosaic"`` in ``ops``, with ``mosaic_forward.py``.

Math, per row, as in ``backward.py`` (x_hat = (x - mean) * rstd, w = scale_offset +
scale, g = dy * w, N the row length; RMSNorm has mean = 0 and c2 = 0):

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N
    dx = (g - (x_hat * c1 + c2)) * rstd
    dscale = sum over rows of dy * x_hat
    dbias  = sum over rows of dy

The element-wise formulas and their rounding order are ``backward.py``'s; the row sums
and the column sums are reductions in another order (one Mosaic GPU warpgroup's), so
dx agrees with the Pallas (Triton lowering) backend to about 1 ulp, not bitwise.

Stage 1, ``pallas_norm_mgpu_bwd`` (``plgpu.kernel``, grid (G,), one warpgroup a
program, plus the producer below): program r is persistent over row blocks r, r + G,
... (G about the SM count). A row block of ``block_m`` rows arrives in shared memory by TMA, as
``N / block_w`` copies of [block_m, block_w] x and dy chunks (TMA boxes are at most 256
elements a side) plus a 32-element window of mean and rstd, into one of
``num_stages`` slots with an mbarrier each: the next ``num_stages - 1`` row blocks are
in flight while one is computed. scale is copied to shared memory once a program and
held in registers as float32 w. Pass 1 reads the block from shared memory chunk by
chunk into registers and reduces c1 (and c2) a row across the warpgroup; pass 2 reads
it again, writes dx to a shared-memory staging tile (TMA-stored to HBM, in flight while
the next block is loaded) and adds the chunk's column sums to the float32 dscale
(dbias) partials, which stay in registers across row blocks and are written once, one
[N] row a program: [G, N] float32, never [M, N]. The register layout puts one row
chunk over the warpgroup's 128 threads (``_rows_layout``): column sums of a block are
sums within a thread, row sums one cross-warp reduction a row block.

Stage 2, ``pallas_norm_mgpu_bwd_reduce``: program j sums column strip j of the [G, N]
partials over G in a fixed order (one thread a column, rows in order in pieces of
``_REDUCE_ROWS``) and casts to the parameter's dtype. No atomic accumulates anything,
so the gradients are bitwise deterministic.

Constraints (``NotImplementedError`` before any kernel runs): rows of a multiple of 16
bytes (TMA's row stride: N % 8 in 2-byte dtypes, N % 4 in float32), the shared memory
of one program (``_SMEM_BYTES``), the partials' registers (``_ACC_REGS`` float32 a
thread: N <= 8192 for LayerNorm, 16384 for RMSNorm), ``combine_row_sums``
(tensor-parallel hidden dim) not implemented. The row is N rounded up to whole
128-column chunks; M is any size. TMA zero-fills what lies past M or N on load (so
those elements add nothing to the sums) and drops it on store; in interpret mode, where
the interpreter raises on an out-of-bounds store, dx and dscale/dbias are allocated
with whole row blocks and chunks and sliced.

Interpret mode runs the kernels through JAX's Mosaic GPU interpreter
(``InterpretGPUParams``, jax >= 0.10) with out-of-bounds reads returning zeros, as TMA
does; the interpreter has no ``layout_cast``, so register layouts are only given to the
compiled kernel (``_Layouts``). The API differences across jax 0.10-0.12 that these
kernels meet (the interpreter's import, ``plgpu.kernel``'s keyword names, the lowering
semantics) are shimmed in ``_compat.py``.

Several warpgroups a program (``MosaicBackwardConfig.num_warpgroups``): each loads x and
dy, computes dx and keeps the partials of its own N / k columns; c1 (and c2) meet in
shared memory behind an mbarrier, summed in warpgroup order, and warpgroup 0 loads the
mean/rstd windows. They need ``warp_rows`` (Mosaic GPU's reduction scratch is one buffer
a program: with rows spread over the warpgroup, two warpgroups raced on it, wrong dx on
an H100, 2026-11-26), whose partials are kept a row of the block at a time. Correct on
the GPU, and 1.1-4x slower than one warpgroup (docs/mosaic.md#warp-rows): the default
stays at one.

Warp specialisation (``MosaicBackwardConfig.warp_specialized``, the default): one more
warpgroup a program, the producer, issues every TMA load (x, dy and the mean/rstd
windows of each row block into a slot, once the consumers have released it through the
slot's mbarrier); the consumers compute dx, store it and keep the partials. On an H200
it took 6-22% off the one-warpgroup kernel (docs/mosaic.md#warp-specialized-backward).

The fused residual add (``dh``, ``dx_dtype``, ``residual_dtype``, as in
``backward.py``; 2026-11-26): dh arrives with x (here h) and dy into slots of its own,
is added to dx in float32, and dx leaves in x's dtype, dresidual (where the residual's
dtype differs) through a second staging tile.

``cast="llama"`` (2026-11-26): g through the forward's roundings transposed and dscale
against the rounded x_hat, as ``backward._x_hat_g``.

Not here (issue #29): cluster multicast of scale (scale/bias are read once a program,
132-264 programs: 1-4 MB of L2 reads against the 64+ MiB a call streams from HBM), and
the FP8-input variant of ``backward.py`` (``ops`` refuses it for this backend before it
reaches this module).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_norm.config import DeviceInfo, cdiv, device_info
from pallas_norm.kernels._compat import (mosaic_interpret_params, mosaic_kernel_kwargs,
                                          mosaic_lane_semantics, out_struct)
from pallas_norm.kernels.forward import _round

__all__ = ["MosaicBackwardConfig", "backward_config", "checked_config", "norm_backward"]

_F32 = jnp.float32
_WARPGROUP = 128  # threads of one Mosaic GPU program (one warpgroup)
_STATS_WINDOW = 32  # f32 elements of mean / rstd a TMA copy: 128 bytes, a warpgroup's
_STATS_ALIGN = 4  # f32 elements in 16 bytes: a TMA source's alignment
_MAX_BOX = 256  # TMA: at most 256 elements along each dimension of a copy
# Shared memory one program may use (H100 / H200: 227 KB a block; headroom for the
# barriers and the reduction scratch Mosaic GPU allocates itself).
_SMEM_BYTES = 200 * 1024
# float32 partials a thread may hold across row blocks (N / 128 each, dscale and
# dbias): beyond this the kernel would spill.
_ACC_REGS = 128
# stage 2: partial rows summed a step (a thread holds this many f32 a step)
_REDUCE_ROWS = 8


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """Launch config of the Mosaic GPU backward.

  Attributes:
    block_m: rows a row block: 1, or a multiple of 4 up to 32 (a row block's mean/rstd
      then start on a 16-byte boundary, which a TMA source must; one row reads its
      value at an offset into an aligned window).
    block_w: columns of one TMA chunk (128 or 256; divides N rounded up to 128).
    num_stages: shared-memory slots of the load pipeline (>= 1): row blocks in flight.
    num_programs: G, the stage-1 grid (<= 256); the partials are [G, N] float32.
    num_warpgroups: k warpgroups a program (1, 2 or 4), each with its own N / k
      columns (k divides the block_w-column chunks): dx, the partials of those columns,
      and the row sums exchanged through shared memory. k > 1 needs ``warp_rows``.
    warp_rows: each warp holds whole rows of a chunk (block_m a multiple of 4): c1 and
      c2 are summed within a warp, and the partials are kept a row of the block at a
      time ([block_m, W] f32 a chunk in registers: N / (32 k) floats a thread each)
      and summed over the block's rows once, at the end, one warpgroup after the
      other (Mosaic GPU's reduction scratch is one buffer a program).
    warp_specialized: one more warpgroup a program, the producer, issues every TMA
      load (x, dy and the mean/rstd windows of each row block, into a slot once the
      num_warpgroups consumers have released it through the slot's mbarrier); the
      consumers only compute dx, store it and keep the partials (nvFuser's LayerNorm
      backward, issue #29).
  """

  block_m: int
  block_w: int
  num_stages: int
  num_programs: int
  num_warpgroups: int = 1
  warp_rows: bool = False
  warp_specialized: bool = False

  def __post_init__(self):
    if self.num_warpgroups not in (1, 2, 4):
      raise ValueError(f"{self.num_warpgroups=} must be 1, 2 or 4")
    if self.num_warpgroups > 1 and not self.warp_rows:
      raise ValueError(f"{self.num_warpgroups=} needs warp_rows=True (Mosaic GPU's "
                       "reduction scratch is shared by the warpgroups of a program)")
    if self.warp_rows and self.block_m % _STATS_ALIGN:
      raise ValueError(f"warp_rows needs a multiple of {_STATS_ALIGN} rows "
                       f"({self.block_m=})")
    if not (self.block_m == 1 or (self.block_m % _STATS_ALIGN == 0
                                  and _STATS_ALIGN <= self.block_m <= _STATS_WINDOW)):
      raise ValueError(f"{self.block_m=} must be 1 or a multiple of {_STATS_ALIGN} up to "
                       f"{_STATS_WINDOW}")
    if self.block_w not in (128, 256):
      raise ValueError(f"{self.block_w=} must be 128 or 256")
    if self.num_stages < 1:
      raise ValueError(f"{self.num_stages=} must be >= 1")
    if not 1 <= self.num_programs <= _MAX_BOX:
      raise ValueError(f"{self.num_programs=} must be in [1, {_MAX_BOX}]")


def _padded(n: int) -> int:
  """N rounded up to whole 128-column chunks (at least one)."""
  return max(1, cdiv(n, _WARPGROUP)) * _WARPGROUP


def _smem_bytes(n: int, block_m: int, num_stages: int, x_bytes: int, dy_bytes: int,
                dx_bytes: int, scale_bytes: int, dh_bytes: int = 0,
                dres_bytes: int = 0) -> int:
  """Shared memory of one stage-1 program: the x and dy slots (and dh's, with the
  fused residual add), mean/rstd windows, the dx staging tile (and dresidual's, in
  another dtype) and scale."""
  slots = num_stages * (block_m * n * (x_bytes + dy_bytes + dh_bytes)
                        + 2 * _STATS_WINDOW * 4)
  return slots + block_m * n * (dx_bytes + dres_bytes) + n * scale_bytes


def backward_config(m: int, n: int, dtype, subtract_mean: bool,
                    device: DeviceInfo | None = None,
                    fused_bytes: tuple[int, int, int] = (0, 0, 0)) -> MosaicBackwardConfig:
  """The default launch config for x [M, N] of ``dtype`` (``fused_bytes``: dh's, dx's
  and dresidual's bytes an element with the fused residual add, counted in the shared
  memory the rules fit; not measured with it).

  block_m: as many rows as keep a block at <= 4096 elements up to N = 1024, 4 rows up
  to N = 4096, 1 beyond, within the program's shared memory (``_SMEM_BYTES``) with 2
  stages; 1 or a multiple of 4; stages: 3 when they fit. G: the SM count (4 on CPU), at
  most the row blocks. Warp-specialised (a producer warpgroup issues the loads): H200,
  2026-11-26, us against the same config without it, LayerNorm 8192x4096 97.4 -> 90.3,
  8192x2048 40.4 -> 38.2, 4096x8192 192.3 -> 150.4, RMSNorm 8192x4096 80.1 -> 72.5
  (benchmarks/results/h200_2026-11-26_mosaic_sweep_bwd_ws_5d761f8.txt). Measured at a few
  shapes only (the comment at the rule). ``subtract_mean`` is accepted for the tuning
  to come.
  """
  del subtract_mean
  device = device or device_info()
  b = jnp.dtype(dtype).itemsize
  n = _padded(n)
  block_w = 256 if n % 256 == 0 else 128
  # 1, or a multiple of 4 (MosaicBackwardConfig.block_m), the largest that fits; rows
  # up to 4096 wide take 4-row blocks rather than 1 (H200, 2026-11-24, RMSNorm,
  # benchmarks/results/h200_2026-11-24_mosaic_bwd_probe_*.txt: 8192x2048 34.5 us against
  # 71.3 at one row, the Pallas backend's 34.4; 8192x4096 80.6 at 4 rows x 2 stages
  # against 126.4 at 1 row x 3 stages, the Pallas backend's 57)
  cap = 4096 // n if n <= 1024 else (_STATS_ALIGN if n <= 4096 else 1)
  dh_b, dx_b, dres_b = fused_bytes
  smem = lambda bm, stages: _smem_bytes(n, bm, stages, b, b, dx_b or b, 4, dh_b, dres_b)
  fits = [bm for bm in range(_STATS_WINDOW, 0, -_STATS_ALIGN) if bm <= cap
          and smem(bm, 2) <= _SMEM_BYTES]
  block_m = fits[0] if fits else 1
  stages = 3 if smem(block_m, 3) <= _SMEM_BYTES else 2
  g = max(1, min(device.num_sms, _MAX_BOX, cdiv(max(m, 1), block_m)))
  return MosaicBackwardConfig(block_m=block_m, block_w=block_w, num_stages=stages,
                              num_programs=g, warp_specialized=True)


# --------------------------------------------------------------------------- launch


def _kernel(body, out, scratch, *, grid, interpret, name, num_threads=1):
  """plgpu.kernel over ``grid`` (axis "g"), ``num_threads`` warpgroups a program (axis
  "wg" when more than one)."""
  out_kw, scratch_kw = mosaic_kernel_kwargs()
  threads = {} if num_threads == 1 else dict(num_threads=num_threads, thread_name="wg")
  return plgpu.kernel(body, **{out_kw: out, scratch_kw: scratch}, grid=grid,
                      grid_names=("g",),
                      interpret=mosaic_interpret_params() if interpret else None,
                      kernel_name=name, compiler_params=mosaic_lane_semantics(), **threads)


class _Layouts:
  """Register layouts of the kernels: [rows, W] tiles, ``row`` a [rows] vector (a row's
  value in the threads that hold the row), ``col`` a [W] vector split like the tile's
  columns. Two tile layouts:

  - each row over the warpgroup (the default; V contiguous elements a thread, 32 lanes,
    4 warps: W a multiple of 128 V), rows in registers: a row sum crosses the warps
    (Mosaic GPU reduces through its shared-memory reduction scratch), a column sum
    stays in registers;
  - ``warp_rows``: each warp holds whole rows (row i in warp i % 4; V contiguous
    elements a thread, 32 lanes: W a multiple of 32 V; rows a multiple of 4): a row sum
    stays in the warp (shuffles), no shared memory. Mosaic GPU's reduction scratch is
    one buffer for the whole program (jax 0.10-0.11), so with several warpgroups a
    program only this layout gives right row sums (the default raced: wrong mean/rstd
    on an H100, 2026-11-26).

  Interpret mode has no ``layout_cast``: ``cast`` is then the identity."""

  def __init__(self, vec: int, interpret: bool, warp_rows: bool = False):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    if warp_rows:
      tile = fa.TiledLayout(fa.Tiling(((4, 32 * vec), (1, vec))), warp_dims=(-4,),
                            lane_dims=(-3,), vector_dim=-1,
                            _check_canonical=False).canonicalize()
    else:
      tile = fa.TiledLayout(fa.Tiling(((1, _WARPGROUP * vec), (1, 32 * vec), (vec,))),
                            warp_dims=(-4,), lane_dims=(-2,), vector_dim=-1,
                            _check_canonical=False).canonicalize()
    self.interpret = interpret
    self.tile, self.row, self.col = (self._pallas(t) for t in
                                     (tile, tile.reduce((1,)), tile.reduce((0,))))

  @staticmethod
  def _pallas(t):
    return plgpu.Layout.TILED(t.tiling, warp_dims=t.warp_dims, lane_dims=t.lane_dims,
                              vector_dim=t.vector_dim)

  def cast(self, a, layout):
    return a if self.interpret else plgpu.layout_cast(a, layout)

  def rows(self, v, width):
    """[rows] -> [rows, width], each row's value across it, in the tile layout; a
    scalar (one row) -> [1, width]."""
    if v.ndim == 0:
      return self.cast(lax.broadcast_in_dim(v, (1, width), ()), self.tile)
    return self.cast(lax.broadcast_in_dim(v, (v.shape[0], width), (0,)), self.tile)

  def stats(self, ref, rows, off):
    """rows values of a [32] f32 mean / rstd window: [rows] in the row layout (from
    its start: a block of a multiple of 4 rows starts aligned), or a scalar for one row
    (Mosaic GPU cannot load a one-element vector), at ``off`` (traced, 0 to 3) into the
    window, which starts on the 16-byte boundary at or before the row."""
    if rows == 1:
      return ref[off]
    return self.cast(ref[pl.ds(0, rows)], self.row)

  def cols(self, v, rows):
    """[W] -> [rows, W], the vector repeated down the rows, in the tile layout."""
    return self.cast(lax.broadcast_in_dim(v, (rows, v.shape[0]), (1,)), self.tile)


def _vec(block_w: int, itemsize: int, warp_rows: bool = False) -> int:
  """Elements a thread loads at once: 16 bytes, at most block_w / 128 (a row over the
  warpgroup) or block_w / 32 (``warp_rows``: a row over a warp)."""
  if warp_rows:  # at most 4: 8 bf16 a thread failed Mosaic GPU's check that a vector
    # load does not cross a swizzle tile (jax 0.10.2, 256 columns)
    return max(1, min(16 // itemsize, block_w // 32, 4))
  return max(1, min(16 // itemsize, block_w // _WARPGROUP))


def _rem(a, b):
  """lax.rem of a traced index by a Python int in the index's own dtype: lax.rem takes no
  weak types, and with jax_enable_x64 a bare Python int becomes int64 against an int32
  index (a TypeError under x64 until 2026-11-27)."""
  a = jnp.asarray(a)
  return lax.rem(a, jnp.asarray(b, a.dtype))


def _sum(terms):
  return functools.reduce(lambda a, b: a + b, terms)


def _my_chunks(k: int, num_chunks: int):
  """(wg, the block_w-column chunks this warpgroup of k owns: N / k consecutive ones);
  wg is 0 with one warpgroup, else the "wg" axis index (traced)."""
  per_wg = num_chunks // k
  if k == 1:
    return 0, list(range(per_wg))
  wg = lax.axis_index("wg")
  return wg, [wg * per_wg + c for c in range(per_wg)]


def _exchange_row_sums(sums, red, xbar, b, wg, k, lay):
  """This warpgroup's [block_m] partial row sums -> the whole rows', through buffer b of
  ``red`` ([2, Q, k, block_m] f32 shared memory, Q >= len(sums)) behind mbarrier
  ``xbar[b]`` (k arrivals), summed in warpgroup order (every warpgroup gets the same
  bits). A warpgroup may write buffer b again only after every warpgroup has passed
  the exchange through the other buffer, so after it read this one."""
  for q, v in enumerate(sums):
    red[b, q, wg] = v
  plgpu.barrier_arrive(xbar.at[b])
  plgpu.barrier_wait(xbar.at[b])
  return [_sum([lay.cast(red[b, q, j], lay.row) for j in range(k)])
          for q in range(len(sums))]


def _warp_specialized(wg, k, num_steps, num_stages, free, fetch_step, consume,
                      prologue=None):
  """A warp-specialised program: warpgroup k, the producer, runs ``prologue`` and then
  ``fetch_step(step, slot)`` for each row block, into slot step % num_stages once the k
  consumers have released the slot's previous block (``free[slot]``, k arrivals), and
  at the end waits for the last releases (the interpreter wants every thread to observe
  every phase of a barrier it waits on); warpgroups 0..k-1 run ``consume``."""
  @pl.when(wg == k)
  def _producer():
    if prologue is not None:
      prologue()

    def load(step, carry):
      slot = _rem(step, num_stages)

      @pl.when(step >= num_stages)  # the consumers are done with the slot's last block
      def _():
        plgpu.barrier_wait(free.at[slot])
      fetch_step(step, slot)
      return carry

    lax.fori_loop(0, num_steps, load, 0)

    def drain(step, carry):  # the last slots' releases: every phase observed
      plgpu.barrier_wait(free.at[_rem(step, num_stages)])
      return carry

    lax.fori_loop(jnp.maximum(num_steps - num_stages, 0), num_steps, drain, 0)

  @pl.when(wg < k)
  def _consumers():
    consume()


# --------------------------------------------------------------------------- stage 1


def _stage1_kernel(*refs, m, n, scale_offset, subtract_mean, has_scale, has_bias,
                   has_dh, has_dres, cast, block_m, block_w, num_stages, num_programs,
                   num_warpgroups, warp_rows, warp_specialized, interpret):
  """Program r: row blocks r, r + G, ... of dx, and its [N] f32 partial rows. With k
  warpgroups, each loads x and dy, computes dx and holds the partials of its own N / k
  columns; the row sums c1 (and c2) are exchanged through shared memory (summed in
  warpgroup order), and warpgroup 0 loads the mean/rstd windows. ``warp_specialized``:
  warpgroup k, the producer, issues every load instead (a slot's next row block once
  the k consumers have released it through the slot's ``free`` barrier). ``has_dh``
  (the fused residual add; x is then h): dh, h's cotangent, is loaded with x and dy and
  added to dx in float32; ``has_dres``: dx is written once more in the residual's
  dtype (dresidual). ``cast`` (x's and y's dtypes, for cast="llama"): g goes through
  the forward's roundings' transposes (to y's dtype, then x's), and dscale sums dy
  against x_hat rounded to x's dtype, as ``backward._x_hat_g``."""
  refs = list(refs)
  # inputs
  dy_ref, x_ref = refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  # outputs
  dx_ref = refs.pop(0)
  dres_ref = refs.pop(0) if has_dres else None
  dw_ref = refs.pop(0) if has_scale else None
  db_ref = refs.pop(0) if has_bias else None
  # scratch
  xs, dys = refs.pop(0), refs.pop(0)  # [S, C, block_m, W] x's / dy's dtype
  dhs = refs.pop(0) if has_dh else None  # [S, C, block_m, W] dh's dtype
  ws = refs.pop(0) if has_scale else None  # [C, W] scale's dtype
  ms = refs.pop(0) if subtract_mean else None  # [S, 32] f32
  rs, dxs = refs.pop(0), refs.pop(0)  # [S, 32] f32, [C, bm, W] dx's dtype
  dress = refs.pop(0) if has_dres else None  # [C, bm, W] dresidual's dtype
  bar = refs.pop(0)  # [S]
  wbar = refs.pop(0) if has_scale else None
  k = num_warpgroups
  red = refs.pop(0) if k > 1 else None  # [2, 2, k, block_m] f32: the row-sum exchange
  xbar = refs.pop(0) if k > 1 else None  # [2], k arrivals
  fbar = refs.pop(0) if k > 1 else None  # k arrivals: the partials' turns
  free = refs.pop(0) if warp_specialized else None  # [S], k arrivals: a slot released
  assert not refs

  num_chunks = _padded(n) // block_w
  lay = _Layouts(_vec(block_w, x_ref.dtype.itemsize, warp_rows), interpret, warp_rows)
  r = lax.axis_index("g")
  wg, mine = _my_chunks(k, num_chunks)
  if warp_specialized:  # the producer is warpgroup k
    wg = lax.axis_index("wg")
  per_wg = len(mine)
  num_steps = (cdiv(m, block_m) - 1 - r) // num_programs + 1

  zero = r * 0  # traced: a column start past N is then not checked at trace time

  def chunk(c):  # columns of chunk c; the last may run past N (TMA: zeros / dropped)
    start = c * block_w
    if not isinstance(start, int):  # a warpgroup's chunk: traced already
      return pl.ds(start, block_w)
    return pl.ds(start + zero if start + block_w > n else start, block_w)

  def fetch(step, slot, chunks=mine, stats=False):
    """Row block r + step * G into slot: the x and dy ``chunks`` (this wg's), and the
    mean/rstd windows where ``stats`` (warpgroup 0's by default)."""
    row0 = (r + step * num_programs) * block_m
    rows = pl.ds(row0, block_m)
    for c in chunks:
      plgpu.copy_gmem_to_smem(x_ref.at[rows, chunk(c)], xs.at[slot, c], bar.at[slot])
      plgpu.copy_gmem_to_smem(dy_ref.at[rows, chunk(c)], dys.at[slot, c], bar.at[slot])
      if has_dh:
        plgpu.copy_gmem_to_smem(dh_ref.at[rows, chunk(c)], dhs.at[slot, c], bar.at[slot])
    # a TMA source must be 16-byte aligned: the window starts at the boundary at or
    # before row0 (one row: row0 % 4 elements before it; a multiple of 4 rows: at it)
    window = pl.ds(row0 - _rem(row0, _STATS_ALIGN), _STATS_WINDOW)

    def windows():
      if subtract_mean:
        plgpu.copy_gmem_to_smem(mean_ref.at[window], ms.at[slot], bar.at[slot])
      plgpu.copy_gmem_to_smem(rstd_ref.at[window], rs.at[slot], bar.at[slot])

    if stats:
      windows()
    else:
      # warpgroup 0 loads the windows; it refills a slot only after the step's
      # exchange, which every warpgroup reaches after reading the slot's mean/rstd
      pl.when(wg == 0)(windows)

  def load_w():
    """scale_offset + scale: [W] f32 a chunk of this wg's, in registers (or None)."""
    if not has_scale:
      return None
    for c in mine:
      plgpu.copy_gmem_to_smem(scale_ref.at[chunk(c)], ws.at[c], wbar)
    plgpu.barrier_wait(wbar)
    w = []
    for c in mine:
      wc = lay.cast(ws[c], lay.col).astype(_F32)
      w.append(wc + _F32(scale_offset) if scale_offset else wc)
    return w

  def row_totals(step, sums):
    """This wg's [block_m] row sums -> the whole rows' (one exchange a step, through
    buffer step % 2: a warpgroup writes a buffer again only after every warpgroup has
    passed the next step's exchange, so after it read this one)."""
    if k == 1:
      return sums
    return _exchange_row_sums(sums, red, xbar, _rem(step, 2), wg, k, lay)

  def parts(slot, i, mean, rstd, w):
    """(x_hat, dy, g, x_hat_w) of this wg's chunk i: [block_m, W] f32 each; x_hat_w is
    what dscale sums dy against."""
    c = mine[i]
    x = lay.cast(xs[slot, c], lay.tile).astype(_F32)
    dy = lay.cast(dys[slot, c], lay.tile).astype(_F32)
    if mean is not None:
      x = x - lay.rows(mean, block_w)
    x_hat = x * lay.rows(rstd, block_w)
    g = dy if w is None else dy * lay.cols(w[i], block_m)
    if cast is None:
      return x_hat, dy, g, x_hat
    x_dt, y_dt = cast
    return x_hat, dy, _round(_round(g, y_dt), x_dt), _round(x_hat, x_dt)

  def body(step, accs, w):
    slot = _rem(step, num_stages)
    rb = r + step * num_programs
    plgpu.barrier_wait(bar.at[slot])
    off = _rem(rb * block_m, _STATS_ALIGN)  # 0 unless one row a block
    rstd = lay.stats(rs.at[slot], block_m, off)  # [block_m] f32 (a scalar for one row)
    mean = lay.stats(ms.at[slot], block_m, off) if subtract_mean else None
    # pass 1: the row sums, chunk by chunk, summed across the warpgroup once
    s1, s2 = [], []
    for i in range(per_wg):
      x_hat, _, g, _ = parts(slot, i, mean, rstd, w)
      s1.append(x_hat * g)
      s2.append(g)
    sums = [jnp.sum(_sum(s1), axis=1)] + ([jnp.sum(_sum(s2), axis=1)]
                                          if subtract_mean else [])
    sums = row_totals(step, sums)
    c1 = sums[0] / n  # [block_m] f32
    c2 = sums[1] / n if subtract_mean else None
    # the previous row block's dx has left the staging tile (its TMA stores read it)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    # pass 2: dx and the partials
    new = []
    for i, c in enumerate(mine):
      x_hat, dy, g, x_hat_w = parts(slot, i, mean, rstd, w)
      dx = g - x_hat * lay.rows(c1, block_w)
      if c2 is not None:
        dx = dx - lay.rows(c2, block_w)
      dx = dx * lay.rows(rstd, block_w)
      if dhs is not None:  # the fused residual add: h's cotangent, in float32
        dx = dx + lay.cast(dhs[slot, c], lay.tile).astype(_F32)
      dxs[c] = dx.astype(dxs.dtype)
      if dress is not None:
        dress[c] = dx.astype(dress.dtype)
      dw, db = accs[i]
      if warp_rows:  # a row of the block at a time: summed over rows at the end
        new.append((None if dw is None else dw + dy * x_hat_w,
                    None if db is None else db + dy))
      else:
        new.append((None if dw is None else dw + jnp.sum(dy * x_hat_w, axis=0),
                    None if db is None else db + jnp.sum(dy, axis=0)))
    if free is not None:  # the slot has been read: the producer may refill it
      plgpu.barrier_arrive(free.at[slot])
    plgpu.commit_smem()
    rows = pl.ds(rb * block_m, block_m)
    for c in mine:
      plgpu.copy_smem_to_gmem(dxs.at[c], dx_ref.at[rows, chunk(c)])
      if dress is not None:
        plgpu.copy_smem_to_gmem(dress.at[c], dres_ref.at[rows, chunk(c)])
    plgpu.commit_smem_to_gmem_group()

    if free is None:
      # refill this slot with the row block num_stages ahead (its reads are done: the
      # copy waits for the warpgroup)
      @pl.when(step + num_stages < num_steps)
      def _():
        fetch(step + num_stages, slot)

    return tuple(new)

  def zeros(has):
    if not has:
      return None
    if warp_rows:
      return lay.cast(jnp.zeros((block_m, block_w), _F32), lay.tile)
    return lay.cast(jnp.zeros((block_w,), _F32), lay.col)

  def consume():
    w = load_w()
    init = tuple((zeros(has_scale), zeros(has_bias)) for _ in range(per_wg))
    accs = lax.fori_loop(0, num_steps, lambda step, a: body(step, a, w), init)
    plgpu.wait_smem_to_gmem(0)

    def store_partials():
      for c, (dw, db) in zip(mine, accs):
        cols = pl.ds(c * block_w, block_w)  # the partials have whole chunks
        for acc, ref in ((dw, dw_ref), (db, db_ref)):
          if acc is not None:  # warp_rows: the sum over the block's rows crosses warps
            ref[r, cols] = jnp.sum(acc, axis=0) if warp_rows else acc

    if fbar is None:
      store_partials()
    else:  # one warpgroup at a time through the reduction scratch
      for j in range(k):
        @pl.when(wg == j)
        def _():
          store_partials()
        plgpu.barrier_arrive(fbar)
        plgpu.barrier_wait(fbar)

  if free is None:
    for s in range(num_stages):  # prologue: the first num_stages row blocks
      @pl.when(s < num_steps)
      def _():
        fetch(s, s)
    consume()
    return

  _warp_specialized(wg, k, num_steps, num_stages, free,
                    lambda step, slot: fetch(step, slot, range(num_chunks), stats=True),
                    consume)


# --------------------------------------------------------------------------- stage 2


def _reduce_kernel(*refs, num_parts, interpret):
  """Program j: out[strip j] = sum over the G partial rows in order, for each (part,
  out) pair (dscale's and dbias's partials in one launch)."""
  parts, outs = refs[:num_parts], refs[num_parts:2 * num_parts]
  ps, os_, bar = refs[2 * num_parts:]  # [P, G, 128] f32, [P, 128] out dtype, [P]
  g_total = parts[0].shape[0]
  lay = _Layouts(1, interpret)
  strip = pl.ds(lax.axis_index("g") * _WARPGROUP, _WARPGROUP)
  for i, part_ref in enumerate(parts):
    plgpu.copy_gmem_to_smem(part_ref.at[:, strip], ps.at[i], bar.at[i])
  for i, out_ref in enumerate(outs):
    plgpu.barrier_wait(bar.at[i])
    acc = None
    for g0 in range(0, g_total, _REDUCE_ROWS):
      rows = pl.ds(g0, min(_REDUCE_ROWS, g_total - g0))
      piece = jnp.sum(lay.cast(ps[i, rows], lay.tile), axis=0)  # [128] f32
      acc = piece if acc is None else acc + piece
    os_[i] = acc.astype(os_.dtype)
  plgpu.commit_smem()
  for i, out_ref in enumerate(outs):
    plgpu.copy_smem_to_gmem(os_.at[i], out_ref.at[strip])
  plgpu.wait_smem_to_gmem(0)


def _reduce_partials(parts, dtypes, n, interpret):
  """[G, N'] f32 each (N' = N rounded up to 128) -> [N] each in its dtype, one launch
  for arrays of one dtype (``ops`` gives scale and bias the parameter dtype)."""
  g, n_pad = parts[0].shape
  if len({jnp.dtype(d) for d in dtypes}) != 1:
    return [_reduce_partials([p], [d], n, interpret)[0] for p, d in zip(parts, dtypes)]
  out_dtype = jnp.dtype(dtypes[0])
  n_out = n_pad if interpret else n  # the interpreter raises on stores past N
  scratch = [plgpu.SMEM((len(parts), g, _WARPGROUP), _F32),
             plgpu.SMEM((len(parts), _WARPGROUP), out_dtype),
             plgpu.Barrier(num_arrivals=1, num_barriers=len(parts))]
  call = _kernel(functools.partial(_reduce_kernel, num_parts=len(parts),
                                   interpret=interpret),
                 [out_struct((n_out,), out_dtype, parts[0]) for _ in parts], scratch,
                 grid=(n_pad // _WARPGROUP,), interpret=interpret,
                 name="pallas_norm_mgpu_bwd_reduce")
  return [a[:n] if n_out != n else a for a in call(*parts)]


# --------------------------------------------------------------------------- launcher


def _check(n, dtypes, cfg: MosaicBackwardConfig, num_accs, combine_row_sums,
           fused_bytes=(0, 0, 0)):
  """NotImplementedError / ValueError for what this backend cannot run.
  ``fused_bytes``: dh's, dx's and dresidual's bytes an element with the fused residual
  add (dx's 0: x's)."""
  if combine_row_sums is not None:
    raise NotImplementedError("backend='mosaic' does not implement combine_row_sums "
                              "(the hidden dim sharded, tensor parallel) yet")
  for dt in dtypes:
    if n * jnp.dtype(dt).itemsize % 16:
      raise NotImplementedError(
          f"backend='mosaic' backward: TMA needs rows of a multiple of 16 bytes; N={n} "
          f"of {jnp.dtype(dt).name} is {n * jnp.dtype(dt).itemsize} bytes")
  n_pad = _padded(n)
  if n_pad % cfg.block_w:
    raise ValueError(f"config.block_w={cfg.block_w} must divide N={n} rounded up to "
                     f"128 ({n_pad})")
  if (n_pad // cfg.block_w) % cfg.num_warpgroups:
    raise ValueError(f"config.num_warpgroups={cfg.num_warpgroups} must divide the "
                     f"{n_pad // cfg.block_w} chunks of {cfg.block_w} columns (N={n})")
  if num_accs * n_pad // _WARPGROUP > _ACC_REGS:
    raise NotImplementedError(
        f"backend='mosaic' backward holds the dscale/dbias partials in registers: "
        f"{num_accs} x N/128 = {num_accs * n_pad // _WARPGROUP} f32 a thread > "
        f"{_ACC_REGS} (N={n})")
  x_b, dy_b, *rest = (jnp.dtype(dt).itemsize for dt in dtypes)
  dh_b, dx_b, dres_b = fused_bytes
  need = _smem_bytes(n_pad, cfg.block_m, cfg.num_stages, x_b, dy_b, dx_b or x_b,
                     rest[0] if rest else 0, dh_b, dres_b)
  if need > _SMEM_BYTES:
    raise NotImplementedError(
        f"backend='mosaic' backward: one program needs {need} bytes of shared memory "
        f"> {_SMEM_BYTES} (N={n}, block_m={cfg.block_m}, num_stages={cfg.num_stages})")


def checked_config(m: int, n: int, x_dtype, dy_dtype, scale_dtype, has_bias: bool,
                   subtract_mean: bool, config=None, combine_row_sums=None,
                   fused_dtypes=None) -> MosaicBackwardConfig:
  """``config`` if a MosaicBackwardConfig, else ``backward_config``'s, checked against
  x and dy [M, N], a scale of ``scale_dtype`` (None: no scale) and, with the fused
  residual add, ``fused_dtypes`` (dh's, dx's, dresidual's or None)
  (NotImplementedError / ValueError, as ``norm_backward`` raises them). ``ops`` asks it
  whether this backend serves a call."""
  fused = (0, 0, 0) if fused_dtypes is None else tuple(
      0 if d is None else jnp.dtype(d).itemsize for d in fused_dtypes)
  cfg = config if isinstance(config, MosaicBackwardConfig) else backward_config(
      m, n, x_dtype, subtract_mean, fused_bytes=fused)
  _check(n, [x_dtype, dy_dtype] + ([scale_dtype] if scale_dtype is not None else []),
         cfg, int(scale_dtype is not None) + int(has_bias), combine_row_sums, fused)
  return cfg


def norm_backward(dy, x, scale, mean, rstd, *, has_bias: bool, scale_offset: float,
                  subtract_mean: bool, config=None, interpret: bool,
                  scale_dtype=None, bias_dtype=None, combine_row_sums=None, dh=None,
                  dx_dtype=None, residual_dtype=None, cast=None):
  """Two-stage backward on Pallas Mosaic GPU; ``backward.norm_backward``'s contract.

  Args:
    dy, x: [M, N], x's dtype (float32, bfloat16 or float16); rows of a multiple of 16
      bytes.
    scale: [N] or None.
    mean: [M] f32 (LayerNorm) or None (RMSNorm); rstd: [M] f32, saved by the forward.
    has_bias: whether to produce dbias.
    scale_offset, subtract_mean: as in the forward.
    config: a MosaicBackwardConfig; anything else (``ops`` passes the other backends'
      ``config.BackwardConfig``) is ignored and ``backward_config`` picks one.
    interpret: run both stages through JAX's Mosaic GPU interpreter.
    scale_dtype, bias_dtype: dtypes of dscale and dbias.
    combine_row_sums: must be None (tensor-parallel row sums are not implemented here).
    dh, dx_dtype, residual_dtype: the fused residual add, as in
      ``backward.norm_backward`` (x then being h = x + residual): dh [M, N] (h's
      cotangent) or None is added to dx in float32; dx is written in ``dx_dtype``
      (default x's dtype) and, given a different ``residual_dtype``, once more in that
      dtype (dresidual).
    cast: None (cast="torch") or (x's dtype name, y's dtype name) for cast="llama"
      (the forward's roundings, transposed; dscale sums dy against the rounded x_hat),
      as in ``backward.norm_backward``; dy is then in y's dtype.

  Returns:
    (dx [M, N] dx_dtype, dscale [N] scale_dtype or None, dbias [N] bias_dtype or None);
    with a ``residual_dtype``, (dx, dresidual, dscale, dbias), dresidual being dx
    itself when the dtypes agree.

  Raises:
    NotImplementedError: rows not a multiple of 16 bytes; partials or shared memory
      beyond one program (N too large; see the module docstring); ``combine_row_sums``.
    ValueError: a config whose block_w does not divide N.
  """
  m, n = x.shape
  has_scale = scale is not None
  dx_dtype = jnp.dtype(dx_dtype or x.dtype)
  has_dres = residual_dtype is not None and jnp.dtype(residual_dtype) != dx_dtype
  if dh is not None and dh.shape != x.shape:
    raise ValueError(f"dh.shape={dh.shape} must be x's {x.shape}")
  fused = None
  if dh is not None or residual_dtype is not None or dx_dtype != x.dtype:
    fused = (None if dh is None else dh.dtype, dx_dtype,
             residual_dtype if has_dres else None)
  cfg = checked_config(m, n, x.dtype, dy.dtype, scale.dtype if has_scale else None,
                       has_bias, subtract_mean, config, combine_row_sums, fused)

  def result(dx, dres, dscale, dbias):
    if residual_dtype is None:
      return dx, dscale, dbias
    return dx, dres if has_dres else dx, dscale, dbias

  if m == 0 or n == 0:
    return result(jnp.zeros(x.shape, dx_dtype), jnp.zeros(x.shape, residual_dtype),
                  jnp.zeros((n,), scale_dtype) if has_scale else None,
                  jnp.zeros((n,), bias_dtype) if has_bias else None)
  bm, bw, stages = cfg.block_m, cfg.block_w, cfg.num_stages
  num_row_blocks = cdiv(m, bm)
  g = max(1, min(cfg.num_programs, num_row_blocks))
  n_pad = _padded(n)
  num_chunks = n_pad // bw
  # The interpreter raises on TMA stores past M or N (the GPU drops them): dx has whole
  # row blocks and chunks there, sliced after.
  m_out, n_out = (num_row_blocks * bm, n_pad) if interpret else (m, n)
  out = [out_struct((m_out, n_out), dx_dtype, x)]
  if has_dres:
    out.append(out_struct((m_out, n_out), residual_dtype, x))
  out += [out_struct((g, n_pad), _F32, x)] * (int(has_scale) + int(has_bias))
  scratch = [plgpu.SMEM((stages, num_chunks, bm, bw), x.dtype),
             plgpu.SMEM((stages, num_chunks, bm, bw), dy.dtype)]
  if dh is not None:
    scratch.append(plgpu.SMEM((stages, num_chunks, bm, bw), dh.dtype))
  if has_scale:
    scratch.append(plgpu.SMEM((num_chunks, bw), scale.dtype))
  if subtract_mean:
    scratch.append(plgpu.SMEM((stages, _STATS_WINDOW), _F32))
  scratch += [plgpu.SMEM((stages, _STATS_WINDOW), _F32),
              plgpu.SMEM((num_chunks, bm, bw), dx_dtype)]
  if has_dres:
    scratch.append(plgpu.SMEM((num_chunks, bm, bw), residual_dtype))
  scratch.append(plgpu.Barrier(
      num_arrivals=(2 + int(dh is not None)) * num_chunks + 1 + int(subtract_mean),
      num_barriers=stages))
  if has_scale:
    scratch.append(plgpu.Barrier(num_arrivals=num_chunks))
  k = cfg.num_warpgroups
  if k > 1:
    scratch += [plgpu.SMEM((2, 2, k, bm), _F32),
                plgpu.Barrier(num_arrivals=k, num_barriers=2), plgpu.Barrier(num_arrivals=k)]
  if cfg.warp_specialized:
    scratch.append(plgpu.Barrier(num_arrivals=k, num_barriers=stages))
  body = functools.partial(
      _stage1_kernel, m=m, n=n, scale_offset=float(scale_offset),
      subtract_mean=subtract_mean, has_scale=has_scale, has_bias=has_bias,
      has_dh=dh is not None, has_dres=has_dres,
      cast=None if cast is None else tuple(jnp.dtype(d) for d in cast), block_m=bm,
      block_w=bw, num_stages=stages, num_programs=g, num_warpgroups=k,
      warp_rows=cfg.warp_rows, warp_specialized=cfg.warp_specialized, interpret=interpret)
  inputs = [a for a in (dy, x, dh, scale, mean if subtract_mean else None, rstd)
            if a is not None]
  dx, *parts = _kernel(body, out, scratch, grid=(g,), interpret=interpret,
                       name="pallas_norm_mgpu_bwd",
                       num_threads=k + int(cfg.warp_specialized))(*inputs)
  dres = parts.pop(0) if has_dres else None
  if (m_out, n_out) != (m, n):
    dx = dx[:m, :n]
    dres = None if dres is None else dres[:m, :n]
  dtypes = [dt for dt, has in ((scale_dtype, has_scale), (bias_dtype, has_bias)) if has]
  sums = _reduce_partials(parts, dtypes, n, interpret) if parts else []
  dscale = sums.pop(0) if has_scale else None
  dbias = sums.pop(0) if has_bias else None
  return result(dx, dres, dscale, dbias)
