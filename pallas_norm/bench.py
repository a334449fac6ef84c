"""Side-by-side GPU benchmark: ``python -m pallas_norm.bench`` (or ``make bench``).

Runs RMSNorm and LayerNorm, forward and forward+backward, for pallas_norm (every mode
and the heuristic, on the ``"pallas"`` and ``"triton"`` backends) and its peers in the
same process on the same inputs: the XLA reference (``reference.norm`` under
``jax.jit``), ``flax.nnx.RMSNorm``/``LayerNorm``, tokamax, torch and Liger-Kernel
(each one when it can be imported; otherwise the reason is printed).

Method (``../shared/BENCHMARKING.md``):
  * JAX: CUPTI kernel time from ``jax.experimental.mosaic.gpu.profiler.measure(step,
    aggregate=False, iterations=K)``; the time of one call is the sum of all of its
    kernels (a backward is several). ``XLA_FLAGS`` gets
    ``--xla_gpu_enable_command_buffer=`` before jax starts its backend, so that CUPTI
    sees the kernels; when it still reports none the row says "n/a" and why.
  * L2: R device copies of the inputs, R * bytes(x) >= 4 * L2, and ``step`` cycles
    through them, one copy per call. No flush kernel (its dirty lines would be
    written back on the next kernel's time).
  * Compilation is excluded (one warm-up call); the median of ``--iters`` (>= 30)
    calls is reported, with the 10th and 90th percentiles in the JSON.
  * forward+backward = ``jax.jit`` of ``jax.vjp`` of the op applied to a fixed random
    dy; the step returns y too, so that every implementation writes it.
  * tokamax is timed as ``PallasTritonNormalization(input_output_alias=False)``: the op
    that ``tokamax.layer_norm(..., implementation="triton")`` calls, with the same
    kernel and launch config, minus one thing. Its default forward aliases y onto x;
    in a jitted step whose x stays live (a parameter here, a residual stream in a
    model), XLA then copies x first with a device-to-device memcpy. CUPTI kernel time
    does not see that copy, and the kernel then reads x from L2, where the copy left
    it. On an H200 (2026-11-21), 4096x1024 bf16: 4.26 us aliased (kernel only), 5.79 us
    without the alias (``benchmarks/results/h200_2026-11-21_tokamax_alias.txt``).
    Its VJP writes dx over x in the same way; ``tokamax_vjp_without_alias`` launches
    the same kernel with the same config into a buffer of its own. The step's results
    are bitwise the same. H200, 2026-11-22, RMSNorm 32768x128 forward+backward: 13.94 us
    aliased (kernels only), 15.30 us without; the H100: 15.17 / 17.74 us. From 4096x4096
    up the two tie (``benchmarks/results/h200_2026-11-22_tokamax_vjp_alias.txt``).
  * torch peers: CUDA events around each call on the same rotated inputs (shared
    through DLPack), queued behind ``torch.cuda._sleep`` so the host runs ahead; the
    median. Events include the gaps between a call's kernels, which CUPTI does not.
  * Copy: ``-a`` on a 1 GiB buffer under ``jax.jit`` (one read and one write of every
    byte), timed as above: copy GB/s = 2 * bytes / median time.

Bytes model (the fewest bytes through HBM; scale, bias, mean and rstd are negligible):
  forward          read x, write y                         2 * M * N * itemsize
  forward+backward forward, then read x and dy, write dx   5 * M * N * itemsize
GB/s = bytes / median time, and "% copy" = GB/s / copy GB/s of the same run.

Output: progress lines as it goes; JSON and CSV (rows + metadata) and a PNG plot at
``--out``; the summary table is printed last. ``--plot-only A.json [B.json ...]``
merges result files and redraws the plot and the table; ``--dry-run`` prints the plan.
"""

from __future__ import annotations

import os

_COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="


