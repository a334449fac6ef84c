"""A/B of the FP8 dense layer's op (``flax_layers.fp8.norm_dense_fp8``, delayed scaling,
forward + backward) before and after it kept x's row dims (2026-11-27: no reshape of x to
[M, N]; the transposed copy y_t as [N, *lead]; the weight-gradient GEMM contracting the
row dims), on 2-D x [8192, 4096] and 3-D x [4, 2048, 4096] (F = 4096), RMSNorm and
LayerNorm, bf16.

OLD_PY is the module before the change (``git show db698c8:flax_layers/fp8.py``), loaded
beside the current one; both call today's ``pallas_norm.fp8`` (the old one through the
public ``rms_norm_fp8`` / ``layer_norm_fp8``, whose y_t is [N, M]).

Method: CUPTI kernel time (``pallas_norm.bench.timing.cupti_time``), median of 10 calls
over 3 rotated inputs, the variants interleaved in each of 5 rounds, the median of the
rounds; each kernel's median beside it. Also: the compiled program's GEMM calls
(``gemm_calls_in``) and its top-level transpose/copy fusions, and the outputs (out, dx,
dkernel, dscale) compared with the old variant's.

Usage (GPU machine, from benchmarks/): python fp8_dense_rank_ab.py OLD_PY OUT.json
"""
import importlib.util
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import _fp8_sweep
from flax_layers import fp8 as new_fp8
from pallas_norm import config as C
from pallas_norm.bench import timing

SHAPES = [(8192, 4096), (4, 2048, 4096)]
F = 4096


def load(path):
  spec = importlib.util.spec_from_file_location("old_fp8", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["old_fp8"] = mod  # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


def transposes(hlo):
  return sum(1 for line in hlo.splitlines()
             if re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]*(transpose|copy)[\w.\-]*\s*=", line))


def main(old_py, out_path):
  old_fp8 = load(old_py)
  print("device", C.device_info().name, flush=True)
  results = []
  for shape in SHAPES:
    n = shape[-1]
    for subtract_mean in (False, True):
      k = jax.random.split(jax.random.key(0), 6)
      xs = [jax.random.normal(jax.random.key(10 + i), shape, jnp.bfloat16) for i in range(3)]
      kernel = 0.02 * jax.random.normal(k[1], (n, F))
      scale = 1 + 0.1 * jax.random.normal(k[2], (n,))
      ln_bias = 0.1 * jax.random.normal(k[3], (n,)) if subtract_mean else None
      dout = jax.random.normal(k[4], (*shape[:-1], F), jnp.bfloat16)
      fns, outs, rows, info = {}, {}, {}, {}
      for name, mod in (("old", old_fp8), ("new", new_fp8)):
        state = mod.init_delayed_scaling(16)  # each module's own state class
        state = state._replace(input_amax_history=state.input_amax_history + 12.0,
                               kernel_amax_history=state.kernel_amax_history + 0.1,
                               output_grad_amax_history=state.output_grad_amax_history + 0.01)

        def fwd_bwd(x, mod=mod, state=state):
          f = lambda x, kern, s, b: mod.norm_dense_fp8(
              x, kern, s, b, None, subtract_mean=subtract_mean, eps=1e-6, state=state)
          out, pull = jax.vjp(f, x, kernel, scale, ln_bias)
          return (out,) + pull(dout)
        jitted = jax.jit(fwd_bwd)
        hlo = jitted.lower(xs[0]).compile().as_text()
        info[name] = {"gemms": dict(new_fp8.gemm_calls_in(hlo)),
                      "transpose_or_copy": transposes(hlo)}
        fns[name] = jitted
        outs[name] = jax.block_until_ready(jitted(xs[0]))
        rows[name] = {}
      _fp8_sweep.time_rounds(fns, rows, [(x,) for x in xs], rounds=5, iters=10)
      diffs = {}
      for i, nm in enumerate(("out", "dx", "dkernel", "dscale", "dln_bias")):  # vjp order
        a, b = outs["old"][i], outs["new"][i]
        if a is None:
          continue
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        diffs[nm] = {"bitwise": bool(np.array_equal(a, b)),
                     "max_abs": float(np.max(np.abs(a - b))),
                     "max_ref": float(np.max(np.abs(a)))}
      r = {"shape": list(shape), "f": F, "op": "layer" if subtract_mean else "rms",
           "old_us": rows["old"]["us"], "new_us": rows["new"]["us"],
           "old_kernel_us": rows["old"]["kernel_us"], "new_kernel_us": rows["new"]["kernel_us"],
           "old_rounds": rows["old"]["rounds"], "new_rounds": rows["new"]["rounds"],
           "info": info, "diffs": diffs}
      results.append(r)
      print(f"{r['op']:5s} {'x'.join(map(str, shape)):14s} old {r['old_us']:8.1f} us  "
            f"new {r['new_us']:8.1f} us  new/old {r['new_us'] / r['old_us']:.3f}  "
            f"gemms old {info['old']['gemms']} new {info['new']['gemms']}  "
            f"transpose/copy old {info['old']['transpose_or_copy']} new "
            f"{info['new']['transpose_or_copy']}  bitwise "
            f"{ {k: v['bitwise'] for k, v in diffs.items()} }", flush=True)
  meta = {"device": C.device_info().name, "jax": jax.__version__,
          "commit": timing.git_commit(), "method": __doc__}
  json.dump({"meta": meta, "results": results}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
