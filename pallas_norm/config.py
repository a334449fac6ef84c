"""Launch configs (frozen dataclasses) and the mode heuristic, per device.

One heuristic serves both backends (``"pallas"`` and ``"triton"``): they run the same
algorithms with the same block shapes. A config the caller passes to a launcher always
wins; these functions only build the default.

Terms (TileGym / Triton names):
  row block   ``block_m`` consecutive rows handled together by one program.
  block_n     columns per tile. When ``block_n >= N`` the whole row is one tile
              ("single tile"); otherwise the row is walked in ``block_n`` chunks.
  programs    grid size. For ``multi_wave_*`` it is ``cdiv(M, block_m)``; for
              ``static_persistent`` and the backward it is about the SM count times
              an occupancy factor, and each program loops over row blocks with a
              grid stride.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

__all__ = [
    "MODES",
    "DeviceInfo",
    "ForwardConfig",
    "BackwardConfig",
    "device_info",
    "choose_mode",
    "forward_config",
    "backward_config",
    "cached_max_block_n",
    "reduce_config",
    "split_resident_programs",
]

MODES = ("multi_wave_reload", "multi_wave_cached", "static_persistent")


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the heuristics need to know about the device."""

  platform: str  # "gpu" or "cpu" (interpret mode)
  name: str
  num_sms: int  # streaming multiprocessors; a small stand-in on CPU


@functools.lru_cache(maxsize=None)
def _device_info_cached(platform: str, name: str, core_count: int | None) -> DeviceInfo:
  if platform == "gpu" and core_count:
    return DeviceInfo(platform, name, int(core_count))
  # Interpret mode on CPU runs programs one after another: few, fat programs are
  # fastest, and the persistent/grid-stride paths still see several programs.
  return DeviceInfo("cpu", name, 4)


def device_info(device: jax.Device | None = None) -> DeviceInfo:
  """DeviceInfo of ``device`` (default: the first JAX device)."""
  d = device if device is not None else jax.devices()[0]
  return _device_info_cached(d.platform, d.device_kind, getattr(d, "core_count", None))


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Launch config of one forward kernel.

  Attributes:
    mode: one of ``MODES``.
    block_m: rows per row block (power of 2).
    block_n: columns per tile (power of 2). ``multi_wave_cached`` needs
      ``block_n >= N``; the other modes chunk the row when ``block_n < N``.
    num_warps: warps per program.
    num_programs: grid size for ``static_persistent`` (ignored by the others).
    num_stages: software-pipelining depth of the kernel's loops (Triton's num_stages).
    chunk_n: for ``multi_wave_cached`` with ``block_n < N`` (a row split over
      programs), the columns of one load: each program holds its split as
      ``block_n / chunk_n`` [block_m, chunk_n] tiles (power of 2; 0 means one tile).
      Ignored by the other modes.
    split_rows: for ``static_persistent`` with ``block_n < N``, split each row over
      cdiv(N, block_n) programs that exchange their partial statistics (x read from
      HBM once; reloaded from L2) instead of walking the row in chunks.
      ``num_programs`` is then the number of row-block groups G; the grid is
      G x cdiv(N, block_n) and needs cdiv(N, block_n) <= SMs x
      ``split_resident_programs(num_warps)``. Pallas backend only.
    split_lag: with ``split_rows``, how many row blocks ahead of its normalisation a
      program publishes a row block's partial statistics (>= 0).
    split_early_publish: with ``split_rows`` and ``split_lag >= 1``, a program issues
      the loads of the row block it publishes before it normalises the one ``split_lag``
      behind, and reduces them after: those HBM loads are in flight across the wait
      on the other splits, held in registers.
  """

  mode: str
  block_m: int
  block_n: int
  num_warps: int
  num_programs: int = 0
  num_stages: int = 1
  chunk_n: int = 0
  split_rows: bool = False
  split_lag: int = 2
  split_early_publish: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"{self.mode=} must be one of {MODES}")
    for f in ("block_m", "block_n"):
      v = getattr(self, f)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{f}={v} must be a positive power of 2")
    if self.chunk_n < 0 or self.chunk_n & (self.chunk_n - 1):
      raise ValueError(f"{self.chunk_n=} must be 0 or a positive power of 2")
    if self.num_warps not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"{self.num_warps=} must be a power of 2 in [1, 32]")
    if self.split_rows and self.mode != "static_persistent":
      raise ValueError(f"split_rows is a static_persistent option, not {self.mode}'s")
    _check_split_lag(self)


def _check_split_lag(cfg):
  if cfg.split_lag < 0:
    raise ValueError(f"{cfg.split_lag=} must be >= 0")
  if cfg.split_early_publish and not (cfg.split_rows and cfg.split_lag >= 1):
    raise ValueError(f"split_early_publish needs split_rows and split_lag >= 1 (got "
                     f"{cfg.split_rows=}, {cfg.split_lag=})")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Launch config of the two-stage backward.

  Attributes:
    block_m: rows per row block in stage 1 (power of 2).
    block_n: columns per tile in stage 1 (power of 2); the row is chunked when
      ``block_n < N``.
    num_warps: warps per stage-1 program.
    num_programs: G, the stage-1 grid; the dscale/dbias partials are [G, N] f32.
    reduce_block_n: columns per stage-2 program (power of 2).
    reduce_block_g: partial rows summed per stage-2 step (power of 2).
    reduce_num_warps: warps per stage-2 program.
    num_stages: software-pipelining depth of the stage-1 loops (Triton's num_stages;
      the split-row kernel schedules its own loads and ignores it).
    split_rows: with ``block_n < N``, split each row over cdiv(N, block_n) programs
      that exchange their partial row sums (x and dy read from HBM once) instead of the
      row-statistics + column-tiled pair (x and dy read twice). ``num_programs`` is
      then the number of row-block groups G; the grid is G x cdiv(N, block_n) and
      needs cdiv(N, block_n) <= SMs x ``split_resident_programs(num_warps)``.
    split_lag: with ``split_rows``, how many row blocks ahead of its dx a program
      publishes a row block's partial sums (>= 0); dx reloads x and dy, from L2.
    split_early_publish: with ``split_rows`` and ``split_lag >= 1``, a program issues
      the loads of the row block it publishes before the dx of the one ``split_lag``
      behind, and reduces them after: those HBM loads are in flight across the wait
      on the other splits, held in registers.
    reload_rows: with ``block_n < N``, one program walks whole rows: pass 1 reads x and
      dy chunk by chunk for the row sums, pass 2 reloads them (from L2) for dx, and the
      partials of all cdiv(N, block_n) chunks stay in registers (the chunk loop is
      unrolled). x and dy are read from HBM once, with no exchange between programs.
    chunk_n: with ``split_rows``, each program loads, reduces and writes its split as
      ``block_n / chunk_n`` [block_m, chunk_n] tiles (power of 2; 0 means one tile).
      Ignored otherwise.
    pieces: for a row that fits one tile (``block_n >= N``), the tile as column pieces
      of these widths side by side from column 0 (decreasing powers of 2 summing to at
      most block_n and covering N), e.g. (4096, 1024) for N = 5120, so that fewer lanes
      are masked than in one 8192-wide tile. Empty: one block_n-wide tile.
  """

  block_m: int
  block_n: int
  num_warps: int
  num_programs: int
  reduce_block_n: int = 128
  reduce_block_g: int = 32
  reduce_num_warps: int = 4
  num_stages: int = 1
  split_rows: bool = False
  reload_rows: bool = False
  chunk_n: int = 0
  split_lag: int = 2
  split_early_publish: bool = False
  pieces: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "pieces", tuple(self.pieces))
    p = self.pieces
    if any(v < 1 or v & (v - 1) for v in p) or any(a <= b for a, b in zip(p, p[1:])):
      raise ValueError(f"{self.pieces=} must be decreasing powers of 2")
    if sum(p) > self.block_n:
      raise ValueError(f"{self.pieces=} must fit block_n={self.block_n}")
    if self.split_rows and self.reload_rows:
      raise ValueError("split_rows and reload_rows are exclusive: pick one long-row kernel")
    for f in ("block_m", "block_n", "reduce_block_n", "reduce_block_g"):
      v = getattr(self, f)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{f}={v} must be a positive power of 2")
    if self.chunk_n < 0 or self.chunk_n & (self.chunk_n - 1):
      raise ValueError(f"{self.chunk_n=} must be 0 or a positive power of 2")
    if self.num_programs < 1:
      raise ValueError(f"{self.num_programs=} must be >= 1")
    _check_split_lag(self)


