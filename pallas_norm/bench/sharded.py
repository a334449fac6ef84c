"""Sharded benchmark: ``python -m pallas_norm.bench --sharded``.

Times pallas_norm (``rms_norm`` / ``layer_norm``, the heuristic) against XLA's own norm
under the same sharding (``reference.norm`` under ``jax.jit``: what ``flax.nnx.RMSNorm``
compiles to), in one process on the same inputs, over a 1-D mesh of every local device:

  DP  x [B, S, N] sharded P("data", None, None); scale and bias replicated (dscale and
      dbias are psum'd).
  TP  x sharded P(None, None, "model") on its last axis; scale and bias P("model").

for RMSNorm and LayerNorm, forward and forward+backward (``jax.vjp``; the step returns
y, dx, dscale(, dbias), as ``peers.fwdbwd``), on meshes of Explicit and of Auto axis
types (``--axis-types``). Two forward+backward passes:

  fwdbwd      dy is an input of the step, as in the single-GPU bench: nothing orders the
              backward after the forward, so XLA may fuse its own norm's backward row
              sums (c1 = mean(x_hat * dy * w)) into the forward's statistics pass, one
              read of x fewer than a training step can do. Under TP that is 6 passes over
              the shard against pallas_norm's 8 (statistics, normalise; row sums, dx).
  fwdbwd_dep  dy is released only once y is computed (``jax.lax.optimization_barrier`` on
              (y, dy)), the order of a training step, where dy is a function of y: the
              same step for both implementations, with that fusion ruled out.
 Each (shape, op, pass, layout, axis type) is a cell: one row for
pallas_norm and one for XLA.

Method (``../shared/BENCHMARKING.md``, its "Sharded" section):
  * One executable per row: ``jax.jit(step).lower(*args).compile()``. It is what is timed,
    its outputs are what is compared, and its HLO text (``as_text()``) gives the
    collectives: instructions counted per opcode (all-gather, all-reduce, reduce-scatter,
    all-to-all, collective-permute; an async ``-start``/``-done`` pair counts once).
  * Time: CUPTI kernel time (``jax.experimental.mosaic.gpu.profiler.measure``), every
    kernel of a call summed, NCCL's included. jaxlib's CUPTI hook hands back each kernel
    record without its device, so neither one device's kernels nor the maximum over devices
    can be told apart. The time of a call is therefore the sum of all devices' kernels of
    that call divided by the device count: the mean per-device kernel time. Under SPMD
    every device runs the same kernels on an equal shard (a call whose kernel count is not
    a multiple of the device count is refused), so this is the per-device time; both
    implementations are timed by this one rule. One ``measure`` profiles K = ``--iters``
    back-to-back calls; its records, in order, are cut into K equal chunks, one sample
    each; the median is reported (p10 and p90 in the JSON).
  * Fallback: where CUPTI reports no kernels (or fails), and on CPU (``--allow-cpu``), the
    row is wall clock: the median of max(``--iters``, 30) calls, each timed up to
    ``jax.block_until_ready``, with ``"method": "wall"`` and the reason. Rows are only
    compared (speedup, DP ratio) when both were timed by the same method.
  * L2: R rotated copies of x (and dy), R * bytes(local shard) >= 4 * L2
    (``rotations``), fewer where R copies of x and dy would take over a quarter of
    a device's memory. Compilation and one warm-up call are excluded.
  * DP against one device: the same step on one device's local shard [B/ndev, S, N] (its
    shard of the rotated inputs, unsharded on that device), timed by the same rule;
    ``dp_over_single`` = DP per-device time / that time (target: <= 1.10).
  * Correctness, in the same run: max |ours - XLA| in float32 of y, dx, dscale and dbias
    (``err_y``, ``err_dx``, ``err``) on rotation 0; ``check`` is ``run.compare``'s
    per-dtype relative tolerance.

Bytes model, per device on its local shard [M_loc, N_loc] (DP: M_loc = B*S/ndev,
N_loc = N; TP: M_loc = B*S, N_loc = N/ndev); scale, bias and the statistics are
negligible:
  forward          read x, write y                         2 * M_loc * N_loc * itemsize
  forward+backward forward, then read x and dy, write dx   5 * M_loc * N_loc * itemsize
GB/s per device = bytes / median time.

Output: a progress line per row; JSON (rows and metadata) and a PNG bar chart (one bar
group per cell: pallas_norm against XLA, annotated with the speedup) at
``--out``/``<gpu>_<date>_sharded_<commit>.json`` and ``.png``; the summary table last.
``--dry-run`` prints the plan. Needs >= 2 GPUs; ``--allow-cpu`` runs on CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``) in interpret mode, wall clock.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_norm.bench import peers, report, run, timing
from pallas_norm.bench.plan import (ASSUMED_L2, DTYPES, IMPL_BY_NAME, OPS, bytes_model,
                                    parse_list, rotations)

__all__ = ["DEFAULT_SHAPES", "COLLECTIVES", "collectives", "parse_shapes", "build_plan",
           "format_table", "plot", "main"]

DEFAULT_SHAPES = ((16, 4096, 4096),)  # BENCHMARKING.md's "Sharded" case
_CPU_SHAPES = ((2, 8, 128),)  # interpret mode: tiny
_LAYOUTS = {"dp": "data", "tp": "model"}  # layout -> its mesh axis
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
_IMPLS = {"pallas_norm": "pallas", "xla": "xla"}  # row name -> bench implementation
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")
# An HLO instruction's opcode: after its type, before "(" ("-start" of an async pair);
# not an instruction name (%all-reduce.3) nor the "-done" half.
_COLLECTIVE_RE = re.compile(r"(?<![\w%.-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_MIN_WALL_ITERS = 30
_DP_TARGET = 1.10


# --------------------------------------------------------------------------- plan


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
  """"16x4096x4096,8x2048x8192" -> ((16, 4096, 4096), (8, 2048, 8192)); duplicates dropped."""
  shapes = []
  for tok in (t.strip().lower() for t in text.split(",")):
    if not tok:
      continue
    parts = tok.split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
      raise ValueError(f"shape {tok!r} must be BxSxN with positive sizes, e.g. 16x4096x4096")
    shape = tuple(int(p) for p in parts)
    if shape not in shapes:
      shapes.append(shape)
  if not shapes:
    raise ValueError(f"no shape in {text!r}")
  return tuple(shapes)


def collectives(hlo_text: str) -> dict[str, int]:
  """Collective instructions of an HLO module's text, counted per opcode."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for m in _COLLECTIVE_RE.finditer(hlo_text):
    counts[m.group(1)] += 1
  return counts


