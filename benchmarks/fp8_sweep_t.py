"""FP8-output delayed kernel with y_t (the transposed copy), config sweep on the device it
runs on (written for the H100; the picks, _T_* in kernels/fp8.py, are the H200's): row
blocks of 32 or 64 rows walked in 64- to 256-wide chunks, 4-16 warps, 1-4 persistent
programs a SM, scale/bias in the tile's layout; RMSNorm and LayerNorm at 8192x4096,
16384x4096, 8192x8192 and 32768x2048. CUPTI kernel time, median of 10 calls over inputs
rotated over >= 256 MiB, rounds interleaved (3; the default config timed in each); bf16
x, f32 scale/bias, e4m3fn; GB/s on the bytes model (read 2, write 1 + 1).
Usage: python benchmarks/fp8_sweep_t.py OUT.json BUDGET_S (GPU)."""
import os, sys, time, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
timing.warm_up()
SMS = device_info().num_sms
C = K.Fp8Config
# (block_m, block_n, num_warps, programs a SM)
CANDS = [(32, 128, 16, 1), (32, 128, 16, 2), (32, 128, 16, 3), (32, 128, 16, 4),
         (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 4), (32, 256, 16, 1),
         (32, 256, 16, 2), (32, 256, 8, 2), (32, 64, 8, 2), (32, 64, 8, 4), (32, 64, 4, 4),
         (64, 128, 16, 1), (64, 128, 16, 2), (64, 64, 8, 2), (64, 64, 16, 2)]
rows, groups = [], []
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm, transpose=True)
    cs = [d] + [c for c in (C(bm, bn, w, SMS * k, True) for bm, bn, w, k in CANDS) if c != d]
    fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=True, interpret=False, config=cfg)[:2])
           for cfg in cs]
    groups.append((f"{op} {m}x{n}", cs, fns, m * n * 4, xs, d))
res = {}
for r in range(3):
  for tag, cs, fns, nb, xs, d in groups:
    for cfg, f in zip(cs, fns):
      if time.time() - T0 > BUDGET:
        break
      try:
        us = timing.time_us(f, xs, 10)
      except Exception as e:
        print(tag, cfg, "ERR", str(e)[:150], flush=True); us = None
      res.setdefault((tag, cfg), []).append(us)
  print(f"round {r} done at {time.time() - T0:.0f}s", flush=True)
for (tag, cfg), v in res.items():
  v = [u for u in v if u is not None]
  if not v:
    continue
  g = [x for x in groups if x[0] == tag][0]
  us = float(np.median(v))
  rows.append(dict(tag=tag, config=str(cfg), default=cfg == g[5], us=us, rounds=v,
                   gbs=g[3] / us / 1e3))
  print(f"{tag:16s} {'D' if cfg == g[5] else ' '} bm={cfg.block_m:2d} bn={cfg.block_n:3d} "
        f"w={cfg.num_warps:2d} k={cfg.num_programs // SMS} {us:7.1f}us {g[3]/us/1e3:6.0f}GB/s",
        flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, num_sms=SMS, rows=rows, note=__doc__,
               elapsed_s=time.time() - T0), open(out, "w"), indent=1)
best = {}
for r in rows:
  if r["tag"] not in best or r["us"] < best[r["tag"]]["us"]:
    best[r["tag"]] = r
for t, r in best.items():
  dflt = [x["us"] for x in rows if x["tag"] == t and x["default"]]
  print("BEST", t, r["config"], f"{r['us']:.1f}us", "default", dflt)
