"""Pallas kernels (Triton lowering) of the FP8-output norms (``pallas_norm.fp8``).

Bytes model, per element of x [M, N] (2-byte x): read x 2 B, write y 1 B (+1 B for the
transposed copy y_t). Per-row values ([M] floats) are noise beside it. The kernels'
passes over HBM:

  delayed scaling (the scale is known): ONE pass, ``pallas_norm_fp8_delayed``.
      grid = cdiv(M, block_m); a program owns block_m rows. Rows that fit one tile are
      loaded once and kept in registers; longer rows are walked in block_n chunks for
      the statistics, then re-walked (from L2, the chunks just read) to normalise,
      quantise with the given scale and store y, y_t and the rows' amax (TileGym's
      multi_wave_reload with a tall row block when y_t is asked for: the transposed
      store of a [block_m, block_n] tile writes block_m contiguous bytes a y_t row, so
      block_m >= 32 fills a 32-byte sector). The tensor amax is a jnp max over the
      [M] row amaxes. HBM: 2 + 1 (+1) bytes an element, the minimum.
  current scaling (the scale is this call's amax / fp8_max): no value can be quantised
      before the whole tensor's amax is known, so beyond cache sizes one pass is
      impossible. Two passes:
        1. ``pallas_norm_fp8_stats`` (grid cdiv(M, block_m), short row blocks): reads x,
           writes only mean, rstd and the row amax of y_f32 ([M] each);
        a jnp max gives amax, then y_scale and 1 / y_scale;
        2. ``pallas_norm_fp8_quantise`` (2-D grid of [block_m, block_n] tiles, an
           elementwise pass): reads x again, recomputes y_f32 from the saved mean and
           rstd with the same operations as pass 1, quantises, stores y and y_t (a tile
           of >= 32 rows makes the transposed store coalesced).
      HBM: 2 + 2 + 1 (+1) = 5 (6) bytes an element. COAT's alternative (pass 1 writes y
      in bf16 with its row amax, pass 2 reads it back and quantises) moves 2 + 2 + 2 +
      1 (+1) = 7 (8) bytes and rounds y to bf16 before quantising (the contract
      quantises the float32 y); writing y in float32 instead would be 11 (12). Reading
      x twice is the cheapest exact design.

  tensor parallel (x's hidden dim sharded; ``pallas_norm.fp8._pallas``): the forward's
      shard-statistics kernel and an all-reduce give the whole rows' mean and rstd; then
      ``pallas_norm_fp8_quantise`` with ``return_amax`` (delayed: quantise and the tiles'
      amax in one pass), or ``pallas_norm_fp8_amax`` (``fp8_tile_amax``: the tiles' amax
      only) and then the quantise pass (current scaling).

The quantisation is ``pallas_norm.fp8.quantise`` (the jnp chain's own function),
y_f32 = forward._affine(x_hat, w, b) with x_hat = (x - mean) * rstd, as the reference
orders it. Row amaxes are kept as the int32 bits of |y_f32|: for non-negative floats
the bit patterns order as the values do and every NaN is above +Inf, so an integer max
propagates NaN (Triton's float max is maxnum, which drops it) and is exact.

Launch configs: ``fp8_config``: the statistics kernel and the delayed kernel without
y_t take the forward's measured tiles; the tall y_t blocks and the quantise tiles are
unmeasured constants, each with its reason (the lead tunes them on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.config import (_COLUMN_SPLIT_MAX_M, _COLUMN_SPLIT_MIN_BLOCK_N,
                                RELOAD_UNROLL_MAX_CHUNKS, _few_rows_tile, cdiv,
                                device_info, forward_config, next_power_of_2)
from pallas_norm.fp8 import quantise
from pallas_norm.kernels._compat import out_struct, stream_cache_modifier
from pallas_norm.kernels.forward import (_affine, _chunk_index, _chunk_stats, _load,
                                         _load_params, _load_tile, _Sum, _tile_index,
                                         _tile_stats, _where0)

__all__ = ["Fp8Config", "fp8_config", "fp8_entry_fields", "fp8_from_entry", "table_pass",
           "table_passes", "fp8_norm_delayed", "fp8_stats", "fp8_quantise", "residual_config",
           "fp8_tile_amax", "reduce_amax"]

_F32 = jnp.float32
KERNELS = ("delayed", "stats", "quantise")
# Compiled kernels cast to FP8 with the hardware's saturating conversion (``_emit``);
# False keeps quantise's explicit clip there too (the A/B of docs/fp8_tuning.md#fp8-tuning).
HW_SATURATE = True
# Compiled kernels keep the running amax as float32 |y| max-ed with PTX ``max.NaN.f32``
# (``_fold_amax``: one FMNMX an element where the int32 bits take an AND and a max);
# False keeps the int32 bits there too (the A/B of docs/fp8_tuning.md).
HW_AMAX = True


# --------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """Launch config of one FP8-output kernel.

  Attributes:
    block_m: rows a program (row-block kernels) or a tile (quantise); power of 2.
    block_n: columns of a tile (power of 2); the row-block kernels walk rows wider than
      it in block_n chunks.
    num_warps: warps a program.
    num_programs: the row-block kernels' grid. 0: one row block a program (grid
      cdiv(M, block_m)); G > 0: G persistent programs, program r walking row blocks
      r, r + G, ... (whole rows: the next block's x prefetched into registers before
      this one's math), with the amax kept elementwise in registers across its rows
      and reduced once, into one int32 partial a program (``_persistent_kernel``).
      Ignored by "quantise".
    tile_params: the row-block kernels load scale/bias as [1, block_n] rows indexed in
      the x tile's 2-D shape (``_load_params_2d``), in the tile's register layout; False
      loads them as [block_n] vectors, which the compiler converts to the tile's layout
      through shared memory (a [4096] f32 scale at 4 warps: 8 rounds, 16 barriers, once
      a row block, or once a program when num_programs > 0). Ignored by "quantise".
    hoist_params: persistent whole rows (num_programs > 0, block_n >= N): scale/bias
      loaded once a program and kept in registers across its row blocks (True), or
      loaded again for each row block (False: from L1/L2; fewer registers, so more
      programs resident: LayerNorm [1, 4096] at 4 warps 202 -> 128 registers a thread,
      2 -> 4 programs a SM; ptxas for sm_90a). Ignored otherwise.
    row_amax: persistent whole rows: each row block's |y| reduced to one value at once
      (one more cross-thread reduction a row block) instead of kept elementwise in a
      [block_m, block_n] float32 carry (block_m * block_n / (32 * num_warps) registers a
      thread). Ignored otherwise.
    packed: persistent whole rows of bf16 x without y_t (``_packed_kernel``): x enters
      as uint32 pairs of bf16 ([M, N / 2], a bitcast), each pair unpacked where it is
      used, and y leaves as int16 pairs of FP8 values (one two-value conversion each).
      The prefetched row block is then carried as loaded: carried as bf16 values, its
      128-bit loads are split one value a register inside the current row block's
      math, which waits there for the prefetch (H100 ncu, docs/fp8_tuning.md#fp8-packed).
      ValueError for x that is not bf16, an odd N, rows wider than block_n, y_t, or
      num_programs == 0.
    stream_x: persistent whole rows: x loaded with the ``.cg`` cache modifier (L2 only,
      ``_compat.stream_cache_modifier``, the forward's choice, measured on the H200's
      bf16 forward), or without (False: L1 and L2; faster for these kernels on the
      H100, docs/fp8_tuning.md#fp8-packed). Ignored otherwise.
    column_splits: one row block a program (``num_programs`` 0) with whole rows
      (``block_n >= N``): programs a row block, each loading the whole row for the
      statistics and quantising and storing ``block_n / column_splits`` of its columns
      (with one amax partial each; split 0 writes mean/rstd): XLA's few-row schedule,
      as the forward's ``ForwardConfig.column_splits``. 1: one program a row block.
      A power of 2, at most ``block_n``; ValueError otherwise, or with
      ``num_programs`` or chunked rows.
    packed_params: with ``packed``, bf16 scale/bias enter as uint32 pairs too ([N / 2],
      a bitcast) and are loaded in one contiguous load, unpacked into their even and
      odd columns, instead of two strided gathers; the outputs are the same bits.
      Ignored otherwise (and for scale/bias of another dtype).
  """

  block_m: int
  block_n: int
  num_warps: int
  num_programs: int = 0
  tile_params: bool = False
  hoist_params: bool = True
  row_amax: bool = False
  packed: bool = False
  stream_x: bool = True
  packed_params: bool = False
  column_splits: int = 1

  def __post_init__(self):
    for name in ("block_m", "block_n", "num_warps"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"Fp8Config.{name}={v} must be a power of 2")
    if self.num_programs < 0:
      raise ValueError(f"Fp8Config.num_programs={self.num_programs} must be >= 0 (0: a "
                       f"row block a program)")
    cs = self.column_splits
    if cs < 1 or cs & (cs - 1) or cs > self.block_n or (cs > 1 and self.num_programs):
      raise ValueError(f"Fp8Config.column_splits={cs} must be a power of 2 in [1, "
                       f"block_n], and 1 with num_programs > 0")


# The row-block kernels' configs. H200, bf16 x, e4m3fn, 2026-11-23 (CUPTI kernel time,
# median of 10 calls over inputs rotated over >= 256 MiB; docs/fp8_tuning.md#fp8-tuning,
# benchmarks/results/h200_2026-11-23_sweep2_fp8_f2c3297.json): the pick against the
# one-row-block-a-program kernel at the forward's tile, in us.
_WHOLE_ROW_MAX = 8192  # rows up to this width stay in registers (forward's cached limit)
# Persistent whole-row tiles, scale/bias in the tile's layout (tile_params):
# {(kernel, op, N'): (block_m, num_warps, programs a SM, hoist_params)}, kernel "stats" or
# "delayed" (without y_t), N' the row padded to a power of 2; a shape not in it (and
# LayerNorm's statistics at N' 2048 and 8192, where none won by 3%) keeps the forward's
# tile.
_PERSISTENT_ROWS: dict[tuple[str, str, int], tuple[int, int, int, bool]] = {
    ("stats", "rms", 2048): (2, 4, 4, True),        # 32768x2048: 38.0 / 41.2
    ("delayed", "rms", 2048): (2, 4, 4, True),      # 65.0 / 69.2
    ("delayed", "layer", 2048): (2, 4, 3, True),    # 72.4 / 81.1
    ("stats", "rms", 4096): (1, 8, 3, True),        # 8192x4096: 21.6 / 23.1
    ("delayed", "rms", 4096): (1, 16, 3, False),    # 32.6 / 38.0
    ("stats", "layer", 4096): (1, 4, 4, False),     # 27.6 / 29.2
    ("delayed", "layer", 4096): (1, 8, 2, True),    # 38.3 / 45.8
    ("stats", "rms", 8192): (2, 16, 1, True),       # 8192x8192: 41.3 / 43.8
    ("delayed", "rms", 8192): (1, 32, 1, True),     # 68.1 / 73.1
    # 8192x8192 (benchmarks/fp8_ab.py at fd31e12, h200_2026-11-23_fp8ab_e88c315.json): 81.9 against
    # 189.9 for the old pick (1, 8, 2, False), which sweep 2 had at 86.8; LayerNorm's
    # 8192-wide rows are near the register limit and vary 80-400 us from config to
    # config (sweep 3)
    ("delayed", "layer", 8192): (2, 8, 2, True),
}
# H100 overrides of _PERSISTENT_ROWS (sweeps 5-7; every other entry above was the
# fastest or within 1% on the H100 too); programs a SM 0: one row block a program; the
# five-element tiles take row_amax. Us, this / the pick before it.
# [docs/fp8_tuning.md#fp8-h100-2026-11-26, #fp8-h100-row-amax]
_PERSISTENT_ROWS_H100: dict[tuple[str, str, int], tuple] = {
    ("delayed", "layer", 8192): (2, 16, 1, True),
    ("delayed", "rms", 2048): (1, 4, 8, True, True),   # 32768x2048: 72.3 / 75.9
    ("delayed", "rms", 4096): (1, 8, 4, True, True),   # 8192x4096: 38.2 / 39.4
    ("delayed", "rms", 8192): (1, 16, 2, True, True),  # 8192x8192: 78.4 / 79.6
    ("stats", "rms", 4096): (1, 4, 4, True, True),     # 8192x4096: 24.2 / 24.7
    ("stats", "rms", 8192): (1, 8, 2, True, True),     # 8192x8192: 46.5 / 47.5
    ("delayed", "layer", 4096): (1, 8, 3, True, True),  # 16384x4096: 82.9 / 83.6
    ("stats", "layer", 4096): (1, 4, 6, True, True),   # 8192x4096: 28.1 / 33.1
    ("stats", "layer", 8192): (1, 8, 2, True, True),   # 8192x8192: 61.5 / 71.2
}
# H100, 2-byte scale/bias where they want another tile than float32's (reloading 2-byte
# params a row block is cheap); us, this / the float32 pick, both with bf16 params.
# [docs/fp8_tuning.md#fp8-h100-row-amax]
_PERSISTENT_ROWS_H100_2B: dict[tuple[str, str, int], tuple] = {
    ("delayed", "rms", 4096): (1, 16, 3, False),    # 16384x4096: 71.0 / 74.1
    ("stats", "layer", 8192): (1, 4, 0, True),      # 8192x8192: 53.2 / 61.1
}
# H100, bf16 x of even N (sweep 8): Fp8Config.packed (x carried as bf16 pairs) and
# stream_x=False (x loaded without .cg) beat every pick above. {(kernel, op, N'):
# (block_m, num_warps, programs a SM, hoist_params, row_amax, packed, stream_x[,
# packed_params])}; us at the sweep's shapes, this / the pick before it.
# [docs/fp8_tuning.md#fp8-packed]
# packed_params (the packed kernel's bf16 scale/bias as uint32 pairs; nothing for other
# dtypes) at N' = 8192: delayed LayerNorm 42.8 -> 40.1 us at 4096x8192, 77.4 -> 74.8 at
# 8192x8192, RMSNorm 38.5 -> 37.3, 72.3 -> 70.7, LayerNorm's statistics pass 1-2%
# faster; at the N' 2048 and 4096 tiles within -1% to +1%: not taken there.
# [docs/fp8_tuning.md#fp8-packed-params-8192]
_BF16_ROWS_H100: dict[tuple[str, str, int], tuple] = {
    ("delayed", "rms", 4096): (2, 8, 2, True, True, True, False),    # 35.6/38.2, 69.3/74.2
    # 39.0/43.4, 74.7/82.9; 2 a SM (the registers' limit) against 4: 39.0/39.5, 74.7/75.4
    # (float32 params), 38.8/38.7, 73.7/74.6 (bf16; h100_2026-11-26_sweep8_fp8_ln4096_*)
    ("delayed", "layer", 4096): (2, 4, 2, True, True, True, False),
    ("delayed", "rms", 2048): (2, 4, 4, True, True, True, False),    # 69.2 / 72.6
    ("delayed", "layer", 2048): (2, 4, 4, True, True, True, False),  # 70.8 / 82.0
    ("delayed", "rms", 8192): (1, 8, 2, True, True, True, False, True),  # 72.9 / 78.4
    ("delayed", "layer", 8192): (2, 16, 1, True, False, False, False),  # 78.9 / 89.0
    ("stats", "layer", 4096): (2, 4, 4, True, True, True, False),    # 27.6 / 28.4
    ("stats", "layer", 2048): (2, 4, 4, True, True, True, False),    # 49.1 / 61.8
    ("stats", "layer", 8192): (1, 4, 2, True, True, True, False, True),  # 53.0 / 62.0
}
# The same with 2-byte scale/bias, where they want another config (us, this / the
# float32 rule above, both with bf16 params; the pick before: 89.1):
_BF16_ROWS_H100_2B: dict[tuple[str, str, int], tuple] = {
    ("delayed", "layer", 8192): (1, 4, 2, True, True, True, False, True),  # 76.5 / 80.5
    # 8192x4096 37.0 / 38.9, 16384x4096 71.6 / 74.0: [1, 4096] x 8 warps with the pairs
    # (79 registers; 3 a SM), h100_2026-11-27_sweep8_pp4096_1a9d994.json
    # [docs/fp8_tuning.md#fp8-pp-4096]
    ("delayed", "layer", 4096): (1, 8, 3, True, True, True, False, True),
    # statistics pass (current scaling), 8192x4096 25.8 / 27.2 (the pick before, (1, 4,
    # 6) of _PERSISTENT_ROWS_H100), 16384x4096 48.9 / 50.5,
    # h100_2026-11-27_sweep8_pp4096_stats_208c955.json [docs/fp8_tuning.md#fp8-pp-4096]
    ("stats", "layer", 4096): (1, 8, 3, True, True, True, False, True),
}
# Delayed with y_t: persistent programs over 32-row blocks (32 one-byte values = one
# 32-byte sector a y_t row) walked in 128-wide chunks, 16 warps, 2 a SM, scale/bias in the
# tile's layout (8192x4096: RMSNorm 71.6 / 78.3 at 32 x 256, a row block a program;
# LayerNorm 75.9 / 85.0). The second walk of a row block reads 32 * N * itemsize bytes
# back from L2.
_T_ROWS, _T_BLOCK_N, _T_WARPS, _T_PROGRAMS_PER_SM, _T_TILE_PARAMS = 32, 128, 16, 2, True
# H100, LayerNorm with y_t: 4 programs a SM (16384x4096 182.5/229.0; RMSNorm keeps 2).
# [docs/fp8_tuning.md#fp8-h100-2026-11-26]
_T_PROGRAMS_PER_SM_H100_LAYER = 4
# Delayed scaling with y_t on the H100: the one-pass kernel without y_t, then XLA's
# transpose of the FP8 y, not the fused kernel above (RMSNorm 8192x4096 64.4/85.5). The
# H200 is not measured. [docs/fp8_tuning.md#fp8-yt-separate]
_T_SEPARATE_DEVICES = ("H100",)
# Current scaling's quantise pass, a row block's tiles at a time from the bottom up: on
# the H100 2-6% faster without y_t (RMSNorm 8192x4096 64.2 -> 60.6 us, 16384x4096 121.0
# -> 116.0; LayerNorm 68.8 -> 67.3, 129.2 -> 125.1 at 8192x8192), RMSNorm with y_t 2-3%,
# LayerNorm with y_t within 0.5% (docs/fp8_tuning.md#fp8-current-order, at 15d32a1). The
# H200 not measured (none lent).
_Q_BOTTOM_UP_DEVICES = ("H100",)
_TILE_PARAMS = False  # the forward-tile path (tp there: 8192x4096 delayed 36.8 / 38.0, but
#                       32768x2048 80.2 / 69.2)
# Unmeasured: the quantise pass's 2-D tiles (25.6 us at 8192x4096 without y_t: 3.9 TB/s).
_Q_TILE_T = (64, 128)  # quantise with y_t: 64-byte y_t segments, 128-byte y segments
_Q_TILE = (8, 512)  # quantise without y_t: 512-byte y rows, 1 KiB x rows
_CPU_MIN_BLOCK_M = 64  # interpret mode runs programs one after another: fewer of them


# ------------------------------------------------------------------------ tables
# The FP8-output kernels' tuned configs (pallas_norm.tuning; the tuner's keys
# "fp8_stats", "fp8_delayed", "fp8_delayed_t", "fp8_quantise", "fp8_quantise_t", and
# "fp8_static": the delayed kernel without y_t writing y alone, ``stats=False``): an
# entry holds Fp8Config's fields (num_programs as programs_per_sm, 0: a row block a
# program), and for "fp8_delayed_t" ``separate`` (transpose_separately's choice), for
# the quantise keys ``bottom_up`` (quantise_bottom_up's).
FP8_FLAGS = ("separate", "bottom_up")


def table_pass(kernel: str, transpose: bool, stats: bool = True) -> str:
  """The tables' pass of an FP8 kernel ("stats" has no y_t; "delayed" without y_t and
  without ``stats``, y alone: "fp8_static")."""
  if kernel == "delayed" and not transpose and not stats:
    return "fp8_static"
  return f"fp8_{kernel}" + ("_t" if transpose and kernel != "stats" else "")


def table_passes(kernel: str, transpose: bool, stats: bool = True) -> tuple[str, ...]:
  """The tables' passes whose entries fit an FP8 kernel call, first choice first: its
  own (``table_pass``), then, for y alone ("fp8_static"), "fp8_delayed": the same
  kernel timed with the stores of mean, rstd and amax."""
  return tuple(dict.fromkeys((table_pass(kernel, transpose, stats),
                              table_pass(kernel, transpose))))


def _tuned_entry(kernel: str, m: int, n: int, dtype, subtract_mean: bool,
                 transpose: bool, param_dtype, interpret: bool, residual: bool = False,
                 stats: bool = True):
  """The tables' entry for this FP8 kernel call, or None (interpret mode: the CPU's
  tables only). ``residual``: the fused residual add's family ("rms_res", "layer_res").
  Without ``stats`` (y alone): the "fp8_static" entry, else the "fp8_delayed" one (the
  same kernel with its stores of mean, rstd and amax)."""
  from pallas_norm import config as _config
  from pallas_norm import tuning
  device = device_info()
  if interpret != (device.platform != "gpu"):
    return None  # compiled from a CPU or interpreted on a GPU: no table of that device
  for pass_ in table_passes(kernel, transpose, stats):
    key = _config.table_key(pass_, m, n, dtype, subtract_mean=subtract_mean,
                            param_dtype=param_dtype, residual=residual)
    found = tuning.lookup(key, device.name, backend="pallas", gpu=device.platform == "gpu")
    if found is not None:
      return found[0]
  return None


def fp8_entry_fields(cfg: Fp8Config, num_sms: int, m: int | None = None,
                     **flags) -> dict:
  """An Fp8Config's fields as a table stores them (``programs_per_sm``; at least 1
  where the rows clamped a persistent grid), with ``flags`` (FP8_FLAGS) beside."""
  f = dataclasses.asdict(cfg)
  g = f.pop("num_programs")
  pps = round(g / num_sms, 6)
  if g and m is not None and g == cdiv(m, cfg.block_m):
    pps = max(1.0, pps)
  return dict(f, programs_per_sm=pps, **flags)


def fp8_from_entry(entry, m: int, n: int, dtype, transpose: bool,
                   interpret: bool) -> Fp8Config | None:
  """``entry``'s Fp8Config rebuilt for x [m, n] (block_n the whole padded row where the
  entry's was, block_m at most the rows, programs_per_sm times the SMs), or None where
  it does not fit (``_packed_x``'s conditions, a tile past 65536 elements)."""
  from pallas_norm import config as _config
  try:
    f, pps = _config.entry_tile({k: v for k, v in entry.fields.items()
                                 if k not in FP8_FLAGS}, entry.key.n, m, n, interpret)
    f["num_programs"] = (0 if not pps else max(1, min(int(round(pps * device_info().num_sms)),
                                                     cdiv(m, f["block_m"]))))
    cfg = Fp8Config(**f)
  except (TypeError, ValueError):
    return None
  if not interpret and cfg.block_m * cfg.block_n > 65536:
    return None
  if cfg.column_splits > 1 and n > cfg.block_n:
    return None
  if cfg.packed and (jnp.dtype(dtype) != jnp.bfloat16 or n % 2 or n > cfg.block_n
                     or transpose or not cfg.num_programs):
    return None
  return cfg


def _tuned_flag(flag: str, kernel: str, shape, dtype, subtract_mean: bool,
                transpose: bool, param_dtype, interpret: bool) -> bool | None:
  """A table entry's FP8_FLAGS value for this call, or None (no entry, or no such
  field)."""
  if shape is None:
    return None
  e = _tuned_entry(kernel, *shape, dtype, subtract_mean, transpose, param_dtype, interpret)
  v = None if e is None else e.fields.get(flag)
  return None if v is None else bool(v)


def quantise_bottom_up(interpret: bool = False, shape=None, dtype=None,
                       subtract_mean: bool = False, transpose: bool = False,
                       param_dtype=None) -> bool:
  """Whether current scaling's quantise pass walks its tiles a row block at a time from
  the last row block up: the statistics pass read x top to bottom just before, so the
  last rows it read may still be in L2. Otherwise the launch grid's order (row blocks
  fastest, a column of tiles top to bottom, then the next). The same values either way.
  Given the call (``shape`` [M, N] and the rest), a table entry's ``bottom_up`` first;
  else ``_Q_BOTTOM_UP_DEVICES`` (measured); interpret mode keeps the launch order (the
  tests force each)."""
  v = _tuned_flag("bottom_up", "quantise", shape, dtype, subtract_mean, transpose,
                  param_dtype, interpret)
  return _on_devices(_Q_BOTTOM_UP_DEVICES, interpret) if v is None else v


def transpose_separately(interpret: bool = False, shape=None, dtype=None,
                         subtract_mean: bool = False, param_dtype=None) -> bool:
  """Whether delayed scaling's y_t is best written as XLA's transpose of the one-pass
  kernel's y rather than by the fused kernel (``fp8_norm_delayed(transpose=True)``).
  Given the call (``shape`` [M, N] and the rest), a table entry's ``separate`` first;
  else ``_T_SEPARATE_DEVICES`` (measured). Interpret mode keeps the fused kernel."""
  v = _tuned_flag("separate", "delayed", shape, dtype, subtract_mean, True, param_dtype,
                  interpret)
  return _on_devices(_T_SEPARATE_DEVICES, interpret) if v is None else v


def _on_devices(devices: tuple[str, ...], interpret: bool) -> bool:
  """A device rule: compiled on a GPU whose name holds one of ``devices``."""
  if interpret:
    return False
  device = device_info()
  return device.platform == "gpu" and any(d in device.name for d in devices)


def _warps(tile_elems: int) -> int:
  """One 16-byte vector of 2-byte x (8 values) a thread: tile / 256 warps in [4, 16]."""
  return max(4, min(16, tile_elems // 256))


def _few_rows(m: int, n: int, dtype, kernel: str, subtract_mean: bool, device,
              gpu: bool) -> Fp8Config | None:
  """Few rows (decode): the forward's few-row rows (``config._few_rows_tile``: a GPU, up
  to 64 rows of 2-byte or wider x, 256 < N' <= 8192, N' = 16384 from 8 rows), "delayed"
  without y_t and "stats": a row a program at the forward's few-row warps, scale/bias
  loaded with x, before the row's reductions (``_persistent_kernel`` with one row block
  a program and ``hoist_params``), not the many-row persistent picks, which load them
  after the statistics or put two rows in a program, nor (at N' = 16384) 8-row chunked
  blocks; up to 8 rows of N' >= 8192, each row over 8 programs (``column_splits``).
  [docs/tuning_rules.md#few-rows]"""
  if not (gpu and kernel in ("delayed", "stats") and _few_rows_tile(m, n, dtype, device)):
    return None
  fwd = forward_config(m, n, dtype, "multi_wave_cached", device,
                       subtract_mean=subtract_mean, tuned=False)
  n_pad = next_power_of_2(n)
  if m <= _COLUMN_SPLIT_MAX_M and n_pad >= _COLUMN_SPLIT_MIN_BLOCK_N:  # the forward's rows
    return Fp8Config(1, n_pad, fwd.num_warps, tile_params=True,
                     column_splits=_FP8_COLUMN_SPLITS)
  return Fp8Config(1, n_pad, fwd.num_warps, m, tile_params=True, hoist_params=True)


# Few rows of a long row: the FP8 row kernel's column splits (Fp8Config.column_splits)
# on the forward's rows (config._column_splits: up to 8 rows of N' >= 8192), 8 a row.
# H200, 2026-11-28, static-scale y alone, us (CUPTI, 5 rounds of 10 calls interleaved;
# every variant also ran a 0.7 us broadcast of the probe's captured scale), the few-row
# default / 2 / 4 / 8 / 16 splits: RMSNorm 8x8192 2.5 / 2.4 / 2.3 / 2.2 / 2.4,
# LayerNorm 8x8192 3.6 / 3.5 / 3.3 / 3.2 / 3.3; at N 4096 within 0.1 us, at 64 rows
# slower (64x8192: 2.7 / 2.8 / 2.8 / 3.3 / 4.3).
# [docs/tuning_rules.md#few-rows]
_FP8_COLUMN_SPLITS = 8


def fp8_config(m: int, n: int, dtype=jnp.bfloat16, *, kernel: str,
               subtract_mean: bool = False, transpose: bool = False,
               interpret: bool = False, param_dtype=None, tuned: bool = True,
               residual: bool = False, stats: bool = True) -> Fp8Config:
  """The launch config of ``kernel`` ("delayed", "stats" or "quantise") for x [M, N]:
  the tuning tables' entry for the call (``tuned``; ``fp8_from_entry``), else the
  default below.

  "stats" and "delayed" without y_t are the forward's kernel plus an epilogue (amax,
  quantise, a 1-byte store), so they take the forward's measured tile of the same
  rows (``config.forward_config``): multi_wave_cached's whole row up to N = 8192,
  multi_wave_reload's chunks beyond; up to 64 rows on a GPU, a row a program with
  scale/bias loaded with x (``_few_rows``). "delayed" with y_t takes 32-row blocks walked in
  256-wide chunks, "quantise" its own 2-D tiles (constants above, unmeasured). The
  variants (persistent programs, scale/bias in the tile's layout) are picked from
  ``_PERSISTENT_ROWS``, ``_T_PROGRAMS_PER_SM`` (with ``_T_ROWS``, ``_T_BLOCK_N``,
  ``_T_WARPS``) and ``_TILE_PARAMS``, on a GPU (H200-measured rules, the constants'
  comments), with the H100's own picks where they differ (``_PERSISTENT_ROWS_H100``,
  ``_T_PROGRAMS_PER_SM_H100_LAYER``; ``_PERSISTENT_ROWS_H100_2B`` where ``param_dtype``,
  scale/bias's dtype, None without them, is 2 bytes wide; first of all, for bf16 x of
  even N, ``_BF16_ROWS_H100`` / ``_BF16_ROWS_H100_2B``: the packed kernel, x loaded
  without .cg).

  ``residual`` (delayed scaling with ``residual=``): the tables' entry of the residual
  family ("rms_res" / "layer_res"), else this function's config without it; either as
  ``residual_config`` makes it (one program a row block).

  ``stats`` False ("delayed" without y_t: y alone, static scaling's): the tables'
  "fp8_static" entry first, then the "fp8_delayed" one (``_tuned_entry``).

  Raises:
    ValueError: an unknown kernel name.
  """
  if kernel not in KERNELS:
    raise ValueError(f"{kernel=} is not an FP8 kernel; valid: {KERNELS}")
  if residual:
    e = tuned and _tuned_entry(kernel, m, n, dtype, subtract_mean, transpose, param_dtype,
                               interpret, residual=True, stats=stats)
    cfg = fp8_from_entry(e, m, n, dtype, transpose, interpret) if e else None
    if cfg is None:
      cfg = fp8_config(m, n, dtype, kernel=kernel, subtract_mean=subtract_mean,
                       transpose=transpose, interpret=interpret, param_dtype=param_dtype,
                       tuned=tuned, stats=stats)
    return residual_config(cfg)
  if tuned:
    e = _tuned_entry(kernel, m, n, dtype, subtract_mean, transpose, param_dtype, interpret,
                     stats=stats)
    cfg = None if e is None else fp8_from_entry(e, m, n, dtype, transpose, interpret)
    if cfg is not None:
      return cfg
  if kernel == "quantise":
    bm, bn = _Q_TILE_T if transpose else _Q_TILE
    bn = min(bn, next_power_of_2(n))
    bm = min(bm, next_power_of_2(m)) if not interpret else max(bm, min(
        _CPU_MIN_BLOCK_M, next_power_of_2(m)))
    return Fp8Config(bm, bn, _warps(bm * bn))
  device = device_info()
  sms = device.num_sms
  # The persistent picks are GPU rules: interpret mode (CPU) runs programs one after
  # another, so it keeps the forward's (CPU-sized) tiles and one row block a program.
  gpu = not interpret and device.platform == "gpu"
  if kernel == "delayed" and transpose and not gpu:
    bn = min(next_power_of_2(n), _T_BLOCK_N)
    return Fp8Config(_T_ROWS, bn, _warps(_T_ROWS * bn))
  h100 = "H100" in device.name
  if kernel == "delayed" and transpose:
    bn = min(next_power_of_2(n), _T_BLOCK_N)
    per_sm = (_T_PROGRAMS_PER_SM_H100_LAYER if h100 and subtract_mean
              else _T_PROGRAMS_PER_SM)
    return Fp8Config(_T_ROWS, bn, _T_WARPS or _warps(_T_ROWS * bn), sms * per_sm,
                     _T_TILE_PARAMS)
  few = _few_rows(m, n, dtype, kernel, subtract_mean, device, gpu)
  if few is not None:
    return few
  key = (kernel, "layer" if subtract_mean else "rms", next_power_of_2(n))
  tile = None
  two_byte = param_dtype is not None and jnp.dtype(param_dtype).itemsize == 2
  if h100 and jnp.dtype(dtype) == jnp.bfloat16 and n % 2 == 0:
    tile = (_BF16_ROWS_H100_2B if two_byte else {}).get(key, _BF16_ROWS_H100.get(key))
  if h100 and tile is None and two_byte:
    tile = _PERSISTENT_ROWS_H100_2B.get(key)
  if h100 and tile is None:
    tile = _PERSISTENT_ROWS_H100.get(key)
  tile = tile or _PERSISTENT_ROWS.get(key)
  if gpu and tile is not None and next_power_of_2(n) <= _WHOLE_ROW_MAX:
    bm, warps, per_sm, hoist, *rest = tile  # rest: row_amax, packed, stream_x, packed_params
    return Fp8Config(bm, next_power_of_2(n), warps, sms * per_sm, True, hoist, *rest)
  mode = "multi_wave_cached" if next_power_of_2(n) <= _WHOLE_ROW_MAX else "multi_wave_reload"
  fwd = forward_config(m, n, dtype, mode, subtract_mean=subtract_mean, tuned=False)
  if fwd.block_n < n and mode == "multi_wave_cached":  # a split row: not this kernel's
    fwd = forward_config(m, n, dtype, "multi_wave_reload", subtract_mean=subtract_mean,
                         tuned=False)
  return Fp8Config(fwd.block_m, fwd.block_n, fwd.num_warps, tile_params=_TILE_PARAMS)


# --------------------------------------------------------------------------- tile code


def _amax_bits(y, mask):
  """|y| as int32 bits, elementwise (y's shape); the elements outside ``mask`` are 0. A
  max over them is the max |y| (NaN, whose bits are above +Inf's, propagates)."""
  bits = lax.bitcast_convert_type(y, jnp.int32) & jnp.int32(0x7FFFFFFF)
  if mask is not None:
    bits = jnp.where(mask, bits, jnp.int32(0))
  return bits


def _max_abs_nan(acc, y):
  """max(acc, |y|) elementwise for float32 tiles, NaN where either is NaN: PTX
  ``abs.f32`` and ``max.NaN.f32`` (sm_80+), which ptxas folds into one FMNMX.NAN with a
  |.| operand. jnp.maximum lowers to ``maxnumf``, which drops a NaN, and jnp.abs to
  ``abs.ftz.f32``, which flushes subnormals to 0."""
  return plgpu.elementwise_inline_asm(
      "{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", args=[acc, y],
      constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, _F32)])[0]


def _fold_amax(acc, y, mask, hw_amax):
  """The running elementwise amax ``acc`` (None: none yet) folded with |y| (0 outside
  ``mask``). ``hw_amax`` (compiled): float32 and ``_max_abs_nan``, one instruction an
  element; else (interpret mode) the int32 bits of |y| (``_amax_bits``) and an integer
  max. Both order non-negative values as the floats do and keep a NaN; ``_amax_out``
  turns either into int32 bits."""
  if hw_amax:
    if mask is not None:
      y = jnp.where(mask, y, _F32(0))
    return _max_abs_nan(jnp.zeros_like(y) if acc is None else acc, y)
  bits = _amax_bits(y, mask)
  return bits if acc is None else jnp.maximum(acc, bits)


def _amax_zeros(shape, hw_amax):
  return jnp.zeros(shape, _F32 if hw_amax else jnp.int32)


def _carry_init(row_amax, shape, hw_amax):
  """A persistent program's running amax at the start: int32 bits of a scalar
  (``row_amax``: each row block reduced at once) or the elementwise carry of ``shape``
  (``_fold_amax``'s)."""
  return jnp.zeros((), jnp.int32) if row_amax else _amax_zeros(shape, hw_amax)


def _carry_out(carry, row_amax):
  """int32 bits of the max of a ``_carry_init`` carry after the loop."""
  return carry if row_amax else _amax_out(carry, (0, 1))


def _amax_out(acc, axes):
  """int32 bits of the max of ``acc`` (``_fold_amax``'s) over ``axes`` (a tuple), reduced
  as integers: the bits of a non-negative float or of max.NaN's NaN (0x7FFFFFFF) order as
  the values, with NaN above +Inf (a float max reduction would drop it)."""
  if acc.dtype != jnp.int32:
    acc = lax.bitcast_convert_type(acc, jnp.int32)
  for ax in sorted(axes, reverse=True):
    acc = jnp.max(acc, axis=ax)
  return acc


def _load_params_2d(scale_ref, bias_ref, cols, col_mask, scale_offset):
  """_load_params as [1, block_n] f32 rows, indexed in the tile's 2-D shape: loaded in the
  tile's layout, not as a 1-D vector that the compiler then converts through shared
  memory (a [4096] f32 scale at 4 warps: 8 rounds, 16 barriers a row block; PTX)."""
  return _load_params(scale_ref, bias_ref, cols[None, :],
                      None if col_mask is None else col_mask[None, :], scale_offset)


def _emit(x, tile, mean, rstd, params, q, acc, hw_amax):
  """y_f32 of the f32 x ``tile`` ((rows, cols, row_mask, col_mask, mask)) from the rows'
  ``mean`` (None: RMSNorm) and ``rstd``; quantised and stored when ``q`` is
  (inv, fp8_dtype, y_ref, y_t_ref or None, hw_sat). Returns the running elementwise amax
  ``acc`` (None: none yet) folded with the tile's |y| (``_fold_amax``, [block_m,
  block_n]).

  ``hw_sat`` (compiled for the GPU): the cast to FP8 is the hardware's saturating one,
  ``cvt.rn.satfinite.e4m3x2.f32`` / ``.e5m2x2.f32`` (Triton's float32 -> FP8
  conversion on sm_89+), which clips finite values and +-Inf to +-fp8_max and keeps
  NaN: ``pallas_norm.fp8.quantise``'s semantics without its two selects (four
  instructions an element of a kernel that issues ~19). Interpret mode keeps them: XLA's
  CPU cast does not saturate. tests/test_fp8_output.py's saturation and NaN/Inf tests
  check both."""
  rows, cols, _, col_mask, mask = tile
  if mean is not None:
    x = x - mean[:, None]
  w, b = params(cols, col_mask)
  y = _affine(x * rstd[:, None], w, b)  # [block_m, block_n] f32
  if q is not None:
    inv, fp8_dtype, y_ref, y_t_ref, hw_sat = q
    yq = (y * inv).astype(fp8_dtype) if hw_sat else quantise(y, inv, fp8_dtype)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], yq, mask=mask)
    if y_t_ref is not None:  # y_t[c, r] = y[r, c]: the same tile through transposed indices
      plgpu.store(y_t_ref.at[cols[None, :], rows[:, None]], yq, mask=mask)
  # Masked elements were loaded as 0: their y is 0 unless a mean or a bias moves it.
  return _fold_amax(acc, y, mask if mean is not None or b is not None else None, hw_amax)


