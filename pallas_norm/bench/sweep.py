"""Launch-config sweeps of the Pallas kernels: ``python -m pallas_norm.bench sweep``.

The measurements behind ``pallas_norm/config.py``. For each shape it times candidate
ForwardConfigs (every mode) and BackwardConfigs by calling the launchers directly,
prints the best per (shape, kernel) with GB/s on the bytes model (forward
2*M*N*itemsize; backward 3*M*N*itemsize: read x, dy, write dx), and writes every row to
a JSON file. Method as in the kernel bench: CUPTI kernel time (summed over the kernels of
one call; the backward is stage 1 + 2), inputs rotated over >= 4x L2, median of --iters.
max_err is the largest |difference| from the XLA reference (y forward, dx backward) on
the first input. bf16 inputs, GPU only (``--dry-run`` lists the candidates anywhere).

``--grid`` picks the candidates (each grid has its own defaults for the other flags):
  default               every mode's tiles and warps, G = 2 or 4 programs a SM
  split                 the split-row multi_wave_cached forward: block_n 8192 at 4, 8
                        and 16 warps, 16384 at 8 and 16, beside the default config
  split-bwd             the split-row backward: 2048-wide splits at 4 warps, 2-4
                        programs a SM, split_lag 0-3; 2048 at 8 warps, 4096 at 4 and 8;
                        beside the defaults, the pair and the reload-row kernel
  reload-bwd            the reload-row backward: block_n 2048-8192, block_m 1 or 2,
                        8/16/32 warps, 1 or 2 programs a SM
  reload-bwd-stages     the same at block_m 2 and 4 and num_stages 1-3, G = SMs
  ln-fwd-tiles          LayerNorm forward tiles (cached tiles of 1024-32768 elements at
                        1-16 warps; persistent and reload for N > 8192)
  narrow-bwd-tiles      the 32768x128 backward: [8-128, 128] tiles, 2-8 warps, G = 1-4
                        programs a SM
  narrow-bwd-programs   the 32768x128 backward at its default tile, G in (528, 512, 384,
                        264, 256, 128), each twice

Which results file each grid wrote, and which rule it backs: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp

from pallas_norm import config as C
from pallas_norm import reference
from pallas_norm.bench import timing
from pallas_norm.kernels import backward, forward

_L2_BYTES = 64 << 20
_GPU_SMS = 132  # H100 and H200: what --dry-run plans for off the GPU
_DEFAULT_SHAPES = ("4096x1024,4096x4096,4096x8192,8192x5120,32768x128,16384x16384,"
                   "4096x65536,1024x262144")


# --------------------------------------------------------------------------- grids
# Each candidate function is (m, n, num_sms, op) -> [config]; op is "rms" or "layer".


def _tiles(m, bn, sizes):
  """Row-block sizes block_m giving tiles of ``sizes`` elements (block_m <= M)."""
  return sorted({max(1, t // bn) for t in sizes if max(1, t // bn) <= C.next_power_of_2(m)})


def _warps(tile):
  # 8 to 64 elements a thread (tokamax uses <= 4 warps, i.e. many elements a thread)
  return sorted({max(1, min(32, tile // d)) for d in (2048, 1024, 512, 256)})


def _default_fwd(m, n, num_sms, op):
  del op
  bn_full = C.next_power_of_2(n)
  out = []
  if bn_full <= 32768:
    for bm in _tiles(m, bn_full, (2048, 4096, 8192, 16384, 32768)):
      for nw in _warps(bm * bn_full):
        out.append(C.ForwardConfig("multi_wave_cached", bm, bn_full, nw))
        if bn_full <= 4096:
          for g in (2 * num_sms, 4 * num_sms):
            out.append(C.ForwardConfig("static_persistent", bm, bn_full, nw, g))
  for bn in (4096, 8192):
    if bn >= bn_full:
      continue
    for nw, st in itertools.product((8, 16), (1, 3)):
      out.append(C.ForwardConfig("multi_wave_reload", 1, bn, nw, 0, st))
    if bn_full >= 65536:
      for g, st in itertools.product((num_sms // 4, num_sms // 2, num_sms), (1, 3)):
        out.append(C.ForwardConfig("static_persistent", 1, bn, 16, g, st))
  return out


def _default_bwd(m, n, num_sms, op):
  del op
  bn_full = C.next_power_of_2(n)

  def cfg(bm, bn, nw, g, st):
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            num_stages=st, **C.reduce_config(n, g))

  out = []
  if bn_full <= 16384:
    for bm in _tiles(m, bn_full, (2048, 4096, 8192, 16384)):
      for nw, g, st in itertools.product(_warps(bm * bn_full), (num_sms, 2 * num_sms),
                                         (1, 2)):
        out.append(cfg(bm, bn_full, nw, g, st))
  for bn in (2048, 4096, 8192):
    if bn >= bn_full:
      continue
    k = C.cdiv(n, bn)
    for bm, g in itertools.product((1, 2), sorted({max(1, c * num_sms // k)
                                                   for c in (1, 2, 4)})):
      out.append(cfg(bm, bn, bn * bm // 256, g, 1))
  return out


def _split_fwd(m, n, sms, op):
  cands = [C.forward_config(m, n, None, subtract_mean=op == "layer")]
  for bn, nw in ((8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16)):
    if bn < n and -(-n // bn) <= sms:
      cands.append(C.ForwardConfig("multi_wave_cached", 1, bn, nw))
  return cands


def _split_bwd(m, n, sms, op):
  del op
  cands = [C.backward_config(m, n, None),  # RMSNorm's and LayerNorm's differ only in
           C.backward_config(m, n, None, subtract_mean=True)]  # the reload's tile
  g = max(1, 2 * sms // C.cdiv(n, 4096))
  cands.append(C.BackwardConfig(block_m=1, block_n=4096, num_warps=16, num_programs=g,
                                **C.reduce_config(n, g)))  # the pair
  if C.next_power_of_2(n) <= 32768:
    cands.append(C.BackwardConfig(block_m=1, block_n=4096, num_warps=16, num_programs=sms,
                                  reload_rows=True, **C.reduce_config(n, sms)))

  def split(bn, nw, occ, lag):
    g = max(1, min(m, occ * sms // C.cdiv(n, bn)))
    return C.BackwardConfig(block_m=1, block_n=bn, num_warps=nw, num_programs=g,
                            split_rows=True, split_lag=lag, **C.reduce_config(n, g))

  for occ in (2, 3, 4):
    for lag in (1, 2, 3):
      cands.append(split(2048, 4, occ, lag))
  cands += [split(2048, 4, 4, 0), split(2048, 8, 4, 2), split(4096, 4, 2, 2),
            split(4096, 8, 2, 2)]
  return [c for i, c in enumerate(cands) if c not in cands[:i]
          and (not c.split_rows or C.cdiv(n, c.block_n) <= sms)]


def _reload_bwd(m, n, sms, op, *, grid):
  del op
  def cfg(bm, bn, nw, g, **kw):
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **kw, **C.reduce_config(n, g))

  cands = [C.backward_config(m, n, None),  # RMSNorm's default (the split-row kernel)
           C.backward_config(m, n, None, subtract_mean=True)]  # the pair
  if grid == "wide":  # the first sweep: tile shapes and programs a SM
    for bn in (2048, 4096, 8192):
      if bn >= n:
        continue
      for nw in (8, 16, 32):
        if n // (32 * nw) > 64:  # more than 64 partial registers a thread
          continue
        for bm in (1, 2):
          for occ in ((1,) if nw == 32 else (1, 2)):  # 2 x 32 warps: the thread limit
            cands.append(cfg(bm, bn, nw, occ * sms, reload_rows=True))
  else:  # the second: row blocks of 2 and 4 and Triton's pipeliner (num_stages)
    tiles = [(bm, bn, nw) for bm in (2, 4) for bn, nw in
             ((2048, 8), (4096, 8), (4096, 16), (8192, 32), (2048, 16), (8192, 8))]
    for bm, bn, nw in tiles:
      if bn >= n or n // (32 * nw) > 64:
        continue
      for st in (1, 2, 3):
        cands.append(cfg(bm, bn, nw, sms, num_stages=st, reload_rows=True))
  return cands


def _ln_fwd_tiles(m, n, sms, op):
  del op
  bn_full = C.next_power_of_2(n)
  out = []
  if bn_full <= 8192:
    for bm in (1, 2, 4, 8, 16, 32, 64):
      tile = bm * bn_full
      if bm > m or tile < 1024 or tile > 32768:
        continue
      for nw in (1, 2, 4, 8, 16):
        if tile // (nw * 32) > 128 or tile // (nw * 32) < 4:
          continue
        out.append(C.ForwardConfig("multi_wave_cached", bm, bn_full, nw))
  else:
    for bn, nw, g in itertools.product((8192, 16384, 32768), (16, 32),
                                       (sms, 2 * sms, 4 * sms)):
      out.append(C.ForwardConfig("static_persistent", 1, bn, nw, g))
    for bn, nw in itertools.product((4096, 8192), (8, 16)):
      out.append(C.ForwardConfig("multi_wave_reload", 1, bn, nw))
  return out


def _narrow_bwd_tiles(m, n, sms, op):
  del op
  out = []
  bn = C.next_power_of_2(n)
  for bm, nw, g in itertools.product((8, 16, 32, 64, 128), (2, 4, 8),
                                     (sms, 2 * sms, 4 * sms)):
    out.append(C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                                **C.reduce_config(n, g)))
  return out


def _narrow_bwd_programs(m, n, sms, op):
  del sms
  d = C.backward_config(m, n, None, subtract_mean=(op == "layer"))
  cands = []
  for _ in range(2):
    for g in (528, 512, 384, 264, 256, 128):
      cands.append(C.BackwardConfig(block_m=d.block_m, block_n=d.block_n,
                                    num_warps=d.num_warps, num_programs=g,
                                    **C.reduce_config(n, g)))
  return cands


@dataclasses.dataclass(frozen=True)
class Grid:
  """A sweep's candidates and its defaults (the command that wrote its results)."""

  fwd: object = None  # (m, n, num_sms, op) -> [ForwardConfig], or None
  bwd: object = None  # (m, n, num_sms, op) -> [BackwardConfig], or None
  shapes: str = _DEFAULT_SHAPES
  ops: str = "rms"
  iters: int = 10
  budget_s: float = 420.0

  @property
  def kernels(self) -> str:
    return ",".join(k for k in ("fwd", "bwd") if getattr(self, k) is not None)


