"""The autotuner: ``python -m pallas_norm.tune`` measures launch configs on this GPU and
writes a tuning table (``pallas_norm.tuning``'s format; docs/tuning.md).

For each key (pass, op family, dtypes, N, M):
  1. each backend that serves it (and, for the forward, each mode) is timed at its
     default config (``config.forward_config`` / ``backward_config``, ``tuned=False``);
  2. from the ``--search-top`` fastest of those defaults, a coordinate search over
     ``config.search_space``: one field at a time, every value of its domain with the
     others held, a value kept if it beats the best by more than ``--min-gain``; rounds
     until one changes nothing (at most ``--rounds``). The other backends' and modes'
     defaults, rebuilt for the searched one, are timed with its start and the search
     moves from the fastest (one field at a time does not leave a default's basin).
     Candidates that do not fit the shape (``config.from_entry``'s re-validation) are
     pruned before anything is traced, those whose trace raises (the launchers' own
     checks) before they compile;
     the candidates of one field compile together on a thread pool, then each is timed;
  3. the ``--confirm`` fastest that pass the check against ``backend="xla"`` (relative
     L2 error within the dtype's tolerance), and the start, are timed
     ``--confirm-rounds`` more times in turns: the entry is the least median, the
     start unless another beats it by more than ``--min-gain`` (the search's best is
     the least of many noisy times, so biased low).

Timing, as the kernel bench does it: CUPTI kernel time (the sum of a call's kernels),
inputs rotated over >= 4x L2, the median of ``--iters`` calls. "fwd" times the op's
primal; "fwd_stats" the forward under ``jax.vjp`` (which also writes mean and rstd);
"bwd" the forward and the backward in a training step's order (dy released once y
exists), the forward's kernels left out by name (a name missing or no kernel left: no
time, never a 0 us entry); on XLA, whose fusions of the two passes cannot be told
apart, the backward alone (jax.vjp's pullback timed on its residuals). Each candidate
is traced afresh under ``tuning.forced`` (the ops' jit statics carry
``tuning.context()``).

The table: one entry per (key, backend[, mode]) with its median us and ``default_us``
(the default config of the Pallas backend and the default mode: what the op runs with no
table). ``--out`` (default: the user's table, ``tuning.user_path(device_kind)``) is
merged into; keys already there are skipped (run the same command again to resume).
``--budget-s`` stops starting keys after that many seconds and writes what it has.

Example: ``python -m pallas_norm.tune --shapes 4096x5120,1x4096 --families rms,layer``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import os
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm import config as C
from pallas_norm import tuning

__all__ = ["Candidate", "run", "main", "keys_for", "DEFAULT_SHAPES", "TABLE_SHAPES"]

# The kernel bench's shapes and the few-row buckets (decode, sampling).
DEFAULT_SHAPES = ((4096, 1024), (4096, 4096), (4096, 8192), (8192, 5120), (32768, 128),
                  (16384, 16384), (4096, 65536), (1024, 262144), (8192, 2048),
                  (8192, 4096), (8192, 8192), (1, 4096), (8, 4096), (64, 4096),
                  (512, 4096), (1, 2048), (64, 8192))
# The shipped tables' grid: every M bucket at these widths, the larger M first (a
# partial table then serves training first): the M of TABLE_MS up to 4096 at every
# width, 32768 where M x N is at most 2**26 elements, and past it a shape of the steady
# bucket (more than 4096 rows, tuning.STEADY_BUCKET: the training sizes), the kernel
# bench's where it has one (2026-11-29: N >= 4096 had no training-size key here).
TABLE_NS = (1024, 2048, 4096, 8192, 16384, 65536)
TABLE_MS = (32768, 4096, 512, 64, 8, 1)
_TABLE_STEADY = ((8192, 4096), (8192, 8192), (16384, 16384), (8192, 65536))


def _table_shapes() -> tuple[tuple[int, int], ...]:
  top = tuning.M_BUCKETS[tuning.STEADY_BUCKET - 1]  # 4096: the last bucket of few waves
  shapes = {(m, n) for m in TABLE_MS for n in TABLE_NS if m <= top or m * n <= 1 << 26}
  shapes.update(_TABLE_STEADY)
  return tuple(sorted(shapes, key=lambda s: (-s[0], s[1])))


TABLE_SHAPES = _table_shapes()
PRESETS = {"bench": DEFAULT_SHAPES, "table": TABLE_SHAPES}
FAMILIES = ("rms", "layer", "rms_res", "layer_res", "rms_llama", "layer_llama",
            "rms_res_post")
# rms_res_post: ``rms_norm(x, s, residual=r, post_norm_scale=p)``'s one-kernel forward
# (Gemma's post-norm, residual add and pre-norm); "fwd" only: under jax.vjp that op runs
# the rms and rms_res kernels, whose own keys tune them.
POST_FAMILIES = ("rms_res_post",)
TUNED_PASSES = ("fwd", "fwd_stats", "bwd")
# The FP8-output kernels (rms_norm_fp8 / layer_norm_fp8; families rms and layer): delayed
# scaling's one pass with and without y_t; current scaling's statistics pass and its
# quantise pass with and without y_t (each timed in the op, the other kernel as it is);
# "fp8_static", delayed scaling's one pass writing y alone (``stats=False``: W8A8
# serving's static-scale norm), whose kernel drops the stores the "fp8_delayed" entry
# was timed with (H200, 2026-11-29, 1x8192: RMSNorm's y alone 1.54 us on that entry
# against 1.25 on the default, h200_2026-11-29_fp8_tuned_vs_untuned_n8192_cd0bdd0.json).
FP8_PASSES = ("fp8_delayed", "fp8_delayed_t", "fp8_stats", "fp8_quantise", "fp8_quantise_t",
              "fp8_static")
_FP8_TOL = 0.07  # an FP8 value that rounds the other way moves by up to 1/8
BACKENDS = ("pallas", "triton", "mosaic", "xla")
_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
_L2_BYTES = 64 << 20
_MAX_ROTATIONS = 16


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One config to time: its table entry (key, backend, mode, fields) and the config it
  rebuilds to for the key's shape."""

  entry: tuning.Entry
  config: object

  @property
  def label(self) -> str:
    from pallas_norm.kernels import fp8 as kfp8
    cls = {"bwd": C.BackwardConfig}.get(self.entry.key.pass_, C.ForwardConfig)
    if _fp8_out(self.entry.key):
      cls = kfp8.Fp8Config
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    short = " ".join(f"{k}={v}" for k, v in sorted(self.entry.fields.items())
                     if k in ("block_m", "block_n", "num_warps") or defaults.get(k, 0) != v)
    return f"{self.entry.backend}/{self.entry.mode or '-'} {short}"


