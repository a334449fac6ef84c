"""The kernel bench's run loop: inputs, ``--check``, one row per case, the result file.

For each group of cases (one shape) it builds R rotated device copies of the inputs
(``plan.rotations``), then for each case: compiles and warms up the step, compares its
outputs with the XLA reference (``--check``), and times it (``timing.cupti_time``, or
CUDA events for torch). A case that fails becomes a row with its status and reason; the
run goes on. The file is rewritten after every shape, so a cut-off run keeps its rows.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm.bench import peers, report, timing
from pallas_norm.bench.plan import (DTYPES, FP8_INPUT_GROUP, IMPL_BY_NAME, Case, Impl,
                                    bytes_model, fp8_design_bytes, fp8_input, fp8_static,
                                    fp8_variant, groups, rotations)

# Relative error ||out - ref|| / ||ref|| accepted by --check, per dtype.
_CHECK_TOL = {"bf16": 1e-2, "f16": 2e-3, "f32": 1e-4}

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
  # FP8 input ("*_fp8in" ops): (x8 float8_e4m3fn [M, N], x_scale f32 [M, N // G]) a copy
  x8s: list = dataclasses.field(default_factory=list)


def _make_inputs(m: int, n: int, dtype, r: int, need_dy: bool, seed: int,
                 need_residual: bool = False, need_fp8: bool = False) -> _Inputs:
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
  x8s = [_fp8_input(x, k) for x, k in zip(xs, jax.random.split(keys[-1], r))] if need_fp8 else []
  jax.block_until_ready((xs, dys, rs, dhs, scale, bias, x8s))
  return _Inputs(xs, dys, scale, bias, rs=rs, dhs=dhs, x8s=x8s)


def _fp8_input(x, key):
  """(x8, x_scale): x as float8_e4m3fn (values of N(0, 1), no saturation) with scales
  uniform in [0.5, 2] a group of FP8_INPUT_GROUP."""
  m, n = x.shape
  x_scale = jax.random.uniform(key, (m, n // FP8_INPUT_GROUP), jnp.float32, 0.5, 2.0)
  return x.astype(jnp.float8_e4m3fn), x_scale


def _arg_sets(op: str, pass_: str, inp: _Inputs) -> list:
  """The rotated argument tuples of one case: (x, scale, bias[, dy]); for a "*_res" op
  x is (x, r) and dy is (dy, dh)."""
  bias = inp.bias if op.startswith("layer") else None
  xs = (list(zip(inp.xs, inp.rs)) if op.endswith("_res")
        else inp.x8s if fp8_input(op) else inp.xs)
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


def rel_err(out, ref) -> tuple[float, float]:
  """(||out - ref|| / ||ref||, max |out - ref|) in float32."""
  o = jnp.asarray(out, jnp.float32)
  r = jnp.asarray(ref, jnp.float32)
  d = o - r
  rel = jnp.sqrt(jnp.sum(d * d)) / jnp.maximum(jnp.sqrt(jnp.sum(r * r)), 1e-30)
  return float(rel), float(jnp.max(jnp.abs(d)))


def _reference_outputs(op: str, pass_: str, inp: _Inputs):
  """Reference y (fwd) or (y, (dx, dscale[, dbias])) (fwdbwd, fwdbwd_dep) on copy 0."""
  f = peers.jax_fn(IMPL_BY_NAME["xla"], op)
  args = _arg_sets(op, pass_, inp)[0]
  return jax.jit(peers.step_of(f, op, pass_))(*args)


def compare(out, ref, dtype_name: str, names=None) -> dict:
  """Every array of ``out`` against ``ref``; pass when each relative error is within
  the dtype's tolerance (NaN never passes). ``names``: the outputs' names (default:
  y, dx, dscale, dbias, or with a residual y, h, dx, dresidual, dscale, dbias)."""
  outs = [a for a in jax.tree.leaves(out)]
  refs = [a for a in jax.tree.leaves(ref)]
  if len(outs) != len(refs):
    return {"check": "FAIL", "check_detail": f"{len(outs)} outputs, reference has {len(refs)}"}
  errs = [rel_err(o, r) for o, r in zip(outs, refs)]
  tol = _CHECK_TOL[dtype_name]
  ok = all(e[0] <= tol for e in errs)  # False for NaN
  if names is None:
    names = (["y", "dx", "dscale", "dbias"] if len(errs) <= 4
             else ["y", "h", "dx", "dresidual", "dscale", "dbias"])[:len(errs)]
  detail = " ".join(f"{nm}:rel={e[0]:.2e},max={e[1]:.2e}" for nm, e in zip(names, errs))
  return {"check": "ok" if ok else "FAIL", "check_detail": f"{detail} (tol {tol:g})"}


# --------------------------------------------------------------------------- run


def _prepare_jax_case(impl: Impl, c: Case, inp: _Inputs, args, ref):
  """(row with compile_s and the --check result, the jitted step, its rotated args)."""
  f = peers.jax_fn(impl, c.op)
  step = peers.step_of(f, c.op, c.pass_)
  step = jax.jit(step if impl.tables else peers.without_tables(step))
  arg_sets = _arg_sets(c.op, c.pass_, inp)
  t0 = time.perf_counter()
  out = jax.block_until_ready(step(*arg_sets[0]))  # compile + warm up
  row = {"compile_s": round(time.perf_counter() - t0, 2)}
  if ref is not None:
    row.update(compare(out, ref, args.dtype, _fp8_names(c.op) if fp8_variant(c.op)
                       else None))
  del out
  return row, step, arg_sets


def _run_jax_case(impl: Impl, c: Case, inp: _Inputs, args, ref) -> dict:
  row, step, arg_sets = _prepare_jax_case(impl, c, inp, args, ref)
  row.update(timing.cupti_time(step, arg_sets, args.iters))
  row["timer"] = "cupti"
  return row


def _time_rounds(pending: list, args, copy_gbs) -> None:
  """``--rounds``: time the prepared JAX cases of one (op, pass, shape) cell, ``pending``
  [(row, step, arg_sets)], in ``args.rounds`` rounds of ``args.iters`` calls, the cases
  alternated round by round; each row gets the summary of all its calls, the rounds'
  medians ("rounds_us") and the first round's kernels, then its status (``_finish``). A
  round without CUPTI times (or one that raised) makes the row n/a (or error).

  One untimed round comes first: the case timed first after a cell's compiles ran
  slower in its first round (H200, 2026-11-29: 1.95 against 1.41 us, then level; the
  same config 8% apart in a cell's median, docs/performance.md#few-rows)."""
  calls: list[list[float]] = [[] for _ in pending]
  medians: list[list[float]] = [[] for _ in pending]
  result: list[dict | None] = [None] * len(pending)
  for r in range(args.rounds + 1):  # round 0 untimed
    for i, (_, step, arg_sets) in enumerate(pending):
      if result[i] is not None and "us" not in result[i]:
        continue  # n/a or an error once: no more rounds
      try:
        t = timing.cupti_time(step, arg_sets, args.iters, per_call=True)
      except Exception as e:  # noqa: BLE001 - one failure must not stop the run
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        t = {"status": "error", "reason": msg[:2000]}
      if "us" not in t:
        result[i] = t
      elif r > 0:
        result[i] = result[i] or t
        calls[i] += t["per_call_us"]
        medians[i].append(t["us"])
  for i, (row, _, _) in enumerate(pending):
    t = result[i]
    if "us" in t:
      row.update(timing.summarise(calls[i]), kernels=t["kernels"],
                 kernel_us=t["kernel_us"], rounds_us=medians[i])
    else:
      row.update(t)
    row["timer"] = "cupti"
    _finish(row, copy_gbs)


def _run_torch_case(impl: Impl, c: Case, inp: _Inputs, args, ref) -> dict:
  import torch
  f = peers.torch_fn(impl, c.op)
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
    out = (out[0].detach(), tuple(out[1])) if c.pass_ != "fwd" else out
    row.update(compare(jax.tree.map(lambda a: jnp.from_dlpack(a.contiguous()), out),
                        ref, args.dtype))
  del out
  row.update(timing.torch_time(call, r, args.iters))
  row["timer"] = "cuda_events"
  return row


def _run_case(c: Case, inp: _Inputs, args, copy_gbs, unavailable: dict, ref,
              pending: list | None = None) -> dict:
  """One case's row. With ``pending`` (``--rounds``), a JAX case is only compiled and
  checked: its (row, step, arg_sets) is appended there for ``_time_rounds``, which times
  and finishes the row (status "pending" until then)."""
  impl = IMPL_BY_NAME[c.impl]
  itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
  nbytes = bytes_model(c.m, c.n, itemsize, c.pass_, c.op)
  row = {"op": c.op, "pass": c.pass_, "m": c.m, "n": c.n, "dtype": args.dtype,
         "impl": c.impl, "family": impl.family, "phase": c.phase, "bytes": nbytes,
         "rotations": len(inp.xs), "iters": args.iters}
  if c.impl in unavailable:
    return {**row, "status": "unavailable", "reason": unavailable[c.impl]}
  try:
    if pending is not None and impl.kind != "torch":
      prepared, step, arg_sets = _prepare_jax_case(impl, c, inp, args, ref)
      row.update(prepared, status="pending")
      pending.append((row, step, arg_sets))
      return row
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
  return _finish(row, copy_gbs)


def _finish(row: dict, copy_gbs) -> dict:
  """``row``'s status ("ok" with a time, else the timer's "n/a" or "error") and its
  GB/s, % of copy and, for pallas_norm's FP8 output, the bytes its kernels move."""
  if "us" not in row:
    row["status"] = "n/a" if row.get("status", "pending") == "pending" else row["status"]
    return row
  row["status"] = "ok"
  row["gbs"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
  row["pct_copy"] = 100.0 * row["gbs"] / copy_gbs if copy_gbs else None
  if fp8_variant(row["op"]) and row["impl"] == "pallas":  # the bytes its kernels move
    itemsize = jnp.dtype(DTYPES[row["dtype"]]).itemsize
    row["bytes_design"] = fp8_design_bytes(row["m"], row["n"], itemsize, row["op"])
    row["gbs_design"] = row["bytes_design"] / (row["us"] * 1e-6) / 1e9
  return row


def _fp8_names(op: str) -> list[str]:
  """Fp8Norm's leaves as the bench's FP8-output step returns them: y_t with "_t", no
  y_scale under delayed scaling (the given one, left out: peers._fp8_fn); y alone for a
  static-scale op."""
  if fp8_static(op):
    return ["y", "h"] if op.endswith("_res") else ["y"]
  _, delayed, transpose = fp8_variant(op)
  return ["y"] + ([] if delayed else ["y_scale"]) + ["amax"] + (
      ["y_t"] if transpose else []) + ["mean", "rstd"]


_METHOD = ("CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure, all kernels "
           "of a call summed; torch: CUDA events behind torch.cuda._sleep), median of "
           "{iters} calls after one warm-up{rounds}, R rotated input copies with R*bytes(x) >= "
           "4*L2, no flush; XLA_FLAGS {flag}; bytes: fwd 2*M*N*itemsize, fwd+bwd "
           "5*M*N*itemsize, FP8 output (itemsize+1)*M*N (+M*N with y_t), FP8 input "
           "(1+itemsize+4/16)*M*N fwd, +(1+2*itemsize+4/16)*M*N bwd; copy = -a on "
           "1 GiB under jit, 2*bytes/time")


def run_plan(args, plan: list[Case]) -> int:
  """Time every case of ``plan`` (``cli.parser``'s ``args``); write JSON, CSV and PNG at
  ``--out``; print the table. Returns 1 when a ``--check`` failed, else 0."""
  start = time.perf_counter()
  dtype = DTYPES[args.dtype]
  itemsize = jnp.dtype(dtype).itemsize
  torch_ok = timing.torch_status()
  dev = timing.device_meta(torch_ok[0])
  print(f"device: {dev['device']} ({dev['num_sms']} SMs, L2 {dev['l2_bytes'] / 1e6:.0f} MB "
        f"{dev['l2_source']}), jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}",
        flush=True)
  unavailable: dict[str, str] = {}
  for impl in dict.fromkeys(IMPL_BY_NAME[c.impl] for c in plan):
    reason = peers.probe(impl, torch_ok)
    if reason:
      unavailable[impl.name] = reason
      print(f"skip {impl.name}: {reason}", flush=True)
  timing.warm_up()
  copy = timing.measure_copy(dtype, args.iters)
  copy["copy_gbs_jax"], copy["copy_source"] = copy.get("copy_gbs"), "jax -x (CUPTI)"
  if torch_ok[0]:
    copy["copy_gbs_torch"] = timing.torch_copy_gbs(args.iters)
    # The reference is the fastest copy measured: torch's copy_ beat XLA's elementwise
    # kernel on the H200 (4231 against 3362 GB/s, 2026-11-21).
    if copy["copy_gbs_torch"] and copy["copy_gbs_torch"] > (copy.get("copy_gbs") or 0):
      copy["copy_gbs"], copy["copy_source"] = copy["copy_gbs_torch"], "torch copy_ (events)"
  if timing.BACKEND_STARTED_EARLY:
    print(f"warning: the XLA backend started before pallas_norm.bench set XLA_FLAGS; set "
          f"XLA_FLAGS={timing.COMMAND_BUFFER_FLAG} in the environment", flush=True)
  copy_txt = f"{copy['copy_gbs_jax']:.0f}" if copy.get("copy_gbs_jax") else "n/a"
  print(f"copy: {copy_txt} GB/s (jax, CUPTI)"
        + (f", {copy['copy_gbs_torch']:.0f} GB/s (torch, events)" if torch_ok[0] else "")
        + (f" -- {copy['copy_reason']}" if copy.get("copy_reason") else "")
        + f"; % of copy uses {copy['copy_source']}", flush=True)
  meta = {
      **dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "dtype": args.dtype, "iters": args.iters, "git_commit": timing.git_commit(),
      "jax": jax.__version__,
      **{key: timing.version(dist) for key, dist in (
          ("jaxlib", "jaxlib"), ("triton", "triton"), ("jax_triton", "jax-triton"),
          ("tokamax", "tokamax"), ("flax", "flax"), ("torch", "torch"),
          ("liger", "liger-kernel"))},
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv[1:],
      "rounds": args.rounds,
      "method": _METHOD.format(
          iters=args.iters, flag=timing.COMMAND_BUFFER_FLAG,
          rounds="" if args.rounds == 1 else (
              f" (JAX: {args.rounds} rounds of {args.iters} calls, the implementations of "
              f"a cell alternated round by round after all compiled and one untimed round; the median of all "
              f"{args.rounds * args.iters} calls)")),
      "bytes_model": {"fwd": "2*M*N*itemsize", "fwdbwd": "5*M*N*itemsize",
                      "fwd (*_res)": "4*M*N*itemsize", "fwdbwd (*_res)": "8*M*N*itemsize",
                      "fwd (*_fp8*)": "(itemsize+1)*M*N, +M*N with y_t (*_t)",
                      "fwd (*_fp8in)": "(1+itemsize)*M*N + 4*M*N/16 (x e4m3, x_scale, y)",
                      "fwdbwd (*_fp8in)": "fwd + (1+2*itemsize)*M*N + 4*M*N/16 "
                                          "(x, x_scale, dy, dx)",
                      "bytes_design (*_fp8*, pallas)": "delayed: the model; current: "
                                                       "+itemsize*M*N (x read twice)"},
      "unavailable": unavailable, **copy}
  out = report.out_path(args, meta)
  rows: list[dict] = []
  done = 0
  for (phase, m, n), cases in groups(plan):
    if time.perf_counter() - start > args.budget_s:
      rows += [_not_run(c, args) for c in cases]
      continue
    fp8 = any(fp8_input(c.op) for c in cases)
    r = rotations(m, n, 1 if fp8 else itemsize, dev["l2_bytes"])  # x8: 1 byte
    inp = _make_inputs(m, n, dtype, r, any(c.pass_ != "fwd" for c in cases), args.seed,
                       any(c.op.endswith("_res") for c in cases), fp8)
    refs: dict = {}
    # --rounds: the implementations of one (op, pass) cell compile first, then alternate
    cells = ([cases] if args.rounds == 1 else
             list(_by_key(cases, lambda c: (c.op, c.pass_)).values()))
    for cell in cells:
      pending = None if args.rounds == 1 else []
      printed = []
      for c in cell:
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
              print(f"--check: reference failed for {c.op} {c.pass_} {m}x{n}: {e}",
                    flush=True)
              refs[(c.op, c.pass_)] = None
          ref = refs[(c.op, c.pass_)]
        row = _run_case(c, inp, args, meta.get("copy_gbs"), unavailable, ref, pending)
        rows.append(row)
        if row["status"] != "unavailable":  # the reason was printed once, above
          printed.append((f"[{done:4d}/{len(plan)} {elapsed:6.1f}s]", row))
        if pending is None:
          for head, r in printed:
            print(f"{head} {_progress(r)}", flush=True)
          printed = []
      if pending:
        _time_rounds(pending, args, meta.get("copy_gbs"))
      for head, r in printed:
        print(f"{head} {_progress(r)}", flush=True)
    del inp, refs
    gc.collect()
    if "torch" in sys.modules and torch_ok[0]:
      sys.modules["torch"].cuda.empty_cache()
    report.write(out, meta, rows)  # partial results survive a cut-off run
  skipped = sum(r["status"] == "not run" for r in rows)
  if skipped:
    print(f"budget of {args.budget_s:.0f}s spent: {skipped} cases not run; run subsets "
          f"(--shapes/--ops/--passes/--impls) or raise --budget-s", flush=True)
  report.write(out, meta, rows)
  print(f"wrote {out} and {out.with_suffix('.csv')}")
  failed = [r for r in rows if r.get("check") == "FAIL"]
  for r in failed:
    print(f"CHECK FAILED: {r['op']} {r['pass']} {report.shape_txt(r)} {r['impl']}: "
          f"{r['check_detail']}", flush=True)
  report.finish(out, {"meta": meta, "rows": rows})
  return 1 if failed else 0


def _by_key(items, key) -> dict:
  """{key(item): [items]} in first-seen order."""
  out: dict = {}
  for it in items:
    out.setdefault(key(it), []).append(it)
  return out


def _not_run(c: Case, args) -> dict:
  return {"op": c.op, "pass": c.pass_, "m": c.m, "n": c.n, "dtype": args.dtype,
          "impl": c.impl, "family": IMPL_BY_NAME[c.impl].family, "phase": c.phase,
          "status": "not run", "reason": f"--budget-s {args.budget_s:.0f} spent"}


def _progress(row: dict) -> str:
  head = f"{row['op']:5} {row['pass']:6} {report.shape_txt(row):<12} {row['impl']:17}"
  check = f"  check {row['check']} {row['check_detail']}" if "check" in row else ""
  if row["status"] != "ok":
    return f"{head} {row['status']}: {row.get('reason', '')[:300]}{check}"
  pct = f"{row['pct_copy']:4.0f}% copy" if row.get("pct_copy") is not None else "n/a copy"
  if "gbs_design" in row:
    pct += f" (moved {row['gbs_design']:.0f} GB/s)"
  return (f"{head} {row['us']:9.1f} us {row['gbs']:6.0f} GB/s {pct}  "
          f"k={len(row.get('kernels', [])) or '-'} R={row['rotations']} "
          f"compile {row['compile_s']:.1f}s{check}")


