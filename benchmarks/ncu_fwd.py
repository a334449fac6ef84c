"""RMSNorm forward at M x N (default 8192 x 8192; `python benchmarks/ncu_fwd.py M N`), bf16,
through both backends, each call twice, for ncu.

The metrics behind README's Pallas-against-Triton note
(benchmarks/results/h200_2026-11-21_ncu_fwd_8192sq.csv) came from:

  ncu --clock-control none --target-processes all -k regex:norm --csv --metrics \
    launch__registers_per_thread,launch__grid_size,launch__block_size,\
sm__warps_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,\
smsp__inst_executed.sum,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum \
    python benchmarks/ncu_fwd.py

and the launch statistics (function cache configuration, shared-memory carveout, L1
hit rate; benchmarks/results/h200_2026-11-21_ncu_fwd_launch_{8192sq,16384sq}.csv) from:

  ncu --clock-control none -k regex:norm_fwd -s 1 -c 2 --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section SpeedOfLight \
    -o rep python benchmarks/ncu_fwd.py 16384 16384
  ncu -i rep.ncu-rep --page details --csv
"""
import sys

import jax
import jax.numpy as jnp

import pallas_norm

m, n = (int(v) for v in (sys.argv[1:3] if len(sys.argv) > 2 else (8192, 8192)))
x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
s = jnp.full((n,), 1.1, jnp.bfloat16)
for be in ("pallas", "triton"):
  g = jax.jit(lambda x, s, be=be: pallas_norm.rms_norm(x, s, backend=be))
  for _ in range(2):
    jax.block_until_ready(g(x, s))
  print("ran", be, flush=True)
