"""The kernel bench (``python -m pallas_norm.bench``) with the experiment switch
``kernels.forward.PARAMS_2D`` (the one-tile forwards' scale/bias loaded as
[1, block_n] rows, multi_wave_cached and static_persistent; e05a7b5, removed in the next
commit: run the script there) set or not, so that one bench run
each gives the switch's A/B. Usage (GPU): python benchmarks/params_2d_bench.py on|off
BENCH_ARGS..."""
import sys
from pallas_norm.kernels import forward as F

F.PARAMS_2D = sys.argv[1] == "on"
from pallas_norm.bench import cli  # noqa: E402

sys.exit(cli.main(sys.argv[2:]))