def _walk(num_chunks, body, init):
  """``body(k, carry)`` over chunks k = num_chunks - 1, ..., 0 (the last ones read by
  the statistics pass are the likeliest in L2), unrolled for short rows."""
  if num_chunks <= RELOAD_UNROLL_MAX_CHUNKS:
    carry = init
    for j in range(num_chunks):
      carry = body(jnp.int32(num_chunks - 1 - j), carry)
    return carry
  return lax.fori_loop(0, num_chunks, lambda j, c: body(num_chunks - 1 - j, c), init)


def _norm_refs(refs, has_scale, has_bias, fp8_dtype, transpose, subtract_mean, hw_sat,
               has_residual=False, stats=True):
  """(x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref) of a row-block kernel;
  q as in _emit (None for the statistics kernel), the absent refs None (mean, rstd and
  amax all three without ``stats``). With a residual (inputs x, residual, ...; outputs
  y[, y_t], h, ...) x_ref is forward.py's _Sum of x and the residual, which stores h at
  the first load of each element."""
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  q = None
  if fp8_dtype is not None:
    inv_ref, y_ref = refs.pop(0), refs.pop(0)
    y_t_ref = refs.pop(0) if transpose else None
    q = (inv_ref[0], jnp.dtype(fp8_dtype), y_ref, y_t_ref, hw_sat)
  if has_residual:
    x_ref = _Sum(x_ref, r_ref, refs.pop(0))
  # RMSNorm's mean_ref: its zeros (_store_row_stats)
  mean_ref, rstd_ref, amax_ref = refs if stats else (None, None, None)
  return x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref


