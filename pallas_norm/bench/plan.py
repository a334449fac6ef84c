"""What the kernel bench measures: shapes, implementations, the bytes model and the plan.

Bytes model (the fewest bytes through HBM; scale, bias, mean and rstd are negligible):
  forward          read x, write y                         2 * M * N * itemsize
  forward+backward forward, then read x and dy, write dx   5 * M * N * itemsize
  with the fused residual add ("*_res" ops): forward reads x and r, writes y and h
  (4 * M * N * itemsize); forward+backward then reads dy, dh and h, writes dx (8).
  FP8 output ("*_fp8*" ops, forward only): read x, write y in FP8 (1 byte), and y_t
  (1 more) with "_t": (itemsize + 1 [+ 1]) * M * N. pallas_norm's current scaling
  reads x twice (docs/fp8.md): its own traffic, ``fp8_design_bytes``, is reported too.
  FP8 input ("*_fp8in" ops): x in float8_e4m3fn (1 byte) with one float32 scale a group
  of 16 (4/16 bytes an element); y, dy and dx in the run's dtype: forward
  (1 + 4/16 + itemsize) * M * N, forward+backward that plus (1 + 4/16 + 2 * itemsize) * M * N.
GB/s = bytes / median time, and "% copy" = GB/s / copy GB/s of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax.numpy as jnp

# The project's benchmarking brief's shape table (docs/performance.md gives the method),
# then Llama/Qwen hidden sizes with M = 8192 tokens, then the decode shapes below.
BENCH_SHAPES = ((4096, 1024), (4096, 4096), (4096, 8192), (8192, 5120), (32768, 128),
                (16384, 16384), (4096, 65536), (1024, 262144))
LLM_SHAPES = ((8192, 2048), (8192, 4096), (8192, 5120), (8192, 8192))
# Decode (issue #58): a step's few rows (M = batch tokens) at the hidden sizes, where
# launch latency, not bandwidth, decides; `--decode` times the whole step.
DECODE_SHAPES = tuple((m, n) for n in (2048, 4096, 8192) for m in (1, 8, 64, 512))
QUICK_SHAPES = ((4096, 1024), (8192, 4096), (32768, 128), (4096, 65536))

# "*_res": the fused residual add, (y, h) = (norm(x + r), x + r), residual in x's dtype.
OPS = ("rms", "layer", "rms_res", "layer_res")
# FP8 output (pallas_norm.rms_norm_fp8 / layer_norm_fp8), forward only: "<norm>_fp8"
# current scaling, "_delayed" delayed scaling (a fixed y_scale), "_t" with the transposed
# copy y_t. "--ops fp8" is all eight.
FP8_OPS = tuple(f"{norm}_fp8{scaling}{t}" for norm in ("rms", "layer")
                for scaling in ("", "_delayed") for t in ("", "_t"))
# FP8 input (rms_norm / layer_norm with x_scale=): x float8_e4m3fn with float32 scales
# a group of FP8_INPUT_GROUP, y (and dx) in the run's dtype. "--ops fp8in" is both.
FP8_INPUT_OPS = ("rms_fp8in", "layer_fp8in")
FP8_INPUT_GROUP = 16  # COAT's QB
# W8A8 serving's static scale (vLLM's static-scale FP8 norms): y_scale given, y alone
# (the serving step reads y only): ours with stats=False (no amax, mean or rstd written;
# the delayed kernel's y-only variant, since 2026-11-29).
FP8_STATIC_OPS = ("rms_fp8_static", "layer_fp8_static")
# The same with the fused residual add before it (vLLM's
# fused_add_rms_norm_static_fp8_quant): (x, r) in, y and h out.
FP8_STATIC_RES_OPS = ("rms_fp8_static_res", "layer_fp8_static_res")
# The static ops with stats=True (amax, mean and rstd written, y read alone): what the
# static ops ran before stats=False existed, for the A/B of the two kernels.
FP8_STATIC_STATS_OPS = ("rms_fp8_static_stats", "layer_fp8_static_stats")
# Gemma's post-norm before the fused residual add (rms_norm(x, s, residual=r,
# post_norm_scale=s): h = r + rms_norm(x, s), y = rms_norm(h, s); the bench passes the one
# scale as both): ours in one kernel outside jax.vjp, XLA's fusion of the jnp, and what
# flax's Gemma writes (its norm, the add, its norm). The "*_res" bytes model and inputs.
POST_OPS = ("rms_post_res",)
# the kernel bench's ops (--sharded: OPS)
KERNEL_OPS = (OPS + FP8_OPS + FP8_STATIC_OPS + FP8_INPUT_OPS
              + POST_OPS + FP8_STATIC_RES_OPS + FP8_STATIC_STATS_OPS)
FP8_DELAYED_SCALE = 8.0 / 448.0  # the "_delayed" ops' y_scale: |y| up to 8 in e4m3fn
# fwdbwd_dep: forward+backward with dy released only once y exists (peers.fwdbwd_dep; the
# order of a training step, where dy is a function of y). Opt-in (--passes); same bytes.
PASSES = ("fwd", "fwdbwd", "fwdbwd_dep")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
# The same eps for every implementation.
EPS = {"rms": 1e-6, "layer": 1e-5, "rms_res": 1e-6, "layer_res": 1e-5, "rms_post_res": 1e-6,
       **{op: 1e-6 if op.startswith("rms") else 1e-5
          for op in FP8_OPS + FP8_STATIC_OPS + FP8_INPUT_OPS + FP8_STATIC_RES_OPS
          + FP8_STATIC_STATS_OPS}}
_BYTES_FACTOR = {"fwd": 2, "fwdbwd": 5, "fwdbwd_dep": 5}
# With a residual: forward reads x and r, writes y and h; backward reads dy, dh and h,
# writes dx (= dresidual).
_BYTES_FACTOR_RES = {"fwd": 4, "fwdbwd": 8, "fwdbwd_dep": 8}
# The implementations that serve the fused residual add (the others: n/a): ours (both
# backends), XLA's fusion of the same formula, and a flax user's `h = x + r; norm(h)`.
_RES_IMPLS = ("pallas", "triton", "mosaic", "auto", "auto-untuned", "xla", "flax")
# FP8 output: ours (Pallas, the heuristic config) and the jnp chain under jit (norm in
# float32, amax, quantise, transpose: pallas_norm's backend="xla").
_FP8_IMPLS = ("pallas", "xla")
# FP8 input: ours (both backends, every mode) and the jnp chain under jit
# (reference.dequantise, then reference.norm: pallas_norm's backend="xla").
_FP8_INPUT_IMPLS = ("pallas", "triton", "xla")
_MODE_SHORT = {"reload": "multi_wave_reload", "cached": "multi_wave_cached",
               "persistent": "static_persistent"}
ASSUMED_L2 = 64 << 20  # when torch cannot tell (H100: 50 MB, H200: 60 MB)
MAX_ROTATIONS = 64


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation: ``family`` is "pallas_norm" or "peer"; ``kind`` "jax" or "torch"."""

  name: str
  family: str
  kind: str
  phase: int  # 0: the heuristic and the peers; 1: the per-mode sweep
  abbrev: str
  backend: str | None = None
  mode: str | None = None
  tables: bool = True  # False: traced with PALLAS_NORM_TUNING=none (the default alone)


