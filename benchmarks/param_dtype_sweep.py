"""Forward launch configs with float32 scale/bias and bf16 x (the functional API called
with float32 parameters), Pallas backend: what the default loses against bf16
parameters, and which config wins back the difference (docs/tuning_rules.md#f32-params).

Per shape, in one process (a fault loses that shape only): the default config with bf16
scale/bias, the default with float32 scale/bias, then float32 scale/bias with each
variant of VARIANTS (multi_wave_cached row blocks, and static_persistent one-tile
programs, which load scale/bias once a program). The forward writes mean/rstd (as under
``jax.vjp``). Also the backward (both stages) at its default, bf16 against float32
parameters. CUPTI kernel time, median of 20 calls over 3 rotated inputs; % of torch
``copy_`` on the bytes model (forward: read x, write y; backward: read x and dy, write
dx); max |y - y of the default| per variant.

Usage (GPU machine): python benchmarks/param_dtype_sweep.py [--out FILE.json]
         or, one shape: python benchmarks/param_dtype_sweep.py OP M N
"""

import _per_shape

SHAPES = [("layer", 4096, 8192), ("layer", 8192, 4096), ("rms", 4096, 8192),
          ("rms", 8192, 4096), ("layer", 8192, 2048), ("rms", 8192, 2048)]
# (mode, block_m, num_warps, programs a SM or 0): block_n is N rounded up to a power of 2
VARIANTS = [("multi_wave_cached", bm, w, 0) for bm in (1, 2, 4) for w in (4, 8, 16)] + [
    ("static_persistent", bm, w, a) for bm in (1, 2) for w in (8, 16) for a in (1, 2)]


def run_shape(op, m, n):
  import jax
  import jax.numpy as jnp
  from pallas_norm import config as CF
  from pallas_norm.bench import timing
  from pallas_norm.kernels import backward as B
  from pallas_norm.kernels import forward as F
  layer = op == "layer"
  sms = CF.device_info().num_sms
  copy = timing.torch_copy_gbs(20)
  k = jax.random.split(jax.random.key(0), 3)
  s32 = 1 + 0.1 * jax.random.normal(k[0], (n,), jnp.float32)
  b32 = 0.1 * jax.random.normal(k[1], (n,), jnp.float32) if layer else None
  s16, b16 = s32.astype(jnp.bfloat16), None if b32 is None else b32.astype(jnp.bfloat16)
  xs = [jax.random.normal(jax.random.key(10 + i), (m, n), jnp.bfloat16) for i in range(3)]
  dys = [jax.random.normal(jax.random.key(20 + i), (m, n), jnp.bfloat16) for i in range(3)]
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
  dflt = CF.forward_config(m, n, jnp.bfloat16, subtract_mean=layer)
  rows = []

  shape = dict(op=op, m=m, n=n)

  def pct(us, streams):
    return _per_shape.pct_of_copy(us, streams, m, n, 2, copy)

  def fwd_row(name, cfg, s, b, ref=None):
    def measure(row):
      f = jax.jit(lambda x: F.norm_forward(x, s, b, config=cfg, **kw))
      y = jax.block_until_ready(f(xs[0]))[0]
      if ref is not None:
        row["max_abs_diff_y"] = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
      row["us"] = timing.cupti_time(f, [(x,) for x in xs], 20).get("us")
      row["pct_copy"] = pct(row["us"], 2)
      return y
    return _per_shape.record(rows, shape, dict(kind="fwd", params=str(s.dtype),
                                               variant=name, config=str(cfg)), measure)

  fwd_row("default", dflt, s16, b16)
  y32 = fwd_row("default", dflt, s32, b32).astype(jnp.float32)
  bn = CF.next_power_of_2(n)
  for mode, bm, w, a in VARIANTS:
    progs = 0 if not a else min(a * sms, CF.cdiv(m, bm))
    cfg = CF.ForwardConfig(mode, bm, bn, w, progs)
    fwd_row(f"{mode} [{bm}, {bn}] x {w}" + (f", {a} a SM" if a else ""), cfg, s32, b32, y32)

  # the backward at its default, bf16 against float32 parameters
  bcfg = CF.backward_config(m, n, jnp.bfloat16, subtract_mean=layer)
  for s, b in ((s16, b16), (s32, b32)):
    def measure(row, s=s, b=b):
      _, mu, r = F.norm_forward(xs[0], s, b, config=dflt, **kw)
      bkw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=False,
                 scale_dtype=s.dtype, bias_dtype=None if b is None else b.dtype)
      g = jax.jit(lambda dy, x: B.norm_backward(dy, x, s, mu, r, config=bcfg, **bkw))
      jax.block_until_ready(g(dys[0], xs[0]))
      row["us"] = timing.cupti_time(g, [(dy, xs[0]) for dy in dys], 20).get("us")
      row["pct_copy"] = pct(row["us"], 3)
    _per_shape.record(rows, shape, dict(kind="bwd", params=str(s.dtype), variant="default",
                                        config=str(bcfg)), measure)
  return dict(device=CF.device_info().name, copy_gbs=copy, rows=rows)


def _line(op, m, n, row):
  return (f"{op:5s} {m}x{n} {row['kind']} {row['params']:8s} "
          f"{row.get('us') or 0:8.1f} us {row.get('pct_copy') or 0:5.1f}% "
          f"{row['variant']} {row.get('max_abs_diff_y', '')} {row.get('error', '')}")


if __name__ == "__main__":
  _per_shape.main(__file__, run_shape, SHAPES, _line, timeout=240)
