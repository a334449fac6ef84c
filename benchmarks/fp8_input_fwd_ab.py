"""FP8-input forward (issue #27 item 1): launch configs with and without the residuals
the backward needs (mean/rstd, written under jax.vjp), x float8_e4m3fn with float32
scales a group of 16, y bf16; RMSNorm and LayerNorm. Rounds interleaved in one process.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated x, the median of ``ROUNDS`` rounds; % of torch ``copy_`` on the bytes
model read x (1) and its scales (4/16), write y (2) a element; y checked against the
default config's (max |diff|).

Usage (GPU machine): [N8192=1 | N8192P=1 | N16384=1] python benchmarks/fp8_input_fwd_ab.py
OUT.json [bf16|f32]  (scale's and bias's dtype; default f32; N8192P: static_persistent
variants at 8192x8192 where the default is another mode; N16384: whole-row tiles of
static_persistent and multi_wave_cached at N = 16384)
"""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

from pallas_norm import config as C
from pallas_norm.bench import timing
from pallas_norm.kernels import forward as F

ROUNDS = 5
G = 16
SHAPES = [(8192, 4096), (16384, 4096)]
# (block_m, num_warps[, mode]); None = forward_config's pick
VARIANTS = [None, (1, 8), (1, 2), (2, 4), (2, 8), (4, 8), (1, 16)]
if os.environ.get("N8192"):  # N = 8192: the persistent default against multi_wave_cached
  SHAPES = [(8192, 8192)]
  VARIANTS = [None, (1, 8, "multi_wave_cached"), (2, 8, "multi_wave_cached"),
              (2, 16, "multi_wave_cached"), (1, 16, "multi_wave_cached"),
              (4, 16, "multi_wave_cached"), (2, 8), (2, 16)]
if os.environ.get("N8192P"):  # N = 8192 where the default is not persistent (the H100):
  SHAPES = [(8192, 8192)]     # static_persistent at (block_m, warps, mode, programs a SM)
  VARIANTS = [None, (2, 16, "static_persistent", 2), (2, 16, "static_persistent", 1),
              (1, 16, "static_persistent", 2), (2, 8, "static_persistent", 2),
              (2, 8, "static_persistent", 3)]
if os.environ.get("N16384"):  # N = 16384, whole-row tiles of both modes (fp8_tuning.md#fp8-x-wide)
  SHAPES = [(4096, 16384), (8192, 16384)]
  VARIANTS = [None, (1, 16, "static_persistent", 1), (1, 32, "static_persistent", 1),
              (1, 8, "static_persistent", 2), (2, 32, "static_persistent", 1),
              (1, 8, "multi_wave_cached"), (1, 16, "multi_wave_cached"),
              (1, 32, "multi_wave_cached"), (2, 32, "multi_wave_cached")]


def main(out_path):
  copy = timing.torch_copy_gbs(20)
  print("device", C.device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in SHAPES:
    for layer in (False, True):
      sets = []
      for i in range(3):
        k = jax.random.split(jax.random.key(i), 2)
        sets.append(((2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn),
                     jax.random.uniform(k[1], (m, n // G), minval=0.5, maxval=2.0)))
      w = (1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))).astype(PARAM)
      dflt = C.forward_config(m, n, jnp.float8_e4m3fn, subtract_mean=layer)
      rows = {}
      for v in VARIANTS:
        cfg = dflt if v is None else dataclasses.replace(dflt, block_m=v[0], num_warps=v[1])
        if v is not None and v[2:]:
          cfg = dataclasses.replace(cfg, mode=v[2], num_programs=(
              v[3] * C.device_info().num_sms if v[3:] else 0))
        for res in (False, True):
          name = ("default" if v is None else f"bm{v[0]} w{v[1]}{' ' + v[2] if v[2:] else ''}"
                  f"{f' {v[3]}/SM' if v[3:] else ''}") + (" +res" if res else "")
          f = jax.jit(lambda x8, xs, cfg=cfg, res=res: F.norm_forward(
              x8, w, w if layer else None, eps=1e-5, scale_offset=0.0, subtract_mean=layer,
              config=cfg, interpret=False, x_scale=xs, y_dtype=jnp.bfloat16,
              return_residuals=res)[0])
          rows[name] = dict(config=str(cfg), residuals=res, fn=f, rounds=[])
      ref = rows["default"]["fn"](*sets[0])
      for name, row in rows.items():
        try:
          row["max_abs_diff"] = float(jnp.max(jnp.abs(
              row["fn"](*sets[0]).astype(jnp.float32) - ref.astype(jnp.float32))))
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      for _ in range(ROUNDS):
        for row in rows.values():
          if "error" not in row:
            row["rounds"].append(timing.cupti_time(row["fn"], sets, 10).get("us"))
      nbytes = m * n * (1 + 4 / G + 2)
      for name, row in rows.items():
        row.pop("fn")
        if row["rounds"]:
          row["us"] = sorted(row["rounds"])[len(row["rounds"]) // 2]
          row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e9 / copy if copy else None
        print(f"{'layer' if layer else 'rms':5s} {m}x{n} {name:36s} {row.get('us') or 0:7.1f} us "
              f"{row.get('pct_copy') or 0:5.1f}% {row.get('max_abs_diff', '')} "
              f"{row.get('error', '')}", flush=True)
      results.append(dict(op="layer" if layer else "rms", m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS, param=str(PARAM),
                 results=results), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  PARAM = jnp.bfloat16 if sys.argv[2:] == ["bf16"] else jnp.float32
  main(sys.argv[1])