def _chunked_block(rb, x_ref, tile, params, q, amax, *, n, eps, subtract_mean, block_m,
                   block_n, hw_amax):
  """Row block ``rb`` in block_n chunks: statistics, then a second walk (from L2) that
  emits. ``amax``: the running elementwise amax (``_fold_amax``), [block_m, block_n].
  Returns (mean or None, rstd, amax)."""
  mean, acc = _chunk_stats(rb, x_ref, n=n, subtract_mean=subtract_mean, block_m=block_m,
                           block_n=block_n)
  rstd = lax.rsqrt(acc / n + _F32(eps))

  def body(k, amax):
    t = tile(rb, k)
    x = _load_tile(x_ref, t[0], t[1], t[4])
    return _emit(x, t, mean, rstd, params, q, amax, hw_amax)

  return mean, rstd, _walk(cdiv(n, block_n), body, amax)


def _store_row_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd):
  if rstd_ref is None:  # without stats (static scaling's y alone): nothing stored
    return
  plgpu.store(rstd_ref.at[rows], rstd, mask=row_mask)
  if mean_ref is not None:  # RMSNorm (mean None): Fp8Norm's zeros mean
    plgpu.store(mean_ref.at[rows], jnp.zeros_like(rstd) if mean is None else mean,
                mask=row_mask)