def _set_xla_env() -> None:
  """Append the CUPTI-friendly XLA flag (keeping XLA_FLAGS) and share the GPU with torch."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_enable_command_buffer" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_COMMAND_BUFFER_FLAG}".strip()
  # JAX would take 75% of the GPU up front; torch peers need room beside it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge._backends)
  except Exception:  # noqa: BLE001 - a private attribute; unknown means "no"
    return False


# XLA reads XLA_FLAGS when it creates its backend, not when jax is imported (which the
# package __init__ has already done under `python -m`), so this is early enough unless
# something started the backend already; _run says so if it did.
_BACKEND_STARTED_EARLY = _backend_started()
_set_xla_env()

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.stages  # noqa: E402
import numpy as np  # noqa: E402

from pallas_norm import reference  # noqa: E402

__all__ = [
    "BENCH_SHAPES",
    "LLM_SHAPES",
    "IMPLS",
    "Case",
    "bytes_model",
    "parse_shapes",
    "rotations",
    "build_plan",
    "format_table",
    "plot",
    "main",
]

# The table of BENCHMARKING.md, then Llama/Qwen hidden sizes with M = 8192 tokens.
BENCH_SHAPES = ((4096, 1024), (4096, 4096), (4096, 8192), (8192, 5120), (32768, 128),
                (16384, 16384), (4096, 65536), (1024, 262144))
LLM_SHAPES = ((8192, 2048), (8192, 4096), (8192, 5120), (8192, 8192))
_QUICK_SHAPES = ((4096, 1024), (8192, 4096), (32768, 128), (4096, 65536))

# "*_res": the fused residual add, (y, h) = (norm(x + r), x + r), residual in x's dtype.
_OPS = ("rms", "layer", "rms_res", "layer_res")
_PASSES = ("fwd", "fwdbwd")
_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
_EPS = {"rms": 1e-6, "layer": 1e-5, "rms_res": 1e-6, "layer_res": 1e-5}  # the same eps for every implementation
_BYTES_FACTOR = {"fwd": 2, "fwdbwd": 5}
# With a residual: forward reads x and r, writes y and h; backward reads dy, dh and h,
# writes dx (= dresidual).
_BYTES_FACTOR_RES = {"fwd": 4, "fwdbwd": 8}
# The implementations that serve the fused residual add (the others: n/a): ours, XLA's
# fusion of the same formula, and a flax user's `h = x + r; norm(h)`.
_RES_IMPLS = ("pallas", "xla", "flax")
# Relative error ||out - ref|| / ||ref|| accepted by --check, per dtype.
_CHECK_TOL = {"bf16": 1e-2, "f16": 2e-3, "f32": 1e-4}
_MODE_SHORT = {"reload": "multi_wave_reload", "cached": "multi_wave_cached",
               "persistent": "static_persistent"}
_ASSUMED_L2 = 64 << 20  # when torch cannot tell (H100: 50 MB, H200: 60 MB)
_MAX_ROTATIONS = 64
_COPY_BYTES = 1 << 30
_STATUSES = {"ok": "", "n/a": "n/a", "skipped": "skip", "error": "err",
             "unavailable": "unav", "not run": "-"}


@dataclasses.dataclass(frozen=True)
class _Impl:
  """One implementation: ``family`` is "pallas_norm" or "peer"; ``kind`` "jax" or "torch"."""

  name: str
  family: str
  kind: str
  phase: int  # 0: the heuristic and the peers; 1: the per-mode sweep
  abbrev: str
  backend: str | None = None
  mode: str | None = None


IMPLS = (
    _Impl("pallas", "pallas_norm", "jax", 0, "pal", backend="pallas"),
    _Impl("triton", "pallas_norm", "jax", 0, "tri", backend="triton"),
    _Impl("xla", "peer", "jax", 0, "xla"),
    _Impl("flax", "peer", "jax", 0, "flax"),
    _Impl("tokamax", "peer", "jax", 0, "tkmx"),
    _Impl("torch", "peer", "torch", 0, "torch"),
    _Impl("liger", "peer", "torch", 0, "liger"),
) + tuple(
    _Impl(f"{backend}:{short}", "pallas_norm", "jax", 1, f"{backend[:3]}.{short[:2]}",
          backend=backend, mode=mode)
    for backend in ("pallas", "triton") for short, mode in _MODE_SHORT.items())
_IMPL_BY_NAME = {i.name: i for i in IMPLS}


@dataclasses.dataclass(frozen=True)
class Case:
  """One measurement: (op, pass, shape, implementation)."""

  phase: int
  m: int
  n: int
  op: str
  pass_: str
  impl: str


# --------------------------------------------------------------------------- plan


def bytes_model(m: int, n: int, itemsize: int, pass_: str, op: str = "rms") -> int:
  """Bytes a norm must move: forward 2*M*N*itemsize, forward+backward 5*M*N*itemsize;
  with the fused residual add ("*_res" ops) 4 and 8 (x, r -> y, h; dy, dh, h -> dx)."""
  if pass_ not in _BYTES_FACTOR:
    raise ValueError(f"{pass_=} must be one of {tuple(_BYTES_FACTOR)}")
  factor = _BYTES_FACTOR_RES if op.endswith("_res") else _BYTES_FACTOR
  return factor[pass_] * m * n * itemsize


def _serves(impl: _Impl, op: str) -> bool:
  """Whether ``impl`` runs ``op`` (the fused residual add: ours on Pallas, XLA, flax)."""
  if not op.endswith("_res"):
    return True
  return (impl.backend or impl.name) in _RES_IMPLS


def rotations(m: int, n: int, itemsize: int, l2_bytes: int) -> int:
  """Copies R of x (and dy) so that R * bytes(x) >= 4 * L2 (at least 1, at most 64)."""
  return int(min(_MAX_ROTATIONS, max(1, math.ceil(4 * l2_bytes / (m * n * itemsize)))))


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
  """"4096x1024,8192x4096" -> ((4096, 1024), (8192, 4096)); duplicates dropped."""
  shapes = []
  for tok in text.split(","):
    tok = tok.strip().lower()
    if not tok:
      continue
    parts = tok.split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"shape {tok!r} must be MxN, e.g. 4096x1024")
    m, n = (int(p) for p in parts)
    if m < 1 or n < 1:
      raise ValueError(f"shape {tok!r}: M and N must be positive")
    if (m, n) not in shapes:
      shapes.append((m, n))
  if not shapes:
    raise ValueError(f"no shape in {text!r}")
  return tuple(shapes)


def _parse_list(text: str, valid, what: str) -> tuple[str, ...]:
  items = tuple(t.strip() for t in text.split(",") if t.strip())
  bad = [t for t in items if t not in valid]
  if bad or not items:
    raise ValueError(f"{what} {bad or text!r} not in {tuple(valid)}")
  return items


def _select_impls(text: str | None, quick: bool) -> tuple[_Impl, ...]:
  """``--impls``: names, or ``family:*`` for every mode of a backend (``pallas:*``)."""
  if text is None:
    return tuple(i for i in IMPLS if not quick or i.phase == 0)
  chosen = []
  for tok in (t.strip() for t in text.split(",") if t.strip()):
    if tok.endswith(":*"):
      hits = [i for i in IMPLS if i.name.startswith(tok[:-1])]
    else:
      hits = [i for i in IMPLS if i.name == tok]
    if not hits:
      raise ValueError(f"--impls: {tok!r} matches none of {[i.name for i in IMPLS]} "
                       f"(use e.g. 'pallas:*' for every mode)")
    chosen += [i for i in hits if i not in chosen]
  return tuple(i for i in IMPLS if i in chosen)


def build_plan(args: argparse.Namespace) -> list[Case]:
  """Cases in run order: phase (heuristic and peers first), shape, op, pass, impl.

  Phase 1 (the per-mode sweep) comes after every shape of phase 0, so that a run cut
  short by ``--budget-s`` still has the comparison that matters.
  """
  impls = _select_impls(args.impls, args.quick)
  if args.shapes:
    shapes = parse_shapes(args.shapes)
  elif args.quick:
    shapes = _QUICK_SHAPES
  else:
    shapes = tuple(dict.fromkeys(BENCH_SHAPES + LLM_SHAPES))
  ops = _parse_list(args.ops, _OPS, "--ops")
  passes = _parse_list(args.passes, _PASSES, "--passes")
  return [Case(phase, m, n, op, p, impl.name)
          for phase in (0, 1) for m, n in shapes for op in ops for p in passes
          for impl in impls if impl.phase == phase and _serves(impl, op)]


def _groups(plan: list[Case]):
  """[((phase, m, n), [cases])] in plan order: the inputs are built once per group."""
  out: dict[tuple[int, int, int], list[Case]] = {}
  for c in plan:
    out.setdefault((c.phase, c.m, c.n), []).append(c)
  return list(out.items())


def _print_plan(plan: list[Case], args: argparse.Namespace) -> None:
  itemsize = jnp.dtype(_DTYPES[args.dtype]).itemsize
  print(f"plan: {len(plan)} cases, dtype={args.dtype}, iters={args.iters}, "
        f"budget={args.budget_s:.0f}s; R assumes L2={_ASSUMED_L2 >> 20} MiB "
        f"(the run reads it from torch); availability is probed at run time")
  for (phase, m, n), cases in _groups(plan):
    ops = ",".join(dict.fromkeys(c.op for c in cases))
    passes = ",".join(dict.fromkeys(c.pass_ for c in cases))
    impls = ",".join(dict.fromkeys(c.impl for c in cases))
    r = rotations(m, n, itemsize, _ASSUMED_L2)
    mib = m * n * itemsize / 2**20
    print(f"  phase {phase} {f'{m}x{n}':<12} x={mib:7.1f} MiB R={r:<2} ops={ops} passes={passes} "
          f"impls={impls}")


# --------------------------------------------------------------------------- timing


class _NoGpu(RuntimeError):
  pass


def _require_gpu() -> None:
  backend = jax.default_backend()
  if backend != "gpu":
    raise _NoGpu(f"pallas_norm.bench needs a GPU (jax.default_backend()={backend!r}); "
                 f"use --dry-run to print the plan or --plot-only FILE.json to redraw "
                 f"a result")


def _profiler():
  from jax.experimental.mosaic.gpu import profiler
  return profiler


def _rotating_step(step, arg_sets):
  """A callable that runs ``step`` on the next argument set at each call.

  ``profiler.measure`` calls its function with the same arguments every iteration and
  jits anything that is not already a ``jax.stages.Wrapped``; subclassing that protocol
  keeps the rotation in Python, one copy per call.
  """
  class _Rotating(jax.stages.Wrapped):

    def __init__(self):
      self.calls = 0

    def __call__(self):
      args = arg_sets[self.calls % len(arg_sets)]
      self.calls += 1
      # Hand back only the smallest output: it is ready when the whole call is, and
      # the big ones are freed instead of piling up over the iterations.
      return min(jax.tree.leaves(step(*args)), key=lambda a: a.size)

    def trace(self, *args, **kwargs):
      raise NotImplementedError

    def lower(self, *args, **kwargs):
      raise NotImplementedError

  return _Rotating()


def _summarise(per_call_us: list[float]) -> dict:
  a = np.asarray(per_call_us, np.float64)
  return {"us": float(np.median(a)), "us_p10": float(np.percentile(a, 10)),
          "us_p90": float(np.percentile(a, 90)), "samples": int(a.size)}


def _cupti_time(step, arg_sets, iters: int) -> dict:
  """CUPTI kernel time of ``step`` over rotated ``arg_sets``: {us, us_p10, us_p90, kernels}
  or {status: "n/a", reason}."""
  rot = _rotating_step(step, arg_sets)
  try:
    _, timings = _profiler().measure(rot, aggregate=False, iterations=iters)()
  except RuntimeError as e:  # e.g. kernel names differing between iterations
    return {"status": "n/a", "reason": f"CUPTI: {e}"}
  if not timings:
    return {"status": "n/a", "reason": "CUPTI reported no kernels (XLA may have run the "
                                       "program as a command buffer)"}
  if isinstance(timings[0], tuple):  # iterations=1 returns one list, not a list of lists
    timings = [timings]
  per_call = [sum(ms for _, ms in it) * 1e3 for it in timings]
  out = _summarise(per_call)
  out["kernels"] = [name for name, _ in timings[0]]
  # Each kernel's own median, in launch order (so they need not add up to "us"), over
  # the calls that launched the same kernels as the first.
  names = out["kernels"]
  same = [it for it in timings if [nm for nm, _ in it] == names]
  out["kernel_us"] = [float(np.median([it[i][1] for it in same]) * 1e3)
                      for i in range(len(names))]
  return out


def _torch_time(call, n_sets: int, iters: int) -> dict:
  """Median CUDA-event time of ``call(i)``, i cycling over ``n_sets`` rotated inputs."""
  import torch
  call(0)
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  for i in range(3):
    call(i % n_sets)
  host_s = (time.perf_counter() - t0) / 3  # host time to enqueue one call
  torch.cuda.synchronize()
  starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
  ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
  sleep = getattr(torch.cuda, "_sleep", None)
  if sleep is not None:  # let the host enqueue every call before the GPU reaches them
    sleep(int(min(2e9, 2e9 * 1.5 * iters * host_s)))
  for k in range(iters):
    starts[k].record()
    call(k % n_sets)
    ends[k].record()
  torch.cuda.synchronize()
  return _summarise([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


# --------------------------------------------------------------------------- implementations


def _jax_fn(impl: _Impl, op: str):
  """f(x, scale, bias) -> y for a JAX implementation (bias is None for RMSNorm); for a
  "*_res" op, f((x, r), scale, bias) -> (y, h)."""
  eps = _EPS[op]
  if op.endswith("_res"):
    return _residual_fn(impl, op[:-len("_res")], eps)
  layer = op == "layer"
  if impl.family == "pallas_norm":
    import pallas_norm
    if layer:
      return lambda x, s, b: pallas_norm.layer_norm(x, s, b, eps=eps, mode=impl.mode,
                                                    backend=impl.backend)
    return lambda x, s, b: pallas_norm.rms_norm(x, s, eps=eps, mode=impl.mode,
                                                backend=impl.backend)
  if impl.name == "xla":
    return lambda x, s, b: reference.norm(x, s, b, eps=eps, subtract_mean=layer)[0]
  if impl.name == "tokamax":
    import tokamax
    from absl import flags
    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags: not our argv
      flags.FLAGS(sys.argv[:1])
    # What layer_norm(implementation="triton") runs, without the y-onto-x and dx-onto-x
    # aliases whose memcpy CUPTI cannot see (module docstring).
    from tokamax._src.ops.normalization import pallas_triton
    op = pallas_triton.PallasTritonNormalization(input_output_alias=False,
                                                 vjp=tokamax_vjp_without_alias())
    return lambda x, s, b: op(x=x, scale=s, offset=b, epsilon=eps, subtract_mean=layer)
  if impl.name == "flax":
    return _flax_fn(op, eps)
  raise ValueError(f"{impl.name=} is not a JAX implementation")


class _DropAliases:
  """A module whose ``pallas_call`` loses its ``input_output_aliases`` argument; every
  other attribute is the wrapped module's."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    return getattr(self._module, name)

  def pallas_call(self, *args, input_output_aliases=None, **kwargs):
    del input_output_aliases  # the outputs get buffers of their own
    return self._module.pallas_call(*args, **kwargs)


