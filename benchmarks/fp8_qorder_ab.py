"""A/B of the current-scaling quantise pass's grid order (kernels/fp8.py
``_Q_ROWS_REVERSED``): row tiles launched fastest (column strips, each down all rows)
against column tiles fastest with the row tiles from the last (the rows the statistics
pass read last, likeliest in L2, read first). The whole op, ``rms_norm_fp8`` /
``layer_norm_fp8`` with current scaling, with and without y_t, RMSNorm and LayerNorm, at
8192x4096, 16384x4096, 8192x8192 and 32768x2048, rounds interleaved (5). CUPTI kernel
time of the op's kernels, median of 10 calls over inputs rotated over >= 256 MiB; bf16
x, bf16 scale/bias, e4m3fn. Each variant's outputs are checked bitwise equal to the
other's first. Usage: python benchmarks/fp8_qorder_ab.py OUT.json (on the GPU machine)"""
import sys, json
import jax, jax.numpy as jnp, numpy as np
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
import pallas_norm
out = sys.argv[1]
timing.warm_up()
rows = []


def mk(sm, transpose):
  f = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
  def g(x, s, b):
    r = f(x, s, b, transpose=transpose) if sm else f(x, s, transpose=transpose)
    return r.y, r.y_scale, r.amax, r.y_t
  return jax.jit(g)


def bits(tree):
  return [np.atleast_1d(np.asarray(a)).view(np.uint8) for a in jax.tree.leaves(tree)]


for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),
         (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16),
         (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16))
        for i in range(sets)]
  for op in ("rms", "layer"):
    sm = op == "layer"
    for transpose in (False, True):
      fns, outs = {}, {}
      for rev in (False, True):
        K._Q_ROWS_REVERSED = rev
        f = mk(sm, transpose)
        outs[rev] = bits(jax.block_until_ready(f(*xs[0])))  # traced now, with this order
        fns[rev] = f
      K._Q_ROWS_REVERSED = False
      same = all(np.array_equal(u, v) for u, v in zip(outs[False], outs[True]))
      res = {rev: [] for rev in fns}
      for r in range(5):
        for rev, f in fns.items():
          res[rev].append(timing.time_us(f, xs, 10))
      nb = m * n * (4 if transpose else 3)
      for rev, v in res.items():
        us = float(np.median(v))
        rows.append(dict(op=op, shape=f"{m}x{n}", transpose=transpose, rows_reversed=rev,
                         us=us, rounds=v, gbs=nb / us / 1e3, bitwise_equal=same))
        print(f"{op:5s} {m}x{n:<6d} y_t={int(transpose)} reversed={int(rev)} {us:7.1f} us "
              f"{nb / us / 1e3:6.0f} GB/s equal={same} rounds={[round(t, 1) for t in v]}",
              flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
          indent=1)
