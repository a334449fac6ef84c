"""Sweep of the split-row multi_wave_cached forward (rows over cdiv(N, block_n) programs).

Times the default config of each shape next to split configs (block_n 8192 at 4, 8
and 16 warps; 16384 at 8 and 16), with benchmarks/sweep.py's method (CUPTI, rotated
inputs, median of --iters). The measurement behind config.py's _SPLIT_* thresholds:

  python benchmarks/sweep_split.py OUT.json SHAPES {rms|layer}
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402

from pallas_norm import config as C  # noqa: E402

out, shapes, op = sys.argv[1:4]


def _fwd(m, n, sms):
  cands = [C.forward_config(m, n, None, subtract_mean=op == "layer")]
  for bn, nw in ((8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16)):
    if bn < n and -(-n // bn) <= sms:
      cands.append(C.ForwardConfig("multi_wave_cached", 1, bn, nw))
  return cands


sweep._fwd_candidates = _fwd
sys.argv = ["sweep", "--shapes", shapes, "--ops", op, "--kernels", "fwd", "--iters", "10",
            "--budget-s", "100", "--out", out]
sweep.main()
