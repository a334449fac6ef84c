"""A/B of ``l2_prefetch`` (forward.l2_touch: a persistent program touches one element a
32-byte sector of row block rb + 2G into L2 while it computes rb) in the FP8-output
row-block kernels (delayed scaling and current scaling's statistics pass), the default
config against the same config with l2_prefetch on, and a few other tiles with it.
Outputs of each variant are first checked bitwise against the default's. CUPTI kernel
time (``timing.cupti_time``), median of 10 calls over inputs rotated over >= 256 MiB, 5
rounds interleaved; bf16 x, bf16 scale (and bias), e4m3fn. GB/s on the bytes model
(delayed: read 2, write 1 a value; statistics: read 2).

Usage (on the GPU machine): python benchmarks/l2_prefetch_ab.py OUT.json
"""
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K

C = K.Fp8Config


def main(out):
  timing.warm_up()
  sms = jax.devices()[0].core_count
  rows = []
  for m, n in ((8192, 4096), (16384, 4096), (32768, 2048), (8192, 8192)):
    sets = max(2, -(-(256 << 20) // (m * n * 2)))
    key = jax.random.key(0)
    xs = [(jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16),
           (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16),
           (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16))
          for i in range(sets)]
    for op in ("rms", "layer"):
      sm = op == "layer"
      for kernel in ("delayed", "stats"):
        base = K.fp8_config(m, n, jnp.bfloat16, kernel=kernel, subtract_mean=sm)
        cfgs = {"default": base}
        if base.num_programs:
          cfgs["default@l2"] = dataclasses.replace(base, l2_prefetch=True)
          for bm, nw, per_sm, hoist in ((1, 16, 2, False), (2, 16, 1, True), (2, 8, 2, True),
                                        (1, 8, 3, True), (2, 16, 2, False)):
            if bm * n > 2 * 8192:
              continue
            c = C(bm, base.block_n, nw, sms * per_sm, True, hoist, True)
            cfgs[f"{bm}x{base.block_n} w{nw} {per_sm}/SM hoist={int(hoist)}@l2"] = c

        def mk(cfg, kernel=kernel, sm=sm):
          if kernel == "delayed":
            return jax.jit(lambda x, s, b: K.fp8_norm_delayed(
                x, s, b if sm else None, 0.01, eps=1e-5, scale_offset=0.0,
                subtract_mean=sm, fp8_dtype=jnp.float8_e4m3fn, transpose=False,
                interpret=False, config=cfg))
          return jax.jit(lambda x, s, b: K.fp8_stats(
              x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
              interpret=False, config=cfg))

        fns, ref = {}, None
        for name, cfg in cfgs.items():
          f = mk(cfg)
          try:
            o = jax.block_until_ready(f(*xs[0]))
          except Exception as e:  # noqa: BLE001 (a config that does not compile)
            print(f"{m}x{n} {op} {kernel} {name} FAILED {type(e).__name__}: {e}"[:400])
            continue
          outs = [a for a in o if a is not None]
          if ref is None:
            ref = outs
            same = True
          else:  # y, mean, rstd bitwise; the amax partials differ in count: their max
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(ref[:-1], outs[:-1]))
            same &= int(jnp.max(ref[-1])) == int(jnp.max(outs[-1]))
          fns[name] = (f, same)
        res = {k: [] for k in fns}
        for _ in range(5):
          for k, (f, _) in fns.items():
            res[k].append(timing.cupti_time(f, xs, 10).get("us"))
        bpe = 3 if kernel == "delayed" else 2
        for k, v in res.items():
          v = [t for t in v if t is not None]
          us = float(np.median(v)) if v else None
          row = dict(shape=[m, n], op=op, kernel=kernel, variant=k, config=str(cfgs[k]),
                     us=us, rounds=v, bitwise_equal_to_default=fns[k][1],
                     gbs=None if us is None else bpe * m * n / us / 1e3)
          rows.append(row)
          print(f"{m}x{n} {op:5s} {kernel:7s} {k:36s} {us:8.1f} us {row['gbs']:6.0f} GB/s "
                f"same={fns[k][1]} {[round(t, 1) for t in v]}", flush=True)
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
                  open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
