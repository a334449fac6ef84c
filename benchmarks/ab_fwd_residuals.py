"""A/B of the plain forward with and without writing mean/rstd (GPU).

  python benchmarks/ab_fwd_residuals.py

For each op and shape: the public op under jax.jit ("public"), the forward launcher with
return_residuals=False ("kernel_nores") and with True ("kernel_res"), all at the default
launch config. Method: benchmarks/sweep.py's CUPTI kernel time over rotated bf16 inputs
(>= 256 MiB), median of 10 calls a round, 5 rounds interleaved. Its finding
(results/h200_2026-11-22_fwd_residuals.txt): on small shapes the same kernel's time
depends on which outputs the jitted function returns, so a difference between
"kernel_nores" and "kernel_res" there is not the kernel's.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (sets XLA_FLAGS before jax starts a backend)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_norm  # noqa: E402
from pallas_norm import config as C  # noqa: E402
from pallas_norm.kernels import forward  # noqa: E402

SHAPES = ((32768, 128), (4096, 1024), (4096, 4096), (8192, 5120), (8192, 8192),
          (16384, 16384), (4096, 65536))


def main():
  sweep.ab_warm_up()
  for op in ("rms", "layer"):
    sm = op == "layer"
    for m, n in SHAPES:
      key = jax.random.PRNGKey(0)
      reps = max(2, 4 * (64 << 20) // (m * n * 2))
      xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16)
            for i in range(reps)]
      scale = (jnp.ones((n,), jnp.float32) * 1.25).astype(jnp.bfloat16)
      bias = jnp.ones((n,), jnp.bfloat16) * 0.5 if sm else None
      cfg = C.forward_config(m, n, jnp.bfloat16, subtract_mean=sm)

      def launch(x, res, cfg=cfg, scale=scale, bias=bias, sm=sm):
        return forward.norm_forward(x, scale, bias, eps=1e-6, scale_offset=0.0,
                                    subtract_mean=sm, config=cfg, interpret=False,
                                    return_residuals=res)

      public = (lambda x, scale=scale, bias=bias: pallas_norm.layer_norm(x, scale, bias)
                if sm else pallas_norm.rms_norm(x, scale))
      fns = {"public": (jax.jit(public), ""),
             "kernel_nores": (jax.jit(lambda x: launch(x, False)[0]), ""),
             "kernel_res": (jax.jit(lambda x: launch(x, True)), "")}
      for f, _ in fns.values():
        jax.block_until_ready(f(xs[0]))
      sweep.ab_report(f"fwd {op} {m}x{n}", fns, [(x,) for x in xs], 5, 2 * m * n * 2)


if __name__ == "__main__":
  main()
