"""FP8-input forward + backward under ``jax.vjp`` at N = 16384: the forward's mode and
FP8 x's load vector side by side (docs/fp8_tuning.md#fp8-x-wide-vjp). The forward that writes
mean/rstd ran slower than the plain forward at these widths (RMSNorm 4096x16384: 102.9 us
under jax.vjp against 79.3 alone), and in ptxas's output (sm_90a, on CPU) the
multi_wave_cached RMSNorm kernel that writes rstd converts its tiles through shared memory
(20 STS / 20 LDS, 21 barriers) with the 16-value FP8 loads the rule keeps for it
(``forward._FP8_VECTOR_16``), and not with runs of 8 (5 / 6, 7).

Variants, each (mode, vector): the rule (None, None); multi_wave_cached and
static_persistent (``mode=``, the mode's default tile) with runs of 8 (8) or 16 values
(0), RMSNorm and LayerNorm. x float8_e4m3fn with float32 scales a group of 16, bf16
scale/bias, y and dx bf16; the public ops.

Method: each variant compiled ahead of time after ``jax.clear_caches()`` (the ops'
module-level jit would hand every variant the first one's trace) with the vector forced
while it is traced (``_fp8_sweep.forced_fp8_vector``); CUPTI kernel time, median of 10
calls over 3 rotated x, variants interleaved in 5 rounds, the median of the rounds and
each kernel's median; outputs checked against the rule's (max |diff|).

Usage (GPU machine): python benchmarks/fp8_input_wide_vjp_ab.py OUT.json
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
SHAPES = [(4096, 16384), (8192, 16384)]
# (name, mode, vector): None is the rule's
VARIANTS = [("rule", None, None),
            ("cached v8", "multi_wave_cached", 8), ("cached v16", "multi_wave_cached", 0),
            ("persistent v8", "static_persistent", 8),
            ("persistent v16", "static_persistent", 0)]


def main(out_path):
  copy = timing.torch_copy_gbs(20)
  print("device", C.device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in SHAPES:
    for layer in (False, True):
      xs8, s, w, b, dy = _fp8_sweep.fp8x_inputs(m, n, G)

      def fwdbwd(x, mode):
        def norm(x_, w_, b_):
          if layer:
            return pallas_norm.layer_norm(x_, w_, b_, x_scale=s, group_size=G, mode=mode)
          return pallas_norm.rms_norm(x_, w_, x_scale=s, group_size=G, mode=mode)
        y, pull = jax.vjp(norm, x, w, b)
        return (y,) + pull(dy)[1:]

      fns, rows, ref = {}, {}, None
      for name, mode, vec in VARIANTS:
        try:
          fns[name] = _fp8_sweep.compiled_with_vector(lambda x, mode=mode: fwdbwd(x, mode),
                                                      vec, xs8[0])
          got = jax.block_until_ready(fns[name](xs8[0]))
          ref = ref or got
          rows[name] = dict(max_abs_diff=[
              float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
              for a, r in zip(got, ref) if a is not None])
        except Exception as e:  # a variant that does not compile: recorded
          rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
      _fp8_sweep.time_rounds(fns, rows, [(x,) for x in xs8], rounds=ROUNDS)
      nbytes = m * n * ((1 + 4 / G + 2) + (2 + 1 + 4 / G + 2))
      for name, row in rows.items():
        if row.get("rounds"):
          row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e9 / copy
        print(f"{'layer' if layer else 'rms':5s} {m}x{n} {name:15s} {row.get('us', 0):7.1f} us "
              f"{row.get('pct_copy', 0):5.1f}%  kernels {row.get('kernel_us')} "
              f"{row.get('max_abs_diff', '')} {row.get('error', '')}", flush=True)
      results.append(dict(op="layer" if layer else "rms", m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS,
                 results=results, note=__doc__), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