def _norm_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                 fp8_dtype, transpose, hw_sat, hw_amax, tile_params, block_m, block_n,
                 column_splits=1, has_residual=False, stats=True):
  """Row block ``program_id(0)``: statistics, y_f32, row amax; quantised and stored
  when ``fp8_dtype`` is given (delayed scaling), else only mean/rstd/amax (pass 1 of
  current scaling). With ``column_splits`` (whole rows), program p is split
  p % column_splits of row block p // column_splits: the whole row's statistics, its
  share of the columns quantised, an amax partial a row and split (amax_ref
  [M x column_splits]); split 0 stores mean/rstd. ``has_residual`` (one program a row
  block, no column splits): x + residual normalised, h stored (``_norm_refs``). Without
  ``stats`` (static scaling's y alone) no mean, rstd or amax is stored (the amax's folds,
  unused, are dead code)."""
  x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref = _norm_refs(
      refs, has_scale, has_bias, fp8_dtype, transpose, subtract_mean, hw_sat, has_residual,
      stats)
  m = x_ref.shape[0]
  rb, k = pl.program_id(0), 0
  if column_splits > 1:
    rb, k = rb // column_splits, rb % column_splits
  tile = functools.partial(_tile_index, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)
  params = functools.partial(_load_params_2d if tile_params else _load_params, scale_ref,
                             bias_ref, scale_offset=scale_offset)
  t0 = tile(rb, 0)
  rows, _, row_mask, _, mask = t0
  if cdiv(n, block_n) == 1:  # the row block stays in registers: x is read once
    x = _load_tile(x_ref, rows, t0[1], mask, first=True)  # [block_m, block_n] f32, 0 outside
    mean, rstd, _ = _tile_stats(x, mask, n=n, eps=eps, subtract_mean=subtract_mean)
    if column_splits > 1:  # this split's columns, reloaded (L1/L2)
      tk = _chunk_index(rb, k, m, n, block_m=block_m, block_n=block_n,  # masked past N
                        chunk_n=block_n // column_splits, rows_in_bounds=True)
      amax = _emit(_load_tile(x_ref, tk[0], tk[1], tk[4]), tk, mean, rstd, params, q,
                   None, hw_amax)
      if stats:
        first = k == 0
        _store_row_stats(mean_ref, rstd_ref, rows,
                         first if row_mask is None else row_mask & first, mean, rstd)
        plgpu.store(amax_ref.at[rows * column_splits + k], _amax_out(amax, (1,)),
                    mask=row_mask)
      return
    amax = _emit(x, t0, mean, rstd, params, q, None, hw_amax)
  else:  # statistics over the chunks, then a second walk (from L2) that stores
    mean, rstd, amax = _chunked_block(rb, x_ref, tile, params, q,
                                      _amax_zeros((block_m, block_n), hw_amax), n=n,
                                      eps=eps, subtract_mean=subtract_mean,
                                      block_m=block_m, block_n=block_n, hw_amax=hw_amax)
  if stats:
    _store_row_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd)
    plgpu.store(amax_ref.at[rows], _amax_out(amax, (1,)), mask=row_mask)


