"""The compiled first-order programs of three ops, for comparing two versions of the
library: jax.grad of an RMSNorm loss and of a LayerNorm + residual loss (x [8192, 4096]
bf16), and of the FP8 dense op (x [8192, 4096], kernel [4096, 4096]); the optimized HLO
text with metadata, value names and the debug tables stripped, one file each
(OUT_rms.txt, OUT_ln_res.txt, OUT_dense.txt). Identical files mean identical programs.

Usage: python benchmarks/first_order_hlo.py OUT (run once per version, with PYTHONPATH
pointing at it), then diff the files.
"""
import re
import sys

import jax
import jax.numpy as jnp

import pallas_norm
from flax_layers import fp8

M, N = 8192, 4096


def main(out):
  x = jax.random.normal(jax.random.key(0), (M, N), jnp.bfloat16)
  r = jax.random.normal(jax.random.key(1), (M, N), jnp.bfloat16)
  w, b = jnp.ones(N), jnp.zeros(N)
  k = 0.01 * jax.random.normal(jax.random.key(2), (N, N))
  sq = lambda t: jnp.sum(t.astype(jnp.float32) ** 2)
  fns = {
      "rms": lambda x, w: jax.grad(lambda x, w: sq(pallas_norm.rms_norm(x, w)),
                                   argnums=(0, 1))(x, w),
      "ln_res": lambda x, w: jax.grad(lambda x, w: sum(map(sq, pallas_norm.layer_norm(
          x, w, b, residual=r))), argnums=(0, 1))(x, w),
      "dense": lambda x, w: jax.grad(lambda x, w: sq(fp8.norm_dense_fp8(
          x, k, w, eps=1e-6)), argnums=(0, 1))(x, w),
  }
  for name, f in fns.items():
    text = jax.jit(f).lower(x, w).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%v", text)
    lines = [ln for ln in text.splitlines()
             if not re.match(r"^\d+ ", ln) and "stack_frame" not in ln]
    open(f"{out}_{name}.txt", "w").write("\n".join(lines) + "\n")
    print(name, len(lines), "lines", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
