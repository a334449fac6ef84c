"""The FP8-x forward (multi_wave_cached) that writes mean/rstd, after ncu showed what the
stores change (docs/fp8_tuning.md#fp8-x-stats-store): with them the compiler lays the
tile out so that scale/bias and y go through shared memory (ldmatrix/stmatrix). Two
switches of 59c4c3a, removed after e05a7b5 (run the script at 59c4c3a;
``kernels.forward.STATS_TILE``: mean/rstd
stored by masked stores of [block_m, block_n] tiles in the tile's own shape;
``PARAMS_2D``: scale/bias loaded as [1, block_n] rows), each alone and both, with and
without mean/rstd, against the library. x float8_e4m3fn with float32 scales a group of
16, bf16 scale/bias/y, the forward kernel alone (``kernels.forward.norm_forward``); each
variant compiled with its switches set while it is traced; CUPTI kernel time, median of
10 calls over 3 rotated x, variants interleaved in 5 rounds, the median; outputs checked
bitwise against the library's. Usage (GPU): python benchmarks/fp8_stats_tile_ab.py
OUT.json"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from pallas_norm import config as C
from pallas_norm.bench import timing

import _fp8_sweep as S
from pallas_norm.kernels import forward as F

CELLS = [(True, 4096, 16384, 16), (False, 4096, 16384, 8), (True, 8192, 4096, 8),
         (False, 8192, 4096, 8)]
VARIANTS = [("nores", False, False, False), ("nores params_2d", False, False, True),
            ("res", True, False, False), ("res stats_tile", True, True, False),
            ("res params_2d", True, False, True), ("res both", True, True, True)]
rows = []
timing.warm_up()
for layer, m, n, warps in CELLS:
  xs8, s, w, _, _ = S.fp8x_inputs(m, n)
  cfg = C.ForwardConfig("multi_wave_cached", 1, n, warps)
  fns, outs = {}, {}
  for name, res, st, p2 in VARIANTS:
    F.STATS_TILE, F.PARAMS_2D = st, p2
    try:
      f = jax.jit(lambda x, res=res: F.norm_forward(
          x, w, w if layer else None, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
          config=cfg, interpret=False, x_scale=s, y_dtype=jnp.bfloat16,
          return_residuals=res)).lower(xs8[0]).compile()
    finally:
      F.STATS_TILE = F.PARAMS_2D = False
    fns[name] = f
    outs[name] = [np.asarray(a).tobytes() for a in jax.tree.leaves(f(xs8[0]))]
  res_t = S.interleaved_us(fns, [(x,) for x in xs8])
  cell = f"{'layer' if layer else 'rms'} {m}x{n} [1, {n}] x {warps}"
  for k, v in res_t.items():
    ref = outs["res" if k.startswith("res") else "nores"]
    us = float(np.median(v))
    rows.append(dict(cell=cell, variant=k, us=us, rounds=v, equal=outs[k] == ref))
    print(f"{cell:32s} {k:16s} {us:7.1f} us equal={outs[k] == ref} "
          f"rounds={[round(t, 1) for t in v]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
          open(sys.argv[1], "w"), indent=1)
