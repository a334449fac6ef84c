"""FP8-output delayed kernel (no y_t), sweep 3: one-block-a-program multi-row tiles and
persistent programs with more rows a block (scale loaded once a block of rows), at
8192x4096 / 16384x4096 / 8192x8192, RMS and LayerNorm. CUPTI kernel time, median of 10
calls over inputs rotated over >= 256 MiB; bf16 x, f32 scale/bias; e4m3fn.
Usage: python benchmarks/fp8_sweep3.py OUT.json BUDGET_S (on the GPU machine)"""
import os, sys, time, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
timing.warm_up()
SMS = device_info().num_sms
C = K.Fp8Config
rows = []
def cands(n):
  c = []
  for bm, w in ((1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32), (16, 32)):
    if bm * n <= 65536:
      c += [C(bm, n, w), C(bm, n, w, tile_params=True)]
  for bm, w, k in ((2, 8, 2), (4, 16, 1), (2, 16, 1), (4, 8, 2), (1, 4, 8), (1, 8, 4)):
    if bm * n <= 32768:
      c += [C(bm, n, w, SMS * k, True, True), C(bm, n, w, SMS * k, True, False)]
  return c
groups = []
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm)
    cs = [d] + [c for c in cands(n) if c != d]
    mk = lambda cfg, s=s, b=b, sm=sm: jax.jit(lambda x: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg))
    groups.append((f"{op} {m}x{n}", cs, mk, m * n * 3, xs, d))
for r in range(max(len(g[1]) for g in groups)):
  for tag, cs, mk, nb, xs, d in groups:
    if time.time() - T0 > BUDGET or r >= len(cs):
      continue
    cfg = cs[r]
    try:
      us = timing.time_us(mk(cfg), xs, 10)
    except Exception as e:
      print(tag, cfg, "ERR", str(e)[:150], flush=True); continue
    if us is None:
      continue
    rows.append(dict(tag=tag, config=str(cfg), default=cfg == d, us=us, gbs=nb / us / 1e3))
    print(f"{tag:16s} {'D' if cfg == d else ' '} bm={cfg.block_m:2d} w={cfg.num_warps:2d} "
          f"G={cfg.num_programs:4d} tp={int(cfg.tile_params)} h={int(cfg.hoist_params)} "
          f"{us:7.1f}us {nb/us/1e3:6.0f}GB/s", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, num_sms=SMS, rows=rows, note=__doc__),
            open(out, "w"), indent=1)
best = {}
for r in rows:
  if r["tag"] not in best or r["us"] < best[r["tag"]]["us"]:
    best[r["tag"]] = r
for t, r in best.items():
  dflt = [x["us"] for x in rows if x["tag"] == t and x["default"]]
  print("BEST", t, r["config"], f"{r['us']:.1f}us", "default", dflt)