def tokamax_vjp_without_alias():
  """tokamax's Pallas-Triton VJP with the same kernel and launch config, minus the
  dx-onto-x alias of its ``pallas_call`` (module docstring: CUPTI does not see the copy
  of x that the alias costs).

  Raises:
    RuntimeError: this tokamax's VJP no longer launches through ``block.pallas_call``,
      so the alias cannot be dropped (rather than time it with a hidden copy).
  """
  from tokamax._src.ops.normalization import pallas_triton_vjp as tv
  if not callable(getattr(getattr(tv, "block", None), "pallas_call", None)):
    raise RuntimeError("tokamax's pallas_triton_vjp has no block.pallas_call to drop the "
                       "dx-onto-x alias from; update bench.tokamax_vjp_without_alias")

  class NoAliasVjp(tv.PallasTritonNormalizationVjp):
    # tokamax binds arguments by _fwd's signature: keep the original's.
    @functools.wraps(tv.PallasTritonNormalizationVjp._fwd)
    def _fwd(self, *args, **kwargs):  # runs while the op is traced
      block = tv.block
      tv.block = _DropAliases(block)
      try:
        return super()._fwd(*args, **kwargs)
      finally:
        tv.block = block

  return NoAliasVjp()


def _residual_fn(impl: _Impl, op: str, eps: float):
  """f((x, r), scale, bias) -> (y, h) for the fused residual add."""
  layer = op == "layer"
  if impl.family == "pallas_norm":
    import pallas_norm
    norm = pallas_norm.layer_norm if layer else pallas_norm.rms_norm
    extra = (lambda b: (b,)) if layer else (lambda b: ())
    return lambda xr, s, b: norm(xr[0], s, *extra(b), residual=xr[1], eps=eps,
                                 mode=impl.mode, backend=impl.backend)
  if impl.name == "xla":  # the same formula, jnp under jit: XLA fuses it
    def f(xr, s, b):
      x, r = xr
      h = x.astype(jnp.float32) + r.astype(jnp.float32)
      y = reference.norm(h, s, b, eps=eps, subtract_mean=layer)[0]
      return y.astype(x.dtype), h.astype(r.dtype)
    return f
  if impl.name == "flax":  # what a flax model writes: the add, then flax's norm
    norm = _flax_fn(op, eps)
    def g(xr, s, b):
      h = xr[0] + xr[1]
      return norm(h, s, b), h
    return g
  raise NotImplementedError(f"{impl.name} has no fused residual add")


