"""Launch-config sweep for the Pallas kernels (GPU): the measurements behind config.py.

For each shape it times candidate ForwardConfigs (every mode) and BackwardConfigs by
calling the launchers directly, prints the best per (shape, kernel) with GB/s on the
bytes model (forward 2*M*N*itemsize; backward 3*M*N*itemsize: read x, dy, write dx),
and writes every row to a JSON file. Method as in pallas_norm.bench: CUPTI kernel time
(summed over the kernels of one call), inputs rotated over >= 4x L2, median of --iters.
max_err is the largest |difference| from the XLA reference (y forward, dx backward) on
the first input.

  python benchmarks/sweep.py --shapes 4096x4096,32768x128 --out /tmp/sweep.json
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_norm import bench  # noqa: E402
from pallas_norm import config as C  # noqa: E402
from pallas_norm import reference  # noqa: E402
from pallas_norm.kernels import backward, forward  # noqa: E402

_L2_BYTES = 64 << 20


def _time(fn, inputs, iters):
  """Median CUPTI time (us) of fn over rotated inputs, or None if no kernel was seen."""
  jax.block_until_ready(fn(*inputs[0]))
  return bench._cupti_time(fn, inputs, iters).get("us")


def ab_warm_up() -> int:
  """For the A/B scripts: print the device, keep the GPU busy for 3 s (clocks up) and
  return its SM count. With PN_NOLIMIT=1 (sweeps only), split-row configs may then have
  more splits than ``split_resident_programs`` allows: such a grid may deadlock."""
  if os.environ.get("PN_NOLIMIT"):
    forward._split_count = backward._split_count = lambda n, bn, interp, **k: -(-n // bn)
  sms = C.device_info().num_sms
  print(jax.devices()[0].device_kind, sms, flush=True)
  warm = jnp.ones((1 << 28,), jnp.float32)
  t0 = time.time()
  while time.time() - t0 < 3:
    jax.block_until_ready(warm * 2)
  return sms


def ab_first_call(cfg_text, fn, *args):
  """For the A/B scripts: the first (tracing) call of ``fn``. A config ending in
  "@nocg" is traced with the x/dy loads' cache modifier off (kernels/_compat.py); one
  ending in "@cgall" with every x/dy load ".cg", its L1 eviction policy dropped."""
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


def ab_report(tag, fns, ins, rounds, nbytes_moved):
  """For the A/B scripts: time each of ``fns`` ({name: (fn, checks text)}) over the
  rotated ``ins``, ``rounds`` rounds of 10 calls interleaved over the configs, and print
  a line each: the median of the rounds, GB/s on ``nbytes_moved`` and every round."""
  res = {c: [] for c in fns}
  for _ in range(rounds):
    for c, (fn, _) in fns.items():
      res[c].append(_time(fn, ins, 10))
  for c, (_, checks) in fns.items():
    med = np.median(res[c])
    print(f"{tag} {c:26s} {med:7.1f}us {nbytes_moved / med / 1e3:6.0f}GB/s "
          f"rounds {[round(t, 1) for t in res[c]]} {checks}", flush=True)


def _tiles(m, bn, sizes):
  """Row-block sizes block_m giving tiles of ``sizes`` elements (block_m <= M)."""
  return sorted({max(1, t // bn) for t in sizes if max(1, t // bn) <= C.next_power_of_2(m)})


def _warps(tile):
  # 8 to 64 elements a thread (tokamax uses <= 4 warps, i.e. many elements a thread)
  return sorted({max(1, min(32, tile // d)) for d in (2048, 1024, 512, 256)})


def _fwd_candidates(m, n, num_sms):
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


def _bwd_candidates(m, n, num_sms):
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


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="4096x1024,4096x4096,4096x8192,8192x5120,32768x128,"
                 "16384x16384,4096x65536,1024x262144")
  p.add_argument("--ops", default="rms")
  p.add_argument("--kernels", default="fwd,bwd")
  p.add_argument("--iters", type=int, default=15)
  p.add_argument("--budget-s", type=float, default=500)
  p.add_argument("--out", default="sweep.json")
  args = p.parse_args()
  dev = C.device_info()
  t0 = time.time()
  print(f"device={jax.devices()[0].device_kind} sms={dev.num_sms} jax={jax.__version__}")
  # Warm the GPU up (clocks ramp) before the first timing.
  w = jnp.ones((1 << 28,), jnp.float32)
  while time.time() - t0 < 3:
    jax.block_until_ready(w * 2)
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
    scale = jnp.ones((n,), jnp.bfloat16) * 1.25
    bias = jnp.full((n,), 0.5, jnp.bfloat16)
    for op in args.ops.split(","):
      sm = op == "layer"
      b = bias if sm else None
      stats = [reference.norm(x, scale, b, eps=1e-5, subtract_mean=sm) for x in xs]
      y_ref = stats[0][0].astype(jnp.float32)
      dx_ref = None  # the XLA reference's dx for (xs[0], dys[0]), computed once
      for kern in args.kernels.split(","):
        cands = (_fwd_candidates if kern == "fwd" else _bwd_candidates)(m, n, dev.num_sms)
        best = []
        for cfg in cands:
          if time.time() - t_start > args.budget_s:
            print("budget exhausted", flush=True)
            break
          try:
            if kern == "fwd":
              fn = jax.jit(lambda x, cfg=cfg: forward.norm_forward(
                  x, scale, b, eps=1e-5, scale_offset=0.0, subtract_mean=sm, config=cfg,
                  interpret=False)[0])
              y = fn(xs[0])
              err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref)))
              t = _time(fn, [(x,) for x in xs], args.iters)
              gbs = 2 * nbytes / t / 1e3 if t else None
            else:
              fn = jax.jit(lambda dy, x, mean, rstd, cfg=cfg: backward.norm_backward(
                  dy, x, scale, mean if sm else None, rstd, has_bias=sm, scale_offset=0.0,
                  subtract_mean=sm, config=cfg, interpret=False, scale_dtype=scale.dtype,
                  bias_dtype=bias.dtype))
              if dx_ref is None:
                _, pull = jax.vjp(lambda x: reference.norm(x, scale, b, eps=1e-5,
                                                           subtract_mean=sm)[0], xs[0])
                dx_ref = pull(dys[0])[0].astype(jnp.float32)
              dx = fn(dys[0], xs[0], stats[0][1], stats[0][2])[0]
              err = float(jnp.max(jnp.abs(dx.astype(jnp.float32) - dx_ref)))
              t = _time(fn, [(dy, x, s[1], s[2]) for dy, x, s in zip(dys, xs, stats)],
                        args.iters)
              gbs = 3 * nbytes / t / 1e3 if t else None
          except Exception as e:  # a config the compiler rejects is a data point
            print(f"  {op} {shape} {kern} {cfg} ERROR {type(e).__name__}: {str(e)[:200]}",
                  flush=True)
            continue
          row = dict(op=op, shape=shape, kernel=kern, us=t, gbs=gbs, max_err=err,
                     config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
          rows.append(row)
          best.append(row)
        best.sort(key=lambda r: r["us"] or 1e30)
        if best and best[0]["us"] and kern == "bwd":
          from jax.experimental.mosaic.gpu import profiler
          cfg = C.BackwardConfig(**best[0]["config"])
          fn = jax.jit(lambda dy, x, mean, rstd: backward.norm_backward(
              dy, x, scale, mean if sm else None, rstd, has_bias=sm, scale_offset=0.0,
              subtract_mean=sm, config=cfg, interpret=False, scale_dtype=scale.dtype,
              bias_dtype=bias.dtype))
          _, ks = profiler.measure(fn, aggregate=False)(dys[1], xs[1], stats[1][1],
                                                        stats[1][2])
          print("  breakdown:", [(k[:40], round(t * 1e3, 1)) for k, t in ks or []])
        for r in best[:4]:
          print(f"{op} {shape} {kern} {r['us']:8.1f}us {r['gbs']:6.0f}GB/s err={r['max_err']:.2g} "
                f"{r['config']}", flush=True)
      with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f)


if __name__ == "__main__":
  main()
