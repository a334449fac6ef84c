"""A/B of Fp8Config.one_pass_stats (LayerNorm's whole-row statistics as one joint
reduction of (sum x, sum x^2), with the two-pass variance again for rows where mean^2 >
var) in the FP8-output delayed and statistics kernels, at each kernel's default config:
data N(0, 1) (the one-pass path) and N(8, 1) (mean^2 > var in every row: the fallback),
8192x4096, 16384x4096, 8192x8192 and 32768x2048; also RMSNorm delayed at 8192x8192 with
one row block a program at 32 warps (tile_params). mean/rstd of each variant checked
against the default's first (rtol 1e-5). CUPTI kernel time, median of 10 calls over
inputs rotated over >= 256 MiB, 5 interleaved rounds; bf16 x, f32 scale/bias, e4m3fn.
Usage: python benchmarks/fp8_onepass_ab.py OUT.json (on the GPU machine)"""
import sys, json, dataclasses
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
timing.warm_up()
rows = []
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  data = {mu: [((mu + jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16)).astype(
      jnp.bfloat16),) for i in range(sets)] for mu in (0.0, 8.0)}
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  variants = {}
  for kernel in ("delayed", "stats"):
    d = K.fp8_config(m, n, kernel=kernel, subtract_mean=True)
    for tag, cfg in (("default", d), ("one_pass", dataclasses.replace(d, one_pass_stats=True))):
      if kernel == "delayed":
        f = jax.jit(lambda x, cfg=cfg: K.fp8_norm_delayed(
            x, s, b, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=True,
            fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[2:4])
        bpe = 3
      else:
        f = jax.jit(lambda x, cfg=cfg: K.fp8_stats(
            x, s, b, eps=1e-5, scale_offset=0.0, subtract_mean=True, interpret=False,
            config=cfg)[:2])
        bpe = 2
      for mu in (0.0, 8.0):
        variants[f"layer {kernel} {tag} mean={mu:g}"] = (f, data[mu], bpe, (kernel, mu))
  if (m, n) == (8192, 8192):
    for cfg in (K.fp8_config(m, n, kernel="delayed"), K.Fp8Config(1, 8192, 32, 0, True),
                K.Fp8Config(1, 8192, 16, 0, True)):
      f = jax.jit(lambda x, cfg=cfg: K.fp8_norm_delayed(
          x, s, None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=False,
          fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
      variants[f"rms delayed {cfg}"] = (f, data[0.0], 3, None)
  # checks: one_pass statistics against the default's
  for k, (f, xs, _, key) in variants.items():
    if key is None or "one_pass" not in k:
      continue
    ref = variants[k.replace("one_pass", "default")][0](*xs[0])
    got = f(*xs[0])
    for a, c in zip(got, ref):
      np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    print(f"{m}x{n} {k}: mean/rstd within 1e-5 of the default's", flush=True)
  res = {k: [] for k in variants}
  for r in range(5):
    for k, (f, xs, _, _) in variants.items():
      res[k].append(timing.time_us(f, xs, 10))
  for k, v in res.items():
    v = [t for t in v if t is not None]
    us = float(np.median(v))
    row = dict(shape=[m, n], variant=k, us=us, rounds=v,
               gbs=variants[k][2] * m * n / us / 1e3)
    rows.append(row)
    print(f"{m}x{n} {k:52s} {us:8.1f} us {row['gbs']:6.0f} GB/s "
          f"rounds={[round(t, 1) for t in v]}", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
            indent=1)
