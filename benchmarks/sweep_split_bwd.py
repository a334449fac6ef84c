"""Sweep of the split-row backward (each row over cdiv(N, block_n) programs).

Times, per shape and op, the default BackwardConfig, the row-statistics + column-tiled
pair, the reload-row kernel (rows <= 32768), and split-row configs: 2048-wide splits at
4 warps with 2, 3 or 4 programs a SM and row blocks published 0-3 ahead of their dx
(``split_lag``), and 2048 at 8 warps, 4096 at 4 and 8 warps, all at lag 2. Method:
benchmarks/sweep.py's (CUPTI kernel time of stage 1 + 2, rotated inputs, median of
--iters, dx checked against the XLA reference). The measurement behind config.py's
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
  cands = [C.backward_config(m, n, None),  # RMSNorm's and LayerNorm's differ only in
           C.backward_config(m, n, None, subtract_mean=True)]  # the reload's tile
  g = max(1, 2 * sms // C.cdiv(n, 4096))
  cands.append(C.BackwardConfig(block_m=1, block_n=4096, num_warps=16, num_programs=g,
                                **C.reduce_config(n, g)))  # the pair
  if C.next_power_of_2(n) <= 32768:
    cands.append(C.BackwardConfig(block_m=1, block_n=4096, num_warps=16, num_programs=sms,
                                  reload_rows=True, **C.reduce_config(n, sms)))

  def split(bn, nw, occ, lag):
    g = max(1, min(m, occ * sms // C.cdiv(n, bn)))
    return C.BackwardConfig(block_m=1, block_n=bn, num_warps=nw, num_programs=g,
                            split_rows=True, split_lag=lag, **C.reduce_config(n, g))

  for occ in (2, 3, 4):
    for lag in (1, 2, 3):
      cands.append(split(2048, 4, occ, lag))
  cands += [split(2048, 4, 4, 0), split(2048, 8, 4, 2), split(4096, 4, 2, 2),
            split(4096, 8, 2, 2)]
  return [c for i, c in enumerate(cands) if c not in cands[:i]
          and (not c.split_rows or C.cdiv(n, c.block_n) <= sms)]


sweep._bwd_candidates = _bwd
sys.argv = ["sweep", "--shapes", shapes, "--ops", ops, "--kernels", "bwd", "--iters", "10",
            "--budget-s", budget_s, "--out", out]
sweep.main()
