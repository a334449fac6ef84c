"""Launch configs (frozen dataclasses) and the heuristic that picks them, per device.

What lives where:
  this module       the configs (``ForwardConfig``, ``BackwardConfig``), the device
                    summary (``DeviceInfo``, ``device_info``), the rules (the constants
                    under "Rules": one line each, with a one-line reason and
                    ``[T#anchor]``, the section of docs/tuning_rules.md that holds its
                    measurement) and the selectors that apply them (``choose_mode``,
                    ``forward_config``, ``backward_config``, ``reduce_config``).
  docs/tuning_rules.md    every rule's evidence (device, date, figures, results file under
                    benchmarks/results/) and how to run the sweep again.
  docs/design.md    what the kernels these configs launch do.
  tests/test_config_pinned.py
                    pins every config the selectors choose (H100, H200, another GPU,
                    CPU); a rule changed on purpose regenerates
                    tests/data/config_pinned.json (``--regen``).

One heuristic serves both backends (``"pallas"`` and ``"triton"``): they run the same
algorithms with the same block shapes; the rules marked "Pallas" pick kernels that only
the Pallas backend has. A config the caller passes to a launcher always wins; these
functions only build the default.

Terms (TileGym / Triton names):
  row block   ``block_m`` consecutive rows handled together by one program.
  block_n     columns per tile. When ``block_n >= N`` the whole row is one tile
              ("single tile"); otherwise the row is walked in ``block_n`` chunks.
  programs    grid size. For ``multi_wave_*`` it is ``cdiv(M, block_m)``; for
              ``static_persistent`` and the backward it is about the SM count times
              an occupancy factor, and each program loops over row blocks with a
              grid stride.
  N'          ``next_power_of_2(N)``, the padded row (a single tile's block_n).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from pallas_norm import tuning as _tuning

__all__ = [
    "MODES",
    "DeviceInfo",
    "ForwardConfig",
    "BackwardConfig",
    "device_info",
    "choose_mode",
    "choose_backend",
    "forward_config",
    "backward_config",
    "cached_max_block_n",
    "reduce_config",
    "split_resident_programs",
    "search_space",
    "table_key",
    "entry_fields",
    "entry_tile",
    "from_entry",
    "fits",
]

MODES = ("multi_wave_reload", "multi_wave_cached", "static_persistent")


def next_power_of_2(n: int) -> int:
  """Smallest power of 2 >= ``n`` (1 for n <= 1): N', the tiles' padded row width, which
  is also the widths a table entry serves (``tuning.padded_width``)."""
  return _tuning.padded_width(n)


def cdiv(a: int, b: int) -> int:
  """Ceiling of a / b for integers (b > 0)."""
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the heuristics need to know about the device.

  Attributes:
    platform: "gpu", or "cpu" for interpret mode (also a GPU that reports no SM count).
    name: the device kind, e.g. "NVIDIA H200"; rules restricted to a GPU match a
      substring of it.
    num_sms: streaming multiprocessors (132 on an H100 SXM or H200); 4 on CPU.
  """

  platform: str
  name: str
  num_sms: int


_CPU_NUM_SMS = 4  # interpret mode: several programs for the grid-stride paths. [T#cpu]


@functools.lru_cache(maxsize=None)
def _device_info_cached(platform: str, name: str, core_count: int | None) -> DeviceInfo:
  if platform == "gpu" and core_count:
    return DeviceInfo(platform, name, int(core_count))
  return DeviceInfo("cpu", name, _CPU_NUM_SMS)


def device_info(device: jax.Device | None = None) -> DeviceInfo:
  """DeviceInfo of ``device`` (default: ``jax.devices()[0]``), from its ``platform``,
  ``device_kind`` and ``core_count`` (the SM count). Cached per (platform, kind,
  count)."""
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
    hoist_params: ``multi_wave_cached`` with the row in one tile loads scale/bias with
      x, before the row reductions, instead of after them: their load's latency is not
      added to the program's, at the price of registers held across the reductions
      (which matters only when programs wait for an SM: the default hoists while the
      grid fits one wave, ``cdiv(M, block_m) <= SMs``). Ignored by the other modes
      (static_persistent loads them once a program: ``reload_params``).
    column_splits: ``multi_wave_cached`` with the row in one tile (``block_n >= N``):
      programs a row block, each loading the whole tile for the row statistics and
      storing ``block_n / column_splits`` of its columns (XLA's schedule for few
      rows: no exchange between programs, each reads the row, from L2 but for the
      first; few rows then use that many times more SMs). 1: one program a row block.
      A power of 2, at most ``block_n``; FP8 x (``x_scale``) only at 1.
    stream_x: ``multi_wave_cached`` and ``static_persistent`` with the row in one tile
      (Pallas): x (and the residual) loaded with the ``.cg`` cache modifier (L2 only,
      ``kernels._compat.stream_cache_modifier``: each element is read once), or without
      (False: L1 and L2, the Triton backend's plain loads; ``.cg`` cost the FP8 kernels
      up to 11% on the H100, docs/fp8_tuning.md#fp8-packed). The chunked rows of
      ``multi_wave_reload`` and ``static_persistent`` (Pallas, not split over
      programs): both passes with ``.cg``, or (False) with the L1 eviction hints,
      evict_last in the statistics pass and evict_first in the reload (the Triton
      backend's reload, which took less time with the residual add at 16384x16384:
      docs/tuning.md, "At a5624e7-ac9bf24"). A tuned field; the default keeps ``.cg``.
      Ignored by the other kernels and backends.
    reload_params: ``static_persistent`` with the row in one tile (Pallas): scale/bias
      loaded for each row block after its statistics (from L2 but for the first), as
      ``multi_wave_cached`` does, instead of once a program and held in registers
      across all of its row blocks (False, the default). Fewer registers a thread,
      more programs a SM (ncu, LayerNorm 512x8192 at 8 warps: 143 held, 1 program a
      SM; 100 reloaded, 2), more L2 reads where a program takes many row blocks; where
      measured, the best held config was still the faster (docs/tuning.md#status-2026-11-29).
      A tuned field. Ignored by the other modes and backends.

  Raises:
    ValueError: an unknown mode, a block size that is not a power of 2, num_warps not
      in (1, 2, 4, ..., 32), split_rows outside static_persistent, a negative
      split_lag, or split_early_publish without split_rows and split_lag >= 1.
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
  hoist_params: bool = False
  column_splits: int = 1
  stream_x: bool = True
  reload_params: bool = False

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
    cs = self.column_splits
    if cs < 1 or cs & (cs - 1) or cs > self.block_n:
      raise ValueError(f"{self.column_splits=} must be a power of 2 in [1, block_n]")
    if cs > 1 and self.mode != "multi_wave_cached":
      raise ValueError(f"column_splits is a multi_wave_cached option, not {self.mode}'s")
    _check_split_lag(self)


def _check_split_lag(cfg):
  if cfg.split_lag < 0:
    raise ValueError(f"{cfg.split_lag=} must be >= 0")
  if cfg.split_early_publish and not (cfg.split_rows and cfg.split_lag >= 1):
    raise ValueError(f"split_early_publish needs split_rows and split_lag >= 1 (got "
                     f"{cfg.split_rows=}, {cfg.split_lag=})")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Launch config of the backward (two stages, or one kernel: ``fused_reduce``).

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
    prefetch_depth: the persistent stage 1 loads row block rb + prefetch_depth x G
      while it computes rb, holding that many row blocks' tiles in registers (>= 1).
    recompute_dx: the persistent stage 1 accumulates the dscale/dbias partials first
      and computes dx from the raw bf16 x and dy tiles converted again after the row
      reductions, so that the float32 x_hat and g are not live across them (bf16 x and
      dy, cast="torch"; otherwise only the partials move ahead of the row reductions,
      which shortens what is live across them). Bitwise the same either way.
    prefetch_stats: the persistent stage 1 loads the next row block's mean and rstd
      with its x and dy tiles (one row block ahead), not at the top of the row block
      that uses them: with one program a SM its barriers keep the warps in step, and
      that load's latency was exposed once a row block.
    reload_scale: the persistent stage 1 loads the scale's tile each row block (from
      L1/L2) instead of holding it in registers across the row blocks: fewer registers,
      so that two programs of 16 warps fit a SM (FP8-x LayerNorm with 2-byte scale/bias
      and recompute_dx: 64 registers, against 79 with the scale held). Bitwise the same.
    joint_row_sums: a row that fits the tile reduces LayerNorm's two row sums
      (sum(x_hat g) and sum(g)) as one reduction of the pair: one set of cross-warp
      barriers instead of two. Bitwise the same sums; no effect on RMSNorm (one sum).
      These three flags (prefetch_stats, reload_scale, joint_row_sums): the Pallas
      backend's persistent stage 1 only (the Triton backend's kernel ignores them).
    fused_reduce: for a row in one tile (``block_n >= N``), Pallas backend: one kernel
      instead of two. Its first ``num_programs`` programs are stage 1 without partials
      (dx only); cdiv(N, column_block_n) more programs each sum dscale (and dbias) of
      one column strip over all M rows, in row order, from x, dy and the forward's
      rstd (and mean), and store it in the parameter's dtype. x and dy are read twice
      (the second time mostly from L2), so it pays where a launch costs more than the
      reads: few rows. Deterministic (no atomics). (With ``num_programs`` = 1 the two
      stages are one kernel anyway: stage 1's one partial row is the sum.)
    column_block_m, column_block_n: with ``fused_reduce``, the column programs' tile:
      rows summed a step, columns a program (powers of 2).
    column_splits: for a row in one tile (``block_n >= N``), Pallas backend: programs a
      row-block group (a power of 2, at most block_n), the forward's
      ``ForwardConfig.column_splits`` for the backward. Each of a group's programs
      loads the whole tile for the row sums c1 (and c2), the same reductions as the
      one-program kernel's, then reloads its ``block_n / column_splits`` columns (from
      L2 but for the first) and writes their dx and dscale/dbias partials: no exchange
      between programs, no fill, and few rows spread over that many times more SMs
      (one row: over ``column_splits`` programs instead of one). 1: a program a group.
      Not with ``fused_reduce``, ``split_rows``, ``reload_rows``, ``pieces`` or FP8 x.

  Raises:
    ValueError: a block size or pieces that are not powers of 2 (pieces decreasing, and
      summing to at most block_n), split_rows with reload_rows (or either with
      fused_reduce), column_splits not a power of 2 <= block_n or with any of those
      (or pieces), num_programs < 1, a
      negative split_lag, or split_early_publish without split_rows and split_lag >= 1.
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
  prefetch_depth: int = 1
  recompute_dx: bool = False
  prefetch_stats: bool = False
  joint_row_sums: bool = False
  reload_scale: bool = False
  fused_reduce: bool = False
  column_block_m: int = 16
  column_block_n: int = 128
  column_splits: int = 1

  def __post_init__(self):
    object.__setattr__(self, "pieces", tuple(self.pieces))
    cs = self.column_splits
    if cs < 1 or cs & (cs - 1) or cs > self.block_n:
      raise ValueError(f"{self.column_splits=} must be a power of 2 <= block_n")
    if cs > 1 and (self.fused_reduce or self.split_rows or self.reload_rows or self.pieces):
      raise ValueError("column_splits > 1 is for a row in one tile without fused_reduce, "
                       "split_rows, reload_rows or pieces")
    if self.prefetch_depth < 1:
      raise ValueError(f"{self.prefetch_depth=} must be >= 1")
    p = self.pieces
    if any(v < 1 or v & (v - 1) for v in p) or any(a <= b for a, b in zip(p, p[1:])):
      raise ValueError(f"{self.pieces=} must be decreasing powers of 2")
    if sum(p) > self.block_n:
      raise ValueError(f"{self.pieces=} must fit block_n={self.block_n}")
    if self.split_rows and self.reload_rows:
      raise ValueError("split_rows and reload_rows are exclusive: pick one long-row kernel")
    if self.fused_reduce and (self.split_rows or self.reload_rows):
      raise ValueError("fused_reduce is for rows in one tile, not split_rows/reload_rows")
    for f in ("block_m", "block_n", "reduce_block_n", "reduce_block_g", "column_block_m",
              "column_block_n"):
      v = getattr(self, f)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{f}={v} must be a positive power of 2")
    if self.chunk_n < 0 or self.chunk_n & (self.chunk_n - 1):
      raise ValueError(f"{self.chunk_n=} must be 0 or a positive power of 2")
    if self.num_programs < 1:
      raise ValueError(f"{self.num_programs=} must be >= 1")
    _check_split_lag(self)