def _local(shape, layout: str, ndev: int) -> tuple[int, int]:
  """(M_loc, N_loc) of one device's shard of x [B, S, N] under ``layout``."""
  b, s, n = shape
  return (b * s // ndev, n) if layout == "dp" else (b * s, n // ndev)


def build_plan(args: argparse.Namespace, ndev: int, platform: str) -> list[dict]:
  """Cells in run order: shape, axis type, layout, op, pass.

  Raises:
    ValueError: an unknown op, pass, layout or axis type, or a shape that ``ndev``
      devices do not shard evenly (DP needs B % ndev == 0, TP N % ndev == 0).
  """
  if args.shapes:
    shapes = parse_shapes(args.shapes)
  else:
    shapes = _CPU_SHAPES if args.allow_cpu and platform != "gpu" else DEFAULT_SHAPES
  ops = parse_list(args.ops, OPS, "--ops")
  passes = parse_list(args.passes, _PASSES, "--passes")
  layouts = parse_list(args.layouts, _LAYOUTS, "--layouts")
  axis_types = parse_list(args.axis_types, _AXIS_TYPES, "--axis-types")
  for shape in shapes:
    for layout in layouts:
      dim = shape[0] if layout == "dp" else shape[2]
      if dim % ndev:
        raise ValueError(f"shape {'x'.join(map(str, shape))}: {layout} shards "
                         f"{'B' if layout == 'dp' else 'N'}={dim} over {ndev} devices, "
                         f"unevenly; pick a multiple of {ndev}")
  return [{"shape": shape, "axis_type": at, "layout": lay, "op": op, "pass": p}
          for shape in shapes for at in axis_types for lay in layouts
          for op in ops for p in passes]


def _print_plan(plan: list[dict], args, ndev: int, platform: str) -> None:
  itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
  print(f"plan: {len(plan)} cells x {tuple(_IMPLS)}, dtype={args.dtype}, iters={args.iters}, "
        f"over {ndev} devices (here: {jax.device_count()} {platform}; a run needs >= 2 "
        f"GPUs, or --allow-cpu); R assumes L2={ASSUMED_L2 >> 20} MiB")
  for shape in dict.fromkeys(c["shape"] for c in plan):
    cells = [c for c in plan if c["shape"] == shape]
    print(f"  {'x'.join(map(str, shape))}")
    for layout in dict.fromkeys(c["layout"] for c in cells):
      m, n = _local(shape, layout, ndev)
      r = _rotations(m, n, itemsize, "cpu" if args.allow_cpu else "gpu", ASSUMED_L2,
                     None)
      sub = [c for c in cells if c["layout"] == layout]
      print(f"    {layout} x {_spec_txt(layout)} local [{m}, {n}] "
            f"{m * n * itemsize / 2**20:.1f} MiB R={r} axis types="
            f"{','.join(dict.fromkeys(c['axis_type'] for c in sub))} ops="
            f"{','.join(dict.fromkeys(c['op'] for c in sub))} passes="
            f"{','.join(dict.fromkeys(c['pass'] for c in sub))}"
            + (" (+ one device on its local shard)" if layout == "dp" else ""))


def _spec_txt(layout: str) -> str:
  axis = _LAYOUTS[layout]
  return f'P("{axis}", None, None)' if layout == "dp" else f'P(None, None, "{axis}")'


# --------------------------------------------------------------------------- inputs


def _rotations(m: int, n: int, itemsize: int, platform: str, l2_bytes: int,
               mem_bytes: int | None) -> int:
  """rotations, fewer where R copies of x and dy would pass a quarter of memory;
  1 off the GPU (wall clock: no L2 to defeat)."""
  if platform != "gpu":
    return 1
  r = rotations(m, n, itemsize, l2_bytes)
  if mem_bytes:
    r = max(1, min(r, mem_bytes // (8 * m * n * itemsize)))
  return r


def _make_inputs(shape, layout: str, mesh, dtype, r: int, need_dy: bool, seed: int):
  """Rotated inputs placed on ``mesh``: (xs [R], dys [R], scale, bias), generated in place.

  With jax's partitionable threefry (the default), the same seed gives the same values
  under every layout and mesh: every cell of a shape normalises the same data.
  """
  axis = _LAYOUTS[layout]
  x_spec = P(axis, None, None) if layout == "dp" else P(None, None, axis)
  p_spec = P(None) if layout == "dp" else P(axis)
  n = shape[-1]
  keys = jax.random.split(jax.random.key(seed), 2 * r + 2)

  def normal(ks, shp, spec, dt):  # one array per key, each placed as ``spec`` says
    return jax.jit(lambda ks: [jax.random.normal(k, shp, dt) for k in ks],
                   out_shardings=NamedSharding(mesh, spec))(list(ks))

  xs = normal(keys[:r], shape, x_spec, dtype)
  dys = normal(keys[r:2 * r], shape, x_spec, dtype) if need_dy else []
  scale, bias = normal(keys[-2:], (n,), p_spec, jnp.float32)
  scale, bias = (1.0 + 0.1 * scale).astype(dtype), (0.1 * bias).astype(dtype)
  jax.block_until_ready((xs, dys, scale, bias))
  return xs, dys, scale, bias


def _arg_sets(op: str, pass_: str, inputs) -> list[tuple]:
  xs, dys, scale, bias = inputs
  bias = bias if op == "layer" else None
  if pass_ == "fwd":
    return [(x, scale, bias) for x in xs]
  # fwdbwd and fwdbwd_dep
  return [(x, scale, bias, dy) for x, dy in zip(xs, dys)]


def _shard0(arg_sets: list[tuple]) -> list[tuple]:
  """The first device's shard of every argument, as a plain single-device array."""
  return [tuple(None if a is None else a.addressable_shards[0].data for a in args)
          for args in arg_sets]


# --------------------------------------------------------------------------- timing


def _cupti_time(step, arg_sets, iters: int, ndev: int) -> dict:
  """Mean per-device CUPTI kernel time of one call (module docstring), or {reason}."""
  rot = timing.rotating_step(step, arg_sets)

  class _Calls(jax.stages.Wrapped):
    """``iters`` rotated calls as one function: measure runs it to warm up, then under
    CUPTI, and waits for every call's output."""

    def __call__(self):
      return [rot() for _ in range(iters)]

  try:
    _, records = timing.profiler().measure(_Calls(), aggregate=False)()
  except RuntimeError as e:
    return {"reason": f"CUPTI: {e}"}
  if not records:
    return {"reason": "CUPTI reported no kernels (XLA may have run the program as a "
                      "command buffer)"}
  per_call, rest = divmod(len(records), iters)
  if rest or per_call % ndev:
    return {"reason": f"CUPTI: {len(records)} kernel records for {iters} calls on {ndev} "
                      f"devices: not the same kernels on every device and call"}
  chunks = [records[i * per_call:(i + 1) * per_call] for i in range(iters)]
  out = timing.summarise([sum(ms for _, ms in c) * 1e3 / ndev for c in chunks])
  out.update(method="cupti", kernels_per_device=per_call // ndev,
             kernels=list(dict.fromkeys(name for name, _ in chunks[0])))
  return out


def _wall_time(step, arg_sets, iters: int) -> dict:
  """Median wall-clock time of max(iters, 30) calls, each up to block_until_ready."""
  per_call = []
  for i in range(max(iters, _MIN_WALL_ITERS)):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*arg_sets[i % len(arg_sets)]))
    per_call.append((time.perf_counter() - t0) * 1e6)
  return {**timing.summarise(per_call), "method": "wall"}


def _time(step, arg_sets, iters: int, ndev: int, platform: str) -> dict:
  if platform == "gpu":
    t = _cupti_time(step, arg_sets, iters, ndev)
    if "us" in t:
      return t
    reason = t["reason"]
  else:
    reason = f"no CUPTI on {platform}"
  return {**_wall_time(step, arg_sets, iters), "wall_reason": reason}


_PASSES = ("fwd", "fwdbwd", "fwdbwd_dep")
_BYTES_PASS = {"fwd": "fwd", "fwdbwd": "fwdbwd", "fwdbwd_dep": "fwdbwd"}


def _compile_and_time(impl: str, op: str, pass_: str, arg_sets, iters, ndev, platform):
  """(timing and collectives of one implementation's step, its outputs on rotation 0)."""
  f = peers.jax_fn(IMPL_BY_NAME[_IMPLS[impl]], op)
  step = jax.jit(peers.step_of(f, op, pass_))
  t0 = time.perf_counter()
  compiled = step.lower(*arg_sets[0]).compile()
  out = jax.block_until_ready(compiled(*arg_sets[0]))  # the warm-up call
  row = {"compile_s": round(time.perf_counter() - t0, 2),
         "collectives": collectives(compiled.as_text())}
  row.update(_time(compiled, arg_sets, iters, ndev, platform))
  return row, out


def _errors(out, ref, dtype_name: str) -> dict:
  """Max |out - ref| (f32) per output, and run.compare's check."""
  names = ("y", "dx", "dscale", "dbias")
  err = {nm: run.rel_err(o, r)[1]
         for nm, o, r in zip(names, jax.tree.leaves(out), jax.tree.leaves(ref))}
  return {"err": err, "err_y": err["y"], "err_dx": err.get("dx"),
          **run.compare(out, ref, dtype_name)}


def _warm_up(mesh, seconds: float = 3.0) -> None:
  """Keep every device of ``mesh`` busy for a few seconds, so that its clocks ramp up."""
  axis = mesh.axis_names[0]
  a = jax.device_put(jnp.ones((mesh.size << 28,), jnp.float32), NamedSharding(mesh, P(axis)))
  f = jax.jit(lambda v: v * 2)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(a))