def _flax_fn(op: str, eps: float):
  """flax.nnx defaults (LayerNorm: use_fast_variance=True), eps matched, params and
  output in x's dtype, run functionally (split/merge, what nnx.jit does)."""
  from flax import nnx

  def f(x, s, b):
    n = x.shape[-1]
    kw = dict(epsilon=eps, dtype=x.dtype, param_dtype=s.dtype, rngs=nnx.Rngs(0))
    module = nnx.LayerNorm(n, **kw) if op == "layer" else nnx.RMSNorm(n, **kw)
    graphdef, _ = nnx.split(module)
    params = {"scale": nnx.Param(s)}
    if op == "layer":
      params["bias"] = nnx.Param(b)
    return nnx.merge(graphdef, nnx.State(params))(x)

  return f


def _torch_fn(impl: _Impl, op: str):
  """f(x, weight, bias) -> y on torch CUDA tensors."""
  eps = _EPS[op]
  if impl.name == "torch":
    import torch.nn.functional as F
    if op == "layer":
      return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, eps)
  if impl.name == "liger":
    from liger_kernel.transformers import functional as lf
    if op == "layer":
      return lambda x, w, b: lf.liger_layer_norm(x, w, b, eps)
    # in_place=False: the default writes dx over dy, which the rotation reuses.
    return lambda x, w, b: lf.liger_rms_norm(x, w, eps, in_place=False)
  raise ValueError(f"{impl.name=} is not a torch implementation")


def _probe(impl: _Impl, torch_ok: tuple[bool, str]) -> str | None:
  """Why ``impl`` cannot run here, or None."""
  needs = {"triton": "jax_triton", "flax": "flax.nnx", "tokamax": "tokamax",
           "liger": "liger_kernel.transformers.functional"}
  if impl.kind == "torch" and not torch_ok[0]:
    return torch_ok[1]
  mod = needs.get(impl.backend if impl.family == "pallas_norm" else impl.name)
  if mod is None:
    return None
  try:
    importlib.import_module(mod)
  except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
    return f"cannot import {mod}: {type(e).__name__}: {e}"
  return None


def _torch_status() -> tuple[bool, str]:
  try:
    import torch
  except Exception as e:  # noqa: BLE001
    return False, f"cannot import torch: {e}"
  if not torch.cuda.is_available():
    return False, f"torch {torch.__version__} has no CUDA device"
  return True, ""


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class _Inputs:
  """Rotated device inputs of one shape: xs/dys [R] of [M, N], scale/bias [N]."""

  xs: list
  dys: list
  scale: jax.Array
  bias: jax.Array
  torch: dict | None = None
  rs: list = dataclasses.field(default_factory=list)  # residuals ("*_res" ops)
  dhs: list = dataclasses.field(default_factory=list)  # h's cotangents


def _make_inputs(m: int, n: int, dtype, r: int, need_dy: bool, seed: int,
                 need_residual: bool = False) -> _Inputs:
  keys = jax.random.split(jax.random.key(seed), 4 * r + 2)
  xs = [jax.random.normal(keys[i], (m, n), dtype) for i in range(r)]
  dys = [jax.random.normal(keys[r + i], (m, n), dtype) for i in range(r)] if need_dy else []
  rs = dhs = []
  if need_residual:
    rs = [jax.random.normal(keys[2 * r + i], (m, n), dtype) for i in range(r)]
    if need_dy:
      dhs = [jax.random.normal(keys[3 * r + i], (m, n), dtype) for i in range(r)]
  scale = (1.0 + 0.1 * jax.random.normal(keys[-2], (n,), jnp.float32)).astype(dtype)
  bias = (0.1 * jax.random.normal(keys[-1], (n,), jnp.float32)).astype(dtype)
  jax.block_until_ready((xs, dys, rs, dhs, scale, bias))
  return _Inputs(xs, dys, scale, bias, rs=rs, dhs=dhs)


def _arg_sets(op: str, pass_: str, inp: _Inputs) -> list:
  """The rotated argument tuples of one case: (x, scale, bias[, dy]); for a "*_res" op
  x is (x, r) and dy is (dy, dh)."""
  bias = inp.bias if op.startswith("layer") else None
  xs = list(zip(inp.xs, inp.rs)) if op.endswith("_res") else inp.xs
  if pass_ == "fwd":
    return [(x, inp.scale, bias) for x in xs]
  dys = list(zip(inp.dys, inp.dhs)) if op.endswith("_res") else inp.dys
  return [(x, inp.scale, bias, dy) for x, dy in zip(xs, dys)]