# ======================================================================= Tables
# Tuned configs are data (pallas_norm/tuning/, made by ``python -m pallas_norm.tune``): an
# entry stores a config's fields with ``num_programs`` as ``programs_per_sm`` (programs,
# times the splits of a row for ``split_rows``, over the SM count of the table's device;
# at least 1)
# and pieces as ``pieces_round`` (pieces of N rounded up to it; 0: none); the stage-2
# knobs are ``reduce_config``'s. ``from_entry`` rebuilds a config for the actual shape
# and device, and returns None where it does not fit (the caller then takes the default).


def dtype_name(dtype) -> str:
  """A dtype's name for a table key ("bfloat16"); "none" for None."""
  if dtype is None:
    return "none"
  try:
    return np.dtype(dtype).name
  except TypeError:  # a torch dtype (the Triton backend's tests)
    return str(dtype).rsplit(".", 1)[-1]


def table_key(pass_: str, m: int, n: int, dtype, *, subtract_mean: bool,
              residual: bool = False, llama: bool = False,
              param_dtype=None, post_norm: bool = False) -> _tuning.Key:
  """The tuning key of one kernel call (pallas_norm.tuning's docstring)."""
  return _tuning.Key(pass_, _tuning.family(subtract_mean, residual, llama, post_norm),
                     dtype_name(dtype), dtype_name(param_dtype), int(n), int(max(m, 1)))


def entry_fields(cfg, n: int, num_sms: int, m: int | None = None) -> dict:
  """A ForwardConfig's or BackwardConfig's fields as a table stores them (above); with
  ``m``, a grid clamped to the row blocks of m rows is stored as at least one program a
  SM (one program for M = 1 says nothing of the grid for more rows)."""
  f = dataclasses.asdict(cfg)
  f.pop("mode", None)
  for k in ("reduce_block_n", "reduce_block_g", "reduce_num_warps"):
    f.pop(k, None)
  splits = cdiv(n, cfg.block_n) if cfg.split_rows else 1
  pps = round(cfg.num_programs * splits / num_sms, 6)
  clamped = m is not None and cfg.num_programs == cdiv(m, cfg.block_m)
  f["programs_per_sm"] = max(1.0, pps) if clamped else pps
  del f["num_programs"]
  if "pieces" in f:
    pieces = f.pop("pieces")
    f["pieces_round"] = pieces[-1] if pieces else 0
  return f


def entry_tile(fields: dict, entry_n: int, m: int, n: int, interpret: bool):
  """(fields, programs_per_sm) of a table entry made at N = ``entry_n``, its tile rebuilt
  for x [m, n]: block_n the whole padded row where the entry's was, else at most it;
  block_m at most next_power_of_2(m) (interpret mode: at least min(64, that)).

  Raises:
    ValueError, TypeError: a field that is not a number."""
  f = dict(fields)
  pps = float(f.pop("programs_per_sm", 0))
  bn_full, bn_entry = next_power_of_2(n), next_power_of_2(entry_n)
  bn = int(f.get("block_n", bn_full))
  f["block_n"] = bn_full if bn >= bn_entry else min(bn, bn_full)
  block_m = min(int(f.get("block_m", 1)), next_power_of_2(m))
  f["block_m"] = _cpu_block_m(block_m, m) if interpret else block_m
  return f, pps


def from_entry(entry: _tuning.Entry, m: int, n: int, device: DeviceInfo, backend: str):
  """``entry``'s config rebuilt for x viewed as [m, n] on ``device`` (``entry_tile``;
  programs_per_sm times this device's SMs), or None where it does not fit."""
  try:
    f, pps = entry_tile(entry.fields, entry.key.n, m, n, device.platform == "cpu")
    if f.get("chunk_n"):
      f["chunk_n"] = min(int(f["chunk_n"]), f["block_n"])
    splits = cdiv(n, f["block_n"]) if f.get("split_rows") else 1
    programs = max(1, min(int(round(pps * device.num_sms)) // splits,
                          cdiv(m, f["block_m"])))
    if entry.key.pass_ == "bwd":
      r = int(f.pop("pieces_round", 0))
      pieces = (_binary_pieces(cdiv(n, r) * r) if r and f["block_n"] >= n
                and cdiv(n, r) * r <= f["block_n"] else ())
      if f["block_n"] < n:  # the column splits of a row in one tile
        f.pop("column_splits", None)
      if programs == 1 or not f.get("fused_reduce"):  # one program: stage 1 is the sum
        f["fused_reduce"] = False
        f.pop("column_block_m", None)
        f.pop("column_block_n", None)
      else:
        f["column_block_m"] = min(int(f.get("column_block_m", 16)), next_power_of_2(m))
        f["column_block_n"] = min(int(f.get("column_block_n", 128)), next_power_of_2(n))
      cfg = BackwardConfig(**f, num_programs=programs, pieces=pieces,
                           **reduce_config(n, programs, backend))
    else:
      mode = entry.mode
      if mode != "multi_wave_cached" or f["block_n"] < n:
        f.pop("hoist_params", None)
      if (mode == "multi_wave_cached" and f["block_n"] < n) or f.get("split_rows"):
        f.pop("stream_x", None)  # the split-row kernels ignore it
      if mode != "static_persistent" or f["block_n"] < n:
        f.pop("reload_params", None)
      cfg = ForwardConfig(mode=mode, **f,
                          num_programs=programs if mode == "static_persistent" else 0)
  except (TypeError, ValueError):
    return None
  return cfg if fits(cfg, n, device, backend) else None


def fits(cfg, n: int, device: DeviceInfo, backend: str) -> bool:
  """Whether ``cfg`` can run rows of N on ``device`` with ``backend`` (the launchers'
  own limits, checked before any kernel is traced)."""
  bn_full = next_power_of_2(n)
  gpu = device.platform == "gpu"
  splits = cdiv(n, cfg.block_n)
  # a tile's registers (interpret mode raises block_m for speed: no such limit)
  if (gpu and cfg.block_m * cfg.block_n > 65536) or cfg.block_n > max(bn_full, 1):
    return False
  if cfg.split_rows and (backend != "pallas" or cfg.block_n >= n or (
      gpu and splits > device.num_sms * split_resident_programs(cfg.num_warps))):
    return False
  if isinstance(cfg, ForwardConfig):
    if cfg.column_splits > 1 and (backend != "pallas" or cfg.block_n < n):
      return False
    if cfg.mode == "multi_wave_cached" and cfg.block_n < n:  # the split-row kernel
      return backend == "pallas" and (not gpu or splits <= device.num_sms)
    if cfg.mode == "multi_wave_cached" and bn_full > _CACHED_MAX_BLOCK_N:
      return False
    return True
  if backend != "pallas" and (cfg.pieces or cfg.reload_rows or cfg.fused_reduce
                              or cfg.column_splits > 1):
    return False
  return cfg.block_n >= n or not (cfg.pieces or cfg.fused_reduce or cfg.column_splits > 1)


def _tuned(pass_: str, m: int, n: int, dtype, device: DeviceInfo, *, backend: str,
           mode: str | None, subtract_mean: bool, residual: bool, llama: bool,
           param_dtype, post_norm: bool = False):
  """The tables' config for this call (``from_entry``), or None: no entry, or it does
  not fit. An entry measured at another shape that is its (backend, mode)'s default
  there (the tuner kept the default) gives this shape's default of that mode: it says
  "the default", not "this tile" (measured: docs/tuning.md, "The lookup"); one that is
  the default there, its mode too, gives this shape's default, mode and all, where the
  caller left ``mode`` open."""
  key = table_key(pass_, m, n, dtype, subtract_mean=subtract_mean, residual=residual,
                  llama=llama, param_dtype=param_dtype, post_norm=post_norm)
  found = _tuning.lookup(key, device.name, backend=backend, mode=mode,
                         gpu=device.platform == "gpu")
  if found is None:
    return None
  e = found[0]
  if (e.key.m, e.key.n) != (m, n):
    kw = dict(subtract_mean=subtract_mean, backend=backend, residual=residual,
              param_dtype=param_dtype, llama=llama, tuned=False)
    if pass_ != "bwd":
      kw.update(return_residuals=pass_ == "fwd_stats", post_norm=post_norm)
    def default_at(m, n, mode_=None):
      try:
        if pass_ == "bwd":
          return backward_config(m, n, dtype, device, **kw)
        return forward_config(m, n, dtype, mode_, device, **kw)
      except (ValueError, NotImplementedError):
        return None
    own = from_entry(e, e.key.m, e.key.n, device, backend)
    # first the default, its mode included, where the caller left the mode open
    # (8192x5120 ran the 8192x8192 default's mode 9% slower than its own:
    # docs/tuning.md, "The lookup"); then the entry mode's default (the backward has
    # no mode: one test)
    for mode_ in dict.fromkeys(([None] if mode is None else []) + [e.mode or None]):
      if own == default_at(e.key.m, e.key.n, mode_):
        return default_at(m, n, mode_)
  return from_entry(e, m, n, device, backend)


