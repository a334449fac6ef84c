"""A/B of the FP8 dense layer's empty-history rule (``flax_layers.fp8._EMPTY_HISTORY_CURRENT``,
2026-11-27): does the ``lax.cond`` on each amax history cost the delayed train step
anything once the histories are filled?

The train step of ``python -m pallas_norm.bench --e2e --fp8-dense`` (config ``d4096``
unless CONFIG is given: 4 blocks h = h + dense(norm(h)), x [8192, 4096] bf16, a jitted
adamw step that writes the Fp8Meta state back), variant "fp8" (RMSNormDenseFP8, delayed
scaling), compiled twice: with the rule (three lax.cond a layer) and without (flax's scale
1 on an empty history, no cond); flax's bf16 pair beside them. Every variant is warmed up
for WARMUP steps (the histories fill), then timed in ROUNDS interleaved rounds of STEPS
samples, each sample CHAIN steps dispatched back to back, wall clock after
block_until_ready (the e2e bench's ``_time_round``). Prints each variant's median step
time and its ratio to flax's, paired by round; the compiled programs' conditional count.

Usage (GPU machine, repository root): python benchmarks/fp8_dense_empty_history_ab.py OUT.json
"""
import json
import os
import sys

import jax
import numpy as np

from flax_layers import fp8
from pallas_norm.bench import e2e, timing

CONFIG, WARMUP, ROUNDS, STEPS, CHAIN = "d4096", 8, 7, 8, 4
MODES = ("none", "cond", "cond_grad", "where_grad")  # fp8._EMPTY_HISTORY


def compiled_step(cfg, variant, rule, tokens):
  fp8._EMPTY_HISTORY = rule
  _, dstep, params, opt_state = e2e.build(cfg, variant, 0)
  compiled = dstep.lower(params, opt_state, tokens).compile()  # traced under `rule`
  conds = compiled.as_text().count(" conditional(")
  return compiled, (params, opt_state), conds


def main(out):
  cfg = e2e.FP8_DENSE_CONFIGS[CONFIG]
  tokens = jax.random.normal(jax.random.key(0), (cfg.batch * cfg.seq, cfg.d), jax.numpy.bfloat16)
  variants = {"flax": ("flax", "none"), **{f"fp8_{m}": ("fp8", m) for m in MODES}}
  live, meta = {}, {"device": timing.device_meta(False), "config": cfg.name,
                    "commit": os.environ.get("PALLAS_NORM_GIT_COMMIT", "unknown"),
                    "method": f"wall clock, {ROUNDS} interleaved rounds x {STEPS} samples "
                              f"x {CHAIN} chained steps, after {WARMUP} warm-up steps"}
  for name, (variant, rule) in variants.items():
    step, state, conds = compiled_step(cfg, variant, rule, tokens)
    _, state, loss = e2e._time_round(step, state, tokens, WARMUP, 1)
    live[name] = [step, state]
    meta[f"{name}_conditionals"] = conds
    print(f"{name}: {conds} conditionals in the compiled step, loss after warm-up {loss:.6g}",
          flush=True)
  rounds = {k: [] for k in variants}
  for _ in range(ROUNDS):
    for name in variants:
      step, state = live[name]
      ts, live[name][1], _ = e2e._time_round(step, state, tokens, STEPS, CHAIN)
      rounds[name].append(float(np.median(ts)) * 1e3)
  rows = []
  for name in variants:
    ratio = np.asarray(rounds["flax"]) / np.asarray(rounds[name])
    rows.append({"variant": name, "step_ms": float(np.median(rounds[name])),
                 "round_ms": rounds[name], "speedup_vs_flax_paired": float(np.median(ratio))})
    print(f"{name:15s} {rows[-1]['step_ms']:8.3f} ms  {rows[-1]['speedup_vs_flax_paired']:.3f}x "
          f"flax (paired)  rounds {' '.join(f'{t:.2f}' for t in rounds[name])}", flush=True)
  print(f"device: {meta['device']['device']}; commit {meta['commit']}; {meta['method']}")
  with open(out, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
