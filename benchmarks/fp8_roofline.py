"""What the FP8 output's bytes model allows on this GPU (issue #27, docs/fp8_tuning.md#fp8-roofline).

The FP8-output norm reads x (2 bytes an element) and writes y (1 byte): a 2:1 stream,
unlike the copy (1:1) that the bench's "% of copy" divides by. This script times, per
shape of bf16 x [M, N], the simplest kernels of that same bytes model next to the FP8
norms, so that their "% of copy" can be read against what a kernel with no math at all
reaches:

  copy       torch ``copy_`` of 1 GiB (CUDA events; the bench's reference) and XLA's
             negate (CUPTI);
  cast       x -> float8_e4m3fn, nothing else: torch ``x.to(torch.float8_e4m3fn)``
             (CUDA events), XLA ``x.astype`` (CUPTI), and a Pallas Triton kernel that
             loads a [block_m, N] row block and stores it cast (CUPTI), at several
             row blocks and warp counts;
  read       XLA ``jnp.max(jnp.abs(x))`` (read only, 2 bytes an element);
  fp8 norm   ``rms_norm_fp8`` / ``layer_norm_fp8`` with delayed scaling (one pass, the
             library's default configs), and the bf16 ``rms_norm`` forward (read 2,
             write 2) for comparison.

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``) or CUDA events for
torch, median of 30 calls over 3 rotated input sets (>= 192 MiB, beyond L2). GB/s on each
kernel's own bytes; "% copy" against torch's copy_ GB/s measured in the same process.

Run on the GPU machine (``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` as ``make bench``
sets): ``python benchmarks/fp8_roofline.py OUT.json``. ``--ncu`` instead runs each
Pallas kernel a few times for an ncu session to profile (no timing).
"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_norm
from pallas_norm.bench import timing

E4M3 = jnp.float8_e4m3fn
SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192)]
CAST_TILES = [(1, 4), (1, 8), (2, 8), (4, 16), (8, 16)]  # (block_m, num_warps)


def cast_kernel(x_ref, y_ref):
  y_ref[...] = x_ref[...].astype(jnp.float32).astype(E4M3)


@functools.lru_cache(None)
def pallas_cast(m, n, block_m, num_warps):
  spec = pl.BlockSpec((block_m, n), lambda i: (i, 0))
  return jax.jit(pl.pallas_call(
      cast_kernel, out_shape=jax.ShapeDtypeStruct((m, n), E4M3), grid=(m // block_m,),
      in_specs=[spec], out_specs=spec,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      name=f"roofline_cast_{block_m}x{num_warps}w"))


def candidates(m, n):
  """name -> (jitted fn of (x, w), bytes an element)."""
  ys = jnp.float32(0.05)
  c = {
      "xla_cast": (jax.jit(lambda x, w: x.astype(E4M3)), 3),
      "xla_read_amax": (jax.jit(lambda x, w: jnp.max(jnp.abs(x))), 2),
      "rms_norm_fp8_delayed": (jax.jit(lambda x, w: pallas_norm.rms_norm_fp8(
          x, w, y_scale=ys).y), 3),
      "layer_norm_fp8_delayed": (jax.jit(lambda x, w: pallas_norm.layer_norm_fp8(
          x, w, w, y_scale=ys).y), 3),
      "rms_norm_fp8_current": (jax.jit(lambda x, w: pallas_norm.rms_norm_fp8(x, w).y), 3),
      "rms_norm_bf16_fwd": (jax.jit(lambda x, w: pallas_norm.rms_norm(x, w)), 4),
  }
  for bm, nw in CAST_TILES:
    c[f"pallas_cast_{bm}x{nw}w"] = (lambda x, w, f=pallas_cast(m, n, bm, nw): f(x), 3)
  return c


def main(argv):
  ncu = "--ncu" in argv
  out_path = None if ncu else argv[0]
  import torch
  rows, meta = [], {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "method": "CUPTI kernel time (torch: CUDA events), median of 30 calls "
                              "over 3 rotated input sets; % copy against torch copy_"}
  if not ncu:
    timing.warm_up()
    meta["torch_copy_gbs"] = timing.torch_copy_gbs(30)
    meta["xla_negate_copy"] = timing.measure_copy(jnp.bfloat16, 30)
    print(meta, flush=True)
  for m, n in (SHAPES[:1] if ncu else SHAPES):
    sets = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),
             1 + 0.1 * jax.random.normal(jax.random.key(9), (n,))) for i in range(3)]
    for name, (fn, bpe) in candidates(m, n).items():
      if ncu:
        if name.startswith(("pallas_cast", "rms_norm_fp8", "layer_norm_fp8")):
          for a in sets:
            jax.block_until_ready(fn(*a))
        continue
      try:
        jax.block_until_ready(fn(*sets[0]))
        t = timing.cupti_time(fn, sets, 30)
      except Exception as e:  # noqa: BLE001 (a row that says why)
        t = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
      rows.append(dict(shape=[m, n], name=name, bytes_per_elem=bpe, **t))
    if not ncu:
      tx = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
      t = timing.torch_time(lambda i: tx[i].to(torch.float8_e4m3fn), 3, 30)
      rows.append(dict(shape=[m, n], name="torch_cast", bytes_per_elem=3, **t))
      del tx
      torch.cuda.empty_cache()
    for r in rows:
      if r["shape"] == [m, n] and "us" in r and "gbs" not in r:
        r["gbs"] = r["bytes_per_elem"] * m * n / (r["us"] * 1e-6) / 1e9
        r["pct_copy"] = 100 * r["gbs"] / meta["torch_copy_gbs"]
        print(f"{m}x{n} {r['name']:26s} {r['us']:8.1f} us {r['gbs']:7.0f} GB/s "
              f"{r['pct_copy']:5.1f}% copy", flush=True)
      elif r["shape"] == [m, n] and "us" not in r:
        print(f"{m}x{n} {r['name']:26s} {r.get('reason')}", flush=True)
  if out_path:
    with open(out_path, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
