"""The harness of the FP8-output config sweeps (fp8_sweep4.py, fp8_sweep5.py,
fp8_sweep6.py, fp8_sweep_t.py): their inputs (``inputs``), and groups of (tag, configs,
jitted functions, bytes, inputs, default) timed in interleaved rounds (every group's
every config once a round, within a time budget), the median of the rounds a config,
printed and written as JSON with each group's best.
CUPTI kernel time (``pallas_norm.bench.timing.time_us``: median of ``iters`` calls over
the rotated inputs). ``time_rounds``: the A/B scripts' interleaved rounds with each
kernel's time (fp8_x_vector_ab.py, fp8_input_wide_modes.py, fp8_input_wide_vjp_ab.py);
``fp8x_inputs``: the FP8-input A/Bs' inputs; ``forced_fp8_vector``: FP8 x's load vector
forced while a function is traced (fp8_input_bwd_sweep.py --vector), and
``compiled_with_vector`` a function compiled so (fp8_x_vector_ab.py,
fp8_input_wide_vjp_ab.py)."""
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm.bench import timing
from pallas_norm.kernels import forward


@contextlib.contextmanager
def forced_fp8_vector(vec):
  """Inside: every FP8-x kernel traced loads x in runs of ``vec`` values a thread (0: 16,
  the loads before ``forward._fp8_vector``'s rule), whatever the rule says; ``vec`` None:
  the rule."""
  if vec is None:
    yield
    return
  rule = forward._fp8_vector
  forward._fp8_vector = lambda kernel, subtract_mean, n: vec
  try:
    yield
  finally:
    forward._fp8_vector = rule


def compiled_with_vector(fn, vec, *args):
  """``jax.jit(fn)`` compiled ahead of time for ``args`` with FP8 x's load vector forced
  to ``vec`` (None: the rule) while it is traced, after clearing JAX's caches: the ops'
  module-level jit (``ops._norm_nd_jit``) would otherwise hand every variant the kernels
  traced for the first one."""
  jax.clear_caches()
  with forced_fp8_vector(vec):
    return jax.jit(fn).lower(*args).compile()


def fp8x_inputs(m, n, group_size=16):
  """The FP8-input A/Bs' inputs (fp8_input_wide_modes.py, fp8_input_wide_vjp_ab.py): three
  x [M, N] float8_e4m3fn (2 N(0, 1)) to rotate, x_scale [M, N / G] f32 uniform in [0.5,
  2), bf16 scale 1 + 0.1 N(0, 1) and bias 0.1 N(0, 1), dy [M, N] bf16 N(0, 1)."""
  xs8 = [(2 * jax.random.normal(jax.random.key(20 + i), (m, n))).astype(
      jnp.float8_e4m3fn) for i in range(3)]
  s = jax.random.uniform(jax.random.key(1), (m, n // group_size), minval=0.5, maxval=2.0)
  w = (1 + 0.1 * jax.random.normal(jax.random.key(2), (n,))).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.key(3), (n,))).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(9), (m, n), jnp.bfloat16)
  return xs8, s, w, b, dy


def inputs(m, n, param_dtype=jnp.float32):
  """(xs, scale, bias) of one shape: x [M, N] bf16 rotated over >= 256 MiB (at least two
  sets), scale 1 + 0.1 N(0, 1) and bias 0.1 * scale in ``param_dtype``."""
  sets = max(2, -(-(256 << 20) // (m * n * 2)))
  xs = [(jax.random.normal(jax.random.key(i), (m, n), jnp.bfloat16),) for i in range(sets)]
  s = 1 + 0.1 * jax.random.normal(jax.random.key(7), (n,))
  return xs, s.astype(param_dtype), (0.1 * s).astype(param_dtype)


def time_rounds(fns, rows, arg_sets, *, rounds=5, iters=10):
  """Time ``fns`` ({name: callable}) in ``rounds`` interleaved rounds (each once a round,
  ``timing.cupti_time`` over ``arg_sets``, ``iters`` calls), skipping the names whose
  ``rows[name]`` holds an "error". Fills ``rows[name]``: "rounds" (us a round), "us" (their
  median) and "kernel_us" (each kernel's median over the rounds, in launch order)."""
  live = [k for k in fns if "error" not in rows[k]]
  for k in live:
    rows[k].update(rounds=[], kernel_us=[])
  for _ in range(rounds):
    for k in live:
      t = timing.cupti_time(fns[k], arg_sets, iters)
      rows[k]["rounds"].append(t.get("us"))
      rows[k]["kernel_us"].append(t.get("kernel_us"))
  for k in live:
    row = rows[k]
    r = sorted(row["rounds"])
    row["us"] = r[len(r) // 2]
    row["kernel_us"] = [round(sorted(c)[len(c) // 2], 2) for c in zip(*row["kernel_us"])]


def run(groups, out, *, budget_s, t0, num_sms, note, rounds=3, iters=10, describe=str):
  """Time ``groups`` ((tag, configs, fns, bytes, inputs, default) each) and write ``out``.
  ``describe(cfg)``: a config's printed form."""
  res = {}
  for r in range(rounds):
    for tag, cs, fns, _, xs, _ in groups:
      for cfg, f in zip(cs, fns):
        if time.time() - t0 > budget_s:
          break
        try:
          us = timing.time_us(f, xs, iters)
        except Exception as e:  # noqa: BLE001 (a config that does not fit is a result)
          print(tag, cfg, "ERR", str(e)[:150], flush=True)
          us = None
        res.setdefault((tag, cfg), []).append(us)
    print(f"round {r} done at {time.time() - t0:.0f}s", flush=True)
  rows = []
  for (tag, cfg), v in res.items():
    v = [u for u in v if u is not None]
    if not v:
      continue
    g = next(x for x in groups if x[0] == tag)
    us = float(np.median(v))
    rows.append(dict(tag=tag, config=str(cfg), default=cfg == g[5], us=us, rounds=v,
                     gbs=g[3] / us / 1e3))
    print(f"{tag:24s} {'D' if cfg == g[5] else ' '} {describe(cfg)} {us:7.1f}us "
          f"{g[3] / us / 1e3:6.0f}GB/s rounds={[round(u, 1) for u in v]}", flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, num_sms=num_sms, rows=rows, note=note,
                 elapsed_s=time.time() - t0), open(out, "w"), indent=1)
  best = {}
  for r in rows:
    if r["tag"] not in best or r["us"] < best[r["tag"]]["us"]:
      best[r["tag"]] = r
  for t, r in best.items():
    dflt = [x["us"] for x in rows if x["tag"] == t and x["default"]]
    print("BEST", t, r["config"], f"{r['us']:.1f}us", "default", dflt)
