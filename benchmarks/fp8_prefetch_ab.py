"""A/B of Fp8Config.prefetch_depth (the persistent whole-row FP8-output delayed kernel with
the next two row blocks' x in flight instead of one), against each shape's default config,
rounds interleaved (5), outputs checked bitwise equal to the default's first. RMSNorm and
LayerNorm at 8192x4096, 16384x4096, 8192x8192 and 32768x2048. CUPTI kernel time, median
of 10 calls over inputs rotated over >= 256 MiB; bf16 x, f32 scale/bias, e4m3fn.
Usage: python benchmarks/fp8_prefetch_ab.py OUT.json (on the GPU machine)"""
import dataclasses, sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
timing.warm_up()
SMS = device_info().num_sms
C = K.Fp8Config
# extra (block_m, num_warps, programs a SM, hoist_params) tiles run at depth 2, by (op, N)
EXTRA = {("layer", 4096): [(1, 16, 2, True)], ("rms", 4096): [(1, 16, 2, False)],
         ("rms", 8192): [(2, 16, 1, True)], ("layer", 8192): [(1, 16, 1, True)]}
rows = []
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm)
    cfgs = [d]
    if d.num_programs:
      cfgs.append(dataclasses.replace(d, prefetch_depth=2))
    cfgs += [C(bm, n, w, SMS * k, True, h, 2) for bm, w, k, h in EXTRA.get((op, n), [])]
    fns = [jax.jit(lambda x, cfg=cfg, sm=sm: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg))
           for cfg in cfgs]
    ref = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(fns[0](*xs[0]))]
    for cfg, f in zip(cfgs[1:], fns[1:]):
      got = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(f(*xs[0]))]
      same = all(np.array_equal(u, v) for u, v in zip(got[:3], ref[:3]))  # y, mean, rstd
      print(f"{m}x{n} {op} {cfg}: y/mean/rstd bitwise equal to the default's: {same}",
            flush=True)
    res = {i: [] for i in range(len(cfgs))}
    for r in range(5):
      for i, f in enumerate(fns):
        res[i].append(timing.time_us(f, xs, 10))
    for i, cfg in enumerate(cfgs):
      v = [t for t in res[i] if t is not None]
      us = float(np.median(v))
      row = dict(shape=[m, n], op=op, config=str(cfg), default=i == 0, us=us, rounds=v,
                 gbs=3 * m * n / us / 1e3)
      rows.append(row)
      print(f"{m}x{n} {op:5s} {'D' if i == 0 else ' '} bm={cfg.block_m} w={cfg.num_warps:2d} "
            f"G={cfg.num_programs:4d} h={int(cfg.hoist_params)} depth={cfg.prefetch_depth} "
            f"{us:7.1f} us {row['gbs']:6.0f} GB/s rounds={[round(t, 1) for t in v]}",
            flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
            indent=1)
