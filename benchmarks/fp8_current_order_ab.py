"""Current scaling's quantise pass (pass 2) walking its tiles in four orders, rounds
interleaved (5): "col" (the launch grid's fastest axis over row blocks: a column of tiles
top to bottom, then the next column; the library's), "col_rev" (the same, bottom to top),
"row" (a row block's tiles, then the next row block, top to bottom), "row_rev" (row blocks
bottom to top). Pass 1 (the statistics kernel) reads x top to bottom, so a pass 2 that
starts at the bottom may find the last rows of x still in L2 (50 MB on an H100, 60 MB on an
H200) and read less from HBM. The whole public op (`rms_norm_fp8` / `layer_norm_fp8`
without y_scale: statistics, amax, quantise), with and without y_t; bf16 x and
scale/bias, e4m3fn. CUPTI kernel time of all of a call's kernels, median of 10 calls over
inputs rotated over >= 256 MiB (so x is not in L2 when a call starts); y, y_t and the
scale checked bitwise equal to "col"'s; % of copy on the issue's bytes model (read 2,
write 1, + 1 with y_t), copy measured here.

Each order is traced after `jax.clear_caches()` and compiled ahead of time, and the
compiled executables are what is timed: the public ops sit behind jits made at import,
whose first trace a new outer jit reuses, so a module flag flipped between variants is
otherwise never read again. (This script's first version, `5b55d8d`, did not: its four
"orders" were one kernel, and its results were withdrawn on 2026-11-27.) The HLO text of
each variant is compared, so that variants which compile to the same program are reported.
Usage: python benchmarks/fp8_current_order_ab.py OUT.json [SHAPES] (GPU; INTERPRET=1 runs
the orders' checks on CPU without timing)"""
import hashlib, json, os, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
CPU = os.environ.get("INTERPRET") == "1"
SHAPES = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
          "8192x4096,16384x4096,8192x8192,32768x2048").split(",")]
ORDERS = ("col", "col_rev", "row", "row_rev")
if not CPU:
  from pallas_norm.bench import timing
  timing.warm_up()
  copy = timing.measure_copy(jnp.bfloat16, 20).get("copy_gbs")
  print(f"copy {copy:.0f} GB/s", flush=True)
rows = []
for m, n in SHAPES:
  sets = 1 if CPU else max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)
  for op in ("rms", "layer"):
    for t in (False, True):
      fns, hlo = {}, {}
      for o in ORDERS:
        K._QUANTISE_ORDER = o
        jax.clear_caches()
        if op == "rms":
          f = jax.jit(lambda x, t=t: tuple(pallas_norm.rms_norm_fp8(x, s, transpose=t))[:4])
        else:
          f = jax.jit(lambda x, t=t: tuple(pallas_norm.layer_norm_fp8(x, s, b, transpose=t))[:4])
        lowered = f.lower(*xs[0])
        hlo[o] = hashlib.md5(lowered.as_text().encode()).hexdigest()[:8]
        fns[o] = lowered.compile()
      K._QUANTISE_ORDER = "col"
      jax.clear_caches()
      raw = lambda outs: [np.asarray(a).tobytes() for a in outs if a is not None]
      ref = raw(fns["col"](*xs[0]))
      eq = {k: raw(f(*xs[0])) == ref for k, f in fns.items()}
      distinct = len(set(hlo.values()))
      print(f"{op} {m}x{n} t={int(t)}: HLO {hlo} ({distinct} distinct), equal {eq}", flush=True)
      assert distinct == len(ORDERS), "two orders compiled to the same program"
      if CPU:
        assert all(eq.values()), eq
        continue
      res = {k: [] for k in fns}
      for _ in range(5):
        for k, f in fns.items():
          res[k].append(timing.time_us(f, xs, 10))
      nbytes = (4 if t else 3) * m * n
      for k, v in res.items():
        us = float(np.median(v))
        rows.append(dict(op=op, shape=f"{m}x{n}", transpose=t, order=k, us=us, rounds=v,
                         equal=eq[k], hlo=hlo[k], gbs=nbytes / us / 1e3,
                         pct_copy=100 * nbytes / us / 1e3 / copy))
        print(f"{op:5s} {m}x{n:<6d} t={int(t)} {k:8s} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s "
              f"{100 * nbytes / us / 1e3 / copy:5.1f}% "
              f"equal={eq[k]} rounds={[round(x, 1) for x in v]}", flush=True)
if not CPU:
  json.dump(dict(device=jax.devices()[0].device_kind, copy_gbs=copy, rows=rows, note=__doc__),
            open(out, "w"), indent=1)
