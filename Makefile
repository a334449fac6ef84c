# pallas_norm: the two README commands are `make demo` and `make test`.
# Each sets up its own virtualenv (.venv) from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test demo bench bench-e2e gpu-check clean venv tune

$(VENV)/.stamp-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(VENV)/.stamp-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

venv: $(VENV)/.stamp-test

# CPU test suite: Pallas interpret mode + the Triton interpreter + the notebooks, and
# the sharding tests in a process of their own on 8 fake CPU devices.
# Each of the three runs on TEST_WORKERS pytest-xdist workers (2: CI's cores).
# XLA's CPU backend compiles the interpret-mode kernels (loops over the grid) without
# LLVM's expensive optimisations: about a third less time over the suite, and no
# fast-math either way; but with LLVM's optimisations the LayerNorm amax of
# tests/test_fp8_output.py::test_delayed_transpose_separately moved by one float32 ulp
# between two interpret-mode programs that the GPU gives bitwise equal (2026-11-27). CPU
# only: gpu-check does not set it; tests/conftest.py sets the same flags when pytest runs
# without them (tests/test_conftest.py). (XLA's excess
# precision stays allowed: interpret mode then drops a Pallas kernel's round trip
# through a narrower dtype, tests/test_cast.py::test_llama_dscale_sums_the_rounded_x_hat;
# turning it off moved an FP8 amax by one float32 ulp between two kernels that the GPU
# gives bitwise equal, tests/test_fp8_output.py::test_chunked_kernels, 2026-11-26.)
CPU_TEST_FLAGS = --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
TEST_ENV = TRITON_INTERPRET=1 XLA_FLAGS="$$XLA_FLAGS $(CPU_TEST_FLAGS)"
SHARDED_ENV = PALLAS_NORM_SHARDED=1 TRITON_INTERPRET=1 \
  XLA_FLAGS="$$XLA_FLAGS $(CPU_TEST_FLAGS) --xla_force_host_platform_device_count=8"
TEST_WORKERS ?= 2
# tests/multihost (jax.distributed: 2 processes x 4 CPU devices, in subprocesses of their
# own) runs in the first line. Its process pairs run once a pytest run, one pair at a
# time, whichever worker asks first (tests/conftest.py's run_once): --dist loadgroup
# does not keep its tests on one worker with pytest 9.2 and pytest-xdist 3.8 (the
# xdist_group marks are ignored: a 6-test module marked with one group ran on both
# workers, 2026-11-28); the flag stays for versions where it works.
test: $(VENV)/.stamp-test
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) tests
	$(SHARDED_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS) tests/sharded
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --nbmake --nbmake-timeout=600 notebooks

# The main job: a jax.jit training loop of a Flax model on real text (CPU by default).
demo: $(VENV)/.stamp-demo
	$(PY) -m pallas_norm.demo $(DEMO_ARGS)

# GPU machine only (no network): its own python3 with preinstalled jax/flax/torch,
# plus the wheels that ../shared/tools/device-wheels.sh put in .whl/.
GPU_SITE ?= /tmp/pallas_norm_site
define gpu_env
if ls .whl/*.whl >/dev/null 2>&1; then \
  $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl; fi; \
export PYTHONPATH=$(CURDIR):$(GPU_SITE):$(CURDIR)/.whl/stubs:$$PYTHONPATH; \
export XLA_PYTHON_CLIENT_PREALLOCATE=$${XLA_PYTHON_CLIENT_PREALLOCATE:-false};
endef

# With two or more GPUs, the sharding tests run on them too. The single-GPU part in one
# process outlasts a 10-minute device command (on an H200, pytest over all but the
# Mosaic GPU test files got through about a quarter of them before a 330 s timeout:
# h200_2026-11-26_gpu-check_rest_partial_b48c78c.log); with pytest-xdist (its wheels and
# execnet's in .whl: pip download pytest-xdist execnet --no-deps -d .whl),
#   XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q --gpu -n 8 tests
# (gpu_env sets that variable: with it unset, 8 workers preallocating ran an H100 out of
# memory at collection, 2026-11-27) took 5 min 54 s on an H200 (2026-11-26; benchmarks/README.md), tests/sharded then
# run as below, without -n. The tests marked bigmem (arrays past 2**31 elements, ~26 GiB
# each) run afterwards in a process of their own: beside xdist workers, which keep the
# memory they took, they ran an 80 GB H100 out of memory, on one worker as well
# (h100_2026-11-26_gpu-check_a0ff217.log, h100_2026-11-26_gpu-check_d2e5616.log).
gpu-check:
	$(gpu_env) $(PYTHON) -m pytest -q -p no:cacheprovider --gpu $(PYTEST_ARGS) -m "not bigmem" tests
	$(gpu_env) $(PYTHON) -m pytest -q -p no:cacheprovider --gpu -m bigmem tests
	@if [ "$$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then \
	  $(gpu_env) PALLAS_NORM_SHARDED=1 $(PYTHON) -m pytest -q -p no:cacheprovider --gpu \
	    $(PYTEST_ARGS) tests/sharded; \
	else echo "gpu-check: one GPU, tests/sharded not run (needs >= 2)"; fi

bench:
	$(gpu_env) XLA_FLAGS="$$XLA_FLAGS --xla_gpu_enable_command_buffer=" $(PYTHON) -m pallas_norm.bench $(BENCH_ARGS)

# The shipped tuning table of this GPU (docs/tuning.md): the tuner over the table's grid,
# resumed where the last run stopped; run it until it says no key is left.
tune:
	$(gpu_env) $(PYTHON) -m pallas_norm.tune --preset table --shipped --no-progress $(TUNE_ARGS)

# The end-to-end train-step benchmark (docs/e2e.md); XLA's default flags, as training runs.
bench-e2e:
	$(gpu_env) $(PYTHON) -m pallas_norm.bench --e2e $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
