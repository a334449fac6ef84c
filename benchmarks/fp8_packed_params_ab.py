"""The packed FP8-output kernel (``Fp8Config.packed``, bf16 x carried as pairs) with its
bf16 scale/bias held as uint32 pairs and unpacked at each use (the experiment switch
``kernels.fp8._PACKED_PARAMS`` of 8e38493, removed in the next commit: run the script
there), against the same
kernel holding them as float32 (the library): half the registers for the hoisted
scale/bias, which might let more programs fit a SM. Delayed scaling and the current
scaling's statistics kernel, RMSNorm and LayerNorm, bf16 x and scale/bias, e4m3fn, the
kernel alone (``fp8_norm_delayed`` / ``fp8_stats`` with the config given), at the H100
picks (``_BF16_ROWS_H100``) and at one and two more programs a SM. CUPTI kernel time,
median of 10 calls over inputs rotated past 256 MiB, variants interleaved in 5 rounds,
the median; outputs checked bitwise equal between the two. Usage (GPU): python
benchmarks/fp8_packed_params_ab.py OUT.json"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
from pallas_norm import config as C
from pallas_norm.bench import timing

import _fp8_sweep as S
from pallas_norm.kernels import fp8 as K

E4 = jnp.float8_e4m3fn
sms = C.device_info().num_sms
# (kernel, layer, m, n, block_m, warps, programs a SM list)
CELLS = [("delayed", True, 8192, 4096, 2, 4, (2, 3, 4)),
         ("delayed", True, 16384, 4096, 2, 4, (2, 3)),
         ("delayed", False, 8192, 4096, 2, 8, (2, 3)),
         ("stats", True, 8192, 4096, 2, 4, (4, 5)),
         ("delayed", True, 32768, 2048, 2, 4, (4, 5))]
rows = []
timing.warm_up()
for kern, layer, m, n, bm, warps, per_sms in CELLS:
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(8), (n,))).astype(jnp.bfloat16) if layer else None
  fns, outs = {}, {}
  for per_sm in per_sms:
    cfg = K.Fp8Config(bm, n, warps, per_sm * sms, True, True, True, True, False)
    for pp in (False, True):
      K._PACKED_PARAMS = pp
      try:
        if kern == "delayed":
          f = jax.jit(lambda x, cfg=cfg: K.fp8_norm_delayed(
              x, s, b, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=layer, fp8_dtype=E4,
              transpose=False, interpret=False, config=cfg)).lower(xs[0][0]).compile()
        else:
          f = jax.jit(lambda x, cfg=cfg: K.fp8_stats(
              x, s, b, eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False,
              config=cfg)).lower(xs[0][0]).compile()
      finally:
        K._PACKED_PARAMS = False
      name = f"{per_sm}/SM {'pairs' if pp else 'f32'}"
      fns[name] = f
      outs[name] = [np.asarray(a).tobytes() for a in jax.tree.leaves(f(xs[0][0]))]
  res = S.interleaved_us(fns, xs)
  cell = f"{kern} {'layer' if layer else 'rms'} {m}x{n} [{bm}, {n}] x {warps}"
  for k, v in res.items():
    ref = outs[f"{k.split()[0]} f32"]
    us = float(np.median(v))
    rows.append(dict(cell=cell, variant=k, us=us, rounds=v, equal=outs[k] == ref))
    print(f"{cell:36s} {k:10s} {us:7.1f} us equal={outs[k] == ref} "
          f"rounds={[round(t, 1) for t in v]}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__),
          open(sys.argv[1], "w"), indent=1)
