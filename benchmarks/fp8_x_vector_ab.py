"""A/B of FP8 x's load vector (``kernels.forward._fp8_vector``, docs/fp8_tuning.md#fp8-x-vector):
the public FP8-input ops (x float8_e4m3fn, float32 scales a group of 16, bf16 scale/bias,
y and dx bf16) with the FP8 x tile loaded in runs of 16 elements a thread ("v0", the
loads before the rule), of 8 ("v8"), or by the rule ("rule": runs of 8 but in the kernels
of ``_FP8_VECTOR_16``). The forward alone (outside jax.vjp) and the forward + backward
(jax.vjp, then the pullback of a bf16 dy), RMSNorm and LayerNorm at 8192x4096,
16384x4096, 8192x8192, 32768x2048 and 4096x16384 (rows split or chunked), at the default
configs.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated inputs, variants interleaved in each of ROUNDS rounds, the median of the
rounds; each kernel's median beside it. Outputs checked bitwise against "v0". Each
variant is compiled ahead of time after ``jax.clear_caches()`` (the ops' module-level
jit caches its trace, which would give every variant the first one's kernels).

Usage (GPU machine): python benchmarks/fp8_x_vector_ab.py OUT.json
"""
import json
import sys

import jax
import jax.numpy as jnp

import pallas_norm
from pallas_norm import config as C
from pallas_norm.bench import timing
import _fp8_sweep

ROUNDS = 5
G = 16
SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192), (32768, 2048), (4096, 16384)]
# variant: the vector forced while it is traced (None: the rule, forward._fp8_vector)
VARIANTS = {"v0": 0, "v8": 8, "rule": None}


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
        fns = {v: _fp8_sweep.compiled_with_vector(fn, VARIANTS[v], xs8[0])
               for v in VARIANTS}
        ref = jax.block_until_ready(fns["v0"](xs8[0]))
        hlo0 = fns["v0"].as_text()
        rows = {}
        for v, f in fns.items():
          got = jax.block_until_ready(f(xs8[0]))
          same = all(bool(jnp.array_equal(a, r)) for a, r in
                     zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
          # the compiled program holds other kernels than v0's (a check on the A/B)
          rows[v] = dict(bitwise_equal_v0=same, program_differs_v0=f.as_text() != hlo0)
        _fp8_sweep.time_rounds(fns, rows, [(x,) for x in xs8], rounds=ROUNDS)
        for v, row in rows.items():
          print(f"{'layer' if layer else 'rms':5s} {pas:6s} {m}x{n} {v:8s} "
                f"{row['us']:7.1f} us  kernels {row['kernel_us']}  bitwise="
                f"{row['bitwise_equal_v0']} differs={row['program_differs_v0']}", flush=True)
        results.append(dict(op="layer" if layer else "rms", pass_=pas, m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS,
                 results=results, note=__doc__), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