# --------------------------------------------------------------------------- keys


def keys_for(shapes, families=("rms", "layer"), passes=TUNED_PASSES,
             dtypes=("bfloat16",), params=(None,)) -> list[tuning.Key]:
  """Every key of the product; ``params`` None means x's dtype. A post-norm family
  (``POST_FAMILIES``) has "fwd" keys only."""
  out = []
  for (m, n), fam, p, dt, pd in itertools.product(shapes, families, passes, dtypes, params):
    if fam in POST_FAMILIES and p != "fwd":
      continue
    out.append(tuning.Key(p, fam, dt, pd or dt, int(n), int(m)))
  return out


def _parts(key: tuning.Key) -> dict:
  fam = key.family
  return dict(subtract_mean=fam.startswith("layer"), residual="_res" in fam,
              llama="_llama" in fam, post_norm=fam.endswith("_post"))


# --------------------------------------------------------------------------- the op


FP8_GROUP = 16  # FP8 x: one float32 scale a group of 16 (COAT's, the bench's)


def _fp8(key: tuning.Key) -> bool:
  return jnp.dtype(key.x).itemsize == 1


def _op(key: tuning.Key, backend: str, mode: str | None):
  """f(x, scale, bias, residual, x_scale) -> the op's output (y, or (y, h)); FP8 x
  (x_scale not None) gives y in the params' dtype; an FP8-output key: the Fp8Norm of
  rms_norm_fp8 / layer_norm_fp8 (delayed scaling with y_scale 8/448; "fp8_static": with
  ``stats=False``)."""
  import pallas_norm
  p = _parts(key)
  if _fp8_out(key):
    kernel, transpose, stats = _fp8_kernel(key)
    ys = jnp.float32(8.0 / 448.0) if kernel == "delayed" else None
    op = pallas_norm.layer_norm_fp8 if p["subtract_mean"] else pallas_norm.rms_norm_fp8
    extra = (lambda b: (b,)) if p["subtract_mean"] else (lambda b: ())

    def f8(x, s, b, r, xs):  # with a residual family: (Fp8Norm, h)
      del xs
      res = {} if r is None else dict(residual=r)
      return op(x, s, *extra(b), y_scale=ys, transpose=transpose, backend=backend,
                stats=stats, **res)
    return f8
  kw = dict(mode=mode, backend=backend, cast="llama" if p["llama"] else "torch")
  if _fp8(key):
    kw.update(group_size=FP8_GROUP, out_dtype=jnp.dtype(key.params))
  if p["subtract_mean"]:
    def f(x, s, b, r, xs):
      return pallas_norm.layer_norm(x, s, b, residual=r, x_scale=xs, **kw)
  elif p["post_norm"]:  # b: the post-norm's scale
    def f(x, s, b, r, xs):
      del xs
      return pallas_norm.rms_norm(x, s, residual=r, post_norm_scale=b, **kw)
  else:
    def f(x, s, b, r, xs):
      del b
      return pallas_norm.rms_norm(x, s, residual=r, x_scale=xs, **kw)
  return f