def search_space(pass_: str, m: int, n: int, device: DeviceInfo, *, backend: str,
                 mode: str | None, subtract_mean: bool,
                 post_norm: bool = False, residual: bool = False) -> dict[str, tuple]:
  """Each tunable field's domain for one key (the tuner's coordinate search, one field at
  a time, in this order: the kernel's structure first, then tiles, warps and programs,
  then the flags). Values are table fields (``entry_fields``); combinations that do not
  fit are pruned by ``from_entry``. ``post_norm``: the one-kernel forward of
  ``post_norm_scale=`` (multi_wave_cached, a row a program: no column splits).
  ``residual`` with an FP8-output pass: the delayed kernel's residual variant (a row
  block a program: its tile, warps and ``tile_params``)."""
  bn_full = next_power_of_2(n)
  rows = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= next_power_of_2(m))
  warps = (1, 2, 4, 8, 16, 32)
  if post_norm:
    return dict(hoist_params=(False, True), block_m=rows, num_warps=warps,
                stream_x=(True, False))
  per_sm = (1, 2, 3, 4, 6, 8)
  chunks = tuple(c for c in (1024, 2048, 4096, 8192, 16384) if c < bn_full)
  pallas = backend == "pallas"
  space: dict[str, tuple] = {}
  if pass_.startswith("fp8_"):  # kernels/fp8.py's Fp8Config, and its kernel's flag
    if residual:  # the row-block kernel alone (kernels.fp8.residual_config)
      return dict(block_m=rows, num_warps=warps, tile_params=(False, True))
    if pass_.startswith("fp8_quantise"):
      return dict(block_n=(128, 256, 512, 1024), block_m=rows, num_warps=warps,
                  bottom_up=(False, True))
    space.update(block_m=rows, num_warps=warps, programs_per_sm=(0,) + per_sm,
                 tile_params=(False, True), hoist_params=(False, True),
                 row_amax=(False, True), packed=(False, True), stream_x=(False, True),
                 packed_params=(False, True), column_splits=(1, 2, 4, 8, 16))
    if pass_ == "fp8_delayed_t":
      space["separate"] = (False, True)
    return space
  if pass_ == "bwd":
    # Pallas may hold N' 16384 as one tile a row, as the default does from 8 to 64 rows;
    # past 64 rows the tuner measures it (its seed: tune.py's few-row default)
    one_tile = bn_full <= (_FEW_ROWS_MAX_BLOCK_N if pallas else _BWD_SINGLE_TILE_MAX)
    if bn_full > _BWD_SINGLE_TILE_MAX:
      # Pallas's split row also at 128 and 256 columns a split (fewer row groups at the
      # same programs a SM: fewer dscale partials). Where timed they lost (RMSNorm
      # 512x16384, 1 warp: 128 / 256 / 512 columns 37.0 / 23.7 / 20.5 us,
      # docs/tuning.md, "At d36f12e"); the search keeps them (two candidates a key)
      # for GPUs of other SM counts and occupancy.
      narrow = (128, 256) if pallas else ()
      space["block_n"] = (tuple(c for c in narrow + (512,) + chunks if c < bn_full)
                          + ((bn_full,) if one_tile else ()))
      if pallas:
        space.update(split_rows=(False, True), reload_rows=(False, True),
                     split_lag=(1, 2, 3), split_early_publish=(False, True),
                     chunk_n=(0, 128, 256, 1024, 2048))
    if pallas and one_tile and m > 1:
      space["fused_reduce"] = (False, True)
    space.update(block_m=rows, num_warps=warps, programs_per_sm=per_sm)
    if pallas and one_tile and m > 1:
      space.update(column_block_n=(32, 64, 128, 256, 512), column_block_m=rows)
    if pallas and one_tile:
      space["column_splits"] = (1, 2, 4, 8, 16)  # few rows over more SMs (fused: pruned)
      if subtract_mean:
        space.update(pieces_round=(0, 512, 1024), joint_row_sums=(False, True))
      space.update(prefetch_stats=(False, True), recompute_dx=(False, True),
                   reload_scale=(False, True), prefetch_depth=(1, 2))
    return space
  if mode == "multi_wave_cached" and pallas and n > _SPLIT_MIN_N:
    space.update(block_n=(2048, 4096, 8192, 16384), chunk_n=(0, 1024, 2048, 4096))
  elif mode == "multi_wave_cached":
    space["hoist_params"] = (False, True)
    if pallas:
      space["column_splits"] = (1, 2, 4, 8, 16)
  elif mode == "multi_wave_reload":
    space.update(block_n=chunks or (bn_full,), num_stages=(1, 2))
  elif mode == "static_persistent":
    whole = (bn_full,) if bn_full <= _CACHED_MAX_BLOCK_N else ()
    space.update(block_n=whole + chunks, programs_per_sm=per_sm)
    if pallas and bn_full > _BWD_SINGLE_TILE_MAX:
      space.update(split_rows=(False, True), split_lag=(1, 2, 3),
                   split_early_publish=(False, True))
  space.update(block_m=rows, num_warps=warps)
  whole_row = (mode == "static_persistent" and bn_full <= _CACHED_MAX_BLOCK_N
               or mode == "multi_wave_cached" and "chunk_n" not in space)
  if pallas and (whole_row or mode != "multi_wave_cached"):  # x's loads: .cg or not
    space["stream_x"] = (True, False)  # (not read by the split-row cached kernel)
  if pallas and whole_row and mode == "static_persistent":
    space["reload_params"] = (False, True)
  return space


# ======================================================================== Rules
# One rule a line (or a small table): the value, a one-line reason, and [T#anchor]: the
# section of docs/tuning_rules.md with the measurement (device, date, figures, results file).
# Times are H200 bf16 kernel times in us unless a line says otherwise; "a/b" is the
# rule's pick (a) against the alternative (b); N' is next_power_of_2(N).

# ---- Forward: the mode by row length (choose_mode's fall-through, both backends).
# multi_wave_cached up to N' 8192 (4096x8192: 36.4/38.8 reload); reload wins past it.
_HEURISTIC_CACHED_MAX = 8192  # [T#fwd-modes]
# N > 32768: static_persistent, 16384-wide chunks (4096x65536: 354.7/404.1 reload).
_HEURISTIC_RELOAD_MAX = 32768  # [T#long-rows]
_PERSISTENT_CHUNK_N_LARGE = 16384  # [T#long-rows]
# The longest row multi_wave_cached holds in registers: 32768 f32 over 16 warps is 64
# registers a thread for x alone.
_CACHED_MAX_BLOCK_N = 32768  # [T#cached-max]

# ---- Forward tile and warps.
# Rows packed into ~4096-element tiles, every mode (32768x128: 5.8 at 32 rows, 5.9 at 16).
_FWD_TILE_ELEMS = 4096  # [T#fwd-tile]
# RMSNorm: warps = tile / 1024 in [4, 8] (4096x1024: 6.4 at 4, 6.8 at 8). [T#fwd-warps]
_FWD_MIN_WARPS, _FWD_MAX_WARPS, _FWD_ELEMS_PER_WARP = 4, 8, 1024
# LayerNorm single tile: >= 2 rows, >= 2048 elements, tile / 2048 warps (8192^2: 81.4/96.2
# for RMSNorm's rule). [T#ln-fwd-tile]
_LN_MIN_BLOCK_M, _LN_TILE_ELEMS, _LN_ELEMS_PER_WARP = 2, 2048, 2048
# LayerNorm N' <= 256: at least 2 warps (32768x128: 6.9/7.6 at 1). [T#ln-fwd-tile]
_NARROW_BLOCK_N, _LN_NARROW_MIN_WARPS = 256, 2
# LayerNorm N' = 2048, Pallas: 4 warps, not 2 (8192x2048: 20.3/21.0). [T#ln-fwd-tile]
_LN_2048_WARPS = 4
# LayerNorm 2048 < N <= 3072, Pallas: [1, 4096] at 4 warps, not [2, 4096] (8192x3072:
# 29.0-30.1/31.1-31.2). [T#ln-fwd-tile]
_LN_ONE_ROW_MAX_N, _LN_ONE_ROW_WARPS = 3072, 4
# LayerNorm N' = 8192: one row a tile at 8 warps (4096x8192: 40.4/42.4 [2, 8192]). [T#ln-fwd-tile]
_LN_WIDE_BLOCK_N, _LN_WIDE_WARPS = 8192, 8
# ... and 4 warps for N <= 5120 (8192x5120: 48.0/48.8 at 8). [T#ln-fwd-tile]
_LN_WIDE_PADDED_MAX_N, _LN_WIDE_PADDED_WARPS = 5120, 4

# ---- Forward: chunked rows (multi_wave_reload, chunked static_persistent).
# 8192-wide chunks up to N = 32768 (16384^2: 286/299 at 4096), 4096 beyond
# (4096x65536: 389/395 at 8192), 16 warps (8 warps: 302/411/441). [T#reload-chunk]
_RELOAD_CHUNK_N_SMALL, _RELOAD_CHUNK_N_LARGE, _RELOAD_WARPS = 8192, 4096, 16
# Pallas: both passes unrolled up to 4 chunks (LayerNorm 4096x65536: 413.1 -> 402.1).
RELOAD_UNROLL_MAX_CHUNKS = 4  # read by kernels/forward.py. [T#reload-unroll]
# static_persistent: SMs x 4 programs (4096^2: 18.8/19.0 at 2 a SM). [T#persistent-occupancy]
_PERSISTENT_OCCUPANCY = 4

# ---- Forward, Pallas: static_persistent with the row as one hoisted-scale [1, N'] tile.
# The Pallas launch leaves little L1, so multi-wave programs re-read scale from L2 every
# row. (rows longer than, rows up to, num_warps, programs a SM, largest itemsize, a
# substring of the device name); block_n is N'. [T#persistent-tile]
_RMS_PERSISTENT_TILES = (
    (12288, 16384, 32, 1, 4, "H200"),  # 16384^2: 274.6/291.8 reload; H100: 379.7/365.8
    (6144, 8192, 16, 2, 4, "H200"),    # 8192^2: 68.3/70.2 cached; H100: 94.9/91.6
)
_LN_PERSISTENT_TILES = (
    (8192, 16384, 16, 1, 4, ""),       # 16384^2: 295.5/327.4 reload; H100 374.0/397.7
    (4096, 5120, 4, 3, 2, "H200"),     # 8192x5120: 46.1/46.9; f32 and the H100 lose
)

# ---- Forward, Pallas: float32 scale/bias with a 2-byte x (the functional API called
# with float32 parameters; the Flax layers cast them to x's dtype): static_persistent
# [2, N'] tiles load them once a program where multi-wave tiles re-read them every row
# (LayerNorm 4096x8192 62.4 -> 38.5). (LayerNorm, N', block_m, num_warps, programs a
# SM, devices). [T#f32-params]
_F32_PARAMS_TILES = (
    (True, 8192, 2, 8, 1, ("H100", "H200")),
    (True, 4096, 2, 8, 2, ("H100", "H200")),
    (False, 4096, 2, 8, 2, ("H100", "H200")),
    (False, 8192, 2, 16, 2, ("H100",)),
)

# ---- Forward, Pallas: rows split over programs that exchange partial statistics.
# RMSNorm N > 16384: multi_wave_cached over cdiv(N, 8192) programs of 4 warps, while
# cdiv(N, 8192) <= SMs (1024x262144: 361.2/419.7 persistent). [T#rms-split]
_SPLIT_MIN_N = 16384
_SPLIT_BLOCK_N, _SPLIT_WARPS = 8192, 4
_SPLIT_CHUNK_N = 4096  # a split held as 4096-wide chunks (4096x65536: 292/304). [T#split-chunks]
# LayerNorm N > 32768 with mode="multi_wave_cached": 4096-wide splits of 1 warp in
# 1024-wide chunks (4096x65536: 373.8/405.0); the heuristic takes the persistent split.
_LN_SPLIT_MIN_N = 32768  # [T#ln-split]
_LN_SPLIT_BLOCK_N, _LN_SPLIT_WARPS, _LN_SPLIT_CHUNK_N = 4096, 1, 1024  # [T#ln-split]
# LayerNorm 16384 < N <= 4096 x SMs: static_persistent split_rows, W-wide splits of 1
# warp, W = 1024 up to 65536 else 2048, 16384 / W programs a SM, early publish 2 ahead
# (4096x65536: 347.3/375.0; early publish 1024x262144: 363/391). [T#ln-persistent-split]
_LN_PSPLIT_MIN_N, _LN_PSPLIT_WIDE_N = 16384, 65536
_LN_PSPLIT_W, _LN_PSPLIT_WIDE_W, _LN_PSPLIT_COLS_PER_SM = 1024, 2048, 16384
_LN_PSPLIT_LAG = 2  # a lead of 3: 362.4/348.9 against 2's 363/347. [T#ln-persistent-split]

