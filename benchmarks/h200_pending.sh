#!/usr/bin/env bash
# The H200 measurements that the H100-only rules of 2026-11-26 wait for (no H200 was lent
# from 2026-11-26 on): docs/residual.md ("Not yet": the stage-1 flags on the two LayerNorm +
# residual cells under 85% of copy) and docs/fp8.md#fp8-status (the FP8 rules).
# Usage, on the GPU machine from the repository root, with the wheels of
# ../shared/tools/device-wheels.sh in .whl/ (as `make gpu-check`):
#   bash benchmarks/h200_pending.sh PART OUTDIR [COMMIT]
#   PART: res | res-quick | fp8out | fp8in | fp8in-bench | rules   (res-quick: res's two
#   cells under 85% only, about 4 minutes; rules: every H100-only rule at once, about 7
#   minutes: the kernel bench of the FP8 paths and the LayerNorm + residual cells twice,
#   with the H200's rules and with the H100's, the device named H100 to config.py:
#   whether the H100's rules as a whole should extend to the H200)
# Each part fits one 10-minute device command (each step under `timeout`); on any GPU
# other than an H200 it prints the GPU's name and exits 0 without running anything.
set -u
part=${1:?PART}; out=${2:?OUTDIR}; commit=${3:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu; $(date -u)"
# (H200_PENDING_ANY_GPU=1 runs it anyway: a test of this script on another GPU)
case "$gpu" in *H200*) ;; *) [ "${H200_PENDING_ANY_GPU:-0}" = 1 ] || { echo "not an H200: nothing run"; exit 0; };; esac
mkdir -p "$out"; out=$(cd "$out" && pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pallas_norm_site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/pallas_norm_site:$PWD/.whl/stubs PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_NORM_GIT_COMMIT=$commit
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
d=$(case "$gpu" in *H200*) echo h200;; *H100*) echo h100;; *) echo gpu;; esac)_$(date -u +%F)  # h100_ or gpu_ only in a test
# The kernel bench with config._STAGE1_FLAGS_DEVICES as given (stock: the library's rule).
bench_flags() {  # VARIANT DEVICES OPS SHAPES
  timeout 120 python3 - "$1" "$2" "$3" "$4" "$out/${d}_stage1_flags_$1_$commit.json" <<'PY'
import sys
from pallas_norm import config as C
if sys.argv[2] != "stock":
  C._STAGE1_FLAGS_DEVICES = tuple(sys.argv[2].split(","))
from pallas_norm.bench import cli
sys.exit(cli.main(["--ops", sys.argv[3], "--passes", "fwdbwd", "--shapes", sys.argv[4],
                   "--impls", "pallas", "--iters", "30", "--check", "--out", sys.argv[5]]))
PY
}
case "$part" in
res)
  timeout 200 python3 -m pallas_norm.bench ab bwd --op layer --residual --rounds 5 \
    --shapes 8192x4096,4096x8192,16384x4096,8192x8192,32768x2048 \
    --configs 'default;default@ps;default@js;default@ps@js' | tee "$out/${d}_ab_stage1_flags_ln_res_$commit.txt"
  timeout 130 python3 -m pallas_norm.bench ab bwd --op layer --rounds 5 \
    --shapes 8192x4096,4096x8192,16384x4096,8192x8192 \
    --configs 'default;default@ps;default@js;default@ps@js' | tee "$out/${d}_ab_stage1_flags_ln_$commit.txt"
  bench_flags stock stock layer_res,layer 8192x4096,4096x8192
  bench_flags h100rule H100,H200 layer_res,layer 8192x4096,4096x8192
  ;;
res-quick)
  timeout 100 python3 -m pallas_norm.bench ab bwd --op layer --residual --rounds 5 \
    --shapes 8192x4096,4096x8192 \
    --configs 'default;default@ps;default@js;default@ps@js' | tee "$out/${d}_ab_stage1_flags_ln_res_$commit.txt"
  bench_flags stock stock layer_res 8192x4096,4096x8192
  bench_flags h100rule H100,H200 layer_res 8192x4096,4096x8192
  ;;
fp8out)
  cd benchmarks
  timeout 120 python3 fp8_yt_design_ab.py "$out/${d}_fp8_yt_design_ab_$commit.json"
  timeout 130 python3 fp8_sweep7.py "$out/${d}_sweep7_fp8_bf16_$commit.json" 100 bfloat16
  timeout 230 python3 fp8_sweep8.py "$out/${d}_sweep8_fp8_bf16_$commit.json" 200 bfloat16
  cd ..
  timeout 100 python3 -m pallas_norm.bench --ops fp8 --shapes 8192x4096,16384x4096,8192x8192,32768x2048 \
    --impls pallas,xla --iters 30 --check --out "$out/${d}_fp8_$commit.json"
  ;;
fp8in)
  cd benchmarks
  timeout 150 python3 fp8_x_vector_ab.py "$out/${d}_fp8_x_vector_ab_$commit.json"
  timeout 150 python3 fp8_input_wide_modes.py "$out/${d}_fp8in_wide_modes_$commit.json"
  timeout 150 python3 fp8_input_bwd_sweep.py "$out/${d}_fp8in_bwd_occupancy_bf16_$commit.json" --occupancy --bf16-params
  N16384=1 timeout 110 python3 fp8_input_fwd_ab.py "$out/${d}_fp8in_fwd_ab_16384_bf16_$commit.json" bf16
  ;;
fp8in-bench)
  cd benchmarks
  timeout 200 python3 fp8_input_bwd_sweep.py "$out/${d}_fp8in_bwd_occupancy_widths_bf16_$commit.json" --occupancy-widths --bf16-params
  cd ..
  timeout 200 python3 -m pallas_norm.bench --ops fp8in --shapes 8192x4096,16384x4096,8192x8192,32768x2048,4096x16384 \
    --impls pallas,xla --iters 30 --check --out "$out/${d}_fp8in_$commit.json"
  ;;
rules)
  for rules in ${RULES:-h200 h100 h200 h100}; do  # alternated twice: drift shows
    timeout 140 python3 - "$rules" "$out/${d}_rules_${rules}_$commit" <<'PY'
import os, sys
from pallas_norm import config as C
rules, out = sys.argv[1], sys.argv[2]
if rules == "h100":  # every rule keyed on "H100" in the device's name applies, none on "H200"
  cached = C._device_info_cached
  C._device_info_cached = lambda p, name, cores: cached(
      p, "NVIDIA H100 80GB HBM3 (the H100's rules; run on " + name.replace("H200", "H-200") + ")",
      cores)
n = 1 + sum(os.path.exists(f"{out}_{i}.json") for i in range(1, 3))
from pallas_norm.bench import cli
sys.exit(cli.main(["--ops", "fp8,fp8in,layer_res", "--shapes", "8192x4096,16384x4096,4096x8192",
                   "--impls", "pallas", "--iters", "30", "--check", "--out", f"{out}_{n}.json"]))
PY
  done
  ;;
*) echo "unknown PART $part (res | res-quick | fp8out | fp8in | fp8in-bench | rules)"; exit 2;;
esac
echo "done: $(date -u)"
