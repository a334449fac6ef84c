"""Delayed scaling (FP8 output) with the persistent row-block kernels walking their row
blocks from the last one up (``kernels.fp8._ROWS_BOTTOM_UP``, an experiment) against the
library's top-down walk. With y_t on the H100, y_t is XLA's transpose of y
(``transpose_separately``) and reads y right after the kernel wrote it: rows written last
may still be in L2 (50 MB), so the order in which the kernel leaves them can decide how
much of that read hits L2. Without y_t the walk should change nothing (a check). The whole
public op (`rms_norm_fp8` / `layer_norm_fp8` with y_scale 8 / 448, the bench's), bf16 x
and scale/bias, e4m3fn; each variant traced after `jax.clear_caches()` and compiled ahead
of time (the public ops' jits keep their first trace), the HLOs checked distinct, outputs
checked bitwise equal; CUPTI kernel time of all of a call's kernels, median of 10 calls
over x rotated over >= 256 MiB, 5 interleaved rounds; % of copy on the bytes model (read
2, write 1, + 1 with y_t), copy measured here.
Usage: python benchmarks/fp8_rows_order_ab.py OUT.json [SHAPES] (GPU; INTERPRET=1: the
checks alone, on CPU)"""
import hashlib, json, os, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
CPU = os.environ.get("INTERPRET") == "1"
SHAPES = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
          "8192x4096,16384x4096,8192x8192,32768x2048,4096x8192").split(",")]
VARIANTS = {"top_down": False, "bottom_up": True}
if not CPU:
  from pallas_norm.bench import timing
  timing.warm_up()
  copy = timing.measure_copy(jnp.bfloat16, 20).get("copy_gbs")
  print(f"copy {copy:.0f} GB/s", flush=True)
rows = []
ys = jnp.float32(8.0 / 448.0)
for m, n in SHAPES:
  sets = 1 if CPU else max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for op in ("rms", "layer"):
    for t in (False, True):
      fns, hlo = {}, {}
      for name, flag in VARIANTS.items():
        K._ROWS_BOTTOM_UP = flag
        jax.clear_caches()
        if op == "rms":
          f = jax.jit(lambda x, t=t: tuple(pallas_norm.rms_norm_fp8(x, s, y_scale=ys,
                                                                     transpose=t))[:4])
        else:
          f = jax.jit(lambda x, t=t: tuple(pallas_norm.layer_norm_fp8(x, s, b, y_scale=ys,
                                                                       transpose=t))[:4])
        lowered = f.lower(*xs[0])
        hlo[name] = hashlib.md5(lowered.as_text().encode()).hexdigest()[:8]
        fns[name] = lowered.compile()
      K._ROWS_BOTTOM_UP = False
      jax.clear_caches()
      raw = lambda outs: [np.asarray(a).tobytes() for a in outs if a is not None]
      ref = raw(fns["top_down"](*xs[0]))
      eq = {k: raw(f(*xs[0])) == ref for k, f in fns.items()}
      distinct = len(set(hlo.values()))
      print(f"{op} {m}x{n} t={int(t)}: HLO {hlo}, equal {eq}", flush=True)
      if CPU:  # interpret mode: the persistent kernels only where the config is one
        continue
      assert distinct == len(VARIANTS) or not K.fp8_config(
          m, n, kernel="delayed", subtract_mean=op == "layer",
          param_dtype=jnp.bfloat16).num_programs, "the variants compiled to one program"
      res = {k: [] for k in fns}
      for _ in range(5):
        for k, f in fns.items():
          res[k].append(timing.time_us(f, xs, 10))
      nbytes = (4 if t else 3) * m * n
      for k, v in res.items():
        us = float(np.median(v))
        rows.append(dict(op=op, shape=f"{m}x{n}", transpose=t, variant=k, us=us, rounds=v,
                         equal=eq[k], hlo=hlo[k], gbs=nbytes / us / 1e3,
                         pct_copy=100 * nbytes / us / 1e3 / copy))
        print(f"{op:5s} {m}x{n:<6d} t={int(t)} {k:9s} {us:7.1f} us {nbytes / us / 1e3:6.0f} "
              f"GB/s {100 * nbytes / us / 1e3 / copy:5.1f}% equal={eq[k]} "
              f"rounds={[round(x, 1) for x in v]}", flush=True)
if not CPU:
  json.dump(dict(device=jax.devices()[0].device_kind, copy_gbs=copy, rows=rows, note=__doc__),
            open(out, "w"), indent=1)
