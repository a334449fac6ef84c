"""FP8-output row-block kernels, sweep 7: ``Fp8Config.row_amax`` (each row block's amax
reduced at once, no elementwise carry: fewer registers a thread, so more programs a SM),
with and without ``hoist_params``, against the current pick, for the delayed kernel
(no y_t) at 8192x4096, 16384x4096, 32768x2048 and 8192x8192 and the statistics kernel
(current scaling's pass 1) at 8192x4096 and 8192x8192, RMSNorm and LayerNorm. CUPTI
kernel time, median of 10 calls over inputs rotated over >= 256 MiB, rounds interleaved
(3; the default config timed in each); bf16 x, e4m3fn, scale/bias in PARAM_DTYPE
(float32 by default). The H100 picks before this sweep (``OLD_H100``) are candidates too.
Usage: python benchmarks/fp8_sweep7.py OUT.json BUDGET_S [PARAM_DTYPE] (GPU)."""
import os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import _fp8_sweep
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
PARAM_DTYPE = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
OLD_H100 = {("delayed", "layer", 8192): (2, 16, 1, True),
            ("stats", "layer", 8192): (1, 4, 0, True),
            ("delayed", "rms", 2048): (1, 8, 0, True)}
timing.warm_up()
SMS = device_info().num_sms
C = K.Fp8Config
P = lambda bm, n, w, k, h, ra: C(bm, n, w, SMS * k, True, bool(h), bool(ra))
# (block_m, num_warps, programs a SM), each with hoist_params 0/1 and row_amax 1
TILES = {
    4096: [(1, 4, 4), (1, 4, 6), (1, 4, 8), (1, 4, 12), (1, 8, 2), (1, 8, 3), (1, 8, 4),
           (1, 8, 6), (1, 16, 1), (1, 16, 2), (1, 16, 3)],
    2048: [(1, 4, 4), (1, 4, 8), (1, 4, 12), (2, 4, 4), (2, 4, 6), (2, 4, 8), (2, 8, 2),
           (2, 8, 3), (2, 8, 4), (4, 8, 2)],
    8192: [(1, 8, 2), (1, 8, 4), (1, 8, 6), (1, 16, 1), (1, 16, 2), (1, 16, 3), (1, 32, 1),
           (2, 16, 1), (2, 16, 2)],
}
CASES = [("delayed", m, n) for m, n in ((8192, 4096), (16384, 4096), (32768, 2048),
                                        (8192, 8192))]
CASES += [("stats", m, n) for m, n in ((8192, 4096), (8192, 8192))]
groups = []
for kernel, m, n in CASES:
  xs, s, b = _fp8_sweep.inputs(m, n, PARAM_DTYPE)
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm)
    new_h100, K._PERSISTENT_ROWS_H100 = K._PERSISTENT_ROWS_H100, OLD_H100
    old = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm)
    K._PERSISTENT_ROWS_H100 = new_h100
    cs = [old] + [P(bm, n, w, k, h, 1) for bm, w, k in TILES[n] for h in (1, 0)]
    cs = [d] + [c for c in dict.fromkeys(cs) if c != d]
    if kernel == "delayed":
      f = lambda x, cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
          x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
          fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0]
      nbytes = m * n * 3
    else:
      f = lambda x, cfg, s=s, b=b, sm=sm: K.fp8_stats(
          x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
          interpret=False, config=cfg)[1]
      nbytes = m * n * 2
    fns = [jax.jit(lambda x, cfg=cfg, f=f: f(x, cfg)) for cfg in cs]
    groups.append((f"{kernel} {op} {m}x{n}", cs, fns, nbytes, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS,
               note=f"{__doc__}\nparam_dtype={PARAM_DTYPE.name}",
               describe=lambda c: (f"bm={c.block_m:2d} w={c.num_warps:2d} G={c.num_programs:4d} "
                                   f"tp={int(c.tile_params)} h={int(c.hoist_params)} "
                                   f"ra={int(c.row_amax)}"))
