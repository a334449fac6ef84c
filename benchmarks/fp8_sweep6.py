"""FP8-output delayed kernel (no y_t), sweep 6: one row block a program with scale/bias
loaded in the tile's layout (tile_params; sweep 5 had one-block tiles without it only),
1-4 rows, 4-16 warps, against the default, at 8192x4096, 16384x4096, 32768x2048 and
8192x8192, RMSNorm and LayerNorm; also the statistics kernel (current scaling's pass 1)
the same way. CUPTI kernel time, median of 10 calls over inputs rotated over
>= 256 MiB, rounds interleaved (3; the default config timed in each); bf16 x, f32
scale/bias, e4m3fn. Usage: python benchmarks/fp8_sweep6.py OUT.json BUDGET_S (GPU)."""
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
P = lambda bm, n, w, k, h: C(bm, n, w, SMS * k, True, bool(h))
ONE_BLOCK = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (2, 16), (4, 16), (1, 16)]  # (bm, warps)
rows = []
groups = []
for m, n in ((8192, 4096), (16384, 4096), (32768, 2048), (8192, 8192)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  for op in ("rms", "layer"):
    sm = op == "layer"
    for kernel in ("delayed", "stats"):
      d = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm)
      cs = [C(bm, n, w, 0, True) for bm, w in ONE_BLOCK if bm * n <= 32768]
      cs = [d] + [c for c in cs if c != d]
      if kernel == "delayed":
        fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
            x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
            fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
               for cfg in cs]
        nb = m * n * 3
      else:
        fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_stats(
            x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
            interpret=False, config=cfg)[1]) for cfg in cs]
        nb = m * n * 2
      groups.append((f"{op} {kernel} {m}x{n}", cs, fns, nb, xs, d))
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
  print(f"{tag:24s} {'D' if cfg == g[5] else ' '} bm={cfg.block_m:2d} w={cfg.num_warps:2d} "
        f"G={cfg.num_programs:4d} tp={int(cfg.tile_params)} h={int(cfg.hoist_params)} "
        f"{us:7.1f}us {g[3]/us/1e3:6.0f}GB/s rounds={[round(u, 1) for u in v]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, num_sms=SMS, rows=rows, note=__doc__),
          open(out, "w"), indent=1)
best = {}
for r in rows:
  if r["tag"] not in best or r["us"] < best[r["tag"]]["us"]:
    best[r["tag"]] = r
for t, r in best.items():
  dflt = [x["us"] for x in rows if x["tag"] == t and x["default"]]
  print("BEST", t, r["config"], f"{r['us']:.1f}us", "default", dflt)
