"""ncu target: LayerNorm (or RMSNorm) forward+backward with FP8 x (e4m3fn, a float32 scale
a group of 16) at 8192x4096, bf16 scale/bias/y/dy, as the kernel bench's ``*_fp8in``
fwdbwd cell runs it (jax.vjp, cotangent y only), five calls.
Usage (GPU): ncu ... -k regex:bwd_persistent --launch-skip 2 --launch-count 1
python benchmarks/fp8in_ncu_target.py layer|rms"""
import sys, jax, jax.numpy as jnp
import pallas_norm
m, n = 8192, 4096
layer = sys.argv[1] == "layer"
k = jax.random.split(jax.random.key(0), 4)
x8 = jax.random.normal(k[0], (m, n)).astype(jnp.float8_e4m3fn)
xs = jax.random.uniform(k[1], (m, n // 16), jnp.float32, 0.5, 2.0)
s = (1 + 0.1 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16)
b = (0.1 * jax.random.normal(k[3], (n,))).astype(jnp.bfloat16)
dy = jax.random.normal(k[3], (m, n), jnp.bfloat16)


def f(x8, xs, s, b, dy):
  norm = lambda x, s, b: (pallas_norm.layer_norm(x, s, b, x_scale=xs, out_dtype=s.dtype)
                          if layer else pallas_norm.rms_norm(x, s, x_scale=xs,
                                                             out_dtype=s.dtype))
  y, vjp = jax.vjp(norm, x8, s, b)
  return y, vjp(dy)


f = jax.jit(f)
for _ in range(5):
  jax.block_until_ready(f(x8, xs, s, b, dy))
