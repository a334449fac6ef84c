"""Plain Triton kernels for ``backend="triton"`` (called through jax-triton).

The same algorithms as the Pallas kernels (``forward.py``, ``backward.py``), written as
``@triton.jit`` kernels. RMSNorm and LayerNorm share every kernel through the
``SUBTRACT_MEAN`` constexpr. Statistics are float32.

Forward, per row (N = row length, eps added before the square root):

    LayerNorm: mean = sum(x) / N;  var = sum((x - mean)**2) / N   (two-pass, or a chunked
               Welford/Chan combine of exact per-chunk mean and M2; never E[x^2] - E[x]^2)
    RMSNorm:   mean = 0;           var = sum(x**2) / N
    rstd = rsqrt(var + eps);  y = (x - mean) * rstd * (scale_offset + scale) + bias

``STATS`` (``return_residuals``) writes mean / rstd for the backward; a plain forward
(outside ``jax.vjp``) skips them.

Fused residual add (``HAS_RESIDUAL``, flash-attention's ``residual=``): the kernels read
x and the residual r, normalise h = x + r summed in float32, and store h (in h's dtype)
at its first load; passes that reload x reload both and add again, so y comes from the
float32 sum. The backward reads the saved h as its x, adds h's cotangent dh to dx in
float32 (``HAS_DH``) and writes the sum in x's dtype, and once more in the residual's
(``HAS_DRES``) when they differ.

FP8 x (``XGROUP`` > 0, issue #27's group-scaled input): x is float8_e4m3fn / e5m2 and
its float32 scales [..., N // XGROUP] come in the residual's pointer (the forward
kernels; FP8 x takes no residual) or ``xs_ptr`` (the backward's); every load of x is
dequantised in registers (``_dequantise``: x * the scale of its group), so the kernels
see float32 x, and y / dx are stored in their outputs' dtypes.

``cast="llama"`` (HF LlamaRMSNorm; ``LLAMA_X`` / ``LLAMA_Y``: ``DTYPE_CODES`` of x's and
y's dtypes, 0 for "torch"): y = round_y(round_x(x_hat) * w) + bias; the backward takes g
through the roundings' transposes and sums dscale against the rounded x_hat (as the
Pallas kernels' ``_LlamaY`` / ``_x_hat_g``).

Backward, per row (x_hat = (x - mean) * rstd, w = scale_offset + scale, g = dy * w, or
g = dy without a scale):

    c1 = sum(x_hat * g) / N
    c2 = sum(g) / N                      (LayerNorm; 0 for RMSNorm)
    dx = (g - (x_hat * c1 + c2)) * rstd
    dscale = sum_rows(dy * x_hat)        dbias = sum_rows(dy)

Stage 1 (``norm_bwd_kernel``) runs on a persistent grid (G, chunks, batch): program
(r, k) owns column chunk k for row blocks r, r + G, ..., keeps its dscale / dbias
partials in registers and writes partial row r of chunk k to a ``[G, N]`` buffer.
  - single tile (``block_n >= N``, one chunk): c1 and c2 are reduced in the tile;
  - chunked (``CHUNKED``, long rows): ``bwd_row_stats_kernel`` first writes c1 and c2
    per row ([M] f32 each), so no partial row is ever read back.
Stage 2 (``partial_reduce_kernel``) sums ``[G, N] -> [N]`` in a fixed order and casts to
the parameter dtype: no atomics, bitwise deterministic.

Modes, as launch plans of the two forward code paths (``CHUNKED`` and ``PERSISTENT``):

    multi_wave_cached   grid cdiv(M, block_m); one [block_m, block_n >= N] tile per program.
    multi_wave_reload   grid cdiv(M, block_m); pass 1 over block_n chunks for the stats,
                        pass 2 reloads x (last chunk first, the likeliest still in L2)
                        to normalise. Serves any N.
    static_persistent   grid G = config.num_programs; grid-stride loop over row blocks.
                        Single tile (scale/bias loaded once, before the loop) when
                        block_n >= N, else the reload passes per row block.

Tensor parallel (the hidden dim sharded: each device holds N' = N / shards columns of
every row), as the Pallas ``norm_forward_stats`` / ``norm_forward_apply`` do it:

    fwd_shard_stats_kernel   per row, over the shard's columns: RMSNorm s1 = sum(x**2);
                             LayerNorm s1 = mean, s2 = M2 (the chunked Chan combine above).
    (the caller combines them across the shards into the whole rows' mean and rstd)
    fwd_shard_apply_kernel   y of the shard's columns from the whole rows' mean / rstd.

Both walk the row in block_n chunks (one when it fits) and take the mode's grid: one row
block a program, or static_persistent's grid-stride loop. The backward computes c1 / c2
over the shard's columns with ``bwd_row_stats_kernel`` (divided by N'), the caller
averages them across the shards, and ``norm_bwd_kernel`` (``CHUNKED``) reads them:
``combine_row_sums`` in the plans.

The persistent loops (single-tile forward, backward stage 1) load the next row block's
x (and dy) before the current block's math; past the last block those loads are fully
masked and touch no memory.

Batch axis: every kernel has a last grid axis of size ``batch`` (1 outside ``vmap``):
the input is ``[batch, M, N]`` and scale/bias are ``[batch, N]`` rows at
``PARAM_STRIDE`` (0 when shared). ``jax_triton.py`` uses it for ``vmap`` with a batched
scale and for per-example dscale / dbias.

Shapes are ``tl.constexpr`` (``M``, ``N``, ``PARAM_STRIDE``, ``G``), as in the Pallas
lowering, where they are static. jax-triton passes integer arguments with no
divisibility hint, so a runtime N hides that ``row * N`` is a multiple of 16 bytes and
Triton falls back to narrow loads and stores; jax.jit recompiles per shape anyway. With a batch, the G persistent programs are
split over it (``cdiv(G, batch)`` per entry), so the partials stay about ``[G, N]``.

Every launch parameter comes from ``forward_plan`` / ``shard_stats_plan`` /
``shard_apply_plan`` / ``row_stats_plan`` / ``backward_plan`` / ``reduce_plan``: the
jax-triton glue and the torch test launcher both use them. Switches that only plain
Triton has (no Pallas equivalent) are in ``TritonKnobs`` (``KNOBS``), off by default, for
A/B runs on the GPU.

Triton notes: pass 1 of the reload path loads x with ``evict_last`` (keep it in L2 for
pass 2; the tensor-parallel statistics kernel too, for the apply kernel), pass 2 with
``evict_first``. Row offsets are int64 only when the plan sees a
flat offset that could pass 2**31 - 1 (``USE_INT64``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import triton
import triton.language as tl

from pallas_norm import config as _config

__all__ = [
    "KNOBS",
    "DTYPE_CODES",
    "LaunchPlan",
    "TritonKnobs",
    "forward_plan",
    "shard_stats_plan",
    "shard_apply_plan",
    "row_stats_plan",
    "backward_plan",
    "reduce_plan",
    "norm_fwd_kernel",
    "fwd_shard_stats_kernel",
    "fwd_shard_apply_kernel",
    "bwd_row_stats_kernel",
    "norm_bwd_kernel",
    "partial_reduce_kernel",
]

_INT32_MAX = 2**31 - 1
# The Pallas backward's rule (backward.PREFETCH_DH_MAX_BLOCK_N, same value: the backends
# run the same schedule): LayerNorm prefetches dh with x and dy for tiles this wide or
# less.
_PREFETCH_DH_MAX_BLOCK_N = 4096


@dataclasses.dataclass(frozen=True)
class TritonKnobs:
  """Plain-Triton switches with no Pallas counterpart (compile-time constants).

  Off by default: the defaults run what the Pallas kernels run. Not measured yet; set
  ``triton_kernels.KNOBS = TritonKnobs(...)`` in a fresh process to A/B them.

  Attributes:
    evict_first: ``eviction_policy="evict_first"`` on the last (only) read of x / dy
      in the single-tile forward and in backward stage 1 (``EVICT_FIRST``).
    stream_cg: ``cache_modifier=".cg"`` (L2 only, skip L1) on those same loads
      (``STREAM_CG``). ptxas refuses ``.cg`` together with ``.evict_first``.
    loop_stages: ``tl.range(..., num_stages=loop_stages)`` on the chunk loops (reload
      passes, backward row statistics); 0 leaves them to the launch's num_stages
      (``LOOP_STAGES``).
  """

  evict_first: bool = False
  stream_cg: bool = False
  loop_stages: int = 0

  def __post_init__(self):
    if self.evict_first and self.stream_cg:
      raise ValueError(f"{self.evict_first=} and {self.stream_cg=}: ptxas cannot combine "
                       f"ld.global.cg with .evict_first; pick one")
    if self.loop_stages < 0:
      raise ValueError(f"{self.loop_stages=} must be >= 0")

  def constexprs(self) -> tuple[tuple[str, Any], ...]:
    return (("EVICT_FIRST", bool(self.evict_first)), ("STREAM_CG", bool(self.stream_cg)),
            ("LOOP_STAGES", int(self.loop_stages)))


KNOBS = TritonKnobs()


# --------------------------------------------------------------------------- helpers


@triton.jit
def _row_ids(b, rb, M, BLOCK_M: tl.constexpr, USE_INT64: tl.constexpr):
  """Rows of row block ``rb`` of batch entry ``b``.

  Returns (rows [BLOCK_M] flat row ids, i64 when USE_INT64, row_mask [BLOCK_M]).
  """
  r = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] i32, row within the batch entry
  rows = b * M + r
  if USE_INT64:
    rows = rows.to(tl.int64)
  return rows, r < M


@triton.jit
def _tile_at(b, rb, cols, col_mask, M, N, BLOCK_M: tl.constexpr, USE_INT64: tl.constexpr):
  """(rows [BLOCK_M], row_mask, offs [BLOCK_M, BLOCK_N], mask) of row block ``rb``."""
  rows, row_mask = _row_ids(b, rb, M, BLOCK_M, USE_INT64)
  offs = rows[:, None] * N + cols[None, :]
  return rows, row_mask, offs, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _stream_load(ptr, offs, mask, EVICT_FIRST: tl.constexpr, STREAM_CG: tl.constexpr):
  """Masked load (0 outside, in the pointer's dtype) of a last read, with the knobs."""
  return tl.load(ptr + offs, mask=mask, other=0.0,
                 eviction_policy="evict_first" if EVICT_FIRST else "",
                 cache_modifier=".cg" if STREAM_CG else "")


@triton.jit
def _load_param(ptr, offs, mask, OFFSET: tl.constexpr, HAS: tl.constexpr):
  """OFFSET + p[offs] as f32 ([BLOCK_N]), or 0.0 (unused) when the param is absent."""
  if HAS:
    p = OFFSET + tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
  else:
    p = 0.0
  return p


@triton.jit
def _round(v, CODE: tl.constexpr):
  """float32 ``v`` rounded to the dtype of ``CODE`` (``DTYPE_CODES``) and back; 0 and
  float32 leave it as it is."""
  if CODE == 2:
    v = v.to(tl.bfloat16).to(tl.float32)
  elif CODE == 3:
    v = v.to(tl.float16).to(tl.float32)
  return v


@triton.jit
def _affine(x_hat, w, bias, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
            LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr):
  """x_hat [BLOCK_M, BLOCK_N] f32 * w[None] + bias[None], rounded once at the store
  (``cast="torch"``). With ``LLAMA_X`` (``cast="llama"``, HF LlamaRMSNorm): x_hat is
  rounded to x's dtype before the weight multiplies it, and the product to y's dtype
  (``LLAMA_Y``) before the bias is added."""
  y = x_hat
  if LLAMA_X != 0:
    y = _round(y, LLAMA_X)
  if HAS_SCALE:
    y = y * w[None, :]
    if LLAMA_X != 0:
      y = _round(y, LLAMA_Y)
  if HAS_BIAS:
    y = y + bias[None, :]
  return y


@triton.jit
def _dequantise(x, s_ptr, offs, mask, XGROUP: tl.constexpr, GROUPED: tl.constexpr):
  """FP8 tile ``x`` [BLOCK_M, BLOCK_N] at flat offsets ``offs`` (row * N + col, N a
  multiple of XGROUP) as float32 x * s, s [..., N // XGROUP] the dequantisation scales
  of its groups: element (row, col) takes scale offs // XGROUP = row * (N // XGROUP) +
  col // XGROUP (the Pallas kernels' ``_dequantise``: the same float32 product)."""
  return _apply_scales(x, _group_scales(s_ptr, offs, mask, XGROUP, GROUPED), XGROUP, GROUPED)


@triton.jit
def _group_scales(s_ptr, offs, mask, XGROUP: tl.constexpr, GROUPED: tl.constexpr):
  """The scales of the groups of a [BLOCK_M, BLOCK_N] tile: [BLOCK_M, BLOCK_N // XGROUP]
  f32, one load a group, when ``GROUPED`` and XGROUP divides BLOCK_N (the tile, viewed
  as [BLOCK_M, BLOCK_N // XGROUP, XGROUP], starts at a multiple of XGROUP: its columns
  are k * BLOCK_N + j); else each element's scale, [BLOCK_M, BLOCK_N] (a gather: one
  4-byte load an element). H200, 2026-11-23 (``--ops fp8in``, 8192x4096 e4m3 x, G 16;
  grouped against gathered): the backward's stage 1 RMSNorm 70.8 against 102.0 us,
  LayerNorm 78.0 against 114.0; the forward RMSNorm 47.4 against 35.1 (so it gathers),
  LayerNorm 52.9 against 53.0 (it groups: ``GROUP_SCALES`` = SUBTRACT_MEAN there).
  docs/fp8_tuning.md#fp8-input-gpu. Loaded next to a prefetched FP8 tile,
  multiplied in by ``_apply_scales`` when the tile is used."""
  BM: tl.constexpr = offs.shape[0]
  BN: tl.constexpr = offs.shape[1]
  if GROUPED and BN % XGROUP == 0:
    go = tl.min(tl.reshape(offs, (BM, BN // XGROUP, XGROUP)), axis=2) // XGROUP
    gm = tl.max(tl.reshape(mask.to(tl.int32), (BM, BN // XGROUP, XGROUP)), axis=2) > 0
    return tl.load(s_ptr + go, mask=gm, other=0.0)
  else:
    return tl.load(s_ptr + offs // XGROUP, mask=mask, other=0.0)


@triton.jit
def _apply_scales(x, s, XGROUP: tl.constexpr, GROUPED: tl.constexpr):
  """float32 x * s for ``_group_scales``' s: broadcast over each group (x viewed as
  [BLOCK_M, BLOCK_N // XGROUP, XGROUP]), or elementwise."""
  BM: tl.constexpr = x.shape[0]
  BN: tl.constexpr = x.shape[1]
  if GROUPED and BN % XGROUP == 0:
    xg = tl.reshape(x.to(tl.float32), (BM, BN // XGROUP, XGROUP)) * s[:, :, None]
    return tl.reshape(xg, (BM, BN))
  else:
    return x.to(tl.float32) * s


@triton.jit
def _load_sum(x_ptr, r_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr,
              EVICT_FIRST: tl.constexpr, STREAM_CG: tl.constexpr, EVICT_LAST: tl.constexpr,
              GROUP_SCALES: tl.constexpr):
  """The tile of x (x's dtype), or of h = x + residual (``HAS_RESIDUAL``: float32, the
  sum of the two tiles converted to float32), or of FP8 x dequantised (``XGROUP`` > 0:
  float32 x * its group's scale, the scales at ``r_ptr``, one load a group with
  ``GROUP_SCALES``: _group_scales); masked lanes read 0."""
  if EVICT_LAST:
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
  else:
    x = _stream_load(x_ptr, offs, mask, EVICT_FIRST, STREAM_CG)
  if XGROUP > 0:
    x = _dequantise(x, r_ptr, offs, mask, XGROUP, GROUP_SCALES)
  if HAS_RESIDUAL:
    if EVICT_LAST:
      r = tl.load(r_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    else:
      r = _stream_load(r_ptr, offs, mask, EVICT_FIRST, STREAM_CG)
    x = x.to(tl.float32) + r.to(tl.float32)
  return x


@triton.jit
def _load_row_stats(mean_ptr, rstd_ptr, rows, row_mask, SUBTRACT_MEAN: tl.constexpr):
  """-> (mean, rstd) [BLOCK_M] f32 of ``rows`` (mean = 0.0 for RMSNorm)."""
  rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
  if SUBTRACT_MEAN:
    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
  else:
    mean = 0.0
  return mean, rstd


# --------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tile(x, y_ptr, h_ptr, mean_ptr, rstd_ptr, w, bias, scale_ptr, bias_ptr, param_off,
              b, rb, M, N, EPS: tl.constexpr, SCALE_OFFSET: tl.constexpr,
              SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
              HAS_BIAS: tl.constexpr, STATS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              XGROUP: tl.constexpr,
              LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, USE_INT64: tl.constexpr, LATE_PARAMS: tl.constexpr):
  """Normalise row block ``rb``, already loaded as one [BLOCK_M, BLOCK_N >= N] tile ``x``
  (x's dtype, or the float32 h = x + residual with ``HAS_RESIDUAL``, which is stored
  here in h's dtype; 0 outside).

  With LATE_PARAMS, scale/bias are loaded here once the statistics are done (``w`` and
  ``bias`` are unused), so that they are not live across the reductions (the multi-wave
  path; see forward.py's ``_single_tile``); else ``w``/``bias`` are the hoisted values.
  """
  cols = tl.arange(0, BLOCK_N)
  rows, row_mask, offs, mask = _tile_at(b, rb, cols, cols < N, M, N, BLOCK_M, USE_INT64)
  if HAS_RESIDUAL:
    tl.store(h_ptr + offs, x.to(h_ptr.dtype.element_ty), mask=mask)
  x = x.to(tl.float32)  # [BLOCK_M, BLOCK_N] f32
  if SUBTRACT_MEAN:
    mean = tl.sum(x, axis=1) / N  # [BLOCK_M] f32
    xc = tl.where(mask, x - mean[:, None], 0.0)  # two-pass variance, in registers
    if STATS:
      tl.store(mean_ptr + rows, mean, mask=row_mask)
  else:
    xc = x
  rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + EPS)  # [BLOCK_M] f32
  if STATS:
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
  if LATE_PARAMS:
    col_mask = cols < N
    w = _load_param(scale_ptr, param_off + cols, col_mask, SCALE_OFFSET, HAS_SCALE)
    bias = _load_param(bias_ptr, param_off + cols, col_mask, 0.0, HAS_BIAS)
  y = _affine(xc * rstd[:, None], w, bias, HAS_SCALE, HAS_BIAS, LLAMA_X, LLAMA_Y)
  tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_stats(x_ptr, r_ptr, h_ptr, row_offs, row_mask, N, SUBTRACT_MEAN: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr,
                 LOOP_STAGES: tl.constexpr):
  """Statistics pass over one row block in BLOCK_N chunks.

  x (and the residual) are loaded with evict_last: they are read again (the reload
  pass, or the apply kernel). With ``HAS_RESIDUAL`` the statistics are those of the
  float32 h = x + residual, and h is stored here (its one store), in h's dtype.

  Args:
    row_offs: [BLOCK_M, 1] flat offsets of the rows' first elements.
    row_mask: [BLOCK_M] rows inside the array.

  Returns:
    (mean [BLOCK_M] f32, 0 for RMSNorm; acc [BLOCK_M] f32): acc is M2 = sum((x - mean)**2)
    for LayerNorm (Chan et al.'s combine of each chunk's exact two-pass (mean, M2)), the
    sum of squares for RMSNorm, over the N columns.
  """
  cols0 = tl.arange(0, BLOCK_N)
  mean = tl.zeros([BLOCK_M], tl.float32)
  acc = tl.zeros([BLOCK_M], tl.float32)
  for off in tl.range(0, N, BLOCK_N,
                      num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
    cols = off + cols0
    mask = row_mask[:, None] & (cols < N)[None, :]  # [BLOCK_M, BLOCK_N]
    offs = row_offs + cols[None, :]
    x = _load_sum(x_ptr, r_ptr, offs, mask, HAS_RESIDUAL, XGROUP, False, False, True,
                  SUBTRACT_MEAN)
    if HAS_RESIDUAL:
      tl.store(h_ptr + offs, x.to(h_ptr.dtype.element_ty), mask=mask)
    x = x.to(tl.float32)  # [BLOCK_M, BLOCK_N] f32
    if SUBTRACT_MEAN:
      # Chan et al. combine of (count, mean, M2) with this chunk's exact two-pass stats.
      cnt = tl.minimum(N - off, BLOCK_N)
      n_b = cnt.to(tl.float32)
      n_ab = (off + cnt).to(tl.float32)
      n_a = n_ab - n_b
      mean_b = tl.sum(x, axis=1) / n_b  # [BLOCK_M] f32
      d = tl.where(mask, x - mean_b[:, None], 0.0)
      delta = mean_b - mean
      mean = mean + delta * (n_b / n_ab)
      acc = acc + tl.sum(d * d, axis=1) + delta * delta * (n_a * n_b / n_ab)
    else:
      acc += tl.sum(x * x, axis=1)
  return mean, acc


@triton.jit
def _chunk_normalise(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, row_offs, row_mask, mean,
                     rstd, param_off, N, SCALE_OFFSET: tl.constexpr,
                     SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr,
                     LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr, BLOCK_N: tl.constexpr,
                     LOOP_STAGES: tl.constexpr):
  """Normalising pass over one row block: reload x chunk by chunk (evict_first: last
  use), last chunk first (the last chunks read by the statistics pass are the likeliest
  to still be in L2), and store y = (x - mean) * rstd * w + bias. With ``HAS_RESIDUAL``
  x and the residual are both reloaded and added again in float32 (y is computed from
  the float32 sum, whatever h's dtype).

  Args:
    row_offs: [BLOCK_M, 1] flat offsets of the rows' first elements.
    row_mask: [BLOCK_M] rows inside the array.
    mean: [BLOCK_M] f32 (LayerNorm only, else unused); rstd: [BLOCK_M] f32.
    param_off: offset of this batch entry's scale / bias row.
  """
  cols0 = tl.arange(0, BLOCK_N)
  n_chunks = tl.cdiv(N, BLOCK_N)
  for j in tl.range(0, n_chunks, num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
    cols = (n_chunks - 1 - j) * BLOCK_N + cols0
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_N]
    offs = row_offs + cols[None, :]
    x = _load_sum(x_ptr, r_ptr, offs, mask, HAS_RESIDUAL, XGROUP, True, False,
                  False, SUBTRACT_MEAN).to(tl.float32)  # [BLOCK_M, BLOCK_N] f32
    if SUBTRACT_MEAN:
      x = x - mean[:, None]
    w = _load_param(scale_ptr, param_off + cols, col_mask, SCALE_OFFSET, HAS_SCALE)
    bias = _load_param(bias_ptr, param_off + cols, col_mask, 0.0, HAS_BIAS)
    y = _affine(x * rstd[:, None], w, bias, HAS_SCALE, HAS_BIAS, LLAMA_X, LLAMA_Y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_chunked(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, b, rb,
                 M, N, param_stride, EPS: tl.constexpr, SCALE_OFFSET: tl.constexpr,
                 SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, STATS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 XGROUP: tl.constexpr,
                 LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, USE_INT64: tl.constexpr,
                 LOOP_STAGES: tl.constexpr):
  """One row block walked in BLOCK_N chunks: stats pass, then a normalising reload."""
  rows, row_mask = _row_ids(b, rb, M, BLOCK_M, USE_INT64)
  row_offs = rows[:, None] * N  # [BLOCK_M, 1]
  mean, acc = _chunk_stats(x_ptr, r_ptr, h_ptr, row_offs, row_mask, N, SUBTRACT_MEAN,
                           HAS_RESIDUAL, XGROUP, BLOCK_M, BLOCK_N, LOOP_STAGES)
  rstd = tl.rsqrt(acc / N + EPS)  # [BLOCK_M] f32
  if STATS:
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    if SUBTRACT_MEAN:
      tl.store(mean_ptr + rows, mean, mask=row_mask)
  _chunk_normalise(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, row_offs, row_mask, mean, rstd,
                   b * param_stride, N, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE, HAS_BIAS,
                   HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_N, LOOP_STAGES)


@triton.jit
def norm_fwd_kernel(
    # inputs
    x_ptr, r_ptr, scale_ptr, bias_ptr,
    # outputs
    y_ptr, h_ptr, mean_ptr, rstd_ptr,
    # statics
    M: tl.constexpr, N: tl.constexpr, PARAM_STRIDE: tl.constexpr, EPS: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr, LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr,
    PERSISTENT: tl.constexpr, USE_INT64: tl.constexpr, EVICT_FIRST: tl.constexpr,
    STREAM_CG: tl.constexpr, LOOP_STAGES: tl.constexpr):
  """Forward of every mode. Grid (programs, batch).

  x: [batch, M, N]; r (the residual, ``HAS_RESIDUAL`` only, else unused: any pointer):
  [batch, M, N]; scale, bias: [batch, N] rows at ``PARAM_STRIDE`` (unused when absent:
  any pointer); y: [batch, M, N] in x's dtype, or y's under ``cast="llama"``
  (``LLAMA_X`` / ``LLAMA_Y``: x's and y's ``DTYPE_CODES``, 0 for ``cast="torch"``);
  h = x + r: [batch, M, N] in h's dtype (``HAS_RESIDUAL`` only); mean (LayerNorm
  only), rstd: [batch, M] f32, written only with STATS (else unused: any pointer).
  """
  pid = tl.program_id(0)
  b = tl.program_id(1)
  n_rb = tl.cdiv(M, BLOCK_M)
  if CHUNKED:
    if PERSISTENT:
      for rb in tl.range(pid, n_rb, tl.num_programs(0)):
        _fwd_chunked(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, b,
                     rb, M, N, PARAM_STRIDE, EPS, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE,
                     HAS_BIAS, STATS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M, BLOCK_N,
                     USE_INT64, LOOP_STAGES)
    else:
      _fwd_chunked(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, b,
                   pid, M, N, PARAM_STRIDE, EPS, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE,
                   HAS_BIAS, STATS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M, BLOCK_N,
                   USE_INT64, LOOP_STAGES)
  else:
    # Single tile. Persistent: scale/bias are loaded once per program, before the
    # row-block loop. Multi-wave: after the statistics (LATE_PARAMS in _fwd_tile).
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    _, _, offs0, mask0 = _tile_at(b, pid, cols, col_mask, M, N, BLOCK_M, USE_INT64)
    if PERSISTENT:
      w = _load_param(scale_ptr, b * PARAM_STRIDE + cols, col_mask, SCALE_OFFSET, HAS_SCALE)
      bias = _load_param(bias_ptr, b * PARAM_STRIDE + cols, col_mask, 0.0, HAS_BIAS)
      step = tl.num_programs(0)
      # FP8 x: the prefetched tile stays FP8 with its scales beside it, dequantised when
      # used (_group_scales)
      if XGROUP > 0:
        x_raw = _stream_load(x_ptr, offs0, mask0, EVICT_FIRST, STREAM_CG)
        xs = _group_scales(r_ptr, offs0, mask0, XGROUP, SUBTRACT_MEAN)
      else:
        x_raw = _load_sum(x_ptr, r_ptr, offs0, mask0, HAS_RESIDUAL, XGROUP, EVICT_FIRST,
                          STREAM_CG, False, False)  # [BLOCK_M, BLOCK_N]
        xs = 0.0
      for rb in tl.range(pid, n_rb, step):
        # Prefetch the next row block before this one's math; past the last block the
        # rows are all masked.
        _, _, offs_next, mask_next = _tile_at(b, rb + step, cols, col_mask, M, N, BLOCK_M,
                                              USE_INT64)
        if XGROUP > 0:
          x_next = _stream_load(x_ptr, offs_next, mask_next, EVICT_FIRST, STREAM_CG)
          xs_next = _group_scales(r_ptr, offs_next, mask_next, XGROUP, SUBTRACT_MEAN)
          x = _apply_scales(x_raw, xs, XGROUP, SUBTRACT_MEAN)
        else:
          x_next = _load_sum(x_ptr, r_ptr, offs_next, mask_next, HAS_RESIDUAL, XGROUP,
                             EVICT_FIRST, STREAM_CG, False, False)
          xs_next = 0.0
          x = x_raw
        _fwd_tile(x, y_ptr, h_ptr, mean_ptr, rstd_ptr, w, bias, scale_ptr, bias_ptr,
                  b * PARAM_STRIDE, b, rb, M, N, EPS, SCALE_OFFSET, SUBTRACT_MEAN,
                  HAS_SCALE, HAS_BIAS, STATS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M,
                  BLOCK_N, USE_INT64, False)
        x_raw = x_next
        xs = xs_next
    else:
      x = _load_sum(x_ptr, r_ptr, offs0, mask0, HAS_RESIDUAL, XGROUP, EVICT_FIRST, STREAM_CG,
                    False, SUBTRACT_MEAN)  # [BLOCK_M, BLOCK_N]
      _fwd_tile(x, y_ptr, h_ptr, mean_ptr, rstd_ptr, 0.0, 0.0, scale_ptr, bias_ptr,
                b * PARAM_STRIDE, b, pid, M, N, EPS, SCALE_OFFSET, SUBTRACT_MEAN,
                HAS_SCALE, HAS_BIAS, STATS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M,
                BLOCK_N, USE_INT64, True)


# ------------------------------------------------------ tensor parallel: statistics, then y


@triton.jit
def _shard_stats_block(x_ptr, r_ptr, s1_ptr, s2_ptr, h_ptr, b, rb, M, N,
                       SUBTRACT_MEAN: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       XGROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_INT64: tl.constexpr, LOOP_STAGES: tl.constexpr):
  """Statistics of row block ``rb`` over its N columns: s1 = sum(x**2) (RMSNorm), or
  s1 = mean and s2 = M2 (LayerNorm); of h = x + residual, stored, with a residual."""
  rows, row_mask = _row_ids(b, rb, M, BLOCK_M, USE_INT64)
  mean, acc = _chunk_stats(x_ptr, r_ptr, h_ptr, rows[:, None] * N, row_mask, N,
                           SUBTRACT_MEAN, HAS_RESIDUAL, XGROUP, BLOCK_M, BLOCK_N,
                           LOOP_STAGES)  # [BLOCK_M] f32 each
  if SUBTRACT_MEAN:
    tl.store(s1_ptr + rows, mean, mask=row_mask)
    tl.store(s2_ptr + rows, acc, mask=row_mask)
  else:
    tl.store(s1_ptr + rows, acc, mask=row_mask)


@triton.jit
def fwd_shard_stats_kernel(
    # inputs
    x_ptr, r_ptr,
    # outputs
    s1_ptr, s2_ptr, h_ptr,
    # statics
    M: tl.constexpr, N: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PERSISTENT: tl.constexpr, USE_INT64: tl.constexpr, LOOP_STAGES: tl.constexpr):
  """Tensor-parallel forward, pass 1 of 2: row statistics over this shard's N columns.
  Grid (programs, batch).

  x: [batch, M, N]; r: [batch, M, N], the residual (``HAS_RESIDUAL`` only, else unused:
  any pointer); s1: [batch, M] f32, sum(x**2) (RMSNorm) or the mean (LayerNorm);
  s2: [batch, M] f32, M2 = sum((x - mean)**2) (LayerNorm only, else unused: any
  pointer); h = x + r: [batch, M, N] in h's dtype (``HAS_RESIDUAL`` only; the
  statistics are then h's). PERSISTENT: grid-stride loop over the row blocks, else one
  a program.
  """
  pid = tl.program_id(0)
  b = tl.program_id(1)
  if PERSISTENT:
    for rb in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
      _shard_stats_block(x_ptr, r_ptr, s1_ptr, s2_ptr, h_ptr, b, rb, M, N, SUBTRACT_MEAN,
                         HAS_RESIDUAL, XGROUP, BLOCK_M, BLOCK_N, USE_INT64, LOOP_STAGES)
  else:
    _shard_stats_block(x_ptr, r_ptr, s1_ptr, s2_ptr, h_ptr, b, pid, M, N, SUBTRACT_MEAN,
                       HAS_RESIDUAL, XGROUP, BLOCK_M, BLOCK_N, USE_INT64, LOOP_STAGES)


@triton.jit
def _shard_apply_block(x_ptr, r_ptr, scale_ptr, bias_ptr, mean_ptr, rstd_ptr, y_ptr, b, rb,
                       M, N, param_stride, SCALE_OFFSET: tl.constexpr,
                       SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr,
                       LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, USE_INT64: tl.constexpr,
                       LOOP_STAGES: tl.constexpr):
  """y of row block ``rb`` from the whole rows' mean (LayerNorm) and rstd."""
  rows, row_mask = _row_ids(b, rb, M, BLOCK_M, USE_INT64)
  mean, rstd = _load_row_stats(mean_ptr, rstd_ptr, rows, row_mask, SUBTRACT_MEAN)
  _chunk_normalise(x_ptr, r_ptr, scale_ptr, bias_ptr, y_ptr, rows[:, None] * N, row_mask,
                   mean, rstd, b * param_stride, N, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE,
                   HAS_BIAS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_N, LOOP_STAGES)


@triton.jit
def fwd_shard_apply_kernel(
    # inputs
    x_ptr, r_ptr, scale_ptr, bias_ptr, mean_ptr, rstd_ptr,
    # outputs
    y_ptr,
    # statics
    M: tl.constexpr, N: tl.constexpr, PARAM_STRIDE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, XGROUP: tl.constexpr, LLAMA_X: tl.constexpr,
    LLAMA_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PERSISTENT: tl.constexpr, USE_INT64: tl.constexpr, LOOP_STAGES: tl.constexpr):
  """Tensor-parallel forward, pass 2 of 2: y = (x - mean) * rstd * w + bias over this
  shard's N columns, from the whole rows' statistics. Grid (programs, batch).

  x: [batch, M, N]; r: the residual given to the statistics kernel (``HAS_RESIDUAL``;
  y is then that of x + r, else unused: any pointer); scale, bias: [batch, N] rows at
  ``PARAM_STRIDE`` (unused when absent: any pointer); mean (LayerNorm only, else
  unused), rstd: [batch, M] f32; y: [batch, M, N] in x's dtype (y's with ``LLAMA_X``,
  as in ``norm_fwd_kernel``). PERSISTENT: grid-stride loop over the row blocks, else
  one a program.
  """
  pid = tl.program_id(0)
  b = tl.program_id(1)
  if PERSISTENT:
    for rb in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
      _shard_apply_block(x_ptr, r_ptr, scale_ptr, bias_ptr, mean_ptr, rstd_ptr, y_ptr, b, rb,
                         M, N, PARAM_STRIDE, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE,
                         HAS_BIAS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M, BLOCK_N,
                         USE_INT64, LOOP_STAGES)
  else:
    _shard_apply_block(x_ptr, r_ptr, scale_ptr, bias_ptr, mean_ptr, rstd_ptr, y_ptr, b, pid,
                       M, N, PARAM_STRIDE, SCALE_OFFSET, SUBTRACT_MEAN, HAS_SCALE,
                       HAS_BIAS, HAS_RESIDUAL, XGROUP, LLAMA_X, LLAMA_Y, BLOCK_M, BLOCK_N,
                       USE_INT64, LOOP_STAGES)


# --------------------------------------------------------------------------- backward


@triton.jit
def _bwd_math(dy, x, mean, rstd, w, mask, SUBTRACT_MEAN: tl.constexpr,
              HAS_SCALE: tl.constexpr, LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr):
  """Raw dy, x tiles -> (dy, x_hat, g, x_hat_w), each [BLOCK_M, BLOCK_N] f32, 0 where
  masked: g = dy * w is x_hat's cotangent, x_hat_w what dscale sums dy against. With
  ``LLAMA_X`` (``cast="llama"``), g goes through the transposes of the forward's
  roundings (to y's dtype, then x's) and x_hat_w is the rounded x_hat the weight
  multiplied (as backward.py's ``_x_hat_g``)."""
  dy = dy.to(tl.float32)
  x = x.to(tl.float32)
  if SUBTRACT_MEAN:
    x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
  else:
    x_hat = x * rstd[:, None]
  if HAS_SCALE:
    g = dy * w[None, :]
  else:
    g = dy
  x_hat_w = x_hat
  if LLAMA_X != 0:
    g = _round(_round(g, LLAMA_Y), LLAMA_X)
    x_hat_w = _round(x_hat, LLAMA_X)
  return dy, x_hat, g, x_hat_w


@triton.jit
def _bwd_dx(x_hat, g, c1, c2, rstd, SUBTRACT_MEAN: tl.constexpr):
  """dx = (g - (x_hat * c1 + c2)) * rstd, [BLOCK_M, BLOCK_N] f32."""
  if SUBTRACT_MEAN:
    dx = (g - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]
  else:
    dx = (g - x_hat * c1[:, None]) * rstd[:, None]
  return dx


@triton.jit
def bwd_row_stats_kernel(
    # inputs
    dy_ptr, x_ptr, scale_ptr, mean_ptr, rstd_ptr, xs_ptr,
    # outputs
    c1_ptr, c2_ptr,
    # statics
    M: tl.constexpr, N: tl.constexpr, PARAM_STRIDE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
    XGROUP: tl.constexpr, LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_INT64: tl.constexpr, LOOP_STAGES: tl.constexpr):
  """Chunked backward, first kernel: c1 = sum(x_hat * g) / N and c2 = sum(g) / N per row,
  walking the row in BLOCK_N chunks. Grid (cdiv(M, BLOCK_M), batch).

  dy, x: [batch, M, N]; scale: [batch, N] rows at ``PARAM_STRIDE``; mean (LayerNorm
  only), rstd: [batch, M] f32; c1: [batch, M] f32; c2: [batch, M] f32 (LayerNorm only,
  else unused). ``LLAMA_X`` / ``LLAMA_Y``, ``XGROUP`` and xs: as in ``norm_bwd_kernel``.
  """
  rb = tl.program_id(0)
  b = tl.program_id(1)
  rows, row_mask = _row_ids(b, rb, M, BLOCK_M, USE_INT64)
  row_offs = rows[:, None] * N  # [BLOCK_M, 1]
  cols0 = tl.arange(0, BLOCK_N)
  mean, rstd = _load_row_stats(mean_ptr, rstd_ptr, rows, row_mask, SUBTRACT_MEAN)
  c1 = tl.zeros([BLOCK_M], tl.float32)
  c2 = tl.zeros([BLOCK_M], tl.float32)
  for off in tl.range(0, N, BLOCK_N,
                      num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
    cols = off + cols0
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_N]
    offs = row_offs + cols[None, :]
    w = _load_param(scale_ptr, b * PARAM_STRIDE + cols, col_mask, SCALE_OFFSET, HAS_SCALE)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if XGROUP > 0:
      x = _dequantise(x, xs_ptr, offs, mask, XGROUP, True)
    _, x_hat, g, _ = _bwd_math(dy, x, mean, rstd, w, mask, SUBTRACT_MEAN, HAS_SCALE,
                               LLAMA_X, LLAMA_Y)
    c1 += tl.sum(x_hat * g, axis=1)
    c2 += tl.sum(g, axis=1)
  tl.store(c1_ptr + rows, c1 / N, mask=row_mask)
  if SUBTRACT_MEAN:
    tl.store(c2_ptr + rows, c2 / N, mask=row_mask)


@triton.jit
def norm_bwd_kernel(
    # inputs
    dy_ptr, x_ptr, scale_ptr, mean_ptr, rstd_ptr, xs_ptr, c1_ptr, c2_ptr, dh_ptr,
    # outputs
    dx_ptr, dres_ptr, dscale_part_ptr, dbias_part_ptr,
    # statics
    M: tl.constexpr, N: tl.constexpr, PARAM_STRIDE: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, XGROUP: tl.constexpr, HAS_DH: tl.constexpr,
    PREFETCH_DH: tl.constexpr,
    HAS_DRES: tl.constexpr, LLAMA_X: tl.constexpr, LLAMA_Y: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr, USE_INT64: tl.constexpr,
    EVICT_FIRST: tl.constexpr, STREAM_CG: tl.constexpr):
  """Backward stage 1, persistent over row blocks. Grid (G, chunks, batch).

  Program (r, k, b) handles column chunk k of row blocks r, r + G, ... of batch entry b.
  Without CHUNKED there is one chunk (BLOCK_N >= N) and c1/c2 are reduced here; with
  it, c1/c2 come from ``bwd_row_stats_kernel``.

  dy, x: [batch, M, N] (x is h = x + residual with the fused residual add); scale:
  [batch, N] rows at ``PARAM_STRIDE``; mean (LayerNorm only), rstd: [batch, M] f32; c1,
  c2: [batch, M] f32 (CHUNKED only; c2 LayerNorm only); dh: [batch, M, N], h's
  cotangent, added to dx in float32 (``HAS_DH`` only, else unused: any pointer;
  prefetched with x and dy under ``PREFETCH_DH``, else loaded at the store);
  dx: [batch, M, N] in x's dtype (the residual add's x); dres: [batch, M, N], the same
  sum in the residual's dtype (``HAS_DRES`` only: when it differs from dx's);
  dscale_part, dbias_part: [batch * G, N] f32, row ``b * G + r`` columns of chunk k
  written by program (r, k, b) alone (each only when the param exists). ``LLAMA_X`` /
  ``LLAMA_Y`` (``cast="llama"``; ``DTYPE_CODES`` of x's and y's dtypes, 0 otherwise):
  the forward's roundings, transposed (``_bwd_math``). ``XGROUP`` > 0: x is FP8 and
  xs [batch, M, N // XGROUP] f32 its group scales (x dequantised as it is loaded,
  ``_dequantise``); else xs is unused (any pointer).
  """
  pid = tl.program_id(0)
  k = tl.program_id(1)
  b = tl.program_id(2)
  step = tl.num_programs(0)
  n_rb = tl.cdiv(M, BLOCK_M)
  cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
  col_mask = cols < N
  # Hoisted: scale once per program; the partials stay in registers until the end.
  w = _load_param(scale_ptr, b * PARAM_STRIDE + cols, col_mask, SCALE_OFFSET, HAS_SCALE)
  dscale = tl.zeros([BLOCK_N], tl.float32)
  dbias = tl.zeros([BLOCK_N], tl.float32)
  _, _, offs0, mask0 = _tile_at(b, pid, cols, col_mask, M, N, BLOCK_M, USE_INT64)
  dy = _stream_load(dy_ptr, offs0, mask0, EVICT_FIRST, STREAM_CG)  # [BLOCK_M, BLOCK_N]
  x_raw = _stream_load(x_ptr, offs0, mask0, EVICT_FIRST, STREAM_CG)
  xs = _group_scales(xs_ptr, offs0, mask0, XGROUP, True) if XGROUP > 0 else 0.0
  if PREFETCH_DH:
    dh = _stream_load(dh_ptr, offs0, mask0, EVICT_FIRST, STREAM_CG)
  else:
    dh = 0.0
  for rb in tl.range(pid, n_rb, step):
    # Prefetch the next row block (fully masked past the end) before this one's math;
    # dh too, with the fused residual add.
    _, _, offs_next, mask_next = _tile_at(b, rb + step, cols, col_mask, M, N, BLOCK_M,
                                          USE_INT64)
    dy_next = _stream_load(dy_ptr, offs_next, mask_next, EVICT_FIRST, STREAM_CG)
    x_next = _stream_load(x_ptr, offs_next, mask_next, EVICT_FIRST, STREAM_CG)
    # FP8 x: prefetched as FP8 with its scales, dequantised here, for this block
    if XGROUP > 0:
      xs_next = _group_scales(xs_ptr, offs_next, mask_next, XGROUP, True)
      x = _apply_scales(x_raw, xs, XGROUP, True)
    else:
      xs_next = 0.0
      x = x_raw
    if PREFETCH_DH:
      dh_next = _stream_load(dh_ptr, offs_next, mask_next, EVICT_FIRST, STREAM_CG)
    else:
      dh_next = 0.0
    rows, row_mask, offs, mask = _tile_at(b, rb, cols, col_mask, M, N, BLOCK_M, USE_INT64)
    mean, rstd = _load_row_stats(mean_ptr, rstd_ptr, rows, row_mask, SUBTRACT_MEAN)
    dyf, x_hat, g, x_hat_w = _bwd_math(dy, x, mean, rstd, w, mask, SUBTRACT_MEAN, HAS_SCALE,
                                       LLAMA_X, LLAMA_Y)
    if CHUNKED:
      c1 = tl.load(c1_ptr + rows, mask=row_mask, other=0.0)  # [BLOCK_M] f32
      if SUBTRACT_MEAN:
        c2 = tl.load(c2_ptr + rows, mask=row_mask, other=0.0)
      else:
        c2 = 0.0
    else:
      c1 = tl.sum(x_hat * g, axis=1) / N  # [BLOCK_M] f32
      c2 = tl.sum(g, axis=1) / N
    dx = _bwd_dx(x_hat, g, c1, c2, rstd, SUBTRACT_MEAN)
    if PREFETCH_DH:
      dx += dh.to(tl.float32)
    elif HAS_DH:
      dx += _stream_load(dh_ptr, offs, mask, EVICT_FIRST, STREAM_CG).to(tl.float32)
    if HAS_DRES:
      tl.store(dres_ptr + offs, dx.to(dres_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dscale += tl.sum(dyf * x_hat_w, axis=0)
    dbias += tl.sum(dyf, axis=0)
    dy = dy_next
    x_raw = x_next
    xs = xs_next
    dh = dh_next
  part_row = b * step + pid
  if USE_INT64:
    part_row = part_row.to(tl.int64)
  part_offs = part_row * N + cols
  if HAS_SCALE:
    tl.store(dscale_part_ptr + part_offs, dscale, mask=col_mask)
  if HAS_BIAS:
    tl.store(dbias_part_ptr + part_offs, dbias, mask=col_mask)


@triton.jit
def partial_reduce_kernel(
    # inputs
    part_ptr,
    # outputs
    out_ptr,
    # statics
    G: tl.constexpr, N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, USE_INT64: tl.constexpr):
  """Backward stage 2. Grid (cdiv(N, BLOCK_N), batch).

  part: [batch * G, N] f32; out: [batch, N] in the parameter dtype, out[b] = the sum of
  part rows b*G .. b*G + G - 1 in a fixed order.
  """
  pid = tl.program_id(0)
  b = tl.program_id(1)
  cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
  col_mask = cols < N
  acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
  for g0 in tl.range(0, G, BLOCK_G):
    g = g0 + tl.arange(0, BLOCK_G)
    rows = b * G + g
    if USE_INT64:
      rows = rows.to(tl.int64)
    mask = (g < G)[:, None] & col_mask[None, :]  # [BLOCK_G, BLOCK_N]
    acc += tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
  out = tl.sum(acc, axis=0)  # [BLOCK_N] f32
  out_row = b * N
  if USE_INT64:
    out_row = out_row.to(tl.int64)
  tl.store(out_ptr + out_row + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------- launch plans


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
  """Everything a launch needs besides the arrays.

  Attributes:
    grid: the launch grid; its last axis is the batch.
    num_warps: warps per program.
    num_stages: software-pipelining depth (the config's ``num_stages``).
    constexprs: the kernel's ``tl.constexpr`` arguments, as (name, value) pairs.
  """

  grid: tuple[int, ...]
  num_warps: int
  num_stages: int
  constexprs: tuple[tuple[str, Any], ...]

  @property
  def kwargs(self) -> dict[str, Any]:
    return dict(self.constexprs)


# ``cast="llama"``'s dtypes as the kernels' LLAMA_X / LLAMA_Y constexprs (0: no llama).
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}


def _llama(cast: tuple[str, str] | None) -> tuple[tuple[str, int], ...]:
  """LLAMA_X / LLAMA_Y of ``cast`` ((x's dtype name, y's dtype name) for
  ``cast="llama"``, None for "torch").

  Raises:
    ValueError: a dtype name outside ``DTYPE_CODES``.
  """
  if cast is None:
    return (("LLAMA_X", 0), ("LLAMA_Y", 0))
  for name in cast:
    if name not in DTYPE_CODES:
      raise ValueError(f"cast={cast}: {name!r} is not one of {tuple(DTYPE_CODES)}")
  return (("LLAMA_X", DTYPE_CODES[cast[0]]), ("LLAMA_Y", DTYPE_CODES[cast[1]]))


def _needs_int64(rows: int, n: int, block_m: int, block_n: int) -> bool:
  # The largest flat offset a (masked) lane can form: padded rows times N plus a padded
  # column.
  return (rows + block_m) * n + _config.cdiv(n, block_n) * block_n > _INT32_MAX


def forward_plan(config: _config.ForwardConfig, *, batch: int, m: int, n: int, eps: float,
                 scale_offset: float, subtract_mean: bool, has_scale: bool,
                 has_bias: bool, return_residuals: bool = True, param_stride: int = 0,
                 has_residual: bool = False, cast: tuple[str, str] | None = None,
                 x_group: int = 0, knobs: TritonKnobs | None = None) -> LaunchPlan:
  """Launch plan of ``norm_fwd_kernel`` for x: [batch, m, n].

  ``x_group``: FP8 x's group size (its scales passed as the residual pointer; 0: x is
  not FP8).

  ``param_stride``: elements between the scale/bias rows of consecutive batch entries
  (0 when they share one row, else n).

  ``return_residuals=False`` leaves mean / rstd unwritten (``STATS``); ``has_residual``:
  the fused residual add (``HAS_RESIDUAL``); ``cast``: (x's, y's dtype names) for
  ``cast="llama"``, None for "torch" (``_llama``); ``knobs`` defaults to ``KNOBS``.

  Raises:
    ValueError: multi_wave_cached with ``config.block_n < n``, or static_persistent
      with ``config.num_programs < 1``.
  """
  if config.mode == "multi_wave_cached" and config.block_n < n:
    raise ValueError(f"multi_wave_cached holds the row in one tile: {config.block_n=} "
                     f"must be >= N={n}")
  persistent = config.mode == "static_persistent"
  if persistent:
    if config.num_programs < 1:
      raise ValueError(f"static_persistent needs {config.num_programs=} >= 1")
    programs = _config.cdiv(config.num_programs, batch)
  else:
    programs = _config.cdiv(m, config.block_m)
  chunked = config.mode == "multi_wave_reload" or config.block_n < n
  # The persistent loop prefetches up to G row blocks past M: offsets must fit too.
  rows = batch * m + (programs * config.block_m if persistent else 0)
  constexprs = (
      ("M", m), ("N", n), ("PARAM_STRIDE", param_stride), ("EPS", float(eps)), ("SCALE_OFFSET", float(scale_offset)),
      ("SUBTRACT_MEAN", bool(subtract_mean)), ("HAS_SCALE", bool(has_scale)),
      ("HAS_BIAS", bool(has_bias)), ("STATS", bool(return_residuals)),
      ("HAS_RESIDUAL", bool(has_residual)), ("XGROUP", int(x_group)), *_llama(cast),
      ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n), ("CHUNKED", chunked),
      ("PERSISTENT", persistent),
      ("USE_INT64", _needs_int64(rows, n, config.block_m, config.block_n)),
      *(knobs or KNOBS).constexprs())
  return LaunchPlan((programs, batch), config.num_warps, config.num_stages, constexprs)


def _shard_programs(config: _config.ForwardConfig, batch: int, m: int) -> tuple[int, bool]:
  """(programs a batch entry, persistent) of the tensor-parallel forward kernels:
  static_persistent takes ``cdiv(config.num_programs, batch)`` of them (one a row block
  when 0), at most one a row block; the multi-wave modes one a row block."""
  num_row_blocks = _config.cdiv(m, config.block_m)
  if config.mode != "static_persistent":
    return num_row_blocks, False
  programs = _config.cdiv(config.num_programs, batch) if config.num_programs else num_row_blocks
  return max(1, min(programs, num_row_blocks)), True


def shard_stats_plan(config: _config.ForwardConfig, *, batch: int, m: int, n: int,
                     subtract_mean: bool, has_residual: bool = False, x_group: int = 0,
                     knobs: TritonKnobs | None = None) -> LaunchPlan:
  """Launch plan of ``fwd_shard_stats_kernel`` for x: [batch, m, n], a shard of the
  hidden dim (s1, s2: [batch * m] f32 each).

  The row is walked in ``config.block_n`` chunks (one when it fits), in every mode:
  multi_wave_cached too, and ``split_rows`` / ``chunk_n`` are not used (as in the Pallas
  kernels). static_persistent loops over row blocks (``_shard_programs``).
  """
  programs, persistent = _shard_programs(config, batch, m)
  constexprs = (
      ("M", m), ("N", n), ("SUBTRACT_MEAN", bool(subtract_mean)),
      ("HAS_RESIDUAL", bool(has_residual)), ("XGROUP", int(x_group)),
      ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n),
      ("PERSISTENT", persistent),
      ("USE_INT64", _needs_int64(batch * m, n, config.block_m, config.block_n)),
      ("LOOP_STAGES", int((knobs or KNOBS).loop_stages)))
  return LaunchPlan((programs, batch), config.num_warps, config.num_stages, constexprs)


def shard_apply_plan(config: _config.ForwardConfig, *, batch: int, m: int, n: int,
                     scale_offset: float, subtract_mean: bool, has_scale: bool,
                     has_bias: bool, param_stride: int = 0, has_residual: bool = False,
                     cast: tuple[str, str] | None = None, x_group: int = 0,
                     knobs: TritonKnobs | None = None) -> LaunchPlan:
  """Launch plan of ``fwd_shard_apply_kernel`` for x: [batch, m, n], a shard of the
  hidden dim; grid and chunks as in ``shard_stats_plan``, ``param_stride``,
  ``has_residual`` and ``cast`` as in ``forward_plan``."""
  programs, persistent = _shard_programs(config, batch, m)
  constexprs = (
      ("M", m), ("N", n), ("PARAM_STRIDE", param_stride),
      ("SCALE_OFFSET", float(scale_offset)), ("SUBTRACT_MEAN", bool(subtract_mean)),
      ("HAS_SCALE", bool(has_scale)), ("HAS_BIAS", bool(has_bias)),
      ("HAS_RESIDUAL", bool(has_residual)), ("XGROUP", int(x_group)), *_llama(cast),
      ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n),
      ("PERSISTENT", persistent),
      ("USE_INT64", _needs_int64(batch * m, n, config.block_m, config.block_n)),
      ("LOOP_STAGES", int((knobs or KNOBS).loop_stages)))
  return LaunchPlan((programs, batch), config.num_warps, config.num_stages, constexprs)


def row_stats_plan(config: _config.BackwardConfig, *, batch: int, m: int, n: int,
                   scale_offset: float, subtract_mean: bool, has_scale: bool,
                   param_stride: int = 0, combine_row_sums: bool = False,
                   cast: tuple[str, str] | None = None, x_group: int = 0,
                   knobs: TritonKnobs | None = None) -> LaunchPlan | None:
  """Launch plan of ``bwd_row_stats_kernel`` (c1, c2: [batch * m] f32 each) for dy, x:
  [batch, m, n]; None when ``config.block_n >= n`` (the single-tile backward needs no
  row statistics), unless ``combine_row_sums``: x is a shard of the hidden dim and its
  row sums are combined across the shards before ``norm_bwd_kernel`` reads them."""
  if config.block_n >= n and not combine_row_sums:
    return None
  constexprs = (
      ("M", m), ("N", n), ("PARAM_STRIDE", param_stride),
      ("SCALE_OFFSET", float(scale_offset)), ("SUBTRACT_MEAN", bool(subtract_mean)),
      ("HAS_SCALE", bool(has_scale)), ("XGROUP", int(x_group)), *_llama(cast),
      ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n),
      ("USE_INT64", _needs_int64(batch * m, n, config.block_m, config.block_n)),
      ("LOOP_STAGES", int((knobs or KNOBS).loop_stages)))
  return LaunchPlan((_config.cdiv(m, config.block_m), batch), config.num_warps,
                    config.num_stages, constexprs)


def backward_plan(config: _config.BackwardConfig, *, batch: int, m: int, n: int,
                  scale_offset: float, subtract_mean: bool, has_scale: bool,
                  has_bias: bool, param_stride: int = 0, combine_row_sums: bool = False,
                  has_dh: bool = False, has_dres: bool = False,
                  cast: tuple[str, str] | None = None, x_group: int = 0,
                  knobs: TritonKnobs | None = None) -> LaunchPlan:
  """Launch plan of ``norm_bwd_kernel`` for dy, x: [batch, m, n].

  ``has_dh`` / ``has_dres``: the fused residual add's dh input and dresidual output
  (``HAS_DH`` / ``HAS_DRES``); ``cast`` and ``x_group`` (FP8 x, ``XGROUP``) as in
  ``forward_plan``.

  The grid is (G, chunks, batch); the partial buffers are ``[batch * grid[0], n]`` f32.
  With ``CHUNKED`` (``config.block_n < n``, or ``combine_row_sums``: c1 / c2 are given,
  combined across the shards of the hidden dim), ``row_stats_plan`` launches first.
  """
  programs = _config.cdiv(config.num_programs, batch)
  chunked = config.block_n < n or combine_row_sums
  knobs = knobs or KNOBS
  # Rows: the prefetch reaches one row block past the last (G * block_m rows at most).
  rows = max(batch * m + programs * config.block_m, batch * programs)
  constexprs = (
      ("M", m), ("N", n), ("PARAM_STRIDE", param_stride),
      ("SCALE_OFFSET", float(scale_offset)), ("SUBTRACT_MEAN", bool(subtract_mean)),
      ("HAS_SCALE", bool(has_scale)), ("HAS_BIAS", bool(has_bias)),
      ("XGROUP", int(x_group)), ("HAS_DH", bool(has_dh)),
      ("PREFETCH_DH", bool(has_dh) and bool(subtract_mean)
       and config.block_n <= _PREFETCH_DH_MAX_BLOCK_N),
      ("HAS_DRES", bool(has_dres)), *_llama(cast),
      ("BLOCK_M", config.block_m), ("BLOCK_N", config.block_n), ("CHUNKED", chunked),
      ("USE_INT64", _needs_int64(rows, n, config.block_m, config.block_n)),
      ("EVICT_FIRST", bool(knobs.evict_first)), ("STREAM_CG", bool(knobs.stream_cg)))
  grid = (programs, _config.cdiv(n, config.block_n) if chunked else 1, batch)
  return LaunchPlan(grid, config.num_warps, config.num_stages, constexprs)


def reduce_plan(config: _config.BackwardConfig, *, batch: int, groups: int,
                n: int) -> LaunchPlan:
  """Launch plan of ``partial_reduce_kernel`` for partials: [batch * groups, n]."""
  constexprs = (("G", groups), ("N", n), ("BLOCK_G", config.reduce_block_g), ("BLOCK_N", config.reduce_block_n),
                ("USE_INT64", _needs_int64(batch * groups, n, config.reduce_block_g,
                                           config.reduce_block_n)))
  return LaunchPlan((_config.cdiv(n, config.reduce_block_n), batch),
                    config.reduce_num_warps, 1, constexprs)
