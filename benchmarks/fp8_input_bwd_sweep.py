"""Launch-config sweep of the FP8-input backward (issue #27 item 1; docs/fp8.md): x in
float8_e4m3fn with float32 scales a group of 16, dy and dx bf16, RMSNorm and LayerNorm,
both stages (``kernels/backward.py``), against the same backward with bf16 x at its
default config, in one process, rounds interleaved.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated dy, the median of ``ROUNDS`` rounds; GB/s on the bytes model read dy (2),
x (1) and its scales (4/16), write dx (2) a element; dx and dscale checked against the
default config's (max |diff|).

Usage (GPU machine): python benchmarks/fp8_input_bwd_sweep.py OUT.json [--stage1-flags]
[--vector] [--wide] [--wide-tile] [--bf16-params] (``--stage1-flags``: the default config with
BackwardConfig.prefetch_stats and joint_row_sums on and off, docs/tuning_rules.md#stage1-flags,
instead of the launch configs; ``--vector``: the launch configs with FP8 x loaded in
runs of 8 elements a thread (``_fp8_sweep.forced_fp8_vector``) and the default config
with 16-value runs beside them, docs/fp8_tuning.md#fp8-x-vector; ``--wide``: rows of 16384
(4096x16384, 8192x16384), the split-row backward's widths, occupancy and lag, and the
row-statistics + column pair (docs/fp8_tuning.md#fp8-x-wide); ``--wide-tile``: the same
rows as one register tile of 16 or 32 warps at one program a SM, with the stage-1 flags
(docs/fp8_tuning.md#fp8-x-wide-tile); ``--occupancy``: [1, N'] x 16
warps at two programs a SM, which fit only in 64 registers a thread, with and without
the flags that free them (BackwardConfig.reload_scale, recompute_dx;
docs/fp8_tuning.md#fp8-x-occupancy; ``--occupancy-widths``: the same 8 elements a thread at
N' = 8192 and 2048); ``--bf16-params``: scale/bias in bf16, not float32)
"""
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from pallas_norm import config as C
from pallas_norm.bench import timing
from pallas_norm.kernels import backward as B
from pallas_norm.kernels import forward as F

import _fp8_sweep

ROUNDS = 5
G = 16
SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192)]
# (block_m, num_warps, programs a SM); None = backward_config's pick
VARIANTS = [None, (1, 8, 2), (1, 8, 3), (1, 16, 1), (2, 16, 1), (2, 8, 2), (1, 4, 4),
            (2, 32, 1), (1, 32, 1), (4, 16, 1)]
# --stage1-flags: BackwardConfig fields set on the default config
FLAG_VARIANTS = [None, dict(prefetch_stats=True), dict(joint_row_sums=True),
                 dict(prefetch_stats=True, joint_row_sums=True)]
# --vector: (variant, FP8 x's load vector forced while it is traced: 8, or 0 for 16)
VECTOR_VARIANTS = [(None, 8), (None, 0), ((2, 16, 1), 8), ((1, 16, 1), 8), ((2, 8, 2), 8),
                   ((2, 32, 1), 8), ((1, 8, 2), 8), ((4, 16, 1), 8), ((1, 32, 1), 0),
                   ((2, 16, 1), 0)]


# --wide: (name, fields of BackwardConfig set on the default, from (default, sms, n)), the
# default being the split-row kernel of W = 512 at 1 warp (docs/tuning_rules.md#bwd-split):
# W and its warps doubled keep the default's programs (as its rule would), ``occupancy``
# scales them; the pair's grid is occupancy x SMs / chunks, as _BWD_CHUNK_OCCUPANCY's.
def _split(w, occupancy=1.0, lag=2, early=False):
  return lambda d, sms, n: dict(split_rows=True, block_n=w, num_warps=w // 512,
                                num_programs=max(1, int(d.num_programs * occupancy)),
                                split_lag=lag, split_early_publish=early)


