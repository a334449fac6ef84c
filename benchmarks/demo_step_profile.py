"""Where `make demo`'s train step spends its time on a GPU, pallas_norm against flax.

The demo's tiny model (d_model 64, rows of 64) runs pallas_norm's step at about 0.44x
flax's steps/s on an H200 (docs/demo.md, 2026-11-21). This takes the demo's own model,
optimizer and jitted train step (``demo._make_steps``) for both norms and reports:

1. wall clock: steps/s of 200 back-to-back steps, the variants alternated over 3
   rounds (as the demo's loop, without its progress bar), and with a host sync after
   every step (device-bound time + dispatch);
2. a ``jax.profiler`` trace of 20 steps each: kernels a step, their summed duration
   (the device's busy time), the span from the first activity's start to the last one's
   end divided by the steps, and the kernels that take most of the time;
   pallas_norm's kernels (their names carry the Pallas kernel names) apart.

Usage (GPU): python benchmarks/demo_step_profile.py OUT.json
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pallas_norm
from pallas_norm import config as C
from pallas_norm import demo

STEPS, ROUNDS, TRACE_STEPS = int(os.environ.get("STEPS", 200)), 3, 20


def _setup(norm, cfg, vocab, batches):
  model = demo.CharTransformer(vocab, cfg.d_model, cfg.layers, cfg.heads, norm,
                               rngs=nnx.Rngs(cfg.seed))
  opt = nnx.Optimizer(model, optax.adamw(cfg.learning_rate, weight_decay=0.01),
                      wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  step, _ = demo._make_steps(graphdef)
  state, loss = step(state, *batches[0])  # compile
  loss.block_until_ready()
  return step, state


def _wall(step, state, batches, sync_each: bool):
  t0 = time.perf_counter()
  for i in range(STEPS):
    state, loss = step(state, *batches[i % len(batches)])
    if sync_each:
      loss.block_until_ready()
  loss.block_until_ready()
  return state, (time.perf_counter() - t0) / STEPS


def _trace(step, state, batches):
  d = tempfile.mkdtemp()
  jax.profiler.start_trace(d)
  for i in range(TRACE_STEPS):
    state, loss = step(state, *batches[i % len(batches)])
  loss.block_until_ready()
  jax.profiler.stop_trace()
  data = jax.profiler.ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  return state, events


def _summary(events):
  if not events:  # no GPU plane (a CPU run of this script)
    return {"activities_per_step": 0, "busy_us_per_step": 0, "span_us_per_step": 0,
            "top": [], "norm_named_us_per_step": 0, "norm_named": []}
  busy = sum(d for _, _, d in events)
  span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
  by_name = collections.Counter()
  for n, _, d in events:
    by_name[n] += d
  ours = {n: v for n, v in by_name.items()
          if any(k in n for k in ("norm", "stage", "reduce_partials", "_fwd", "_bwd"))}
  return {
      "activities_per_step": len(events) / TRACE_STEPS,
      "busy_us_per_step": busy / TRACE_STEPS / 1e3,
      "span_us_per_step": span / TRACE_STEPS / 1e3,
      "top": [(n[:80], round(v / TRACE_STEPS / 1e3, 2)) for n, v in by_name.most_common(12)],
      "norm_named_us_per_step": round(sum(ours.values()) / TRACE_STEPS / 1e3, 2),
      "norm_named": sorted(((n[:80], round(v / TRACE_STEPS / 1e3, 2)) for n, v in ours.items()),
                           key=lambda t: -t[1]),
  }


def main(out_path):
  cfg = demo.DemoConfig()
  text = demo.load_text(None)
  chars = sorted(set(text))
  lut = {c: i for i, c in enumerate(chars)}
  data = np.fromiter((lut[c] for c in text), np.int32, len(text))
  rng = np.random.default_rng(cfg.seed)
  starts = rng.integers(0, len(data) - cfg.seq - 1, size=(16, cfg.batch))
  batches = [tuple(jax.device_put(a) for a in demo._windows(data, s, cfg.seq))
             for s in starts]
  dev = C.device_info()
  print(f"device {dev.name}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"jax {jax.__version__}; demo defaults d_model={cfg.d_model} layers={cfg.layers} "
        f"batch={cfg.batch} seq={cfg.seq}", flush=True)
  variants = {"pallas_norm.RMSNorm": pallas_norm.RMSNorm, "flax.nnx.RMSNorm": nnx.RMSNorm}
  runs = {k: _setup(v, cfg, len(chars), batches) for k, v in variants.items()}
  wall = collections.defaultdict(list)
  for _ in range(ROUNDS):
    for k, (step, state) in runs.items():
      for sync in (False, True):
        state, t = _wall(step, state, batches, sync)
        wall[(k, sync)].append(t)
      runs[k] = (step, state)
  out = {"device": dev.name, "jax": jax.__version__, "steps": STEPS, "rounds": ROUNDS,
         "variants": {}}
  for k, (step, state) in runs.items():
    _, events = _trace(step, state, batches)
    s = _summary(events)
    s["wall_us_async"] = [round(t * 1e6, 1) for t in wall[(k, False)]]
    s["wall_us_synced"] = [round(t * 1e6, 1) for t in wall[(k, True)]]
    out["variants"][k] = s
    print(f"\n{k}: wall {np.median(wall[(k, False)]) * 1e6:.1f} us a step back to back "
          f"({1 / np.median(wall[(k, False)]):.0f} steps/s), "
          f"{np.median(wall[(k, True)]) * 1e6:.1f} us synced each step; trace: "
          f"{s['activities_per_step']:.0f} activities a step, busy {s['busy_us_per_step']:.1f} us, "
          f"span {s['span_us_per_step']:.1f} us; norm-named kernels "
          f"{s['norm_named_us_per_step']} us")
    for n, v in s["top"]:
      print(f"  {v:8.2f} us  {n}")
    for n, v in s["norm_named"][:8]:
      print(f"  norm {v:8.2f} us  {n}")
  with open(out_path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main(sys.argv[1])
