"""What the FP8-output kernels' mean/rstd stores cost: delayed scaling and the current
scaling's statistics kernel at the library's configs (``fp8_config``), with the stores
(the library) and without (``kernels.fp8._NO_ROW_STATS``, the experiment switch of d00d918,
removed in the next commit: mean/rstd left unwritten, wrong as outputs, timing only),
RMSNorm and LayerNorm, bf16 x and scale/bias, e4m3fn, the kernel alone. CUPTI kernel
time, median of 10 calls over inputs rotated past 256 MiB, variants interleaved in 5
rounds, the median; y checked bitwise equal. Usage (GPU): python
benchmarks/fp8_row_stats_cost_ab.py OUT.json"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from pallas_norm.bench import timing

import _fp8_sweep as S
from pallas_norm.kernels import fp8 as K

E4 = jnp.float8_e4m3fn
rows = []
timing.warm_up()
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for kern in ("delayed", "stats"):
    for layer in (True, False):
      bb = b if layer else None
      fns, ys = {}, {}
      for off in (False, True):
        K._NO_ROW_STATS = off
        try:
          if kern == "delayed":
            f = jax.jit(lambda x: K.fp8_norm_delayed(
                x, s, bb, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
                fp8_dtype=E4, transpose=False, interpret=False)).lower(xs[0][0]).compile()
          else:
            f = jax.jit(lambda x: K.fp8_stats(
                x, s, bb, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
                interpret=False)).lower(xs[0][0]).compile()
        finally:
          K._NO_ROW_STATS = False
        name = "no stores" if off else "library"
        fns[name] = f
        ys[name] = np.asarray(f(xs[0][0])[0]).tobytes()
      res = S.interleaved_us(fns, xs)
      cell = f"{kern} {'layer' if layer else 'rms'} {m}x{n}"
      for k, v in res.items():
        us = float(np.median(v))
        eq = ys[k] == ys["library"] if kern == "delayed" else None
        rows.append(dict(cell=cell, variant=k, us=us, rounds=v, y_equal=eq))
        print(f"{cell:28s} {k:10s} {us:7.1f} us y_equal={eq} "
              f"rounds={[round(t, 1) for t in v]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
          open(sys.argv[1], "w"), indent=1)
