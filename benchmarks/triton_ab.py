"""backend="triton" against backend="pallas" (and the TritonKnobs), RMSNorm bf16, same launch
configs; CUPTI time over rotated inputs, median of 20. GPU only.

  python benchmarks/triton_ab.py pallas|triton|evict_first|stream_cg|stages2
"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import pallas_norm
from pallas_norm import bench
from pallas_norm.kernels import triton_kernels as tk
which = sys.argv[1]
backend = "pallas" if which == "pallas" else "triton"
if which == "evict_first": tk.KNOBS = tk.TritonKnobs(evict_first=True)
if which == "stream_cg": tk.KNOBS = tk.TritonKnobs(stream_cg=True)
if which == "stages2": tk.KNOBS = tk.TritonKnobs(loop_stages=2)
bench._warm_up(2)
out = []
for m, n in [(4096, 4096), (8192, 5120), (32768, 128), (16384, 16384), (1024, 262144)]:
  R = max(2, -(-4 * 64 * 2**20 // (m * n * 2)))
  k = jax.random.key(0)
  xs = [(jax.random.normal(jax.random.fold_in(k, i), (m, n), jnp.bfloat16), jnp.full((n,), 1.1, jnp.bfloat16), jax.random.normal(jax.random.fold_in(k, 99 + i), (m, n), jnp.bfloat16)) for i in range(R)]
  f = lambda x, s: pallas_norm.rms_norm(x, s, backend=backend)
  fwd = jax.jit(lambda x, s, dy: f(x, s))
  def fbs(x, s, dy):
    y, pull = jax.vjp(f, x, s)
    return y, pull(dy)
  fb = jax.jit(fbs)
  t1 = bench._cupti_time(fwd, xs, 20).get("us"); t2 = bench._cupti_time(fb, xs, 20).get("us")
  out.append(f"{m}x{n} fwd {2*m*n*2/t1/1e3:.0f} fb {5*m*n*2/t2/1e3:.0f}")
print(which, " | ".join(out), flush=True)