def _to_torch(a: jax.Array):
  """The same device buffer as a torch tensor (DLPack); a copy if DLPack refuses."""
  import torch
  try:
    return torch.from_dlpack(a)
  except Exception:  # noqa: BLE001
    host = np.asarray(a)
    if host.dtype == jnp.bfloat16:
      return torch.from_numpy(host.view(np.uint16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(host).cuda()


def _torch_inputs(inp: _Inputs) -> dict:
  if inp.torch is None:
    inp.torch = {"xs": [_to_torch(x) for x in inp.xs], "dys": [_to_torch(d) for d in inp.dys],
                 "scale": _to_torch(inp.scale), "bias": _to_torch(inp.bias)}
  return inp.torch


# --------------------------------------------------------------------------- check


def _rel_err(out, ref) -> tuple[float, float]:
  """(||out - ref|| / ||ref||, max |out - ref|) in float32."""
  o = jnp.asarray(out, jnp.float32)
  r = jnp.asarray(ref, jnp.float32)
  d = o - r
  rel = jnp.sqrt(jnp.sum(d * d)) / jnp.maximum(jnp.sqrt(jnp.sum(r * r)), 1e-30)
  return float(rel), float(jnp.max(jnp.abs(d)))


def _reference_outputs(op: str, pass_: str, inp: _Inputs):
  """Reference y (fwd) or (y, (dx, dscale[, dbias])) (fwdbwd) on copy 0."""
  f = _jax_fn(_IMPL_BY_NAME["xla"], op)
  args = _arg_sets(op, pass_, inp)[0]
  return jax.jit(f if pass_ == "fwd" else _fwdbwd(f))(*args)


def _compare(out, ref, dtype_name: str) -> dict:
  """Every array of ``out`` against ``ref``; pass when each relative error is within
  the dtype's tolerance (NaN never passes)."""
  outs = [a for a in jax.tree.leaves(out)]
  refs = [a for a in jax.tree.leaves(ref)]
  if len(outs) != len(refs):
    return {"check": "FAIL", "check_detail": f"{len(outs)} outputs, reference has {len(refs)}"}
  errs = [_rel_err(o, r) for o, r in zip(outs, refs)]
  tol = _CHECK_TOL[dtype_name]
  ok = all(e[0] <= tol for e in errs)  # False for NaN
  names = (["y", "dx", "dscale", "dbias"] if len(errs) <= 4
           else ["y", "h", "dx", "dresidual", "dscale", "dbias"])[:len(errs)]
  detail = " ".join(f"{nm}:rel={e[0]:.2e},max={e[1]:.2e}" for nm, e in zip(names, errs))
  return {"check": "ok" if ok else "FAIL", "check_detail": f"{detail} (tol {tol:g})"}


# --------------------------------------------------------------------------- run


def _fwdbwd(f):
  def step(x, s, b, dy):
    y, pull = jax.vjp(f, x, s, b)
    return y, pull(dy)
  return step


def _run_jax_case(impl: _Impl, c: Case, inp: _Inputs, args, ref) -> dict:
  f = _jax_fn(impl, c.op)
  step = jax.jit(f if c.pass_ == "fwd" else _fwdbwd(f))
  arg_sets = _arg_sets(c.op, c.pass_, inp)
  t0 = time.perf_counter()
  out = jax.block_until_ready(step(*arg_sets[0]))  # compile + warm up
  row = {"compile_s": round(time.perf_counter() - t0, 2)}
  if ref is not None:
    row.update(_compare(out, ref, args.dtype))
  del out
  row.update(_cupti_time(step, arg_sets, args.iters))
  row["timer"] = "cupti"
  return row


def _run_torch_case(impl: _Impl, c: Case, inp: _Inputs, args, ref) -> dict:
  import torch
  f = _torch_fn(impl, c.op)
  t = _torch_inputs(inp)
  r = len(t["xs"])
  bias = t["bias"] if c.op == "layer" else None
  if c.pass_ == "fwd":
    def call(i):
      with torch.no_grad():
        return f(t["xs"][i], t["scale"], bias)
  else:
    xs = [x.detach().requires_grad_() for x in t["xs"]]
    w = t["scale"].detach().requires_grad_()
    b = bias.detach().requires_grad_() if bias is not None else None
    params = [w] + ([b] if b is not None else [])

    def call(i):
      y = f(xs[i], w, b)
      return y, torch.autograd.grad(y, [xs[i]] + params, t["dys"][i])
  t0 = time.perf_counter()
  out = call(0)
  torch.cuda.synchronize()
  row = {"compile_s": round(time.perf_counter() - t0, 2)}
  if ref is not None:
    out = (out[0].detach(), tuple(out[1])) if c.pass_ == "fwdbwd" else out
    row.update(_compare(jax.tree.map(lambda a: jnp.from_dlpack(a.contiguous()), out),
                        ref, args.dtype))
  del out
  row.update(_torch_time(call, r, args.iters))
  row["timer"] = "cuda_events"
  return row


def _run_case(c: Case, inp: _Inputs, args, copy_gbs, unavailable: dict, ref) -> dict:
  impl = _IMPL_BY_NAME[c.impl]
  itemsize = jnp.dtype(_DTYPES[args.dtype]).itemsize
  nbytes = bytes_model(c.m, c.n, itemsize, c.pass_, c.op)
  row = {"op": c.op, "pass": c.pass_, "m": c.m, "n": c.n, "dtype": args.dtype,
         "impl": c.impl, "family": impl.family, "phase": c.phase, "bytes": nbytes,
         "rotations": len(inp.xs), "iters": args.iters}
  if c.impl in unavailable:
    return {**row, "status": "unavailable", "reason": unavailable[c.impl]}
  try:
    run = _run_torch_case if impl.kind == "torch" else _run_jax_case
    row.update(run(impl, c, inp, args, ref))
  except NotImplementedError as e:
    return {**row, "status": "skipped", "reason": f"NotImplementedError: {e}"}
  except ImportError as e:
    unavailable[c.impl] = f"{type(e).__name__}: {e}"
    return {**row, "status": "error", "reason": unavailable[c.impl]}
  except Exception as e:  # noqa: BLE001 - one failure must not stop the run
    msg = "".join(traceback.format_exception_only(type(e), e)).strip()
    return {**row, "status": "error", "reason": msg[:2000]}
  if "us" not in row:
    return {**row, "status": row.pop("status", "n/a")}
  row["status"] = "ok"
  row["gbs"] = nbytes / (row["us"] * 1e-6) / 1e9
  row["pct_copy"] = 100.0 * row["gbs"] / copy_gbs if copy_gbs else None
  return row


def _warm_up(seconds: float = 3.0) -> None:
  """Keep the GPU busy for a few seconds so that its clocks have ramped before timing."""
  a = jnp.ones((1 << 28,), jnp.float32)
  f = jax.jit(lambda v: v * 2)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(a))


def _measure_copy(dtype, iters: int) -> dict:
  """GB/s of a 1 GiB read+write (``-a`` under jit): 2 * bytes / median CUPTI time."""
  itemsize = jnp.dtype(dtype).itemsize
  a = jax.random.normal(jax.random.key(1), (_COPY_BYTES // itemsize // 4096, 4096), dtype)
  step = jax.jit(lambda v: -v)
  jax.block_until_ready(step(a))
  t = _cupti_time(step, [(a,)], iters)
  del a
  if "us" not in t:
    return {"copy_gbs": None, "copy_reason": t["reason"]}
  return {"copy_gbs": 2 * _COPY_BYTES / (t["us"] * 1e-6) / 1e9, "copy_us": t["us"],
          "copy_bytes": _COPY_BYTES, "copy_kernels": t["kernels"]}


def _torch_copy_gbs(iters: int) -> float | None:
  import torch
  src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device="cuda")
  dst = torch.empty_like(src)
  t = _torch_time(lambda i: dst.copy_(src), 1, iters)
  del src, dst
  torch.cuda.empty_cache()
  return 2 * _COPY_BYTES / (t["us"] * 1e-6) / 1e9


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git_commit() -> str:
  env = os.environ.get("PALLAS_NORM_GIT_COMMIT")
  if env:
    return env
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         timeout=10, cwd=pathlib.Path(__file__).resolve().parent)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _device_meta(torch_ok: bool) -> dict:
  d = jax.devices()[0]
  meta = {"device": d.device_kind, "num_sms": getattr(d, "core_count", None),
          "l2_bytes": _ASSUMED_L2, "l2_source": "assumed"}
  if torch_ok:
    import torch
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    if l2:
      meta.update(l2_bytes=int(l2), l2_source="torch")
  return meta


def _slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


_METHOD = ("CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure, all kernels "
           "of a call summed; torch: CUDA events behind torch.cuda._sleep), median of "
           "{iters} calls after one warm-up, R rotated input copies with R*bytes(x) >= "
           "4*L2, no flush; XLA_FLAGS {flag}; bytes: fwd 2*M*N*itemsize, fwd+bwd "
           "5*M*N*itemsize; copy = -a on 1 GiB under jit, 2*bytes/time")


def _run(args, plan: list[Case]) -> int:
  start = time.perf_counter()
  dtype = _DTYPES[args.dtype]
  itemsize = jnp.dtype(dtype).itemsize
  torch_ok = _torch_status()
  dev = _device_meta(torch_ok[0])
  print(f"device: {dev['device']} ({dev['num_sms']} SMs, L2 {dev['l2_bytes'] / 1e6:.0f} MB "
        f"{dev['l2_source']}), jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}",
        flush=True)
  unavailable: dict[str, str] = {}
  for impl in dict.fromkeys(_IMPL_BY_NAME[c.impl] for c in plan):
    reason = _probe(impl, torch_ok)
    if reason:
      unavailable[impl.name] = reason
      print(f"skip {impl.name}: {reason}", flush=True)
  _warm_up()
  copy = _measure_copy(dtype, args.iters)
  copy["copy_gbs_jax"], copy["copy_source"] = copy.get("copy_gbs"), "jax -x (CUPTI)"
  if torch_ok[0]:
    copy["copy_gbs_torch"] = _torch_copy_gbs(args.iters)
    # The reference is the fastest copy measured: torch's copy_ beat XLA's elementwise
    # kernel on the H200 (4231 against 3362 GB/s, 2026-11-21).
    if copy["copy_gbs_torch"] and copy["copy_gbs_torch"] > (copy.get("copy_gbs") or 0):
      copy["copy_gbs"], copy["copy_source"] = copy["copy_gbs_torch"], "torch copy_ (events)"
  if _BACKEND_STARTED_EARLY:
    print(f"warning: the XLA backend started before bench.py set XLA_FLAGS; set "
          f"XLA_FLAGS={_COMMAND_BUFFER_FLAG} in the environment", flush=True)
  copy_txt = f"{copy['copy_gbs_jax']:.0f}" if copy.get("copy_gbs_jax") else "n/a"
  print(f"copy: {copy_txt} GB/s (jax, CUPTI)"
        + (f", {copy['copy_gbs_torch']:.0f} GB/s (torch, events)" if torch_ok[0] else "")
        + (f" -- {copy['copy_reason']}" if copy.get("copy_reason") else "")
        + f"; % of copy uses {copy['copy_source']}", flush=True)
  meta = {
      **dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "dtype": args.dtype, "iters": args.iters, "git_commit": _git_commit(),
      "jax": jax.__version__, "jaxlib": _version("jaxlib"), "triton": _version("triton"),
      "jax_triton": _version("jax-triton"), "tokamax": _version("tokamax"),
      "flax": _version("flax"), "torch": _version("torch"), "liger": _version("liger-kernel"),
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv[1:],
      "method": _METHOD.format(iters=args.iters, flag=_COMMAND_BUFFER_FLAG),
      "bytes_model": {"fwd": "2*M*N*itemsize", "fwdbwd": "5*M*N*itemsize",
                      "fwd (*_res)": "4*M*N*itemsize", "fwdbwd (*_res)": "8*M*N*itemsize"},
      "unavailable": unavailable, **copy}
  out = _out_path(args, meta)
  rows: list[dict] = []
  done = 0
  for (phase, m, n), cases in _groups(plan):
    if time.perf_counter() - start > args.budget_s:
      rows += [_not_run(c, args) for c in cases]
      continue
    r = rotations(m, n, itemsize, dev["l2_bytes"])
    inp = _make_inputs(m, n, dtype, r, any(c.pass_ == "fwdbwd" for c in cases), args.seed,
                       any(c.op.endswith("_res") for c in cases))
    refs: dict = {}
    for c in cases:
      done += 1
      elapsed = time.perf_counter() - start
      if elapsed > args.budget_s:
        rows.append(_not_run(c, args))
        continue
      ref = None
      if args.check and c.impl not in unavailable:
        if (c.op, c.pass_) not in refs:
          try:
            refs[(c.op, c.pass_)] = _reference_outputs(c.op, c.pass_, inp)
          except Exception as e:  # noqa: BLE001
            print(f"--check: reference failed for {c.op} {c.pass_} {m}x{n}: {e}", flush=True)
            refs[(c.op, c.pass_)] = None
        ref = refs[(c.op, c.pass_)]
      row = _run_case(c, inp, args, meta.get("copy_gbs"), unavailable, ref)
      rows.append(row)
      if row["status"] != "unavailable":  # the reason was printed once, above
        print(f"[{done:4d}/{len(plan)} {elapsed:6.1f}s] {_progress(row)}", flush=True)
    del inp, refs
    gc.collect()
    if "torch" in sys.modules and torch_ok[0]:
      sys.modules["torch"].cuda.empty_cache()
    _write(out, meta, rows)  # partial results survive a cut-off run
  skipped = sum(r["status"] == "not run" for r in rows)
  if skipped:
    print(f"budget of {args.budget_s:.0f}s spent: {skipped} cases not run; run subsets "
          f"(--shapes/--ops/--passes/--impls) or raise --budget-s", flush=True)
  _write(out, meta, rows)
  print(f"wrote {out} and {out.with_suffix('.csv')}")
  failed = [r for r in rows if r.get("check") == "FAIL"]
  for r in failed:
    print(f"CHECK FAILED: {r['op']} {r['pass']} {_shape_txt(r)} {r['impl']}: "
          f"{r['check_detail']}", flush=True)
  _finish(out, {"meta": meta, "rows": rows})
  return 1 if failed else 0


def _not_run(c: Case, args) -> dict:
  return {"op": c.op, "pass": c.pass_, "m": c.m, "n": c.n, "dtype": args.dtype,
          "impl": c.impl, "family": _IMPL_BY_NAME[c.impl].family, "phase": c.phase,
          "status": "not run", "reason": f"--budget-s {args.budget_s:.0f} spent"}


def _progress(row: dict) -> str:
  head = f"{row['op']:5} {row['pass']:6} {_shape_txt(row):<12} {row['impl']:17}"
  check = f"  check {row['check']} {row['check_detail']}" if "check" in row else ""
  if row["status"] != "ok":
    return f"{head} {row['status']}: {row.get('reason', '')[:300]}{check}"
  pct = f"{row['pct_copy']:4.0f}% copy" if row.get("pct_copy") is not None else "n/a copy"
  return (f"{head} {row['us']:9.1f} us {row['gbs']:6.0f} GB/s {pct}  "
          f"k={len(row.get('kernels', [])) or '-'} R={row['rotations']} "
          f"compile {row['compile_s']:.1f}s{check}")


# --------------------------------------------------------------------------- output

_CSV_FIELDS = ("op", "pass", "m", "n", "dtype", "impl", "family", "status", "us", "us_p10",
               "us_p90", "gbs", "pct_copy", "bytes", "rotations", "iters", "timer",
               "compile_s", "check", "check_detail", "kernels", "kernel_us", "reason")


def _out_path(args, meta: dict) -> pathlib.Path:
  if args.out:
    return pathlib.Path(args.out)
  return pathlib.Path("benchmarks/results") / f"{_slug(meta['device'])}_{meta['date'][:10]}.json"


def _write(path: pathlib.Path, meta: dict, rows: list[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"meta": meta, "rows": rows, "summary": _summary(rows)},
                             indent=1, default=str) + "\n")
  with path.with_suffix(".csv").open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=_CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({**r, "kernels": ";".join(r.get("kernels", [])),
                  "kernel_us": ";".join(f"{t:.2f}" for t in r.get("kernel_us", []))})