def _row_block_loader(x_ref, *, n, block_m, block_n, stream):
  """``load(rb)``: row block rb's [block_m, block_n] tile of x as stored (0 outside; past
  the last row block fully masked, no memory access), through the ``.cg`` cache modifier
  when ``stream`` (forward.py's ``_load_row_block``), else a plain load
  (``Fp8Config.stream_x``)."""
  m = x_ref.shape[0]

  def load(rb):
    rows, cols, _, _, mask = _tile_index(rb, 0, m, n, block_m=block_m, block_n=block_n)
    return plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask,
                      other=None if mask is None else jnp.array(0, x_ref.dtype),
                      cache_modifier=stream_cache_modifier() if stream else None)

  return load


def _persistent_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                       fp8_dtype, transpose, hw_sat, hw_amax, tile_params, hoist_params,
                       row_amax, stream_x, block_m, block_n, num_programs, stats=True):
  """``_norm_kernel`` over row blocks r, r + G, ... (r = program_id(0), G =
  ``num_programs``), with the amax as one partial a program; without ``stats`` (static
  scaling's y alone) no mean, rstd or amax stored, as ``_norm_kernel``'s.

  Whole rows (block_n >= N): scale/bias loaded once (``hoist_params``; else once a row
  block), the next row block's x loaded before this one's reductions (its loads in
  flight during them; past the last block fully masked), as forward.py's
  static_persistent. Longer rows: each row block chunked
  as in ``_norm_kernel``. |y| is max-ed elementwise into a [block_m, block_n] carry
  (``_fold_amax``; no reduction a row) and reduced across the tile once, at the end:
  amax_ref [G] int32 (``reduce_amax``'s input as the row amaxes are).
  """
  x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref = _norm_refs(
      refs, has_scale, has_bias, fp8_dtype, transpose, subtract_mean, hw_sat,
      stats=stats)
  m = x_ref.shape[0]
  pid = pl.program_id(0)
  num_steps = (cdiv(m, block_m) - 1 - pid) // num_programs + 1
  tile = functools.partial(_tile_index, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)
  stat_kw = dict(n=n, eps=eps, subtract_mean=subtract_mean)
  params = functools.partial(_load_params_2d if tile_params else _load_params, scale_ref,
                             bias_ref, scale_offset=scale_offset)
  if cdiv(n, block_n) == 1:
    _, cols, _, col_mask, _ = _tile_index(0, 0, 1, n, block_m=1, block_n=block_n)
    if hoist_params:
      w, b = params(cols, col_mask)
      params = lambda c, cm: (w, b)
    load = _row_block_loader(x_ref, n=n, block_m=block_m, block_n=block_n, stream=stream_x)

    def body(i, carry):
      amax, x = carry  # x: this row block's tile in x's dtype, 0 outside
      rb = pid + i * num_programs
      x_next = load(rb + num_programs)  # the prefetch
      t = tile(rb, 0)
      x = x.astype(_F32)
      mean, rstd, _ = _tile_stats(x, t[4], **stat_kw)
      if row_amax:  # the row block's amax bits now: a scalar carry
        a = _emit(x, t, mean, rstd, params, q, None, hw_amax)
        amax = jnp.maximum(amax, _amax_out(a, (0, 1)))
      else:
        amax = _emit(x, t, mean, rstd, params, q, amax, hw_amax)
      _store_row_stats(mean_ref, rstd_ref, t[0], t[2], mean, rstd)
      return amax, x_next

    init = _carry_init(row_amax, (block_m, block_n), hw_amax)
    amax, _ = lax.fori_loop(0, num_steps, body, (init, load(pid)))
    if stats:
      amax_ref[pid] = _carry_out(amax, row_amax)
  else:  # chunked rows: the elementwise carry (row_amax is for whole rows)
    def body(i, amax):
      rb = pid + i * num_programs
      mean, rstd, amax = _chunked_block(rb, x_ref, tile, params, q, amax, block_m=block_m,
                                        block_n=block_n, hw_amax=hw_amax, **stat_kw)
      t = tile(rb, 0)
      _store_row_stats(mean_ref, rstd_ref, t[0], t[2], mean, rstd)
      return amax

    amax = lax.fori_loop(0, num_steps, body, _amax_zeros((block_m, block_n), hw_amax))
    if stats:
      amax_ref[pid] = _amax_out(amax, (0, 1))


