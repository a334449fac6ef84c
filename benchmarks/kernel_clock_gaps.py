"""What the kernel bench's clock leaves out: the memsets (and memcpys) of each call.

``pallas_norm.bench.timing.cupti_time`` sums the durations of a call's *kernels*. XLA
fills some buffers with memsets instead: the zeros and sentinels of the persistent
split-row kernels (``kernels/forward.py``: the ticket counter, the slots filled with
``_PENDING``; the split-row forward's sync array), aliased into the kernels. Those are
not in the kernel bench's figures (docs/performance.md, "Nor our own memsets"). This
script measures them: each cell's jitted call, timed by ``cupti_time`` and then traced by
``jax.profiler`` (the device plane's stream lines, every activity: kernels, memsets,
memcpys), over ``CALLS`` calls on rotated inputs.

Per cell it prints: the CUPTI kernel time (median us a call), from the trace the kernels'
and the memsets' / memcpys' mean us a call and how many a call, and the memsets' share of
kernels + memsets. Device, date and method are in the output.

Usage (GPU machine): python benchmarks/kernel_clock_gaps.py OUT.json [--more | CELL ... |
  --e2e CONFIG]
  CELL: op:pass:MxN[:dtype][@backend] (``_cell``), pass fwd|fwdbwd (default: the
  split-row cells of the kernel bench and a one-tile cell beside them; ``--more``: the
  residual add, FP8 output and input, and the Triton and Mosaic backends; ``--e2e``:
  the e2e bench's train steps of one config instead, ``main_e2e``: llama, qwen3, gemma
  or the bench's ``--fp8-dense`` d4096 etc.)
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_norm
from pallas_norm import config as C
from pallas_norm.bench import timing

CALLS = 20
DEFAULT_CELLS = ["rms:fwdbwd:4096x4096", "rms:fwd:4096x65536", "rms:fwdbwd:4096x65536",
                 "layer:fwd:4096x65536", "layer:fwdbwd:4096x65536",
                 "rms:fwdbwd:16384x16384", "layer:fwdbwd:16384x16384",
                 "rms:fwd:1024x262144", "layer:fwdbwd:1024x262144",
                 "rms_fp8in:fwdbwd:4096x16384", "layer_fp8in:fwdbwd:4096x16384"]
# --more: the other ops' kernels (residual add, FP8 output, the other backends)
MORE_CELLS = ["rms_res:fwdbwd:8192x4096", "layer_res:fwdbwd:8192x4096",
              "layer_res:fwdbwd:4096x65536", "rms_fp8in:fwdbwd:8192x4096",
              "rms_fp8:fwd:8192x4096", "layer_fp8_t:fwd:8192x4096",
              "rms_fp8_delayed:fwd:8192x4096", "layer_fp8_delayed_t:fwd:8192x4096",
              "layer_fp8_delayed:fwd:4096x8192", "rms:fwdbwd:8192x4096@mosaic",
              "layer:fwdbwd:8192x4096@mosaic", "rms:fwdbwd:8192x4096@triton",
              "layer:fwdbwd:4096x65536@triton"]
FP8_DELAYED_SCALE = 8.0 / 448.0  # the kernel bench's (plan.FP8_DELAYED_SCALE)
# KEEP_Y_SCALE=1: the delayed cells return the given y_scale (a constant of the step) as
# the kernel bench did before 2026-11-27 (a MemcpyD2D a call)
KEEP_Y_SCALE = os.environ.get("KEEP_Y_SCALE") == "1"


def _cell(spec: str):
  """(name, step, arg_sets) of 'op:pass:MxN[:dtype][@backend]': op rms|layer, then
  optionally _res (the fused residual add), _fp8in (FP8 x), or _fp8[_delayed][_t] (FP8
  output, forward only: current or delayed scaling, with y_t); backend pallas (default),
  triton or mosaic."""
  spec_, _, backend = spec.partition("@")
  backend = backend or "pallas"
  op, pass_, shape, *rest = spec_.split(":")
  m, n = map(int, shape.split("x"))
  dtype = jnp.dtype(rest[0] if rest else "bfloat16")
  layer = op.startswith("layer")
  fp8 = op.endswith("_fp8in")
  res = op.endswith("_res")
  fp8_out = "_fp8" in op and not fp8
  norm = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
  opts = dict(backend=backend)
  if fp8_out:
    if pass_ != "fwd":
      raise ValueError(f"{spec}: FP8 output is forward only")
    norm = pallas_norm.layer_norm_fp8 if layer else pallas_norm.rms_norm_fp8
    opts.update(transpose=op.endswith("_t"))
    if "_delayed" in op:
      opts.update(y_scale=jnp.float32(FP8_DELAYED_SCALE))
  if fp8:
    opts.update(out_dtype=dtype)
  key = jax.random.split(jax.random.key(0), 8)
  w = (1 + 0.1 * jax.random.normal(key[0], (n,))).astype(jnp.bfloat16)
  params = (w, w) if layer else (w,)
  sets = []
  n_sets = max(2, timing_rotations(m, n))
  for i in range(n_sets):
    k = jax.random.split(key[1 + i % 7], 4)
    if fp8:
      x = (2 * jax.random.normal(k[0], (m, n))).astype(jnp.float8_e4m3fn)
      xs = jax.random.uniform(k[1], (m, n // 16), minval=0.5, maxval=2.0)
      kw = dict(x_scale=xs)
    else:
      x, kw = jax.random.normal(k[0], (m, n), dtype), {}
    if res:
      kw = dict(residual=jax.random.normal(k[3], (m, n), dtype))
    dy = jax.random.normal(k[2], (m, n), dtype)
    sets.append((x, dy, kw))

  def fwd(x, dy, kw):
    out = norm(x, *params, **kw, **opts)
    if fp8_out and "_delayed" in op and not KEEP_Y_SCALE:  # as the kernel bench's step
      return out._replace(y_scale=None)  # (peers._fp8_fn: the given scale, a constant)
    return out

  def fwdbwd(x, dy, kw):
    y, vjp = jax.vjp(lambda x: norm(x, *params, **kw, **opts), x)
    cot = (dy, dy) if res else dy  # (y, h) with the residual add
    return y, vjp(cot)[0]

  step = jax.jit(fwd if pass_ == "fwd" else fwdbwd)
  return spec, step, sets


def timing_rotations(m: int, n: int) -> int:
  """Input sets so that they span >= 256 MiB (the bench's rotation: no L2 carry-over)."""
  return int(np.ceil((256 << 20) / (m * n * 2)))


def _trace_events(step, arg_sets, calls: int):
  """Per-activity (name, duration_ns) on the device plane's stream lines, over ``calls``
  calls, and the line names seen."""
  for a in arg_sets[:2]:
    jax.block_until_ready(step(*a))
  d = tempfile.mkdtemp()
  jax.profiler.start_trace(d)
  for i in range(calls):
    out = step(*arg_sets[i % len(arg_sets)])
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  path = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
  data = jax.profiler.ProfileData.from_file(path)
  events, lines = [], set()
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      names = [e.name for e in line.events]
      common = sorted(set(names), key=names.count, reverse=True)[:4]
      lines.add(f"{line.name} [{len(names)} events: {', '.join(n[:40] for n in common)}]")
      if not line.name.startswith("Stream"):
        continue  # derived lines (XLA Ops, Modules) repeat the stream's activities
      events += [(e.name, e.duration_ns, dict(e.stats).get("hlo_op", ""))
                 for e in line.events]  # (a duplicate "_src" stat key: the last wins)
  return events, sorted(lines)


def _kind(name: str) -> str:
  low = name.lower()
  return "memset" if "memset" in low else "memcpy" if "memcpy" in low else "kernel"


def main(out_path, specs):
  dev = C.device_info()
  print(f"device {dev.name}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"jax {jax.__version__}; {CALLS} calls a cell on rotated inputs (>= 256 MiB); "
        f"cupti = timing.cupti_time (kernels only, median a call); trace = "
        f"jax.profiler's device plane, stream lines, mean a call", flush=True)
  # Every CUPTI timing first: once jax.profiler has traced, the CUPTI client of
  # cupti_time stops ("activity records were dropped").
  cuptis = {}
  for spec in specs:
    _, step, sets = _cell(spec)
    cuptis[spec] = timing.cupti_time(step, sets, CALLS)
    del step, sets
  rows = []
  for spec in specs:
    name, step, sets = _cell(spec)
    cupti = cuptis[spec]
    events, lines = _trace_events(step, sets, CALLS)
    del step, sets
    by = {"kernel": [], "memset": [], "memcpy": []}
    for nm, ns, _ in events:
      by[_kind(nm)].append((nm, ns))
    per = {k: sum(ns for _, ns in v) / 1e3 / CALLS for k, v in by.items()}
    cnt = {k: len(v) / CALLS for k, v in by.items()}
    share = per["memset"] / max(1e-9, per["kernel"] + per["memset"])
    row = dict(cell=name, cupti_us=cupti.get("us"), cupti_kernels=cupti.get("kernels"),
               trace_kernel_us=per["kernel"], trace_memset_us=per["memset"],
               trace_memcpy_us=per["memcpy"], kernels_per_call=cnt["kernel"],
               memsets_per_call=cnt["memset"], memcpys_per_call=cnt["memcpy"],
               memset_share=share, memset_names=sorted({n for n, _ in by["memset"]}),
               lines=lines)
    rows.append(row)
    print(f"{name:32s} cupti {row['cupti_us'] or float('nan'):9.1f} us | trace kernels "
          f"{per['kernel']:9.1f} us ({cnt['kernel']:.0f}) memsets {per['memset']:6.2f} us "
          f"({cnt['memset']:.0f}) memcpys {per['memcpy']:6.2f} us ({cnt['memcpy']:.0f}) | "
          f"memsets {100 * share:.2f}% of kernels + memsets", flush=True)
    print("  the device plane's lines:", *lines, sep="\n    ", flush=True)
  with open(out_path, "w") as f:
    json.dump(dict(device=dev.name, date=time.strftime("%Y-%m-%d"), calls=CALLS,
                   jax=jax.__version__, rows=rows), f, indent=1)


def main_e2e(out_path, config_names):
  """The e2e bench's train steps (``pallas_norm.bench.e2e``: its configs, variants and
  non-donating step, as its CUPTI breakdown takes them): per variant the CUPTI kernel
  time of a step, and from the trace the kernels', memsets' and memcpys' time a step,
  the memcpys of HLO instructions in the ``pn_norm`` name scope apart (what the
  breakdown's ``norm`` category would leave out)."""
  from pallas_norm.bench import e2e
  dev = C.device_info()
  steps = 3
  print(f"device {dev.name}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"jax {jax.__version__}; e2e train steps (pallas_norm.bench.e2e.build, the "
        f"non-donating step), {steps} steps a variant: cupti = timing.cupti_time "
        f"(kernels only, median a step); trace = jax.profiler's device plane, stream "
        f"lines, mean a step", flush=True)
  built = []
  for name in config_names:
    cfg = (e2e.CONFIGS | e2e.FP8_DENSE_CONFIGS)[name]
    if cfg.style == "dense":
      tokens = jax.random.normal(jax.random.key(0), (cfg.batch * cfg.seq, cfg.d),
                                 jnp.bfloat16)
      variants = ("flax", "pallas")
    else:
      tokens = jax.random.randint(jax.random.key(0), (cfg.batch, cfg.seq + 1), 0,
                                  cfg.vocab)
      variants = e2e.VARIANTS
    for v in variants:
      step, _, params, opt_state = e2e.build(cfg, v, 0)
      step = step.lower(params, opt_state, tokens).compile()  # (compiled once)
      hlo = step.as_text()
      args = (params, opt_state, tokens)
      built.append((name, v, step, args, e2e.norm_fusions(hlo),
                    timing.cupti_time(step, [args], steps)))
  rows = []
  for name, v, step, args, norm_names, cupti in built:  # traces after every CUPTI timing
    events, _ = _trace_events(step, [args], steps)
    per = {"kernel": 0.0, "memset": 0.0, "memcpy": 0.0, "memcpy_norm": 0.0}
    cnt = dict.fromkeys(per, 0)
    for nm, ns, op in events:
      k = _kind(nm)
      per[k] += ns / 1e3 / steps
      cnt[k] += 1 / steps
      if k == "memcpy" and (op in norm_names or op.replace(".", "_") in norm_names):
        per["memcpy_norm"] += ns / 1e3 / steps
        cnt["memcpy_norm"] += 1 / steps
    row = dict(config=name, variant=v, cupti_us=cupti.get("us"),
               **{f"trace_{k}_us": u for k, u in per.items()},
               **{f"{k}s_per_step": c for k, c in cnt.items()},
               memcpy_ops=sorted({op for nm, _, op in events if _kind(nm) == "memcpy"}))
    rows.append(row)
    print(f"{name:6s} {v:7s} cupti {row['cupti_us'] or float('nan'):9.1f} us | trace kernels "
          f"{per['kernel']:9.1f} us ({cnt['kernel']:.0f}) memsets {per['memset']:6.2f} us "
          f"({cnt['memset']:.0f}) memcpys {per['memcpy']:6.2f} us ({cnt['memcpy']:.0f}), in "
          f"pn_norm {per['memcpy_norm']:6.2f} us ({cnt['memcpy_norm']:.0f}) | memcpy ops "
          f"{row['memcpy_ops'][:8]}", flush=True)
  with open(out_path, "w") as f:
    json.dump(dict(device=dev.name, date=time.strftime("%Y-%m-%d"), steps=steps,
                   jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  cells = sys.argv[2:]
  if cells[:1] == ["--e2e"]:
    if len(cells) != 2:  # every variant's state is held until the traces, which come
      # after every CUPTI timing of the process (llama and gemma in one process ran out
      # of an H100's memory)
      sys.exit("--e2e takes one config a process: llama, qwen3, gemma, d4096, ...")
    main_e2e(sys.argv[1], cells[1:])
    sys.exit(0)
  if cells == ["--more"]:
    cells = MORE_CELLS
  main(sys.argv[1], cells or DEFAULT_CELLS)