def _finish(path: pathlib.Path, doc: dict) -> None:
  png = path.with_suffix(".png")
  try:
    plot(doc, png)
    print(f"wrote {png}")
  except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
    print(f"plot failed: {type(e).__name__}: {e}")
  print(format_table(doc["rows"], doc["meta"]), flush=True)


def _shape_txt(r: dict) -> str:
  return f"{r['m']}x{r['n']}"


def _key(r: dict):
  return (r["op"], r["pass"], r["m"], r["n"])


def _summary(rows: list[dict]) -> list[dict]:
  """Per (op, pass, shape): pallas_norm's heuristic against the best peer."""
  out = []
  for key in dict.fromkeys(_key(r) for r in rows):
    ok = [r for r in rows if _key(r) == key and r["status"] == "ok"]
    peers = [r for r in ok if r["family"] == "peer"]
    ours = [r for r in ok if r["family"] == "pallas_norm"]
    heur = next((r for r in ok if r["impl"] == "pallas"), None)
    best_peer = max(peers, key=lambda r: r["gbs"], default=None)
    best_ours = max(ours, key=lambda r: r["gbs"], default=None)
    s = {"op": key[0], "pass": key[1], "m": key[2], "n": key[3],
         "pallas_gbs": heur and heur["gbs"], "pallas_pct_copy": heur and heur.get("pct_copy"),
         "best_peer": best_peer and best_peer["impl"],
         "best_peer_gbs": best_peer and best_peer["gbs"],
         "best_pallas_norm": best_ours and best_ours["impl"],
         "best_pallas_norm_gbs": best_ours and best_ours["gbs"]}
    s["ratio"] = (heur["gbs"] / best_peer["gbs"]) if heur and best_peer else None
    out.append(s)
  return out