# ---- Few rows (decode, sampling), rows wider than _NARROW_BLOCK_N, 2-byte and wider
# dtypes. The forward up to 64 rows: a row a program at >= 4 warps, N'/1024 up to 16
# (flat: RMSNorm 8x4096 1.9-2.1 us over 2-16 warps and the modes). The backward up to 8
# rows: a row a program (LayerNorm 8x4096 2.3/2.9 us at [2, 4096]; at 64 rows the
# rows-a-tile rule wins: 5.1/5.4, RMSNorm 64x1024 2.9/3.2). multi_wave_cached loads
# scale/bias with x (hoist_params) up to 4 waves of programs (RMSNorm 1x4096 2.0/2.4 us,
# 64x4096 2.1/2.7, 512x4096 3.9/4.4; LayerNorm 512x4096 5.0/5.3). H200. [T#few-rows]
_FEW_ROWS_M, _FEW_ROWS_BWD_ONE_ROW_M, _FEW_ROWS_MAX_WARPS, _HOIST_MAX_WAVES = 64, 8, 16, 4
# ... and rows up to N' = 16384 as one tile a row there, forward (multi_wave_cached, not
# the persistent or reload picks of many rows) and backward (not the split-row kernel),
# from 8 rows at N' = 16384: fwd+bwd 8x16384 and 64x16384 23-38% faster in all four ops
# (RMSNorm 8.3 -> 5.8 us, 13.1 -> 8.9), forwards -6 to +2%; at 1x16384 the split
# backward, a row over many SMs, stays 12-14% ahead. H200. [T#few-rows]
_FEW_ROWS_MAX_BLOCK_N, _FEW_ROWS_WIDE_MIN_M = 16384, 8
# ... and up to 8 rows of N' 8192-16384 split over programs that each load the whole row
# for its statistics and store a share of its columns (ForwardConfig.column_splits, XLA's
# few-row schedule): RMSNorm 4 a row (1x16384 2.9 -> 2.3 us, 8x16384 3.0 -> 2.4, 8x8192
# 2.3 -> 2.1), LayerNorm 8 (1x16384 4.4 -> 3.4, 8x8192 3.4 -> 3.0); under jax.vjp (mean/
# rstd written). Slower from 64 rows (RMSNorm 64x8192 2.4 -> 2.6 at 4) and level or
# slower at N' <= 4096 (RMSNorm 8x4096 1.9 -> 2.0). H200. [T#few-rows]
_COLUMN_SPLIT_MAX_M, _COLUMN_SPLIT_MIN_BLOCK_N = 8, 8192
_COLUMN_SPLITS_RMS, _COLUMN_SPLITS_LN = 4, 8

# ---- Backward: few rows. One kernel (fused_reduce) up to _FEW_ROWS_M rows (a column
# program then sums at most 4 row steps; at 512x4096 it lost, 19.2/8.2 us, H200); the
# column programs' tile. [T#few-rows]
_FUSED_COLUMN_BLOCK_M, _FUSED_COLUMN_BLOCK_N = 16, 128

# ---- Backward (stage 1): single tiles.
# One register tile up to N' 8192 (16384^2 as one tile: 812 us/686 the pair). [T#bwd-single-tile]
_BWD_SINGLE_TILE_MAX = 8192
# block_m = 4096 / block_n rows (4096x1024: 10.8 at 4 rows, 11.9 at 2). [T#bwd-tile]
_BWD_TILE_ELEMS = 4096
# Warps: 4 below N' 4096 (4096x1024: 10.8/11.9 at 8), else N' / 256 (4096x8192: 57.9/61.1
# at 16). [T#bwd-grid-warps]
_BWD_MIN_WARPS, _BWD_WIDE_MIN_BLOCK_N, _BWD_ELEMS_PER_WARP = 4, 4096, 256
# Grid: 2 programs a SM up to N' 4096 (4096^2: 31.7/33.4 at 1), else 1 (4096x8192:
# 57.9/63.3 at 2). [T#bwd-grid-warps]
_BWD_TWO_PER_SM_MAX_BLOCK_N = 4096
# N' <= 256: [2048 / N', N'] tiles, 2 warps, SMs x 4, RMSNorm's G rounded down to a
# power of 2 (32768x128: 11.2/11.6; G 512: 11.13/11.36 at 528). [T#bwd-narrow]
_BWD_NARROW_TILE_ELEMS, _BWD_NARROW_WARPS, _BWD_NARROW_OCCUPANCY = 2048, 2, 4
# LayerNorm N' 4096 and 8192: 16 warps, 1 program a SM (8192x5120: 97.9/112.2). [T#bwd-ln-tile]
_BWD_LN_TILE_MIN_BLOCK_N, _BWD_LN_TILE_WARPS = 4096, 16
# LayerNorm N' = 4096, Pallas: 2-row blocks (8192x4096: 66.9/75.3 at [1, 4096]; with the
# fused residual add 83.6/88.7 at [1, 4096] and /88.7 at [2, 4096] x 8). [T#bwd-ln-4096]
_BWD_LN_4096_BLOCK_M = 2
# LayerNorm 2048 < N <= 3072, Pallas: the tile as pieces 2048 + 512 or 1024 (N rounded
# up to 512), 8 warps, 2 a SM (8192x3072: 53.1/71.4). [T#bwd-ln-pieces]
_BWD_LN_PIECES_MAX_N, _BWD_LN_PIECES_ROUND, _BWD_LN_PIECES_WARPS = 3072, 512, 8
_BWD_LN_2048_WARPS = 8  # LayerNorm [2, 2048], Pallas (8192x2048: 33.8/35.3 at 4). [T#bwd-ln-2048]

# ---- Backward (stage 1), Pallas: rows wider than one tile split over programs.
# W the narrowest of 512, 1024, ... with 4 N <= W^2, W / 512 warps, published 2 row
# blocks ahead, programs a SM as registers allow: RMSNorm 20 warps, LayerNorm 16
# (16384^2 RMSNorm: 500.2/511.1 reload). All of a row's programs resident. [T#bwd-split]
_BWD_SPLIT_MIN_W, _BWD_SPLIT_ELEMS_PER_WARP, _BWD_SPLIT_LAG = 512, 512, 2
_BWD_SPLIT_RMS_WARPS_PER_SM, _BWD_SPLIT_LN_WARPS_PER_SM = 20, 16
# LayerNorm 32768 < N with W <= 1024: W = 1024 at 1 warp, 8 a SM, early publish 3 ahead
# (4096x65536: 552.3/616.0). [T#bwd-split-ln-early]
_BWD_SPLIT_LN_EARLY_MIN_N, _BWD_SPLIT_LN_EARLY_W, _BWD_SPLIT_LN_EARLY_LAG = 32768, 1024, 3
_BWD_SPLIT_LN_EARLY_WARPS_PER_SM = 8
# Longer rows and the Triton backend: the row-statistics + column-tiled pair, 4096-wide
# chunks, 16 warps, 2 x SMs / chunks programs a column (16384^2: 686 us). [T#bwd-pair]
_BWD_CHUNK_N, _BWD_CHUNK_WARPS, _BWD_CHUNK_OCCUPANCY = 4096, 16, 2
# reload_rows: no rule picks it since the split beat it (16384^2: 500.2/511.1). [T#bwd-reload]

# ---- Backward stage 2: all G partial rows of a column strip in one tile of at most
# 8192 f32, one load deep (a loop over G cost ~8 us at N = 1024). [T#reduce]
_REDUCE_TILE = 8192
# Stage 2's warps on the Pallas backend: a tile / 1024 (8 for a full tile), not / 512:
# up to 0.9 us faster a backward, slower nowhere (LayerNorm + residual 8192x4096
# 83.7/83.1). The Triton backend keeps tile / 512 (not measured). [T#reduce]
_REDUCE_ELEMS_PER_WARP = 1024
_REDUCE_MAX_BLOCK_G, _REDUCE_MIN_BLOCK_N = 1024, 8  # bounds, not measured. [T#unmeasured]

# ---- The fused residual add (residual=), Pallas, H200, 2-byte dtypes. The plain norm's
# picks, except (bf16 x and residual, 2026-11-23): [T#residual]
# RMSNorm rows the one-tile persistent forward takes up to N = 8192 go to
# multi_wave_cached (8192^2: 135.2/178.4; the prefetched x + r sum is a second tile).
_RES_NO_PERSISTENT_TILE_MAX_N = 8192
# LayerNorm N' = 4096 (N > 3072): forward [1, 4096] at 8 warps (8192x4096: 70.5/73.5 at
# [2, 4096] x 4; 16384x4096: 136.1/142.2); the backward takes the plain rule
# ([T#bwd-ln-4096]).
_RES_LN_4096_FWD = (1, 8)  # (block_m, num_warps)

# ---- FP8 x (x_scale=), RMSNorm forward at N' = 4096: [2, 4096] x 4 warps, not the
# one-row tile (8192x4096 under jax.vjp: 31.0/38.9). [T#fp8-in-fwd]
_FP8_RMS_FWD_BLOCK_N = 4096
_FP8_RMS_FWD_TILE = (2, 4)  # (block_m, num_warps)
# N' = 8192 (static_persistent, 2 programs a SM): [2, 8192] x 16 warps, not [1, 8192] x
# 16. H200, 2026-11-26, 8192x8192, with / without residuals: 63.5/76.0 against
# 84.0/79.1 us (multi_wave_cached [2, 8192] x 8: 67.7/67.2). [T#fp8-in-fwd]
_FP8_RMS_PERSISTENT_8192 = (2, 16)  # (block_m, num_warps)
# H100: that tile at 2 programs a SM only where the forward also writes mean/rstd
# (jax.vjp; 8192x8192 80.4/84.1 with a bf16 scale); the forward alone keeps
# multi_wave_cached [1, 8192] x 8 (77.4/87.9). [T#fp8-in-fwd]
_FP8_RMS_PERSISTENT_8192_H100_PER_SM = 2  # the tile: _FP8_RMS_PERSISTENT_8192
# H100, FP8-x LayerNorm forward at N' = 4096 without mean/rstd, 2-byte scale/bias, no
# residual add: [1, 4096] x 8, not [2, 4096] x 4 (8192x4096 40.7/43.0). [T#fp8-in-fwd]
_FP8_LN_FWD_H100_PRIMAL_2B = (1, 8)  # (block_m, num_warps)
# H100, FP8 x at N' = 8192: float32 scale/bias take static_persistent [2, 8192] x 16 at
# 2 a SM (_fp8_h100_8192; LayerNorm 88.8/132.5); LayerNorm with 2-byte scale/bias under
# jax.vjp takes multi_wave_cached [2, 8192] x 16 (88.2/107.7). [T#fp8-in-fwd]
_FP8_LN_FWD_H100_RES_8192_2B = (2, 16)  # (block_m, num_warps)
# H100, FP8-x LayerNorm backward at N' = 4096: [1, 4096] x 32 warps, 1 a SM (the bf16
# tile [2, 4096] x 16 spills with FP8 x; 8192x4096 82.8/107.6). [T#fp8-in-bwd]
_FP8_LN_4096_BWD_H100 = (1, 32, 1)  # (block_m, num_warps, programs a SM)
# H100, FP8 x, 2-byte scale: the one-tile stage 1 at 8 elements a thread and 1024 threads
# a SM where recompute_dx and reload_scale bring it to 64 registers (LayerNorm 8192x4096
# 68.6/77.1); a float32 scale does not fit. {(subtract_mean, N'): (block_m, num_warps,
# programs a SM, BackwardConfig flags)}, prefetch_stats and joint_row_sums on as in every
# variant measured. [docs/fp8_tuning.md#fp8-x-occupancy]
_FP8_BWD_LN_FLAGS = dict(prefetch_stats=True, joint_row_sums=True)
_FP8_BWD_H100_2B = {
    (True, 2048): (1, 8, 4, dict(_FP8_BWD_LN_FLAGS, reload_scale=True)),
    (True, 4096): (1, 16, 2, dict(_FP8_BWD_LN_FLAGS, recompute_dx=True, reload_scale=True)),
    (True, 8192): (1, 32, 1, dict(_FP8_BWD_LN_FLAGS, recompute_dx=True)),
    (False, 2048): (1, 8, 4, dict(prefetch_stats=True, recompute_dx=True)),
}
# H100, FP8 x at 8192 < N <= 16384 (Pallas, no residual add): the forward's mode by op and
# by whether it writes mean/rstd (RMSNorm alone multi_wave_cached, 4096x16384
# 79.3/106.4). {(subtract_mean, return_residuals): mode} [docs/fp8_tuning.md#fp8-x-wide]
_FP8_WIDE_MODES_H100 = {(False, False): "multi_wave_cached",
                        (False, True): "static_persistent",
                        (True, True): "multi_wave_cached"}
