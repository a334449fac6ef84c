"""A/B of the FP8-output delayed kernel: the hardware's saturating FP8 cast (HW_SATURATE,
kernels/fp8.py) against the explicit clip, default configs, rounds interleaved. CUPTI
kernel time, median of 10 calls over inputs rotated over >= 256 MiB, 5 rounds; bf16 x,
f32 scale/bias, e4m3fn. Also LayerNorm 8192x8192 candidates. Usage: python benchmarks/fp8_ab.py OUT.json (on the GPU machine)"""
import os, sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
import pallas_norm
out = sys.argv[1]
timing.warm_up()
C = K.Fp8Config
rows = []
def mk(sm, transpose, cfg=None):
  return jax.jit(lambda x, s, b: K.fp8_norm_delayed(
      x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
      fp8_dtype=jnp.float8_e4m3fn, transpose=transpose, interpret=False, config=cfg)[:2])
def mkcur(sm):
  f = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
  return jax.jit(lambda x, s, b: f(x, s, b)[0] if sm else f(x, s)[0])
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),
         1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)),
         0.1 * jax.random.normal(jax.random.key(8), (n,))) for i in range(sets)]
  for op in ("rms", "layer"):
    sm = op == "layer"
    variants = {}
    for hw in (True, False):
      K.HW_SATURATE = hw
      variants[f"delayed hw={int(hw)}"] = (mk(sm, False), 3)
      variants[f"delayed_t hw={int(hw)}"] = (mk(sm, True), 4)
      variants[f"current hw={int(hw)}"] = (mkcur(sm), 3)
      for a in xs[:1]:
        for f, _ in list(variants.values())[-3:]:
          jax.block_until_ready(f(*a))
    K.HW_SATURATE = True
    if (m, n) == (8192, 8192) and sm:
      for cfg in (C(2, 8192, 8, 264, True, True), C(1, 8192, 8, 528, True, True),
                  C(2, 8192, 16, 132, True, True), C(1, 1024, 8)):
        variants[f"delayed cfg {cfg}"] = (mk(sm, False, cfg), 3)
        jax.block_until_ready(variants[f"delayed cfg {cfg}"][0](*xs[0]))
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
      print(f"{m}x{n} {op:5s} {k:60s} {us:8.1f} us {row['gbs']:6.0f} GB/s", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"), indent=1)
