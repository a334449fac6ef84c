"""Delayed-scaling LayerNorm (FP8 output, no y_t) at the two 64 MiB cells under 85% of
copy on the H100 (8192x4096, 4096x8192; docs/fp8_tuning.md#fp8-balanced-grid): the
pick (persistent, packed) against one-row-block-a-program grids (``Fp8Config.num_programs
= 0``, ``_norm_kernel``: the plain forward's structure, an amax a row), tiles as the
bf16 multi_wave_cached forward takes them. CUPTI kernel time of the whole call (the
amax reduction included), median of 10 calls over inputs rotated over >= 256 MiB,
rounds interleaved (ROUNDS, 3), the pick in each; bf16 x and scale/bias, e4m3fn. Each
config's y and amax are checked against the pick's first.
Usage: [ROUNDS=3] python benchmarks/fp8_ln_grid_ab.py OUT.json BUDGET_S [SHAPES] (GPU)"""
import os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import _fp8_sweep
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
SHAPES = [tuple(map(int, s.split("x"))) for s in
          (sys.argv[3] if len(sys.argv) > 3 else "8192x4096,4096x8192").split(",")]
timing.warm_up()
SMS = device_info().num_sms
# (block_m, num_warps) for one row block a program, tile_params on and off
TILES = {4096: [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (1, 16)],
         8192: [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (1, 32)]}
groups = []
for op in ("layer", "rms"):
  sm = op == "layer"
  for m, n in SHAPES:
    xs, s, b = _fp8_sweep.inputs(m, n, jnp.bfloat16)
    d = K.fp8_config(m, n, kernel="delayed", subtract_mean=sm, param_dtype=jnp.bfloat16)
    cs = [d] + [K.Fp8Config(bm, n, w, 0, tp) for bm, w in TILES[n] for tp in (True, False)]
    f = lambda x, cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
        x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
        fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)
    full = [jax.jit(lambda x, cfg=cfg, f=f: f(x, cfg)) for cfg in cs]
    ref = full[0](xs[0][0])
    ref_amax = float(K.reduce_amax(ref[-1]))
    for cfg, g in zip(cs[1:], full[1:]):
      try:
        r = g(xs[0][0])
      except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
        print("compile", cfg, "ERR", str(e)[:150], flush=True)
        continue
      same = float(jnp.mean((r[0].view(jnp.uint8) == ref[0].view(jnp.uint8)).astype(jnp.float32)))
      print(f"check {op} {m}x{n} bm={cfg.block_m} w={cfg.num_warps} tp={int(cfg.tile_params)}: "
            f"y bytes equal {same}, amax {float(K.reduce_amax(r[-1]))} / {ref_amax}", flush=True)
    # the op's amax reduced as fp8_norm's callers do (reduce_amax), so its kernel counts
    # f=f: these are traced at their first call, in _fp8_sweep.run after the loop, when
    # the name f is the last group's (at 9d52124 they all ran RMSNorm 4096x8192's f)
    fns = [jax.jit(lambda x, cfg=cfg, f=f: (lambda r: (r[0], K.reduce_amax(r[-1])))(f(x, cfg)))
           for cfg in cs]
    groups.append((f"delayed {op} {m}x{n}", cs, fns, m * n * 3, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS,
               rounds=int(os.environ.get("ROUNDS", 3)), note=__doc__,
               describe=lambda c: (f"bm={c.block_m:2d} w={c.num_warps:2d} G={c.num_programs:4d} "
                                   f"tp={int(c.tile_params)} pk={int(c.packed)}"))
