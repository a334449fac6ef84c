"""The Mosaic GPU forward (kernels/mosaic_forward.py) against the Pallas (Triton
lowering) forward on the GPU: max |diff| of y and rstd, CUPTI kernel time (median of 20
calls over 3 rotated inputs), % of copy on the bytes model (read x, write y), each case
in its own process. Usage (GPU machine): python benchmarks/mosaic_fwd_probe.py."""
import json, subprocess, sys, traceback
CASES = [("rms", 8192, 1024), ("rms", 8192, 2048), ("layer", 8192, 2048), ("rms", 8192, 4096),
         ("layer", 8192, 4096), ("rms", 16384, 4096), ("rms", 4096, 8192),
         ("layer", 4096, 8192)]


def run_case(op, m, n):
  import jax, jax.numpy as jnp
  from pallas_norm.kernels import forward as F, mosaic_forward as MF
  from pallas_norm import config as CF
  from pallas_norm.bench import timing
  layer = op == "layer"
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))
  b = 0.1 * s if layer else None
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(3)]
  kw = dict(eps=1e-5, scale_offset=0.0, subtract_mean=layer, interpret=False)
  fm = jax.jit(lambda x: MF.norm_forward(x, s, b, **kw))
  fp = jax.jit(lambda x: F.norm_forward(x, s, b, config=CF.forward_config(
      m, n, x.dtype, subtract_mean=layer), **kw))
  ym, _, rm = jax.block_until_ready(fm(*xs[0]))
  yp, _, rp = fp(*xs[0])
  out = dict(config=str(MF.forward_config(m, n, jnp.bfloat16, layer)),
             max_abs_diff_y=float(jnp.max(jnp.abs(ym.astype(jnp.float32) - yp.astype(jnp.float32)))),
             max_abs_diff_rstd=float(jnp.max(jnp.abs(rm - rp))))
  copy = timing.torch_copy_gbs(20)
  for name, f in (("mosaic", fm), ("pallas", fp)):
    us = timing.cupti_time(f, xs, 20).get("us")
    out[f"{name}_us"] = us
    out[f"{name}_pct_copy"] = None if not us else 100 * 4 * m * n / (us * 1e-6) / 1e9 / copy
  return out


if __name__ == "__main__":
  if len(sys.argv) > 1:
    op, m, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
      r = dict(ok=True, **run_case(op, m, n))
    except Exception:
      r = dict(ok=False, error=traceback.format_exc()[-1500:])
    print("RESULT " + json.dumps(dict(op=op, m=m, n=n, **r)), flush=True)
  else:
    for c in CASES:
      p = subprocess.run([sys.executable, __file__, *map(str, c)], capture_output=True,
                         text=True, timeout=150)
      lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
      print(lines[-1] if lines else f"NO RESULT {c} rc={p.returncode} {p.stderr[-1500:]}",
            flush=True)
