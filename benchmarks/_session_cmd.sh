set -u
C=${1:?commit}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu x $(nvidia-smi -L | wc -l)"
case "$gpu" in *H200*) bash benchmarks/h200_pending.sh res-quick $OUT/h200 $C ;; esac
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/stubs PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_NORM_GIT_COMMIT=$C
tag=$(case "$gpu" in *H200*) echo h200x2;; *) echo h100x2;; esac)_$(date -u +%F)
L=$OUT/${tag}_gpu-check_sharded_$C.log
( time PALLAS_NORM_SHARDED=1 timeout 300 python3 -m pytest -q -p no:cacheprovider --gpu tests/sharded ) > $L 2>&1; echo "rc=$?" >> $L
tail -4 $L
