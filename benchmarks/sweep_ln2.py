"""Re-sweep after commit 9a791b9 (late scale/bias loads): LayerNorm forward tiles and
the narrow-row (32768 x 128) backward, through benchmarks/sweep.py's timing (GPU).

  python benchmarks/sweep_ln2.py OUT.json fwd   # LayerNorm forward candidates
  python benchmarks/sweep_ln2.py OUT.json bwd   # 32768 x 128 backward, RMSNorm and LayerNorm
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/sweep.py
import sweep
from pallas_norm import config as C
def fwd(m, n, sms):
  bn_full = C.next_power_of_2(n)
  out = []
  if bn_full <= 8192:
    for bm in (1, 2, 4, 8, 16, 32, 64):
      tile = bm * bn_full
      if bm > m or tile < 1024 or tile > 32768: continue
      for nw in (1, 2, 4, 8, 16):
        if tile // (nw * 32) > 128 or tile // (nw * 32) < 4: continue
        out.append(C.ForwardConfig("multi_wave_cached", bm, bn_full, nw))
  else:
    for bn, nw, g in itertools.product((8192, 16384, 32768), (16, 32), (sms, 2 * sms, 4 * sms)):
      out.append(C.ForwardConfig("static_persistent", 1, bn, nw, g))
    for bn, nw in itertools.product((4096, 8192), (8, 16)):
      out.append(C.ForwardConfig("multi_wave_reload", 1, bn, nw))
  return out
def bwd(m, n, sms):
  out = []
  bn = C.next_power_of_2(n)
  for bm, nw, g in itertools.product((8, 16, 32, 64, 128), (2, 4, 8), (sms, 2 * sms, 4 * sms)):
    out.append(C.BackwardConfig(block_m=bm, block_n=bn, num_warps=nw, num_programs=g, **C.reduce_config(n, g)))
  return out
sweep._fwd_candidates = fwd
sweep._bwd_candidates = bwd
which = sys.argv[2]
if which == "fwd":
  sys.argv = ["sweep", "--shapes", "4096x8192,8192x5120,8192x8192,8192x2048,8192x4096,4096x4096,4096x1024,32768x128,1024x262144", "--ops", "layer", "--kernels", "fwd", "--iters", "10", "--budget-s", "260", "--out", sys.argv[1]]
else:
  sys.argv = ["sweep", "--shapes", "32768x128", "--ops", "rms,layer", "--kernels", "bwd", "--iters", "10", "--budget-s", "120", "--out", sys.argv[1]]
sweep.main()