GRIDS = {
    "default": Grid(_default_fwd, _default_bwd, iters=15, budget_s=500),
    "split": Grid(fwd=_split_fwd, budget_s=100),
    "split-bwd": Grid(bwd=_split_bwd),
    "reload-bwd": Grid(bwd=functools.partial(_reload_bwd, grid="wide")),
    "reload-bwd-stages": Grid(bwd=functools.partial(_reload_bwd, grid="stages")),
    "ln-fwd-tiles": Grid(fwd=_ln_fwd_tiles, shapes=("4096x8192,8192x5120,8192x8192,8192x2048,"
                                                    "8192x4096,4096x4096,4096x1024,32768x128,"
                                                    "1024x262144"),
                         ops="layer", budget_s=260),
    "narrow-bwd-tiles": Grid(bwd=_narrow_bwd_tiles, shapes="32768x128", ops="rms,layer",
                             budget_s=120),
    "narrow-bwd-programs": Grid(bwd=_narrow_bwd_programs, shapes="32768x128", iters=30,
                                budget_s=100),
}


# --------------------------------------------------------------------------- CLI


_HELP = ("Launch-config sweep of the Pallas kernels (GPU): CUPTI kernel time of each "
         "candidate config over rotated bf16 inputs, median of --iters; the best per (shape, "
         "op, kernel) printed, every row in the JSON. Bytes: fwd 2*M*N*2, bwd 3*M*N*2.")


