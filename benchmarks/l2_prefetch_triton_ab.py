"""A/B of ``TritonKnobs.l2_prefetch`` (backward stage 1 of the Triton backend: thread 0
of a program asks L2 for row block rb + 2G of dy, x and dh with
``cp.async.bulk.prefetch.L2.global`` while the program computes rb), beside the Pallas
backend, forward+backward of the public ops under ``jax.vjp`` (bf16 x, bf16 scale and
bias, the fused residual add where the op has one). Each variant's outputs are checked
against the Pallas backend's first. CUPTI kernel time of every kernel of a call
(``timing.cupti_time``), median of 10 calls over inputs rotated over >= 256 MiB, 5 rounds
interleaved; also the forward alone, so that backward = fwd+bwd - fwd.

Usage (on the GPU machine): python benchmarks/l2_prefetch_triton_ab.py OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_norm
from pallas_norm.bench import timing
from pallas_norm.kernels import triton_kernels as tk

VARIANTS = (("pallas", "pallas", False), ("triton", "triton", False),
            ("triton@l2", "triton", True))


def main(out):
  timing.warm_up()
  rows = []
  for m, n in ((8192, 4096), (16384, 4096)):
    for op in ("layer_res", "rms_res", "layer", "rms"):
      sm, res = op.startswith("layer"), op.endswith("_res")
      sets = max(2, -(-(256 << 20) // (m * n * 2)))
      key = jax.random.key(0)
      mk = lambda i, s=1.0: (s * jax.random.normal(jax.random.fold_in(key, i), (m, n))  # noqa
                             ).astype(jnp.bfloat16)
      w = jnp.full((n,), 1.25, jnp.bfloat16)
      b = jnp.full((n,), 0.5, jnp.bfloat16)
      ins = [(mk(i), mk(100 + i), mk(200 + i), mk(300 + i)) for i in range(sets)]

      def call(backend, x, r):
        if sm:
          return pallas_norm.layer_norm(x, w, b, residual=r if res else None,
                                        backend=backend)
        return pallas_norm.rms_norm(x, w, residual=r if res else None, backend=backend)

      fns, ref = {}, None
      for name, backend, l2 in VARIANTS:
        def fb(x, r, dy, dh, backend=backend):
          out, pull = jax.vjp(lambda x, r: call(backend, x, r), x, r)
          return pull((dy, dh) if res else dy)
        def f(x, r, dy, dh, backend=backend):
          return call(backend, x, r)
        tk.KNOBS = tk.TritonKnobs(l2_prefetch=l2)  # read when the call is traced
        fb, f = jax.jit(fb), jax.jit(f)
        grads = jax.block_until_ready(fb(*ins[0]))
        jax.block_until_ready(f(*ins[0]))
        tk.KNOBS = tk.TritonKnobs()
        g0 = grads[0].astype(jnp.float32)
        if ref is None:
          ref, err = g0, 0.0
        else:
          err = float(jnp.max(jnp.abs(g0 - ref)))
        fns[name] = (fb, f, err)
      res_t = {k: ([], []) for k in fns}
      for _ in range(5):
        for k, (fb, f, _) in fns.items():
          res_t[k][0].append(timing.cupti_time(fb, ins, 10).get("us"))
          res_t[k][1].append(timing.cupti_time(f, ins, 10).get("us"))
      for k, (tb, tf) in res_t.items():
        ub, uf = float(np.median(tb)), float(np.median(tf))
        row = dict(shape=[m, n], op=op, variant=k, fwdbwd_us=ub, fwd_us=uf,
                   bwd_us=ub - uf, fwdbwd_rounds=tb, fwd_rounds=tf,
                   dx_max_diff_vs_pallas=fns[k][2])
        rows.append(row)
        print(f"{m}x{n} {op:9s} {k:10s} fwd+bwd {ub:7.1f} us  fwd {uf:6.1f}  bwd {ub - uf:6.1f}"
              f"  dx diff {fns[k][2]:.3g}  {[round(t, 1) for t in tb]}", flush=True)
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
                open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
