"""Launch-config sweep of the Mosaic GPU backend (issue #29): how many programs a SM,
pipeline stages, rows a block, y staged in place, rows a warp, warpgroups a program.
Forward (kernels/mosaic_forward.py) and backward (kernels/mosaic_backward.py, both stages), bf16 x, float32 scale/bias,
against the Pallas (Triton lowering) backend's default in the same process: CUPTI
kernel time, median of 20 calls over 3 rotated inputs, % of torch ``copy_`` on the
bytes model (forward: read x, write y; backward: read x and dy, write dx), max |diff|
against the Pallas result. One process a shape (a fault loses that shape only).

Usage (GPU machine): python benchmarks/mosaic_sweep.py [--out FILE.json]
                 or, one shape: python benchmarks/mosaic_sweep.py OP M N
MOSAIC_SWEEP=fwd or =bwd runs one pass's variants only.
"""
import dataclasses
import os

import _per_shape

SHAPES = [("rms", 8192, 2048), ("layer", 8192, 2048), ("rms", 8192, 4096),
          ("layer", 8192, 4096), ("rms", 4096, 8192), ("layer", 4096, 8192)]
# Variants: overrides of the default config (None: the default itself); "a_sm" sets
# num_programs to that many programs a SM. warp_rows: each warp holds whole rows (row
# sums within a warp); several warpgroups a program need it.
FWD = [None, dict(warp_rows=True), dict(warp_rows=True, a_sm=3),
       dict(warp_rows=True, block_m=8), dict(warp_rows=True, block_w=128),
       dict(warp_rows=True, num_warpgroups=2, block_w=128),
       dict(warp_rows=True, num_warpgroups=2, block_w=128, a_sm=1),
       dict(warp_rows=True, num_warpgroups=4, block_w=128, a_sm=1),
       dict(warp_rows=True, num_warpgroups=4, block_w=128),
       dict(warp_rows=True, num_warpgroups=4, a_sm=1),
       dict(warp_rows=True, num_warpgroups=2, a_sm=1),
       # warp-specialised: a producer warpgroup issues the loads (y in a tile of its own)
       dict(warp_specialized=True, y_in_place=False, a_sm=1),
       dict(warp_specialized=True, y_in_place=False, a_sm=1, num_stages=3),
       dict(warp_specialized=True, y_in_place=False, a_sm=1, warp_rows=True,
            num_warpgroups=2),
       dict(warp_specialized=True, y_in_place=False, a_sm=2, num_stages=1)]
# backward: G <= 256 (the partials' TMA box)
BWD = [None, dict(warp_rows=True), dict(warp_rows=True, num_warpgroups=2),
       dict(warp_rows=True, num_warpgroups=4),
       dict(warp_rows=True, num_warpgroups=4, block_w=128),
       dict(warp_rows=True, num_warpgroups=2, block_w=128),
       dict(warp_rows=True, num_warpgroups=4, num_stages=3),
       dict(warp_rows=True, num_warpgroups=4, num_programs=256, num_stages=1),
       # warp-specialised: a producer warpgroup issues the loads
       dict(warp_specialized=True), dict(warp_specialized=True, num_stages=3),
       dict(warp_specialized=True, warp_rows=True, num_warpgroups=2, block_w=128),
       dict(warp_specialized=True, block_m=8, num_stages=2)]
# MOSAIC_SWEEP=bwd (or fwd): one pass only
PASSES = os.environ.get("MOSAIC_SWEEP", "fwd,bwd").split(",")


def _variant(dflt, c, sms, cap):
  if c is None:
    return dflt
  c = dict(c)
  if "a_sm" in c:
    c["num_programs"] = c.pop("a_sm") * sms
  if "num_programs" in c:
    c["num_programs"] = min(c["num_programs"], cap)
  if c.get("warp_rows") and dflt.block_m % 4:  # one-row default blocks: 4 rows
    c.setdefault("block_m", 4)
  return dataclasses.replace(dflt, **c)


