"""FP8-output delayed kernel (no y_t), sweep 4: the persistent whole-row configs. Run at
327ea5c, where the amax carry was folded a thread's 8-column run at a time (fewer
registers; reverted after this sweep: one-row tiles ran 2x slower, docs/fp8.md), at 8192x4096,
16384x4096, 32768x2048 and 8192x8192, RMSNorm and LayerNorm. CUPTI kernel time, median
of 10 calls over inputs rotated over >= 256 MiB, rounds interleaved (3); bf16 x, f32
scale/bias, e4m3fn. Usage: python benchmarks/fp8_sweep4.py OUT.json BUDGET_S (GPU)."""
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
P = lambda bm, n, w, k, h: C(bm, n, w, SMS * k, True, bool(h))
CANDS = {
    4096: [(1, 16, 3, 1), (1, 16, 4, 0), (1, 16, 3, 0), (1, 16, 2, 1), (1, 8, 4, 1),
           (1, 8, 6, 0), (1, 8, 4, 0), (2, 16, 2, 1), (2, 8, 3, 1), (2, 8, 4, 1)],
    2048: [(2, 4, 4, 1), (2, 8, 2, 1), (2, 8, 3, 1), (2, 8, 4, 1), (1, 4, 8, 1), (2, 4, 6, 1),
           (4, 16, 1, 1), (4, 16, 2, 1), (1, 8, 6, 1)],
    8192: [(1, 32, 1, 1), (1, 32, 2, 0), (1, 16, 2, 1), (1, 16, 3, 1), (2, 16, 1, 1),
           (2, 16, 2, 1), (2, 8, 2, 1), (1, 8, 4, 1)],
}
groups = []
for m, n in ((8192, 4096), (16384, 4096), (32768, 2048), (8192, 8192)):
  xs, s, b = _fp8_sweep.inputs(m, n)
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm)
    cs = [d] + [c for c in (P(bm, n, w, k, h) for bm, w, k, h in CANDS[n]) if c != d]
    fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
           for cfg in cs]
    groups.append((f"{op} {m}x{n}", cs, fns, m * n * 3, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS, note=__doc__,
               describe=lambda c: (f"bm={c.block_m:2d} w={c.num_warps:2d} "
                                   f"k={c.num_programs // SMS} h={int(c.hoist_params)}"))
