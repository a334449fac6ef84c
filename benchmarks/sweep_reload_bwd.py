"""Sweep of the reload backward (one program walks whole rows, partials in registers).

Times the default BackwardConfig of each shape, the row-statistics + column-tiled pair
and the split-row kernel next to reload-row configs. RELOAD_GRID=wide (the default):
block_n 2048 / 4096 / 8192, block_m 1 / 2, 8 / 16 / 32 warps, G = 1 or 2 programs a
SM; RELOAD_GRID=stages: block_m 2 / 4 at six (block_n, warps) pairs and num_stages
1 / 2 / 3 (Triton's software pipeliner over the row-block loop), G = SMs. With benchmarks/sweep.py's
method (CUPTI, rotated inputs, median of --iters, dx checked against the XLA
reference). The measurement behind config.py's _BWD_RELOAD_* thresholds:

  python benchmarks/sweep_reload_bwd.py OUT.json SHAPES {rms|layer|rms,layer} [BUDGET_S]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402

from pallas_norm import config as C  # noqa: E402

out, shapes, ops = sys.argv[1:4]
budget_s = sys.argv[4] if len(sys.argv) > 4 else "420"


def _bwd(m, n, sms):
  def cfg(bm, bn, nw, g, **kw):
    return C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g,
                            **kw, **C.reduce_config(n, g))

  cands = [C.backward_config(m, n, None),  # RMSNorm's default (the split-row kernel)
           C.backward_config(m, n, None, subtract_mean=True)]  # the pair
  grid = os.environ.get("RELOAD_GRID", "wide")
  if grid == "wide":  # the first sweep: tile shapes and programs a SM
    for bn in (2048, 4096, 8192):
      if bn >= n:
        continue
      for nw in (8, 16, 32):
        if n // (32 * nw) > 64:  # more than 64 partial registers a thread
          continue
        for bm in (1, 2):
          for occ in ((1,) if nw == 32 else (1, 2)):  # 2 x 32 warps: the thread limit
            cands.append(cfg(bm, bn, nw, occ * sms, reload_rows=True))
  else:  # the second: row blocks of 2 and 4 and Triton's pipeliner (num_stages)
    tiles = [(bm, bn, nw) for bm in (2, 4) for bn, nw in
             ((2048, 8), (4096, 8), (4096, 16), (8192, 32), (2048, 16), (8192, 8))]
    for bm, bn, nw in tiles:
      if bn >= n or n // (32 * nw) > 64:
        continue
      for st in (1, 2, 3):
        cands.append(cfg(bm, bn, nw, sms, num_stages=st, reload_rows=True))
  return cands


sweep._bwd_candidates = _bwd
sys.argv = ["sweep", "--shapes", shapes, "--ops", ops, "--kernels", "bwd", "--iters", "10",
            "--budget-s", budget_s, "--out", out]
sweep.main()