IMPLS = (
    Impl("pallas", "pallas_norm", "jax", 0, "pal", backend="pallas"),
    # the same with the tuning tables ignored: the default configs alone
    Impl("pallas-untuned", "pallas_norm", "jax", 0, "pal.u", backend="pallas",
         tables=False),
    Impl("triton", "pallas_norm", "jax", 0, "tri", backend="triton"),
    # backend="mosaic" (issue #29): the plain norms and the fused residual add (not
    # in the FP8 impl lists); it refuses N % 128 != 0 and rows beyond its shared
    # memory (a "skip" cell)
    Impl("mosaic", "pallas_norm", "jax", 0, "mos", backend="mosaic"),
    # backend=None: per kernel, the backend config.choose_backend picks (plain and fused)
    Impl("auto", "pallas_norm", "jax", 0, "auto", backend=None),
    Impl("auto-untuned", "pallas_norm", "jax", 0, "auto.u", backend=None, tables=False),
    Impl("xla", "peer", "jax", 0, "xla"),
    Impl("flax", "peer", "jax", 0, "flax"),
    Impl("tokamax", "peer", "jax", 0, "tkmx"),
    Impl("torch", "peer", "torch", 0, "torch"),
    Impl("liger", "peer", "torch", 0, "liger"),
) + tuple(
    Impl(f"{backend}:{short}", "pallas_norm", "jax", 1, f"{backend[:3]}.{short[:2]}",
         backend=backend, mode=mode)
    for backend in ("pallas", "triton") for short, mode in _MODE_SHORT.items())