_FP8_WIDE_MIN_N, _FP8_WIDE_MAX_N = 8192, 16384
# ... with 2-byte scale/bias, LayerNorm's plain forward: multi_wave_cached [1, 16384] x 16
# (4096x16384 82.9/89.7), looked up before the table above. [docs/fp8_tuning.md#fp8-x-wide]
_FP8_WIDE_MODES_H100_2B = {(True, False): "multi_wave_cached"}
_FP8_LN_FWD_H100_PRIMAL_16384_2B = (1, 16)  # (block_m, num_warps)
# ... and RMSNorm's static_persistent under jax.vjp there: rows split over programs,
# 1024-wide splits of 1 warp, 16 programs a SM, early publish 2 ahead (forward + backward
# 4096x16384 246.5/253.2 us with the one-tile forward, its forward 93.6/103.4; 8192x16384
# 483.6/497.9; LayerNorm's split forwards were slower, 316.0/277.4).
# (split width, programs a SM) [docs/fp8_tuning.md#fp8-x-wide-split]
_FP8_RMS_VJP_SPLIT_H100 = (1024, 16)
# LayerNorm N' = 8192 backward: 32 warps (8192^2: 158.0/171.6 at 16; H100 with
# recompute_dx 4096x8192 105.5/107.7). [T#recompute-dx]
_RES_LN_8192_BWD_WARPS = 32
_RES_LN_8192_BWD_WARPS_DEVICES = ("H200", "H100")
_RES_DEVICE, _RES_MAX_ITEMSIZE = "H200", 2
# LayerNorm + residual, N' = 8192, bf16, Pallas, every GPU: recompute_dx, x and dy
# converted again for dx after the row reductions ([1, 8192] x 32 spills without it;
# H100 4096x8192 105.5/107.7 at 32 warps). [T#recompute-dx]
_RES_LN_8192_BWD_RECOMPUTE = True

# ---- Backward stage 1, the persistent one-tile kernel (N' <= 8192), Pallas, 2-byte
# dtypes and FP8 x, on _STAGE1_FLAGS_DEVICES, from N' = 512: prefetch_stats (mean/rstd a
# row block ahead) and joint_row_sums (LayerNorm) by op, N' and residual add, where each
# measured faster (_stage1_flags; LayerNorm 8192x4096 74.6/80.7 with prefetch_stats, H100).
# [T#stage1-flags]
_STAGE1_FLAGS_DEVICES = ("H100",)
_STAGE1_FLAGS_MIN_BLOCK_N = 512

# ---- backend=None: the backend of each kernel (forward, backward), where one measured
# faster than the Pallas backend side by side; everywhere else "pallas". Entries:
# (device name substring, pass "fwd"/"bwd", op "rms"/"layer" or, with the fused
# residual add, "rms_res"/"layer_res", N low, N high, backend), 2-byte dtypes (ops
# checks that the backend serves the call, else "pallas"). [T#backend]
_BACKEND_RULES = (
    # H100, 2026-11-25, bf16 backward (fwd+bwd minus fwd, us, triton/pallas): 8192x1024
    # 21.2/23.2, 8192x2048 38.8/42.8, 32768x2048 138.9/152.3, 8192x4096 72.2/75.3,
    # 16384x4096 137.7/141.9; at N = 8192 73.9/74.4, beyond slower
    ("H100", "bwd", "rms", 513, 4096, "triton"),
    # H200, 2026-11-23, the same difference: 8192x4096 54.9/59.3, 16384x4096
    # 103.3/108.6, 32768x2048 105.0/118.6; 8192x8192 113.6/106.6 (slower)
    ("H200", "bwd", "rms", 1025, 4096, "triton"),
    # H100, 2026-11-25, LayerNorm backward at N' = 2048 on Mosaic GPU (mosaic/pallas):
    # 8192x2048 41.9/42.5, 32768x2048 144.7/148.7 (Triton: 44.2, 151.5)
    ("H100", "bwd", "layer", 1025, 2048, "mosaic"),
    # H200, LayerNorm forward, us pallas/triton in three runs (2026-11-23 a4f17a0,
    # 2026-11-26 b48c78c twice): 8192x4096 1.013/1.027/1.024, 16384x4096 1.040/1.035,
    # 4096x8192 1.024/1.028, 8192x8192 1.072/1.063; at N = 2048 a tie or slower
    # (32768x2048 1.008/1.001, 8192x2048 0.957)
    ("H200", "fwd", "layer", 2049, 8192, "triton"),
    # H200, the fused residual add (x, residual and h in x's dtype), us triton/pallas in
    # two runs (2026-11-23 a4f17a0, 2026-11-26 42c360e). Forward: RMSNorm 8192x4096
    # 66.1/67.7, 67.3/69.0; 16384x4096 131.3/132.9, 132.0/133.8; 8192x8192 131.5/133.7;
    # 4096x8192 67.6/69.5; 32768x2048 a tie (130.3/130.2, 130.8/130.8). LayerNorm
    # 8192x4096 67.6/68.5, 68.4/69.4; 16384x4096 132.6/134.0, 133.9/135.7; 8192x8192
    # 132.5/137.8; 4096x8192 68.4/71.2; 32768x2048 131.9/134.1, 132.5/135.1. RMSNorm
    # backward (both stages): 8192x4096 72.0/74.2, 72.1/74.6; 16384x4096 133.3/138.1,
    # 133.8/138.8; 8192x8192 140.4/141.6; 4096x8192 74.9/76.0; 32768x2048 140.9/146.5,
    # 141.5/147.7. (LayerNorm's backward: Pallas, 8192x4096 82.5, 82.9 against 101.1, 102.3.)
    ("H200", "fwd", "rms_res", 2049, 8192, "triton"),
    ("H200", "fwd", "layer_res", 1025, 8192, "triton"),
    ("H200", "bwd", "rms_res", 1025, 8192, "triton"),
)
_BACKEND_MAX_ITEMSIZE = 2

# ---- Interpret mode (CPU): fewer, fatter programs run faster. [T#cpu]
_CPU_MIN_BLOCK_M = 64


# ==================================================================== Selectors


def choose_backend(pass_: str, n: int, dtype, subtract_mean: bool = False,
                   device: DeviceInfo | None = None, residual: bool = False, *,
                   m: int | None = None, param_dtype=None, llama: bool = False,
                   return_residuals: bool = True) -> str:
  """The backend ``backend=None`` gives one kernel: given ``m``, the backend of the
  tuning tables' entry for the call (``pass_`` "fwd", with ``return_residuals`` the
  tables' "fwd_stats", or "bwd"; ``pallas_norm.tuning``); else "pallas", or the backend
  of the first ``_BACKEND_RULES`` entry that matches (``device``'s name, ``pass_`` "fwd" or
  "bwd", the op (``subtract_mean``: LayerNorm; ``residual``: the fused residual add),
  N, a dtype of at most 2 bytes). On CPU (interpret mode) always "pallas". Whether that
  backend serves the call (a cast, FP8 x, a mode, jax-triton installed, shared memory,
  the residual's dtypes) is ``ops``' check; where it does not, ``ops`` takes "pallas".
  [T#backend]"""
  device = device or device_info()
  if m is not None:
    p = "bwd" if pass_ == "bwd" else ("fwd_stats" if return_residuals else "fwd")
    key = table_key(p, m, n, dtype, subtract_mean=subtract_mean, residual=residual,
                    llama=llama, param_dtype=param_dtype)
    found = _tuning.lookup(key, device.name, gpu=device.platform == "gpu")
    if found is not None:
      return found[0].backend
  if device.platform != "gpu" or np.dtype(dtype).itemsize > _BACKEND_MAX_ITEMSIZE:
    return "pallas"
  op = ("layer" if subtract_mean else "rms") + ("_res" if residual else "")
  for name, p, o, lo, hi, backend in _BACKEND_RULES:
    if name in device.name and p == pass_ and o == op and lo <= n <= hi:
      return backend
  return "pallas"


def cached_max_block_n(dtype) -> int:
  """Largest padded row length (elements) multi_wave_cached accepts for ``dtype`` (a
  NumPy / JAX dtype): 32768 whatever the dtype. [T#cached-max]"""
  del dtype
  return _CACHED_MAX_BLOCK_N