def format_table(rows: list[dict], meta: dict) -> str:
  """GB/s per (op, pass, shape) x implementation, then pallas vs the best peer."""
  impls = [i for i in IMPLS if any(r["impl"] == i.name for r in rows)]
  width = {i.name: max(6, len(i.abbrev)) for i in impls}
  copy = meta.get("copy_gbs")
  lines = [f"{meta.get('device', '?')}  {meta.get('dtype', '?')}  {meta.get('date', '?')}  "
           f"GB/s (fwd 2*M*N*s, fwd+bwd 5*M*N*s bytes"
           f"{'; *_res 4 and 8' if any(r['op'].endswith('_res') for r in rows) else ''}); copy "
           f"{f'{copy:.0f}' if copy else 'n/a'} GB/s; commit {str(meta.get('git_commit'))[:10]}"]
  for src in meta.get("merged_from", []):  # rows of several runs; % of copy is each run's
    lines.append(f"  merged: {src['file']} ({src['date']}, commit {src['git_commit']}, copy "
                 f"{src['copy_gbs'] or 0:.0f} GB/s)")
  head = f"{'op':5} {'pass':6} {'MxN':12}" + "".join(f" {i.abbrev:>{width[i.name]}}" for i in impls)
  lines.append(head + f" | {'pal%cp':>6} {'best peer':>13} {'pal/peer':>8}")
  by = {(_key(r), r["impl"]): r for r in rows}
  for s in _summary(rows):
    key = (s["op"], s["pass"], s["m"], s["n"])
    cells = []
    for i in impls:
      r = by.get((key, i.name))
      if r is None:
        txt = ""
      elif r["status"] == "ok":
        txt = f"{r['gbs']:.0f}" + ("!" if r.get("check") == "FAIL" else "")
      else:
        txt = _STATUSES.get(r["status"], r["status"])
      cells.append(f" {txt:>{width[i.name]}}")
    pct = f"{s['pallas_pct_copy']:.0f}%" if s["pallas_pct_copy"] is not None else "-"
    peer = (f"{s['best_peer_gbs']:.0f} {s['best_peer']}" if s["best_peer"] else "-")
    ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
    lines.append(f"{s['op']:5} {s['pass']:6} {_shape_txt(s):<12}"
                 + "".join(cells) + f" | {pct:>6} {peer:>13} {ratio:>8}")
  legend = ", ".join(f"{i.abbrev}={i.name}" for i in impls)
  lines.append(f"{legend}; n/a=no CUPTI kernels, err=error, skip=refused (e.g. cached N), "
               f"unav=not importable, -=not run, !=--check failed")
  return "\n".join(lines)


