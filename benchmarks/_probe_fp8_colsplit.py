"""One-off A/B (deleted once its result is committed): the static-scale FP8 norm (y
alone) at few rows, Fp8Config.column_splits 1-16 against the default and XLA's jnp chain;
CUPTI kernel time (the bench's timing), 5 rounds of 10 calls interleaved, x rotated."""
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm.bench import timing
from pallas_norm.bench.ab import _inputs, _report
from pallas_norm.kernels import fp8 as kfp8

E4M3 = jnp.float8_e4m3fn
for op in ("rms", "layer"):
  sm = op == "layer"
  for shape in ("1x4096", "8x2048", "8x4096", "8x8192", "64x2048", "64x4096", "64x8192",
                "512x4096"):
    m, n = map(int, shape.split("x"))
    nbytes, xs, _, scale = _inputs(shape, jnp.bfloat16, False)
    bias = jnp.ones_like(scale) * 0.5 if sm else None
    inv = jnp.float32(20.0)
    d = kfp8.fp8_config(m, n, jnp.bfloat16, kernel="delayed", subtract_mean=sm)
    cfgs = {"default": d}
    for cs in (1, 2, 4, 8, 16):
      cfgs[f"cs{cs}"] = kfp8.Fp8Config(1, max(n, 256), d.num_warps, tile_params=True,
                                       column_splits=cs)
    fns = {}
    ref = None
    for name, cfg in cfgs.items():
      f = jax.jit(lambda x, cfg=cfg: kfp8.fp8_norm_delayed(
          x, scale, bias, inv, eps=1e-5, scale_offset=0.0, subtract_mean=sm,
          fp8_dtype=E4M3, transpose=False, interpret=False, config=cfg)[0])
      y = np.asarray(f(xs[0]).astype(jnp.float32))
      ref = y if ref is None else ref
      fns[name] = (f, f"maxdiff={np.abs(y - ref).max():.3g}")
    g = pallas_norm.layer_norm_fp8 if sm else pallas_norm.rms_norm_fp8
    extra = (bias,) if sm else ()
    fns["xla"] = (jax.jit(lambda x: g(x, scale, *extra, y_scale=jnp.float32(0.05),
                                      backend="xla").y), "")
    _report(f"fp8_static {op} {shape}", fns, [(x,) for x in xs], 5, nbytes + m * n)
