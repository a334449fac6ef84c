"""Sweep of the split-row backward (each row over cdiv(N, block_n) programs).

Times the default BackwardConfig of each shape next to split-row configs (block_n 2048
and 4096 at 4 warps, 4096 and 8192 at 8, 8192 at 16; G = 1, 2 or 4 programs a SM over
the splits; num_stages 2 (next row block prefetched) or 3 (and dx deferred a row block)) and, for rows <= 16384, the single-tile kernel
at 16 and 32 warps, with benchmarks/sweep.py's method (CUPTI, rotated inputs, median
of --iters, dx checked against the XLA reference). The measurement behind config.py's
_BWD_SPLIT_* thresholds:

  python benchmarks/sweep_split_bwd.py OUT.json SHAPES {rms|layer|rms,layer} [BUDGET_S]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402

from pallas_norm import config as C  # noqa: E402

out, shapes, ops = sys.argv[1:4]
budget_s = sys.argv[4] if len(sys.argv) > 4 else "420"


def _bwd(m, n, sms):
  # The row-statistics + column-tiled pair (LayerNorm's default; RMSNorm's before).
  cands = [C.backward_config(m, n, None, subtract_mean=True)]

  def cfg(bm, bn, nw, g, st, split):
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            num_stages=st, split_rows=split, **C.reduce_config(n, g))

  if C.next_power_of_2(n) <= 16384:
    for nw in (16, 32):
      cands.append(cfg(1, C.next_power_of_2(n), nw, sms, 1, False))
  for bn, nw in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
    k = C.cdiv(n, bn)
    if bn >= n or k > sms:
      continue
    for occ in (1, 2, 4):
      for st in (2, 3):
        cands.append(cfg(1, bn, nw, max(1, occ * sms // k), st, True))
  return cands


sweep._bwd_candidates = _bwd
sys.argv = ["sweep", "--shapes", shapes, "--ops", ops, "--kernels", "bwd", "--iters", "10",
            "--budget-s", budget_s, "--out", out]
sweep.main()