def plot(doc: dict, png: str | os.PathLike) -> None:
  """GB/s against N (log2), one line per implementation, one panel per (op, pass)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in doc["rows"] if r["status"] == "ok"]
  meta = doc["meta"]
  ops = [op for op in _OPS if any(r["op"] == op for r in rows)] or ["rms"]
  passes = [p for p in _PASSES if any(r["pass"] == p for r in rows)] or ["fwd"]
  fig, axes = plt.subplots(len(ops), len(passes), figsize=(6.5 * len(passes), 4.5 * len(ops)),
                           squeeze=False)
  for (i, op), (j, p) in itertools.product(enumerate(ops), enumerate(passes)):
    ax = axes[i][j]
    for impl in dict.fromkeys(r["impl"] for r in rows):
      pts = sorted((r["n"], r["m"], r["gbs"]) for r in rows
                   if r["op"] == op and r["pass"] == p and r["impl"] == impl)
      if pts:
        style = "-o" if _IMPL_BY_NAME.get(impl, IMPLS[0]).family == "pallas_norm" else "--s"
        ax.plot([q[0] for q in pts], [q[2] for q in pts], style, ms=4, label=impl)
    if meta.get("copy_gbs"):
      ax.axhline(meta["copy_gbs"], color="k", lw=1, ls=":",
                 label=f"copy {meta['copy_gbs']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("N (hidden size)")
    ax.set_ylabel("GB/s (fwd 2MNs, fwd+bwd 5MNs)")
    ax.set_title(f"{'RMSNorm' if op == 'rms' else 'LayerNorm'} "
                 f"{'forward' if p == 'fwd' else 'forward+backward'}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.suptitle(f"{meta.get('device', '?')} {meta.get('dtype', '')} - {str(meta.get('date', ''))[:10]}")
  fig.tight_layout()
  fig.savefig(png, dpi=110)
  plt.close(fig)


def _merge(paths: list[str]) -> dict:
  """Rows of several result files; a later file's row replaces an earlier one's."""
  rows: dict = {}
  meta: dict = {}
  sources = []
  for p in paths:
    doc = json.loads(pathlib.Path(p).read_text())
    meta = {**meta, **doc["meta"]}
    sources.append({k: doc["meta"].get(k) for k in ("date", "git_commit", "device", "copy_gbs",
                                                    "argv")} | {"file": pathlib.Path(p).name})
    for r in doc["rows"]:
      rows[(_key(r), r["dtype"], r["impl"])] = r
  if len(paths) > 1:  # each row keeps its own run's % of copy; meta names every run
    meta["merged_from"] = sources
  return {"meta": meta, "rows": list(rows.values())}


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.bench",
      description="Side-by-side GPU benchmark of pallas_norm against XLA, flax, tokamax, "
                  "torch and Liger (CUPTI kernel time, rotated inputs, median). "
                  "Bytes model: fwd 2*M*N*itemsize, fwd+bwd 5*M*N*itemsize.",
      epilog="--sharded: the sharded benchmark over every local GPU instead "
             "(pallas_norm/bench_sharded.py; its options: --sharded --help). "
             "--e2e: the train-step benchmark (pallas_norm/bench_e2e.py; --e2e --help).")
  p.add_argument("--shapes", help="MxN list, e.g. 4096x1024,8192x4096 (default: the "
                                  "BENCHMARKING.md table plus Llama/Qwen hidden sizes at M=8192)")
  p.add_argument("--ops", default="rms,layer",
                 help="rms,layer (default both); rms_res,layer_res: the fused residual add "
                      "(pallas, xla and flax only)")
  p.add_argument("--passes", default="fwd,fwdbwd", help="fwd,fwdbwd (default both)")
  p.add_argument("--impls", help="comma list of " + ",".join(i.name for i in IMPLS)
                 + "; 'pallas:*' / 'triton:*' for every mode (default: all)")
  p.add_argument("--dtype", default="bf16", choices=tuple(_DTYPES))
  p.add_argument("--iters", type=int, default=30, help="timed calls per case (>= 30 for results)")
  p.add_argument("--quick", action="store_true",
                 help="4 shapes, heuristic and peers only (no per-mode sweep)")
  p.add_argument("--check", action="store_true",
                 help="compare every output (and grads) with the XLA reference before timing")
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="stop starting new cases after this many seconds (default 420)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="result JSON path (CSV and PNG beside it); default "
                               "benchmarks/results/<device>_<date>.json")
  p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
  p.add_argument("--plot-only", nargs="+", metavar="FILE.json",
                 help="merge result files, redraw the PNG (at --out or beside the first "
                      "file) and print the table; no GPU")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--sharded" in argv:  # the multi-GPU benchmark, with options of its own
    from pallas_norm import bench_sharded
    return bench_sharded.main([a for a in argv if a != "--sharded"])
  if "--e2e" in argv:  # the train-step benchmark, with options of its own
    from pallas_norm import bench_e2e
    return bench_e2e.main([a for a in argv if a != "--e2e"])
  parser = _parser()
  args = parser.parse_args(argv)
  if args.iters < 1:
    parser.error(f"--iters={args.iters} must be >= 1")
  if args.plot_only:
    doc = _merge(args.plot_only)
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.plot_only[0])
    if args.out:
      _write(out, doc["meta"], doc["rows"])
      print(f"wrote {out} and {out.with_suffix('.csv')}")
    _finish(out, doc)
    return 0
  try:
    plan = build_plan(args)
  except ValueError as e:
    parser.error(str(e))
  if args.dry_run:
    _print_plan(plan, args)
    return 0
  try:
    _require_gpu()
  except _NoGpu as e:
    print(e, file=sys.stderr)
    return 2
  return _run(args, plan)


if __name__ == "__main__":
  sys.exit(main())