# ---------------------------------------------------------------------------
# Thresholds. Each names the measurement behind it: H200, bf16 RMSNorm, CUPTI kernel
# time over rotated inputs, benchmarks/sweep.py, 2026-11-21 (files under
# benchmarks/results/). "ms/us" are the kernel times of the best candidates.
# ---------------------------------------------------------------------------

# Largest row (in elements, padded to a power of 2) that multi_wave_cached keeps in
# registers: 32768 f32 values over 16 warps is 64 registers a thread for x alone.
_CACHED_MAX_BLOCK_N = 32768
# Above this padded row length the heuristic leaves multi_wave_cached for
# multi_wave_reload: at 16384 x 16384, reload (block_n 8192, 16 warps) took 286 us and
# the best cached config 305 us; at N <= 8192 cached won (4096 x 8192: 36.4 us against
# 38.8 us for reload).
_HEURISTIC_CACHED_MAX = 8192
# Forward tile: about 4096 elements. 32768 x 128 ran 5.8 us at block_m 32 and 64, 5.9
# at 16; 4096 x 1024 ran 6.2 us at block_m 2 and 4.
_FWD_TILE_ELEMS = 4096
# RMSNorm forward warps: tile / 1024 clamped to [4, 8]. 4096 x 1024 (tile [4, 1024]):
# 6.4 us at 4 warps, 6.8 at 8; 8192 x 5120 / 8192^2 ([1, 8192]): 44.8 / 71.7 us at 8;
# 4096 x 4096 ([1, 4096]) 19.1 us at 4 warps, 19.0 at 8, 20.5 at 16
# (benchmarks/results/h200_2026-11-21_sweep_warps.json).
_FWD_MIN_WARPS, _FWD_MAX_WARPS = 4, 8
_FWD_ELEMS_PER_WARP = 1024
# LayerNorm forward (single tile): at least 2 rows a tile and a tile of >= 2048
# elements, with 64 f32 values a thread (warps = tile / 2048). Against RMSNorm's rule
# it saved 13% at 8192 x 5120 (50.9 against 55.6 us), 16% at 8192^2 (81.4 / 96.2),
# 14% at 4096 x 8192 (43.0 / 49.7) and 14% at 4096 x 1024 (7.0 / 8.1) (sweep_ln.json,
# before commit 9a791b9 loaded scale/bias after the statistics).
# Re-swept after 9a791b9 (benchmarks/results/h200_2026-11-21_sweep_ln2_fwd.json):
#   - rows of 8192 (padded) take one row and 8 warps (wider forced single tiles keep
#     the >= 2-row rule, which has not been re-measured): 4096 x 8192 40.4 us against
#     42.4 for [2, 8192] at 8 warps, 8192 x 5120 49.1 / 54.1, 8192^2 76.9 / 80.5
#     (best: 40.4, 48.7 at 4 warps, 76.9);
#   - rows of <= 256 take at least 2 warps: 32768 x 128 [16, 128] 6.9 us at 2 warps
#     against 7.6 at 1;
#   - the rule stays best or within 3% of the best elsewhere: 4096 x 4096 21.4 (best),
#     4096 x 1024 7.1 (best), 8192 x 4096 39.5 / 38.7, 8192 x 2048 21.2 / 20.4.
#   - rows of 4096 < N <= 5120 (padded to 8192) take 4 warps: 8192 x 5120 48.0 us
#     against 48.8 at 8 warps, H200, 2026-11-21, median of 7 alternating rounds of
#     10 calls (48.8 the slowest round at 4 warps, 48.6 the fastest at 8), where full
#     8192 rows keep 8 (8192^2 76.7 against 77.7, 4096 x 8192 40.1 / 40.6)
#     (benchmarks/results/h200_2026-11-21_ln_wide_warps.txt). 6144 is not measured.
_LN_MIN_BLOCK_M, _LN_TILE_ELEMS, _LN_ELEMS_PER_WARP = 2, 2048, 2048
# Pallas backend, re-measured 2026-11-22 (H200, benchmarks/ab_split_fwd.py, 5 rounds of
# 10 calls; results/h200_h100_2026-11-22_ln_fwd_tiles.txt; the H100 agreed: 8192 x 3072
# 37.2 against 38.3, 8192 x 2048 25.8 / 26.4, float32 ties or wins):
#   - [2, 2048] tiles take 4 warps, not 2: 8192 x 2048 20.3 us against 21.0, 4096 x 2048
#     10.5 / 10.9;
#   - rows of 2048 < N <= 3072 (padded to 4096) take one row a tile ([1, 4096], 4
#     warps), not two: 8192 x 3072 29.0-30.1 against 31.1-31.2, 4096 x 3072 16.0 / 17.1,
#     16384 x 3072 54.5 / 58.3, 8192 x 2560 25.8 / 27.1, float32 8192 x 3072 55.2 /
#     56.6. Full 4096 rows keep [2, 4096] (8192 x 4096 38.1 against 38.2 for [1, 4096]).
_LN_2048_WARPS, _LN_ONE_ROW_MAX_N, _LN_ONE_ROW_WARPS = 4, 3072, 4
_LN_WIDE_BLOCK_N, _LN_WIDE_WARPS = 8192, 8
_LN_WIDE_PADDED_MAX_N, _LN_WIDE_PADDED_WARPS = 5120, 4
_NARROW_BLOCK_N, _LN_NARROW_MIN_WARPS = 256, 2
# Reload chunk: 8192 while N <= 32768 (16384^2: 286 us against 299 at 4096), else 4096
# (4096 x 65536: 389 us against 395 at 8192; 1024 x 262144: 429 against 432), 16 warps
# (8 warps: 302 / 411 / 441 us).
_RELOAD_CHUNK_N_SMALL, _RELOAD_CHUNK_N_LARGE, _RELOAD_WARPS = 8192, 4096, 16
# Chunked rows (multi_wave_reload, chunked static_persistent; Pallas backend) of at most
# this many chunks unroll both passes at trace time; longer rows keep a loop. RMSNorm
# also sums x*x elementwise over the chunks and reduces across the row once. H200,
# 2026-11-21, bf16 forward, CUPTI over rotated inputs, median of 30 (before -> after):
# LayerNorm 4096 x 65536 (4 chunks of 16384) 413.1 -> 402.1 us, 4096 x 32768 185.5 ->
# 182.0, 16384^2 322.0 -> 320.0; RMSNorm 16384^2 285.0 -> 282.5, forced reload at
# 4096 x 32768 178.0 -> 160.4 (the elementwise sum; unrolling alone gave 176.1);
# LayerNorm 1024 x 262144 (16 chunks, not unrolled) 485.2 -> 484.8
# (benchmarks/results/h200_2026-11-21_sweep_unroll.txt).
RELOAD_UNROLL_MAX_CHUNKS = 4
# static_persistent: SMs x this many programs. At 4096 x 4096 it ran 18.8 us with 528
# programs (4 a SM) against 19.0 us with 264.
_PERSISTENT_OCCUPANCY = 4
# Rows longer than this (N > 32768) go to static_persistent with 16384-wide chunks,
# 16 warps, SMs x 4 programs, one row a program: 4096 x 65536 354.7 us against 404.1
# for multi_wave_reload (chunk 4096, 16 warps); 1024 x 262144 420.0 us against 452.4.
# 8192-wide chunks: 386-412 / 443-459 us; 32 warps: 374 / 436 us; SMs x 2 programs:
# 361.6 / 419.6 us (benchmarks/results/h200_2026-11-21_sweep_long.json).
_HEURISTIC_RELOAD_MAX = 32768
_PERSISTENT_CHUNK_N_LARGE = 16384
# Rows padded to 16384 (Pallas backend): static_persistent with the row as one
# [1, 16384] tile, scale/bias hoisted, the next row prefetched, one program a SM;
# RMSNorm for N > 12288 at 32 warps, LayerNorm for N > 8192 at 16 warps. The Pallas
# launch leaves little L1 (docs/performance.md, "The two backends"), so a multi-wave program
# re-reads its 32 KB of scale from L2 for every row; hoisted, it is read once a
# program. H200, 2026-11-22, bf16 forward with residuals, CUPTI over rotated inputs,
# median of 3 rounds of 10 (benchmarks/ab_split_fwd.py "persistent:16384,W,1";
# results/h200_2026-11-22_fwd_persistent_tile.txt), against multi_wave_reload
# (8192-wide chunks, 16 warps):
#   RMSNorm   16384^2 274.6 us (291.8; 16 warps 278.0), 4096 x 16384 71.2 (77.0),
#             16384 x 12288 211.5 (213.5, a tie: 12288 keeps the reload),
#             8192 x 10240 95.0 (90.8).
#   LayerNorm 16384^2 295.5 us at 16 warps (327.4; 32 warps 300.4), 4096 x 16384 76.9
#             (86.6), 16384 x 12288 224.1 (263.4), 8192 x 10240 99.8 (120.9).
# Not kept (same runs): the reload keeping its last chunks in registers instead of
# reloading them (RMSNorm 16384^2 280.3-285.2 us; LayerNorm with both 8192-wide
# chunks kept 309.9-313.1), [2, 8192] reload tiles (290.2-351.6 us), and LayerNorm
# 8192 x 5120 as five 1024-wide tiles instead of one 8192-wide one (47.8-49.2 us
# against 47.1; branch exp/cached-chunks).
# Rows padded to 8192 (Pallas backend), H200, 2026-11-22, same method
# (results/h200_2026-11-22_fwd_persistent_tile_8192.txt), against the multi_wave_cached
# [1, 8192] tile (8 warps RMSNorm; LayerNorm 5120: 4 warps):
#   RMSNorm   [1, 8192] at 16 warps, 2 programs a SM: 8192^2 68.3 us (70.2), 4096 x 8192
#             35.4 (35.8), 2048 x 8192 18.6 (19.3), 16384 x 8192 134.7 (136.2). It lost
#             at 8192 x 6144 (53.9 against 52.0) and 8192 x 5120 (47.6 / 44.5). 1, 3 or 4
#             a SM, 8 or 32 warps: 69.0-79.0 us at 8192^2.
#   LayerNorm [1, 8192] at 4 warps, 3 a SM, for N <= 5120: 8192 x 5120 46.1 us (46.9),
#             4096 x 5120 24.8 (25.4). It lost at 8192 x 6144 (67.1 against 58.4) and
#             8192^2 (81.0 / 75.5); 8 to 32 warps, 1 or 2 a SM: 83.1-86.0 us at 8192^2.
# Checked on another H200 the same day, against those cached tiles: RMSNorm 4096 x 8192
# 34.8 us (35.5), 8192^2 67.8 (68.8), 2048 x 8192 18.6 (19.2), 1024 x 8192 9.2 (9.6),
# 8192 x 7168 60.1 (60.8); float32 4096 x 8192 68.3 (69.9), 8192 x 7168 115.2 (118.4).
# LayerNorm 8192 x 5120 45.2 (46.4), 4096 x 5120 24.5 (25.2), 1024 x 5120 7.9 (8.2),
# 8192 x 4608 42.4 (42.3, a tie); float32 8192 x 5120 lost (97.2 against 90.9), so
# LayerNorm's rule is for 2-byte dtypes.
# On the H100 (2026-11-22, same method, 5 rounds; results/h100_2026-11-22_full_cbaf579_*
# and h100_2026-11-22_persistent_tiles.txt) RMSNorm's tiles lose to what they replaced:
# 8192^2 94.9 us against 91.6 cached, 4096 x 8192 48.1 / 47.1, 16384^2 379.7 / 365.8
# reload, 4096 x 16384 98.9 / 94.1 (in the full run RMSNorm 8192^2 forward fell to 0.97
# of tokamax); LayerNorm's 5120 tile ties or loses (8192 x 5120 61.1 / 60.2, 4096 x 5120
# 32.2 / 32.2), and its 16384 tile wins (16384^2 374.0 / 397.7, 4096 x 16384 96.9 /
# 103.7). So the first three rules are the H200's only (a device whose name has "H200");
# other GPUs keep the multi-wave modes there.
# (rows longer than, rows up to, num_warps, programs a SM, largest itemsize, the device
# name must contain this); block_n is the padded row.
_RMS_PERSISTENT_TILES = ((12288, 16384, 32, 1, 4, "H200"), (6144, 8192, 16, 2, 4, "H200"))
_LN_PERSISTENT_TILES = ((8192, 16384, 16, 1, 4, ""), (4096, 5120, 4, 3, 2, "H200"))
# RMSNorm rows longer than this (N > 16384), on the Pallas backend, go to
# multi_wave_cached split over cdiv(N, 8192) programs (each holds an 8192-wide split in
# registers at 4 warps; they exchange partial sums of squares through global memory),
# as long as that is <= the SM count (N <= 8192 x SMs). H200, 2026-11-21
# (benchmarks/results/h200_2026-11-21_sweep_split_rms.json): 1024 x 262144 361.2 us
# against 419.7 for static_persistent; 4096 x 65536 344.1 / 355.3; 4096 x 32768 173.4
# against 178.7 for multi_wave_reload. At 16384^2 the split lost (338.2 against 285.5),
# and so did 8 and 16 warps and 16384-wide splits everywhere. LayerNorm's split lost
# to persistent/reload on all four shapes (e.g. 4096 x 65536 603.7 against 414.2 us;
# sweep_split_layer.json), so LayerNorm keeps the rules above.
# Since then (same method, 2026-11-21, old -> new kernel, median of 2 x 2 rounds): the
# bf16 split kept as bf16 across the wait and no ticket atomic (programs take (rb, k)
# from their id, with a bounded wait and a recompute fallback) took RMSNorm 4096 x
# 65536 from 348.8 to 305.8 us, 1024 x 262144 358.7 -> 316.6, 4096 x 32768 173.1 ->
# 154.9. A ticket taken once per program by persistent groups with a prefetch of the
# next row block was slower (434-462 us at 4096 x 65536: the acquire-release atomics
# wait on the prefetch), and so was polling the slots for a NaN sentinel (462.7 us).
# Re-swept with the new kernel (h200_2026-11-21_sweep_split_{rms,layer}_noticket.json):
# RMSNorm [1, 8192] at 4 warps stays (4096 x 65536 305.6 us; [1, 4096] at 2 warps 302.6,
# within 1%, would halve the longest row; 8 warps 328.0, 16384-wide 375-392); at
# 16384^2 the reload still wins (286.5 against 292.7-296.0). LayerNorm's split still
# loses: 4096 x 65536 469.1 us at best against 405.6 for static_persistent, 1024 x
# 262144 504.1 / 495.3, 16384^2 462.9 / 322.0 for the reload.
_SPLIT_MIN_N = 16384
_SPLIT_BLOCK_N, _SPLIT_WARPS = 8192, 4
# Each split program holds its split as block_n / chunk_n separate tiles and reduces
# and stores them one at a time: fewer registers, so more programs (bytes in flight)
# a SM. RMSNorm [1, 8192] at 4 warps as two 4096-wide chunks: 4096 x 65536 292 us
# against 304 as one tile, 1024 x 262144 298 / 315, 4096 x 32768 148.0 / 154.8
# (2048-wide chunks 298 / 304 / 152; [1, 4096] at 1 warp in 1024-wide chunks
# 291 / 296 / 148, within 1%). H200, 2026-11-21,
# benchmarks/results/h200_2026-11-21_split_chunks.txt.
_SPLIT_CHUNK_N = 4096
# LayerNorm rows longer than 32768 split too, over cdiv(N, 4096) programs of 1 warp,
# each holding its split as four 1024-wide chunks (167 registers a thread against 253
# as one tile, ncu): 4096 x 49152 288.9 us against 321.3 for static_persistent,
# 4096 x 65536 373.8 / 405.0, 1024 x 262144 388.9 / 489.3 (one tile: 459.6 and
# 480.2; 512- and 2048-wide chunks and [1, 2048] splits 319-482). At 4096 x 32768
# the split lost (218.5 us at best against 182.8 for the reload, which stays).
# The split's statistics were not the cost: Chan, shifted or one-pass sums all took
# 438-450 us at 4096 x 65536 as one tile (H200, 2026-11-21,
# benchmarks/results/h200_2026-11-21_split_chunks.txt).
_LN_SPLIT_MIN_N = 32768
_LN_SPLIT_BLOCK_N, _LN_SPLIT_WARPS, _LN_SPLIT_CHUNK_N = 4096, 1, 1024
# Since 2026-11-22 LayerNorm rows of 16384 < N <= 4096 x SMs take static_persistent
# with split_rows instead (the persistent split-row forward: the split-row backward's
# schedule, nothing held across the wait): W-wide splits of 1 warp, W = 1024 up to
# N = 65536, else 2048, 16384 / W programs a SM (ncu, H200: 116 registers a thread at
# W = 1024, so 16 fit; 234 at 2048, so 8). H200, 2026-11-22, bf16 forward with
# residuals, CUPTI over rotated inputs, median of 3-5 rounds of 10
# (benchmarks/ab_split_fwd.py; results/h200_2026-11-22_split_fwd.txt), against the
# rule before: 4096 x 32768 176.3 us (reload 183.8), 4096 x 65536 347.3 (split above
# 375.0), 1024 x 131072 180.8 (199.6), 1024 x 262144 386.6 (393.4; 382.2 at 2 warps).
# Not kept: W = 512 at 20-32 a SM (4096 x 65536 414-446 us), 2048 at 12 a SM (a second
# wave: 427.5), 4096-wide splits (402.3). At 16384^2 the reload stays (323.7 us
# against 364.6 at best). RMSNorm's persistent split lost to the split above
# everywhere (4096 x 65536 323.0 us at best against 292.7; 16384^2 332.6 against the
# reload's 287.3), so RMSNorm keeps those rules.
# Each program issues the loads of the row block it publishes before it normalises the
# one 2 behind, and reduces them after (split_early_publish): H200, 2026-11-22, same
# method, 3-5 rounds (results/h200_2026-11-22_split_early_publish.txt): 1024 x 262144
# 362.8-363.8 us against 390.9-392.6, 4096 x 65536 347.4-347.7 against 351.5-351.8;
# at a lead of 3, 362.4 / 348.9. RMSNorm's persistent split stayed behind with it
# (4096 x 65536 322.7 us at best against 297.0; 16384^2 369.4 against 291.1).
_LN_PSPLIT_MIN_N, _LN_PSPLIT_WIDE_N = 16384, 65536
_LN_PSPLIT_W, _LN_PSPLIT_WIDE_W, _LN_PSPLIT_COLS_PER_SM = 1024, 2048, 16384
# Backward: rows up to this padded length are one register tile with the partials in
# registers; longer rows use the row-statistics + column-tiled pair. At 16384^2 the
# single 16384-wide tile took 812 us and the pair 674-686 us.
_BWD_SINGLE_TILE_MAX = 8192
# Backward tile: block_m = 4096 / block_n rows. 4096 x 1024: block_m 4 10.8 us, 2 11.9;
# 32768 x 128: block_m 32 11.4 us.
_BWD_TILE_ELEMS = 4096
# Narrow rows (block_n <= 256): [2048 / block_n, block_n] tiles, 2 warps, SMs x 4
# programs. 32768 x 128: RMSNorm 11.2 us against 11.6 for the wider rule ([32, 128],
# 4 warps, SMs x 2), LayerNorm 14.6 / 15.1 (best of the sweep: 11.0 and 14.6;
# benchmarks/results/h200_2026-11-21_sweep_bwd_narrow.json).
# RMSNorm rounds G down to a power of 2 (512 on 132 SMs), so that stage 2 reads the
# [G, N] partials in one unpadded tile: 32768 x 128 11.13 us against 11.36 at 528
# (stage 1 + 2, median of 30, two rounds each; H200, 2026-11-21,
# benchmarks/results/h200_2026-11-21_narrow_bwd_programs.json). LayerNorm keeps
# SMs x 4 (14.34 us against 14.55 at 512). 384 and fewer were slower for both.
_BWD_NARROW_TILE_ELEMS, _BWD_NARROW_WARPS, _BWD_NARROW_OCCUPANCY = 2048, 2, 4
# Backward grid: 2 programs a SM for rows up to 4096 wide (4096 x 4096: 31.7 us with
# 264, 33.4 with 132), 1 a SM for wider rows (4096 x 8192: 57.9 us with 132, 63.3 with
# 264).
# Backward warps: 4 for tiles narrower than 4096 (4096 x 1024: 10.8 us with 4, 11.9
# with 8), else block_n / 256 (4096 x 4096: 16 warps 31.7 us, 8 warps 32.6;
# 4096 x 8192: 32 warps 57.9 us, 16 warps 61.1).
# Chunked backward: 4096-wide column chunks, 16 warps, G = 2 x SMs / chunks programs
# a column (16384^2: 686 us; 4096 x 65536: 690; 1024 x 262144: 690).
_BWD_CHUNK_N = 4096
# LayerNorm single tiles of 4096 and 8192 (padded) take 16 warps and 1 program a SM
# instead (more registers a thread for its two row sums and two partials): H200,
# 2026-11-22, stage 1 + 2, CUPTI over rotated inputs, median of 3 rounds of 10
# (benchmarks/ab_split_bwd.py "tile:..."; results/h200_2026-11-22_ln_bwd_tile.txt):
# 8192 x 5120 97.9 us against 112.2 for the "Backward grid" and "Backward warps" rules
# above (32 warps, SMs programs), 4096 x 8192 68.5 / 73.9, 8192^2 126.4 / 136.2;
# 8192 x 4096 75.5 against 81.9 (16 warps, 2 x SMs), 4096 x 4096 41.6 / 47.7; a rerun
# on another H200 gave the same. Not kept: 8 warps at 2-3 a SM (104-147 us at 8192
# wide), [2, 8192] at 32 warps (387.2: spills), [2, 4096] at 16 warps 2 a SM (74.8 /
# 43.3, a tie at 8192 x 4096). RMSNorm keeps the rule
# above (8192 x 5120 80.5 us against 83.4 at 16 warps; 8192^2 108.8 / 113.7).
_BWD_LN_TILE_MIN_BLOCK_N, _BWD_LN_TILE_WARPS = 4096, 16
# LayerNorm rows of 2048 < N <= 3072 (padded to 4096), Pallas backend: the tile as pieces
# (BackwardConfig.pieces: 2048 + 512 or 2048 + 1024, N rounded up to 512) at 8 warps,
# 2 programs a SM, instead of the [1, 4096] tile at 16 warps above. Three pieces lost
# (8192 x 3584, 2048 + 1024 + 512: 103.7 us against 75.1), so the rule stops at 3072.
# H200, 2026-11-22, 8192 x 3072, stage 1 + 2: 53.1 us against 71.4 (and 54.9 / 72.9
# on another H200); [2, 4096] at 8 warps 63.9, [1, 4096] at 8 warps 75.6
# (results/h200_2026-11-22_bwd_pieces.txt). Not kept: pieces for RMSNorm (8192 x 3072
# 47.2 against 46.9 us; 8192 x 5120 84.8-98.1 against 81.9), or for LayerNorm rows
# wider than 4096 (8192 x 5120 110.2-143.7 against 97.7).
_BWD_LN_PIECES_MAX_N, _BWD_LN_PIECES_ROUND, _BWD_LN_PIECES_WARPS = 3072, 512, 8
# LayerNorm [2, 2048] tiles, Pallas backend, take 8 warps (not 4): 8192 x 2048 33.8 us
# against 35.3 (the same file; 35.7 against 36.4 in results/h200_2026-11-22_ln_bwd_tile.txt).
_BWD_LN_2048_WARPS = 8
# Split-row backward (rows wider than one tile, Pallas backend; both ops): each row over
# cdiv(N, W) programs of W / 512 warps (16 elements of x and of dy a thread), W the
# narrowest of 512, 1024, 2048, ... with 4 N <= W^2 (the slots a program polls are then
# at most a quarter of the bytes of its split), each row block published 2 row blocks
# ahead of its dx, which reloads x and dy from L2 (nothing held across the wait).
# Programs a SM: as many as fit by registers (ncu, H200, 2026-11-22, bf16: RMSNorm 94
# registers a thread at 1 warp, 96 at 2, so 20 warps a SM; LayerNorm 127-128, so 16),
# so G = that x SMs / cdiv(N, W) row-block groups; one more program a SM than fits
# runs a second wave (RMSNorm 16384^2 at 21 programs of 1 warp: 677.7 us against 500.2).
# H200, 2026-11-22, stage 1 + 2, CUPTI over rotated inputs, median of 5 rounds of 10
# (benchmarks/ab_split_bwd.py; benchmarks/results/h200_2026-11-22_split_bwd_occupancy.txt),
# against the rule before (2048-wide splits at 4 warps, 4 a SM; reload-row kernel for
# rows up to 16384):
#   RMSNorm   16384^2 500.2 us (reload 511.1), 8192 x 16384 252.1 (265.6),
#             2048 x 16384 68.4 (76.0), 4096 x 32768 244.9 (264.1), 4096 x 65536 489.2
#             (529.3), 1024 x 131072 251.8 at W = 1024 (268.8; 252.3 at W = 512),
#             1024 x 262144 491.4 at W = 1024 (536.8; 506.3 at W = 2048, 4 warps, 5 a SM).
#   LayerNorm 16384^2 584.5 us (reload 596.1), 2048 x 16384 81.5 (92.3), 4096 x 32768
#             282.5 (343.7), 4096 x 65536 614.6-617.4 (690.0-696.7), 1024 x 131072 329.3
#             at W = 1024 (355.0; 333.6 at W = 512), 1024 x 262144 659.9 at W = 1024
#             (698.1; 683.3 at W = 2048, 2 warps; 512-wide splits, 512 of them: 1048).
# Not kept: W = 256 (RMSNorm 16384^2 579.5 us, LayerNorm 4096 x 65536 1013.8), leads of
# 1 and 3 row blocks (LayerNorm 16384^2 900.1 / 585.9 us, 4096 x 65536 623.7 / 621.4).
# The split's programs wait on each other, so all of a row's must be resident at once:
# cdiv(N, W) <= SMs x split_resident_programs(W / 512 warps), which holds whatever the
# register count; longer rows (N > 4096 x SMs) take the row-statistics + column-tiled
# pair.
_BWD_SPLIT_MIN_W, _BWD_SPLIT_ELEMS_PER_WARP, _BWD_SPLIT_LAG = 512, 512, 2
_BWD_SPLIT_RMS_WARPS_PER_SM, _BWD_SPLIT_LN_WARPS_PER_SM = 20, 16
# LayerNorm rows of 32768 < N where the rule above gives W <= 1024 (N <= 262144): W =
# 1024 at 1 warp (32 elements of x and dy a thread), 8 programs a SM (all that
# split_resident_programs(1) guarantees), each row block published 3 ahead with
# split_early_publish: its loads issued before the dx of the row block 3 behind and
# reduced after it, in flight across the wait. H200, 2026-11-22, stage 1 + 2, same
# method, 3 rounds (results/h200_2026-11-22_split_early_publish.txt): 4096 x 65536
# 552.3-552.5 us against 616.0-619.7 for the rule above, 1024 x 262144 584.3-584.8
# against 666.6-668.1; at 4096 x 32768 (286.9 / 286.2), 16384^2 (587.7 / 584.8) and
# 2048 x 16384 (81.7 / 81.7) it ties, so those keep the rule above. Not kept: leads of
# 2 and 4 (4096 x 65536 568.9 / 566.6 us), 7 a SM (590.9), 9 a SM (a second wave:
# 904.7), 2048-wide splits at 1 or 2 warps (3627.7 / 724.9), 512-wide at 8 a SM
# (797.0), the same splits without the early publish (577.9; 1024 x 262144 700.9).
# RMSNorm lost with it: 16384^2 519.9 us against 501.9 with its own rule, 4096 x 65536
# 511.8 / 496.3; 1024-wide at 8-12 a SM 515-802. So did LayerNorm's own rule with it
# (4096 x 65536 917.1 us: the held loads push its 128 registers a thread past 4
# programs a SM).
_BWD_SPLIT_LN_EARLY_MIN_N, _BWD_SPLIT_LN_EARLY_W, _BWD_SPLIT_LN_EARLY_LAG = 32768, 1024, 3
_BWD_SPLIT_LN_EARLY_WARPS_PER_SM = 8
# Reload-row backward (Pallas backend, ``reload_rows``; the default for rows of 8193 to
# 16384 until the split-row rule above beat it on 2026-11-22, and kept for callers):
# one program a row block walks the whole row twice, the second time from L2, with
# every chunk's partials in registers; G = SMs. Its best configs, as measured:
# H200, 2026-11-21, backward kernels (stage 1 + 2), CUPTI over rotated inputs, median
# of 10 (benchmarks/sweep_reload_bwd.py; results h200_2026-11-21_sweep_reload*.json):
#   - RMSNorm 16384^2: 507-512 us at [2, 4096] tiles, 16 warps, against 608-620 for the
#     split-row kernel of then and 673 for the pair; 4096 x 32768: 287.6 us at
#     [1, 4096], 16 warps, against 312.5 split and 343.5 pair (the split-row kernel of
#     now takes 32768-wide rows: above). Row blocks of 32768 elements won (16384^2 at
#     [1, 4096]: 586 us, at [4, 4096]: 564-570).
#   - LayerNorm 16384^2: 589-597 us at [2, 2048], 8 warps, against 710-714 for the pair;
#     at 4096 x 32768 the pair won (360.7 against 536.0): the reload stops at 16384.
#   - 4096 x 65536 (64 partial registers a thread at 32 warps): 1090 us RMSNorm
#     against 623 split; LayerNorm 2051 against 722 pair. Longer rows keep those.
#   - Not kept: 2 programs a SM (16384^2 RMSNorm 514.8 against 507.1 us), Triton's
#     pipeliner (num_stages 2/3: within 1%), and pass 2 of a row block interleaved with
#     pass 1 of the next (commit de9550a, reverted: 16384^2 RMSNorm 562.2 against 511.0
#     us, LayerNorm 803.9 against 590.4).


