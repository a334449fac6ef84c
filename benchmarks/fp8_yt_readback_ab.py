"""The transposed FP8 copy (delayed scaling, ``transpose=True``) by read-back: a prototype
kernel against the H100's design (the one-pass kernel, then XLA's transpose of y,
docs/fp8_tuning.md#fp8-yt-separate) and the fused kernel (y_t stored from the same registers,
32-row blocks walked twice).

The read-back kernel: persistent programs walk super-blocks of ``sb_rows`` rows (r, r + G,
...). A super-block's rows go through the one-pass whole-row code in ``block_m``-row
blocks (``kernels.fp8._persistent_kernel``'s body: statistics, y quantised and stored
row-major, the next block's x prefetched); then a CTA barrier (``plgpu.debug_barrier``,
which makes the block's global stores visible to all its threads), and the super-block's
y, just written and still in L2, is read back in [sb_rows, yt_chunk] tiles (``.cg``: L2,
not L1) and stored to y_t through transposed indices: sb_rows contiguous bytes a y_t row
(32: one sector). HBM: read x (2 bytes), write y (1) and y_t (1), the issue's bytes
model; the y read-back is an L2 read.

RMSNorm and LayerNorm at 8192x4096, 16384x4096, 8192x8192, 32768x2048; bf16 x and
scale/bias, e4m3fn, inv = 1 / y_scale = 100 (as fp8_yt_design_ab.py). CUPTI kernel time of a call's kernels, median of 10
calls over inputs rotated over >= 256 MiB, variants interleaved in each of 5 rounds, the
median of the rounds; y_t checked bitwise equal to the variant's own y.T, y against the
separate design's y (the count of differing bytes: the packed kernel's row sums run in
another order). Usage: python benchmarks/fp8_yt_readback_ab.py OUT.json (GPU)
"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_norm.bench import timing
from pallas_norm.config import cdiv, device_info
from pallas_norm.kernels import fp8 as K
from pallas_norm.kernels._compat import out_struct, stream_cache_modifier
from pallas_norm.kernels.forward import _tile_index

E4 = jnp.float8_e4m3fn
F32 = jnp.float32


def readback_kernel(*refs, n, eps, scale_offset, subtract_mean, has_scale, has_bias,
                    fp8_dtype, hw_sat, hw_amax, block_m, block_n, num_programs, sb_rows,
                    yt_chunk, row_amax, stream_x):
  x_ref, scale_ref, bias_ref, q, mean_ref, rstd_ref, amax_ref = K._norm_refs(
      refs, has_scale, has_bias, fp8_dtype, True, subtract_mean, hw_sat)
  inv, fp8, y_ref, y_t_ref, hw = q
  q_rows = (inv, fp8, y_ref, None, hw)  # the row phase stores y only
  m = x_ref.shape[0]
  pid = pl.program_id(0)
  s_blocks = sb_rows // block_m
  num_steps = (cdiv(m, sb_rows) - 1 - pid) // num_programs + 1
  tile = functools.partial(_tile_index, m=m, n=n, block_m=block_m, block_n=block_n,
                           rows_in_bounds=True)
  _, cols, _, col_mask, _ = _tile_index(0, 0, 1, n, block_m=1, block_n=block_n)
  w, b = K._load_params_2d(scale_ref, bias_ref, cols, col_mask, scale_offset)
  params = lambda c, cm: (w, b)
  load = K._row_block_loader(x_ref, n=n, block_m=block_m, block_n=block_n, stream=stream_x)
  stats = dict(n=n, eps=eps, subtract_mean=subtract_mean)
  aligned = m % sb_rows == 0 and n % yt_chunk == 0

  def row_block(k, carry, sb):
    amax, x = carry
    rb = sb * s_blocks + k
    nxt = jnp.where(k + 1 < s_blocks, rb + 1, (sb + num_programs) * s_blocks)
    x_next = load(nxt)  # the prefetch (past the end: fully masked)
    t = tile(rb, 0)
    x = x.astype(F32)
    mean, rstd = K._tile_stats(x, t[4], **stats)
    if row_amax:
      a = K._emit(x, t, mean, rstd, params, q_rows, None, hw_amax)
      amax = jnp.maximum(amax, K._amax_out(a, (0, 1)))
    else:
      amax = K._emit(x, t, mean, rstd, params, q_rows, amax, hw_amax)
    K._store_row_stats(mean_ref, rstd_ref, t[0], t[2], mean, rstd)
    return amax, x_next

  def yt_tile(c, sb):
    rows = sb * sb_rows + jnp.arange(sb_rows, dtype=jnp.int32)
    cs = c * yt_chunk + jnp.arange(yt_chunk, dtype=jnp.int32)
    mask = None if aligned else (rows < m)[:, None] & (cs < n)[None, :]
    yq = plgpu.load(y_ref.at[rows[:, None], cs[None, :]], mask=mask,
                     cache_modifier=stream_cache_modifier())
    plgpu.store(y_t_ref.at[cs[None, :], rows[:, None]], yq, mask=mask)

  def super_block(j, carry):
    sb = pid + j * num_programs
    carry = lax.fori_loop(0, s_blocks, lambda k, c: row_block(k, c, sb), carry)
    plgpu.debug_barrier()  # this block's y stores, visible to all its threads
    lax.fori_loop(0, cdiv(n, yt_chunk), lambda c, u: (yt_tile(c, sb), u)[1], 0)
    return carry

  init = (K._carry_init(row_amax, (block_m, block_n), hw_amax), load(pid * s_blocks))
  amax, _ = lax.fori_loop(0, num_steps, super_block, init)
  amax_ref[pid] = K._carry_out(amax, row_amax)


def readback(x, scale, bias, inv, *, subtract_mean, block_m, num_warps, per_sm, sb_rows,
             yt_chunk, row_amax=True, stream_x=False):
  m, n = x.shape
  block_n = 1 << (n - 1).bit_length()
  g = min(per_sm * device_info().num_sms, cdiv(m, sb_rows))
  outs = ([out_struct((m, n), E4, x), out_struct((n, m), E4, x)]
          + [out_struct((m,), F32, x)] * (2 if subtract_mean else 1)
          + [out_struct((g,), jnp.int32, x)])
  res = pl.pallas_call(
      functools.partial(readback_kernel, n=n, eps=1e-5, scale_offset=0.0,
                        subtract_mean=subtract_mean, has_scale=True,
                        has_bias=bias is not None, fp8_dtype="float8_e4m3fn",
                        hw_sat=True, hw_amax=True, block_m=block_m, block_n=block_n,
                        num_programs=g, sb_rows=sb_rows, yt_chunk=yt_chunk,
                        row_amax=row_amax, stream_x=stream_x),
      out_shape=outs, grid=(g,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      name="fp8_delayed_yt_readback",
  )(*[a for a in (x, scale, bias, jnp.asarray(inv, F32).reshape(1)) if a is not None])
  return res[0], res[1], jnp.max(res[-1])


# (block_m, num_warps, programs a SM, sb_rows, yt_chunk)
VARIANTS = [(1, 8, 4, 32, 256), (1, 8, 4, 32, 512), (1, 8, 4, 32, 1024), (1, 8, 2, 32, 512),
            (1, 8, 3, 32, 512), (2, 8, 2, 32, 512), (1, 16, 2, 32, 512), (1, 8, 2, 64, 512),
            (1, 4, 4, 32, 512)]


def main(out):
  timing.warm_up()
  copy = timing.torch_copy_gbs(20)
  print("device", device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
    sets = max(2, -(-(256 << 20) // (m * n * 2)))
    xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
    s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
    b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
    for op in ("rms", "layer"):
      sm = op == "layer"
      bb = b if sm else None
      kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=sm, interpret=False)

      def separate(x):
        y = K.fp8_norm_delayed(x, s, bb, 100.0, fp8_dtype=E4, transpose=False, **kw)[0]
        return y, y.T

      fns = {"separate": jax.jit(separate),
             "fused": jax.jit(lambda x: K.fp8_norm_delayed(
                 x, s, bb, 100.0, fp8_dtype=E4, transpose=True, **kw)[:2])}
      for v in VARIANTS:
        if n > 4096 and v[0] > 1:
          continue
        bm, w, k, sbr, ch = v
        fns[f"readback bm{bm} w{w} {k}/SM sb{sbr} c{ch}"] = jax.jit(
            lambda x, v=v: readback(x, s, bb, 100.0, subtract_mean=sm, block_m=v[0],
                                    num_warps=v[1], per_sm=v[2], sb_rows=v[3],
                                    yt_chunk=v[4])[:2])
      y0 = np.asarray(fns["separate"](*xs[0])[0]).view(np.uint8)
      rows = {}
      for name, f in fns.items():
        try:
          y, yt = f(*xs[0])
          y, yt = np.asarray(y).view(np.uint8), np.asarray(yt).view(np.uint8)
          rows[name] = dict(yt_is_yT=bool(np.array_equal(yt, y.T)),
                            y_bytes_differing=int(np.sum(y != y0)), rounds=[])
        except Exception as e:  # recorded, not timed
          rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      for _ in range(5):
        for name, f in fns.items():
          if "error" not in rows[name]:
            rows[name]["rounds"].append(
                timing.cupti_time(f, xs, 10).get("us"))
      nbytes = m * n * 4
      for name, row in rows.items():
        if row.get("rounds"):
          r = sorted(row["rounds"])
          row["us"] = r[len(r) // 2]
          row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e9 / copy
        print(f"{op:5s} {m}x{n} {name:34s} {row.get('us', 0):7.1f} us "
              f"{row.get('pct_copy', 0):5.1f}%  yt=y.T {row.get('yt_is_yT')} "
              f"y diff {row.get('y_bytes_differing')} {row.get('error', '')}", flush=True)
      results.append(dict(op=op, m=m, n=n, rows=rows))
  json.dump(dict(device=device_info().name, copy_gbs=copy, results=results, note=__doc__),
            open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
