"""The FP8-x forward that writes mean/rstd (jax.vjp's forward) with the statistics
stored as [block_m] vectors (the library) or as [block_m, 1] tiles, against the same
kernel without them (docs/fp8_tuning.md#fp8-x-stats-store): multi_wave_cached whole-row
tiles, x float8_e4m3fn with float32 scales a group of 16, bf16 scale/bias, the forward
kernel alone (``kernels.forward.norm_forward``). Each variant compiled ahead of time with
``kernels.forward.STATS_2D`` set while it is traced (the experiment switch of b88e0b4,
removed in the next commit: run the script at b88e0b4); CUPTI kernel time, median of 10 calls over 3 rotated x, variants
interleaved in 5 rounds, the median; outputs checked bitwise equal between the two
stores. Usage (GPU): python benchmarks/fp8_stats_2d_ab.py OUT.json"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from pallas_norm import config as C
from pallas_norm.bench import timing

import _fp8_sweep as S
from pallas_norm.kernels import forward as F

CELLS = [(True, 4096, 16384, 16), (True, 4096, 16384, 8), (False, 4096, 16384, 8),
         (True, 8192, 4096, 8), (False, 8192, 4096, 8)]
rows = []
timing.warm_up()
for layer, m, n, warps in CELLS:
  xs8, s, w, _, _ = S.fp8x_inputs(m, n)
  cfg = C.ForwardConfig("multi_wave_cached", 1, n, warps)
  fns, outs = {}, {}
  for name, res, two_d in (("without", False, False), ("vector", True, False),
                           ("tile_2d", True, True)):
    F.STATS_2D = two_d
    try:
      f = jax.jit(lambda x, res=res: F.norm_forward(
          x, w, w if layer else None, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
          config=cfg, interpret=False, x_scale=s, y_dtype=jnp.bfloat16,
          return_residuals=res)).lower(xs8[0]).compile()
    finally:
      F.STATS_2D = False
    fns[name] = f
    outs[name] = [np.asarray(a) for a in jax.tree.leaves(f(xs8[0]))]
  equal = all(np.array_equal(a, b) for a, b in zip(outs["vector"], outs["tile_2d"]))
  res_t = S.interleaved_us(fns, [(x,) for x in xs8])
  cell = f"{'layer' if layer else 'rms'} {m}x{n} [1, {n}] x {warps}"
  for k, v in res_t.items():
    us = float(np.median(v))
    rows.append(dict(cell=cell, variant=k, us=us, rounds=v, equal=equal))
    print(f"{cell:32s} {k:8s} {us:7.1f} us  equal={equal} rounds={[round(t, 1) for t in v]}",
          flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
          open(sys.argv[1], "w"), indent=1)
