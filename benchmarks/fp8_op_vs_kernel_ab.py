"""Why the kernel bench's delayed LayerNorm (FP8 output) at 4096x8192 runs 42.7 us (78%
of copy) where fp8_ln_grid_ab.py timed the same config at 39.6 us on the same H100
(2026-11-27; that 39.6 us turned out to be RMSNorm: fp8_ln_grid_ab.py at 9d52124 ran
every group's timed functions with the last group's op, docs/fp8_tuning.md#fp8-one-block-grid):
the public op as the bench calls it against the kernel call as the sweeps call it, one
difference at a time. Variants, each a jitted function of the rotated x:
  kernel   K.fp8_norm_delayed(x, s, b, 100.0) + reduce_amax, s/b closed over (the sweeps)
  inv56    the same with inv = 56 (the bench's y_scale = 8 / 448)
  args     the same with s/b passed as arguments (the bench)
  op       pallas_norm.layer_norm_fp8(x, s, b, y_scale=8/448) as the bench (every output)
  op_ya    the op, y and amax only
each on the bench's data (x, dy ~ N(0, 1), scale 1 + 0.1 N, bias 0.1 N; bench/run.py) and
`kernel` also on the sweeps' (bias 0.1 * scale; _fp8_sweep.inputs). CUPTI kernel time,
median of 10 calls over x rotated over >= 256 MiB, ROUNDS (5) interleaved rounds.
Usage: python benchmarks/fp8_op_vs_kernel_ab.py OUT.json [SHAPES] (GPU)"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp, numpy as np
import _fp8_sweep
import pallas_norm
from pallas_norm.bench import timing
from pallas_norm.kernels import fp8 as K
out = sys.argv[1]
SHAPES = [tuple(map(int, s.split("x"))) for s in
          (sys.argv[2] if len(sys.argv) > 2 else "4096x8192,8192x4096").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", 5))
timing.warm_up()
rows = {}
for op in ("layer", "rms"):
  sm = op == "layer"
  pub = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
  for m, n in SHAPES:
    sets = max(2, -(-(256 << 20) // (m * n * 2)))
    keys = jax.random.split(jax.random.key(0), sets + 2)
    xs = [(jax.random.normal(keys[i], (m, n), jnp.bfloat16),) for i in range(sets)]
    s = (1.0 + 0.1 * jax.random.normal(keys[-2], (n,), jnp.float32)).astype(jnp.bfloat16)
    b = (0.1 * jax.random.normal(keys[-1], (n,), jnp.float32)).astype(jnp.bfloat16)
    sxs, ss, sb = _fp8_sweep.inputs(m, n, jnp.bfloat16)
    kern = lambda x, s, b, inv: K.fp8_norm_delayed(
        x, s, b if sm else None, inv, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False)
    ya = lambda r: (r[0], K.reduce_amax(r[-1]))
    ys = jnp.float32(8.0 / 448.0)
    pargs = (lambda b: (b,)) if sm else (lambda b: ())
    v = {
        "kernel": (jax.jit(lambda x: ya(kern(x, s, b, 100.0))), xs),
        "kernel_sweepdata": (jax.jit(lambda x: ya(kern(x, ss, sb, 100.0))), sxs),
        "inv56": (jax.jit(lambda x: ya(kern(x, s, b, 56.0))), xs),
        "args": (jax.jit(lambda x, s, b: ya(kern(x, s, b, 56.0))), [(x, s, b) for x, in xs]),
        "op": (jax.jit(lambda x, s, b: pub(x, s, *pargs(b), y_scale=ys, eps=1e-5)),
               [(x, s, b) for x, in xs]),
        "op_ya": (jax.jit(lambda x, s, b: (lambda r: (r.y, r.amax))(
            pub(x, s, *pargs(b), y_scale=ys, eps=1e-5))), [(x, s, b) for x, in xs]),
    }
    res = {k: [] for k in v}
    kern_us = {}
    for _ in range(ROUNDS):
      for k, (f, a) in v.items():
        jax.block_until_ready(f(*a[0]))
        t = timing.cupti_time(f, a, 10)
        res[k].append(t.get("us"))
        kern_us[k] = t.get("kernels")
    for k in v:
      us = float(np.median([u for u in res[k] if u is not None]))
      rows[f"{op} {m}x{n} {k}"] = dict(us=us, rounds=res[k], kernels=str(kern_us[k])[:300],
                                       gbs=3 * m * n / us / 1e3)
      print(f"{op} {m}x{n} {k:18s} {us:7.1f} us {3 * m * n / us / 1e3:6.0f} GB/s "
            f"rounds={[round(u, 1) for u in res[k] if u]} kernels={str(kern_us[k])[:160]}",
            flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, rows=rows, note=__doc__), open(out, "w"),
          indent=1)
