"""Probe (lead): does mosaic_backward compile and run on jax 0.11 once plgpu.kernel gets
Lane lowering semantics (0.11 changed the default to Warpgroup, which runs layout
inference)? Each case in its own subprocess. Usage (GPU machine): python benchmarks/mosaic_bwd_probe.py (its cases), or ... OP M N LANE
BM STAGES BW NOSCALE G (one case; 0 = the default config's value)."""
import json, os, subprocess, sys, time, traceback
CASES = [("rms", 8192, 4096, 0, 0, 0, 0, 0, 0), ("layer", 8192, 4096, 0, 0, 0, 0, 0, 0),
         ("rms", 8192, 2048, 0, 0, 0, 0, 0, 0), ("layer", 8192, 2048, 0, 0, 0, 0, 0, 0),
         ("rms", 8192, 1024, 0, 0, 0, 0, 0, 0), ("rms", 16384, 4096, 0, 0, 0, 0, 0, 0)]

def run_case(op, m, n, lane, bm=0, stages=0, bw=0, noscale=0, g=0):
  import jax, jax.numpy as jnp, numpy as np
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if lane:
    import functools
    orig = plgpu.kernel
    @functools.wraps(orig)
    def kernel(*a, **k):
      k.setdefault("compiler_params", plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane))
      return orig(*a, **k)
    plgpu.kernel = kernel
  from pallas_norm.kernels import mosaic_backward as MB, backward as B
  from pallas_norm import config as CF
  layer = op == "layer"
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (m, n), jnp.bfloat16)
  dy = jax.random.normal(k[1], (m, n), jnp.bfloat16)
  s = 1 + 0.1 * jax.random.normal(k[2], (n,))
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1) if layer else None
  var = ((xf - (mean[:, None] if layer else 0)) ** 2).mean(-1)
  rstd = jax.lax.rsqrt(var + 1e-5)
  kw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=False,
            scale_dtype=jnp.float32, bias_dtype=jnp.float32 if layer else None)
  out = {}
  t0 = time.time()
  import dataclasses
  cfg = MB.backward_config(m, n, x.dtype, layer)
  if bm:
    cfg = dataclasses.replace(cfg, block_m=bm, num_programs=min(cfg.num_programs, -(-m // bm)))
  if stages:
    cfg = dataclasses.replace(cfg, num_stages=stages)
  if bw:
    cfg = dataclasses.replace(cfg, block_w=bw)
  if noscale:
    s = None
  if g:
    cfg = dataclasses.replace(cfg, num_programs=g)
  out["config"] = str(cfg)
  f = jax.jit(lambda dy, x, s, mu, r: MB.norm_backward(dy, x, s, mu, r, config=cfg, **kw))
  got = jax.block_until_ready(f(dy, x, s, mean, rstd))
  out["compile_run_s"] = time.time() - t0
  ref = B.norm_backward(dy, x, s, mean, rstd, config=CF.backward_config(m, n, x.dtype, subtract_mean=layer), **kw)
  out["max_abs_diff"] = [None if g is None else float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))) for g, r in zip(got, ref)]
  if m >= 8192 and out["max_abs_diff"][0] is not None:
    from pallas_norm.bench import timing
    sets = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16), x, s, mean, rstd) for i in range(3)]
    out["mosaic_us"] = timing.cupti_time(f, sets, 20).get("us")
    g2 = jax.jit(lambda dy, x, s, mu, r: B.norm_backward(dy, x, s, mu, r, config=CF.backward_config(m, n, x.dtype, subtract_mean=layer), **kw))
    jax.block_until_ready(g2(*sets[0]))
    out["pallas_us"] = timing.cupti_time(g2, sets, 20).get("us")
  return out

if __name__ == "__main__":
  if len(sys.argv) > 1:
    op, m, n, lane, bm, st, bw, ns, g = sys.argv[1], *map(int, sys.argv[2:10])
    try:
      r = dict(ok=True, **run_case(op, m, n, lane, bm, st, bw, ns, g))
    except Exception as e:
      r = dict(ok=False, error=traceback.format_exc()[-1800:])
    print("RESULT " + json.dumps(dict(op=op, m=m, n=n, lane=lane, bm=bm, stages=st, bw=bw, noscale=ns, g=g, **r)), flush=True)
  else:
    for c in CASES:
      p = subprocess.run([sys.executable, __file__, *map(str, c)], capture_output=True, text=True, timeout=150)
      lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
      print(lines[-1] if lines else f"NO RESULT {c} rc={p.returncode} {p.stderr[-1500:]}", flush=True)
