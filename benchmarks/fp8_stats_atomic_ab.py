"""The FP8-x forward's mean/rstd written by atomic exchange (``plgpu.atomic_xchg``, the switch
``kernels.forward.STATS_ATOMIC`` of this commit, reverted in the next) instead of stores:
docs/fp8.md#fp8-x-stats-store. multi_wave_cached whole-row tiles, x float8_e4m3fn with
float32 scales a group of 16, bf16 scale/bias; outputs checked equal to the stores';
CUPTI kernel time, median of 10 calls over 3 rotated x, 5 interleaved rounds, the median.
GPU only (interpret mode has no atomic exchange). Usage: python
benchmarks/fp8_stats_atomic_ab.py"""
import jax, jax.numpy as jnp
from pallas_norm import config as C
from pallas_norm.bench import timing
from pallas_norm.kernels import forward as F
for m, n, warps in ((4096, 16384, (16, 8)), (8192, 4096, (8,))):
  xs8 = [(2 * jax.random.normal(jax.random.key(i), (m, n))).astype(jnp.float8_e4m3fn) for i in range(3)]
  xs = jax.random.uniform(jax.random.key(5), (m, n // 16), minval=0.5, maxval=2.0)
  w = (1 + 0.1 * jax.random.normal(jax.random.key(2), (n,))).astype(jnp.bfloat16)
  fns, outs = {}, {}
  for layer in (True, False):
    for nw in warps:
      cfg = C.ForwardConfig("multi_wave_cached", 1, n, nw)
      for res, at in ((False, False), (True, False), (True, True)):
        F.STATS_ATOMIC = at
        f = jax.jit(lambda x, res=res, layer=layer, cfg=cfg: F.norm_forward(x, w, w if layer else None, eps=1e-5, scale_offset=0.0, subtract_mean=layer, config=cfg, interpret=False, x_scale=xs, y_dtype=jnp.bfloat16, return_residuals=res)).lower(xs8[0]).compile()
        F.STATS_ATOMIC = False
        k = f"{'layer' if layer else 'rms'} {m}x{n} w{nw} {'res' if res else 'nores'}{' atomic' if at else ''}"
        fns[k] = f
        outs[k] = f(xs8[0])
      a, b = outs[k.replace(' atomic', '')], outs[k]
      print(k, "equal to plain stores:", all(bool(jnp.array_equal(u, v)) for u, v in zip(a, b) if u is not None), flush=True)
  t = {k: [] for k in fns}
  for _ in range(5):
    for k, f in fns.items():
      t[k].append(timing.cupti_time(f, [(x,) for x in xs8], 10).get("us"))
  for k, v in t.items():
    print(f"{k:40s} {sorted(v)[2]:7.1f} us", flush=True)
