"""A/B of a boolean module flag of ``pallas_norm.kernels.fp8`` (an experiment's switch,
read at trace time) over the public FP8-output ops: `rms_norm_fp8` / `layer_norm_fp8`,
delayed scaling (y_scale 8 / 448, the kernel bench's) and current scaling, with and
without y_t, bf16 x and scale/bias, e4m3fn. Each variant is traced after
`jax.clear_caches()` and compiled ahead of time, and the compiled executables are timed:
the public ops sit behind jits made at import, whose first trace a new outer jit would
reuse, so a flag flipped between variants would otherwise never be read
(docs/fp8_tuning.md#fp8-stale-trace). The HLOs of the two variants are compared (the
cells where they are one program are reported, and not timed) and every output is
checked bitwise equal. CUPTI kernel time of all of a call's kernels, median of 10 calls
over x rotated over >= 256 MiB, 5 interleaved rounds; % of copy on the bytes model (read
2, write 1, + 1 with y_t; the op's small outputs not counted), copy measured here.
Usage: python benchmarks/fp8_flag_ab.py FLAG OUT.json [SHAPES [OPS]] (GPU; OPS e.g.
"rms_delayed,rms_current_t"; INTERPRET=1: the checks alone, on CPU)"""
import hashlib, json, os, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.kernels import fp8 as K
flag, out = sys.argv[1], sys.argv[2]
assert isinstance(getattr(K, flag), bool), f"kernels.fp8.{flag} is not a bool flag"
CPU = os.environ.get("INTERPRET") == "1"
SHAPES = [tuple(map(int, s.split("x"))) for s in (sys.argv[3] if len(sys.argv) > 3 else
          "8192x4096,16384x4096,8192x8192,32768x2048,4096x8192").split(",")]
OPS = (sys.argv[4].split(",") if len(sys.argv) > 4 else
       [f"{o}_{s}{t}" for o in ("rms", "layer") for s in ("delayed", "current")
        for t in ("", "_t")])
if not CPU:
  from pallas_norm.bench import timing
  timing.warm_up()
  copy = timing.measure_copy(jnp.bfloat16, 20).get("copy_gbs")
  print(f"copy {copy:.0f} GB/s", flush=True)
default = getattr(K, flag)
rows = []
for m, n in SHAPES:
  sets = 1 if CPU else max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for name in OPS:
    op, scaling, *t = name.split("_")
    t = bool(t)
    ys = jnp.float32(8.0 / 448.0) if scaling == "delayed" else None
    fns, hlo = {}, {}
    for v in (False, True):
      setattr(K, flag, v)
      jax.clear_caches()
      if op == "rms":
        f = jax.jit(lambda x: tuple(pallas_norm.rms_norm_fp8(x, s, y_scale=ys, transpose=t)))
      else:
        f = jax.jit(lambda x: tuple(pallas_norm.layer_norm_fp8(x, s, b, y_scale=ys,
                                                               transpose=t)))
      lowered = f.lower(*xs[0])
      hlo[v] = hashlib.md5(lowered.as_text().encode()).hexdigest()[:8]
      fns[v] = lowered.compile()
    setattr(K, flag, default)
    jax.clear_caches()
    raw = lambda outs: [np.asarray(a).tobytes() for a in outs if a is not None]
    ref = raw(fns[False](*xs[0]))
    eq = raw(fns[True](*xs[0])) == ref
    same = hlo[False] == hlo[True]
    print(f"{name} {m}x{n}: HLO {hlo} ({'one program' if same else 'distinct'}), outputs "
          f"equal {eq}", flush=True)
    if CPU or same:
      continue
    res = {v: [] for v in fns}
    for _ in range(5):
      for v, f in fns.items():
        res[v].append(timing.time_us(f, xs, 10))
    nbytes = (4 if t else 3) * m * n
    for v, r in res.items():
      us = float(np.median(r))
      rows.append(dict(op=name, shape=f"{m}x{n}", flag=v, us=us, rounds=r, equal=eq,
                       gbs=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / copy))
      print(f"{name:18s} {m}x{n:<6d} {flag}={v!s:5s} {us:7.1f} us "
            f"{100 * nbytes / us / 1e3 / copy:5.1f}% rounds={[round(u, 1) for u in r]}",
            flush=True)
if not CPU:
  json.dump(dict(device=jax.devices()[0].device_kind, flag=flag, copy_gbs=copy, rows=rows,
                 note=__doc__), open(out, "w"), indent=1)