def _unpack_bf16(u):
  """(even, odd) float32 columns of a tile of bf16 pairs held as uint32 (the even
  column in the low half, as a bitcast of a little-endian bf16 array lays them):
  exact, a shift and an AND a pair."""
  return (lax.bitcast_convert_type(u << 16, _F32),
          lax.bitcast_convert_type(u & jnp.uint32(0xFFFF0000), _F32))


def _param_pair(ref, packed, cols, cm, offset):
  """(even, odd) columns of scale (``offset`` added) or bias as [1, bh] f32, (None,
  None) without the ref: from uint32 pairs of bf16 (``packed``: one load) or two
  strided gathers."""
  if ref is None:
    return None, None
  if packed:
    pair = _unpack_bf16(plgpu.load(ref.at[cols[None, :]], mask=cm, other=(
        None if cm is None else jnp.array(0, ref.dtype))))
  else:
    pair = tuple(_load(ref.at[c[None, :]], cm).astype(_F32) for c in (2 * cols, 2 * cols + 1))
  return tuple(p + _F32(offset) for p in pair) if offset else pair


def _fp8_pair(hi, lo, inv, fp8_dtype, hw_sat):
  """int16 pairs of FP8 values of ``hi * inv`` (high byte) and ``lo * inv`` (low byte),
  quantised as _emit does: compiled, the hardware's two-value saturating conversion
  ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` (the instruction Triton emits for a float32
  -> FP8 cast on sm_89+); else ``quantise`` through the uint8 bits."""
  if hw_sat:
    fmt = {"float8_e4m3fn": "e4m3x2", "float8_e5m2": "e5m2x2"}[fp8_dtype.name]
    return plgpu.elementwise_inline_asm(
        f"cvt.rn.satfinite.{fmt}.f32 $0, $1, $2;", args=[hi * inv, lo * inv],
        constraints="=h,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(hi.shape, jnp.int16)])[0]
  bits = lambda v: lax.bitcast_convert_type(quantise(v, inv, fp8_dtype),
                                            jnp.uint8).astype(jnp.uint32)
  pair = ((bits(hi) << 8) | bits(lo)).astype(jnp.uint16)
  return lax.bitcast_convert_type(pair, jnp.int16)


def _packed_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                   fp8_dtype, transpose, hw_sat, hw_amax, tile_params, hoist_params,
                   row_amax, stream_x, block_m, block_n, num_programs,
                   packed_params=(False, False), stats=True):
  """``_persistent_kernel``'s whole-row path (``Fp8Config.packed``) over x held as bf16
  pairs: x_ref [M, N / 2] uint32, y_ref (delayed) [M, N / 2] int16 pairs of FP8 values
  (the launcher bitcasts both). Each [block_m, block_n / 2] tile is unpacked into its
  even and odd columns (``_unpack_bf16``), the statistics sum both, scale/bias are
  loaded as their even and odd halves, and each pair of y values is quantised into one
  int16 (``_fp8_pair``). Outputs as ``_persistent_kernel``'s, the row sums taken in
  another order (pairs first): on the H100, y's bytes equal but for a few in 10^7, one
  FP8 ulp apart (benchmarks/fp8_sweep8.py at fd31e12 checks them). Without ``stats``
  no mean, rstd or amax stored."""
  del transpose, tile_params  # no y_t (the launcher checks); params as [1, N / 2] rows
  x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref = _norm_refs(
      refs, has_scale, has_bias, fp8_dtype, False, subtract_mean, hw_sat, stats=stats)
  m, h = x_ref.shape
  bh = block_n // 2
  pid = pl.program_id(0)
  num_steps = (cdiv(m, block_m) - 1 - pid) // num_programs + 1
  tile = functools.partial(_tile_index, m=m, n=h, block_m=block_m, block_n=bh,
                           rows_in_bounds=True)
  _, cols, _, col_mask, _ = _tile_index(0, 0, 1, h, block_m=1, block_n=bh)
  cm = None if col_mask is None else col_mask[None, :]

  def params():  # ((w, b) of the even columns, (w, b) of the odd ones), [1, bh] f32
    if not any(packed_params):
      return tuple(_load_params(scale_ref, bias_ref, c[None, :], cm, scale_offset)
                   for c in (2 * cols, 2 * cols + 1))
    return tuple(zip(*(_param_pair(r, p, cols, cm, off) for r, p, off in (
        (scale_ref, packed_params[0], scale_offset), (bias_ref, packed_params[1], 0.0)))))

  if hoist_params:
    hoisted = params()
    params = lambda: hoisted
  load = _row_block_loader(x_ref, n=h, block_m=block_m, block_n=bh, stream=stream_x)

  def body(i, carry):
    amax, u = carry  # u: this row block's pairs as loaded, 0 outside
    rb = pid + i * num_programs
    u_next = load(rb + num_programs)  # the prefetch, carried as loaded
    rows, _, row_mask, _, mask = tile(rb, 0)
    lo, hi = _unpack_bf16(u)
    mean = None
    if subtract_mean:
      mean = jnp.sum(lo + hi, axis=1) / n
      lo, hi = _where0(mask, lo - mean[:, None]), _where0(mask, hi - mean[:, None])
    rstd = lax.rsqrt(jnp.sum(lo * lo + hi * hi, axis=1) / n + _F32(eps))
    (we, be), (wo, bo) = params()
    ye = _affine(lo * rstd[:, None], we, be)
    yo = _affine(hi * rstd[:, None], wo, bo)
    if q is not None:
      inv, fp8, y_ref, _, _ = q
      plgpu.store(y_ref.at[rows[:, None], cols[None, :]],
                  _fp8_pair(yo, ye, inv, fp8, hw_sat), mask=mask)
    # Masked pairs are 0 unless a bias moves them.
    fold_mask = mask if be is not None else None
    a = _fold_amax(None if row_amax else amax, ye, fold_mask, hw_amax)
    a = _fold_amax(a, yo, fold_mask, hw_amax)
    amax = jnp.maximum(amax, _amax_out(a, (0, 1))) if row_amax else a
    _store_row_stats(mean_ref, rstd_ref, rows, row_mask, mean, rstd)
    return amax, u_next

  amax, _ = lax.fori_loop(0, num_steps, body,
                          (_carry_init(row_amax, (block_m, bh), hw_amax), load(pid)))
  if stats:
    amax_ref[pid] = _carry_out(amax, row_amax)


