"""G sweep of the narrow backward (32768 x 128): stage 1 + 2 at [16, 128] tiles, 2 warps,
G in (528, 512, 384, 264, 256, 128), twice each; benchmarks/sweep.py's method.

  python benchmarks/sweep_narrow_bwd_programs.py OUT.json rms|layer
"""
import os, sys
sys.path.insert(0, "benchmarks")
import sweep
from pallas_norm import config as C
out, ops = sys.argv[1:3]
def _bwd(m, n, sms):
  d = C.backward_config(m, n, None, subtract_mean=(ops == "layer"))
  cands = []
  for rep in range(2):
    for g in (528, 512, 384, 264, 256, 128):
      cands.append(C.BackwardConfig(block_m=d.block_m, block_n=d.block_n, num_warps=d.num_warps,
                                    num_programs=g, **C.reduce_config(n, g)))
  return cands
sweep._bwd_candidates = _bwd
sys.argv = ["sweep", "--shapes", "32768x128", "--ops", ops, "--kernels", "bwd", "--iters", "30",
            "--budget-s", "100", "--out", out]
sweep.main()
