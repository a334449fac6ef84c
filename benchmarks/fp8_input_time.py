"""FP8-input norm timing (issue #27 item 1): backend="pallas" and "triton" against the
same computation in jnp under jit (reference.dequantise, then reference.norm), forward
and forward+backward, e4m3 x with groups of 16, bf16 y, on one GPU.

Run on the GPU machine: ``python benchmarks/fp8_input_time.py OUT.json`` (with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` as ``make bench`` sets). Method: CUPTI
kernel time (``pallas_norm.bench.timing.cupti_time``), median of 30 calls over 3 rotated
input sets; GB/s on the bytes model in the JSON's meta; % of the copy measured by
``timing.measure_copy`` (XLA's negate of 1 GiB, in the same process). Results:
docs/fp8_tuning.md#fp8-gpu.
"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import pallas_norm
from pallas_norm import reference
from pallas_norm.bench import timing

out_path = sys.argv[1]
G = 16
rows = []
copy = timing.measure_copy(jnp.bfloat16, 30)
print("copy", copy, flush=True)
for (m, n) in [(8192, 4096), (16384, 4096), (8192, 8192)]:
  for layer in (False, True):
    sets = []
    for i in range(3):
      k = jax.random.split(jax.random.key(i), 4)
      x8 = (2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn)
      xs = jax.random.uniform(k[1], (m, n // G), minval=0.5, maxval=2.0)
      w = 1 + 0.1 * jax.random.normal(k[2], (n,))
      b = 0.1 * jax.random.normal(k[3], (n,)) if layer else None
      dy = jax.random.normal(k[3], (m, n), jnp.bfloat16)
      sets.append((x8, xs, w, b, dy))
    eps = 1e-5 if layer else float(jnp.finfo(jnp.float32).eps)
    def op(backend):
      if backend == "jnp":
        return lambda x8, xs, w, b: reference.norm(reference.dequantise(x8, xs), w, b, eps=eps,
                                                   subtract_mean=layer, out_dtype=jnp.bfloat16)[0]
      if layer:
        return lambda x8, xs, w, b: pallas_norm.layer_norm(x8, w, b, x_scale=xs, eps=eps, backend=backend)
      return lambda x8, xs, w, b: pallas_norm.rms_norm(x8, w, x_scale=xs, eps=eps, backend=backend)
    e = m * n
    byt = {"fwd": e * (1 + 4 / G + 2), "fwdbwd": e * (1 + 4 / G + 2) + e * (1 + 4 / G + 2 + 2)}
    ref_y = None
    for backend in ("pallas", "triton", "jnp"):
      f = op(backend)
      fwd = jax.jit(lambda x8, xs, w, b, dy, f=f: f(x8, xs, w, b))
      def fb(x8, xs, w, b, dy, f=f):
        y, pull = jax.vjp(lambda x, w, b: f(x, xs, w, b), x8, w, b)
        return y, pull(dy)
      fwdbwd = jax.jit(fb)
      y = fwd(*sets[0])
      if ref_y is None:
        ref_y = y
      err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y.astype(jnp.float32))))
      for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        jax.block_until_ready(fn(*sets[0]))
        t = timing.cupti_time(fn, sets, 30)
        us = t.get("us")
        gbs = byt[name] / (us * 1e-6) / 1e9 if us else None
        r = dict(shape=[m, n], op="layer" if layer else "rms", pass_=name, impl=backend, us=us,
                 gbs=gbs, pct_copy=(100 * gbs / copy["copy_gbs"]) if gbs and copy.get("copy_gbs") else None,
                 err_y_vs_pallas=err, kernels=t.get("kernels"))
        rows.append(r)
        print(f"{m}x{n} {r['op']:5s} {name:6s} {backend:6s} {us if us is None else round(us,1)} us "
              f"{gbs and round(gbs)} GB/s {r['pct_copy'] and round(r['pct_copy'])}% copy err_y {err:.2e}", flush=True)
meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, group_size=G,
            method="CUPTI kernel time of every kernel of a call, median of 30 over 3 rotated input sets",
            bytes="fwd: x 1 B + x_scale 4/G B + y 2 B an element; fwdbwd: fwd + (x 1 + 4/G, dy 2, dx 2)",
            copy=copy, commit=timing.git_commit())
json.dump(dict(meta=meta, rows=rows), open(out_path, "w"), indent=1)