def run_shape(op, m, n):
  import jax
  import jax.numpy as jnp
  from pallas_norm import config as CF
  from pallas_norm.bench import timing
  from pallas_norm.kernels import backward as B
  from pallas_norm.kernels import forward as F
  from pallas_norm.kernels import mosaic_backward as MB
  from pallas_norm.kernels import mosaic_forward as MF
  layer = op == "layer"
  sms = CF.device_info().num_sms
  copy = timing.torch_copy_gbs(20)
  k = jax.random.split(jax.random.key(0), 3)
  s = 1 + 0.1 * jax.random.normal(k[0], (n,))
  b = 0.1 * s if layer else None
  xs = [jax.random.normal(jax.random.key(10 + i), (m, n), jnp.bfloat16) for i in range(3)]
  dys = [jax.random.normal(jax.random.key(20 + i), (m, n), jnp.bfloat16) for i in range(3)]
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
  rows = []

  shape = dict(op=op, m=m, n=n)

  def pct(us, streams):
    return _per_shape.pct_of_copy(us, streams, m, n, 2, copy)

  # forward
  fp = jax.jit(lambda x: F.norm_forward(x, s, b, config=CF.forward_config(
      m, n, x.dtype, subtract_mean=layer), **kw))
  yp, mp, rp = jax.block_until_ready(fp(xs[0]))
  us = timing.cupti_time(fp, [(x,) for x in xs], 20).get("us")
  rows.append(dict(kind="fwd", impl="pallas", us=us, pct_copy=pct(us, 2)))
  dflt = MF.forward_config(m, n, jnp.bfloat16, layer)
  for c in FWD if "fwd" in PASSES else []:
    def measure(row, c=c):
      cfg = _variant(dflt, c, sms, 1024)
      row["config"] = str(cfg) + (" (default)" if c is None else "")
      fm = jax.jit(lambda x: MF.norm_forward(x, s, b, config=cfg, **kw))
      ym, _, rm = jax.block_until_ready(fm(xs[0]))
      row["max_abs_diff_y"] = float(jnp.max(jnp.abs(ym.astype(jnp.float32)
                                                    - yp.astype(jnp.float32))))
      row["max_abs_diff_rstd"] = float(jnp.max(jnp.abs(rm - rp)))
      row["us"] = timing.cupti_time(fm, [(x,) for x in xs], 20).get("us")
      row["pct_copy"] = pct(row["us"], 2)
    _per_shape.record(rows, shape, dict(kind="fwd", impl="mosaic"), measure)

  # backward (both stages), from the Pallas forward's statistics
  bkw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=False,
             scale_dtype=jnp.float32, bias_dtype=jnp.float32 if layer else None)
  sets = [(dy, xs[0], mp, rp) for dy in dys]
  bp = jax.jit(lambda dy, x, mu, r: B.norm_backward(dy, x, s, mu, r, config=CF.backward_config(
      m, n, x.dtype, subtract_mean=layer), **bkw))
  ref = jax.block_until_ready(bp(*sets[0]))
  us = timing.cupti_time(bp, sets, 20).get("us")
  rows.append(dict(kind="bwd", impl="pallas", us=us, pct_copy=pct(us, 3)))
  dfltb = MB.backward_config(m, n, jnp.bfloat16, layer)
  for c in BWD if "bwd" in PASSES else []:
    def measure(row, c=c):
      cfg = _variant(dfltb, c, sms, 256)
      row["config"] = str(cfg) + (" (default)" if c is None else "")
      bm = jax.jit(lambda dy, x, mu, r: MB.norm_backward(dy, x, s, mu, r, config=cfg,
                                                         **bkw))
      got = jax.block_until_ready(bm(*sets[0]))
      row["max_abs_diff"] = [None if g is None else float(jnp.max(jnp.abs(
          g.astype(jnp.float32) - r.astype(jnp.float32)))) for g, r in zip(got, ref)]
      row["us"] = timing.cupti_time(bm, sets, 20).get("us")
      row["pct_copy"] = pct(row["us"], 3)
    _per_shape.record(rows, shape, dict(kind="bwd", impl="mosaic"), measure)
  return dict(device=CF.device_info().name, copy_gbs=copy, rows=rows)


def _line(op, m, n, row):
  return (f"{op:5s} {m}x{n} {row['kind']} {row['impl']:6s} "
          f"{row.get('us') or 0:8.1f} us {row.get('pct_copy') or 0:5.1f}% "
          f"{row.get('config', '')} {row.get('error', '')}")


if __name__ == "__main__":
  _per_shape.main(__file__, run_shape, SHAPES, _line, timeout=300)
