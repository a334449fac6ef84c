"""A/B: the FP8-output delayed kernel's x loads with and without the ``.cg`` cache
modifier (``_compat.stream_cache_modifier``: L2 only), for the persistent kernel at its
default config and for ``Fp8Config.packed`` at the tiles that
``benchmarks/fp8_packed_ab.py`` found best (that script's kernel loads without a
modifier). Each variant is traced with ``stream_cache_modifier`` patched in
``kernels/forward.py`` and ``kernels/fp8.py``. CUPTI kernel time of the whole call,
median of 10 calls over inputs rotated over >= 256 MiB, 3 interleaved rounds; bf16 x,
e4m3fn, scale/bias in PARAM_DTYPE (float32 by default).
Usage: python benchmarks/fp8_packed_cg_ab.py OUT.json BUDGET_S [PARAM_DTYPE] (GPU)."""
import os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import _fp8_sweep
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import forward as F
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
PARAM_DTYPE = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
timing.warm_up()
SMS = device_info().num_sms
CG = K.stream_cache_modifier()
TILES = {4096: [(2, 4, 4), (2, 8, 2), (1, 8, 3)], 8192: [(2, 8, 1), (2, 16, 1)],
         2048: [(2, 8, 3), (2, 4, 4)]}
P = lambda bm, n, w, k: K.Fp8Config(bm, n, w, SMS * k, True, True, True, packed=True)


def patched(modifier, fn, x):
  """fn traced and compiled with the x loads' cache modifier ``modifier``."""
  saved = K.stream_cache_modifier, F.stream_cache_modifier
  K.stream_cache_modifier = F.stream_cache_modifier = lambda: modifier
  try:
    jax.block_until_ready(fn(x))
  finally:
    K.stream_cache_modifier, F.stream_cache_modifier = saved
  return fn


groups = []
for m, n in ((8192, 4096), (16384, 4096), (32768, 2048), (8192, 8192)):
  xs, s, b = _fp8_sweep.inputs(m, n, PARAM_DTYPE)
  for op in ("rms", "layer"):
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm, param_dtype=PARAM_DTYPE)
    cs, fns = [], []
    for cfg in [d] + [P(bm, n, w, k) for bm, w, k in TILES[n]]:
      for mod in (CG, None):
        f = jax.jit(lambda x, cfg=cfg, sm=sm: K.fp8_norm_delayed(
            x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
            fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)[0])
        fns.append(patched(mod, f, xs[0][0]))
        cs.append((cfg, mod))
    groups.append((f"delayed {op} {m}x{n}", cs, fns, m * n * 3, xs, (d, CG)))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS,
               note=f"{__doc__}\nparam_dtype={PARAM_DTYPE.name}",
               describe=lambda c: (f"bm={c[0].block_m:2d} w={c[0].num_warps:2d} "
                                   f"G={c[0].num_programs:4d} pk={int(c[0].packed)} "
                                   f"cache={c[1]}"))
