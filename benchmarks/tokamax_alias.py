"""tokamax's forward with and without its y-onto-x alias (H200 A/B behind bench.py's
tokamax call). GPU only.

  python benchmarks/tokamax_alias.py hlo    # the ops in each compiled step
  python benchmarks/tokamax_alias.py cupti  # CUPTI kernel time, as in pallas_norm.bench

Output: ``benchmarks/results/h200_2026-11-21_tokamax_alias.txt``.
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
import tokamax  # pylint: disable=wrong-import-position
from tokamax._src.ops.normalization import pallas_triton  # pylint: disable=wrong-import-position

import pallas_norm  # pylint: disable=wrong-import-position
from pallas_norm import bench, reference  # pylint: disable=wrong-import-position

NOALIAS = pallas_triton.PallasTritonNormalization(input_output_alias=False)
IMPLS = {
    "pallas": lambda x, s: pallas_norm.rms_norm(x, s, eps=1e-6),
    "triton": lambda x, s: pallas_norm.rms_norm(x, s, eps=1e-6, backend="triton"),
    "tokamax": lambda x, s: tokamax.layer_norm(x, s, None, epsilon=1e-6, subtract_mean=False,
                                               implementation="triton"),
    "tokamax_noalias": lambda x, s: NOALIAS(x, s, None, epsilon=1e-6, subtract_mean=False),
    "xla": lambda x, s: reference.norm(x, s, None, eps=1e-6, subtract_mean=False)[0],
}


def main():
  if MODE == "cupti":
    bench._warm_up(2)  # pylint: disable=protected-access
  for m, n in [(4096, 1024), (32768, 128), (4096, 4096), (8192, 5120)]:
    r = max(2, -(-4 * 64 * 2**20 // (m * n * 2)))
    key = jax.random.key(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, n), jnp.bfloat16) for i in range(r)]
    s = jnp.full((n,), 1.1, jnp.bfloat16)
    line = []
    for name, f in IMPLS.items():
      if MODE == "hlo":
        if name.startswith("tokamax"):
          txt = jax.jit(f).lower(xs[0], s).compile().as_text()
          ops = [l.split("=")[1].split("(")[0].strip() for l in txt.splitlines()
                 if " = " in l and ("copy" in l or "custom-call" in l)]
          print(m, n, name, ops)
        continue
      t = bench._cupti_time(jax.jit(f), [(x, s) for x in xs], 30)  # pylint: disable=protected-access
      line.append(f"{name} {t['us']:.2f}us {2 * m * n * 2 / t['us'] / 1e3:.0f}GB/s "
                  f"{t.get('kernels')}")
    if line:
      print(MODE, m, n, " | ".join(line), flush=True)


if __name__ == "__main__":
  main()