IMPL_BY_NAME = {i.name: i for i in IMPLS}


@dataclasses.dataclass(frozen=True)
class Case:
  """One measurement: (op, pass, shape, implementation)."""

  phase: int
  m: int
  n: int
  op: str
  pass_: str
  impl: str


def fp8_variant(op: str) -> tuple[str, bool, bool] | None:
  """(norm, delayed, transpose) of an FP8-output op ("layer_fp8_delayed_t" ->
  ("layer", True, True); a static-scale op is delayed, no y_t); None for the others."""
  if op in FP8_STATIC_OPS + FP8_STATIC_RES_OPS + FP8_STATIC_STATS_OPS:
    return op.split("_fp8")[0], True, False
  if op not in FP8_OPS:
    return None
  norm, rest = op.split("_fp8")
  return norm, "_delayed" in rest, rest.endswith("_t")


def fp8_static(op: str) -> bool:
  """Whether ``op`` is a static-scale FP8-output op (its step returns y alone)."""
  return op in FP8_STATIC_OPS + FP8_STATIC_RES_OPS + FP8_STATIC_STATS_OPS


def fp8_input(op: str) -> bool:
  """Whether ``op`` is an FP8-input op ("rms_fp8in", "layer_fp8in")."""
  return op in FP8_INPUT_OPS


