"""Diagnostic (not a library change): which part of LayerNorm's FP8-output delayed kernel
costs it against RMSNorm's, 16384x4096 bf16 x, f32 scale/bias, H100, the default configs
and the row_amax one. Variants: RMSNorm; RMSNorm + bias; LayerNorm; LayerNorm without
bias; LayerNorm with mean forced to 0 (the first reduction gone; wrong output);
LayerNorm with the variance's reduction on x, not x - mean (wrong output). Five rounds
interleaved, CUPTI kernel time, median of 10 calls over 4 rotated inputs.
Usage: python benchmarks/fp8_ln_diag.py (GPU)."""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
timing.warm_up()
m, n = 16384, 4096
sets = 4
xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
orig = K._tile_stats
def stats_mean0(x, mask, *, n, eps, subtract_mean):
  if not subtract_mean:
    return orig(x, mask, n=n, eps=eps, subtract_mean=False)
  mean = jnp.zeros((x.shape[0],), jnp.float32)
  return mean, lax.rsqrt(jnp.sum(x * x, axis=1) / n + jnp.float32(eps))
def stats_parallel(x, mask, *, n, eps, subtract_mean):
  if not subtract_mean:
    return orig(x, mask, n=n, eps=eps, subtract_mean=False)
  mean = jnp.sum(x, axis=1) / n
  return mean, lax.rsqrt(jnp.sum(x * x, axis=1) / n + jnp.float32(eps))
variants = []
def mk(name, sm, bias, patch, cfg):
  K._tile_stats = patch or orig
  f = jax.jit(lambda x: K.fp8_norm_delayed(x, s, bias, 100.0, eps=1e-5, scale_offset=0.0,
      subtract_mean=sm, fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
  jax.block_until_ready(f(*xs[0]))
  K._tile_stats = orig
  variants.append((name, f))
for cname, cfg in (("default", None), ("(1,8,3,ra)", K.Fp8Config(1, 4096, 8, 396, True, True, True))):
  mk(f"rms {cname}", False, None, None, cfg)
  mk(f"rms+bias {cname}", False, b, None, cfg)
  mk(f"layer {cname}", True, b, None, cfg)
  mk(f"layer nobias {cname}", True, None, None, cfg)
  mk(f"layer mean=0 {cname}", True, b, stats_mean0, cfg)
  mk(f"layer var-parallel {cname}", True, b, stats_parallel, cfg)
res = {v[0]: [] for v in variants}
for r in range(5):
  for name, f in variants:
    res[name].append(timing.time_us(f, xs, 10))
for name, v in res.items():
  print(f"{name:32s} {np.median(v):7.1f} us  {m*n*3/np.median(v)/1e3:6.0f} GB/s  {[round(t,1) for t in v]}")
