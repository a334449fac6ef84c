"""A/B of the FP8-output kernels' running amax: float32 |y| folded with PTX max.NaN.f32
(HW_AMAX, kernels/fp8.py: one FMNMX.NAN an element) against the int32 bits of |y| and an
integer max (an AND and a max an element), default configs, rounds interleaved (5).
Delayed scaling with and without y_t, and current scaling (statistics + quantise), RMSNorm
and LayerNorm, at 8192x4096, 16384x4096, 8192x8192 and 32768x2048. CUPTI kernel time,
median of 10 calls over inputs rotated over >= 256 MiB; bf16 x, f32 scale/bias, e4m3fn.
Each variant's outputs are checked equal to the other's first (y and amax bitwise).
Usage: python benchmarks/fp8_amax_ab.py OUT.json (on the GPU machine)"""
import sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
import pallas_norm
out = sys.argv[1]
timing.warm_up()
rows = []
def mk(sm, transpose):
  return jax.jit(lambda x, s, b: K.fp8_norm_delayed(
      x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
      fp8_dtype=jnp.float8_e4m3fn, transpose=transpose, interpret=False))
def mkcur(sm):
  f = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
  return jax.jit(lambda x, s, b: (lambda r: (r.y, r.amax))(f(x, s, b) if sm else f(x, s)))
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),
         1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)),
         0.1 * jax.random.normal(jax.random.key(8), (n,))) for i in range(sets)]
  for op in ("rms", "layer"):
    sm = op == "layer"
    variants, outs = {}, {}
    for hw in (True, False):
      K.HW_AMAX = hw
      for name, f, bpe in ((f"delayed amax={'f32' if hw else 'bits'}", mk(sm, False), 3),
                           (f"delayed_t amax={'f32' if hw else 'bits'}", mk(sm, True), 4),
                           (f"current amax={'f32' if hw else 'bits'}", mkcur(sm), 3)):
        outs[name] = jax.block_until_ready(f(*xs[0]))  # traced now, with this HW_AMAX
        variants[name] = (f, bpe)
    K.HW_AMAX = True
    for kind in ("delayed", "delayed_t", "current"):
      a, b = outs[f"{kind} amax=f32"], outs[f"{kind} amax=bits"]
      same = all(bool(jnp.array_equal(u.view(jnp.uint8) if u.dtype.itemsize == 1 else u,
                                      v.view(jnp.uint8) if v.dtype.itemsize == 1 else v))
                 for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
      print(f"{m}x{n} {op} {kind}: f32 and bits outputs bitwise equal: {same}", flush=True)
      if not same:
        raise SystemExit("outputs differ")
    res = {k: [] for k in variants}
    for r in range(5):
      for k, (f, _) in variants.items():
        res[k].append(timing.cupti_time(f, xs, 10).get("us"))
    for k, v in res.items():
      v = [t for t in v if t is not None]
      us = float(np.median(v)) if v else None
      bpe = variants[k][1]
      row = dict(shape=[m, n], op=op, variant=k, us=us, rounds=v,
                 gbs=None if us is None else bpe * m * n / us / 1e3)
      rows.append(row)
      print(f"{m}x{n} {op:5s} {k:24s} {us:8.1f} us {row['gbs']:6.0f} GB/s "
            f"rounds={[round(t, 1) for t in v]}", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
            indent=1)
