"""A/B of ``kernels.fp8.atomic_amax`` (the persistent FP8-output programs' amax folded by
an integer atomic max into a zeroed [1] output that XLA writes before the kernel, against
[G] partials and XLA's max after it) by two clocks, over the public ops
(`rms_norm_fp8` / `layer_norm_fp8`, delayed scaling at y_scale 8 / 448 and current
scaling, bf16 x and scale/bias, e4m3fn):
- the CUPTI kernel time that the kernel bench and ``fp8_flag_ab.py`` report, with the
  kernels' names: it counts kernels only, so a memset that XLA may emit for the zeros
  is not in it;
- the wall clock of 200 back-to-back calls over rotated inputs, per call: the GPU runs
  them in order and the host enqueues faster than they run, so it counts the gaps
  between the kernels and any memset too.
Each variant is traced after ``jax.clear_caches()`` and compiled ahead of time (the
public ops' jits would keep their first trace: docs/fp8_tuning.md#fp8-stale-trace);
outputs checked bitwise equal; 5 interleaved rounds, medians.
Usage: python benchmarks/fp8_atomic_amax_wall_ab.py OUT.json [SHAPES [OPS]] (GPU)"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
SHAPES = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
          "8192x4096,16384x4096").split(",")]
OPS = (sys.argv[3] if len(sys.argv) > 3 else
       "layer_delayed,rms_delayed,layer_current").split(",")
CALLS = int(__import__("os").environ.get("CALLS", 200))
timing.warm_up()
rule = K.atomic_amax
rows = []


def wall_us(f, xs):
  jax.block_until_ready(f(*xs[0]))
  t0 = time.perf_counter()
  for i in range(CALLS):
    r = f(*xs[i % len(xs)])
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / CALLS * 1e6


for m, n in SHAPES:
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for name in OPS:
    op, scaling = name.split("_")
    ys = jnp.float32(8.0 / 448.0) if scaling == "delayed" else None
    fns = {}
    for v in (False, True):
      K.atomic_amax = lambda interpret=False, v=v: v and not interpret
      jax.clear_caches()
      if op == "rms":
        f = jax.jit(lambda x: tuple(pallas_norm.rms_norm_fp8(x, s, y_scale=ys)))
      else:
        f = jax.jit(lambda x: tuple(pallas_norm.layer_norm_fp8(x, s, b, y_scale=ys)))
      fns[v] = f.lower(*xs[0]).compile()
    K.atomic_amax = rule
    jax.clear_caches()
    raw = lambda outs: [np.asarray(a).tobytes() for a in outs if a is not None]
    eq = raw(fns[True](*xs[0])) == raw(fns[False](*xs[0]))
    res = {v: dict(cupti=[], wall=[]) for v in fns}
    kernels = {}
    for _ in range(5):
      for v, f in fns.items():
        c = timing.cupti_time(f, xs, 10)
        kernels[v] = list(zip(c.get("kernels", []), c.get("kernel_us", [])))
        res[v]["cupti"].append(c.get("us"))
        res[v]["wall"].append(wall_us(f, xs))
    for v, r in res.items():
      row = dict(op=name, shape=f"{m}x{n}", atomic=v, equal=eq,
                 cupti_us=float(np.median(r["cupti"])), wall_us=float(np.median(r["wall"])),
                 rounds=r, kernels=kernels[v])
      rows.append(row)
      print(f"{name:14s} {m}x{n:<6d} atomic={v!s:5s} CUPTI {row['cupti_us']:6.1f} us  wall "
            f"{row['wall_us']:6.1f} us  equal={eq}  kernels "
            f"{[(k[:28], round(t, 1)) for k, t in kernels[v]]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, calls=CALLS, rows=rows, note=__doc__),
          open(out, "w"), indent=1)