def parser() -> argparse.ArgumentParser:
  """``sweep``'s options (the shapes, ops, kernels, iters and budget default to the grid's)."""
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.bench sweep", description=_HELP,
      epilog="Grids: " + "; ".join(f"{k} ({g.kernels}, --ops {g.ops})" for k, g in GRIDS.items())
             + ". The grids are described in the module docstring "
               "(pallas_norm/bench/sweep.py); other flags default to the grid's.")
  p.add_argument("--grid", default="default", choices=tuple(GRIDS),
                 help="the candidate configs (default: every mode's tiles and warps)")
  p.add_argument("--shapes", help="MxN list (default: the grid's)")
  p.add_argument("--ops", help="rms, layer or rms,layer (default: the grid's)")
  p.add_argument("--kernels", help="fwd, bwd or fwd,bwd (default: what the grid sweeps)")
  p.add_argument("--iters", type=int, help="timed calls per candidate (default: the grid's)")
  p.add_argument("--heuristic-first", action="store_true",
                 help="time config.py's default pick (for --residual, its residual pick) "
                      "first, marked heuristic=True in the JSON")
  p.add_argument("--budget-s", type=float,
                 help="stop starting new candidates after this many seconds (default: the "
                      "grid's)")
  p.add_argument("--out", default="sweep.json", help="JSON of every row (default sweep.json)")
  p.add_argument("--residual", action="store_true",
                 help="the fused residual add (bf16 residual): the forward reads x and r "
                      "and writes y and h (bytes 4*M*N*2), the backward reads dy, dh and "
                      "h and writes dx (4*M*N*2); errors against the formula on h")
  p.add_argument("--dry-run", action="store_true",
                 help=f"list the candidates and exit (no GPU; off the GPU the grids plan "
                      f"for {_GPU_SMS} SMs, as on an H100 or H200, and config.py's "
                      f"default picks among them are this device's)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Run ``sweep`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
  p = parser()
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  grid = GRIDS[args.grid]
  args.shapes = args.shapes or grid.shapes
  args.ops = args.ops or grid.ops
  args.kernels = args.kernels or grid.kernels
  args.iters = args.iters or grid.iters
  args.budget_s = args.budget_s if args.budget_s is not None else grid.budget_s
  for kern in args.kernels.split(","):
    if getattr(grid, kern, None) is None:
      p.error(f"--grid {args.grid} sweeps {grid.kernels} only, not {kern!r}")
  if any(op not in ("rms", "layer") for op in args.ops.split(",")):
    p.error(f"--ops {args.ops!r}: rms, layer or rms,layer")
  dev = C.device_info()
  if args.dry_run:
    return _print_candidates(grid, args, dev.num_sms if dev.platform == "gpu" else _GPU_SMS)
  if timing.gpu_missing():
    return 2
  print(f"device={jax.devices()[0].device_kind} sms={dev.num_sms} jax={jax.__version__}")
  timing.warm_up(3.0)  # the clocks ramp before the first timing
  t_start = time.time()
  rows = []
  for shape in args.shapes.split(","):
    m, n = map(int, shape.split("x"))
    nbytes = m * n * 2
    reps = max(2, -(-4 * _L2_BYTES // nbytes))
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16)
          for i in range(reps)]
    dys = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, n), jnp.bfloat16)
           for i in range(reps)]
    # --residual: r (forward), dh (backward), and h = x + r, the backward's x.
    rs = dhs = hs = None
    if args.residual:
      rs = [jax.random.normal(jax.random.fold_in(key, 199 + i), (m, n), jnp.bfloat16)
            for i in range(reps)]
      dhs = [jax.random.normal(jax.random.fold_in(key, 299 + i), (m, n), jnp.bfloat16)
             for i in range(reps)]
      hs = [(x.astype(jnp.float32) + r.astype(jnp.float32)).astype(jnp.bfloat16)
            for x, r in zip(xs, rs)]
    scale = jnp.ones((n,), jnp.bfloat16) * 1.25
    bias = jnp.full((n,), 0.5, jnp.bfloat16)
    for op in args.ops.split(","):
      sm = op == "layer"
      b = bias if sm else None
      # The backward's saved statistics: of h with a residual (its float32 sum, as the
      # forward computes them), else of x.
      stats = [reference.norm(x, scale, b, eps=1e-5, subtract_mean=sm) for x in xs]
      if args.residual:
        stats = [reference.norm(x.astype(jnp.float32) + r.astype(jnp.float32), scale, b,
                                eps=1e-5, subtract_mean=sm) for x, r in zip(xs, rs)]
      y_ref = stats[0][0].astype(jnp.float32)
      dx_ref = None  # the XLA reference's dx for (xs[0], dys[0]), computed once
      for kern in args.kernels.split(","):
        cands = getattr(grid, kern)(m, n, dev.num_sms, op)
        pick = None
        if args.heuristic_first:  # config.py's own pick, timed first
          pick = (C.forward_config(m, n, jnp.bfloat16, None, subtract_mean=sm,
                                   residual=args.residual) if kern == "fwd" else
                  C.backward_config(m, n, jnp.bfloat16, subtract_mean=sm,
                                    residual=args.residual))
          cands = [pick] + [c for c in cands if c != pick]
        best = []
        for cfg in cands:
          if time.time() - t_start > args.budget_s:
            print("budget exhausted", flush=True)
            break
          try:
            if kern == "fwd" and args.residual:
              fn = jax.jit(lambda x, r, cfg=cfg: forward.norm_forward(
                  x, scale, b, eps=1e-5, scale_offset=0.0, subtract_mean=sm, config=cfg,
                  interpret=False, residual=r)[::3])  # (y, h)
              y = fn(xs[0], rs[0])[0]
              err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - stats[0][0])))
              t = timing.time_us(fn, list(zip(xs, rs)), args.iters)
              gbs = 4 * nbytes / t / 1e3 if t else None
            elif kern == "fwd":
              fn = jax.jit(lambda x, cfg=cfg: forward.norm_forward(
                  x, scale, b, eps=1e-5, scale_offset=0.0, subtract_mean=sm, config=cfg,
                  interpret=False)[0])
              y = fn(xs[0])
              err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref)))
              t = timing.time_us(fn, [(x,) for x in xs], args.iters)
              gbs = 2 * nbytes / t / 1e3 if t else None
            else:
              res = {}
              if args.residual:
                res = dict(dx_dtype=jnp.bfloat16, residual_dtype=jnp.bfloat16)
              fn = jax.jit(lambda dy, x, mean, rstd, dh=None, cfg=cfg: backward.norm_backward(
                  dy, x, scale, mean if sm else None, rstd, has_bias=sm, scale_offset=0.0,
                  subtract_mean=sm, config=cfg, interpret=False, scale_dtype=scale.dtype,
                  bias_dtype=bias.dtype, **(dict(res, dh=dh) if dh is not None else {})))
              xb = hs if args.residual else xs  # the backward's x: h with a residual
              if dx_ref is None:
                _, pull = jax.vjp(lambda x: reference.norm(x, scale, b, eps=1e-5,
                                                           subtract_mean=sm)[0], xb[0])
                dx_ref = pull(dys[0])[0].astype(jnp.float32)
                if args.residual:
                  dx_ref = dx_ref + dhs[0].astype(jnp.float32)
              extra = (dhs[0],) if args.residual else ()
              dx = fn(dys[0], xb[0], stats[0][1], stats[0][2], *extra)[0]
              err = float(jnp.max(jnp.abs(dx.astype(jnp.float32) - dx_ref)))
              sets = [(dy, x, s[1], s[2]) for dy, x, s in zip(dys, xb, stats)]
              if args.residual:
                sets = [a + (dh,) for a, dh in zip(sets, dhs)]
              t = timing.time_us(fn, sets, args.iters)
              gbs = (4 if args.residual else 3) * nbytes / t / 1e3 if t else None
          except Exception as e:  # a config the compiler rejects is a data point
            print(f"  {op} {shape} {kern} {cfg} ERROR {type(e).__name__}: {str(e)[:200]}",
                  flush=True)
            continue
          row = dict(op=op, shape=shape, kernel=kern, residual=args.residual,
                     heuristic=cfg == pick, us=t, gbs=gbs, max_err=err,
                     config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
          rows.append(row)
          best.append(row)
        best.sort(key=lambda r: r["us"] or 1e30)
        if best and best[0]["us"] and kern == "bwd" and not args.residual:
          cfg = C.BackwardConfig(**best[0]["config"])
          fn = jax.jit(lambda dy, x, mean, rstd: backward.norm_backward(
              dy, x, scale, mean if sm else None, rstd, has_bias=sm, scale_offset=0.0,
              subtract_mean=sm, config=cfg, interpret=False, scale_dtype=scale.dtype,
              bias_dtype=bias.dtype))
          _, ks = timing.profiler().measure(fn, aggregate=False)(dys[1], xs[1], stats[1][1],
                                                                 stats[1][2])
          print("  breakdown:", [(k[:40], round(t * 1e3, 1)) for k, t in ks or []])
        for r in best[:4] + [r for r in best[4:] if r["heuristic"]]:
          print(f"{op} {shape} {kern} {r['us']:8.1f}us {r['gbs']:6.0f}GB/s "
                f"err={r['max_err']:.2g}{' (config.py pick)' if r['heuristic'] else ''} "
                f"{r['config']}", flush=True)
      with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f)
  return 0



def _print_candidates(grid: Grid, args, sms: int) -> int:
  print(f"sweep --grid {args.grid}: iters={args.iters} budget={args.budget_s:.0f}s "
        f"for {sms} SMs")
  for shape in args.shapes.split(","):
    m, n = map(int, shape.split("x"))
    for op in args.ops.split(","):
      for kern in args.kernels.split(","):
        cands = getattr(grid, kern)(m, n, sms, op)
        print(f"  {op} {shape} {kern}: {len(cands)} candidates")
        for cfg in cands:
          print(f"    {cfg}")
  return 0
