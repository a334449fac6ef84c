"""tokamax's forward+backward with and without its VJP's dx-onto-x alias (the A/B behind
bench.py's tokamax call). GPU only.

  python benchmarks/tokamax_vjp_alias.py hlo    # copies and custom calls in each step
  python benchmarks/tokamax_vjp_alias.py cupti  # CUPTI kernel time, as in pallas_norm.bench

The step is bench.py's: jax.jit of jax.vjp of the op on x, then the pullback of dy,
returning y and the grads. "tokamax_alias" is what bench.py timed before: the forward
without its y-onto-x alias, the VJP as tokamax ships it (dx written over x). "tokamax"
is bench.py's tokamax now: the VJP without that alias (bench.tokamax_vjp_without_alias).
Output: ``benchmarks/results/<device>_<date>_tokamax_vjp_alias.txt``.
"""
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "cupti"
if MODE == "cupti":
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from absl import flags  # pylint: disable=wrong-import-position

flags.FLAGS(sys.argv[:1])  # tokamax reads absl flags
from tokamax._src.ops.normalization import pallas_triton  # pylint: disable=wrong-import-position

import pallas_norm  # pylint: disable=wrong-import-position
from pallas_norm import bench  # pylint: disable=wrong-import-position

EPS = 1e-6
ALIAS = pallas_triton.PallasTritonNormalization(input_output_alias=False)
NOALIAS = pallas_triton.PallasTritonNormalization(input_output_alias=False,
                                                  vjp=bench.tokamax_vjp_without_alias())


def impls(layer):
  return {
      "pallas": (lambda x, s, b: pallas_norm.layer_norm(x, s, b, eps=EPS)) if layer
                else (lambda x, s, b: pallas_norm.rms_norm(x, s, eps=EPS)),
      "tokamax_alias": lambda x, s, b: ALIAS(x=x, scale=s, offset=b, epsilon=EPS,
                                             subtract_mean=layer),
      "tokamax": lambda x, s, b: NOALIAS(x=x, scale=s, offset=b, epsilon=EPS,
                                         subtract_mean=layer),
  }


def step(f):
  return jax.jit(bench._fwdbwd(f))  # pylint: disable=protected-access


def main():
  print(jax.devices()[0].device_kind, jax.__version__, bench._version("tokamax"), flush=True)  # pylint: disable=protected-access
  if MODE == "cupti":
    bench._warm_up(2)  # pylint: disable=protected-access
  for layer in (False, True):
    for m, n in [(4096, 1024), (32768, 128), (4096, 4096), (8192, 5120)]:
      r = max(2, -(-4 * 64 * 2**20 // (m * n * 2)))
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
        st = step(f)
        if MODE == "hlo":
          if name.startswith("tokamax"):
            txt = st.lower(xs[0], s, b, dys[0]).compile().as_text()
            ops = [l.split("=")[1].split("(")[0].strip() for l in txt.splitlines()
                   if " = " in l and (" copy(" in l or "custom-call" in l)]
            print(op, m, n, name, ops, flush=True)
          continue
        outs[name] = st(xs[0], s, b, dys[0])
        t = bench._cupti_time(st, [(x, s, b, dy) for x, dy in zip(xs, dys)], 30)  # pylint: disable=protected-access
        ks = " ".join(f"{k}={u:.2f}" for k, u in zip(t.get("kernels", []), t.get("kernel_us", [])))
        line.append(f"{name} {t['us']:.2f}us {5 * m * n * 2 / t['us'] / 1e3:.0f}GB/s [{ks}]")
      if outs:  # the two tokamax variants compute the same numbers
        same = all(bool(jnp.array_equal(a, c)) for a, c in
                   zip(jax.tree.leaves(outs["tokamax_alias"]), jax.tree.leaves(outs["tokamax"])))
        print(MODE, op, m, n, f"identical={same}", " | ".join(line), flush=True)


if __name__ == "__main__":
  main()
