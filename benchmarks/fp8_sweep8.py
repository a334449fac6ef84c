"""FP8-output row-block kernels, sweep 8: ``Fp8Config.packed`` (bf16 x carried as uint32
pairs, y stored as FP8 pairs; ``kernels/fp8.py`` ``_packed_kernel``, the design of
``benchmarks/fp8_packed_ab.py``) and ``Fp8Config.stream_x=False`` (x loaded without the
``.cg`` modifier; ``benchmarks/fp8_packed_cg_ab.py``) over tiles and programs a SM,
against the current pick, for the delayed kernel (no y_t) at 8192x4096, 16384x4096,
32768x2048 and 8192x8192 and the statistics kernel (current scaling's pass 1) at
8192x4096, 32768x2048 and 8192x8192, RMSNorm and LayerNorm. Candidates: the pick, the
pick with stream_x=False, packed tiles with stream_x=False. CUPTI kernel time of the
whole call (the bitcasts included), median of 10 calls over inputs rotated over >= 256
MiB, rounds interleaved (3; the default config timed in each); bf16 x, e4m3fn,
scale/bias in PARAM_DTYPE (float32 by default). Before timing, each config's outputs are
checked against the default config's (y bytes equal fraction, amax).
Usage: [ROUNDS=3] python benchmarks/fp8_sweep8.py OUT.json BUDGET_S [PARAM_DTYPE [CASES [TILES]]] (GPU;
CASES e.g. "delayed:layer:8192x4096,16384x4096", TILES a Python dict {N: [(block_m,
num_warps, programs a SM or "G<programs>", hoist_params, row_amax, packed_params),
...]}, packed and without .cg; packed_params (bf16 scale/bias as uint32 pairs) optional,
False by default)."""
import ast, dataclasses, os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
import jax, jax.numpy as jnp
import _fp8_sweep
from pallas_norm.bench import timing
from pallas_norm.config import device_info
from pallas_norm.kernels import fp8 as K
T0 = time.time(); out = sys.argv[1]; BUDGET = float(sys.argv[2])
PARAM_DTYPE = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
timing.warm_up()
SMS = device_info().num_sms
# (block_m, num_warps, programs a SM), hoist_params and row_amax on, stream_x off
TILES = {
    4096: [(2, 4, 4), (2, 8, 2), (2, 4, 3), (1, 8, 3), (2, 4, 5)],
    8192: [(2, 8, 1), (2, 16, 1), (1, 16, 2), (1, 8, 2), (1, 4, 2)],
    2048: [(2, 4, 4), (2, 8, 3), (2, 4, 6), (1, 4, 8)],
}
# k: programs a SM, or "G<g>" for g programs (a grid that divides the row blocks evenly)
programs = lambda k: int(k[1:]) if isinstance(k, str) else SMS * k
P = lambda bm, n, w, k, h=True, ra=True, pp=False: K.Fp8Config(
    bm, n, w, programs(k), True, h, ra, packed=True, stream_x=False, packed_params=pp)
OPS = ("rms", "layer")
CASES = [("delayed", m, n) for m, n in ((8192, 4096), (16384, 4096), (32768, 2048),
                                        (8192, 8192))]
CASES += [("stats", m, n) for m, n in ((8192, 4096), (32768, 2048), (8192, 8192))]
if len(sys.argv) > 4:
  kernel, op, shapes = sys.argv[4].split(":")
  CASES = [(kernel, *map(int, sh.split("x"))) for sh in shapes.split(",")]
  OPS = (op,)
if len(sys.argv) > 5:
  TILES = ast.literal_eval(sys.argv[5])
groups = []
for kernel, m, n in CASES:
  xs, s, b = _fp8_sweep.inputs(m, n, PARAM_DTYPE)
  for op in OPS:
    sm = op == "layer"
    d = K.fp8_config(m, n, kernel=kernel, subtract_mean=sm, param_dtype=PARAM_DTYPE)
    cs = [d] + ([dataclasses.replace(d, stream_x=False)] if d.num_programs else [])
    cs += [P(t[0], n, *t[1:]) for t in TILES[n]]
    if kernel == "delayed":
      f = lambda x, cfg, s=s, b=b, sm=sm: K.fp8_norm_delayed(
          x, s, b if sm else None, 100.0, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
          fp8_dtype=jnp.float8_e4m3fn, transpose=False, interpret=False, config=cfg)
      nbytes = m * n * 3
    else:
      f = lambda x, cfg, s=s, b=b, sm=sm: K.fp8_stats(
          x, s, b if sm else None, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
          interpret=False, config=cfg)
      nbytes = m * n * 2
    pick = 0 if kernel == "delayed" else 1  # y; rstd (RMSNorm's mean is no output)
    full = [jax.jit(lambda x, cfg=cfg, f=f: f(x, cfg)) for cfg in cs]
    ref = full[0](xs[0][0])
    for cfg, g in zip(cs[1:], full[1:]):
      r = g(xs[0][0])
      amax = [float(K.reduce_amax(v[-1])) for v in (ref, r)]
      same = (float(jnp.mean((r[0].view(jnp.uint8) == ref[0].view(jnp.uint8))
                             .astype(jnp.float32))) if kernel == "delayed" else None)
      print(f"check {kernel} {op} {m}x{n} bm={cfg.block_m} w={cfg.num_warps} "
            f"G={cfg.num_programs}: y bytes equal {same}, amax {amax[1]} / {amax[0]}",
            flush=True)
    fns = [jax.jit(lambda x, cfg=cfg, f=f, pick=pick: f(x, cfg)[pick]) for cfg in cs]
    groups.append((f"{kernel} {op} {m}x{n}", cs, fns, nbytes, xs, d))
_fp8_sweep.run(groups, out, budget_s=BUDGET, t0=T0, num_sms=SMS,
               rounds=int(os.environ.get("ROUNDS", 3)),
               note=f"{__doc__}\nparam_dtype={PARAM_DTYPE.name}",
               describe=lambda c: (f"bm={c.block_m:2d} w={c.num_warps:2d} G={c.num_programs:4d} "
                                   f"tp={int(c.tile_params)} h={int(c.hoist_params)} "
                                   f"ra={int(c.row_amax)} pk={int(c.packed)} cg={int(c.stream_x)} "
                                   f"pp={int(c.packed_params)}"))
