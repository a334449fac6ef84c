"""FP8-input forward + backward under ``jax.vjp`` at N = 16384 with the forward's row split
over programs (docs/fp8_tuning.md#fp8-x-wide-split). The forward that writes mean/rstd
runs slower than the plain forward at this width with whole-row tiles (RMSNorm 4096x16384:
about 103 us against 79; docs/fp8_tuning.md#fp8-x-stats-store); the split-row forwards
(small tiles; split 0 stores the statistics) were never tried there: the rules split
rows only above N = 16384.

Variants of the forward that jax.vjp runs (the backward: the rule's), forced by wrapping
``config.forward_config`` for calls that return mean/rstd at N = 16384:
  rule; multi_wave_cached split over 2 or 4 programs (_split_kernel); static_persistent
  split_rows with W-wide splits of W / 1024 warps, 16384 / W programs a SM, lag 2, early
  publish (_split_persistent_kernel, LayerNorm's rule above 16384); and the plain forward
  alone (no mean/rstd) for reference.
x float8_e4m3fn with float32 scales a group of 16, bf16 scale/bias, y and dx bf16.

Method: each variant compiled after ``jax.clear_caches()``; CUPTI kernel time, median of
10 calls over 3 rotated x, variants interleaved in 5 rounds, the median of the rounds and
each kernel's median; outputs checked against the rule's (max |diff|).

Usage (GPU machine): [EXTRA=1] python benchmarks/fp8_input_wide_split_fwd_ab.py OUT.json
"""
import contextlib
import json
import os
import sys

import jax
import jax.numpy as jnp

import pallas_norm
from pallas_norm import config as C
from pallas_norm.bench import timing

import _fp8_sweep

ROUNDS = 5
G = 16
N = 16384
SHAPES = [(4096, N), (8192, N)]
# EXTRA=1: RMSNorm only, the rule and the split configs around its pick (session 20's
# second run, after the rule took the 1024-wide split)
EXTRA = os.environ.get("EXTRA") == "1"


def variants(sms):
  out = [("rule", None)]
  out.append(("cached split 2x8192 w4 c4096", C.ForwardConfig("multi_wave_cached", 1, 8192, 4,
                                                              chunk_n=4096)))
  out.append(("cached split 2x8192 w8", C.ForwardConfig("multi_wave_cached", 1, 8192, 8)))
  out.append(("cached split 4x4096 w4", C.ForwardConfig("multi_wave_cached", 1, 4096, 4)))
  for w in (1024, 2048, 4096):
    per_sm = N // w
    for lag, early in ((2, True), (1, False)):
      out.append((f"psplit W{w} w{w // 1024} lag{lag}{' early' if early else ''}",
                  C.ForwardConfig("static_persistent", 1, w, w // 1024,
                                  per_sm * sms // (N // w), split_rows=True,
                                  split_lag=lag, split_early_publish=early)))
  if EXTRA:  # around the pick: narrower splits, more warps, a longer lead
    for name, w, warps, per_sm, lag in (("W512 w1 32/SM lag2", 512, 1, 32, 2),
                                        ("W1024 w2 16/SM lag2", 1024, 2, 16, 2),
                                        ("W1024 w1 16/SM lag3", 1024, 1, 16, 3),
                                        ("W1024 w1 8/SM lag2", 1024, 1, 8, 2)):
      out.append((f"psplit {name} early",
                  C.ForwardConfig("static_persistent", 1, w, warps,
                                  max(1, per_sm * sms // (N // w)), split_rows=True,
                                  split_lag=lag, split_early_publish=True)))
  return out


@contextlib.contextmanager
def forced_forward(cfg):
  if cfg is None:
    yield
    return
  rule = C.forward_config

  def forced(m, n, *args, **kw):
    if n == N and kw.get("return_residuals", True):
      return cfg
    return rule(m, n, *args, **kw)
  C.forward_config = forced
  try:
    yield
  finally:
    C.forward_config = rule


def main(out_path):
  copy = timing.torch_copy_gbs(20)
  dev = C.device_info()
  print("device", dev.name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in SHAPES:
    for layer in ((False,) if EXTRA else (False, True)):
      xs8, s, w, b, dy = _fp8_sweep.fp8x_inputs(m, n, G)

      def norm(x_, w_, b_):
        if layer:
          return pallas_norm.layer_norm(x_, w_, b_, x_scale=s, group_size=G)
        return pallas_norm.rms_norm(x_, w_, x_scale=s, group_size=G)

      def fwdbwd(x):
        y, pull = jax.vjp(norm, x, w, b)
        return (y,) + pull(dy)[1:]

      fns, rows, ref = {}, {}, None
      for name, cfg in variants(dev.num_sms):
        if EXTRA and cfg is not None and not (cfg.split_rows and cfg.block_n <= 1024):
          continue
        rows[name] = dict(config=str(cfg))
        try:
          jax.clear_caches()
          with forced_forward(cfg):
            fns[name] = jax.jit(fwdbwd).lower(xs8[0]).compile()
          got = jax.block_until_ready(fns[name](xs8[0]))
          ref = ref or got
          rows[name]["max_abs_diff"] = [
              float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
              for a, r in zip(got, ref) if a is not None]
        except Exception as e:  # a variant that does not compile: recorded
          rows[name]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      jax.clear_caches()
      fns["plain forward"] = jax.jit(lambda x: norm(x, w, b)).lower(xs8[0]).compile()
      rows["plain forward"] = dict(config="rule, no mean/rstd")
      _fp8_sweep.time_rounds(fns, rows, [(x,) for x in xs8], rounds=ROUNDS)
      nbytes = m * n * ((1 + 4 / G + 2) + (2 + 1 + 4 / G + 2))
      for name, row in rows.items():
        if row.get("rounds") and name != "plain forward":
          row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e9 / copy
        print(f"{'layer' if layer else 'rms':5s} {m}x{n} {name:32s} {row.get('us', 0):7.1f} us "
              f"{row.get('pct_copy', 0):5.1f}%  kernels {row.get('kernel_us')} "
              f"{row.get('max_abs_diff', '')} {row.get('error', '')}", flush=True)
      results.append(dict(op="layer" if layer else "rms", m=m, n=n, rows=rows))
  json.dump(dict(device=dev.name, copy_gbs=copy, rounds=ROUNDS, results=results,
                 note=__doc__), open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