def _pair(block_n, warps, occupancy=2):
  return lambda d, sms, n: dict(split_rows=False, block_n=block_n, num_warps=warps,
                                num_programs=max(1, occupancy * sms // -(-n // block_n)),
                                prefetch_stats=False, joint_row_sums=False)


def _occ(warps, per_sm, **flags):
  return lambda d, sms, n: dict(block_m=1, num_warps=warps, num_programs=per_sm * sms,
                                prefetch_stats=True, joint_row_sums=True, **flags)


# --occupancy: (name, fields of the config), docs/fp8_tuning.md#fp8-x-occupancy
OCC_VARIANTS = [None,
                ("x16 2/SM recompute+reload", _occ(16, 2, recompute_dx=True,
                                                   reload_scale=True)),
                ("x16 2/SM recompute", _occ(16, 2, recompute_dx=True)),
                ("x16 2/SM reload", _occ(16, 2, reload_scale=True)),
                ("x16 2/SM", _occ(16, 2)),
                ("x16 1/SM recompute+reload", _occ(16, 1, recompute_dx=True,
                                                   reload_scale=True)),
                ("x32 1/SM recompute+reload", _occ(32, 1, recompute_dx=True,
                                                   reload_scale=True))]
OCC_SHAPES = [(8192, 4096), (16384, 4096)]


def _occ8(**flags):  # 8 elements a thread, 1024 threads a SM, at any N'
  return lambda d, sms, n: dict(block_m=1, num_warps=d.block_n // 256,
                                num_programs=max(1, 8192 // d.block_n) * sms,
                                prefetch_stats=True, joint_row_sums=True, **flags)


# --occupancy-widths: the same at N' = 8192 and 2048 ([1, 8192] x 32, 1 a SM; [1, 2048] x
# 8, 4 a SM)
OCC_WIDTH_VARIANTS = [None, ("1024/SM recompute+reload", _occ8(recompute_dx=True,
                                                                reload_scale=True)),
                      ("1024/SM recompute", _occ8(recompute_dx=True)),
                      ("1024/SM reload", _occ8(reload_scale=True)),
                      ("1024/SM", _occ8())]
OCC_WIDTH_SHAPES = [(8192, 8192), (32768, 2048)]
WIDE_SHAPES = [(4096, 16384), (8192, 16384)]
WIDE_VARIANTS = [None, ("split W1024", _split(1024)), ("split W2048", _split(2048)),
                 ("split W512 x0.5", _split(512, 0.5)),
                 ("split W512 lag3", _split(512, 1, 3)),
                 ("split W512 early", _split(512, 1, 3, True)),
                 ("split W1024 early", _split(1024, 1, 3, True)),
                 ("pair 4096 w16", _pair(4096, 16)), ("pair 2048 w8", _pair(2048, 8)),
                 ("pair 4096 w16 x4", _pair(4096, 16, 4))]


def _one_tile(warps, per_sm=1, **flags):
  return lambda d, sms, n: dict(split_rows=False, block_m=1, block_n=n, num_warps=warps,
                                num_programs=per_sm * sms, split_early_publish=False,
                                **flags)


# --wide-tile: a whole row of 16384 as one register tile (the single-tile stage 1 that
# rows up to 8192 take), against the split-row default
WIDE_TILE_VARIANTS = [None, ("one tile w32", _one_tile(32)), ("one tile w16", _one_tile(16)),
                      ("one tile w32 +ps+js", _one_tile(32, prefetch_stats=True,
                                                        joint_row_sums=True)),
                      ("one tile w16 +ps+js", _one_tile(16, prefetch_stats=True,
                                                        joint_row_sums=True)),
                      ("one tile w32 +rdx", _one_tile(32, recompute_dx=True)),
                      ("one tile w16 +rdx+rs", _one_tile(16, recompute_dx=True,
                                                         reload_scale=True))]


def _traced_with(fn, vec):
  """fn with FP8 x's load vector forced to ``vec`` while it is traced (None: the rule)."""
  if vec is None:
    return fn

  def wrapped(*args):
    with _fp8_sweep.forced_fp8_vector(vec):
      return fn(*args)
  return wrapped


def _variant(dflt, v, sms):
  """(name, config) of a VARIANTS / FLAG_VARIANTS entry."""
  if v is None:
    return "default", dflt
  if isinstance(v, dict):
    return "+" + "+".join(v), dataclasses.replace(dflt, **v)
  if callable(v[1]):  # --wide: (name, fields of the config from (default, sms, n))
    return v[0], dataclasses.replace(dflt, **v[1](dflt, sms, dflt_n[0]))
  return f"bm{v[0]} w{v[1]} {v[2]}/SM", dataclasses.replace(
      dflt, block_m=v[0], num_warps=v[1], num_programs=v[2] * sms)


dflt_n = [0]  # the row length _variant's --wide entries size their grids by


def main(out_path, variants=VARIANTS, shapes=None):
  sms = C.device_info().num_sms
  copy = timing.torch_copy_gbs(20)
  print("device", C.device_info().name, "copy GB/s", copy, flush=True)
  results = []
  for m, n in shapes or SHAPES:
    dflt_n[0] = n
    for layer in (False, True):
      k = jax.random.split(jax.random.key(0), 4)
      x8 = (2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn)
      xs = jax.random.uniform(k[1], (m, n // G), minval=0.5, maxval=2.0)
      w = (1 + 0.1 * jax.random.normal(k[2], (n,))).astype(PARAM)
      xb = (x8.astype(jnp.float32) * jnp.repeat(xs, G, axis=1)).astype(jnp.bfloat16)
      dys = [jax.random.normal(jax.random.key(10 + i), (m, n), jnp.bfloat16)
             for i in range(3)]
      fcfg = C.forward_config(m, n, jnp.bfloat16, subtract_mean=layer)
      _, mean, rstd = F.norm_forward(x8, w, w if layer else None, eps=1e-5,
                                     scale_offset=0.0, subtract_mean=layer, config=fcfg,
                                     interpret=False, x_scale=xs, y_dtype=jnp.bfloat16)
      kw = dict(has_bias=layer, scale_offset=0.0, subtract_mean=layer, interpret=False,
                scale_dtype=PARAM, bias_dtype=PARAM)
      dflt = C.backward_config(m, n, jnp.float8_e4m3fn, subtract_mean=layer,
                               param_dtype=PARAM)
      fns = {}
      for v in variants:
        v, vec = v if isinstance(v, tuple) and isinstance(v[-1], int) and len(v) == 2 else (
            v, None)
        name, cfg = _variant(dflt, v, sms)
        name += "" if vec is None else f" v{vec}"
        fns[name] = (jax.jit(_traced_with(lambda dy, cfg=cfg: B.norm_backward(
            dy, x8, w, mean, rstd, config=cfg, x_scale=xs, dx_dtype=jnp.bfloat16, **kw),
            vec)), cfg)
      bf = jax.jit(lambda dy: B.norm_backward(
          dy, xb, w, mean, rstd, config=C.backward_config(m, n, jnp.bfloat16,
                                                          subtract_mean=layer), **kw))
      ref = jax.block_until_ready(fns[next(iter(fns))][0](dys[0]))
      rows = {}
      for name, (f, cfg) in fns.items():
        try:
          got = jax.block_until_ready(f(dys[0]))
          diff = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(got, ref) if a is not None]
          rows[name] = dict(config=str(cfg), max_abs_diff=diff, rounds=[])
        except Exception as e:  # a config that does not compile: recorded
          rows[name] = dict(config=str(cfg), error=f"{type(e).__name__}: {str(e)[:300]}")
      rows["bf16 x, default"] = dict(config="backward_config(bf16)", rounds=[])
      for _ in range(ROUNDS):
        for name, row in rows.items():
          if "error" in row:
            continue
          f = bf if name.startswith("bf16") else fns[name][0]
          row["rounds"].append(timing.cupti_time(f, [(d,) for d in dys], 10).get("us"))
      nbytes = m * n * (2 + 1 + 4 / G + 2)
      for name, row in rows.items():
        if row.get("rounds"):
          us = sorted(row["rounds"])[len(row["rounds"]) // 2]
          row["us"] = us
          row["gbs"] = nbytes / (us * 1e-6) / 1e9
          row["pct_copy"] = 100 * row["gbs"] / copy if copy else None
        print(f"{'layer' if layer else 'rms':5s} {m}x{n} {name:18s} "
              f"{row.get('us') or 0:7.1f} us {row.get('pct_copy') or 0:5.1f}% "
              f"{row.get('max_abs_diff', '')} {row.get('error', '')}", flush=True)
      results.append(dict(op="layer" if layer else "rms", m=m, n=n, rows=rows))
  json.dump(dict(device=C.device_info().name, copy_gbs=copy, rounds=ROUNDS,
                 param=jnp.dtype(PARAM).name, results=results), open(out_path, "w"),
            indent=1)


PARAM = jnp.float32
if __name__ == "__main__":
  PARAM = jnp.bfloat16 if "--bf16-params" in sys.argv[2:] else jnp.float32
  wide_tile = "--wide-tile" in sys.argv[2:]
  wide = "--wide" in sys.argv[2:] or wide_tile
  occ = "--occupancy" in sys.argv[2:]
  occw = "--occupancy-widths" in sys.argv[2:]
  main(sys.argv[1], FLAG_VARIANTS if "--stage1-flags" in sys.argv[2:] else
       VECTOR_VARIANTS if "--vector" in sys.argv[2:] else
       WIDE_TILE_VARIANTS if wide_tile else WIDE_VARIANTS if wide else
       OCC_VARIANTS if occ else OCC_WIDTH_VARIANTS if occw else VARIANTS,
       WIDE_SHAPES if wide else OCC_SHAPES if occ else OCC_WIDTH_SHAPES if occw else None)
