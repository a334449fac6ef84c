"""The transposed FP8 copy (delayed scaling, ``transpose=True``): three designs, rounds
interleaved (5). (a) the fused kernel (y and y_t stored from the same registers, 32-row
blocks walked twice; the default); (b) the one-pass kernel without y_t, then XLA's
transpose of the FP8 y under the same jit; (c) the statistics kernel, then the quantise
pass with y_t (current scaling's two kernels, with the given scale). RMSNorm and
LayerNorm at 8192x4096, 16384x4096, 8192x8192, 32768x2048; bf16 x and scale/bias,
e4m3fn. CUPTI kernel time of all of a call's kernels, median of 10 calls over inputs
rotated over >= 256 MiB; y and y_t checked bitwise equal to (a)'s first; GB/s on the
bytes model read 2, write 1 + 1. Usage: python benchmarks/fp8_yt_design_ab.py OUT.json
(GPU)"""
import sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
timing.warm_up()
rows = []
E4 = jnp.float8_e4m3fn
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for op in ("rms", "layer"):
    sm = op == "layer"
    bb = b if sm else None
    kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=sm, interpret=False)
    fused = jax.jit(lambda x: K.fp8_norm_delayed(x, s, bb, 100.0, fp8_dtype=E4, transpose=True,
                                                 **kw)[:2])
    def xla_t(x):
      y = K.fp8_norm_delayed(x, s, bb, 100.0, fp8_dtype=E4, transpose=False, **kw)[0]
      return y, y.T
    def two(x):
      mean, rstd, _ = K.fp8_stats(x, s, bb, **kw)
      y, y_t, _ = K.fp8_quantise(x, s, bb, mean if sm else None, rstd, jnp.float32(100.0),
                                 scale_offset=0.0, subtract_mean=sm, fp8_dtype=E4,
                                 transpose=True, interpret=False, return_amax=True)
      return y, y_t
    fns = {"fused": fused, "delayed+xla_transpose": jax.jit(xla_t),
           "stats+quantise_t": jax.jit(two)}
    ref = [np.asarray(a).view(np.uint8) for a in fns["fused"](*xs[0])]
    eq = {k: all(np.array_equal(np.asarray(a).view(np.uint8), r) for a, r in zip(f(*xs[0]), ref))
          for k, f in fns.items()}
    res = {k: [] for k in fns}
    for _ in range(5):
      for k, f in fns.items():
        res[k].append(timing.time_us(f, xs, 10))
    for k, v in res.items():
      us = float(np.median(v))
      rows.append(dict(op=op, shape=f"{m}x{n}", design=k, us=us, rounds=v, equal=eq[k],
                       gbs=4 * m * n / us / 1e3))
      print(f"{op:5s} {m}x{n:<6d} {k:24s} {us:7.1f} us {4 * m * n / us / 1e3:6.0f} GB/s "
            f"equal={eq[k]} rounds={[round(t, 1) for t in v]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
          indent=1)
