"""FP8-output delayed kernel with y_t (the transposed copy), config sweep on the device it
runs on (written for the H100; the picks, _T_* in kernels/fp8.py, are the H200's): row
blocks of 32 or 64 rows walked in 64- to 256-wide chunks, 4-16 warps, 1-4 persistent
programs a SM, scale/bias in the tile's layout; RMSNorm and LayerNorm at 8192x4096,
16384x4096, 8192x8192 and 32768x2048. CUPTI kernel time, median of 10 calls over inputs
rotated over >= 256 MiB, rounds interleaved (3; the default config timed in each); bf16
x, f32 scale/bias, e4m3fn; GB/s on the bytes model (read 2, write 1 + 1).
Usage: python benchmarks/fp8_sweep_t.py OUT.json BUDGET_S [short] (GPU; "short": 8- and
16-row blocks instead)."""
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
# (block_m, block_n, num_warps, programs a SM)
CANDS = [(32, 128, 16, 1), (32, 128, 16, 2), (32, 128, 16, 3), (32, 128, 16, 4),
         (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 4), (32, 256, 16, 1),
         (32, 256, 16, 2), (32, 256, 8, 2), (32, 64, 8, 2), (32, 64, 8, 4), (32, 64, 4, 4),
         (64, 128, 16, 1), (64, 128, 16, 2), (64, 64, 8, 2), (64, 64, 16, 2)]
if len(sys.argv) > 3 and sys.argv[3] == "short":  # row blocks of 8 and 16 rows: y_t rows
  # get 8 / 16 contiguous bytes a block, half or a quarter of a 32-byte sector, which the
  # neighbouring row blocks (other programs, at about the same time) fill in L2
  CANDS = [(32, 128, 16, 2), (16, 128, 16, 2), (16, 128, 8, 2), (16, 128, 8, 3),
           (16, 128, 8, 4), (16, 256, 16, 2), (16, 256, 8, 2), (16, 256, 8, 3),
           (16, 512, 16, 2), (8, 256, 8, 4), (8, 512, 8, 3), (8, 512, 16, 2)]
groups = []
for m, n in ((8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048)):
  xs, s, b = _fp8_sweep.inputs(m, n)
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm, transpose=True)
    cs = [d] + [c for c in (C(bm, bn, w, SMS * k, True) for bm, bn, w, k in CANDS) if c != d]
    fns = [jax.jit(lambda x, cfg=cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=True, interpret=False, config=cfg)[:2])
           for cfg in cs]
    groups.append((f"{op} {m}x{n}", cs, fns, m * n * 4, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS, note=__doc__,
               describe=lambda c: (f"bm={c.block_m:2d} bn={c.block_n:3d} w={c.num_warps:2d} "
                                   f"k={c.num_programs // SMS}"))
