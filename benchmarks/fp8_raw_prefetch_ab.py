"""A/B of ``forward.FP8_RAW_PREFETCH`` (issue #27 item 1, docs/fp8.md#fp8-raw-prefetch):
the persistent forward and backward stage 1 prefetch an FP8 x raw (its FP8 tile and
scale tile) and apply the scales where the tile is used, against applying them at the
load (before: the multiply waits for the prefetch's loads). x float8_e4m3fn with float32
scales a group of 16, bf16 scale (and bias), y, dy and dx bf16; the public ops, forward
and forward+backward under ``jax.vjp``, the default configs; the jnp chain
(``backend="xla"``) beside them. Each variant is checked against the other (to float32
rounding). CUPTI kernel time of every kernel of a call (``timing.cupti_time``), median of
10 calls over inputs rotated over >= 256 MiB, 5 rounds interleaved; GB/s on the bench's
bytes model (forward: x 1 + scales 4/16 + y 2 bytes an element; forward+backward that
plus x, scales, dy, dx).

Usage (on the GPU machine): python benchmarks/fp8_raw_prefetch_ab.py OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_norm
from pallas_norm.bench import timing
from pallas_norm.kernels import forward

G = 16
VARIANTS = (("raw", "pallas", True), ("at_load", "pallas", False), ("jnp_chain", "xla", True))


def main(out):
  timing.warm_up()
  copy = timing.torch_copy_gbs(20)
  rows = []
  for m, n in ((8192, 4096), (16384, 4096), (8192, 8192)):
    for layer in (False, True):
      op = "layer" if layer else "rms"
      sets = max(2, -(-(256 << 20) // (m * n)))
      key = jax.random.key(0)
      ins = []
      for i in range(sets):
        k = jax.random.split(jax.random.fold_in(key, i), 3)
        ins.append(((2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn),
                    jax.random.uniform(k[1], (m, n // G), minval=0.5, maxval=2.0),
                    jax.random.normal(k[2], (m, n), jnp.bfloat16)))
      w = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
      b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16)

      def call(backend, x, s):
        if layer:
          return pallas_norm.layer_norm(x, w, b, x_scale=s, group_size=G, backend=backend)
        return pallas_norm.rms_norm(x, w, x_scale=s, group_size=G, backend=backend)

      fns, outs = {}, {}
      for name, backend, raw in VARIANTS:
        forward.FP8_RAW_PREFETCH = raw  # read when the kernels are traced
        fwd = jax.jit(lambda x, s, dy, backend=backend: call(backend, x, s))

        def fb(x, s, dy, backend=backend):  # the cotangent of x only, as the bench
          y, pull = jax.vjp(lambda xv: call(backend, xv, s), x)
          return y, pull(dy)
        fb = jax.jit(fb)
        outs[name] = jax.block_until_ready((fwd(*ins[0]), fb(*ins[0])))
        fns[name] = (fwd, fb)
      forward.FP8_RAW_PREFETCH = True
      diff = float(jnp.max(jnp.abs(outs["raw"][0].astype(jnp.float32)
                                   - outs["at_load"][0].astype(jnp.float32))))
      res = {k: ([], []) for k in fns}
      for _ in range(5):
        for k, (fwd, fb) in fns.items():
          res[k][0].append(timing.cupti_time(fwd, ins, 10).get("us"))
          res[k][1].append(timing.cupti_time(fb, ins, 10).get("us"))
      bf = (1 + 4 / G + 2) * m * n
      bfb = bf + (1 + 4 / G + 2 + 2) * m * n
      for k, (tf, tb) in res.items():
        uf, ub = float(np.median(tf)), float(np.median(tb))
        row = dict(shape=[m, n], op=op, variant=k, fwd_us=uf, fwdbwd_us=ub,
                   fwd_gbs=bf / uf / 1e3, fwdbwd_gbs=bfb / ub / 1e3,
                   fwd_pct_copy=100 * bf / uf / 1e3 / copy if copy else None,
                   fwdbwd_pct_copy=100 * bfb / ub / 1e3 / copy if copy else None,
                   fwd_rounds=tf, fwdbwd_rounds=tb, y_max_diff_raw_vs_at_load=diff)
        rows.append(row)
        print(f"{m}x{n} {op:5s} {k:9s} fwd {uf:7.1f} us ({row['fwd_gbs']:5.0f} GB/s)  "
              f"fwd+bwd {ub:7.1f} us ({row['fwdbwd_gbs']:5.0f} GB/s)  y diff {diff:.3g}",
              flush=True)
      json.dump(dict(device=jax.devices()[0].device_kind, copy_gbs=copy, rows=rows,
                     note=__doc__), open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
