"""Shared pytest setup.

``--gpu`` (used by ``make gpu-check``) requires a CUDA GPU, runs the kernels with
``interpret=False``, enables the tests marked ``gpu`` and skips those marked ``cpu_only``.
Without it, the ``gpu`` tests are reported as skipped (never as passes) and everything runs
in interpret mode (Pallas) or Triton's interpreter (plain Triton).
"""

import fcntl
import os

import pytest

# tests/sharded needs several devices, set before jax is imported: it runs in its own
# process (``make test``: PALLAS_NORM_SHARDED=1 and 8 fake CPU devices; ``make gpu-check``
# on two or more GPUs).
collect_ignore = [] if os.environ.get("PALLAS_NORM_SHARDED") == "1" else ["sharded"]

# The Makefile's CPU_TEST_FLAGS (kept equal: tests/test_conftest.py checks it).
CPU_TEST_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def pytest_addoption(parser):
  parser.addoption("--gpu", action="store_true", default=False,
                   help="run on a CUDA GPU with interpret=False, plus the gpu-only tests")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (make gpu-check)")
  config.addinivalue_line("markers", "cpu_only: only meaningful in interpret mode on CPU")
  if config.getoption("--gpu"):
    import jax
    if jax.default_backend() != "gpu":
      raise pytest.UsageError(f"--gpu given but jax.default_backend()={jax.default_backend()!r}")
  else:
    # The plain-Triton kernels run in Triton's interpreter on CPU; this must be set before
    # triton is imported. On the GPU it must not be: jax-triton needs compiled kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The XLA flags `make test` sets for the interpret-mode kernels (Makefile,
    # CPU_TEST_FLAGS: no LLVM optimisation), so that `pytest tests`
    # alone runs what `make test` runs: with LLVM's optimisations on, two interpret-mode
    # programs that the GPU gives bitwise equal differed by a float32 ulp
    # (test_fp8_output.py::test_delayed_transpose_separately's LayerNorm amax, 2026-11-27).
    # XLA reads the variable when jax makes its CPU client, after this hook.
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_TEST_FLAGS:
      if flag.split("=")[0] not in flags:
        flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def pytest_collection_modifyitems(config, items):
  if config.getoption("--gpu"):
    skip_cpu = pytest.mark.skip(reason="CPU-only (Triton interpreter / no-GPU behaviour)")
    # bigmem tests (~26 GiB arrays) beside other pytest-xdist workers run the GPU out of
    # memory (Makefile, gpu-check): under xdist they are skipped, naming the command that
    # runs them alone (make gpu-check does, after the rest).
    skip_big = pytest.mark.skip(reason="bigmem: run alone, not beside xdist workers: "
                                       "pytest --gpu -m bigmem tests (make gpu-check does)")
    under_xdist = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    for item in items:
      if "cpu_only" in item.keywords:
        item.add_marker(skip_cpu)
      if under_xdist and "bigmem" in item.keywords:
        item.add_marker(skip_big)
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make gpu-check` on the GPU machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def on_gpu(pytestconfig):
  return bool(pytestconfig.getoption("--gpu"))


@pytest.fixture
def call_main(capsys):
  """call_main(main, *argv) -> (exit code, stdout, stderr): a command line's ``main``
  run in this process (an argparse exit gives its code)."""
  def call(main, *argv):
    try:
      rc = main(list(argv))
    except SystemExit as e:
      rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
  return call


# Subprocess runs that several tests read (tests/multihost, test_demo_sharded.py): once
# per pytest run, whatever the xdist workers.
@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
  """``run_once(name, compute)``: the folder that ``compute(folder)`` filled, computed once
  for the whole pytest run. Under pytest-xdist every worker may ask (a module-scoped
  fixture ran on both workers, its tests being split between them: tests/multihost's
  process pairs twice, 327 s of setup, 2026-11-28), so the workers share the folder
  under one file lock: the first computes, the others wait asleep and read it; and no
  two of these runs go side by side (tests/multihost's gloo collectives wait spinning,
  which on CI's 2 cores slows both)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this run

  def run(name, compute):
    folder = root / f"run_once_{name}"
    with open(root / "run_once.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        if not (folder / "done").exists():
          folder.mkdir(exist_ok=True)
          compute(folder)
          (folder / "done").touch()
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
    return folder

  return run
