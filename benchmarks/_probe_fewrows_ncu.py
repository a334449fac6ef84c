"""One-off ncu target (deleted once its result is committed): few-row FP8 static and bf16
RMSNorm forwards, pallas_norm and XLA's jnp, each called twice."""
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm import reference

rng = np.random.default_rng(0)
for m, n in ((8, 8192), (64, 4096)):
  x = jax.device_put(jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16))
  s = jax.device_put(jnp.asarray(rng.standard_normal(n), jnp.bfloat16))
  ys = jnp.float32(0.05)
  fns = {
    "pn_fp8": jax.jit(lambda x, s: pallas_norm.rms_norm_fp8(x, s, y_scale=ys).y),
    "xla_fp8": jax.jit(lambda x, s: pallas_norm.rms_norm_fp8(x, s, y_scale=ys, backend="xla").y),
    "pn_bf16": jax.jit(lambda x, s: pallas_norm.rms_norm(x, s)),
    "xla_bf16": jax.jit(lambda x, s: pallas_norm.rms_norm(x, s, backend="xla")),
  }
  for name, f in fns.items():
    for _ in range(2):
      jax.block_until_ready(f(x, s))
    print(m, n, name, "done", flush=True)
