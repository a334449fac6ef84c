"""Interleaved A/Bs on the GPU: ``python -m pallas_norm.bench ab fwd|bwd|tokamax-alias|triton|ncu``.

  fwd             forward launch configs (with residuals, as under jax.vjp), ``--configs``
                  in the mini-language below; y and rstd checked against the XLA reference.
                  GB/s = 2 x M x N x itemsize / time. Behind config.py's forward rules.
  bwd             backward launch configs (stage 1 + 2); dx and dscale checked against the
                  XLA reference. GB/s = 3 x M x N x itemsize / time (``--residual``: the
                  fused residual add's backward, dh added to dx, 4 x). Behind config.py's
                  backward rules.
  tokamax-alias   tokamax's forward (``--pass fwd``) or forward+backward (``--pass
                  fwdbwd``) with and without its output alias, beside pallas_norm (and, for
                  the forward, the Triton backend and XLA); ``--mode hlo`` lists the
                  copies and custom calls of each compiled step instead. Behind the bench's
                  tokamax call (``peers``).
  triton          backend="triton" against backend="pallas", or the Triton backend with one
                  of its ``TritonKnobs`` on, RMSNorm bf16, the same launch configs; one
                  variant per process (``--variant``).
  ncu             RMSNorm forward through both backends, each called twice: a target for
                  ``ncu`` (no timing of its own).

Method of ``fwd`` and ``bwd``: the kernel bench's CUPTI kernel time (``timing.time_us``:
median of 10 calls a round), ``--rounds`` rounds interleaved over the configs, inputs
rotated over >= 256 MiB; a line per config with the median of the rounds, GB/s and every
round. ``tokamax-alias`` and ``triton``: CUPTI kernel time over rotated inputs (>= 256 MiB),
the median of 30 and 20 calls.

Configs of ``fwd`` (``--configs``, ';'-separated; "@nocg" or "@cgall" appended traces
a config with the x/dy loads' cache modifier off (kernels/_compat.py) or on for all of
them; a backward config's "@d<k>" sets its ``prefetch_depth`` to k, "@rc" ("@rc0")
its ``recompute_dx`` on (off), "@ps" / "@js" / "@fr" ("@ps0" / "@js0" / "@fr0") its
``prefetch_stats`` / ``joint_row_sums`` / ``fused_reduce`` on (off), a forward config's
"@hp" ("@hp0") its ``hoist_params``, "@cs<k>" its ``column_splits``, a backward config's
"@cb<m>.<n>" its ``column_block_m`` and ``column_block_n`` (with ``fused_reduce``), "@w<k>"
its ``num_warps``, and "@r<bn>.<bg>.<w>" stage 2's ``reduce_block_n``,
``reduce_block_g`` and ``reduce_num_warps``, before those):
  default                 config.forward_config's pick
  psplit:bn,nw,occ[,lag[,early]]
                          static_persistent with split_rows: G = occ x SMs / cdiv(N, bn);
                          early 1 sets split_early_publish
  cached:bn,nw,chunk[,bm] multi_wave_cached split over cdiv(N, bn) programs, [bm, bn]
                          splits (bm 1 unless given)
  tile:bm,bn,nw           multi_wave_cached, [bm, bn] tiles (bn >= N)
  persistent:bn,nw,occ    static_persistent walking rows in bn-wide chunks, occ x SMs
  reload:bn,nw            multi_wave_reload
Configs of ``bwd``:
  default                       config.backward_config's pick
  split:bn,nw,occ,stages,chunk[,lag[,bm[,early]]]
                                split-row kernel, G = occ x SMs / cdiv(N, bn);
                                early 1 sets split_early_publish
  reload:bm,bn,nw,occ           reload-row kernel, G = occ x SMs
  tile:bm,bn,nw,occ             single-tile persistent kernel (bn >= N), G = occ x SMs
  tileg:bm,bn,nw,G              the same with G programs
  pieces:bm,nw,occ,w1,w2,...    the same, its tile cut into column pieces w1, w2, ...
  pair:bn,nw,occ                row-statistics + column-tiled pair
``--no-limit``: split-row configs may have more splits than ``split_resident_programs``
allows (such a grid may deadlock; for sweeps only).

Which results file each A/B wrote, and which rule it backs: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm import config as C
from pallas_norm import reference
from pallas_norm.bench import plan, timing

# A backward config's tags (the docstring): @d<k>, @rc / @rc0, @r<bn>.<bg>.<w>, @ps, @js
_TAG = re.compile(r"(@d)(\d+)|@rc([01]?)(?=@|$)|@r(\d+)\.(\d+)\.(\d+)|@(ps|js|fr|hp)([01]?)(?=@|$)"
                  r"|@cs(\d+)|@cb(\d+)\.(\d+)|@w(\d+)")
_FLAGS = {"ps": "prefetch_stats", "js": "joint_row_sums", "fr": "fused_reduce",
          "hp": "hoist_params"}
_AB_BYTES = 4 * (64 << 20)  # the rotated inputs of fwd, bwd, tokamax-alias and triton
_AB_MAX_REPS = 256
_TRITON_VARIANTS = ("pallas", "triton", "evict_first", "stream_cg", "stages2")


# --------------------------------------------------------------------------- shared


def _warm_up_sms(no_limit: bool) -> int:
  """Print the device, keep the GPU busy for 3 s (clocks up) and return its SM count.
  With ``no_limit``, split-row configs may then have more splits than
  ``split_resident_programs`` allows: such a grid may deadlock."""
  from pallas_norm.kernels import backward, forward
  if no_limit:
    forward._split_count = backward._split_count = lambda n, bn, interp, **k: -(-n // bn)
  sms = C.device_info().num_sms
  print(jax.devices()[0].device_kind, sms, flush=True)
  timing.warm_up(3.0)
  return sms


def _first_call(cfg_text, fn, *args):
  """The first (tracing) call of ``fn``. A config ending in "@nocg" is traced with the
  x/dy loads' cache modifier off (kernels/_compat.py); one ending in "@cgall" with every
  x/dy load ".cg", its L1 eviction policy dropped."""
  from pallas_norm.kernels import backward, forward
  if cfg_text.endswith("@nocg"):
    patches = [(forward, "stream_cache_modifier", lambda: None)]
  elif cfg_text.endswith("@cgall"):
    def load_cg(ref_at, mask, eviction_policy=None):
      del eviction_policy
      return forward._load(ref_at, mask, cache_modifier=forward.stream_cache_modifier())
    patches = [(forward, "_load_stream", load_cg), (backward, "_load_stream", load_cg)]
  else:
    return fn(*args)
  saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
  for mod, name, value in patches:
    setattr(mod, name, value)
  try:
    return fn(*args)
  finally:
    for mod, name, value in saved:
      setattr(mod, name, value)


def _report(tag, fns, ins, rounds, nbytes_moved):
  """Time each of ``fns`` ({name: (fn, checks text)}) over the rotated ``ins``,
  ``rounds`` rounds of 10 calls interleaved over the configs, and print a line each: the
  median of the rounds, GB/s on ``nbytes_moved`` and every round."""
  res = {c: [] for c in fns}
  for _ in range(rounds):
    for c, (fn, _) in fns.items():
      res[c].append(timing.time_us(fn, ins, 10))
  for c, (_, checks) in fns.items():
    med = np.median(res[c])
    print(f"{tag} {c:26s} {med:7.1f}us {nbytes_moved / med / 1e3:6.0f}GB/s "
          f"rounds {[round(t, 1) for t in res[c]]} {checks}", flush=True)


def _reps(nbytes: int) -> int:
  """Copies to rotate: >= 256 MiB, at most _AB_MAX_REPS (few-row inputs then stay in L2,
  as a decode step's norm input does: the op before it just wrote it)."""
  return min(_AB_MAX_REPS, max(2, -(-_AB_BYTES // nbytes)))


def _inputs(shape: str, dt, with_dy: bool):
  """(bytes of x, xs, dys, scale) of an ``MxN`` shape: x (and dy) rotated over >= 256 MiB,
  scale bf16 1.25."""
  m, n = map(int, shape.split("x"))
  nbytes = m * n * jnp.dtype(dt).itemsize
  reps = _reps(nbytes)
  key = jax.random.PRNGKey(0)
  xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), dt) for i in range(reps)]
  dys = ([jax.random.normal(jax.random.fold_in(key, 99 + i), (m, n), dt) for i in range(reps)]
         if with_dy else [])
  return nbytes, xs, dys, jnp.ones((n,), jnp.bfloat16) * 1.25


def _split_spec(cs: str) -> tuple[str, list[int]]:
  """"psplit:2048,1,8@nocg" -> ("psplit", [2048, 1, 8])."""
  kind, _, args = cs.partition(":")
  args, kind = (_TAG.sub("", v).removesuffix("@nocg").removesuffix("@cgall")
                for v in (args, kind))
  return kind, [int(v) for v in args.split(",")] if args else []


# --------------------------------------------------------------------------- fwd, bwd


def _fwd_config(kind, a, m, n, sm, sms):
  if kind == "default":
    return C.forward_config(m, n, jnp.bfloat16, subtract_mean=sm)
  if kind == "psplit":
    bn, nw, occ, *rest = a
    g = min(m, max(1, occ * sms // -(-n // bn)))
    return C.ForwardConfig("static_persistent", 1, bn, nw, g, split_rows=True,
                           split_lag=rest[0] if rest else 2,
                           split_early_publish=bool(rest[1]) if len(rest) > 1 else False)
  if kind == "cached":
    bn, nw, ch, *bm = a
    return C.ForwardConfig("multi_wave_cached", bm[0] if bm else 1, bn, nw, chunk_n=ch)
  if kind == "tile":
    bm, bn, nw = a
    return C.ForwardConfig("multi_wave_cached", bm, bn, nw)
  if kind == "persistent":
    bn, nw, occ = a
    return C.ForwardConfig("static_persistent", 1, bn, nw, min(m, occ * sms))
  if kind == "reload":
    bn, nw = a
    return C.ForwardConfig("multi_wave_reload", 1, bn, nw)
  raise ValueError(f"unknown config kind {kind!r}")


def _bwd_config(kind, a, m, n, sm, sms, residual=False):
  if kind == "default":
    return C.backward_config(m, n, jnp.bfloat16, subtract_mean=sm, residual=residual)
  if kind == "split":
    bn, nw, occ, st, ch, *rest = a
    bm = rest[1] if len(rest) > 1 else 1
    g = min(-(-m // bm), max(1, occ * sms // -(-n // bn)))
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            num_stages=st, split_rows=True, chunk_n=ch,
                            split_lag=rest[0] if rest else 2,
                            split_early_publish=bool(rest[2]) if len(rest) > 2 else False,
                            **C.reduce_config(n, g))
  if kind == "reload":
    bm, bn, nw, occ = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            reload_rows=True, **C.reduce_config(n, g))
  if kind == "tile":
    bm, bn, nw, occ = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
  if kind == "tileg":
    bm, bn, nw, g = a
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
  if kind == "pieces":
    bm, nw, occ, *widths = a
    g = min(-(-m // bm), occ * sms)
    return C.BackwardConfig(block_m=bm, block_n=C.next_power_of_2(sum(widths)),
                            num_warps=nw, num_programs=g, pieces=tuple(widths),
                            **C.reduce_config(n, g))
  if kind == "pair":
    bn, nw, occ = a
    g = max(1, occ * sms // -(-n // bn))
    return C.BackwardConfig(block_m=1, block_n=bn, num_warps=nw, num_programs=g,
                            **C.reduce_config(n, g))
  raise ValueError(f"unknown config kind {kind!r}")


def _configs(args, sms: int) -> dict:
  """{(shape, spec): config} of ``--configs`` at every shape (ValueError when one is bad)."""
  make = _fwd_config if args.kernel == "fwd" else _bwd_config
  out = {}
  for shape in args.shapes.split(","):
    m, n = map(int, shape.split("x"))
    for cs in args.configs.split(";"):
      kind, a = _split_spec(cs)
      extra = {"residual": True} if getattr(args, "residual", False) else {}
      try:
        cfg = make(kind, a, m, n, args.op == "layer", sms, **extra)
        for t in _TAG.finditer(cs):  # the tags of the module docstring
          if t.group(1):
            cfg = dataclasses.replace(cfg, prefetch_depth=int(t.group(2)))
          elif t.group(4):
            cfg = dataclasses.replace(cfg, reduce_block_n=int(t.group(4)),
                                      reduce_block_g=int(t.group(5)),
                                      reduce_num_warps=int(t.group(6)))
          elif t.group(7):
            cfg = dataclasses.replace(cfg, **{_FLAGS[t.group(7)]: t.group(8) != "0"})
          elif t.group(9):
            cfg = dataclasses.replace(cfg, column_splits=int(t.group(9)))
          elif t.group(10):
            cfg = dataclasses.replace(cfg, column_block_m=int(t.group(10)),
                                      column_block_n=int(t.group(11)))
          elif t.group(12):
            cfg = dataclasses.replace(cfg, num_warps=int(t.group(12)))
          else:
            cfg = dataclasses.replace(cfg, recompute_dx=t.group(3) != "0")
        out[(shape, cs)] = cfg
      except (TypeError, ValueError) as e:  # unknown kind, too few or too many numbers
        raise ValueError(f"--configs {cs!r}: {e}") from e
  return out


def _ab_fwd(args, shape: str, cfgs: dict, nbytes: int, xs, dys, scale) -> None:
  """One shape of ``ab fwd``: check each config's y and rstd, then time them."""
  del dys
  from pallas_norm.kernels import forward
  op = args.op
  sm = op == "layer"
  xs = [x + (3.0 if sm else 0.0) for x in xs]
  with_bias = sm if args.bias is None else bool(args.bias)
  bias = jnp.ones(scale.shape, jnp.bfloat16) * 0.5 if with_bias else None
  y_ref, _, rstd_ref = reference.norm(xs[0], scale, bias, eps=1e-5, subtract_mean=sm)
  fns = {}
  for cs, cfg in cfgs.items():
    fn = jax.jit(lambda x, cfg=cfg: forward.norm_forward(
        x, scale, bias, eps=1e-5, scale_offset=0.0, subtract_mean=sm, config=cfg,
        interpret=False))
    try:
      y, _, rstd = _first_call(cs, fn, xs[0])
    except Exception as e:  # noqa: BLE001 (a config the kernel refuses)
      print(f"{op} {shape} {cs} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32))))
    rerr = float(jnp.max(jnp.abs(rstd - rstd_ref) / rstd_ref))
    fns[cs] = (fn, f"y_err={err:.3g} rstd_rel={rerr:.2g}")
  _report(f"fwd {op} {shape}", fns, [(x,) for x in xs], args.rounds, 2 * nbytes)


def _ab_bwd(args, shape: str, cfgs: dict, nbytes: int, xs, dys, scale) -> None:
  """One shape of ``ab bwd``: check each config's dx and dscale, then time them."""
  from pallas_norm.kernels import backward
  op = args.op
  sm = op == "layer"
  bias = jnp.ones(scale.shape, jnp.bfloat16) * 0.5 if sm else None
  f = lambda x, s, b: reference.norm(x, s, b, eps=1e-5, subtract_mean=sm)  # noqa: E731
  stats = [f(x, scale, bias) for x in xs]
  _, pull = jax.vjp(lambda x, s: f(x, s, bias)[0], xs[0], scale)
  dxr, dsr = [a.astype(jnp.float32) for a in pull(dys[0])]
  # --residual: x is h = x + residual, and dh (here dy reversed along the rows) is added
  dhs = [dy[::-1] for dy in dys] if args.residual else [None] * len(dys)
  if args.residual:
    dxr = dxr + dhs[0].astype(jnp.float32)
  res_kw = dict(dx_dtype=dys[0].dtype, residual_dtype=dys[0].dtype) if args.residual else {}
  fns = {}
  for cs, cfg in cfgs.items():
    fn = jax.jit(lambda dy, x, mean, rstd, dh, cfg=cfg: backward.norm_backward(
        dy, x, scale, mean, rstd, has_bias=sm, scale_offset=0.0, subtract_mean=sm,
        config=cfg, interpret=False, scale_dtype=scale.dtype, bias_dtype=jnp.bfloat16,
        **(dict(dh=dh, **res_kw) if dh is not None else {})))
    try:
      out = _first_call(cs, fn, dys[0], xs[0], stats[0][1], stats[0][2], dhs[0])
    except Exception as e:  # noqa: BLE001 (a config the kernel refuses)
      print(f"{op} {shape} {cs} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if args.residual:  # (dx, dresidual, dscale, dbias): dresidual is dx here
      out = (out[0], *out[2:])
    err = float(jnp.max(jnp.abs(out[0].astype(jnp.float32) - dxr)))
    errs = float(jnp.max(jnp.abs(out[1].astype(jnp.float32) - dsr))
                 / (jnp.max(jnp.abs(dsr)) + 1e-9))
    fns[cs] = (fn, f"dx_err={err:.3g} ds_rel={errs:.2g}")
  ins = [(dy, x, s[1], s[2], dh) for dy, x, s, dh in zip(dys, xs, stats, dhs)]
  tag = "bwd_res" if args.residual else "bwd"
  _report(f"{tag} {op} {shape}", fns, ins, args.rounds, (4 if args.residual else 3) * nbytes)


def _run_configs(args) -> int:
  """``ab fwd`` / ``ab bwd``: every config is built (and a bad spec refused) first."""
  cfgs = _configs(args, C.device_info().num_sms)
  if args.dry_run:
    for (shape, cs), cfg in cfgs.items():
      print(f"{args.kernel} {args.op} {shape} {cs}: {cfg}")
    return 0
  if timing.gpu_missing():
    return 2
  _warm_up_sms(args.no_limit)
  dt = getattr(jnp, args.dtype)
  for shape in args.shapes.split(","):
    inputs = _inputs(shape, dt, with_dy=args.kernel == "bwd")
    shape_cfgs = {cs: cfgs[(shape, cs)] for cs in args.configs.split(";")}
    (_ab_fwd if args.kernel == "fwd" else _ab_bwd)(args, shape, shape_cfgs, *inputs)
  return 0


# --------------------------------------------------------------------------- tokamax


def _tokamax_flags():
  from absl import flags
  if not flags.FLAGS.is_parsed():  # tokamax reads absl flags: not our argv
    flags.FLAGS(sys.argv[:1])


def _compiled_ops(compiled_text: str, pattern) -> list[str]:
  """The opcodes of a compiled module's instructions whose line ``pattern`` accepts."""
  return [line.split("=")[1].split("(")[0].strip() for line in compiled_text.splitlines()
          if " = " in line and pattern(line)]


def _tokamax_fwd(mode: str) -> None:
  """tokamax's forward with and without its y-onto-x alias
  (``benchmarks/results/h200_2026-11-21_tokamax_alias.txt``)."""
  _tokamax_flags()
  import tokamax
  from tokamax._src.ops.normalization import pallas_triton

  import pallas_norm
  noalias = pallas_triton.PallasTritonNormalization(input_output_alias=False)
  impls = {
      "pallas": lambda x, s: pallas_norm.rms_norm(x, s, eps=1e-6),
      "triton": lambda x, s: pallas_norm.rms_norm(x, s, eps=1e-6, backend="triton"),
      "tokamax": lambda x, s: tokamax.layer_norm(x, s, None, epsilon=1e-6,
                                                 subtract_mean=False, implementation="triton"),
      "tokamax_noalias": lambda x, s: noalias(x, s, None, epsilon=1e-6, subtract_mean=False),
      "xla": lambda x, s: reference.norm(x, s, None, eps=1e-6, subtract_mean=False)[0],
  }
  if mode == "cupti":
    timing.warm_up(2)
  for m, n in [(4096, 1024), (32768, 128), (4096, 4096), (8192, 5120)]:
    r = _reps(m * n * 2)
    key = jax.random.key(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16) for i in range(r)]
    s = jnp.full((n,), 1.1, jnp.bfloat16)
    line = []
    for name, f in impls.items():
      if mode == "hlo":
        if name.startswith("tokamax"):
          txt = jax.jit(f).lower(xs[0], s).compile().as_text()
          print(m, n, name, _compiled_ops(txt, lambda ln: "copy" in ln or "custom-call" in ln))
        continue
      t = timing.cupti_time(jax.jit(f), [(x, s) for x in xs], 30)
      line.append(f"{name} {t['us']:.2f}us {2 * m * n * 2 / t['us'] / 1e3:.0f}GB/s "
                  f"{t.get('kernels')}")
    if line:
      print(mode, m, n, " | ".join(line), flush=True)


def _tokamax_fwdbwd(mode: str) -> None:
  """tokamax's forward+backward with and without its VJP's dx-onto-x alias, in the kernel
  bench's step (``benchmarks/results/h200_2026-11-22_tokamax_vjp_alias.txt``).
  "tokamax_alias" is the forward without its y-onto-x alias and the VJP as tokamax ships
  it (dx written over x); "tokamax" is the bench's tokamax: the VJP without that alias
  (``peers.tokamax_vjp_without_alias``)."""
  _tokamax_flags()
  from tokamax._src.ops.normalization import pallas_triton

  import pallas_norm
  from pallas_norm.bench import peers
  eps = 1e-6
  alias = pallas_triton.PallasTritonNormalization(input_output_alias=False)
  noalias = pallas_triton.PallasTritonNormalization(input_output_alias=False,
                                                    vjp=peers.tokamax_vjp_without_alias())

  def impls(layer):
    return {
        "pallas": (lambda x, s, b: pallas_norm.layer_norm(x, s, b, eps=eps)) if layer
                  else (lambda x, s, b: pallas_norm.rms_norm(x, s, eps=eps)),
        "tokamax_alias": lambda x, s, b: alias(x=x, scale=s, offset=b, epsilon=eps,
                                               subtract_mean=layer),
        "tokamax": lambda x, s, b: noalias(x=x, scale=s, offset=b, epsilon=eps,
                                           subtract_mean=layer),
    }

  print(jax.devices()[0].device_kind, jax.__version__, timing.version("tokamax"), flush=True)
  if mode == "cupti":
    timing.warm_up(2)
  for layer in (False, True):
    for m, n in [(4096, 1024), (32768, 128), (4096, 4096), (8192, 5120)]:
      r = _reps(m * n * 2)
      key = jax.random.key(0)
      xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16)
            for i in range(r)]
      dys = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, n), jnp.bfloat16)
             for i in range(r)]
      s = jnp.full((n,), 1.1, jnp.bfloat16)
      b = jnp.full((n,), 0.1, jnp.bfloat16) if layer else None
      op = "layer" if layer else "rms"
      outs, line = {}, []
      for name, f in impls(layer).items():
        st = jax.jit(peers.fwdbwd(f))
        if mode == "hlo":
          if name.startswith("tokamax"):
            txt = st.lower(xs[0], s, b, dys[0]).compile().as_text()
            ops = _compiled_ops(txt, lambda ln: " copy(" in ln or "custom-call" in ln)
            print(op, m, n, name, ops, flush=True)
          continue
        outs[name] = st(xs[0], s, b, dys[0])
        t = timing.cupti_time(st, [(x, s, b, dy) for x, dy in zip(xs, dys)], 30)
        ks = " ".join(f"{k}={u:.2f}" for k, u in zip(t.get("kernels", []), t.get("kernel_us", [])))
        line.append(f"{name} {t['us']:.2f}us {5 * m * n * 2 / t['us'] / 1e3:.0f}GB/s [{ks}]")
      if outs:  # the two tokamax variants compute the same numbers
        same = all(bool(jnp.array_equal(a, c)) for a, c in
                   zip(jax.tree.leaves(outs["tokamax_alias"]), jax.tree.leaves(outs["tokamax"])))
        print(mode, op, m, n, f"identical={same}", " | ".join(line), flush=True)


# --------------------------------------------------------------------------- triton, ncu


def _triton(variant: str) -> None:
  """RMSNorm bf16 forward and forward+backward GB/s of one backend or Triton knob
  (``benchmarks/results/h200_2026-11-21_triton_ab.txt``)."""
  import pallas_norm
  from pallas_norm.kernels import triton_kernels as tk
  backend = "pallas" if variant == "pallas" else "triton"
  if variant == "evict_first":
    tk.KNOBS = tk.TritonKnobs(evict_first=True)
  if variant == "stream_cg":
    tk.KNOBS = tk.TritonKnobs(stream_cg=True)
  if variant == "stages2":
    tk.KNOBS = tk.TritonKnobs(loop_stages=2)
  timing.warm_up(2)
  out = []
  for m, n in [(4096, 4096), (8192, 5120), (32768, 128), (16384, 16384), (1024, 262144)]:
    r = _reps(m * n * 2)
    k = jax.random.key(0)
    xs = [(jax.random.normal(jax.random.fold_in(k, i), (m, n), jnp.bfloat16),
           jnp.full((n,), 1.1, jnp.bfloat16),
           jax.random.normal(jax.random.fold_in(k, 99 + i), (m, n), jnp.bfloat16))
          for i in range(r)]
    f = lambda x, s: pallas_norm.rms_norm(x, s, backend=backend)  # noqa: E731
    fwd = jax.jit(lambda x, s, dy: f(x, s))

    def fbs(x, s, dy):
      y, pull = jax.vjp(f, x, s)
      return y, pull(dy)
    fb = jax.jit(fbs)
    t1 = timing.cupti_time(fwd, xs, 20).get("us")
    t2 = timing.cupti_time(fb, xs, 20).get("us")
    out.append(f"{m}x{n} fwd {2*m*n*2/t1/1e3:.0f} fb {5*m*n*2/t2/1e3:.0f}")
  print(variant, " | ".join(out), flush=True)


def _ncu(shape: str) -> None:
  """RMSNorm forward at ``shape``, bf16, through both backends, each call twice."""
  import pallas_norm
  ((m, n),) = plan.parse_shapes(shape)
  x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
  s = jnp.full((n,), 1.1, jnp.bfloat16)
  for be in ("pallas", "triton"):
    g = jax.jit(lambda x, s, be=be: pallas_norm.rms_norm(x, s, backend=be))
    for _ in range(2):
      jax.block_until_ready(g(x, s))
    print("ran", be, flush=True)


# --------------------------------------------------------------------------- CLI

_NCU_EXAMPLE = r"""The ncu metrics behind docs/performance.md's two-backends note
(benchmarks/results/h200_2026-11-21_ncu_fwd_8192sq.csv):

  ncu --clock-control none --target-processes all -k regex:norm --csv --metrics \
    launch__registers_per_thread,launch__grid_size,launch__block_size,\
sm__warps_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,\
smsp__inst_executed.sum,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum \
    python -m pallas_norm.bench ab ncu

and the launch statistics (function cache configuration, shared-memory carveout, L1 hit
rate; benchmarks/results/h200_2026-11-21_ncu_fwd_launch_{8192sq,16384sq}.csv):

  ncu --clock-control none -k regex:norm_fwd -s 1 -c 2 --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SpeedOfLight \
    -o rep python -m pallas_norm.bench ab ncu --shape 16384x16384
  ncu -i rep.ncu-rep --page details --csv
"""


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m pallas_norm.bench ab",
      description="Interleaved A/Bs on the GPU (CUPTI kernel time, rotated inputs). "
                  "The config mini-language of 'fwd' and 'bwd': the module docstring of "
                  "pallas_norm/bench/ab.py.")
  sub = p.add_subparsers(dest="what", required=True)
  for kernel, what in (("fwd", "forward"), ("bwd", "backward (stage 1 + 2)")):
    q = sub.add_parser(kernel, help=f"{what} launch configs, rounds interleaved",
                       description=f"A/B of {what} launch configs, rounds interleaved, on "
                                   f"rotated inputs (>= 256 MiB); CUPTI kernel time, median "
                                   f"of 10 calls a round.")
    q.set_defaults(kernel=kernel)
    q.add_argument("--op", required=True, choices=("rms", "layer"))
    q.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    q.add_argument("--shapes", required=True, help="MxN list, e.g. 8192x5120,4096x65536")
    q.add_argument("--configs", required=True,
                   help="';'-separated config specs, e.g. 'default;split:512,1,20,1,0' "
                        "(see pallas_norm/bench/ab.py), each optionally +'@nocg' / '@cgall'")
    q.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="x's (and dy's) dtype; scale and bias stay bfloat16")
    q.add_argument("--no-limit", action="store_true",
                   help="allow more splits than split_resident_programs (may deadlock)")
    if kernel == "bwd":
      q.add_argument("--residual", action="store_true",
                     help="the fused residual add's backward: x is h, dh (h's cotangent) "
                          "is added to dx; default configs are config.py's residual "
                          "picks; GB/s = 4 x M x N x itemsize / time")
    if kernel == "fwd":
      q.add_argument("--bias", type=int, choices=(0, 1),
                     help="1: with a bias, 0: without (default: LayerNorm with, RMSNorm "
                          "without)")
    q.add_argument("--dry-run", action="store_true",
                   help="print each shape's configs and exit (no GPU)")
  q = sub.add_parser("tokamax-alias", help="tokamax with and without its output aliases",
                     description=_tokamax_fwd.__doc__ + " With --pass fwdbwd: "
                     + _tokamax_fwdbwd.__doc__)
  q.add_argument("--pass", dest="pass_", default="fwd", choices=plan.PASSES)
  q.add_argument("--mode", default="cupti", choices=("cupti", "hlo"),
                 help="cupti: kernel times; hlo: the copies and custom calls of each step")
  q = sub.add_parser("triton", help="backend='triton' against 'pallas', and the TritonKnobs",
                     description=_triton.__doc__ + " One variant a process.")
  q.add_argument("--variant", required=True, choices=_TRITON_VARIANTS)
  q = sub.add_parser("ncu", help="both backends' RMSNorm forward, twice each, for ncu",
                     description=_ncu.__doc__, epilog=_NCU_EXAMPLE,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  q.add_argument("--shape", default="8192x8192", help="MxN (default 8192x8192)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Run ``ab`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
  p = parser()
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  if args.what in ("fwd", "bwd"):
    try:
      return _run_configs(args)
    except ValueError as e:
      p.error(str(e))
  if timing.gpu_missing():
    return 2
  if args.what == "tokamax-alias":
    (_tokamax_fwd if args.pass_ == "fwd" else _tokamax_fwdbwd)(args.mode)
  elif args.what == "triton":
    _triton(args.variant)
  else:
    _ncu(args.shape)
  return 0