def _inputs(key: tuning.Key, rotations: int, seed: int = 0) -> list[tuple]:
  """Argument sets (x, scale, bias, residual, dy, x_scale) for the key, ``rotations``
  copies: x of N(0, 1) values (FP8 x: with scales uniform in [0.5, 2] a group); a
  post-norm key's "bias" is the post-norm's scale (1 + N(0, 0.01))."""
  m, n = key.m, key.n
  dt, pdt = jnp.dtype(key.x), jnp.dtype(key.params)
  p = _parts(key)
  k = jax.random.split(jax.random.key(seed), 3)
  scale = (1.0 + 0.1 * jax.random.normal(k[0], (n,), jnp.float32)).astype(pdt)
  bias = None
  if p["subtract_mean"]:
    bias = (0.1 * jax.random.normal(k[1], (n,), jnp.float32)).astype(pdt)
  elif p["post_norm"]:
    bias = (1.0 + 0.1 * jax.random.normal(k[1], (n,), jnp.float32)).astype(pdt)
  dy_dt = pdt if _fp8(key) else dt
  sets = []
  for i in range(rotations):
    ki = jax.random.split(jax.random.fold_in(k[2], i), 4)
    x = jax.random.normal(ki[0], (m, n), jnp.float32).astype(dt)
    r = jax.random.normal(ki[1], (m, n), jnp.float32).astype(dt) if p["residual"] else None
    dy = jax.random.normal(ki[2], (m, n), jnp.float32).astype(dy_dt)
    xs = jax.random.uniform(ki[3], (m, n // FP8_GROUP), jnp.float32, 0.5, 2.0) if _fp8(
        key) else None
    sets.append((x, scale, bias, r, dy, xs))
  return sets


def _step(key: tuning.Key, backend: str, mode: str | None):
  """(prepare, fn): ``prepare(args)`` turns an argument set into fn's arguments, ``fn``
  is what is timed. For "bwd" fn is the forward and the backward (the forward at the
  tables' or the default's config: the forced entry is the backward's); the timer
  leaves out the forward's kernels (``_Measurer.skip``); on "xla", fn is the backward
  alone (jax.vjp's pullback, made by ``prepare``). FP8 x's scales are constants (no
  cotangent)."""
  f = _op(key, backend, mode)
  if key.pass_ == "fwd" or _fp8_out(key):
    return (lambda a: a[:4] + a[5:]), f
  if key.pass_ == "fwd_stats":
    def fwd_stats(x, s, b, r, xs):
      return jax.vjp(lambda x, s, b, r: f(x, s, b, r, xs), x, s, b, r)
    return (lambda a: a[:4] + a[5:]), fwd_stats
  if backend == "xla":
    # XLA's backward alone: jax.vjp's pullback (a pytree of the residuals) made once an
    # argument set, outside the timed call. In one step XLA fuses the two passes'
    # kernels, so no kernel is the forward's alone, and the step less the forward alone
    # was no backward's time (H200, 2026-11-29: 1.06 us for LayerNorm + residual's
    # 64x16384 backward, whose forward alone took 14 us)
    pullback = jax.jit(lambda x, s, b, r, xs: jax.vjp(
        lambda x, s, b, r: f(x, s, b, r, xs), x, s, b, r)[1])

    def prepare(a):
      x, s, b, r, dy, xs = a
      return pullback(x, s, b, r, xs), (dy if r is None else (dy, dy))
    return prepare, lambda pull, ct: pull(ct)

  def fwd_bwd(x, s, b, r, dy, xs):
    y, pull = jax.vjp(lambda x, s, b, r: f(x, s, b, r, xs), x, s, b, r)
    # dy released only once y exists, a training step's order (the bench's fwdbwd_dep):
    # without it XLA may fuse its own backward's row sums into the forward's statistics
    # pass, and the forward's kernels are then no longer the first ones a call launches
    _, dy = jax.lax.optimization_barrier((y, dy))
    return pull(dy if r is None else (dy, dy))
  return (lambda a: a), fwd_bwd


def _compile(cand: Candidate, fn, args):
  """The candidate's compiled executable (configs are chosen at trace time, under the
  forced entry), or the error that ruled it out."""
  def fresh(*a):  # a new function each time: jit's trace cache is keyed on it
    return fn(*a)
  try:
    with tuning.forced(cand.entry):
      lowered = jax.jit(fresh).lower(*args)
    return lowered.compile(), None
  except (ValueError, NotImplementedError, TypeError) as e:
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  except Exception as e:  # noqa: BLE001 - a compiler's failure rules the candidate out
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def cupti_timer(cand: Candidate, exe, arg_sets, iters: int, skip: tuple = ()) -> float | None:
  """The bench's timing (pallas_norm.bench.timing.cupti_time): the median us of a
  call's kernels (each kernel's own median, summed), one kernel of each name in ``skip``
  left out (the forward's, wherever XLA scheduled them: a backward's zero fill, which
  needs nothing from the forward, can run first), or None (a name not found, or no
  kernel left: never a 0 us entry; XLA's backward, whose fusions of the two passes are
  not the forward's alone, is timed by itself, ``_step``)."""
  from pallas_norm.bench import timing
  del cand
  jax.block_until_ready(exe(*arg_sets[0]))
  t = timing.cupti_time(exe, arg_sets, iters)
  if "us" not in t:
    return None
  if not skip:
    return t["us"]
  kernels = list(zip(t["kernels"], t["kernel_us"]))
  for name in skip:
    at = next((i for i, (nm, _) in enumerate(kernels) if nm == name), None)
    if at is None:
      return None
    del kernels[at]
  return float(sum(us for _, us in kernels)) if kernels else None


def forward_kernels(key: tuning.Key, backend: str, arg_sets) -> tuple:
  """The names of the kernels the forward under ``jax.vjp`` launches for ``key`` (the
  backward's timing leaves them out); () off a GPU."""
  if jax.default_backend() != "gpu":
    return ()
  from pallas_norm.bench import timing
  prepare, fn = _step(dataclasses.replace(key, pass_="fwd_stats"), backend, None)
  exe = jax.jit(fn)
  args = [prepare(a) for a in arg_sets[:1]]
  jax.block_until_ready(exe(*args[0]))
  return tuple(timing.cupti_time(exe, args, 3).get("kernels", ()))


# --------------------------------------------------------------------------- search


def _fp8_out(key: tuning.Key) -> bool:
  return key.pass_ in FP8_PASSES


def _fp8_kernel(key: tuning.Key) -> tuple[str, bool, bool]:
  """(kernels/fp8.py's kernel name, transpose, stats) of an FP8-output key: the first
  call whose ``table_pass`` is the key's pass ("fp8_static": the delayed kernel without
  y_t and without stats, y alone)."""
  from pallas_norm.kernels import fp8 as kfp8
  for call in itertools.product(kfp8.KERNELS, (False, True), (True, False)):
    if kfp8.table_pass(*call) == key.pass_:
      return call
  raise ValueError(f"{key.pass_!r} is not an FP8-output pass")


def _entry(key, backend, mode, cfg, device) -> tuning.Entry:
  if _fp8_out(key):
    from pallas_norm.kernels import fp8 as kfp8
    cfg, flags = cfg
    fields = kfp8.fp8_entry_fields(cfg, device.num_sms, key.m, **dict(flags))
  else:
    fields = C.entry_fields(cfg, key.n, device.num_sms, key.m)
  return tuning.Entry(key, backend, mode or "", tuple(sorted(fields.items())))


def _fp8_rebuild(e: tuning.Entry, device):
  """(Fp8Config, flags) of an FP8-output entry for its key's shape, or None."""
  from pallas_norm.kernels import fp8 as kfp8
  _, transpose, _ = _fp8_kernel(e.key)
  cfg = kfp8.fp8_from_entry(e, e.key.m, e.key.n, jnp.dtype(e.key.x), transpose,
                            device.platform != "gpu")
  if cfg is not None and _parts(e.key)["residual"]:  # what the residual variant runs
    cfg = kfp8.residual_config(cfg)
  flags = tuple(sorted((k, bool(v)) for k, v in e.fields.items() if k in kfp8.FP8_FLAGS))
  return None if cfg is None else (cfg, flags)


def _candidate(key, backend, mode, fields: dict, device) -> Candidate | None:
  """The candidate of ``fields`` rebuilt for the key's shape, or None if it does not
  fit (pruned before any trace)."""
  e = tuning.Entry(key, backend, mode or "", tuple(sorted(fields.items())))
  if _fp8_out(key):
    cfg = _fp8_rebuild(e, device)
    if cfg is None or not _plausible(cfg[0], key.n):
      return None
    return Candidate(_entry(key, backend, mode, cfg, device), cfg)
  cfg = C.from_entry(e, key.m, key.n, device, backend)
  if cfg is None or not _plausible(cfg, key.n):
    return None
  # the entry as the rebuilt config normalises (clamped block_m, ...), so that
  # duplicates are found and what is stored is what runs
  return Candidate(_entry(key, backend, mode, cfg, device), cfg)


def _plausible(cfg, n: int) -> bool:
  """The search skips tiles of fewer than 2 or more than 128 elements a thread (the
  defaults are never pruned)."""
  per_thread = cfg.block_m * min(cfg.block_n, C.next_power_of_2(n)) / (32 * cfg.num_warps)
  return 2 <= per_thread <= 128


def _default(key, backend, mode, device) -> Candidate | None:
  p = _parts(key)
  params = None if key.params == key.x else jnp.dtype(key.params)
  if _fp8_out(key):
    from pallas_norm.kernels import fp8 as kfp8
    kernel, transpose, stats = _fp8_kernel(key)
    interpret = device.platform != "gpu"
    cfg = kfp8.fp8_config(key.m, key.n, jnp.dtype(key.x), kernel=kernel,
                          subtract_mean=p["subtract_mean"], transpose=transpose,
                          interpret=interpret, param_dtype=jnp.dtype(key.params),
                          tuned=False, residual=p["residual"], stats=stats)
    flags = ()
    if kernel == "delayed" and transpose:
      flags = (("separate", kfp8.transpose_separately(interpret)),)
    if kernel == "quantise":
      flags = (("bottom_up", kfp8.quantise_bottom_up(interpret)),)
    cfg = (cfg, flags)
    return Candidate(_entry(key, backend, None, cfg, device), cfg)
  try:
    if key.pass_ == "bwd":
      cfg = C.backward_config(key.m, key.n, jnp.dtype(key.x), device,
                              subtract_mean=p["subtract_mean"], backend=backend,
                              residual=p["residual"], param_dtype=params,
                              llama=p["llama"], tuned=False)
    else:
      cfg = C.forward_config(key.m, key.n, jnp.dtype(key.x), mode, device,
                             subtract_mean=p["subtract_mean"], backend=backend,
                             residual=p["residual"], param_dtype=params,
                             return_residuals=key.pass_ == "fwd_stats",
                             llama=p["llama"], tuned=False,
                             post_norm=p["post_norm"] and backend != "xla")
  except (ValueError, NotImplementedError):
    return None
  if p["post_norm"] and backend != "xla":
    from pallas_norm.kernels import forward
    if not forward.post_norm_fits(cfg, key.n):  # the op runs two norms: nothing to tune
      return None
  if backend == "xla":  # no launch config: one candidate, an empty entry
    return Candidate(tuning.Entry(key, "xla", "", ()), cfg)
  mode = getattr(cfg, "mode", None)
  return Candidate(_entry(key, backend, mode, cfg, device), cfg)


def _few_row_seeds(key, backend, mode, device) -> list[Candidate]:
  """Past the few-row bucket (M > 64), that bucket's default rebuilt for ``key``'s rows,
  and with ``fused_reduce`` it also without (the few-row backward's one kernel re-reads
  every row for dscale; past 64 rows stage 2 may sum partials faster): none at M <= 64.
  The one-tile backward of N' 16384 is the default up to 64 rows only, and the many-row
  default's split row cannot reach it one field at a time (block_n and split_rows at
  once). H200, 2026-11-29, RMSNorm 512x16384: the seed with fused_reduce 36.0 us against
  the split's 19.9 (h200_2026-11-29_tune_bwd16384_a41d150.log).
  Below ``_FEW_ROWS_WIDE_MIN_M`` rows of the backward (where N' 16384 is a split row by
  default), the one-tile default of that many rows over 4, 8 and 16 column splits
  (``column_splits``, without ``fused_reduce``): three fields from the split row, so the
  search never timed it at 1x16384 (h200_2026-11-29_tune_bwd_1row_9e56dba.log)."""
  if key.pass_ == "bwd" and key.m < C._FEW_ROWS_WIDE_MIN_M:
    wide = _default(dataclasses.replace(key, m=C._FEW_ROWS_WIDE_MIN_M), backend, mode,
                    device)
    if wide is None:
      return []
    fields = dict(wide.entry.fields, fused_reduce=False)
    return [c for c in (_candidate(key, backend, mode, dict(fields, column_splits=cs),
                                   device) for cs in (4, 8, 16)) if c is not None]
  if key.m <= C._FEW_ROWS_M:
    return []
  few = _default(dataclasses.replace(key, m=C._FEW_ROWS_M), backend, mode, device)
  if few is None:
    return []
  fields = dict(few.entry.fields)
  variants = [fields] + ([dict(fields, fused_reduce=False)] if fields.get("fused_reduce")
                         else [])
  return [c for c in (_candidate(key, backend, mode, f, device) for f in variants)
          if c is not None]


def _table_seeds(key, backend, mode, device, entries) -> list[Candidate]:
  """The table's entries at ``key``'s pass, shape and dtypes, this backend and mode,
  rebuilt for ``key``: its own from an earlier run (``--no-resume``: a retune starts
  where the last one ended), and its sibling families' (with or without the bias or the
  residual; post-norm with post-norm only), whose basin no field-at-a-time move from
  ``key``'s default may reach. H200, 2026-11-29, the backward at 64x16384: RMSNorm's
  search stopped at 5.02 us (column_block_n 64, 4 warps), RMSNorm + residual's, a
  heavier kernel, at 4.32 (column_block_n 256, 8 warps):
  h200_2026-11-29_tune_bwd_16384_9e56dba.log. An FP8-output key is seeded by the
  entries of every pass its kernel call looks up (``kernels/fp8.table_passes``: an
  "fp8_static" key by the "fp8_delayed" ones too). And the key's own family's entries
  in its M bucket at half and twice its N, which the lookup never serves it (another
  N', ``tuning.padded_width``) but which may hold a better tile than its default (H200,
  2026-11-29: RMSNorm + residual's forward at 16384x16384, 531 us with the 8192x8192
  entry rebuilt, 591 with the default; steady_tuned_vs_untuned_a5624e7.log)."""
  post = _parts(key)["post_norm"]
  passes = (key.pass_,)
  if _fp8_out(key):
    from pallas_norm.kernels import fp8 as kfp8
    passes = kfp8.table_passes(*_fp8_kernel(key))
  seeds = []
  for e in entries:
    k = e.key
    same_shape = (k.n, k.m) == (key.n, key.m)
    neighbour = (k.family == key.family and k.n in (key.n // 2, key.n * 2)
                 and tuning.m_bucket(k.m) == tuning.m_bucket(key.m))
    if (k.pass_ not in passes or (k.x, k.params) != (key.x, key.params)
        or not (same_shape or neighbour)
        or _parts(k)["post_norm"] != post
        or e.backend != backend or (e.mode or None) != (mode or None)):
      continue
    c = _candidate(key, backend, mode, e.fields, device)
    if c is not None:
      seeds.append(c)
  return seeds


class _Measurer:
  """Compiles (on a pool) and times candidates of one key and backend/mode; memoised
  by the rebuilt config."""

  def __init__(self, key, backend, mode, arg_sets, timer, iters, workers, log):
    self.prepare, self.fn = _step(key, backend, mode)
    self.args = [self.prepare(a) for a in arg_sets]
    self.skip = (forward_kernels(key, backend, arg_sets)
                 if key.pass_ == "bwd" and backend != "xla" else ())
    self.timer, self.iters, self.workers, self.log = timer, iters, workers, log
    self.times: dict = {}
    self.exes: dict = {}
    self.cands: dict = {}

  def measure(self, cands: list[Candidate]) -> None:
    todo = [c for c in dict.fromkeys(cands) if c.config not in self.times]
    todo = list({c.config: c for c in todo}.values())
    if not todo:
      return
    if self.workers > 1 and len(todo) > 1:
      with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
        built = list(pool.map(lambda c: _compile(c, self.fn, self.args[0]), todo))
    else:
      built = [_compile(c, self.fn, self.args[0]) for c in todo]
    for c, (exe, err) in zip(todo, built):
      us = None
      if exe is not None:
        try:
          us = self.timer(c, exe, self.args, self.iters, self.skip)
        except Exception as e:  # noqa: BLE001 - a launch failure rules it out
          err = f"{type(e).__name__}: {str(e)[:200]}"
      self.times[c.config] = us
      self.exes[c.config] = exe
      self.cands[c.config] = c
      self.log(f"    {'%9.3f us' % us if us is not None else '   pruned'}  {c.label}"
               + (f"  ({err})" if err and us is None else ""))

  def confirm(self, cands: list[Candidate], rounds: int) -> dict:
    """Each candidate (measured before) timed ``rounds`` more times, in turns; {config:
    [the first time, then those]}."""
    times = {c.config: [self.times[c.config]] for c in cands}
    for _ in range(rounds):
      for c in cands:
        us = self.timer(c, self.exes[c.config], self.args, self.iters, self.skip)
        if us is not None:
          times[c.config].append(us)
    self.log("    confirmed: " + ", ".join(
        f"{_median(times[c.config]):.3f} ({min(times[c.config]):.3f}-"
        f"{max(times[c.config]):.3f})" for c in cands))
    return times


def _median(v):
  return float(np.median(np.asarray(v, np.float64)))


def _beats(times, base, min_gain: float) -> bool:
  """Whether a candidate's confirm times ``times`` beat the start's ``base``: the median
  by more than ``min_gain`` and every time below the least of ``base`` (their ranges
  apart). At few rows a kernel takes 1-2 us and CUPTI's times move in steps of 32 ns
  (2.6% of 1.2 us): a 1% "gain" of the medians there is one step of noise, and such an
  entry was 9% slower where it reached N/2 (H200, 2026-11-29, rms fwd 8x4096 -> 8x2048:
  docs/tuning.md#status-2026-11-29)."""
  return _median(times) < _median(base) * (1.0 - min_gain) and max(times) < min(base)


def _coordinate_search(start: Candidate, key, backend, mode, device, meas: _Measurer,
                       rounds: int, min_gain: float, seeds=()) -> None:
  """Times ``start`` and its coordinate neighbours into ``meas`` (its ``times`` and
  ``cands`` then hold every candidate the search measured). ``seeds``: more starting
  points, timed with ``start``; the search moves from the fastest of them."""
  p = _parts(key)
  space = C.search_space(key.pass_, key.m, key.n, device, backend=backend, mode=mode,
                         subtract_mean=p["subtract_mean"], post_norm=p["post_norm"],
                         residual=p["residual"] and _fp8_out(key))
  meas.measure([start, *seeds])
  best = start if meas.times.get(start.config) is not None else None
  for c in seeds:
    us = meas.times.get(c.config)
    if us is not None and (best is None or us < meas.times[best.config] * (1.0 - min_gain)):
      best = c
  for _ in range(rounds):
    changed = False
    for field, values in space.items():
      base = dict(best.entry.fields) if best else dict(start.entry.fields)
      cands = []
      for v in values:
        c = _candidate(key, backend, mode, dict(base, **{field: v}), device)
        if c is not None:
          cands.append(c)
      meas.measure(cands)
      for c in cands:
        us = meas.times.get(c.config)
        if us is None:
          continue
        if best is None or us < meas.times[best.config] * (1.0 - min_gain):
          best, changed = c, True
    if not changed:
      break


def _primal(key: tuning.Key, out):
  """What the check compares: the forward's outputs (y, or y and h); of "fwd_stats"
  the primal only (the residuals differ by backend); of "bwd" every cotangent."""
  if key.pass_ == "fwd_stats":
    out = out[0]
  return [a for a in jax.tree.leaves(out) if getattr(a, "ndim", 0) > 0]


def _check(key, out, ref) -> str | None:
  """None if ``out`` matches ``ref`` (relative L2 error within the dtype's tolerance,
  NaN never), else why not."""
  out, ref = _primal(key, out), _primal(key, ref)
  if [a.shape for a in out] != [a.shape for a in ref]:
    return f"outputs {[a.shape for a in out]} against {[a.shape for a in ref]}"
  tol = _FP8_TOL if _fp8_out(key) else _TOL.get(key.x, 2e-2)
  for o, r in zip(out, ref):
    o32, r32 = np.asarray(o, np.float32), np.asarray(r, np.float32)
    err = float(np.linalg.norm(o32 - r32) / max(float(np.linalg.norm(r32)), 1e-30))
    if not err <= tol:
      return f"rel err {err:.2e} > {tol:g}"
  return None


def _check_candidate(key, meas: _Measurer, cand: Candidate, ref) -> str | None:
  """``_check`` of the candidate's outputs on the first argument set."""
  return _check(key, meas.exes[cand.config](*meas.args[0]), ref)


def _modes(key: tuning.Key, backend: str) -> tuple:
  if _parts(key)["post_norm"]:  # the one kernel (Pallas, cached), and XLA's fusion
    return {"pallas": ("multi_wave_cached",), "xla": (None,)}.get(backend, ())
  if key.pass_ == "bwd" or _fp8_out(key):
    return (None,)
  if backend == "xla":
    return (None,)
  return ("static_persistent",) if backend == "mosaic" else C.MODES


def tune_key(key: tuning.Key, device: C.DeviceInfo, *, backends=BACKENDS, timer=None,
             iters: int = 30, workers: int = 1, rounds: int = 2, min_gain: float = 0.01,
             search_top: int = 2, confirm: int = 3, confirm_rounds: int = 3,
             log=print, table=()) -> list[tuning.Entry]:
  """The entries of one key: per backend (and forward mode) the fastest config found
  that passes the check, each with ``default_us`` (the default config of the Pallas
  backend and the default mode: what the op runs with no table). ``table``: entries
  already measured; those at the key's shape seed the search (``_table_seeds``)."""
  timer = timer or cupti_timer
  nbytes = key.m * key.n * jnp.dtype(key.x).itemsize
  r = 1 if device.platform != "gpu" else int(
      min(_MAX_ROTATIONS, max(1, math.ceil(4 * _L2_BYTES / nbytes))))
  arg_sets = _inputs(key, r)
  ref_prepare, ref_fn = _step(key, "xla", None)
  try:
    ref = jax.jit(ref_fn)(*ref_prepare(arg_sets[0]))
  except (TypeError, ValueError, NotImplementedError) as e:  # the op's own refusal
    log(f"    not served: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return []
  measurers: dict = {}

  def measurer(backend, mode):
    if (backend, mode) not in measurers:
      measurers[backend, mode] = _Measurer(key, backend, mode, arg_sets, timer, iters,
                                           workers, log)
    return measurers[backend, mode]

  default = _default(key, "pallas", None, device)
  default_us = None
  if default is not None:
    dmode = default.entry.mode or None
    measurer("pallas", dmode).measure([default])
    default_us = measurer("pallas", dmode).times.get(default.config)
  # Every (backend, mode)'s default first; the coordinate search then runs from the
  # ``search_top`` fastest of them, and the fastest Pallas one (the others keep their
  # default's entry).
  starts = []
  for backend in backends:
    if _fp8_out(key) and backend != "pallas":  # the FP8-output ops' tables: Pallas only
      continue
    for mode in _modes(key, backend):
      start = _default(key, backend, mode, device)
      if start is None:
        continue
      try:
        measurer(backend, mode).measure([start])
      except Exception as e:  # noqa: BLE001 - a backend that cannot run here
        log(f"    {backend}/{mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      us = measurer(backend, mode).times.get(start.config)
      if us is not None:
        starts.append((us, backend, mode, start))
  starts.sort(key=lambda t: t[0])
  # The Pallas backend's fastest mode is searched whatever its rank: its entry is what
  # the default backend="pallas" runs (at 512x8192 LayerNorm the two fastest defaults
  # were the Triton backend's, and the Pallas kernel kept its default, 7.9 us against
  # Triton's 6.5 at the same tile: h200_2026-11-28_tune_fewrows_b2ed94e.log).
  first_pallas = next((i for i, t in enumerate(starts) if t[1] == "pallas"), None)
  results = []
  for rank, (_, backend, mode, start) in enumerate(starts):
    meas = measurer(backend, mode)
    # mosaic's launchers pick their own configs; xla has none
    if (rank < search_top or rank == first_pallas) and backend not in ("mosaic", "xla"):
      # the other backends' and modes' defaults, rebuilt for this one, as more starting
      # points: one field at a time cannot leave a default's basin (a split row of 512
      # columns at 1 warp never reaches another backend's 4096 at 16 warps)
      seeds = [_candidate(key, backend, mode, dict(other.entry.fields), device)
               for _, b, _, other in starts if b not in ("mosaic", "xla")
               and other is not start]
      seeds += _few_row_seeds(key, backend, mode, device)
      seeds += _table_seeds(key, backend, mode, device, table)
      _coordinate_search(start, key, backend, mode, device, meas, rounds, min_gain,
                         seeds=[c for c in seeds if c is not None])
    ranked = sorted((c for cfg, c in meas.cands.items() if meas.times.get(cfg) is not None),
                    key=lambda c: meas.times[c.config])
    checked = []
    for c in ranked:
      if len(checked) == confirm:
        break
      why = _check_candidate(key, meas, c, ref)
      if why is None:
        checked.append(c)
      else:
        log(f"    check failed: {c.label}: {why}")
    if not checked:
      continue
    # the search's best is biased low (the least of many noisy times): the finalists
    # and the start are timed again, in turns, and the start stays unless a finalist
    # beats it (``_beats``: the median by more than min_gain, the ranges apart)
    if start.config in meas.times and meas.times[start.config] is not None and (
        start.config not in {c.config for c in checked}):
      checked.append(start)
    samples = meas.confirm(checked, confirm_rounds)
    medians = {cfg: _median(v) for cfg, v in samples.items()}
    best = min(checked, key=lambda c: medians[c.config])
    if start.config in samples and not _beats(samples[best.config],
                                              samples[start.config], min_gain):
      best = start
    if (default is not None and (backend, mode) == ("pallas", dmode)
        and default.config in medians):  # another backend's config can compare equal
      default_us = medians[default.config]
    results.append(dataclasses.replace(best.entry, us=round(medians[best.config], 3)))
  return [dataclasses.replace(e, default_us=None if default_us is None
                              else round(default_us, 3)) for e in results]


# --------------------------------------------------------------------------- table


def _meta(device: C.DeviceInfo, argv, method: str) -> dict:
  from pallas_norm.bench import timing as _t  # noqa: F401 - sets XLA_FLAGS for CUPTI
  return dict(device_kind=device.name, num_sms=device.num_sms,
              made_by="python -m pallas_norm.tune " + " ".join(argv or []),
              commit=_git_commit(), date=datetime.date.today().isoformat(),
              jax=jax.__version__, timing=method)


def _git_commit() -> str:
  from pallas_norm.bench import timing
  return timing.git_commit(short=True)


def _read(path: pathlib.Path) -> tuple[list[tuning.Entry], dict]:
  """The table's entries and its meta ([], {} where there is no file)."""
  if not path.exists():
    return [], {}
  t = tuning.Table.load(path)
  return list(t.entries()), t.meta


_RUN_FIELDS = ("made_by", "commit", "date", "jax")


def _runs(old: dict, meta: dict, tuned: int) -> list[dict]:
  """The table's run history (meta "runs"): the old table's, then this run with the
  keys it tuned. A table from before the history was kept gives its own meta's run
  first (the last command that wrote it)."""
  runs = list(old.get("runs") or ())
  if old and not runs and old.get("made_by"):
    runs.append({k: old.get(k) for k in _RUN_FIELDS} | {"keys": None})
  return runs + [{k: meta[k] for k in _RUN_FIELDS} | {"keys": tuned}]


def _write(path: pathlib.Path, entries, meta: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(tuning.to_doc(entries, meta), indent=1) + "\n")
  os.replace(tmp, path)
  tuning.clear_cache()


def run(keys, *, out=None, device: C.DeviceInfo | None = None, backends=BACKENDS,
        timer=None, iters: int = 30, workers: int | None = None, rounds: int = 2,
        min_gain: float = 0.01, search_top: int = 2, confirm: int = 3,
        confirm_rounds: int = 3, budget_s: float | None = None,
        resume: bool = True, progress: bool = True, argv=None, log=None,
        seed_tables=()) -> pathlib.Path:
  """Tune ``keys`` (``keys_for``) on this device and merge the entries into the table
  at ``out`` (default: the user's table for this device kind); returns its path.

  Args:
    keys: tuning.Key list.
    out: the table's path.
    device: the DeviceInfo (default: ``config.device_info()``).
    backends: the backends to try (each where it serves the key).
    timer: ``timer(candidate, executable, arg_sets, iters, skip) -> us or None`` (skip:
      the names of the forward's kernels, one of each left out of a "bwd" key's time);
      default the CUPTI kernel time (a GPU); tests inject a deterministic one.
    iters: timed calls a candidate (the median is kept).
    workers: threads that compile candidates (default: the CPU count on a GPU, else 1).
    rounds, min_gain: the coordinate search's rounds and the relative gain a change must
      bring.
    search_top: how many of the (backend, mode) defaults, fastest first, are searched
      from (the others' entries are their defaults); the Pallas backend's fastest mode
      is searched too, whatever its rank (the default backend's entry).
    confirm, confirm_rounds: the fastest ``confirm`` candidates that pass the check, and
      the start, are timed ``confirm_rounds`` more times in turns; the entry is the
      least median, the start unless another beats it by more than ``min_gain``.
    budget_s: stop starting keys after this many seconds (the table keeps what is done).
    resume: skip keys whose entries are already in ``out``.
    progress: a tqdm progress bar over the keys.
    seed_tables: more tables (paths; another device kind's, say) whose entries at a
      key's pass and shape seed its search, as ``out``'s own do (``_table_seeds``).
      A path that does not exist is skipped.

  Raises:
    tuning.TableError: ``out`` or a seed table exists and is not a table this version
      reads (raised before any key is timed).
  """
  device = device or C.device_info()
  warnings.filterwarnings("ignore", "pallas_norm: no tuned table")
  path = pathlib.Path(out) if out else tuning.user_path(device.name)
  entries, old_meta = _read(path)
  seeded = [e for p in seed_tables if pathlib.Path(p).resolve() != path.resolve()
            for e in _read(pathlib.Path(p))[0]]
  done = {(e.key.group, e.key.n, e.key.m) for e in entries}
  if workers is None:
    workers = (os.cpu_count() or 1) if device.platform == "gpu" else 1
  todo = [k for k in keys if not (resume and (k.group, k.n, k.m) in done)]
  meta = _meta(device, argv, "injected timer" if timer else
               "CUPTI kernel time, median, inputs rotated over >= 4x L2")
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(todo), desc="tune", unit="key", file=sys.stderr)
  log = log or (bar.write if bar is not None else print)
  t0 = time.perf_counter()
  run_meta = meta
  for i, key in enumerate(todo):
    if budget_s is not None and time.perf_counter() - t0 > budget_s:
      log(f"budget of {budget_s:.0f} s spent: {len(todo) - i} keys left (run the same "
          f"command again: it resumes)")
      break
    log(f"{key.pass_} {key.family} x={key.x} params={key.params} {key.m}x{key.n}")
    tk = time.perf_counter()
    new = tune_key(key, device, backends=backends, timer=timer, iters=iters,
                   workers=workers, rounds=rounds, min_gain=min_gain,
                   search_top=search_top, confirm=confirm,
                   confirm_rounds=confirm_rounds, log=log, table=entries + seeded)
    entries = [e for e in entries if (e.key.group, e.key.n, e.key.m) !=
               (key.group, key.n, key.m)] + new
    run_meta = dict(meta, runs=_runs(old_meta, meta, i + 1))
    _write(path, entries, run_meta)
    for e in new:
      log(f"  -> {e.backend}/{e.mode or '-'} {e.us} us (default {e.default_us} us)")
    log(f"  ({time.perf_counter() - tk:.1f} s)")
    if bar is not None:
      bar.update(1)
  else:
    log(f"no key left: {len(todo)} tuned, {len(keys) - len(todo)} already in {path}")
  if bar is not None:
    bar.close()
  if not path.exists():
    _write(path, entries, run_meta)
  return path


def _shapes(text: str):
  from pallas_norm.bench.plan import parse_shapes
  return parse_shapes(text)


def _names(text: str, valid, what: str) -> tuple[str, ...]:
  from pallas_norm.bench.plan import parse_list
  return parse_list(text, valid, what)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.tune",
      description="Measure launch configs on this GPU and write a tuning table "
                  "(docs/tuning.md).")
  p.add_argument("--shapes", type=_shapes, default=None,
                 help="MxN,MxN,... (default: --preset's)")
  p.add_argument("--preset", choices=tuple(PRESETS), default="bench",
                 help="bench: the kernel bench's shapes and few-row ones (default); "
                      "table: the shipped tables' grid (every M bucket at N 1024-65536)")
  p.add_argument("--families", default="rms,layer,rms_res,layer_res",
                 help=f"comma-separated, of {', '.join(FAMILIES)} (default: the first "
                      f"four)")
  p.add_argument("--passes", default=",".join(TUNED_PASSES),
                 help=f"comma-separated, of {', '.join(TUNED_PASSES + FP8_PASSES)} "
                      f"(default: the first three; the FP8-output passes with the "
                      f"families rms, layer)")
  p.add_argument("--dtypes", default="bfloat16",
                 help="x's dtypes (default bfloat16; an FP8 dtype: FP8 input, x_scale= "
                      "a group of 16, y in the params' dtype)")
  p.add_argument("--params", default="", help="scale's dtypes (default: x's)")
  p.add_argument("--backends", default=",".join(BACKENDS))
  p.add_argument("--out", default=None, help="the table (default: the user's table, "
                 "~/.cache/pallas_norm/<device_kind>.json or $PALLAS_NORM_TUNING_DIR)")
  p.add_argument("--shipped", action="store_true",
                 help="write the package's own table for this GPU "
                      "(pallas_norm/tuning/<device_kind>.json) instead of the user's")
  p.add_argument("--seed-tables", default="shipped",
                 help="tables whose entries at a key's pass and shape seed its search "
                      "(comma-separated paths; 'shipped', the default: every shipped "
                      "table, of any GPU; 'none'). The output table's own entries "
                      "always do")
  p.add_argument("--iters", type=int, default=30)
  p.add_argument("--workers", type=int, default=None)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--min-gain", type=float, default=0.01,
                 help="relative gain a change must bring (default 0.01)")
  p.add_argument("--confirm", type=int, default=3,
                 help="finalists a (backend, mode) timed again (default 3)")
  p.add_argument("--confirm-rounds", type=int, default=3)
  p.add_argument("--search-top", type=int, default=2,
                 help="search from the N fastest (backend, mode) defaults (default 2), "
                      "and from the fastest Pallas one whatever its rank")
  p.add_argument("--budget-s", type=float, default=None)
  p.add_argument("--no-resume", dest="resume", action="store_false")
  p.add_argument("--no-progress", dest="progress", action="store_false")
  p.add_argument("--dry-run", action="store_true", help="list the keys and exit")
  return p


def _seed_tables(text: str) -> list[pathlib.Path]:
  """--seed-tables: 'shipped' (every shipped table), 'none', or comma-separated paths."""
  text = text.strip()
  if text == "none":
    return []
  if text == "shipped":
    return tuning.shipped_tables()
  return [pathlib.Path(p) for p in text.split(",") if p.strip()]


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser().parse_args(argv)
  try:
    families = _names(args.families, FAMILIES, "--families")
    passes = _names(args.passes, TUNED_PASSES + FP8_PASSES, "--passes")
    backends = _names(args.backends, BACKENDS, "--backends")
    dtypes = _names(args.dtypes, ("float32", "bfloat16", "float16", "float8_e4m3fn",
                                  "float8_e5m2"), "--dtypes")
    params = _names(args.params, ("float32", "bfloat16", "float16"), "--params") if (
        args.params) else (None,)
  except ValueError as e:
    print(f"pallas_norm.tune: {e}", file=sys.stderr)
    return 2
  keys = keys_for(args.shapes or PRESETS[args.preset], families, passes, dtypes, params)
  if args.dry_run:
    for k in keys:
      print(k.pass_, k.family, k.x, k.params, f"{k.m}x{k.n}")
    print(f"{len(keys)} keys")
    return 0
  device = C.device_info()
  if device.platform != "gpu":
    print("pallas_norm.tune times kernels on a GPU (jax.default_backend() is "
          f"{jax.default_backend()!r}); --dry-run lists the keys", file=sys.stderr)
    return 2
  out = tuning.shipped_path(device.name) if args.shipped else args.out
  try:
    path = run(keys, out=out, device=device, backends=backends, iters=args.iters,
               workers=args.workers, rounds=args.rounds, min_gain=args.min_gain,
               search_top=args.search_top, confirm=args.confirm,
               confirm_rounds=args.confirm_rounds, budget_s=args.budget_s,
               resume=args.resume, progress=args.progress,
               argv=argv, seed_tables=_seed_tables(args.seed_tables))
  except tuning.TableError as e:  # the output or a seed table: before any key is timed
    print(f"pallas_norm.tune: {e}", file=sys.stderr)
    return 2
  print(f"table: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
