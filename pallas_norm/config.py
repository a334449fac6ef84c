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
  """

  mode: str
  block_m: int
  block_n: int
  num_warps: int
  num_programs: int = 0
  num_stages: int = 1

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"{self.mode=} must be one of {MODES}")
    for f in ("block_m", "block_n"):
      v = getattr(self, f)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{f}={v} must be a positive power of 2")
    if self.num_warps not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"{self.num_warps=} must be a power of 2 in [1, 32]")


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
    num_stages: software-pipelining depth of the stage-1 loops.
  """

  block_m: int
  block_n: int
  num_warps: int
  num_programs: int
  reduce_block_n: int = 128
  reduce_block_g: int = 32
  reduce_num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for f in ("block_m", "block_n", "reduce_block_n", "reduce_block_g"):
      v = getattr(self, f)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{f}={v} must be a positive power of 2")
    if self.num_programs < 1:
      raise ValueError(f"{self.num_programs=} must be >= 1")


# ---------------------------------------------------------------------------
# Thresholds. Each names the measurement or the constraint behind it.
# ---------------------------------------------------------------------------

# Largest row (in elements, padded to a power of 2) that multi_wave_cached keeps in
# registers: 32768 f32 values over 16 warps is 64 registers a thread for x alone.
_CACHED_MAX_BLOCK_N = 32768
# Target elements per tile: enough loads in flight per SM to cover HBM latency
# without spilling.
_TILE_ELEMS = 8192
# Chunk width for chunked (row does not fit) paths.
_CHUNK_N = 4096
# Rows below which multi_wave launches leave SMs idle and the persistent grid wins.
_NARROW_N = 512
# Backward: rows up to this (padded) length are one register tile.
_BWD_SINGLE_TILE_MAX = 8192
_BWD_TILE_ELEMS = 4096
_BWD_CHUNK_N = 4096
# Persistent grid = SMs x this (two programs per SM hide each other's reductions).
_PERSISTENT_OCCUPANCY = 2


def cached_max_block_n(dtype) -> int:
  """Largest padded row length multi_wave_cached accepts for ``dtype``."""
  del dtype
  return _CACHED_MAX_BLOCK_N


def _num_warps_for(tile_elems: int) -> int:
  # One 16-byte vector (8 bf16) per thread per row is the sweet spot; cap at 16 warps.
  return int(min(16, max(1, tile_elems // 256)))


def choose_mode(m: int, n: int, dtype, device: DeviceInfo) -> str:
  """The mode the heuristic picks for an [m, n] input."""
  bn = next_power_of_2(n)
  if bn > cached_max_block_n(dtype):
    return "multi_wave_reload"
  if n <= _NARROW_N:
    return "static_persistent"
  return "multi_wave_cached"


def forward_config(m: int, n: int, dtype, mode: str | None = None,
                   device: DeviceInfo | None = None) -> ForwardConfig:
  """Default forward launch config for an [m, n] input of ``dtype``."""
  device = device or device_info()
  mode = mode or choose_mode(m, n, dtype, device)
  if mode not in MODES:
    raise ValueError(f"{mode=} must be one of {MODES}")
  bn_full = next_power_of_2(n)
  if mode == "multi_wave_reload":
    block_n = min(bn_full, _CHUNK_N)
  elif mode == "multi_wave_cached":
    if bn_full > cached_max_block_n(dtype):
      raise NotImplementedError(
          f"multi_wave_cached holds the whole row in registers and supports N up to "
          f"{cached_max_block_n(dtype)} (N={n} pads to {bn_full}); use "
          f"mode='multi_wave_reload' (or 'static_persistent') for longer rows")
    block_n = bn_full
  else:  # static_persistent: single tile while it fits, else chunked
    block_n = bn_full if bn_full <= _CHUNK_N else _CHUNK_N
  block_m = max(1, min(_TILE_ELEMS // block_n, next_power_of_2(m)))
  if device.platform == "cpu":
    # Interpret mode: fewer, fatter programs run faster on CPU.
    block_m = max(block_m, min(64, next_power_of_2(m)))
  num_warps = _num_warps_for(block_m * block_n)
  num_programs = 0
  if mode == "static_persistent":
    num_programs = max(1, min(device.num_sms * _PERSISTENT_OCCUPANCY, cdiv(m, block_m)))
  return ForwardConfig(mode, block_m, block_n, num_warps, num_programs)


def backward_config(m: int, n: int, dtype, device: DeviceInfo | None = None) -> BackwardConfig:
  """Default backward launch config for an [m, n] input of ``dtype``."""
  device = device or device_info()
  bn_full = next_power_of_2(n)
  if bn_full <= _BWD_SINGLE_TILE_MAX:
    block_n = bn_full
    block_m = max(1, min(_BWD_TILE_ELEMS // block_n, next_power_of_2(m)))
    num_programs = device.num_sms * _PERSISTENT_OCCUPANCY
  else:  # row statistics kernel + column-tiled persistent kernel
    block_n, block_m = _BWD_CHUNK_N, 1
    num_programs = max(1, device.num_sms * _PERSISTENT_OCCUPANCY // cdiv(n, block_n))
  if device.platform == "cpu":
    block_m = max(block_m, min(64, next_power_of_2(m)))
  num_programs = max(1, min(num_programs, cdiv(m, block_m)))
  return BackwardConfig(block_m=block_m, block_n=block_n,
                        num_warps=_num_warps_for(block_m * block_n),
                        num_programs=num_programs, **reduce_config(n, num_programs))


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
