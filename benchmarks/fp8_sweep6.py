"""FP8-output delayed kernel (no y_t), sweep 6: one row block a program with scale/bias
loaded in the tile's layout (tile_params; sweep 5 had one-block tiles without it only),
1-4 rows, 4-16 warps, against the default, at 8192x4096, 16384x4096, 32768x2048 and
8192x8192, RMSNorm and LayerNorm; also the statistics kernel (current scaling's pass 1)
the same way. CUPTI kernel time, median of 10 calls over inputs rotated over
>= 256 MiB, rounds interleaved (3; the default config timed in each); bf16 x, f32
scale/bias, e4m3fn. Usage: python benchmarks/fp8_sweep6.py OUT.json BUDGET_S (GPU)."""
import os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import _fp8_sweep
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
timing.warm_up()
SMS = device_info().num_sms
C = K.Fp8Config
ONE_BLOCK = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (2, 16), (4, 16), (1, 16)]  # (bm, warps)
groups = []
for m, n in ((8192, 4096), (16384, 4096), (32768, 2048), (8192, 8192)):
  xs, s, b = _fp8_sweep.inputs(m, n)
  for op in ("rms", "layer"):
    sm = op == "layer"
    for kernel in ("delayed", "stats"):
      d = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm)
      cs = [C(bm, n, w, 0, True) for bm, w in ONE_BLOCK if bm * n <= 32768]
      cs = [d] + [c for c in cs if c != d]
      if kernel == "delayed":
        fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
            x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
            fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
               for cfg in cs]
        nb = m * n * 3
      else:
        fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_stats(
            x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
            interpret=False, config=cfg)[1]) for cfg in cs]
        nb = m * n * 2
      groups.append((f"{op} {kernel} {m}x{n}", cs, fns, nb, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS, note=__doc__,
               describe=lambda c: (f"bm={c.block_m:2d} w={c.num_warps:2d} G={c.num_programs:4d} "
                                   f"tp={int(c.tile_params)} h={int(c.hoist_params)}"))
