"""Does the delayed FP8 LayerNorm's time depend on where its buffers lie? The same
config (the pick) at 4096x8192 ran 39.6 us in one process and 42.5-42.7 us in two others
on H100s the same day (2026-11-27: fp8_ln_grid_ab.py, the kernel bench, fp8_op_vs_kernel_ab.py;
the 39.6 us was later found to be RMSNorm, fp8_ln_grid_ab.py's late-bound op at 9d52124).
Here one jitted function, timed on VARIANTS input sets, each set allocated after a dummy
buffer of a different size (so at another address), the dummies kept alive; rounds
interleaved. CUPTI kernel time, median of 10 calls over the set's 4 rotated x (64 MiB
each); bf16 x and scale/bias, e4m3fn, y_scale 8 / 448 (the bench's). Also prints the x
buffers' device addresses (unsafe_buffer_pointer) mod 2 MiB.
Usage: python benchmarks/fp8_placement_ab.py OUT.json [OP [MxN]] (GPU)"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.bench import timing
out = sys.argv[1]
op = sys.argv[2] if len(sys.argv) > 2 else "layer"
m, n = map(int, (sys.argv[3] if len(sys.argv) > 3 else "4096x8192").split("x"))
ROUNDS = int(os.environ.get("ROUNDS", 5))
timing.warm_up()
sm = op == "layer"
pub = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
s = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (n,), jnp.float32)).astype(jnp.bfloat16)
b = (0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)).astype(jnp.bfloat16)
ys = jnp.float32(8.0 / 448.0)
f = jax.jit(lambda x, s, b: pub(x, s, *((b,) if sm else ()), y_scale=ys, eps=1e-5))
keep, variants = [], {}
for k, pad_kib in enumerate([0, 4, 64, 1024, 2048 + 4, 3072, 8192 + 64, 16384 + 1024]):
  keep.append(jnp.zeros((max(pad_kib, 1) * 256,), jnp.float32).block_until_ready())
  xs = [(jax.random.normal(jax.random.key(10 * k + i), (m, n), jnp.bfloat16), s, b)
        for i in range(4)]
  jax.block_until_ready(xs)
  addrs = [a[0].unsafe_buffer_pointer() % (2 << 20) for a in xs]
  variants[f"pad{pad_kib}KiB"] = (xs, addrs)
res = {k: [] for k in variants}
for _ in range(ROUNDS):
  for k, (xs, _) in variants.items():
    jax.block_until_ready(f(*xs[0]))
    res[k].append(timing.cupti_time(f, xs, 10).get("us"))
rows = {}
for k, (xs, addrs) in variants.items():
  us = float(np.median(res[k]))
  rows[k] = dict(us=us, rounds=res[k], addr_mod_2MiB=addrs, gbs=3 * m * n / us / 1e3)
  print(f"{op} {m}x{n} {k:16s} {us:6.1f} us {3 * m * n / us / 1e3:6.0f} GB/s rounds="
        f"{[round(u, 1) for u in res[k]]} x at (mod 2 MiB) {addrs}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, op=op, shape=[m, n], rows=rows,
               note=__doc__), open(out, "w"), indent=1)
