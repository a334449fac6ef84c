"""FP8-input ops on wide rows (N = 16384, where the kernels chunk or split rows): the
forward modes side by side. x float8_e4m3fn with float32 scales a group of 16, bf16
scale/bias, y and dx bf16; the public ops with ``mode=`` (None: the heuristic), forward
alone and forward + backward under ``jax.vjp`` (x, scale, bias), RMSNorm and LayerNorm at
4096x16384 and 8192x16384.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated inputs, modes interleaved in each of 5 rounds, the median of the rounds;
each kernel's median beside it; % of copy on the kernel bench's bytes model (read x 1 +
scales 4/16, write y 2; + read dy 2, x again, write dx 2 under the backward).

Usage (GPU machine): python benchmarks/fp8_input_wide_modes.py OUT.json
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
MODES = [None, "multi_wave_reload", "static_persistent", "multi_wave_cached"]


def main(out_path):
  copy = timing.torch_copy_gbs(20)
  print("device", C.device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in SHAPES:
    for layer in (False, True):
      xs8, s, w, b, dy = _fp8_sweep.fp8x_inputs(m, n, G)

      def norm(x, w_, b_, mode):
        if layer:
          return pallas_norm.layer_norm(x, w_, b_, x_scale=s, group_size=G, mode=mode)
        return pallas_norm.rms_norm(x, w_, x_scale=s, group_size=G, mode=mode)

      for pas in ("fwd", "fwdbwd"):
        fns = {}
        for mode in MODES:
          if pas == "fwd":
            f = lambda x, mode=mode: norm(x, w, b, mode)
          else:
            def f(x, mode=mode):
              y, pull = jax.vjp(lambda x_, w_, b_: norm(x_, w_, b_, mode), x, w, b)
              return (y,) + pull(dy)[1:]
          fns[str(mode)] = jax.jit(f)
        rows = {}
        for name, f in fns.items():
          try:
            jax.block_until_ready(f(xs8[0]))
            rows[name] = {}
          except Exception as e:  # a mode that refuses the shape: recorded
            rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        _fp8_sweep.time_rounds(fns, rows, [(x,) for x in xs8], rounds=ROUNDS)
        nbytes = m * n * ((1 + 4 / G + 2) + (0 if pas == "fwd" else 2 + 1 + 4 / G + 2))
        for name, row in rows.items():
          if row.get("rounds"):
            row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e9 / copy
          print(f"{'layer' if layer else 'rms':5s} {pas:6s} {m}x{n} {name:18s} "
                f"{row.get('us', 0):7.1f} us {row.get('pct_copy', 0):5.1f}%  "
                f"kernels {row.get('kernel_us')} {row.get('error', '')}", flush=True)
        results.append(dict(op="layer" if layer else "rms", pass_=pas, m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS,
                 results=results, note=__doc__), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
