"""ncu target: the FP8-x forward kernel (multi_wave_cached, ``pallas_norm_fwd_cached``)
with and without mean/rstd written (docs/fp8_tuning.md#fp8-x-stats-store), x
float8_e4m3fn with float32 scales a group of 16, bf16 scale/bias/y, five calls.
LayerNorm at 4096x16384 [1, 16384] x 16, RMSNorm at 4096x16384 [1, 16384] x 8, or either
at 8192x4096 [1, 4096] x 8 ("... 4096").
Usage (GPU): ncu --clock-control none --section SourceCounters -k regex:fwd_cached
--launch-skip 2 --launch-count 1 -o REP python benchmarks/fp8in_stats_ncu_target.py
layer|rms res|nores [4096]; then ncu --import REP.ncu-rep --page source --csv
--print-source sass"""
import sys
import jax
import jax.numpy as jnp
from pallas_norm import config as C
from pallas_norm.kernels import forward as F

layer, res = sys.argv[1] == "layer", sys.argv[2] == "res"
narrow = sys.argv[3:] == ["4096"]
m, n = (8192, 4096) if narrow else (4096, 16384)
warps = 8 if narrow or not layer else 16
x8 = (2 * jax.random.normal(jax.random.key(0), (m, n))).astype(jnp.float8_e4m3fn)
s = jax.random.uniform(jax.random.key(5), (m, n // 16), minval=0.5, maxval=2.0)
w = (1 + 0.1 * jax.random.normal(jax.random.key(2), (n,))).astype(jnp.bfloat16)
cfg = C.ForwardConfig("multi_wave_cached", 1, n, warps)
f = jax.jit(lambda x: F.norm_forward(x, w, w if layer else None, eps=1e-5, scale_offset=0.0,
                                     subtract_mean=layer, config=cfg, interpret=False,
                                     x_scale=s, y_dtype=jnp.bfloat16, return_residuals=res))
for _ in range(5):
  jax.block_until_ready(f(x8))
