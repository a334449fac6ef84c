"""The optimized HLO of the e2e bench's FP8 dense step (``--e2e --fp8-dense``, config
d4096) for VARIANT, written to OUT, and its top-level transpose / convert / copy
instructions and fusions printed with their shapes: where XLA transposes and quantises
around the FP8 GEMMs.
Usage: python benchmarks/fp8_dense_hlo.py VARIANT OUT (GPU)."""
import re, sys, jax, jax.numpy as jnp
from pallas_norm.bench import e2e
cfg = e2e.FP8_DENSE_CONFIGS["d4096"]
v = sys.argv[1]
step, _, params, opt_state = e2e.build(cfg, v)
tokens = jax.random.normal(jax.random.key(0), (cfg.batch * cfg.seq, cfg.d), jnp.bfloat16)
hlo = step.lower(params, opt_state, tokens).compile().as_text()
open(sys.argv[2], "w").write(hlo)
# top-level fusions named like the breakdown's "other" kernels, with their shapes
for line in hlo.splitlines():
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+(fusion|transpose|convert|copy|custom-call)\(", line)
  if m and re.search(r"transpose|convert|copy", m.group(1)):
    kind = re.search(r"kind=(\w+)", line)
    calls = re.search(r"calls=%?([\w.\-]+)", line)
    print(m.group(1), m.group(2), kind.group(1) if kind else "", calls.group(1) if calls else "")