def _quantise_kernel(*refs, n, scale_offset, subtract_mean, has_scale, has_bias,
                     fp8_dtype, transpose, with_amax, hw_sat, hw_amax, block_m, block_n,
                     bottom_up=False, grid_m=1):
  """Tile (i, j) of y: y_f32 from the given mean/rstd, quantised with inv and stored
  (pass 2 of current scaling), and with ``with_amax`` the tile's max |y_f32| bits stored
  at amax_ref[i * grid_n + j]. ``fp8_dtype`` None: only the amax (no inv, no y): the
  tensor-parallel amax pass. (i, j) = (program_id(0), program_id(1)), or with
  ``bottom_up`` (``quantise_bottom_up``) from a 1-D grid: row block grid_m - 1 first."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  mean_ref = refs.pop(0) if subtract_mean else None
  rstd_ref = refs.pop(0)
  q = None
  if fp8_dtype is not None:
    inv_ref, y_ref = refs.pop(0), refs.pop(0)
    y_t_ref = refs.pop(0) if transpose else None
    q = (inv_ref[0], jnp.dtype(fp8_dtype), y_ref, y_t_ref, hw_sat)
  amax_ref = refs.pop(0) if with_amax else None
  if bottom_up:  # a 1-D grid: a row block's tiles in turn, row blocks last first
    pid, grid_n = pl.program_id(0), cdiv(n, block_n)
    i, j = grid_m - 1 - pid // grid_n, lax.rem(pid, grid_n)
  else:
    i, j = pl.program_id(0), pl.program_id(1)
  t = _tile_index(i, j, x_ref.shape[0], n, block_m=block_m, block_n=block_n,
                  rows_in_bounds=True)
  rows, cols, row_mask, _, mask = t
  x = _load_tile(x_ref, rows, cols, mask)  # [block_m, block_n] f32
  mean = None if mean_ref is None else _load(mean_ref.at[rows], row_mask)  # [block_m]
  rstd = _load(rstd_ref.at[rows], row_mask)
  params = functools.partial(_load_params, scale_ref, bias_ref, scale_offset=scale_offset)
  amax = _emit(x, t, mean, rstd, params, q, None, hw_amax)
  if amax_ref is not None:
    amax_ref[i * cdiv(n, block_n) + j] = _amax_out(amax, (0, 1))


# --------------------------------------------------------------------------- launchers


def _row_outs(x, num_amax):
  """mean [M] f32 (RMSNorm: zeros, written by the kernel: an XLA broadcast instead was a
  kernel of its own, 0.6-1.6 us of the op on the H100, docs/fp8_tuning.md#fp8-rms-mean),
  rstd [M] f32, and the amax bits [num_amax] int32."""
  m = x.shape[0]
  return [out_struct((m,), _F32, x)] * 2 + [out_struct((num_amax,), jnp.int32, x)]


def _row_launch(m, n, cfg: Fp8Config):
  """(kernel, grid, statics, amax partials) of the row-block kernels for ``cfg``: a row
  block a program (_norm_kernel; an amax a row) or cfg.num_programs persistent programs
  (_persistent_kernel, or _packed_kernel for cfg.packed; at most one a row block; an
  amax a program)."""
  num_row_blocks = cdiv(m, cfg.block_m)
  statics = dict(tile_params=cfg.tile_params)
  if cfg.column_splits > 1:
    if cfg.block_n < n:
      raise ValueError(f"Fp8Config.column_splits needs whole rows (block_n >= N={n}): "
                       f"{cfg}")
    return (_norm_kernel, num_row_blocks * cfg.column_splits,
            dict(statics, column_splits=cfg.column_splits), m * cfg.column_splits)
  if not cfg.num_programs:
    return _norm_kernel, num_row_blocks, statics, m
  g = min(cfg.num_programs, num_row_blocks)
  return (_packed_kernel if cfg.packed else _persistent_kernel, g,
          dict(statics, hoist_params=cfg.hoist_params, row_amax=cfg.row_amax,
               stream_x=cfg.stream_x, num_programs=g), g)


def _y_outs(x, fp8_dtype, transpose, packed=False):
  m, n = x.shape
  if packed:  # int16 pairs of FP8 values (_packed_kernel; no y_t)
    return [out_struct((m, n // 2), jnp.int16, x)]
  return [out_struct((m, n), fp8_dtype, x)] + (
      [out_struct((n, m), fp8_dtype, x)] if transpose else [])


def _packed_x(x, cfg: Fp8Config, transpose: bool):
  """x as the kernel takes it: for ``cfg.packed``, [M, N / 2] uint32 pairs of bf16 (a
  bitcast, no copy), after checking that the config applies; else x.

  Raises:
    ValueError: cfg.packed with x not bf16, an odd N, rows wider than block_n, y_t, or
      no persistent programs.
  """
  if not cfg.packed:
    return x
  m, n = x.shape
  if (x.dtype != jnp.bfloat16 or n % 2 or n > cfg.block_n or transpose
      or not cfg.num_programs):
    raise ValueError(
        f"Fp8Config.packed takes bfloat16 x of even N up to block_n={cfg.block_n}, "
        f"persistent programs (num_programs > 0) and no y_t; got x {x.dtype} [{m}, {n}], "
        f"num_programs={cfg.num_programs}, transpose={transpose}")
  return lax.bitcast_convert_type(x.reshape(m, n // 2, 2), jnp.uint32)


def _packed_params(scale, bias, cfg: Fp8Config):
  """(scale, bias, statics) as the row-block kernel takes them: for ``cfg.packed`` with
  ``cfg.packed_params``, bf16 ones as [N / 2] uint32 pairs (a bitcast, no copy)."""
  if not (cfg.packed and cfg.packed_params):
    return scale, bias, {}
  pk = lambda p: p is not None and p.dtype == jnp.bfloat16
  f = lambda p: lax.bitcast_convert_type(p.reshape(-1, 2), jnp.uint32) if pk(p) else p
  return f(scale), f(bias), dict(packed_params=(pk(scale), pk(bias)))


def _call(kernel, inputs, outs, grid, cfg: Fp8Config, interpret, name, **statics):
  return pl.pallas_call(
      functools.partial(kernel, block_m=cfg.block_m, block_n=cfg.block_n,
                        hw_sat=HW_SATURATE and not interpret,
                        hw_amax=HW_AMAX and not interpret, **statics),
      out_shape=outs,
      grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=interpret,
      name=name,
  )(*[a for a in inputs if a is not None])


def _param_dtype(scale, bias):
  p = scale if scale is not None else bias
  return None if p is None else p.dtype


def _inv(inv):
  return jnp.asarray(inv, _F32).reshape(1)


def residual_config(cfg: Fp8Config) -> Fp8Config:
  """``cfg`` as the delayed kernel runs it with a residual: one program a row block
  (``_norm_kernel``, whose loads store h: no persistent programs, no packed x) and no
  column splits (each split loads the whole row: h would be stored column_splits
  times)."""
  return dataclasses.replace(cfg, num_programs=0, packed=False, column_splits=1)


def fp8_norm_delayed(x, scale, bias, inv, *, eps: float, scale_offset: float,
                     subtract_mean: bool, fp8_dtype, transpose: bool, interpret: bool,
                     config: Fp8Config | None = None, residual=None, residual_dtype=None,
                     stats: bool = True):
  """Delayed scaling, one pass: the norm of x quantised with ``inv`` = 1 / y_scale.

  Args:
    x: [M, N] float32/bfloat16/float16; scale, bias: [N] float or None.
    inv: () float32, 1 / y_scale.
    eps, scale_offset, subtract_mean: as in ``pallas_norm.layer_norm``.
    fp8_dtype: float8_e4m3fn or float8_e5m2; transpose: also write y_t.
    interpret: Pallas interpret mode. config: Fp8Config (default ``fp8_config``).
    residual: None, or [M, N] float: the fused residual add (vLLM's
      ``fused_add_rms_norm_static_fp8_quant``): the kernel normalises h = x + residual
      (summed in float32), quantises that, and writes h in ``residual_dtype`` (default
      the residual's). The config runs as ``residual_config`` makes it.
    stats: False: y (y_t, h) alone, no mean, rstd or amax written (static scaling's
      y-only kernel, vLLM's ``rms_norm_static_fp8_quant``), on the same config (the
      row-block, persistent or packed kernel without its stores).

  Returns:
    (y [M, N] fp8, y_t [N, M] fp8 or None, mean [M] f32 (zeros for RMSNorm), rstd [M]
    f32, amax bits int32, ``reduce_amax``'s input: [M], the bits of each row's max
    |y_f32| (config.num_programs == 0), or [G], each persistent program's max), and
    h [M, N] last with a residual; without ``stats`` (y, y_t) and h last.

  Raises:
    ValueError: a ``packed`` config that does not apply to x (``_packed_x``).
  """
  m, n = x.shape
  cfg = config or fp8_config(m, n, x.dtype, kernel="delayed", subtract_mean=subtract_mean,
                             transpose=transpose, interpret=interpret,
                             param_dtype=_param_dtype(scale, bias),
                             residual=residual is not None, stats=stats)
  h_outs, extra_statics = [], {}
  if residual is not None:
    cfg = residual_config(cfg)
    h_outs = [out_struct((m, n), jnp.dtype(residual_dtype or residual.dtype), x)]
    extra_statics = dict(has_residual=True)
  if not stats:
    extra_statics["stats"] = False
  kernel, grid, extra, num_amax = _row_launch(m, n, cfg)
  xp = _packed_x(x, cfg, transpose)  # (its checks first)
  scale, bias, pp = _packed_params(scale, bias, cfg)
  extra.update(pp, **extra_statics)
  outs = _call(kernel, [xp, residual, scale, bias, _inv(inv)],
               _y_outs(x, fp8_dtype, transpose, cfg.packed) + h_outs
               + (_row_outs(x, num_amax) if stats else []),
               (grid,), cfg, interpret, "pallas_norm_fp8_delayed", **extra,
               n=n, eps=float(eps), scale_offset=float(scale_offset),
               subtract_mean=subtract_mean, has_scale=scale is not None,
               has_bias=bias is not None, fp8_dtype=jnp.dtype(fp8_dtype).name,
               transpose=transpose)
  outs = list(outs)
  y = outs.pop(0)
  if cfg.packed:  # [M, N / 2] int16 -> [M, N / 2, 2] FP8, the even column first
    y = lax.bitcast_convert_type(y, jnp.dtype(fp8_dtype)).reshape(m, n)
  y_t = outs.pop(0) if transpose else None
  h = outs.pop(0) if residual is not None else None
  # + (mean, rstd, amax bits): _row_outs (none without stats); h last with a residual
  return (y, y_t, *outs) + ((h,) if residual is not None else ())


def fp8_stats(x, scale, bias, *, eps: float, scale_offset: float, subtract_mean: bool,
              interpret: bool, config: Fp8Config | None = None):
  """Current scaling, pass 1: the rows' statistics and the row amax of y_f32.

  Args: as in ``fp8_norm_delayed``.

  Returns:
    (mean [M] f32 (zeros for RMSNorm), rstd [M] f32, amax bits [M] or [G] int32 (as in
    ``fp8_norm_delayed``)).

  Raises:
    ValueError: a ``packed`` config that does not apply to x (``_packed_x``).
  """
  m, n = x.shape
  cfg = config or fp8_config(m, n, x.dtype, kernel="stats", subtract_mean=subtract_mean,
                             interpret=interpret, param_dtype=_param_dtype(scale, bias))
  kernel, grid, extra, num_amax = _row_launch(m, n, cfg)
  xp = _packed_x(x, cfg, False)  # (its checks first)
  scale, bias, pp = _packed_params(scale, bias, cfg)
  extra.update(pp)
  outs = _call(kernel, [xp, scale, bias],
               _row_outs(x, num_amax), (grid,),
               cfg, interpret, "pallas_norm_fp8_stats", **extra, n=n, eps=float(eps),
               scale_offset=float(scale_offset), subtract_mean=subtract_mean,
               has_scale=scale is not None, has_bias=bias is not None, fp8_dtype=None,
               transpose=False)
  return tuple(outs)  # (mean, rstd, amax bits): _row_outs


def _quantise_call(x, scale, bias, mean, rstd, inv, *, scale_offset, subtract_mean,
                   fp8_dtype, transpose, with_amax, interpret, config, name):
  m, n = x.shape
  cfg = config or fp8_config(m, n, x.dtype, kernel="quantise", transpose=transpose,
                             interpret=interpret, subtract_mean=subtract_mean,
                             param_dtype=_param_dtype(scale, bias))
  grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n))
  outs = [] if fp8_dtype is None else _y_outs(x, fp8_dtype, transpose)
  if with_amax:
    outs.append(out_struct((grid[0] * grid[1],), jnp.int32, x))
  bottom_up = quantise_bottom_up(interpret, (m, n), x.dtype, subtract_mean, transpose,
                                 _param_dtype(scale, bias))
  # bottom_up: one grid axis (axis 1 of a CUDA grid stops at 65535 row blocks)
  launch = (grid[0] * grid[1],) if bottom_up else grid
  outs = _call(_quantise_kernel,
               [x, scale, bias, mean if subtract_mean else None, rstd,
                None if fp8_dtype is None else _inv(inv)],
               outs, launch, cfg, interpret, name, n=n, scale_offset=float(scale_offset),
               subtract_mean=subtract_mean, has_scale=scale is not None,
               has_bias=bias is not None,
               fp8_dtype=None if fp8_dtype is None else jnp.dtype(fp8_dtype).name,
               transpose=transpose, with_amax=with_amax, bottom_up=bottom_up,
               grid_m=grid[0])
  return list(outs)


def fp8_quantise(x, scale, bias, mean, rstd, inv, *, scale_offset: float,
                 subtract_mean: bool, fp8_dtype, transpose: bool, interpret: bool,
                 config: Fp8Config | None = None, return_amax: bool = False):
  """Current scaling, pass 2: y (and y_t) from x and the saved statistics; also the
  tensor-parallel apply pass (statistics of whole rows from an all-reduce).

  Args:
    x, scale, bias, scale_offset, subtract_mean, fp8_dtype, transpose, interpret,
      config: as in ``fp8_norm_delayed``.
    mean: [M] f32 (read for LayerNorm only); rstd: [M] f32 (``fp8_stats``'s).
    inv: () float32, 1 / y_scale.
    return_amax: also return the tiles' max |y_f32| bits (delayed scaling's amax).

  Returns:
    (y [M, N] fp8, y_t [N, M] fp8 or None), and with ``return_amax`` the amax bits
    [tiles] int32 (``reduce_amax``'s input).
  """
  outs = _quantise_call(x, scale, bias, mean, rstd, inv, scale_offset=scale_offset,
                        subtract_mean=subtract_mean, fp8_dtype=fp8_dtype,
                        transpose=transpose, with_amax=return_amax, interpret=interpret,
                        config=config, name="pallas_norm_fp8_quantise")
  y, y_t = outs[0], (outs[1] if transpose else None)
  return (y, y_t, outs[-1]) if return_amax else (y, y_t)


def fp8_tile_amax(x, scale, bias, mean, rstd, *, scale_offset: float, subtract_mean: bool,
                  interpret: bool, config: Fp8Config | None = None):
  """The amax bits of y_f32 from x and given statistics, nothing stored but them: the
  tensor-parallel current scaling's pass between the statistics all-reduce and the
  quantise pass (a shard's rows cannot give their amax before the whole rows' rstd is
  known).

  Args: as in ``fp8_quantise``.

  Returns:
    amax bits [tiles] int32 (``reduce_amax``'s input).
  """
  return _quantise_call(x, scale, bias, mean, rstd, None, scale_offset=scale_offset,
                        subtract_mean=subtract_mean, fp8_dtype=None, transpose=False,
                        with_amax=True, interpret=interpret, config=config,
                        name="pallas_norm_fp8_amax")[0]


def reduce_amax(amax_bits):
  """() float32 tensor amax from the kernels' int32 amax bits ([M] a row, or [G] a
  persistent program; NaN if any has one)."""
  return lax.bitcast_convert_type(jnp.max(amax_bits), _F32)