# --------------------------------------------------------------------------- run


def _row(cell: dict, impl: str, ndev: int, itemsize: int, r: int, args) -> dict:
  m, n = _local(cell["shape"], cell["layout"], ndev)
  return {"shape": list(cell["shape"]), "op": cell["op"], "pass": cell["pass"],
          "layout": cell["layout"], "axis_type": cell["axis_type"], "impl": impl,
          "dtype": args.dtype, "local": [m, n],
          "bytes": bytes_model(m, n, itemsize, _BYTES_PASS[cell["pass"]]),
          "rotations": r,
          "iters": args.iters}


def _finish_row(row: dict) -> dict:
  if "us" not in row:
    return {**row, "status": "error"}
  return {**row, "status": "ok", "gbs": row["bytes"] / (row["us"] * 1e-6) / 1e9}


def _compared(a: dict, b: dict) -> float | None:
  """a's time / b's when both were timed by the same method, else None."""
  if "us" in a and "us" in b and a["method"] == b["method"]:
    return a["us"] / b["us"]
  return None


def _run_cell(cell, arg_sets, args, ndev, platform, itemsize, single: dict) -> list[dict]:
  """The XLA row, then pallas_norm's (with the ratio and the errors against XLA)."""
  rows, outs = {}, {}
  for impl in ("xla", "pallas_norm"):
    row = _row(cell, impl, ndev, itemsize, len(arg_sets), args)
    try:
      measured, outs[impl] = _compile_and_time(impl, cell["op"], cell["pass"], arg_sets,
                                               args.iters, ndev, platform)
      row.update(measured)
      if cell["layout"] == "dp":
        key = (cell["shape"], cell["op"], cell["pass"], impl)
        if key not in single:  # the same for every axis type
          single[key] = _compile_and_time(impl, cell["op"], cell["pass"], _shard0(arg_sets),
                                          args.iters, 1, platform)[0]
        row.update(single_us=single[key].get("us"), single_method=single[key].get("method"),
                   dp_over_single=_compared(row, single[key]))
    except Exception as e:  # noqa: BLE001 - one failure must not stop the run
      row["reason"] = "".join(traceback.format_exception_only(type(e), e)).strip()[:2000]
    rows[impl] = _finish_row(row)
  ours, xla = rows["pallas_norm"], rows["xla"]
  ratio = _compared(ours, xla)
  ours.update(xla_us=xla.get("us"), ratio=ratio, speedup=1 / ratio if ratio else None)
  if len(outs) == 2:
    ours.update(_errors(outs["pallas_norm"], outs["xla"], args.dtype))
  return [xla, ours]