def bytes_model(m: int, n: int, itemsize: int, pass_: str, op: str = "rms") -> int:
  """Bytes a norm must move: forward 2*M*N*itemsize, forward+backward 5*M*N*itemsize;
  with the fused residual add ("*_res" ops) 4 and 8 (x, r -> y, h; dy, dh, h -> dx);
  FP8 output ("*_fp8*" ops, forward only) (itemsize + 1) * M * N, + M * N with y_t;
  FP8 input ("*_fp8in" ops; x 1 byte, x_scale 4 bytes a group of FP8_INPUT_GROUP):
  forward x + x_scale + y (M * N * (1 + itemsize) + 4 * M * N / G), forward+backward
  that plus x + x_scale + dy + dx.

  Raises:
    ValueError: ``pass_`` is not one of PASSES, or a backward pass of an FP8-output op.
  """
  if pass_ not in _BYTES_FACTOR:
    raise ValueError(f"{pass_=} must be one of {tuple(_BYTES_FACTOR)}")
  fp8 = fp8_variant(op)
  if fp8 is not None:
    if pass_ != "fwd":
      raise ValueError(f"{op} is forward only (the FP8-output norms are not differentiable)")
    if op.endswith("_res"):  # x and r in, y (FP8) and h out
      return (3 * itemsize + 1) * m * n
    return (itemsize + 1 + int(fp8[2])) * m * n
  if fp8_input(op):
    fwd = (1 + itemsize) * m * n + 4 * m * (n // FP8_INPUT_GROUP)
    return fwd + (fwd + itemsize * m * n if pass_ != "fwd" else 0)
  factor = _BYTES_FACTOR_RES if op.endswith("_res") else _BYTES_FACTOR
  return factor[pass_] * m * n * itemsize


def fp8_design_bytes(m: int, n: int, itemsize: int, op: str) -> int:
  """What pallas_norm's FP8 kernels move: delayed scaling the bytes model (one pass),
  current scaling x read twice (statistics and amax, then quantise; docs/fp8.md)."""
  _, delayed, transpose = fp8_variant(op)
  if op.endswith("_res"):  # delayed scaling: one pass, the bytes model
    return bytes_model(m, n, itemsize, "fwd", op)
  return ((1 if delayed else 2) * itemsize + 1 + int(transpose)) * m * n


def serves(impl: Impl, op: str) -> bool:
  """Whether ``impl`` runs ``op`` (the fused residual add: ours on Pallas, Triton,
  Mosaic GPU and backend=None, XLA, flax; FP8 output: ours on Pallas with its own
  kernels, and XLA; FP8 input: ours on Pallas and Triton, every mode, and XLA)."""
  if fp8_variant(op) is not None:
    return impl.mode is None and (impl.backend or impl.name) in _FP8_IMPLS
  if fp8_input(op):
    return (impl.backend or impl.name) in _FP8_INPUT_IMPLS
  if not op.endswith("_res"):
    return True
  return (impl.backend or impl.name) in _RES_IMPLS


def rotations(m: int, n: int, itemsize: int, l2_bytes: int) -> int:
  """Copies R of x (and dy) so that R * bytes(x) >= 4 * L2 (at least 1, at most 64)."""
  return int(min(MAX_ROTATIONS, max(1, math.ceil(4 * l2_bytes / (m * n * itemsize)))))


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
  """"4096x1024,8192x4096" -> ((4096, 1024), (8192, 4096)); duplicates dropped.

  Raises:
    ValueError: a token that is not MxN with positive M and N, or no shape at all.
  """
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


def parse_list(text: str, valid, what: str) -> tuple[str, ...]:
  """"a,b" -> ("a", "b"), each in ``valid``; ValueError names ``what`` otherwise."""
  items = tuple(t.strip() for t in text.split(",") if t.strip())
  bad = [t for t in items if t not in valid]
  if bad or not items:
    raise ValueError(f"{what} {bad or text!r} not in {tuple(valid)}")
  return items


def _select_impls(text: str | None, quick: bool) -> tuple[Impl, ...]:
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

  Raises:
    ValueError: an unknown shape, op, pass or implementation in ``args``.
  """
  impls = _select_impls(args.impls, args.quick)
  if args.shapes:
    shapes = parse_shapes(args.shapes)
  elif args.quick:
    shapes = QUICK_SHAPES
  else:
    shapes = tuple(dict.fromkeys(BENCH_SHAPES + LLM_SHAPES + DECODE_SHAPES))
  alias = {"fp8": ",".join(FP8_OPS), "fp8in": ",".join(FP8_INPUT_OPS)}
  ops = parse_list(",".join(alias.get(t.strip(), t) for t in args.ops.split(",")),
                   KERNEL_OPS, "--ops")
  passes = parse_list(args.passes, PASSES, "--passes")
  return [Case(phase, m, n, op, p, impl.name)
          for phase in (0, 1) for m, n in shapes for op in ops for p in passes
          for impl in impls if impl.phase == phase and serves(impl, op)
          if p == "fwd" or fp8_variant(op) is None]


def groups(plan: list[Case]):
  """[((phase, m, n), [cases])] in plan order: the inputs are built once per group."""
  out: dict[tuple[int, int, int], list[Case]] = {}
  for c in plan:
    out.setdefault((c.phase, c.m, c.n), []).append(c)
  return list(out.items())


def print_plan(plan: list[Case], args: argparse.Namespace) -> None:
  """``--dry-run``: every group of cases, its input size and rotation count."""
  itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
  print(f"plan: {len(plan)} cases, dtype={args.dtype}, iters={args.iters}, "
        f"budget={args.budget_s:.0f}s; R assumes L2={ASSUMED_L2 >> 20} MiB "
        f"(the run reads it from torch); availability is probed at run time")
  for (phase, m, n), cases in groups(plan):
    ops = ",".join(dict.fromkeys(c.op for c in cases))
    passes = ",".join(dict.fromkeys(c.pass_ for c in cases))
    impls = ",".join(dict.fromkeys(c.impl for c in cases))
    isz = 1 if any(fp8_input(c.op) for c in cases) else itemsize  # FP8 x: 1 byte (run.py)
    r = rotations(m, n, isz, ASSUMED_L2)
    mib = m * n * isz / 2**20
    print(f"  phase {phase} {f'{m}x{n}':<12} x={mib:7.1f} MiB R={r:<2} ops={ops} passes={passes} "
          f"impls={impls}")
