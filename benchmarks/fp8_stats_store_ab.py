"""Why the FP8-x forward that writes mean/rstd (jax.vjp's forward) runs slower than the
one that does not (docs/fp8.md#fp8-x-stats-store): multi_wave_cached whole-row tiles, x
float8_e4m3fn with float32 scales a group of 16, bf16 scale/bias, the forward kernel
alone (``kernels.forward.norm_forward``), with and without mean/rstd written, and with
the experiment switches of this commit's ``kernels/forward.py`` (reverted in the next
commit): ``STATS_MODE`` "none" (mean/rstd not stored although the outputs exist) or
"before" (stored before y), ``SCALAR_STATS`` (a one-row tile's mean/rstd stored as
scalars), ``GATHER_SCALES`` (each element's group scale gathered, no reshape and
broadcast), and FP8 x's load vector forced to runs of 8; bf16 x beside it at N = 4096.

Method: each variant compiled ahead of time with its switches set while it is traced;
CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls over 3
rotated x, variants interleaved in 5 rounds, the median.

Usage (GPU machine, at the commit that has the switches): python
benchmarks/fp8_stats_store_ab.py
"""
import jax
import jax.numpy as jnp

from pallas_norm import config as C
from pallas_norm.bench import timing
from pallas_norm.kernels import forward as F

# (mean/rstd written, STATS_MODE, SCALAR_STATS, GATHER_SCALES, vector or None)
VARIANTS = [(False, "", False, False, None), (True, "", False, False, None),
            (True, "none", False, False, None), (True, "before", False, False, None),
            (True, "", True, False, None), (True, "", False, False, 8),
            (False, "", False, True, None), (True, "", False, True, None)]


def main():
  for m, n, warps in ((4096, 16384, (16, 8)), (8192, 4096, (8,))):
    xs8 = [(2 * jax.random.normal(jax.random.key(i), (m, n))).astype(jnp.float8_e4m3fn)
           for i in range(3)]
    xs = jax.random.uniform(jax.random.key(5), (m, n // 16), minval=0.5, maxval=2.0)
    w = (1 + 0.1 * jax.random.normal(jax.random.key(2), (n,))).astype(jnp.bfloat16)
    xb = [x.astype(jnp.bfloat16) for x in xs8]
    fns = {}
    for layer in (True, False):
      for nw in warps:
        cfg = C.ForwardConfig("multi_wave_cached", 1, n, nw)
        for res, mode, scalar, gather, vec in VARIANTS:
          F.STATS_MODE, F.SCALAR_STATS, F.GATHER_SCALES = mode, scalar, gather
          rule = F._fp8_vector
          if vec is not None:
            F._fp8_vector = lambda k, s, nn, vec=vec: vec
          fn = lambda x, res=res, layer=layer, cfg=cfg: F.norm_forward(
              x, w, w if layer else None, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
              config=cfg, interpret=False, x_scale=xs, y_dtype=jnp.bfloat16,
              return_residuals=res)
          try:
            f = jax.jit(fn).lower(xs8[0]).compile()
          finally:
            F._fp8_vector = rule
            F.STATS_MODE, F.SCALAR_STATS, F.GATHER_SCALES = "", False, False
          name = (f"{'layer' if layer else 'rms'} {m}x{n} fp8 w{nw} "
                  f"{'res' if res else 'nores'} {mode or '-'}{' scalar' if scalar else ''}"
                  f"{' gather' if gather else ''}{f' v{vec}' if vec else ''}")
          fns[name] = (f, [(x,) for x in xs8])
        if n <= 8192:  # bf16 x, its whole-row tile
          for res in (False, True):
            f = jax.jit(lambda x, res=res, layer=layer, cfg=cfg: F.norm_forward(
                x, w, w if layer else None, eps=1e-5, scale_offset=0.0,
                subtract_mean=layer, config=cfg, interpret=False,
                return_residuals=res)).lower(xb[0]).compile()
            fns[f"{'layer' if layer else 'rms'} {m}x{n} bf16 w{nw} "
                f"{'res' if res else 'nores'}"] = (f, [(x,) for x in xb])
    t = {k: [] for k in fns}
    for _ in range(5):
      for k, (f, args) in fns.items():
        t[k].append(timing.cupti_time(f, args, 10).get("us"))
    for k, v in t.items():
      print(f"{k:50s} {sorted(v)[len(v) // 2]:7.1f} us", flush=True)


if __name__ == "__main__":
  main()