def cached_max_block_n(dtype) -> int:
  """Largest padded row length multi_wave_cached accepts for ``dtype``."""
  del dtype
  return _CACHED_MAX_BLOCK_N


def _num_warps_for(tile_elems: int) -> int:
  # One 16-byte vector (8 bf16) per thread per row; at most 16 warps.
  return int(min(16, max(1, tile_elems // 256)))


def _fwd_warps(tile_elems: int) -> int:
  return int(min(_FWD_MAX_WARPS, max(_FWD_MIN_WARPS, tile_elems // _FWD_ELEMS_PER_WARP)))


def _split_rule(subtract_mean: bool) -> tuple[int, int, int, int]:
  """(rows longer than this split, block_n, num_warps, chunk_n) of the split-row
  forward."""
  if subtract_mean:
    return _LN_SPLIT_MIN_N, _LN_SPLIT_BLOCK_N, _LN_SPLIT_WARPS, _LN_SPLIT_CHUNK_N
  return _SPLIT_MIN_N, _SPLIT_BLOCK_N, _SPLIT_WARPS, _SPLIT_CHUNK_N


def _splits_rows(n: int, subtract_mean: bool, backend: str, device: DeviceInfo) -> bool:
  """Whether multi_wave_cached splits an N-long row over several programs."""
  min_n, block_n, _, _ = _split_rule(subtract_mean)
  if backend != "pallas" or n <= min_n:
    return False
  return device.platform == "cpu" or cdiv(n, block_n) <= device.num_sms


def _ln_persistent_split(n: int, subtract_mean: bool, backend: str,
                         device: DeviceInfo) -> tuple[int, int] | None:
  """(block_n, programs a SM) of LayerNorm's persistent split-row forward for N-long
  rows, or None where it is not the pick."""
  if not subtract_mean or backend != "pallas" or n <= _LN_PSPLIT_MIN_N:
    return None
  w = _LN_PSPLIT_W if n <= _LN_PSPLIT_WIDE_N else _LN_PSPLIT_WIDE_W
  if device.platform != "cpu" and n > _LN_SPLIT_BLOCK_N * device.num_sms:
    return None
  return w, _LN_PSPLIT_COLS_PER_SM // w


def _persistent_tile(n: int, dtype, subtract_mean: bool, backend: str,
                     device: DeviceInfo) -> tuple[int, int, int] | None:
  """(block_n, num_warps, programs a SM) of the one-tile static_persistent forward for
  N-long rows of ``dtype`` on ``device``, or None where it is not the pick."""
  if backend != "pallas":
    return None
  itemsize = np.dtype(dtype).itemsize
  for min_n, max_n, num_warps, per_sm, max_itemsize, device_has in (
      _LN_PERSISTENT_TILES if subtract_mean else _RMS_PERSISTENT_TILES):
    if min_n < n <= max_n and itemsize <= max_itemsize and device_has in device.name:
      return next_power_of_2(max_n), num_warps, per_sm
  return None


def choose_mode(m: int, n: int, dtype, device: DeviceInfo, *, subtract_mean: bool = False,
                backend: str = "pallas") -> str:
  """The mode the heuristic picks for an [m, n] input (the fastest one measured).

  multi_wave_cached up to N = 8192 (narrow rows included: at 32768 x 128 it ran 5.8 us
  against 6.0 us for static_persistent), multi_wave_reload up to N = 32768,
  static_persistent (with 16384-wide chunks) beyond. On the Pallas backend,
  static_persistent with the row as one tile (scale/bias hoisted) takes LayerNorm rows
  of 8192 < N <= 16384 and, on an H200 only, RMSNorm rows of 6144 < N <= 8192 and
  12288 < N <= 16384 and LayerNorm rows of 4096 < N <= 5120 (2-byte dtypes);
  multi_wave_cached
  split over programs RMSNorm rows with N > 16384 (up to 8192 x SMs), and
  static_persistent split over programs (``split_rows``) LayerNorm rows with
  N > 16384 (up to 4096 x SMs).
  """
  del m
  if _ln_persistent_split(n, subtract_mean, backend, device):
    return "static_persistent"
  if _persistent_tile(n, dtype, subtract_mean, backend, device):
    return "static_persistent"
  if _splits_rows(n, subtract_mean, backend, device):
    return "multi_wave_cached"
  if n > _HEURISTIC_RELOAD_MAX:
    return "static_persistent"
  if next_power_of_2(n) > _HEURISTIC_CACHED_MAX:
    return "multi_wave_reload"
  return "multi_wave_cached"


def forward_config(m: int, n: int, dtype, mode: str | None = None,
                   device: DeviceInfo | None = None, *,
                   subtract_mean: bool = False, backend: str = "pallas") -> ForwardConfig:
  """Default forward launch config for an [m, n] input of ``dtype``.

  ``subtract_mean`` (LayerNorm) picks the LayerNorm tile rule for single-tile rows and
  the persistent split for LayerNorm's static_persistent rows of 16384 < N <=
  4096 x SMs; ``backend`` ("pallas" or "triton") whether rows may be split.

  Raises:
    ValueError: an unknown mode.
    NotImplementedError: multi_wave_cached for a row it cannot hold: N > 32768 on the
      Triton backend; on the Pallas backend, N > 8192 x SMs (RMSNorm) or
      4096 x SMs (LayerNorm).
  """
  device = device or device_info()
  mode = mode or choose_mode(m, n, dtype, device, subtract_mean=subtract_mean,
                             backend=backend)
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  bn_full = next_power_of_2(n)
  psplit = _ln_persistent_split(n, subtract_mean, backend, device)
  if mode == "static_persistent" and psplit:  # rows split over persistent programs
    w, per_sm = psplit
    block_m = 1 if device.platform != "cpu" else min(64, next_power_of_2(m))
    num_programs = max(1, min(per_sm * device.num_sms // cdiv(n, w), cdiv(m, block_m)))
    return ForwardConfig(mode, block_m, w, 1, num_programs, split_rows=True, split_lag=2,
                         split_early_publish=True)
  split_min_n, split_n, split_warps, split_chunk_n = _split_rule(subtract_mean)
  if mode == "multi_wave_cached" and backend == "pallas" and n > split_min_n:
    if not _splits_rows(n, subtract_mean, backend, device):
      raise NotImplementedError(
          f"multi_wave_cached splits a row over cdiv(N, {split_n}) programs, at "
          f"most one a SM: N={n} needs {cdiv(n, split_n)} > {device.num_sms}; "
          f"use mode='multi_wave_reload' (or 'static_persistent')")
    # The split of a row over programs (forward.py's _split_kernel).
    return ForwardConfig(mode, 1, split_n, split_warps, chunk_n=split_chunk_n)
  tile = _persistent_tile(n, dtype, subtract_mean, backend, device)
  if mode == "static_persistent" and tile:  # the row as one hoisted-scale tile
    block_n, num_warps, per_sm = tile
    block_m = 1 if device.platform != "cpu" else min(64, next_power_of_2(m))
    num_programs = max(1, min(per_sm * device.num_sms, cdiv(m, block_m)))
    return ForwardConfig(mode, block_m, block_n, num_warps, num_programs)
  if n <= _HEURISTIC_RELOAD_MAX:
    chunk = _RELOAD_CHUNK_N_SMALL
  elif mode == "static_persistent":
    chunk = _PERSISTENT_CHUNK_N_LARGE
  else:
    chunk = _RELOAD_CHUNK_N_LARGE
  if mode == "multi_wave_cached" and bn_full > cached_max_block_n(dtype):
    raise NotImplementedError(
        f"multi_wave_cached holds the whole row in registers and supports N up to "
        f"{cached_max_block_n(dtype)} (N={n} pads to {bn_full}); use "
        f"mode='multi_wave_reload' (or 'static_persistent') for longer rows")
  chunked = mode == "multi_wave_reload" or (mode == "static_persistent" and bn_full > chunk)
  block_n = min(bn_full, chunk) if chunked else bn_full
  # Rows are packed up to a ~4096-element tile in every mode: a forced reload at
  # 32768 x 128 with one row a program ran at 250 GB/s (H200 per-mode bench).
  block_m = max(1, min(_FWD_TILE_ELEMS // block_n, next_power_of_2(m)))
  if chunked and block_n >= _RELOAD_CHUNK_N_LARGE:
    num_warps = _RELOAD_WARPS
  elif subtract_mean and not chunked and block_n == _LN_WIDE_BLOCK_N:  # as measured
    block_m = 1
    num_warps = _LN_WIDE_PADDED_WARPS if n <= _LN_WIDE_PADDED_MAX_N else _LN_WIDE_WARPS
  elif subtract_mean and not chunked:
    block_m = max(1, min(max(_LN_MIN_BLOCK_M, _LN_TILE_ELEMS // block_n),
                         next_power_of_2(m)))
    min_warps = _LN_NARROW_MIN_WARPS if block_n <= _NARROW_BLOCK_N else 1
    num_warps = int(min(16, max(min_warps, block_m * block_n // _LN_ELEMS_PER_WARP)))
    if backend == "pallas" and block_n == 2048:
      num_warps = _LN_2048_WARPS
    if backend == "pallas" and block_n == 4096 and n <= _LN_ONE_ROW_MAX_N:
      block_m, num_warps = 1, _LN_ONE_ROW_WARPS
  else:
    num_warps = _fwd_warps(block_m * block_n)
  if device.platform == "cpu":
    # Interpret mode runs programs one after another: fewer, fatter ones are faster.
    block_m = max(block_m, min(64, next_power_of_2(m)))
  num_programs = 0
  if mode == "static_persistent":
    num_programs = max(1, min(device.num_sms * _PERSISTENT_OCCUPANCY, cdiv(m, block_m)))
  return ForwardConfig(mode, block_m, block_n, num_warps, num_programs)


def split_resident_programs(num_warps: int) -> int:
  """Programs of ``num_warps`` warps a SM that are resident together whatever their
  register count: 65536 registers a SM, at most 255 (256 allocated) a thread, so
  8 / num_warps (at least 1). The split-row kernels, whose programs wait on each other,
  split a row over at most this many programs a SM."""
  return max(1, 8 // num_warps)


def _bwd_split_rule(n: int, subtract_mean: bool, device: DeviceInfo):
  """(block_n, num_warps, num_programs, split_lag, split_early_publish) of the split-row
  backward of N-long rows, or None when its programs could not all be resident
  (N > 4096 x SMs)."""
  w = _BWD_SPLIT_MIN_W
  while 4 * n > w * w:
    w *= 2
  lag, early = _BWD_SPLIT_LAG, False
  warps_per_sm = _BWD_SPLIT_LN_WARPS_PER_SM if subtract_mean else _BWD_SPLIT_RMS_WARPS_PER_SM
  num_warps = w // _BWD_SPLIT_ELEMS_PER_WARP
  if subtract_mean and _BWD_SPLIT_LN_EARLY_MIN_N < n and w <= _BWD_SPLIT_LN_EARLY_W:
    w, num_warps, lag, early = _BWD_SPLIT_LN_EARLY_W, 1, _BWD_SPLIT_LN_EARLY_LAG, True
    warps_per_sm = _BWD_SPLIT_LN_EARLY_WARPS_PER_SM
  splits = cdiv(n, w)
  if num_warps > 32 or (device.platform != "cpu"
                        and splits > device.num_sms * split_resident_programs(num_warps)):
    return None
  return w, num_warps, max(1, warps_per_sm // num_warps * device.num_sms // splits), lag, early


def backward_config(m: int, n: int, dtype, device: DeviceInfo | None = None, *,
                    subtract_mean: bool = False, backend: str = "pallas") -> BackwardConfig:
  """Default backward launch config for an [m, n] input of ``dtype``.

  ``subtract_mean`` (LayerNorm) and ``backend`` matter for rows wider than one tile.
  On the Pallas backend, rows wider than 8192 take the split-row kernel while all of a
  row's programs can be resident (N <= 4096 x SMs; ``split_resident_programs``),
  LayerNorm's rows of 32768 < N <= 262144 with ``split_early_publish``; longer rows,
  and all of ``backend="triton"``'s wide rows, the row-statistics + column-tiled pair.
  """
  del dtype
  device = device or device_info()
  bn_full = next_power_of_2(n)
  wide = bn_full > _BWD_SINGLE_TILE_MAX and backend == "pallas"
  split = _bwd_split_rule(n, subtract_mean, device) if wide else None
  split_rows = split is not None
  reload_rows = False  # chosen by no default: the split-row kernel beat it (above)
  lag, early = _BWD_SPLIT_LAG, False
  pieces = ()
  if bn_full <= _NARROW_BLOCK_N:
    block_n = bn_full
    block_m = max(1, min(_BWD_NARROW_TILE_ELEMS // block_n, next_power_of_2(m)))
    num_warps = _BWD_NARROW_WARPS
    num_programs = device.num_sms * _BWD_NARROW_OCCUPANCY
    if not subtract_mean:
      num_programs = 1 << (num_programs.bit_length() - 1)
  elif bn_full <= _BWD_SINGLE_TILE_MAX:
    block_n = bn_full
    block_m = max(1, min(_BWD_TILE_ELEMS // block_n, next_power_of_2(m)))
    num_warps = 4 if block_n < 4096 else block_n // 256
    num_programs = device.num_sms * (2 if block_n <= 4096 else 1)
    if subtract_mean and block_n >= _BWD_LN_TILE_MIN_BLOCK_N:
      num_warps, num_programs = _BWD_LN_TILE_WARPS, device.num_sms
    if subtract_mean and block_n == 2048 and backend == "pallas":
      num_warps = _BWD_LN_2048_WARPS
    if (subtract_mean and block_n == 4096 and n <= _BWD_LN_PIECES_MAX_N
        and backend == "pallas"):  # the Triton backend's kernel has no pieces
      pieces = _binary_pieces(cdiv(n, _BWD_LN_PIECES_ROUND) * _BWD_LN_PIECES_ROUND)
      block_m, num_warps, num_programs = 1, _BWD_LN_PIECES_WARPS, 2 * device.num_sms
  elif split_rows:  # each row split over programs that exchange their row sums
    block_n, num_warps, num_programs, lag, early = split
    block_m = 1
  else:  # row statistics kernel + column-tiled persistent kernel
    block_n, block_m, num_warps = _BWD_CHUNK_N, 1, 16
    num_programs = max(1, 2 * device.num_sms // cdiv(n, block_n))
  if device.platform == "cpu":
    block_m = max(block_m, min(64, next_power_of_2(m)))
  num_programs = max(1, min(num_programs, cdiv(m, block_m)))
  return BackwardConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                        num_programs=num_programs, split_rows=split_rows,
                        reload_rows=reload_rows, split_lag=lag, split_early_publish=early,
                        pieces=pieces, **reduce_config(n, num_programs))


def _binary_pieces(n: int) -> tuple[int, ...]:
  """The powers of 2 that sum to ``n``, largest first (5120 -> (4096, 1024))."""
  return tuple(1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1)


# Stage 2 reads all G partial rows of a column strip in one tile of at most this many
# f32 elements, so that it is one load deep: a loop over G in [32, 128] tiles cost
# ~8 us at N = 1024 on the H200 (2026-11-21, benchmarks/sweep.py), as long as the
# stage-1 kernel itself.
_REDUCE_TILE = 8192


def reduce_config(n: int, num_programs: int) -> dict:
  """Stage-2 knobs for [num_programs, n] partials."""
  block_g = min(next_power_of_2(num_programs), 1024)
  block_n = max(8, min(next_power_of_2(n), _REDUCE_TILE // block_g))
  return dict(reduce_block_n=block_n, reduce_block_g=block_g,
              reduce_num_warps=_num_warps_for(block_g * block_n // 2))
