"""A/B of ``kernels.forward.FP8_X_VECTOR`` (docs/fp8.md#fp8-x-vector): the public FP8-input
ops (x float8_e4m3fn, float32 scales a group of 16, bf16 scale/bias, y and dx bf16) with
the FP8 x tile loaded in runs of 16 elements a thread (0) or 8, per kernel:
"v0" everywhere 0, "v8" everywhere 8, "fwd8" the forward kernels 8 and the backward's 0,
"primal8" only the forward without residuals (outside jax.vjp) 8. The forward alone
(outside jax.vjp) and the forward + backward (jax.vjp, then the pullback of a bf16 dy),
RMSNorm and LayerNorm at 8192x4096, 16384x4096, 8192x8192, at the default configs.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated inputs, variants interleaved in each of ROUNDS rounds, the median of the
rounds; each kernel's median beside it. Outputs checked bitwise against "v0".

Usage (GPU machine): python benchmarks/fp8_x_vector_ab.py OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp

import pallas_norm
from pallas_norm import config as C
from pallas_norm.bench import timing
from pallas_norm.kernels import backward as B
from pallas_norm.kernels import forward as F

ROUNDS = 5
G = 16
SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192)]
# variant: (vector of the forward without residuals, with residuals, the backward)
VARIANTS = {"v0": (0, 0, 0), "v8": (8, 8, 8), "fwd8": (8, 8, 0), "primal8": (8, 0, 0)}
_ORIG = (F.norm_forward, B.norm_backward)
_VEC = [VARIANTS["v0"]]


def _forward(*a, **k):
  vec = _VEC[0][0 if not k.get("return_residuals", True) else 1]
  old, F.FP8_X_VECTOR = F.FP8_X_VECTOR, vec
  try:
    return _ORIG[0](*a, **k)
  finally:
    F.FP8_X_VECTOR = old


def _backward(*a, **k):
  old, F.FP8_X_VECTOR = F.FP8_X_VECTOR, _VEC[0][2]
  try:
    return _ORIG[1](*a, **k)
  finally:
    F.FP8_X_VECTOR = old


F.norm_forward, B.norm_backward = _forward, _backward


def _traced(fn, variant):
  def wrapped(*args):
    _VEC[0] = VARIANTS[variant]
    return fn(*args)
  return jax.jit(wrapped)


def main(out_path):
  copy = timing.torch_copy_gbs(20)
  print("device", C.device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in SHAPES:
    for layer in (False, True):
      k = jax.random.split(jax.random.key(0), 4)
      xs8 = [(2 * jax.random.normal(jax.random.key(20 + i), (m, n))).astype(
          jnp.float8_e4m3fn) for i in range(3)]
      s = jax.random.uniform(k[1], (m, n // G), minval=0.5, maxval=2.0)
      w = (1 + 0.1 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16)
      b = (0.1 * jax.random.normal(k[3], (n,))).astype(jnp.bfloat16)
      dy = jax.random.normal(jax.random.key(9), (m, n), jnp.bfloat16)

      def op(x):
        if layer:
          return pallas_norm.layer_norm(x, w, b, x_scale=s, group_size=G)
        return pallas_norm.rms_norm(x, w, x_scale=s, group_size=G)

      def fwdbwd(x):
        y, pull = jax.vjp(lambda w_, b_: (pallas_norm.layer_norm(
            x, w_, b_, x_scale=s, group_size=G) if layer else pallas_norm.rms_norm(
                x, w_, x_scale=s, group_size=G)), w, b)
        return (y,) + pull(dy)

      for pas, fn in (("fwd", op), ("fwdbwd", fwdbwd)):
        fns = {v: _traced(fn, v) for v in VARIANTS}
        ref = jax.block_until_ready(fns["v0"](xs8[0]))
        rows = {}
        for v, f in fns.items():
          got = jax.block_until_ready(f(xs8[0]))
          same = all(bool(jnp.array_equal(a, r)) for a, r in
                     zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
          rows[v] = dict(bitwise_equal_v0=same, rounds=[], kernel_us=[])
        for _ in range(ROUNDS):
          for v, f in fns.items():
            t = timing.cupti_time(f, [(x,) for x in xs8], 10)
            rows[v]["rounds"].append(t.get("us"))
            rows[v]["kernel_us"].append(t.get("kernel_us"))
        for v, row in rows.items():
          r = sorted(row["rounds"])
          row["us"] = r[len(r) // 2]
          ks = row["kernel_us"]
          row["kernel_us"] = [round(sorted(c)[len(c) // 2], 2) for c in zip(*ks)]
          print(f"{'layer' if layer else 'rms':5s} {pas:6s} {m}x{n} {v:8s} "
                f"{row['us']:7.1f} us  kernels {row['kernel_us']}  bitwise="
                f"{row['bitwise_equal_v0']}", flush=True)
        results.append(dict(op="layer" if layer else "rms", pass_=pas, m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS,
                 results=results, note=__doc__), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
