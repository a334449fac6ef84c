"""Pallas Mosaic GPU forward kernel (Hopper, sm_90) for RMSNorm and LayerNorm.

Status (2026-11-24, issue #29; docs/mosaic.md): runs through JAX's Mosaic GPU
interpreter (tests/test_mosaic_forward.py) and is the forward of ``backend="mosaic"``
in ``ops``, with ``kernels/mosaic_backward.py`` as its backward.

Math, per row (N the row length), as ``forward.py`` computes it (cast="torch"):

    LayerNorm: mean = sum(x) / N;  var = sum((x - mean)**2) / N   (two passes over the
               row, from shared memory: never E[x^2] - E[x]^2)
    RMSNorm:   mean = 0;           var = sum(x**2) / N
    rstd = rsqrt(var + eps);  y = (x - mean) * rstd * (scale_offset + scale) + bias

The row sums are one warpgroup's reductions, in another order than the Triton lowering's,
so y agrees with the Pallas backend to about 1 ulp, not bitwise.

``pallas_norm_mgpu_fwd`` (``plgpu.kernel``, grid (G,), one warpgroup a program): program
r is persistent over row blocks r, r + G, ... (G about the SM count), TileGym's
static_persistent. A row block of ``block_m`` rows (a multiple of 4: its mean/rstd, 16
bytes, leave by one aligned TMA store) arrives in shared memory by TMA as ``N / block_w``
[block_m, block_w] chunks into one of ``num_stages`` slots, each with an mbarrier: the
next ``num_stages - 1`` row blocks are in flight while one is computed. scale and bias
are copied to shared memory once a program. The statistics are computed from the slot
(LayerNorm: two passes), then y chunk by chunk into a shared-memory staging tile that TMA
stores to HBM (in flight while the next block is computed), and mean/rstd through a
[block_m] staging vector each. TMA zero-fills rows past M on load and drops them on store.

Several warpgroups a program (``MosaicForwardConfig.num_warpgroups``): each loads,
normalises and stores its own N / k columns of every row block, and the partial row
sums meet in shared memory behind an mbarrier of k arrivals, summed in warpgroup order.
They need ``warp_rows`` (each warp holds whole rows, so a row sum never goes through
Mosaic GPU's reduction scratch, one buffer for all warpgroups of a program: with rows
spread over the warpgroup, two warpgroups raced on it and gave wrong statistics on an
H100, 2026-11-26). The default takes two where two programs do not fit a SM (N = 8192
in bf16). Tested through the interpreter (2 warpgroups; 4 would need more CPU cores
than CI's 2, since the interpreter runs each in a thread), and compiled on the GPU
(``tests/test_mosaic_forward.py::test_gpu_matches_pallas``).

Warp specialisation (``MosaicForwardConfig.warp_specialized``): one more warpgroup, the
producer, issues every TMA load and refills a slot once the consumers release it (an
mbarrier a slot); y has a staging tile of its own. Correct through the interpreter and
on an H200, and slower or equal there (docs/mosaic.md#warp-specialized): no default
takes it.

Constraints (``NotImplementedError`` before any kernel runs): N a multiple of 128 (whole
chunks, so that no padding column enters LayerNorm's variance); the shared memory of one
program (``mosaic_backward._SMEM_BYTES``: N up to 8192 in bf16 with one stage; with a
residual, its slots and h's staging tile count too: N up to 4096 in bf16); FP8 x and
the tensor-parallel statistics pass are not implemented for this backend (``ops``
refuses them). ``cast="llama"`` (2026-11-26): x_hat rounded to x's dtype before the
weight, the product to y's (the promotion of x's and the parameters'), y in a tile of
its own where that is not x's dtype.

The fused residual add (``residual=``, issue #26's, 2026-11-26): the residual's chunks
arrive by TMA into slots of their own beside x's (one mbarrier for both), every read of
x is h = x + residual summed in float32 (y from that sum, as the Pallas backend), and h
leaves through a staging tile of its own in ``residual_dtype``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_norm.config import DeviceInfo, cdiv, device_info
from pallas_norm.kernels._compat import out_struct
from pallas_norm.kernels.forward import _round, llama_dtype
from pallas_norm.kernels.mosaic_backward import (_SMEM_BYTES, _STATS_ALIGN, _rem,
                                                 _WARPGROUP, _exchange_row_sums,
                                                 _Layouts, _kernel, _my_chunks, _sum,
                                                 _vec, _warp_specialized)

__all__ = ["MosaicForwardConfig", "forward_config", "checked_config", "norm_forward"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
  """Launch config of the Mosaic GPU forward.

  Attributes:
    block_m: rows a row block, a multiple of 4 up to 32.
    block_w: columns of one TMA chunk (128 or 256; divides N).
    num_stages: shared-memory slots of the load pipeline (>= 1; >= 2 with y_in_place).
    num_programs: G, the persistent grid (1 to 1024: several programs a SM where their
      shared memory fits).
    y_in_place: y is staged for its TMA store in the x slot it was computed from, not
      in a tile of its own (a row block less of shared memory a program, so that two
      programs fit a SM); a slot is then refilled one step later, once its store has
      read it: num_stages - 1 row blocks ahead.
    num_warpgroups: k warpgroups a program (1, 2 or 4), each with its own N / k
      columns (whole chunks: k divides N / block_w); the row sums are exchanged through
      shared memory. More warps a SM for the same shared memory. k > 1 needs
      ``warp_rows``.
    warp_rows: each warp holds whole rows of a chunk (row sums within a warp, by
      shuffles) instead of each row spread over the warpgroup (row sums through Mosaic
      GPU's shared-memory reduction scratch, which is one buffer a program: several
      warpgroups would race on it).
    warp_specialized: one more warpgroup a program, the producer, issues every TMA
      load; the num_warpgroups consumers compute and store, and release each slot
      through an mbarrier. Needs a y tile of its own (not y_in_place).
  """

  block_m: int
  block_w: int
  num_stages: int
  num_programs: int
  y_in_place: bool = False
  num_warpgroups: int = 1
  warp_rows: bool = False
  warp_specialized: bool = False

  def __post_init__(self):
    if self.block_m % _STATS_ALIGN or not _STATS_ALIGN <= self.block_m <= 32:
      raise ValueError(f"{self.block_m=} must be a multiple of {_STATS_ALIGN} up to 32")
    if self.block_w not in (128, 256):
      raise ValueError(f"{self.block_w=} must be 128 or 256")
    if self.num_stages < 1 + int(self.y_in_place):
      raise ValueError(f"{self.num_stages=} must be >= {1 + int(self.y_in_place)} "
                       f"({self.y_in_place=})")
    if not 1 <= self.num_programs <= _MAX_PROGRAMS:
      raise ValueError(f"{self.num_programs=} must be in [1, {_MAX_PROGRAMS}]")
    if self.num_warpgroups not in (1, 2, 4):
      raise ValueError(f"{self.num_warpgroups=} must be 1, 2 or 4")
    if self.warp_specialized and self.y_in_place:
      raise ValueError("warp_specialized needs y_in_place=False (the consumers release "
                       "a slot once they have read it)")
    if self.num_warpgroups > 1 and not self.warp_rows:
      raise ValueError(f"{self.num_warpgroups=} needs warp_rows=True (Mosaic GPU's "
                       "reduction scratch is shared by the warpgroups of a program)")


_MAX_PROGRAMS = 1024


def _smem_bytes(n, block_m, num_stages, x_bytes, y_bytes, param_bytes,
                y_in_place=False, r_bytes=0, h_bytes=0) -> int:
  """x slots, the y staging tile (none in place), scale and bias, the mean/rstd
  staging vectors; with a residual (``r_bytes``), its slots and the h staging tile."""
  return (num_stages * block_m * n * (x_bytes + r_bytes)
          + (0 if y_in_place else block_m * n * y_bytes) + block_m * n * h_bytes
          + n * param_bytes + 2 * 4 * block_m)


# Shared memory one program may take for two to fit a SM (H100 / H200: 228 KB a SM, 1 KB
# reserved a block, and headroom for the barriers and the reduction scratch Mosaic GPU
# allocates itself).
_SMEM_TWO_A_SM = 108 * 1024
_SMEM_THREE_A_SM = 72 * 1024  # the same for three


def forward_config(m: int, n: int, dtype, subtract_mean: bool = False,
                   device: DeviceInfo | None = None, param_bytes: int = 8,
                   residual_bytes: tuple[int, int] = (0, 0),
                   y_bytes: int | None = None) -> MosaicForwardConfig:
  """The default launch config for x [M, N] of ``dtype`` (``param_bytes``: scale's and
  bias's bytes an element together; float32 both by default; ``residual_bytes``: the
  residual's and h's bytes an element with ``residual=``, their shared memory counted
  as the rules below count x's and y's; not measured with a residual; ``y_bytes``: y's,
  where not x's (cast="llama" with float32 parameters): y then has a tile of its own,
  the most stages that fit two programs a SM, else one; not measured).

  4-row blocks, y staged in place, whole rows a warp (``warp_rows``), and the most
  stages (3 or 2) with which two programs fit a SM, at G = 3 x the SM count where three
  fit (N = 2048 in bf16), else 2 x (at most the row blocks). Where two do not fit (N =
  8192 in bf16), one program a SM with two warpgroups (2 stages), else one stage with a
  y tile of its own. Measured (bf16, float32 scale/bias, benchmarks/mosaic_sweep.py at fd31e12):
  against the first default (one program a SM, rows over the warpgroup, 3 stages, a y
  tile), H100 RMSNorm 8192x4096 55.8 -> 53.2 us, LayerNorm 8192x4096 60.6 -> 55.8,
  LayerNorm 8192x2048 32.0 -> 27.1, LayerNorm 4096x8192 75.6 -> 64.3 (2026-11-25,
  h100_2026-11-25_mosaic_sweep.txt); then two warpgroups at 4096x8192: LayerNorm 64.7
  -> 54.3 (H100), 46.7 (H200); whole rows a warp: H200 LayerNorm 8192x4096 40.6 ->
  39.3, H100 55.8 -> 56.1 (a tie); three programs a SM at N = 2048: H200 LayerNorm
  24.2 -> 20.8, H100 27.4 -> 26.7, RMSNorm 25.9 -> 25.1 (2026-11-26,
  h100_2026-11-26_mosaic_sweep_wr_af3a940.txt, h200_2026-11-26_mosaic_sweep_ws_f16e2c6.txt).
  ``subtract_mean`` is accepted for tuning to come."""
  del subtract_mean
  device = device or device_info()
  b = jnp.dtype(dtype).itemsize
  block_w = 256 if n % 256 == 0 else 128
  row_blocks = cdiv(max(m, 1), _STATS_ALIGN)
  rb, hb = residual_bytes
  if y_bytes is not None and y_bytes != b:  # y cannot be staged in x's slot
    for stages in (3, 2, 1):
      need = _smem_bytes(n, _STATS_ALIGN, stages, b, y_bytes, param_bytes, False, rb, hb)
      if need <= _SMEM_TWO_A_SM or stages == 1:
        per_sm = 2 if need <= _SMEM_TWO_A_SM else 1
        return MosaicForwardConfig(_STATS_ALIGN, block_w, stages,
                                   max(1, min(per_sm * device.num_sms, row_blocks)),
                                   warp_rows=True)
  for stages in (3, 2):
    need = _smem_bytes(n, _STATS_ALIGN, stages, b, b, param_bytes, True, rb, hb)
    if need <= _SMEM_TWO_A_SM:
      per_sm = 3 if need <= _SMEM_THREE_A_SM else 2
      g = max(1, min(per_sm * device.num_sms, row_blocks))
      return MosaicForwardConfig(_STATS_ALIGN, block_w, stages, g, y_in_place=True,
                                 warp_rows=True)
  g = max(1, min(2 * device.num_sms, row_blocks))
  if _smem_bytes(n, _STATS_ALIGN, 2, b, b, param_bytes, True, rb, hb) <= _SMEM_BYTES:
    k = 2 if (n // block_w) % 2 == 0 else 1
    return MosaicForwardConfig(_STATS_ALIGN, block_w, 2,
                               max(1, min(device.num_sms, row_blocks)), y_in_place=True,
                               num_warpgroups=k, warp_rows=True)
  return MosaicForwardConfig(_STATS_ALIGN, block_w, 1, g, warp_rows=True)


def _fwd_kernel(*refs, m, n, eps, scale_offset, subtract_mean, has_scale, has_bias, stats,
                has_residual, llama_x_dtype, block_m, block_w, num_stages, num_programs,
                y_in_place, num_warpgroups, warp_rows, warp_specialized, interpret):
  """Program r: row blocks r, r + G, ... of y (and mean/rstd). With k warpgroups, each
  loads, normalises and stores its own N / k columns of every row block, and the row
  sums are exchanged through shared memory (summed in warpgroup order: every warpgroup
  gets the same bits). ``warp_specialized``: one more warpgroup, the producer, issues
  every TMA load (scale/bias, then each row block into a slot once the k consumers have
  released it through the slot's ``free`` barrier); the consumers only compute and
  store. ``has_residual``: x's tiles are h = x + residual (float32 sums of the x and
  residual slots), and h is also written, through a staging tile of its own.
  ``llama_x_dtype`` (cast="llama", HF LlamaRMSNorm): x_hat is rounded to that dtype (x's)
  before the weight multiplies it, and the product to y's before the bias is added."""
  refs = list(refs)
  x_ref = refs.pop(0)
  res_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  y_ref = refs.pop(0)
  h_ref = refs.pop(0) if has_residual else None
  mean_ref = refs.pop(0) if stats and subtract_mean else None
  rstd_ref = refs.pop(0) if stats else None
  xs = refs.pop(0)  # [S, C, block_m, W] x's dtype
  res_s = refs.pop(0) if has_residual else None  # [S, C, block_m, W] residual's dtype
  ys = None if y_in_place else refs.pop(0)  # [C, block_m, W] y's dtype
  hs = refs.pop(0) if has_residual else None  # [C, block_m, W] h's dtype
  ws = refs.pop(0) if has_scale else None  # [C, W] scale's dtype
  bs = refs.pop(0) if has_bias else None  # [C, W] bias's dtype
  ms = refs.pop(0) if mean_ref is not None else None  # [block_m] f32 staging
  rs = refs.pop(0) if rstd_ref is not None else None
  bar = refs.pop(0)  # [S]
  pbar = refs.pop(0) if has_scale or has_bias else None
  k = num_warpgroups
  red = refs.pop(0) if k > 1 else None  # [2, 1, k, block_m] f32: the row-sum exchange
  xbar = refs.pop(0) if k > 1 else None  # [2], k arrivals
  free = refs.pop(0) if warp_specialized else None  # [S], k arrivals: a slot released
  assert not refs

  num_chunks = n // block_w
  lay = _Layouts(_vec(block_w, x_ref.dtype.itemsize, warp_rows), interpret, warp_rows)
  r = lax.axis_index("g")
  wg, mine = _my_chunks(k, num_chunks)
  if warp_specialized:  # the producer is warpgroup k
    wg = lax.axis_index("wg")
  num_steps = (cdiv(m, block_m) - 1 - r) // num_programs + 1

  def chunk(c):
    return pl.ds(c * block_w, block_w)

  def fetch(step, slot, chunks):  # chunks of row block r + step * G into slot
    rows = pl.ds((r + step * num_programs) * block_m, block_m)
    for c in chunks:
      plgpu.copy_gmem_to_smem(x_ref.at[rows, chunk(c)], xs.at[slot, c], bar.at[slot])
      if has_residual:
        plgpu.copy_gmem_to_smem(res_ref.at[rows, chunk(c)], res_s.at[slot, c],
                                bar.at[slot])

  def fetch_params(chunks):
    for c in chunks:
      if has_scale:
        plgpu.copy_gmem_to_smem(scale_ref.at[chunk(c)], ws.at[c], pbar)
      if has_bias:
        plgpu.copy_gmem_to_smem(bias_ref.at[chunk(c)], bs.at[c], pbar)

  def x_of(slot, c):  # [block_m, W] f32: x, or h = x + residual summed in float32
    x = lay.cast(xs[slot, c], lay.tile).astype(_F32)
    if has_residual:
      x = x + lay.cast(res_s[slot, c], lay.tile).astype(_F32)
    return x

  exchanges = 2 if subtract_mean else 1  # row sums a step

  def row_total(part, step, i):
    """[block_m] sums of this warpgroup's columns -> the whole rows' (exchange i of
    the step, through buffer (step * exchanges + i) % 2: a warpgroup can write a buffer
    again only after every warpgroup has passed the next exchange, so after it read)."""
    if k == 1:
      return part
    return _exchange_row_sums([part], red, xbar, _rem(step * exchanges + i, 2), wg, k,
                              lay)[0]

  def body(step, carry):
    slot = _rem(step, num_stages)
    rb = r + step * num_programs
    plgpu.barrier_wait(bar.at[slot])
    mean = None
    if subtract_mean:
      mean = row_total(jnp.sum(_sum([x_of(slot, c) for c in mine]), axis=1), step, 0) / n
      d2 = []
      for c in mine:
        d = x_of(slot, c) - lay.rows(mean, block_w)
        d2.append(d * d)
      var = row_total(jnp.sum(_sum(d2), axis=1), step, 1) / n  # [block_m] f32
    else:
      sq = []
      for c in mine:
        x = x_of(slot, c)
        sq.append(x * x)
      var = row_total(jnp.sum(_sum(sq), axis=1), step, 0) / n
    rstd = lax.rsqrt(var + _F32(eps))  # [block_m] f32
    # the previous row block's y and statistics have left the staging buffers
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if y_in_place:  # its slot is free: refill it, num_stages - 1 row blocks ahead
      @pl.when(jnp.logical_and(step >= 1, step - 1 + num_stages < num_steps))
      def _():
        fetch(step - 1 + num_stages, _rem(step - 1 + num_stages, num_stages), mine)
    out_tile = xs.at[slot] if y_in_place else ys
    for c in mine:
      x = x_of(slot, c)
      if hs is not None:
        hs[c] = x.astype(hs.dtype)
      if mean is not None:
        x = x - lay.rows(mean, block_w)
      y = x * lay.rows(rstd, block_w)
      if llama_x_dtype is not None:
        y = _round(y, llama_x_dtype)
      if has_scale:
        w = lay.cast(ws[c], lay.col).astype(_F32)
        y = y * lay.cols(w + _F32(scale_offset) if scale_offset else w, block_m)
        if llama_x_dtype is not None:
          y = _round(y, out_tile.dtype)
      if has_bias:
        y = y + lay.cols(lay.cast(bs[c], lay.col).astype(_F32), block_m)
      out_tile[c] = y.astype(out_tile.dtype)
    if free is not None:  # x's slot has been read: the producer may refill it
      plgpu.barrier_arrive(free.at[slot])
    first = wg == 0  # the statistics leave from warpgroup 0
    if rs is not None:
      @pl.when(first)
      def _():
        rs[...] = rstd
    if ms is not None:
      @pl.when(first)
      def _():
        ms[...] = mean
    plgpu.commit_smem()
    rows = pl.ds(rb * block_m, block_m)
    for c in mine:
      plgpu.copy_smem_to_gmem(out_tile.at[c], y_ref.at[rows, chunk(c)])
      if hs is not None:
        plgpu.copy_smem_to_gmem(hs.at[c], h_ref.at[rows, chunk(c)])

    @pl.when(first)
    def _():
      if rs is not None:
        plgpu.copy_smem_to_gmem(rs, rstd_ref.at[rows])
      if ms is not None:
        plgpu.copy_smem_to_gmem(ms, mean_ref.at[rows])
    plgpu.commit_smem_to_gmem_group()

    if not y_in_place and free is None:
      # refill this slot with the row block num_stages ahead (its reads are done: the
      # copy waits for the warpgroup)
      @pl.when(step + num_stages < num_steps)
      def _():
        fetch(step + num_stages, slot, mine)

    return carry

  def consume():
    if pbar is not None:
      plgpu.barrier_wait(pbar)
    lax.fori_loop(0, num_steps, body, 0)
    plgpu.wait_smem_to_gmem(0)

  if free is None:
    if pbar is not None:  # scale and bias, once a program
      fetch_params(mine)
    for s in range(num_stages):  # prologue: the first num_stages row blocks
      @pl.when(s < num_steps)
      def _():
        fetch(s, s, mine)
    consume()
    return

  _warp_specialized(wg, k, num_steps, num_stages, free,
                    lambda step, slot: fetch(step, slot, range(num_chunks)), consume,
                    prologue=(lambda: fetch_params(range(num_chunks))) if pbar is not None
                    else None)


def _check(m, n, dtypes, cfg: MosaicForwardConfig, residual_bytes=(0, 0), y_bytes=None):
  """NotImplementedError / ValueError for what this backend cannot run."""
  if n % _WARPGROUP:
    raise NotImplementedError(
        f"backend='mosaic' forward: N={n} must be a multiple of {_WARPGROUP} (whole "
        f"TMA chunks); use backend='pallas'")
  if n % cfg.block_w:
    raise ValueError(f"config.block_w={cfg.block_w} must divide N={n}")
  if (n // cfg.block_w) % cfg.num_warpgroups:
    raise ValueError(f"config.num_warpgroups={cfg.num_warpgroups} must divide the "
                     f"{n // cfg.block_w} chunks of {cfg.block_w} columns (N={n})")
  x_b, *rest = (jnp.dtype(dt).itemsize for dt in dtypes)
  if cfg.y_in_place and y_bytes not in (None, x_b):
    raise ValueError("config.y_in_place needs y in x's dtype (cast='llama' with wider "
                     "parameters writes y in their dtype)")
  need = _smem_bytes(n, cfg.block_m, cfg.num_stages, x_b, y_bytes or x_b, sum(rest),
                     cfg.y_in_place, *residual_bytes)
  if need > _SMEM_BYTES:
    raise NotImplementedError(
        f"backend='mosaic' forward: one program needs {need} bytes of shared memory > "
        f"{_SMEM_BYTES} (N={n}, block_m={cfg.block_m}, num_stages={cfg.num_stages}); "
        f"use backend='pallas'")


def checked_config(m: int, n: int, x_dtype, param_dtypes, subtract_mean: bool,
                   config=None, residual_dtypes=None, y_dtype=None) -> MosaicForwardConfig:
  """``config`` if a MosaicForwardConfig, else ``forward_config``'s, checked against
  x [M, N] of ``x_dtype``, scale/bias of ``param_dtypes``, with a residual
  ``residual_dtypes`` (the residual's, h's), and y of ``y_dtype`` (None: x's)
  (NotImplementedError / ValueError, as ``norm_forward`` raises them). ``ops`` asks it
  whether this backend serves a call."""
  rb = (0, 0) if residual_dtypes is None else tuple(
      jnp.dtype(d).itemsize for d in residual_dtypes)
  yb = None if y_dtype is None else jnp.dtype(y_dtype).itemsize
  cfg = config if isinstance(config, MosaicForwardConfig) else forward_config(
      m, n, x_dtype, subtract_mean,
      param_bytes=sum(jnp.dtype(d).itemsize for d in param_dtypes), residual_bytes=rb,
      y_bytes=yb)
  _check(m, n, [x_dtype, *param_dtypes], cfg, rb, yb)
  return cfg


def norm_forward(x, scale, bias, *, eps: float, scale_offset: float, subtract_mean: bool,
                 config=None, interpret: bool, return_residuals: bool = True,
                 residual=None, residual_dtype=None, cast: str = "torch"):
  """RMSNorm / LayerNorm forward on Pallas Mosaic GPU; ``forward.norm_forward``'s
  contract without FP8 x.

  Args:
    x: [M, N] float32, bfloat16 or float16, N a multiple of 128.
    scale, bias: [N] or None.
    eps, scale_offset, subtract_mean: as in ``forward.norm_forward``.
    config: a MosaicForwardConfig; anything else (``ops`` passes the other backends'
      configs) is ignored and ``forward_config`` picks one.
    interpret: run through JAX's Mosaic GPU interpreter.
    return_residuals: also return mean (LayerNorm) and rstd.
    residual: None, or [M, N] float (rows of a multiple of 16 bytes): the kernel
      normalises h = x + residual (summed in float32; y from the float32 sum) and also
      writes h, in ``residual_dtype`` (default: residual's dtype).
    cast: "torch" (y rounded once, in x's dtype) or "llama" (HF LlamaRMSNorm: x_hat
      rounded to x's dtype, times the weight in the promotion of x's and the
      parameters' dtypes, which is y's dtype: ``forward.llama_dtype``).

  Returns:
    (y [M, N] x's dtype (cast="llama": ``forward.llama_dtype``), mean [M] f32 or None,
    rstd [M] f32 or None), and h [M, N] last with a residual.

  Raises:
    NotImplementedError: N not a multiple of 128; shared memory beyond one program.
    ValueError: a config whose block_w does not divide N.
  """
  m, n = x.shape
  if cast not in ("torch", "llama"):
    raise ValueError(f"{cast=} must be 'torch' or 'llama' (gemma is torch with "
                     "scale_offset=1, ops.py)")
  y_dtype = llama_dtype(x, scale, bias) if cast == "llama" else x.dtype
  h_dtype = None
  if residual is not None:
    if residual.shape != x.shape:
      raise ValueError(f"residual.shape={residual.shape} must be x's {x.shape}")
    h_dtype = jnp.dtype(residual_dtype or residual.dtype)
  cfg = checked_config(m, n, x.dtype, [p.dtype for p in (scale, bias) if p is not None],
                       subtract_mean, config,
                       None if residual is None else (residual.dtype, h_dtype),
                       None if y_dtype == x.dtype else y_dtype)
  want_mean = return_residuals and subtract_mean
  if m == 0:
    out = (jnp.zeros(x.shape, y_dtype), jnp.zeros((0,), _F32) if want_mean else None,
           jnp.zeros((0,), _F32) if return_residuals else None)
    return out if residual is None else (*out, jnp.zeros(x.shape, h_dtype))
  bm, bw, stages = cfg.block_m, cfg.block_w, cfg.num_stages
  num_row_blocks = cdiv(m, bm)
  g = max(1, min(cfg.num_programs, num_row_blocks))
  num_chunks = n // bw
  # The interpreter raises on TMA stores past M (the GPU drops them): y has whole row
  # blocks there, sliced after. mean/rstd always do: on the H200 a [block_m] TMA store
  # that runs past a ragged M wrote nothing or garbage into its in-bounds elements
  # (M = 9, 10, 21, 37, 333; 2026-11-24, benchmarks/results/
  # h200_2026-11-24_gpu-check_mosaic_c869e50.log), unlike the 2-D stores of y.
  m_out = num_row_blocks * bm if interpret else m
  m_stats = num_row_blocks * bm
  out = [out_struct((m_out, n), y_dtype, x)]
  if residual is not None:
    out.append(out_struct((m_out, n), h_dtype, x))
  if want_mean:
    out.append(out_struct((m_stats,), _F32, x))
  if return_residuals:
    out.append(out_struct((m_stats,), _F32, x))
  scratch = [plgpu.SMEM((stages, num_chunks, bm, bw), x.dtype)]
  if residual is not None:
    scratch.append(plgpu.SMEM((stages, num_chunks, bm, bw), residual.dtype))
  if not cfg.y_in_place:
    scratch.append(plgpu.SMEM((num_chunks, bm, bw), y_dtype))
  if residual is not None:
    scratch.append(plgpu.SMEM((num_chunks, bm, bw), h_dtype))
  scratch += [plgpu.SMEM((num_chunks, bw), p.dtype) for p in (scale, bias) if p is not None]
  scratch += [plgpu.SMEM((bm,), _F32)] * (int(want_mean) + int(return_residuals))
  scratch.append(plgpu.Barrier(num_arrivals=num_chunks * (1 + int(residual is not None)),
                               num_barriers=stages))
  num_params = int(scale is not None) + int(bias is not None)
  if num_params:
    scratch.append(plgpu.Barrier(num_arrivals=num_params * num_chunks))
  k = cfg.num_warpgroups
  if k > 1:
    scratch += [plgpu.SMEM((2, 1, k, bm), _F32),
                plgpu.Barrier(num_arrivals=k, num_barriers=2)]
  if cfg.warp_specialized:
    scratch.append(plgpu.Barrier(num_arrivals=k, num_barriers=stages))
  body = functools.partial(
      _fwd_kernel, m=m, n=n, eps=float(eps), scale_offset=float(scale_offset),
      subtract_mean=subtract_mean, has_scale=scale is not None, has_bias=bias is not None,
      stats=return_residuals, has_residual=residual is not None,
      llama_x_dtype=x.dtype if cast == "llama" else None, block_m=bm, block_w=bw,
      num_stages=stages, num_programs=g,
      y_in_place=cfg.y_in_place, num_warpgroups=k, warp_rows=cfg.warp_rows,
      warp_specialized=cfg.warp_specialized, interpret=interpret)
  inputs = [a for a in (x, residual, scale, bias) if a is not None]
  outs = list(_kernel(body, out, scratch, grid=(g,), interpret=interpret,
                      name="pallas_norm_mgpu_fwd",
                      num_threads=k + int(cfg.warp_specialized))(*inputs))
  outs = [o[:m] if o.shape[0] != m else o for o in outs]
  y = outs.pop(0)
  h = outs.pop(0) if residual is not None else None
  mean = outs.pop(0) if want_mean else None
  rstd = outs.pop(0) if return_residuals else None
  return (y, mean, rstd) if residual is None else (y, mean, rstd, h)