def _meta(args, platform: str, devices) -> dict:
  torch_ok = platform == "gpu" and timing.torch_status()[0]
  dev = timing.device_meta(torch_ok)
  if platform == "gpu":
    dev["memory_bytes"] = (devices[0].memory_stats() or {}).get("bytes_limit")
  else:
    dev["device"] = platform
  return {**dev, "platform": platform, "device_count": len(devices),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "dtype": args.dtype, "iters": args.iters, "git_commit": timing.git_commit(),
          "jax": jax.__version__, "jaxlib": timing.version("jaxlib"),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv[1:],
          "method": ("per-device CUPTI kernel time: the sum of one call's kernels over all "
                     "devices / device count (jaxlib's CUPTI records carry no device); "
                     f"median of {args.iters} calls; wall clock (median of >= "
                     f"{_MIN_WALL_ITERS} calls to block_until_ready) where CUPTI sees "
                     "nothing, marked per row"),
          "bytes_model": {"fwd": "2*M_loc*N_loc*itemsize", "fwdbwd": "5*M_loc*N_loc*itemsize",
                          "fwdbwd_dep": "5*M_loc*N_loc*itemsize",
                          "per": "device, on its local shard"},
          "layouts": {lay: _spec_txt(lay) for lay in _LAYOUTS}}