def split_resident_programs(num_warps: int) -> int:
  """Programs of ``num_warps`` warps a SM that are resident together whatever their
  register count: 65536 registers a SM, at most 255 (256 allocated) a thread, so
  8 / num_warps (at least 1). The split-row kernels, whose programs wait on each other,
  split a row over at most this many programs a SM. [T#split-residency]"""
  return max(1, 8 // num_warps)


def _cpu_block_m(block_m: int, m: int) -> int:
  """Interpret mode's row block: at least min(64, next_power_of_2(m)) rows. [T#cpu]"""
  return max(block_m, min(_CPU_MIN_BLOCK_M, next_power_of_2(m)))


def _num_warps_for(tile_elems: int) -> int:
  """One 16-byte vector (8 bf16) a thread a row: tile / 256 warps in [1, 16]."""
  return int(min(16, max(1, tile_elems // 256)))


def _fwd_warps(tile_elems: int) -> int:
  """RMSNorm forward warps of a tile. [T#fwd-warps]"""
  return int(min(_FWD_MAX_WARPS, max(_FWD_MIN_WARPS, tile_elems // _FWD_ELEMS_PER_WARP)))


def _split_rule(subtract_mean: bool) -> tuple[int, int, int, int]:
  """(rows longer than this split, block_n, num_warps, chunk_n) of the split-row
  multi_wave_cached forward. [T#rms-split], [T#ln-split]"""
  if subtract_mean:
    return _LN_SPLIT_MIN_N, _LN_SPLIT_BLOCK_N, _LN_SPLIT_WARPS, _LN_SPLIT_CHUNK_N
  return _SPLIT_MIN_N, _SPLIT_BLOCK_N, _SPLIT_WARPS, _SPLIT_CHUNK_N


def _splits_rows(n: int, subtract_mean: bool, backend: str, device: DeviceInfo) -> bool:
  """Whether multi_wave_cached splits an N-long row over several programs (Pallas; at
  most one program a SM, no bound on CPU)."""
  min_n, block_n, _, _ = _split_rule(subtract_mean)
  if backend != "pallas" or n <= min_n:
    return False
  return device.platform == "cpu" or cdiv(n, block_n) <= device.num_sms


def _ln_persistent_split(n: int, subtract_mean: bool, backend: str,
                         device: DeviceInfo) -> tuple[int, int] | None:
  """(block_n, programs a SM) of LayerNorm's persistent split-row forward for N-long
  rows, or None where it is not the pick. [T#ln-persistent-split]"""
  if not subtract_mean or backend != "pallas" or n <= _LN_PSPLIT_MIN_N:
    return None
  w = _LN_PSPLIT_W if n <= _LN_PSPLIT_WIDE_N else _LN_PSPLIT_WIDE_W
  if device.platform != "cpu" and n > _LN_SPLIT_BLOCK_N * device.num_sms:
    return None
  return w, _LN_PSPLIT_COLS_PER_SM // w


def _fp8_rms_vjp_split(n: int, dtype, subtract_mean: bool, residual: bool,
                       return_residuals: bool, backend: str,
                       device: DeviceInfo) -> tuple[int, int] | None:
  """(block_n, programs a SM) of the split-row static_persistent forward that the H100's
  FP8-x RMSNorm under jax.vjp takes at 8192 < N <= 16384 (Pallas, no residual add), or
  None: where ``_fp8_wide_mode`` applies (the same device, backend, dtype and widths).
  [docs/fp8_tuning.md#fp8-x-wide-split]"""
  if subtract_mean or not return_residuals:
    return None
  wide = _fp8_wide_mode(n, dtype, False, residual, True, backend, device)
  return _FP8_RMS_VJP_SPLIT_H100 if wide else None


def _residual_rules(residual: bool, dtype, backend: str, device: DeviceInfo,
                    devices: tuple[str, ...] = (_RES_DEVICE,)) -> bool:
  """Whether the fused residual add's own picks apply (measured: Pallas, 2-byte dtypes,
  on ``devices``: the H200, unless a rule names more). [T#residual]"""
  return (residual and backend == "pallas" and any(d in device.name for d in devices)
          and np.dtype(dtype).itemsize <= _RES_MAX_ITEMSIZE)


def _persistent_tile(n: int, dtype, subtract_mean: bool, backend: str,
                     device: DeviceInfo, residual: bool = False,
                     return_residuals: bool = True,
                     param_dtype=None) -> tuple[int, int, int] | None:
  """(block_n, num_warps, programs a SM) of the one-tile static_persistent forward for
  N-long rows of ``dtype`` on ``device``, or None where it is not the pick.
  [T#persistent-tile], [T#residual], [T#fp8-in-fwd]"""
  if backend != "pallas":
    return None
  if _fp8_h100_8192(n, dtype, subtract_mean, residual, return_residuals, device,
                    param_dtype):
    return 8192, _FP8_RMS_PERSISTENT_8192[1], _FP8_RMS_PERSISTENT_8192_H100_PER_SM
  if (not subtract_mean and n <= _RES_NO_PERSISTENT_TILE_MAX_N
      and _residual_rules(residual, dtype, backend, device)):
    return None
  itemsize = np.dtype(dtype).itemsize
  for min_n, max_n, num_warps, per_sm, max_itemsize, device_has in (
      _LN_PERSISTENT_TILES if subtract_mean else _RMS_PERSISTENT_TILES):
    if min_n < n <= max_n and itemsize <= max_itemsize and device_has in device.name:
      return next_power_of_2(max_n), num_warps, per_sm
  return None


def _fp8_wide_mode(n: int, dtype, subtract_mean: bool, residual: bool,
                   return_residuals: bool, backend: str, device: DeviceInfo,
                   param_dtype=None) -> str | None:
  """The forward mode of the Pallas FP8-x forward of N-long rows, 8192 < N <= 16384, on
  the H100 without a residual add (``_FP8_WIDE_MODES_H100``; with 2-byte scale/bias
  ``_FP8_WIDE_MODES_H100_2B`` first), or None (the heuristic's
  other rules). [docs/fp8_tuning.md#fp8-x-wide]"""
  if (backend != "pallas" or residual or np.dtype(dtype).itemsize != 1
      or "H100" not in device.name or not _FP8_WIDE_MIN_N < n <= _FP8_WIDE_MAX_N):
    return None
  key = (subtract_mean, return_residuals)
  if param_dtype is not None and np.dtype(param_dtype).itemsize == 2:
    return _FP8_WIDE_MODES_H100_2B.get(key, _FP8_WIDE_MODES_H100.get(key))
  return _FP8_WIDE_MODES_H100.get(key)


def _fp8_h100_8192(n: int, dtype, subtract_mean: bool, residual: bool,
                   return_residuals: bool, device: DeviceInfo, param_dtype=None) -> bool:
  """Whether the Pallas FP8-x forward of N-long rows (4096 < N <= 8192) takes the
  one-tile static_persistent [2, 8192] x 16 forward on the H100 (the H200's RMSNorm takes
  it by _RMS_PERSISTENT_TILES), without a residual add: with float32 scale/bias (both
  ops), and RMSNorm's where it also returns mean/rstd (jax.vjp's forward).
  [T#fp8-in-fwd]"""
  if residual or "H100" not in device.name or not 4096 < n <= 8192:
    return False
  if np.dtype(dtype).itemsize != 1:
    return False
  f32_params = param_dtype is not None and np.dtype(param_dtype).itemsize == 4
  return f32_params or (not subtract_mean and return_residuals)


def _f32_params_tile(n: int, dtype, param_dtype, subtract_mean: bool, backend: str,
                     device: DeviceInfo, residual: bool) -> tuple[int, int, int] | None:
  """(block_m, num_warps, programs a SM) of the static_persistent [block_m, N'] tile
  for float32 scale/bias with a 2-byte x on the Pallas backend (H100, H200), or None
  where that rule does not apply. [T#f32-params]"""
  if param_dtype is None or residual or backend != "pallas":
    return None
  if np.dtype(param_dtype).itemsize != 4 or np.dtype(dtype).itemsize != 2:
    return None
  for ln, bn, block_m, num_warps, per_sm, devices in _F32_PARAMS_TILES:
    if (ln == bool(subtract_mean) and bn == next_power_of_2(n)
        and any(d in device.name for d in devices)):
      return block_m, num_warps, per_sm
  return None


def choose_mode(m: int, n: int, dtype, device: DeviceInfo, *, subtract_mean: bool = False,
                backend: str = "pallas", residual: bool = False,
                param_dtype=None, return_residuals: bool = True) -> str:
  """The forward mode the heuristic picks for x viewed as [m, n] (the fastest measured).

  Args:
    m: rows (x's leading axes flattened): up to 64 rows of 2-byte or wider x with
      256 < N' <= 8192 (N' = 16384 from 8 rows) take multi_wave_cached, a row a
      program (few rows, on a GPU: ``_few_rows_tile``).
    n: row length N.
    dtype: x's dtype (only its itemsize matters).
    device: the DeviceInfo to pick for.
    subtract_mean: LayerNorm (True) or RMSNorm (False).
    backend: "pallas" or "triton"; the split-row and one-tile persistent kernels are
      Pallas-only.
    residual: the fused residual add (``residual=``): on an H200 in 2-byte dtypes,
      RMSNorm's one-tile persistent rows up to N = 8192 take multi_wave_cached.
    param_dtype: scale's (or bias's) dtype, None for x's: float32 parameters with a
      2-byte x take static_persistent at N' = 4096 and 8192 (Pallas; H100 and H200,
      RMSNorm's 8192 on the H100 only), and with FP8 x at 4096 < N <= 8192 on the H100.
    return_residuals: whether the forward also writes mean/rstd (under ``jax.vjp``):
      on the H100, FP8-x RMSNorm rows of 4096 < N <= 8192 then take the one-tile
      static_persistent forward; FP8-x rows of 8192 < N <= 16384 pick by it (below).

  Returns:
    One of ``MODES``, first match wins:
      H100, FP8 x, 8192 < N <= 16384   RMSNorm: multi_wave_cached (one tile), under
                                       jax.vjp static_persistent (split rows,
                                       forward_config); LayerNorm under
                                       jax.vjp, or alone with 2-byte scale/bias:
                                       multi_wave_cached (Pallas, no residual)
      static_persistent (f32 params)   as param_dtype says
      static_persistent (split rows)   LayerNorm, Pallas, 16384 < N <= 4096 x SMs
      static_persistent (one tile)     Pallas: LayerNorm 8192 < N <= 16384; H200 only,
                                       RMSNorm 6144 < N <= 8192 and 12288 < N <= 16384,
                                       LayerNorm 4096 < N <= 5120 (2-byte dtypes);
                                       H100, FP8 x, 4096 < N <= 8192: float32
                                       scale/bias, or RMSNorm with return_residuals
      multi_wave_cached (split rows)   RMSNorm, Pallas, 16384 < N <= 8192 x SMs
      static_persistent (chunked)      N > 32768
      multi_wave_reload                N' > 8192
      multi_wave_cached                otherwise (narrow rows included)
    Evidence: docs/tuning_rules.md, sections fwd-modes, long-rows, persistent-tile, rms-split
    and ln-persistent-split.
  """
  if (_few_rows_tile(m, n, dtype, device)
      or _column_splits(m, n, dtype, subtract_mean, backend, device) > 1):
    return "multi_wave_cached"
  wide = _fp8_wide_mode(n, dtype, subtract_mean, residual, return_residuals, backend,
                        device, param_dtype)
  if wide:
    return wide
  if _f32_params_tile(n, dtype, param_dtype, subtract_mean, backend, device, residual):
    return "static_persistent"
  if _ln_persistent_split(n, subtract_mean, backend, device):
    return "static_persistent"
  if _persistent_tile(n, dtype, subtract_mean, backend, device, residual,
                      return_residuals, param_dtype):
    return "static_persistent"
  if _splits_rows(n, subtract_mean, backend, device):
    return "multi_wave_cached"
  if n > _HEURISTIC_RELOAD_MAX:
    return "static_persistent"
  if next_power_of_2(n) > _HEURISTIC_CACHED_MAX:
    return "multi_wave_reload"
  return "multi_wave_cached"


def _few_rows_tile(m: int, n: int, dtype, device: DeviceInfo) -> bool:
  """Whether [m, n] of ``dtype`` is few rows of one tile each (forward and backward):
  a GPU, m <= 64, 2-byte or wider x, 256 < N' <= 8192, or N' = 16384 from 8 rows.
  [T#few-rows]"""
  bn = next_power_of_2(n)
  return (device.platform == "gpu" and m <= _FEW_ROWS_M and np.dtype(dtype).itemsize > 1
          and _NARROW_BLOCK_N < bn <= _FEW_ROWS_MAX_BLOCK_N
          and (bn <= _BWD_SINGLE_TILE_MAX or m >= _FEW_ROWS_WIDE_MIN_M))


def _column_splits(m: int, n: int, dtype, subtract_mean: bool, backend: str,
                   device: DeviceInfo) -> int:
  """ForwardConfig.column_splits of the one-tile forward: up to 8 rows of N' 8192-16384
  (2-byte or wider x, Pallas, a GPU), 4 programs a row block for RMSNorm, 8 for
  LayerNorm; else 1. [T#few-rows]"""
  bn = next_power_of_2(n)
  if not (device.platform == "gpu" and backend == "pallas" and m <= _COLUMN_SPLIT_MAX_M
          and np.dtype(dtype).itemsize > 1
          and _COLUMN_SPLIT_MIN_BLOCK_N <= bn <= _FEW_ROWS_MAX_BLOCK_N):
    return 1
  return _COLUMN_SPLITS_LN if subtract_mean else _COLUMN_SPLITS_RMS


def _fwd_tile(m: int, n: int, block_n: int, chunked: bool, subtract_mean: bool,
              backend: str) -> tuple[int, int]:
  """(block_m, num_warps) of a forward tile of ``block_n`` columns (a chunk of the row
  when ``chunked``). [T#fwd-tile], [T#fwd-warps], [T#ln-fwd-tile], [T#reload-chunk]"""
  block_m = max(1, min(_FWD_TILE_ELEMS // block_n, next_power_of_2(m)))
  if chunked and block_n >= _RELOAD_CHUNK_N_LARGE:
    return block_m, _RELOAD_WARPS
  if not subtract_mean or chunked:
    return block_m, _fwd_warps(block_m * block_n)
  # LayerNorm, single tile.
  if block_n == _LN_WIDE_BLOCK_N:
    return 1, _LN_WIDE_PADDED_WARPS if n <= _LN_WIDE_PADDED_MAX_N else _LN_WIDE_WARPS
  block_m = max(1, min(max(_LN_MIN_BLOCK_M, _LN_TILE_ELEMS // block_n), next_power_of_2(m)))
  min_warps = _LN_NARROW_MIN_WARPS if block_n <= _NARROW_BLOCK_N else 1
  num_warps = int(min(16, max(min_warps, block_m * block_n // _LN_ELEMS_PER_WARP)))
  if backend == "pallas" and block_n == 2048:
    num_warps = _LN_2048_WARPS
  if backend == "pallas" and block_n == 4096 and n <= _LN_ONE_ROW_MAX_N:
    block_m, num_warps = 1, _LN_ONE_ROW_WARPS
  return block_m, num_warps


def forward_config(m: int, n: int, dtype, mode: str | None = None,
                   device: DeviceInfo | None = None, *,
                   subtract_mean: bool = False, backend: str = "pallas",
                   residual: bool = False, param_dtype=None,
                   return_residuals: bool = True, llama: bool = False,
                   tuned: bool = True, post_norm: bool = False) -> ForwardConfig:
  """The forward launch config for x viewed as [m, n] of ``dtype``: the tuning tables'
  entry for the call (``pallas_norm.tuning``), else the default.

  Args:
    m: rows (x's leading axes flattened), >= 1.
    n: row length N (the normalised axis), >= 1.
    dtype: x's dtype (NumPy / JAX; only its itemsize matters).
    mode: one of ``MODES``, or None for ``choose_mode``'s pick.
    device: the DeviceInfo to pick for (default: ``device_info()``).
    subtract_mean: LayerNorm (True) or RMSNorm (False).
    backend: "pallas" or "triton" (whether rows may be split over programs, and the
      Pallas-only tiles).
    residual: the fused residual add (``residual=``): its own picks on an H200 in
      2-byte dtypes (``choose_mode``; LayerNorm N' = 4096 at [1, 4096] x 8 warps).
    param_dtype: scale's (or bias's) dtype, None for x's: float32 parameters with a
      2-byte x have their own static_persistent tiles (``choose_mode``).
    return_residuals: whether the call also writes mean/rstd (the forward of
      ``jax.vjp``; default True): on the H100 the FP8-x RMSNorm forward at N' = 8192
      then takes the one-tile static_persistent forward (``choose_mode``), and at 8192
      < N <= 16384 the split-row one (``_FP8_RMS_VJP_SPLIT_H100``).
    llama: ``cast="llama"`` (a key of its own in the tables).
    tuned: look the tables up (False: the default alone).
    post_norm: the one-kernel forward of ``post_norm_scale=`` (with ``residual``; mode
      multi_wave_cached whatever ``mode`` says): the tables' "rms_res_post" entry, else
      the residual norm's cached config (its table entry or its default) with its column
      splits dropped (the post-norm needs the whole row in one program). Whether it
      holds the row is the caller's check (``kernels.forward.post_norm_fits``).

  Returns:
    A ForwardConfig (block sizes in elements).

  Raises:
    ValueError: an unknown mode.
    NotImplementedError: multi_wave_cached for a row it cannot hold: N' > 32768 on the
      Triton backend; on the Pallas backend, N > 8192 x SMs (RMSNorm) or
      4096 x SMs (LayerNorm).
  """
  device = device or device_info()
  if mode is not None and mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  if post_norm:
    kw = dict(subtract_mean=subtract_mean, backend=backend, residual=True,
              param_dtype=param_dtype, llama=llama)
    cfg = tuned and _tuned("fwd", m, n, dtype, device, mode="multi_wave_cached",
                           post_norm=True, **kw)
    if cfg:
      return cfg
    cfg = forward_config(m, n, dtype, "multi_wave_cached", device, tuned=tuned,
                         return_residuals=return_residuals, **kw)
    return dataclasses.replace(cfg, column_splits=1)
  cfg = tuned and _tuned("fwd_stats" if return_residuals else "fwd", m, n, dtype, device,
                         backend=backend, mode=mode, subtract_mean=subtract_mean,
                         residual=residual, llama=llama, param_dtype=param_dtype)
  if cfg:
    return cfg
  mode = mode or choose_mode(m, n, dtype, device, subtract_mean=subtract_mean,
                             backend=backend, residual=residual, param_dtype=param_dtype,
                             return_residuals=return_residuals)
  res_rules = _residual_rules(residual, dtype, backend, device)
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  cpu = device.platform == "cpu"
  psplit = (_ln_persistent_split(n, subtract_mean, backend, device)
            or _fp8_rms_vjp_split(n, dtype, subtract_mean, residual, return_residuals,
                                  backend, device))
  if mode == "static_persistent" and psplit:  # rows split over persistent programs
    w, per_sm = psplit
    block_m = min(_CPU_MIN_BLOCK_M, next_power_of_2(m)) if cpu else 1
    num_programs = max(1, min(per_sm * device.num_sms // cdiv(n, w), cdiv(m, block_m)))
    return ForwardConfig(mode, block_m, w, 1, num_programs, split_rows=True,
                         split_lag=_LN_PSPLIT_LAG, split_early_publish=True)
  f32p = _f32_params_tile(n, dtype, param_dtype, subtract_mean, backend, device, residual)
  if mode == "static_persistent" and f32p:  # float32 scale/bias, loaded once a program
    block_m, num_warps, per_sm = f32p
    num_programs = max(1, min(per_sm * device.num_sms, cdiv(m, block_m)))
    return ForwardConfig(mode, block_m, next_power_of_2(n), num_warps, num_programs)
  split_min_n, split_n, split_warps, split_chunk_n = _split_rule(subtract_mean)
  if mode == "multi_wave_cached" and backend == "pallas" and n > split_min_n:
    if not _splits_rows(n, subtract_mean, backend, device):
      raise NotImplementedError(
          f"multi_wave_cached splits a row over cdiv(N, {split_n}) programs, at "
          f"most one a SM: N={n} needs {cdiv(n, split_n)} > {device.num_sms}; "
          f"use mode='multi_wave_reload' (or 'static_persistent')")
    # The split of a row over programs (forward.py's _split_kernel).
    return ForwardConfig(mode, 1, split_n, split_warps, chunk_n=split_chunk_n)
  tile = _persistent_tile(n, dtype, subtract_mean, backend, device, residual,
                          return_residuals, param_dtype)
  if mode == "static_persistent" and tile:  # the row as one hoisted-scale tile
    block_n, num_warps, per_sm = tile
    block_m, num_warps = (_fp8_rms_tile(True, block_n, dtype, subtract_mean, backend)
                          or (1, num_warps))
    if _fp8_h100_8192(n, dtype, subtract_mean, residual, return_residuals, device,
                      param_dtype):
      block_m, num_warps = _FP8_RMS_PERSISTENT_8192
    block_m = min(_CPU_MIN_BLOCK_M, next_power_of_2(m)) if cpu else block_m
    num_programs = max(1, min(per_sm * device.num_sms, cdiv(m, block_m)))
    return ForwardConfig(mode, block_m, block_n, num_warps, num_programs)
  bn_full = next_power_of_2(n)
  if mode == "multi_wave_cached" and bn_full > cached_max_block_n(dtype):
    raise NotImplementedError(
        f"multi_wave_cached holds the whole row in registers and supports N up to "
        f"{cached_max_block_n(dtype)} (N={n} pads to {bn_full}); use "
        f"mode='multi_wave_reload' (or 'static_persistent') for longer rows")
  if n <= _HEURISTIC_RELOAD_MAX:
    chunk = _RELOAD_CHUNK_N_SMALL
  elif mode == "static_persistent":
    chunk = _PERSISTENT_CHUNK_N_LARGE
  else:
    chunk = _RELOAD_CHUNK_N_LARGE
  chunked = mode == "multi_wave_reload" or (mode == "static_persistent" and bn_full > chunk)
  block_n = min(bn_full, chunk) if chunked else bn_full
  block_m, num_warps = _fwd_tile(m, n, block_n, chunked, subtract_mean, backend)
  if (res_rules and subtract_mean and not chunked and block_n == 4096
      and n > _LN_ONE_ROW_MAX_N):
    block_m, num_warps = _RES_LN_4096_FWD
  if not chunked and block_m == 1:
    block_m, num_warps = (_fp8_rms_tile(False, block_n, dtype, subtract_mean, backend)
                          or (block_m, num_warps))
  if not chunked:
    block_m, num_warps = (_fp8_ln_h100_tile(block_n, dtype, subtract_mean, backend, device,
                                            residual, param_dtype, return_residuals)
                          or (block_m, num_warps))
  if (not chunked and not cpu and m <= _FEW_ROWS_M and block_n > _NARROW_BLOCK_N
      and np.dtype(dtype).itemsize > 1):  # few rows: a row a program, >= 4 warps
    block_m = 1
    num_warps = max(num_warps, min(_FEW_ROWS_MAX_WARPS,
                                   max(_FWD_MIN_WARPS, block_n // _FWD_ELEMS_PER_WARP)))
  if cpu:
    block_m = _cpu_block_m(block_m, m)
  num_programs = 0
  if mode == "static_persistent":
    num_programs = max(1, min(device.num_sms * _PERSISTENT_OCCUPANCY, cdiv(m, block_m)))
  # scale/bias loaded with x while the grid is one wave (hoist_params)
  hoist = (mode == "multi_wave_cached" and not chunked and device.platform == "gpu"
           and cdiv(m, block_m) <= _HOIST_MAX_WAVES * device.num_sms)
  # column splits (their rows took the few-row tile above: a row a program)
  splits = (_column_splits(m, n, dtype, subtract_mean, backend, device)
            if mode == "multi_wave_cached" and not chunked and block_n >= n else 1)
  return ForwardConfig(mode, block_m, block_n, num_warps, num_programs, hoist_params=hoist,
                       column_splits=splits)


def _fp8_rms_tile(persistent: bool, block_n: int, dtype, subtract_mean: bool,
                  backend: str) -> tuple[int, int] | None:
  """(block_m, num_warps) of the FP8-x RMSNorm forward's two-row tiles on the Pallas
  backend (persistent: the one-tile static_persistent forward at N' = 8192; else the
  whole-row tile at N' = 4096), or None. [T#fp8-in-fwd]"""
  if backend != "pallas" or subtract_mean:  # before np.dtype: the Triton backend's
    return None                               # tests pass torch dtypes
  if np.dtype(dtype).itemsize != 1:
    return None
  if persistent:
    return _FP8_RMS_PERSISTENT_8192 if block_n == 8192 else None
  return _FP8_RMS_FWD_TILE if block_n == _FP8_RMS_FWD_BLOCK_N else None


def _fp8_ln_h100_tile(block_n: int, dtype, subtract_mean: bool, backend: str,
                      device: DeviceInfo, residual: bool, param_dtype,
                      return_residuals: bool) -> tuple[int, int] | None:
  """(block_m, num_warps) of the FP8-x LayerNorm forward's whole-row
  (multi_wave_cached) tile on the H100 with 2-byte scale/bias and no residual add (Pallas),
  or None: N' = 4096 without mean/rstd written, ``_FP8_LN_FWD_H100_PRIMAL_2B``; N' = 8192
  with them, ``_FP8_LN_FWD_H100_RES_8192_2B``; N' = 16384 without them,
  ``_FP8_LN_FWD_H100_PRIMAL_16384_2B``. [T#fp8-in-fwd]"""
  if not subtract_mean or backend != "pallas" or residual or "H100" not in device.name:
    return None
  if param_dtype is None or np.dtype(param_dtype).itemsize != 2:
    return None
  if np.dtype(dtype).itemsize != 1:
    return None
  if block_n == 4096 and not return_residuals:
    return _FP8_LN_FWD_H100_PRIMAL_2B
  if block_n == 8192 and return_residuals:
    return _FP8_LN_FWD_H100_RES_8192_2B
  if block_n == 16384 and not return_residuals:
    return _FP8_LN_FWD_H100_PRIMAL_16384_2B
  return None


def _bwd_split_rule(n: int, subtract_mean: bool, device: DeviceInfo):
  """(block_n, num_warps, num_programs, split_lag, split_early_publish) of the split-row
  backward of N-long rows, or None when its programs could not all be resident
  (N > 4096 x SMs). [T#bwd-split], [T#bwd-split-ln-early]"""
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


def _bwd_tile(m: int, n: int, bn_full: int, subtract_mean: bool, backend: str,
              device: DeviceInfo) -> tuple[int, int, int, int, tuple[int, ...]]:
  """(block_m, block_n, num_warps, num_programs, pieces) of the single-tile backward
  (N' <= 8192). [T#bwd-narrow], [T#bwd-tile], [T#bwd-grid-warps], [T#bwd-ln-tile],
  [T#bwd-ln-pieces], [T#bwd-ln-2048]"""
  block_n = bn_full
  if bn_full <= _NARROW_BLOCK_N:
    block_m = max(1, min(_BWD_NARROW_TILE_ELEMS // block_n, next_power_of_2(m)))
    num_programs = device.num_sms * _BWD_NARROW_OCCUPANCY
    if not subtract_mean:  # a power of 2: stage 2 reads [G, N] in one unpadded tile
      num_programs = 1 << (num_programs.bit_length() - 1)
    return block_m, block_n, _BWD_NARROW_WARPS, num_programs, ()
  block_m = max(1, min(_BWD_TILE_ELEMS // block_n, next_power_of_2(m)))
  wide = block_n >= _BWD_WIDE_MIN_BLOCK_N
  num_warps = block_n // _BWD_ELEMS_PER_WARP if wide else _BWD_MIN_WARPS
  num_programs = device.num_sms * (2 if block_n <= _BWD_TWO_PER_SM_MAX_BLOCK_N else 1)
  pieces = ()
  if subtract_mean and block_n >= _BWD_LN_TILE_MIN_BLOCK_N:
    num_warps, num_programs = _BWD_LN_TILE_WARPS, device.num_sms
    if block_n == 4096 and backend == "pallas":
      block_m = max(1, min(_BWD_LN_4096_BLOCK_M, next_power_of_2(m)))
  if subtract_mean and block_n == 2048 and backend == "pallas":
    num_warps = _BWD_LN_2048_WARPS
  if (subtract_mean and block_n == 4096 and n <= _BWD_LN_PIECES_MAX_N
      and backend == "pallas"):  # the Triton backend's kernel has no pieces
    pieces = _binary_pieces(cdiv(n, _BWD_LN_PIECES_ROUND) * _BWD_LN_PIECES_ROUND)
    block_m, num_warps, num_programs = 1, _BWD_LN_PIECES_WARPS, 2 * device.num_sms
  return block_m, block_n, num_warps, num_programs, pieces


def backward_config(m: int, n: int, dtype, device: DeviceInfo | None = None, *,
                    subtract_mean: bool = False, backend: str = "pallas",
                    residual: bool = False, param_dtype=None, llama: bool = False,
                    tuned: bool = True) -> BackwardConfig:
  """The backward launch config for x viewed as [m, n] of ``dtype``: the tuning tables'
  entry for the call (``pallas_norm.tuning``), else the default.

  Args:
    m: rows (x's leading axes flattened), >= 1.
    n: row length N, >= 1.
    dtype: x's dtype (the rules were measured in bf16; only the residual rules look at
      its itemsize).
    device: the DeviceInfo to pick for (default: ``device_info()``).
    subtract_mean: LayerNorm (True) or RMSNorm (False).
    backend: "pallas" or "triton" (the split-row kernel and the pieces are Pallas-only).
    residual: the fused residual add (x is h, plus dh): LayerNorm N' = 8192 at 32
      warps on an H100 or H200 in 2-byte dtypes, and with ``recompute_dx`` on any GPU
      in bf16.
    param_dtype: the scale's dtype, or None (unknown, or no scale): with FP8 x and a
      2-byte scale the H100's one-tile stage 1 takes ``_FP8_BWD_H100_2B``'s tiles and
      flags (8 elements a thread at 1024 threads a SM).
    llama: ``cast="llama"`` (a key of its own in the tables).
    tuned: look the tables up (False: the default alone).

  Returns:
    A BackwardConfig, stage 2's knobs from ``reduce_config``. Rows up to N' = 8192 are
    one tile, and on the Pallas backend N' = 16384 at 8 to 64 rows (2-byte or wider x, a
    GPU: ``_few_rows_tile``). On the Pallas backend, wider rows take the split-row kernel while all of a
    row's programs can be resident (N <= 4096 x SMs; ``split_resident_programs``),
    LayerNorm's rows of 32768 < N <= 262144 with ``split_early_publish``; longer rows,
    and all of ``backend="triton"``'s wide rows, the row-statistics + column-tiled pair.
    Never ``reload_rows``. On the H100 the one-tile stage 1 takes ``prefetch_stats``
    and ``joint_row_sums`` where they measured faster ([T#stage1-flags]). Evidence:
    docs/tuning_rules.md, the "Backward" sections.
  """
  device = device or device_info()
  cfg = tuned and _tuned("bwd", m, n, dtype, device, backend=backend, mode=None,
                         subtract_mean=subtract_mean, residual=residual, llama=llama,
                         param_dtype=param_dtype)
  if cfg:
    return cfg
  bn_full = next_power_of_2(n)
  few = backend == "pallas" and _few_rows_tile(m, n, dtype, device)
  single = bn_full <= _BWD_SINGLE_TILE_MAX or few  # the row as one register tile
  wide = not single and backend == "pallas"
  split = _bwd_split_rule(n, subtract_mean, device) if wide else None
  lag, early, pieces = _BWD_SPLIT_LAG, False, ()
  flags = {}
  if single:
    block_m, block_n, num_warps, num_programs, pieces = _bwd_tile(
        m, n, bn_full, subtract_mean, backend, device)
    if bn_full > _BWD_SINGLE_TILE_MAX:  # few rows' N' = 16384 (N' / 256 would be 64)
      num_warps = min(num_warps, _FEW_ROWS_MAX_WARPS)
    if subtract_mean and block_n == 8192 and _residual_rules(
        residual, dtype, backend, device, _RES_LN_8192_BWD_WARPS_DEVICES):
      num_warps = _RES_LN_8192_BWD_WARPS
    fp8_h100 = (not pieces and backend == "pallas" and device.platform == "gpu"
                and "H100" in device.name and np.dtype(dtype).itemsize == 1)  # FP8 x
    if fp8_h100 and subtract_mean and block_n == 4096:
      block_m, num_warps, per_sm = _FP8_LN_4096_BWD_H100
      num_programs = per_sm * device.num_sms
    two_byte = fp8_h100 and param_dtype is not None and np.dtype(param_dtype).itemsize == 2
    if two_byte and (subtract_mean, block_n) in _FP8_BWD_H100_2B:
      block_m, num_warps, per_sm, flags = _FP8_BWD_H100_2B[subtract_mean, block_n]
      num_programs = per_sm * device.num_sms
    flags = dict(_stage1_flags(block_n, pieces, subtract_mean, residual, dtype, backend,
                               device), **flags)
  elif split is not None:  # each row split over programs that exchange their row sums
    block_n, num_warps, num_programs, lag, early = split
    block_m = 1
  else:  # row statistics kernel + column-tiled persistent kernel
    block_n, block_m, num_warps = _BWD_CHUNK_N, 1, _BWD_CHUNK_WARPS
    num_programs = max(1, _BWD_CHUNK_OCCUPANCY * device.num_sms // cdiv(n, block_n))
  if (single and device.platform == "gpu"
      and m <= _FEW_ROWS_BWD_ONE_ROW_M and bn_full > _NARROW_BLOCK_N
      and np.dtype(dtype).itemsize > 1):
    block_m = 1  # very few rows: a row a program
  if device.platform == "cpu":
    block_m = _cpu_block_m(block_m, m)
  num_programs = max(1, min(num_programs, cdiv(m, block_m)))
  # One kernel (stage 2 summed by column programs) for few rows.
  if (single and backend == "pallas" and device.platform == "gpu"
      and 1 < num_programs and m <= _FEW_ROWS_M):
    flags["fused_reduce"] = True
    flags["column_block_m"] = min(_FUSED_COLUMN_BLOCK_M, next_power_of_2(m))
    flags["column_block_n"] = min(_FUSED_COLUMN_BLOCK_N, bn_full)
  return BackwardConfig(block_m=block_m, block_n=block_n, num_warps=num_warps,
                        num_programs=num_programs, split_rows=split is not None,
                        reload_rows=False, split_lag=lag, split_early_publish=early,
                        pieces=pieces, **flags,
                        **reduce_config(n, num_programs, backend))


def _stage1_flags(block_n: int, pieces: tuple[int, ...], subtract_mean: bool,
                  residual: bool, dtype, backend: str, device: DeviceInfo) -> dict:
  """``recompute_dx``, ``prefetch_stats`` and ``joint_row_sums`` of the one-tile
  persistent stage 1 with ``block_n``-wide tiles (as pieces, if any), where a rule sets
  them: a dict for ``BackwardConfig(**...)``. recompute_dx: LayerNorm + residual at
  N' = 8192, bf16, one tile, every GPU ([T#recompute-dx]). The other two: the H100, 2-byte
  dtypes and FP8 x without a residual, tiles of 512 or more, not LayerNorm + residual at
  N' = 2048 ([T#stage1-flags])."""
  # the backend before np.dtype: the Triton backend's tests pass torch dtypes
  if backend != "pallas" or device.platform != "gpu":
    return {}
  flags = {}
  if (_RES_LN_8192_BWD_RECOMPUTE and residual and subtract_mean and block_n == 8192
      and not pieces and np.dtype(dtype).name == "bfloat16"):
    flags["recompute_dx"] = True
  itemsize = np.dtype(dtype).itemsize
  if (not any(d in device.name for d in _STAGE1_FLAGS_DEVICES)
      or itemsize not in (1, 2) or (itemsize == 1 and residual)
      or block_n < _STAGE1_FLAGS_MIN_BLOCK_N
      or (subtract_mean and residual and block_n == 2048 and not pieces)):
    return flags
  if itemsize == 1:  # FP8 x (LayerNorm N' = 4096: on _FP8_LN_4096_BWD_H100's tile)
    return dict(flags, prefetch_stats=(not subtract_mean or block_n == 8192
                                       or (block_n == 4096 and not pieces)),
                joint_row_sums=subtract_mean)
  return dict(flags, prefetch_stats=block_n < 8192 or (subtract_mean and not residual),
              joint_row_sums=subtract_mean and (residual or block_n != 4096 or bool(pieces)))


def _binary_pieces(n: int) -> tuple[int, ...]:
  """The powers of 2 that sum to ``n``, largest first (5120 -> (4096, 1024))."""
  return tuple(1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1)


def reduce_config(n: int, num_programs: int, backend: str = "pallas") -> dict:
  """Stage-2 knobs for [num_programs, n] f32 partials: a dict of ``reduce_block_n``
  (columns a program), ``reduce_block_g`` (partial rows a step, next_power_of_2(G) up to
  1024) and ``reduce_num_warps`` (``backend``'s), for ``BackwardConfig(**...)``.
  [T#reduce]"""
  block_g = min(next_power_of_2(num_programs), _REDUCE_MAX_BLOCK_G)
  block_n = max(_REDUCE_MIN_BLOCK_N, min(next_power_of_2(n), _REDUCE_TILE // block_g))
  tile = block_g * block_n
  warps = (max(1, min(16, tile // _REDUCE_ELEMS_PER_WARP)) if backend == "pallas"
           else _num_warps_for(tile // 2))
  return dict(reduce_block_n=block_n, reduce_block_g=block_g, reduce_num_warps=warps)
