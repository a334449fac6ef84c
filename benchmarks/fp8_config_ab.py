"""A/B of FP8-output row-block kernel configs against the default, rounds interleaved (5):
each SPEC is "op:MxN:kernel:cfg|cfg|..." with op rms or layer, kernel delayed or stats,
and each cfg the arguments of kernels.fp8.Fp8Config as a Python tuple, e.g.
"layer:8192x4096:delayed:(1,4096,8,396,True,False)". The default config is timed in each
round too; y (delayed), mean and rstd are checked bitwise equal to the default's first.
CUPTI kernel time, median of 10 calls over inputs rotated over >= 256 MiB; bf16 x, f32
scale/bias, e4m3fn. Usage: python benchmarks/fp8_config_ab.py OUT.json SPEC [SPEC ...]
(on the GPU machine)"""
import ast, sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
out, specs = sys.argv[1], sys.argv[2:]
timing.warm_up()
rows = []
for spec in specs:
  op, shape, kernel, cfgs = spec.split(":", 3)
  m, n = map(int, shape.split("x"))
  sm = op == "layer"
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
  d = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm)
  cands = [d] + [K.Fp8Config(*ast.literal_eval(c)) for c in cfgs.split("|")]
  if kernel == "delayed":
    mk = lambda cfg: jax.jit(lambda x: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[:4])
    nb = 3 * m * n
  else:
    mk = lambda cfg: jax.jit(lambda x: K.fp8_stats(
        x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        interpret=False, config=cfg)[:2])
    nb = 2 * m * n
  fns = [mk(c) for c in cands]
  ref = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(fns[0](*xs[0]))]
  for c, f in zip(cands[1:], fns[1:]):
    got = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(f(*xs[0]))]
    print(f"{spec.split(':')[0]} {shape} {kernel} {c}: outputs bitwise equal to the "
          f"default's: {all(np.array_equal(u, v) for u, v in zip(got, ref))}", flush=True)
  res = {i: [] for i in range(len(cands))}
  for r in range(5):
    for i, f in enumerate(fns):
      res[i].append(timing.time_us(f, xs, 10))
  for i, c in enumerate(cands):
    v = [t for t in res[i] if t is not None]
    us = float(np.median(v))
    rows.append(dict(spec=spec, config=str(c), default=i == 0, us=us, rounds=v,
                     gbs=nb / us / 1e3))
    print(f"{op:5s} {shape:10s} {kernel:7s} {'D' if i == 0 else ' '} {c} {us:7.1f} us "
          f"{nb / us / 1e3:6.0f} GB/s rounds={[round(t, 1) for t in v]}", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
            indent=1)