def _out_path(args, meta: dict) -> pathlib.Path:
  commit = meta["git_commit"][:7]
  return (pathlib.Path(args.out)
          / f"{timing.slug(meta['device'])}_{meta['date'][:10]}_sharded_{commit}.json")


def _write(path: pathlib.Path, meta: dict, rows: list[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")


def _run(args, plan: list[dict], platform: str, devices) -> int:
  ndev = len(devices)
  dtype = DTYPES[args.dtype]
  itemsize = jnp.dtype(dtype).itemsize
  meta = _meta(args, platform, devices)
  print(f"devices: {ndev} x {meta['device']} ({platform}), jax {jax.__version__}, "
        f"XLA_FLAGS={meta['xla_flags']!r}", flush=True)
  out = _out_path(args, meta)
  if platform == "gpu":
    _warm_up(jax.make_mesh((ndev,), ("all",)))
  rows: list[dict] = []
  single: dict = {}
  start = time.perf_counter()
  for shape in dict.fromkeys(c["shape"] for c in plan):
    cells = [c for c in plan if c["shape"] == shape]
    m, n = _local(shape, "dp", ndev)  # the same bytes per device under both layouts
    r = _rotations(m, n, itemsize, platform, meta["l2_bytes"], meta.get("memory_bytes"))
    need_dy = any(c["pass"] != "fwd" for c in cells)
    for at, layout in dict.fromkeys((c["axis_type"], c["layout"]) for c in cells):
      mesh = jax.make_mesh((ndev,), (_LAYOUTS[layout],), axis_types=(_AXIS_TYPES[at],))
      inputs = _make_inputs(shape, layout, mesh, dtype, r, need_dy, args.seed)
      for c in (c for c in cells if (c["axis_type"], c["layout"]) == (at, layout)):
        for row in _run_cell(c, _arg_sets(c["op"], c["pass"], inputs), args, ndev,
                             platform, itemsize, single):
          rows.append(row)
          print(f"[{time.perf_counter() - start:6.1f}s] {_progress(row)}", flush=True)
      del inputs
    _write(out, meta, rows)  # partial results survive a cut-off run
  _write(out, meta, rows)
  print(f"wrote {out}")
  png = out.with_suffix(".png")
  try:
    plot({"meta": meta, "rows": rows}, png)
    print(f"wrote {png}")
  except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
    print(f"plot failed: {type(e).__name__}: {e}")
  print(format_table(rows, meta), flush=True)
  failed = [r for r in rows if r.get("check") == "FAIL"]
  for r in failed:
    print(f"CHECK FAILED: {_cell_txt(r)}: {r['check_detail']}", flush=True)
  return 1 if failed else 0


# --------------------------------------------------------------------------- output


def _cell_txt(r: dict) -> str:
  return (f"{'x'.join(map(str, r['shape'])):<14} {r['op']:5} {r['pass']:6} {r['layout']} "
          f"{r['axis_type']:8}")


def _coll_txt(r: dict) -> str:
  c = r.get("collectives")
  return "/".join(str(c[k]) for k in COLLECTIVES) if c else "-"


def _progress(r: dict) -> str:
  head = f"{_cell_txt(r)} {r['impl']:11}"
  if r["status"] != "ok":
    return f"{head} {r['status']}: {r.get('reason', '')[:300]}"
  extra = ""
  if r.get("speedup"):
    extra += f" speedup {r['speedup']:.2f}"
  if r.get("dp_over_single"):
    extra += f" dp/1dev {r['dp_over_single']:.2f}"
  if "err_y" in r:
    extra += f" err y {r['err_y']:.2e}" + (f" dx {r['err_dx']:.2e}" if r["err_dx"] is not None
                                          else "") + f" check {r['check']}"
  k = f" k={r['kernels_per_device']}" if "kernels_per_device" in r else ""
  return (f"{head} {r['us']:9.1f} us ({r['method']}{k}) {r['gbs']:6.0f} GB/s/dev "
          f"coll {_coll_txt(r)} compile {r['compile_s']:.1f}s{extra}")


def _num(v, width: int, fmt: str) -> str:
  return f"{format(v, fmt) if v is not None else '-':>{width}}"


def format_table(rows: list[dict], meta: dict) -> str:
  """One line per cell: both times, the speedup, the DP ratio, collectives and errors."""
  lines = [f"{meta.get('device', '?')} x{meta.get('device_count', '?')}  {meta.get('dtype', '?')}"
           f"  {meta.get('date', '?')}  commit {str(meta.get('git_commit'))[:10]}",
           "us: per-device time of one call (cupti: kernels of all devices / ndev; wall: "
           "block_until_ready); GB/s per device: fwd 2*M*N*s, fwd+bwd 5*M*N*s bytes of the "
           "local shard; coll: all-gather/all-reduce/reduce-scatter/all-to-all/"
           "collective-permute in the compiled HLO",
           f"{'shape':14} {'op':5} {'pass':6} {'lay':3} {'axes':8} {'ours us':>9} "
           f"{'xla us':>9} {'speedup':>7} {'GB/s':>6} {'1dev us':>9} {'dp/1dev':>7} "
           f"{'coll ours':>9} {'coll xla':>9} {'err y':>8} {'err dx':>8} method"]
  xla = {(_cell_txt(r)): r for r in rows if r["impl"] == "xla"}
  for r in (r for r in rows if r["impl"] == "pallas_norm"):
    x = xla.get(_cell_txt(r), {})
    flag = "" if r.get("dp_over_single") is None or r["dp_over_single"] <= _DP_TARGET else "!"
    method = "/".join(dict.fromkeys(str(t.get("method", t.get("status"))) for t in (r, x)))
    lines.append(
        f"{_cell_txt(r)} {_num(r.get('us'), 9, '.1f')} {_num(x.get('us'), 9, '.1f')} "
        f"{_num(r.get('speedup'), 7, '.2f')} {_num(r.get('gbs'), 6, '.0f')} "
        f"{_num(r.get('single_us'), 9, '.1f')} {_num(r.get('dp_over_single'), 6, '.2f')}"
        f"{flag:1} {_coll_txt(r):>9} {_coll_txt(x):>9} {_num(r.get('err_y'), 8, '.1e')} "
        f"{_num(r.get('err_dx'), 8, '.1e')} {method}")
  lines.append(f"speedup = xla us / ours; dp/1dev = DP per-device time / one device on its "
               f"local shard (! over the {_DP_TARGET:.2f} target); err = max |ours - xla| (f32)")
  return "\n".join(lines)


def plot(doc: dict, png) -> None:
  """Per-device time of pallas_norm and XLA, one bar group per cell, one panel per shape."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows, meta = doc["rows"], doc["meta"]
  shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
  cells = max(1, len(rows) // 2 // max(1, len(shapes)))
  fig, axes = plt.subplots(len(shapes), 1, squeeze=False,
                           figsize=(max(8.0, 0.9 * cells), 4.5 * len(shapes)))
  for ax, shape in zip(axes[:, 0], shapes):
    ours = [r for r in rows if tuple(r["shape"]) == shape and r["impl"] == "pallas_norm"]
    xla = {_cell_txt(r): r for r in rows if tuple(r["shape"]) == shape and r["impl"] == "xla"}
    xs = range(len(ours))
    for dx, impl, color in ((-0.2, "pallas_norm", "C0"), (0.2, "xla", "C1")):
      got = [r if impl == "pallas_norm" else xla.get(_cell_txt(r), {}) for r in ours]
      ax.bar([i + dx for i in xs], [g.get("us") or 0 for g in got], 0.4, color=color,
             label=impl)
    single = [(i, r["single_us"]) for i, r in enumerate(ours) if r.get("single_us")]
    if single:  # DP: pallas_norm on one device's local shard
      ax.hlines([u for _, u in single], [i - 0.4 for i, _ in single],
                [i for i, _ in single], colors="k", lw=2, label="pallas_norm, 1 device")
    for i, r in enumerate(ours):
      top = max(r.get("us") or 0, xla.get(_cell_txt(r), {}).get("us") or 0)
      txt = f"{r['speedup']:.2f}x" if r.get("speedup") else "n/a"
      ax.annotate(txt, (i, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['op']} {r['pass']}\n{r['layout']} {r['axis_type'][:4]}"
                        for r in ours], fontsize=7)
    methods = ",".join(dict.fromkeys(str(r.get("method")) for r in rows
                                     if tuple(r["shape"]) == shape))
    ax.set_ylabel(f"us per call per device ({methods})")
    ax.set_title(f"x [{', '.join(map(str, shape))}] {meta.get('dtype', '')}: speedup = "
                 f"xla / pallas_norm; black: pallas_norm on one device's DP shard", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"{meta.get('device', '?')} x{meta.get('device_count', '?')} sharded - "
               f"{str(meta.get('date', ''))[:10]} {str(meta.get('git_commit'))[:7]}")
  fig.tight_layout()
  report.save_png(fig, png)
  plt.close(fig)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.bench --sharded",
      description="pallas_norm against XLA's norm on inputs sharded over every local GPU "
                  "(DP: x P('data', None, None); TP: x P(None, None, 'model'), scale "
                  "P('model')): per-device CUPTI kernel time, HLO collectives, speedup, DP "
                  "against one device, errors. Bytes per device on its local shard: fwd "
                  "2*M*N*itemsize, fwd+bwd 5*M*N*itemsize.")
  p.add_argument("--shapes", help="BxSxN list, e.g. 16x4096x4096,8x4096x8192 (default "
                                  "16x4096x4096; 2x8x128 on CPU)")
  p.add_argument("--ops", default="rms,layer", help="rms,layer (default both)")
  p.add_argument("--passes", default=",".join(_PASSES),
                 help=f"{','.join(_PASSES)} (default all; see the module docstring)")
  p.add_argument("--layouts", default="dp,tp", help="dp,tp (default both)")
  p.add_argument("--axis-types", default="auto,explicit",
                 help="mesh axis types: auto,explicit (default both)")
  p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
  p.add_argument("--iters", type=int, default=30,
                 help="timed calls per row (>= 30 for results; wall clock takes >= 30)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="benchmarks/results",
                 help="folder for <gpu>_<date>_sharded_<commit>.json and .png "
                      "(default benchmarks/results)")
  p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
  p.add_argument("--allow-cpu", action="store_true",
                 help="run on CPU devices in interpret mode, wall clock (tests; set "
                      "XLA_FLAGS=--xla_force_host_platform_device_count=2 first)")
  return p


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.iters < 1:
    parser.error(f"--iters={args.iters} must be >= 1")
  platform = jax.default_backend()
  devices = jax.devices()
  # A dry run without GPUs plans for the 2 of nvidia-h200-x2 (or more, where seen).
  ndev = len(devices)
  if args.dry_run and platform != "gpu" and not args.allow_cpu:
    ndev = max(2, ndev)
  try:
    plan = build_plan(args, ndev, platform)
  except ValueError as e:
    parser.error(str(e))
  if args.dry_run:
    _print_plan(plan, args, ndev, platform)
    return 0
  if platform != "gpu" and not args.allow_cpu:
    print(f"pallas_norm.bench --sharded needs >= 2 GPUs (jax.default_backend()="
          f"{platform!r}); --dry-run prints the plan, --allow-cpu runs on CPU devices",
          file=sys.stderr)
    return 2
  if len(devices) < 2:
    print(f"pallas_norm.bench --sharded needs >= 2 devices, found {len(devices)} "
          f"{platform}" + ("" if platform == "gpu" else "; set XLA_FLAGS="
                           "--xla_force_host_platform_device_count=2 before jax starts"),
          file=sys.stderr)
    return 2
  return _run(args, plan, platform, devices)


if __name__ == "__main__":
  sys.exit(main())
