"""ncu target: the FP8-output delayed kernel at its default config (or CONFIG, the
arguments of kernels.fp8.Fp8Config as a Python tuple), 16384x4096 bf16 x, f32 scale/bias,
e4m3fn, five calls. Usage (GPU): ncu ... -k regex:fp8_delayed --launch-skip 2
--launch-count 1 python benchmarks/fp8_ncu_target.py rms|layer [CONFIG]"""
import ast, sys, jax, jax.numpy as jnp
from pallas_norm.kernels import fp8 as K
m, n = 16384, 4096
sm = sys.argv[1] == "layer"
cfg = K.Fp8Config(*ast.literal_eval(sys.argv[2])) if len(sys.argv) > 2 else None
x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,)); b = 0.1 * s
f = jax.jit(lambda x: K.fp8_norm_delayed(x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0,
    subtract_mean=sm, fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False,
    config=cfg)[0])
for _ in range(5):
  jax.block_until_ready(f(x))
